"""Tiny random Hugging Face checkpoints written with `save_pretrained`, for parity tests."""
from __future__ import annotations

import numpy as np
import pytest

NEEDS_TORCH = "the transformers parity references need torch: pip install -e '.[test]'"

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2)

# name -> (transformers config class name, overrides, save_pretrained kwargs)
CASES = {
    "llama-gqa-llama3rope-tied": ("LlamaConfig", dict(
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}), {}),
    "llama-mha-linearrope": ("LlamaConfig", dict(
        num_key_value_heads=4, rope_scaling={"rope_type": "linear", "factor": 2.0}), {}),
    "qwen2-bias-sharded": ("Qwen2Config", dict(tie_word_embeddings=False),
                           {"max_shard_size": "40KB"}),
    "qwen3-qknorm-headdim48": ("Qwen3Config", dict(head_dim=48, tie_word_embeddings=True), {}),
    "mistral": ("MistralConfig", dict(sliding_window=4096), {}),
}


def build(name: str, path, seed: int = 0, **overrides):
    """Save case `name` to `path`; returns the fp32 torch model (eval mode)."""
    torch = pytest.importorskip("torch", reason=NEEDS_TORCH)
    import transformers

    cls_name, case_kw, save_kw = CASES[name]
    cfg = getattr(transformers, cls_name)(**{**TINY, **case_kw, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # HF's 0.02 init gives near-uniform logits; spread them out
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(str(path), **save_kw)
    return model


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
    torch = pytest.importorskip("torch", reason=NEEDS_TORCH)

    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()
