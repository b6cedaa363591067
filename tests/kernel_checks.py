"""Helpers for kernel tests: a tight per-row error metric, a CUDA lowering check and the fp8
cache's quantization (each kernel's fp8 tests run natively with `pytest --gpu -k fp8`)."""
import jax
import jax.numpy as jnp
import numpy as np


def max_row_rel_error(out, ref) -> float:
    """max over rows of ||out_row - ref_row|| / ||ref_row|| (last axis is the row)."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    num = np.linalg.norm((out - ref).reshape(-1, ref.shape[-1]), axis=-1)
    den = np.linalg.norm(ref.reshape(-1, ref.shape[-1]), axis=-1)
    return float(np.max(num / np.maximum(den, 1e-30)))


def lower_for_cuda(fn, *args):
    """Lower `fn(*args)` for CUDA on any machine.

    Runs the whole Pallas -> Triton lowering (where unsupported primitives such as sort
    fail), without needing a GPU. Compiling Triton IR to PTX still needs the device.
    Returns the StableHLO text.
    """
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), args)
    exp = jax.export.export(
        jax.jit(fn),
        platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*shapes)
    return exp.mlir_module()


E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
# Round to nearest with 3 mantissa bits: |x - q(x)| <= 2^-4 |x| for normals; below the
# smallest normal (2^-6) the spacing is the subnormals' fixed 2^-9.
E4M3_REL, E4M3_SUBNORMAL_STEP = 2.0**-4, 2.0**-9


def _quantize_kv_here(x):
    """The quantization of the fp8 cache's contract, over the last axis: scale =
    max(absmax / 448, tiny), x_fp8 = round-to-nearest of x / scale."""
    x = jnp.asarray(x, jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(x), axis=-1) / E4M3_MAX, jnp.finfo(jnp.float32).tiny)
    return (x / scale[..., None]).astype(jnp.float8_e4m3fn), scale


try:  # the runtime's quantizer, where it exists
    from sparsejax.cache import quantize_kv
except ImportError:
    quantize_kv = _quantize_kv_here


def fp8_cache(k_pages, v_pages, dtype):
    """The cache quantized per (page, KV head, slot) -> (dict(k_pages, v_pages, k_scale,
    v_scale) of the fp8 cache, (k, v) that cache dequantized to `dtype`). The kernels' dots
    take the fp8 values exactly and fold the scales into the f32 logits and probabilities,
    so a kernel on the fp8 cache matches the reference on it (f32 dequantization) at the
    16-bit tolerances; the reference on the second differs by `dtype`'s rounding of K and
    V."""
    k, k_scale = quantize_kv(k_pages)
    v, v_scale = quantize_kv(v_pages)
    from sparsejax.pallas_kernels.common import dequantize
    return (dict(k_pages=k, v_pages=v, k_scale=k_scale, v_scale=v_scale),
            (dequantize(k, k_scale, dtype), dequantize(v, v_scale, dtype)))


# What rounding a dequantized K/V value to q's dtype moves it by, relative (unit roundoff).
ROUNDOFF = {jnp.dtype(jnp.bfloat16): 2.0**-8, jnp.dtype(jnp.float16): 2.0**-11,
            jnp.dtype(jnp.float32): 0.0}


def fp8_lse_bound(q, k_deq, sm_scale) -> float:
    """How far an LSE over an fp8 cache's K dequantized to q's dtype may sit from one over K
    dequantized in f32: q's dtype rounds each K element by ROUNDOFF relative, moving a
    logit by at most ROUNDOFF * sm_scale * |q| |k| (Cauchy-Schwarz), an LSE by at most the
    largest such move. NaN (never-written) slots are left out."""
    roundoff = ROUNDOFF[jnp.dtype(q.dtype)]
    q = np.asarray(q, np.float64)
    k = np.nan_to_num(np.asarray(k_deq, np.float64), nan=0.0)
    return roundoff * sm_scale * np.linalg.norm(q, axis=-1).max() * np.linalg.norm(k, axis=-1).max()
