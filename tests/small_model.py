"""The small random Llama and ragged prompts that the method and RESA tests share (its
module-scoped fixtures `model` and `prompts` are registered in conftest.py)."""
import jax
import numpy as np
import pytest

import sparsejax
from sparsejax.models import ModelConfig, init_params

CFG = ModelConfig(model_type="llama", vocab_size=101, hidden_size=64, num_layers=6, num_heads=4,
                  num_kv_heads=2, head_dim=16, intermediate_size=96)
LENGTHS = np.array([150, 200, 93], np.int32)
RETRIEVAL = np.array([[1, 1], [0, 1], [1, 0], [0, 0], [0, 1], [1, 0]], bool)


def make_model() -> sparsejax.Model:
    return sparsejax.Model(CFG, init_params(CFG, jax.random.key(0), std=0.1))


def make_prompts() -> np.ndarray:
    """Right-padded random prompts of LENGTHS."""
    rng = np.random.default_rng(0)
    ids = np.zeros((3, LENGTHS.max()), np.int32)
    for i, n in enumerate(LENGTHS):
        ids[i, :n] = rng.integers(0, CFG.vocab_size, n)
    return ids


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def prompts():
    return make_prompts()
