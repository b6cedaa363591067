"""Compiles and wall time of `LLM.generate` over prompts of many lengths, one at a time:
length buckets (one compile per bucket) against a compile per prompt length.

    python benchmarks/bench_buckets.py                  # CPU, the embedded model (~10 min)
    python benchmarks/bench_buckets.py --prompts 8      # shorter

The embedded model (max_position_embeddings 4112) answers `--prompts` retrieval prompts of
lengths drawn uniformly from [--min-length, --max-length] (train/data.py tasks in turn), each
in its own `generate` call of `--max-tokens` greedy tokens with `--method` at 10% of the
context:
- buckets: `LLM.generate` as shipped: prompts padded to `bucket_length`, the method at the
  bucket's budget, one compiled program per bucket;
- per_length: what `LLM.generate` did before buckets: no padding, the method at the prompt's
  own budget, so every new length compiles.
Each arm starts from empty caches (`jax.clear_caches`). Counted per arm: programs compiled for
`generate` (its jit cache), all XLA backend compiles and their seconds (`jax.monitoring`), the
wall time of the calls, and the answers that are right (`buckets_touched` of per_length
counts the distinct prompt widths). Writes results/buckets_<backend>.json.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import write_results  # noqa: E402

import sparsejax  # noqa: E402
from sparsejax.generate import _generate  # noqa: E402
from sparsejax.train import data  # noqa: E402

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """XLA backend compiles (count, seconds) while registered."""

    def __init__(self):
        self.count, self.seconds = 0, 0.0
        jax.monitoring.register_event_duration_secs_listener(self)

    def __call__(self, event, duration, **_):
        if event == COMPILE_EVENT:
            self.count += 1
            self.seconds += duration


def run_arm(llm, samples, arm: str, max_tokens: int, counter: CompileCounter) -> tuple[dict, list]:
    jax.clear_caches()
    programs, compiles, compile_s = _generate._cache_size(), counter.count, counter.seconds
    params = sparsejax.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    rows, t0 = [], time.perf_counter()
    for sample in samples:
        ids = sample.input_ids.tolist()
        before, start = _generate._cache_size(), time.perf_counter()
        if arm == "buckets":
            tokens = llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids
        else:   # the pre-bucket LLM.generate: exact width, the method at the prompt's length
            out = sparsejax.generate(llm.model, np.asarray([ids], np.int32),
                                     max_new_tokens=max_tokens, method=llm.method_for(len(ids)),
                                     pad_to_bucket=False)
            tokens = np.asarray(out.tokens[0, :int(out.num_generated[0])]).tolist()
        seconds = time.perf_counter() - start
        answer = sample.answer_ids.tolist()
        rows.append({"arm": arm, "prompt_tokens": len(ids),
                     "bucket": sparsejax.bucket_length(len(ids)) if arm == "buckets" else len(ids),
                     "compiled": _generate._cache_size() > before, "seconds": round(seconds, 3),
                     "correct": tokens[:len(answer)] == answer})
        print(f"{arm:>10} {len(ids):>5} tokens -> {rows[-1]['bucket']:>5}: "
              f"{seconds:6.2f} s{' (compiled)' if rows[-1]['compiled'] else ''}", flush=True)
    summary = {"arm": arm, "prompts": len(samples),
               "buckets_touched": len({r["bucket"] for r in rows}),
               "generate_programs_compiled": _generate._cache_size() - programs,
               "xla_compiles": counter.count - compiles,
               "xla_compile_seconds": round(counter.seconds - compile_s, 1),
               "wall_seconds": round(time.perf_counter() - t0, 1),
               "correct": sum(r["correct"] for r in rows)}
    print(summary, flush=True)
    return summary, rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--min-length", type=int, default=64)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--method", default="delta")
    p.add_argument("--dtype", default="float32", help='"auto" is the checkpoint\'s (bf16)')
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--note", default="", help="what else ran on the machine, if anything")
    args = p.parse_args(argv)
    llm = sparsejax.LLM(sparsejax.embedded_model_path(), method=args.method,
                        dtype=args.dtype if args.dtype == "auto" else jnp.dtype(args.dtype))
    limit = llm.model.config.max_position_embeddings - args.max_tokens
    if args.max_length > limit:
        raise SystemExit(f"--max-length {args.max_length}: the embedded model takes {limit} "
                         f"prompt tokens with --max-tokens {args.max_tokens}")
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.min_length, args.max_length + 1, args.prompts)
    samples = [data.make_sample(data.TASKS[i % len(data.TASKS)], int(n), args.seed, i)
               for i, n in enumerate(lengths)]
    counter = CompileCounter()
    summaries, rows = [], []
    for arm in ("buckets", "per_length"):
        summary, arm_rows = run_arm(llm, samples, arm, args.max_tokens, counter)
        summaries.append(summary)
        rows += arm_rows
    device = jax.default_backend()
    path = write_results(f"buckets_{device}", summaries + rows, method=args.method,
                         dtype=str(llm.model.dtype), max_tokens=args.max_tokens,
                         lengths=[args.min_length, args.max_length],
                         note="per_length is LLM.generate before length buckets. " + args.note)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
