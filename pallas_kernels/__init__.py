"""Pallas (Triton) GPU kernels, each beside its plain-jnp reference.

`backend="auto"` runs the Pallas kernel on GPU and the reference elsewhere; dense bf16/f16
prefill chunks of 512+ queries take cuDNN on a GPU (`prefill_attention.CUDNN_MIN_CHUNK`).
Every paged kernel also reads an fp8 (float8_e4m3fn) cache given its `k_scale`/`v_scale`
(`common.check_kv_scales`, `common.dequantize`), which `write_tokens` writes into the pages
(`common.quantize`).
"""
from .cache_write import (rope_and_write, rope_and_write_reference, write_tokens,
                          write_tokens_reference)
from .decode_attention import (DecodeAttention, LogitRows, paged_decode_attention,
                               paged_decode_attention_reference, pool_logit_rows)
from .page_bound import quest_page_bound, quest_page_bound_reference
from .prefill_attention import (PrefillAttention, paged_prefill_attention,
                                paged_prefill_attention_reference, paged_tile_scores,
                                paged_tile_scores_reference)
from .sparse_attention import (SparseAttention, sparse_decode_attention,
                               sparse_decode_attention_reference)
from .topk import (Selected, fixed_budget, ratio_budget, threshold_budget, top_p_budget,
                   topk_select, topk_select_reference)

__all__ = [
    "DecodeAttention", "LogitRows", "PrefillAttention", "Selected", "SparseAttention",
    "fixed_budget",
    "paged_decode_attention", "paged_decode_attention_reference", "paged_prefill_attention",
    "paged_prefill_attention_reference", "paged_tile_scores", "paged_tile_scores_reference",
    "pool_logit_rows", "quest_page_bound", "quest_page_bound_reference", "ratio_budget",
    "rope_and_write", "rope_and_write_reference", "sparse_decode_attention",
    "sparse_decode_attention_reference", "threshold_budget", "top_p_budget", "topk_select",
    "topk_select_reference", "write_tokens", "write_tokens_reference",
]
