"""GGUF files (llama.cpp's format) -> `Model`, through the `gguf` package's reader and
dequantizers.

Reads the config from the file's metadata, dequantizes every tensor to float32
(`gguf.quants.dequantize`), renames llama.cpp's tensors to Hugging Face's and undoes the row
permutation llama.cpp's converter applies to the query and key projections of llama
checkpoints (its `LlamaModel.permute`; transformers' `LlamaTensorProcessor` undoes it the same
way), then maps them onto the decoder's layout with `loading.params_from_tensors`. The
tokenizer is transformers' conversion of the file's vocabulary (`AutoTokenizer` with
`gguf_file=`).
"""
from __future__ import annotations

import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from .config import ModelConfig

ARCHITECTURES = ("llama", "qwen2", "qwen3")
# tensor types read (the float ones, and the quantizations gguf dequantizes in numpy)
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
SUFFIX = ".gguf"

_TOP = {"token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(SUFFIX)


def gguf_in(directory: Path) -> Path | None:
    """The one .gguf file of a directory that holds no config.json; None where it holds none;
    an error naming them where it holds several."""
    if (directory / "config.json").exists():
        return None
    files = sorted(directory.glob(f"*{SUFFIX}"))
    if len(files) > 1:
        raise ValueError(f"{directory} holds {len(files)} GGUF files "
                         f"({', '.join(f.name for f in files)}): pass the path of one")
    return files[0] if files else None


def _reader(path: Path):
    import gguf

    if not path.is_file():
        raise ValueError(f"{path} does not exist or is not a file: expected a GGUF file")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:   # struct errors, ValueError for a short buffer, bad magic, ...
        raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}): "
                         "truncated or damaged?") from None
    # the reader maps tensors lazily; a truncated file's last tensor ends past the file's end
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > path.stat().st_size:
        raise ValueError(f"{path} is truncated: its tensors need {end} bytes, the file has "
                         f"{path.stat().st_size}")
    return reader


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_config(reader, path: Path) -> ModelConfig:
    """The `ModelConfig` the metadata of a GGUF file describes."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path} has general.architecture={arch!r}: expected one of "
                         f"{ARCHITECTURES}")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"{path} holds rope_freqs.weight (per-frequency RoPE factors, as "
                         "llama.cpp stores Llama 3.1's rope scaling): not supported")

    def meta(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    heads = meta("attention.head_count")
    hidden = meta("embedding_length")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    d = {
        "model_type": arch,
        "vocab_size": meta("vocab_size", len(tokens) if tokens is not None else None),
        "hidden_size": hidden,
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads),
        "head_dim": meta("attention.key_length",
                         None if heads is None or hidden is None else hidden // heads),
        "intermediate_size": meta("feed_forward_length"),
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta("rope.freq_base", 10000.0),
        "max_position_embeddings": meta("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    scaling = meta("rope.scaling.type", "none")
    if scaling == "linear":
        d["rope_scaling"] = {"rope_type": "linear", "factor": meta("rope.scaling.factor")}
    elif scaling != "none":
        raise ValueError(f"{path} has {arch}.rope.scaling.type={scaling!r}: expected 'none' or "
                         "'linear'")
    missing = [k for k, v in d.items() if v is None and k not in ("bos_token_id",
                                                                  "eos_token_id")]
    if missing:
        raise ValueError(f"{path} lacks the metadata for {missing} (architecture {arch})")
    try:
        return ModelConfig.from_hf_dict(d)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name (None for an unknown one)."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of a query or key projection's rows (weight or bias): within
    each head, rows (pair, half) back to (half, pair) — its rotary layout to HF's."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def dequantize(tensor, path: Path) -> np.ndarray:
    """One reader tensor as float32 in its logical shape ([rows, cols], HF's [out, in])."""
    import gguf

    kind = tensor.tensor_type.name
    if kind not in TENSOR_TYPES:
        raise ValueError(f"{path}: tensor {tensor.name!r} has type {kind}: expected one of "
                         f"{TENSOR_TYPES}")
    w = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape))     # GGUF lists ne0 (columns) first
    return np.asarray(w, np.float32).reshape(shape)


def read_tensors(reader, config: ModelConfig, path: Path) -> dict[str, np.ndarray]:
    """HF name -> float32 tensor, llama's Q/K permutation undone. Unknown names are an error."""
    unknown = [t.name for t in reader.tensors if hf_name(t.name) is None]
    if unknown:
        raise ValueError(f"{path} has tensors a {config.model_type} decoder does not use: "
                         f"{unknown[:8]}{' ...' if len(unknown) > 8 else ''}")
    out = {}
    for t in reader.tensors:
        w = dequantize(t, path)
        if config.model_type == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
            w = unpermute(w, config.num_heads if ".attn_q." in t.name else config.num_kv_heads)
        out[hf_name(t.name)] = w
    return out


def load_gguf(path: str | Path, *, dtype=jnp.bfloat16, check_finite: bool = True):
    """A `Model` from a llama, qwen2 or qwen3 GGUF file, its tensors dequantized."""
    from .decoder import Model
    from .loading import params_from_tensors

    path = Path(path)
    reader = _reader(path)
    config = read_config(reader, path)
    tensors = read_tensors(reader, config, path)
    params = params_from_tensors(lambda name: (tensors[name], str(path)), tensors, config,
                                 dtype, source=str(path), check_finite=check_finite)
    return Model(config=config, params=params)


def load_gguf_tokenizer(path: str | Path):
    """The file's tokenizer, as transformers converts a GGUF vocabulary."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} does not exist or is not a file: expected a GGUF file")
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                             local_files_only=True)
    except Exception as e:   # the reader's errors for a damaged file have no common base
        raise ValueError(f"the tokenizer in {path} cannot be loaded ({type(e).__name__}: {e}): "
                         "truncated or damaged?") from None


__all__ = ["ARCHITECTURES", "TENSOR_TYPES", "gguf_in", "hf_name", "is_gguf", "load_gguf",
           "load_gguf_tokenizer", "read_config", "read_tensors", "unpermute"]
