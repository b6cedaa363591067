"""sparsejax: sparse long-context decoding in JAX over a paged KV cache.

    model = sparsejax.from_pretrained("path/to/hf-checkpoint")      # or a Hub id
    out = sparsejax.generate(model, ids, lengths=lengths, max_new_tokens=64,
                             method=sparsejax.methods.DELTA())
    sparsejax.LLM("path/to/hf-checkpoint", method="delta").generate(["..."])   # text to text
"""
from pathlib import Path

from sparsejax import methods
from sparsejax.cache import PagedKVCache
from sparsejax.generate import (GenerateOutput, Sampling, compile_generate, decode_step, generate,
                                prefill, sample)
from sparsejax.llm import LLM
from sparsejax.models import (Model, ModelConfig, from_pretrained, load_tokenizer, logits,
                              real_model_path, save_pretrained)
from sparsejax.plan import Budget, Role, Score, Selection, Selector, SparsePlan
from sparsejax.sharding import allocate, shard

__version__ = "0.1.0"

EMBEDDED_MODEL = "retrieval-tiny"


def embedded_model_path() -> Path:
    """Directory of the small retrieval model shipped with the package (HF format)."""
    from sparsejax import models as _models

    return Path(_models.__file__).resolve().parent / "assets" / EMBEDDED_MODEL


__all__ = [
    "Budget", "GenerateOutput", "LLM", "Model", "ModelConfig", "PagedKVCache", "Role", "Sampling",
    "Score", "Selection", "Selector", "SparsePlan", "allocate", "compile_generate", "decode_step",
    "embedded_model_path",
    "from_pretrained", "generate", "load_tokenizer", "logits", "methods", "prefill",
    "real_model_path", "sample",
    "save_pretrained", "shard",
]
