"""sparsejax: sparse long-context decoding in JAX over a paged KV cache.

    model = sparsejax.from_pretrained("path/to/hf-checkpoint")      # or a Hub id
    out = sparsejax.generate(model, ids, lengths=lengths, max_new_tokens=64,
                             method=sparsejax.methods.DELTA())
    llm = sparsejax.LLM("path/to/hf-checkpoint", method="delta")                # text to text
    llm.generate(["..."], sparsejax.SamplingParams(max_tokens=64))[0].outputs[0].text

A method left without layer choices (`methods.DELTA()`) takes the paper's, scaled to the
model's depth; `LLM`'s methods attend to a share of each prompt's own length.
"""
from pathlib import Path

from sparsejax import files as _files

# Run as the command line (`sparsejax ...`, `python [OPTIONS] -m sparsejax ...`): Ctrl-C or
# SIGTERM while the imports below run ends the program cleanly, even when the parent left
# them ignored (see files.guard_startup). First, before the seconds of imports.
if _files.started_as_command():
    _files.guard_startup()

from sparsejax import methods  # noqa: E402
from sparsejax.cache import PagedKVCache
from sparsejax.generate import (GenerateOutput, Sampling, bucket_length, compile_generate,
                                decode_step, enable_compilation_cache, generate, max_batch, prefill,
                                sample)
from sparsejax.llm import LLM, CompletionOutput, Logprob, RequestOutput, SamplingParams
from sparsejax.models import (Model, ModelConfig, load_tokenizer, logits, real_model_path,
                              save_pretrained)
from sparsejax.plan import Budget, Role, Score, Selection, Selector, SparsePlan
from sparsejax.sharding import allocate, from_pretrained, shard

__version__ = "0.1.0"

EMBEDDED_MODEL = "retrieval-tiny"


def embedded_model_path() -> Path:
    """Directory of the small retrieval model shipped with the package (HF format)."""
    from sparsejax import models as _models

    return Path(_models.__file__).resolve().parent / "assets" / EMBEDDED_MODEL


__all__ = [
    "Budget", "CompletionOutput", "GenerateOutput", "LLM", "Logprob", "Model", "ModelConfig",
    "PagedKVCache", "RequestOutput", "Role", "Sampling", "SamplingParams", "Score", "Selection",
    "Selector", "SparsePlan", "allocate", "bucket_length", "compile_generate", "decode_step",
    "embedded_model_path", "enable_compilation_cache",
    "from_pretrained", "generate", "load_tokenizer", "logits", "max_batch", "methods", "prefill",
    "real_model_path", "sample",
    "save_pretrained", "shard",
]
