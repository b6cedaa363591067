"""Shared test configuration.

CPU by default. `pytest --gpu` (or `-m gpu`) on a CUDA machine runs the kernels natively
instead of in interpret mode; tests marked `gpu` are skipped without a GPU.
"""
import gc
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import pytest

jax.config.update("jax_enable_x64", False)
if jax.default_backend() == "gpu":
    # the f32 models' checks against transformers and the full forward hold at f32: XLA's
    # default on a GPU runs f32 dots as TF32 (the kernels set their own precision)
    jax.config.update("jax_default_matmul_precision", "highest")

# the `model` and `prompts` fixtures of the method and RESA tests
pytest_plugins = ["small_model"]


def pytest_addoption(parser):
    parser.addoption("--gpu", action="store_true", help="run Pallas kernels natively on the GPU")


def pytest_configure(config):
    if config.getoption("--gpu") and jax.default_backend() != "gpu":
        raise pytest.UsageError("--gpu given but jax sees no GPU")


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Drop each module's compiled executables when it ends. Every CPU executable keeps its
    JIT-compiled code mapped; the whole suite compiles enough of them to pass the kernel's
    limit on memory maps (vm.max_map_count, 65530 by default), where the next compile
    segfaults."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def interpret():
    """Interpret mode for Pallas kernels: True on CPU, False on a GPU."""
    return jax.default_backend() != "gpu"
