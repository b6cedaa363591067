"""ModelConfig: the static description of a decoder, read from a Hugging Face `config.json`.

Covers HF `model_type` llama, qwen2, qwen3 and mistral. Anything this decoder would compute
differently from transformers (another activation, MLP bias, partial rotary, an unknown rope
type, sliding-window layers) is refused with a ValueError that names the field.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
import warnings
from pathlib import Path
from typing import Any

import numpy as np

MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
ROPE_TYPES = ("default", "llama3", "linear")
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                   "intermediate_size")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    # (rope_type, ((key, value), ...)) — a hashable form of HF's rope_scaling / rope_parameters
    rope_scaling: tuple[str, tuple[tuple[str, float], ...]] = ("default", ())
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type={self.model_type!r}: expected one of {MODEL_TYPES}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r}: expected a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim}: RoPE needs an even head_dim")
        if self.rope_scaling[0] not in ROPE_TYPES:
            raise ValueError(f"rope_scaling type {self.rope_scaling[0]!r} is not supported: "
                             f"expected one of {ROPE_TYPES}")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r}: expected a finite number > 0")
        for name in ("max_position_embeddings", "sliding_window"):
            value = getattr(self, name)
            if (value is not None or name == "max_position_embeddings") and (
                    isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r}: expected a positive int")
        for name in ("tie_word_embeddings", "qkv_bias", "o_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: expected true or false")
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            ids = value if isinstance(value, tuple) else () if value is None else (value,)
            if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool)
                       and 0 <= i < self.vocab_size for i in ids):
                raise ValueError(f"{name}={value!r}: expected token ids in [0, "
                                 f"{self.vocab_size}) (the vocabulary), or none")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def rope_params(self) -> dict[str, float]:
        return dict(self.rope_scaling[1])

    def check_context(self, num_tokens: int) -> None:
        """Refuse contexts this decoder would get silently wrong (Mistral's sliding window);
        warn past max_position_embeddings: every RoPE type here is defined at any position, but
        the model never saw those positions in training."""
        if self.sliding_window is not None and num_tokens > self.sliding_window:
            raise ValueError(
                f"{self.model_type} uses sliding_window={self.sliding_window}, smaller than the "
                f"requested length {num_tokens}; sliding-window attention is not implemented, "
                f"so keep prompt + new tokens ≤ {self.sliding_window}")
        if num_tokens > self.max_position_embeddings:
            warnings.warn(f"{num_tokens} tokens (prompt + new tokens) exceed the model's "
                          f"max_position_embeddings={self.max_position_embeddings}; positions "
                          "past it were never trained and the output may degrade", stacklevel=3)

    # ---- HF config.json -------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        if not isinstance(d, dict):
            raise ValueError(f"config.json holds a {type(d).__name__}: expected a JSON object")
        model_type = d.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"config.json model_type={model_type!r} is not supported: "
                             f"expected one of {MODEL_TYPES}")
        missing = [k for k in REQUIRED_FIELDS if d.get(k) is None]
        if missing:
            raise ValueError(f"config.json is missing {missing}")
        for name in ("tie_word_embeddings", "attention_bias"):
            if d.get(name) is not None and not isinstance(d[name], bool):
                raise ValueError(f"config.json {name}={d[name]!r}: expected true or false "
                                 "(a JSON boolean, not a string)")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json hidden_act={act!r}: only 'silu' (SwiGLU) is supported")
        if d.get("mlp_bias", False):
            raise ValueError("config.json mlp_bias=True is not supported")
        if d.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"config.json partial_rotary_factor={d['partial_rotary_factor']} "
                             "is not supported (expected 1.0)")
        if d.get("pretraining_tp", 1) not in (1, None):
            raise ValueError(f"config.json pretraining_tp={d['pretraining_tp']} is not supported")
        num_heads = d["num_attention_heads"]
        hidden = d["hidden_size"]
        head_dim = hidden // num_heads if d.get("head_dim") is None else d["head_dim"]
        rope_theta, rope_scaling = _read_rope(d)
        sliding_window = None
        if model_type == "mistral":
            sliding_window = d.get("sliding_window")
        elif d.get("use_sliding_window", False):
            # Qwen2/3 apply the window only to layers >= max_window_layers; refuse rather than
            # approximate.
            raise ValueError(f"config.json use_sliding_window=True ({model_type}) is not supported")
        layer_types = d.get("layer_types")
        if layer_types and any(t != "full_attention" for t in layer_types):
            raise ValueError(f"config.json layer_types={sorted(set(layer_types))}: only "
                             "'full_attention' layers are supported")
        attention_bias = d.get("attention_bias") or False
        eos, pad = d.get("eos_token_id"), d.get("pad_token_id")
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=hidden,
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=(num_heads if d.get("num_key_value_heads") is None
                          else d["num_key_value_heads"]),
            head_dim=head_dim,
            intermediate_size=d["intermediate_size"],
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=d.get("tie_word_embeddings") or False,
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type == "llama" and attention_bias,
            qk_norm=model_type == "qwen3",
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            sliding_window=sliding_window,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=pad[0] if isinstance(pad, list) else pad,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        """The config of an HF `config.json`; errors name the file."""
        check_regular_file(path, MAX_JSON_BYTES)
        try:
            d = json.loads(Path(path).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        try:
            return cls.from_hf_dict(d)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json that transformers loads into the same architecture."""
        rope_type, params = self.rope_scaling
        d = {
            "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                               "qwen3": "Qwen3ForCausalLM",
                               "mistral": "MistralForCausalLM"}[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if rope_type == "default" else {"rope_type": rope_type,
                                                                  **dict(params)},
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
            else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.model_type in ("llama", "qwen3"):
            d["attention_bias"] = self.o_bias if self.model_type == "llama" else self.qkv_bias
        if self.model_type == "mistral":
            d["sliding_window"] = self.sliding_window
        return d


MAX_JSON_BYTES = 16 << 20    # a checkpoint's JSON files (config, index) are far smaller


def check_regular_file(path: str | Path, max_bytes: int | None = None) -> int:
    """The size of `path`, a regular file (symlinks followed); ValueError naming it when it is
    missing, a device or FIFO (reading one blocks or never ends), or larger than `max_bytes`."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ValueError(f"{path} cannot be read: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path} is not a regular file (mode {stat.filemode(st.st_mode)}): "
                         "expected a checkpoint file")
    if max_bytes is not None and st.st_size > max_bytes:
        raise ValueError(f"{path} holds {st.st_size / 2**20:.1f} MiB: expected at most "
                         f"{max_bytes / 2**20:g} MiB for this file")
    return st.st_size


def _read_rope(d: dict[str, Any]) -> tuple[float, tuple[str, tuple[tuple[str, float], ...]]]:
    """rope theta and scaling from either HF layout: `rope_theta` + `rope_scaling` (transformers
    4.x) or `rope_parameters` (transformers 5.x).

    A config with both that disagree is refused: transformers 4 reads only `rope_scaling`, and
    transformers 5 lets a non-empty `rope_scaling` replace `rope_parameters` but takes
    `rope_theta` from elsewhere, so such a file describes different models to different readers.
    """
    given = {name: d[name] for name in ("rope_parameters", "rope_scaling") if d.get(name)}
    if not all(isinstance(p, dict) for p in given.values()):
        raise ValueError(f"config.json rope fields {given}: expected JSON objects")
    read = {name: _rope_fields(d, p) for name, p in given.items()}
    if len(read) == 2 and read["rope_parameters"] != read["rope_scaling"]:
        raise ValueError(
            f"config.json rope_parameters {given['rope_parameters']} and the legacy rope_scaling "
            f"{given['rope_scaling']} disagree (transformers 4 reads only rope_scaling, 5 "
            "prefers it): keep one of them")
    params = given.get("rope_scaling", given.get("rope_parameters", {}))
    theta, (rope_type, _) = _rope_fields(d, params)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"config.json rope_scaling type {rope_type!r} is not supported: "
                         f"expected one of {ROPE_TYPES}")
    keys = {"default": (), "linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings")}[rope_type]
    missing = [k for k in keys if k not in params]
    if missing:
        raise ValueError(f"config.json rope_scaling ({rope_type}) is missing {missing}")
    return theta, (rope_type, tuple((k, float(params[k])) for k in keys))


def _rope_fields(d: dict[str, Any], params: dict[str, Any]):
    """(theta, (type, other fields)) of one rope dict, for comparing the two layouts."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    rest = {k: v for k, v in params.items() if k not in ("rope_type", "type", "rope_theta")}
    return params.get("rope_theta", d.get("rope_theta", 10000.0)), (rope_type, rest)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] (float64), with llama3 or linear scaling applied."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rope_type = config.rope_scaling[0]
    p = config.rope_params
    if rope_type == "linear":
        return inv_freq / p["factor"]
    if rope_type == "llama3":
        factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old_len = p["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        return np.where(medium, smoothed, scaled)
    return inv_freq
