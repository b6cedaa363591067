"""The per-kernel byte counts a profile's floors are drawn from (`harness.hlo_op_costs`) and
their attribution to layers and parts (`profile_step.per_layer`)."""
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import harness  # noqa: E402
import profile_step  # noqa: E402
import shapes as S  # noqa: E402

import sparsejax  # noqa: E402


def _costs_by_scope(costs, pattern):
    return [c for c in costs.values() if re.search(pattern, c["op_name"])]


def test_shape_bytes():
    assert harness.shape_bytes("bf16[8,1536]{1,0}") == 8 * 1536 * 2
    assert harness.shape_bytes("(f32[4]{0}, s32[], f8e4m3fn[2,3]{1,0})") == 16 + 4 + 6
    assert harness.shape_bytes("pred[]") == 1


def test_operands_and_in_place_update():
    """A matmul moves its operands and result; writing a row into a donated buffer moves the
    row (read and written), not the buffer."""
    def f(cache, x, w, i):
        with jax.named_scope("layer3"):
            with jax.named_scope("mlp"):
                h = x @ w
            cache = jax.lax.dynamic_update_slice(cache, h[None], (i, 0, 0))
        return cache, h

    args = (jnp.zeros((64, 128, 256), jnp.float32), jnp.ones((128, 512), jnp.float32),
            jnp.ones((512, 256), jnp.float32), 3)
    text = jax.jit(f, donate_argnums=0).lower(*args).compile().as_text()
    costs = harness.hlo_op_costs(text)
    (dot,) = _costs_by_scope(costs, r"layer3/mlp/dot_general")
    assert dot["bytes"] == (128 * 512 + 512 * 256 + 128 * 256) * 4
    (write,) = _costs_by_scope(costs, r"layer3/dynamic_update_slice")
    assert write["bytes"] == 2 * (128 * 256 * 4 + 4)   # the row and its index
    # a whole-cache operand of a kernel can be charged a share instead (see `charge`)
    assert harness.hlo_op_costs(text, charge={64 * 128 * 256 * 4: 1}) == costs   # no custom call


def test_kernel_updating_its_operand_in_place():
    """A kernel whose output aliases an operand (the cache write) moves its other operands,
    read and written, and its other results, not the aliased buffer."""
    text = """ENTRY %main (p0: f32[1024,64], p1: bf16[4,64]) -> (f32[1024,64], bf16[4,64]) {
  %p0 = f32[1024,64]{1,0} parameter(0)
  %p1 = bf16[4,64]{1,0} parameter(1)
  ROOT %write.1 = (f32[1024,64]{1,0}, bf16[4,64]{1,0}) custom-call(%p1, %p0), custom_call_target="__gpu$xla.gpu.triton", output_to_operand_aliasing={{0}: (1, {})}, metadata={op_name="jit(f)/layer2/cache_write/pallas_call"}
}
"""
    (cost,) = harness.hlo_op_costs(text).values()
    assert cost["bytes"] == 2 * 4 * 64 * 2 + 4 * 64 * 2
    assert cost["op_name"].endswith("cache_write/pallas_call")


def test_per_layer_sums_kernels_by_layer_and_part():
    costs = {"a": dict(op="fusion", bytes=1000, op_name="jit(decode_step)/layer0/qkv/dot"),
             "b": dict(op="fusion", bytes=3000, op_name="jit(decode_step)/layer0/mlp/dot"),
             "c": dict(op="custom-call", bytes=5000,
                       op_name="jit(decode_step)/layer1/attention_dense/pallas_call"),
             "d": dict(op="fusion", bytes=7, op_name="jit(decode_step)/add")}
    by_op = {"a": (1.0, 0.002), "b": (2.0, 0.003), "c": (1.0, 0.010), "d": (1.0, 0.001),
             "sm90_gemm": (1.0, 0.004)}
    out = profile_step.per_layer(by_op, costs, "NVIDIA H100 80GB HBM3")
    assert out["bandwidth"] == 3.35e12
    cells = {(e["layer"], e["part"]): e for e in out["layers"]}
    assert set(cells) == {(0, "qkv"), (0, "mlp"), (1, "attention")}
    assert cells[0, "mlp"]["launches"] == 2.0 and cells[0, "mlp"]["bytes"] == 3000
    assert cells[1, "attention"]["floor_ms"] == pytest.approx(round(5000 / 3.35e12 * 1e3, 4))
    assert out["unattributed_ms"] == pytest.approx(0.005)   # "d" and the unnamed gemm
    assert sum(p["ms"] for p in out["parts"]) == pytest.approx(0.015)


def test_decode_step_kernels_name_their_layer_and_part():
    """Every layer of the compiled decode step has its q/k/v, K/V write, attention and MLP
    named, so that a GPU profile splits per layer."""
    model = S.random_model("tiny")
    config = model.config
    plan = sparsejax.plan.as_plan(S.method("dense", config, 256), config, None)
    cache = S.random_cache(config, plan, 2, 256, 8, jax.random.key(1))
    step = jax.jit(sparsejax.decode_step, static_argnames="plan", donate_argnums=1)
    text = step.lower(model, cache, jnp.zeros((2,), jnp.int32), plan=plan).compile().as_text()
    scopes = {(int(m.group(1)), m.group(2))
              for c in harness.hlo_op_costs(text).values()
              for m in [re.search(r"/layer(\d+)/([a-z_]+)", c["op_name"])] if m}
    for layer in range(config.num_layers):
        for part in ("qkv", "cache_write", "attention_dense", "mlp"):
            assert (layer, part) in scopes, (layer, part)
