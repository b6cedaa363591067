"""Command line: `sparsejax <command>` (also `python -m sparsejax`).

  generate     complete a prompt with any method, print tokens/s
  demo         the main job on the embedded default model (`make demo`)
  eval         task accuracy / recall / error per method (synthetic long-context tasks)
  pretrain     train a small retrieval model from scratch
  train-gates  train LycheeDecode's HardKuma head gates
  calibrate    DELTA layer-shift probe / Kascade anchor DP
"""
from __future__ import annotations

import argparse
import sys
import time


def _method_from_args(args, model):
    """Build the method named by --method with its options (and --resa) for this model."""
    from sparsejax import methods as M

    config = model.config
    name = args.method
    if name == "dense":
        method = M.Dense()
    elif name == "oracle":
        method = M.OracleTopK(k=args.budget) if args.budget else M.OracleTopK(ratio=args.ratio)
    elif name == "streaming":
        method = M.StreamingLLM(sinks=args.sinks if args.sinks is not None else 4,
                                window=args.window)
    elif name == "quest":
        method = M.Quest(token_budget=args.budget or 1024)
    elif name == "tidal":
        kw = {"select_layers": tuple(args.layers)} if args.layers else {}
        method = M.TidalDecode(k=args.budget or 4096, **kw)
    elif name == "delta":
        kw = {"delta_layers": tuple(args.layers)} if args.layers else {}
        if args.calibration:
            method = M.DELTA.from_calibration(args.calibration, model, budget_pages=args.budget_pages,
                                              recent_pages=args.recent_pages)
        else:
            method = M.DELTA(budget_pages=args.budget_pages, recent_pages=args.recent_pages, **kw)
    elif name == "kascade":
        if args.calibration:
            method = M.Kascade.from_calibration(args.calibration, model, ratio=args.ratio)
        else:
            kw = {"anchor_layers": tuple(args.layers)} if args.layers else {}
            method = M.Kascade(ratio=args.ratio, **kw)
    elif name == "lychee":
        if args.gates:
            heads = args.gates
        else:
            heads = M.random_retrieval_heads(config, args.retrieval_heads)
        budget = M.TopK(args.budget) if args.budget else M.Ratio(args.ratio)
        method = M.Lychee(heads, budget=budget, block=args.block,
                          sinks=args.sinks if args.sinks is not None else 128,
                          recent=args.recent if args.recent is not None else 256)
    else:  # argparse restricts the choices
        raise ValueError(f"--method {name!r}")
    if args.layers is None and hasattr(method, "scaled_to") and args.scale_layers:
        method = method.scaled_to(config.num_layers)
    if args.resa is not None:
        method = M.RESA(method, lam=args.resa)
    return method


def add_method_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("method")
    g.add_argument("--method", default="dense",
                   choices=["dense", "delta", "kascade", "lychee", "quest", "tidal", "streaming",
                            "oracle"])
    g.add_argument("--budget", type=int, default=None, help="token budget (quest, tidal, oracle, "
                   "lychee TopK)")
    g.add_argument("--ratio", type=float, default=0.1, help="budget ratio (kascade, oracle, lychee)")
    g.add_argument("--layers", type=int, nargs="+", default=None,
                   help="Δ-layers (delta), anchor layers (kascade) or selection layers (tidal)")
    g.add_argument("--scale-layers", action="store_true",
                   help="scale the papers' default layer choices to this model's depth")
    g.add_argument("--budget-pages", type=int, default=64)
    g.add_argument("--recent-pages", type=int, default=8)
    g.add_argument("--window", type=int, default=1024)
    g.add_argument("--sinks", type=int, default=None)
    g.add_argument("--recent", type=int, default=None)
    g.add_argument("--block", type=int, default=1, help="lychee selection block (tokens)")
    g.add_argument("--gates", default=None, help="lychee gate checkpoint / TSV / a.pt dir")
    g.add_argument("--retrieval-heads", type=int, default=4,
                   help="lychee without --gates: this many random retrieval heads")
    g.add_argument("--calibration", default=None, help="calibration JSON (delta, kascade)")
    g.add_argument("--resa", type=float, default=None, metavar="LAMBDA",
                   help="wrap the method in RESA with this λ")


def cmd_generate(args) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import sparsejax

    dtype = {"bf16": jnp.bfloat16, "f32": jnp.float32}[args.dtype]
    model = sparsejax.from_pretrained(args.model, dtype=dtype)
    tok = sparsejax.load_tokenizer(args.model)
    ids = tok(args.prompt)["input_ids"]
    method = _method_from_args(args, model)
    eos = tok.eos_token_id if tok.eos_token_id is not None else model.config.eos_token_id
    kw = dict(max_new_tokens=args.max_new_tokens, method=method, temperature=args.temperature,
              top_k=args.top_k, top_p=args.top_p, eos_token_id=eos,
              rng=jax.random.key(args.seed))
    batch = np.asarray([ids], np.int32)
    out = sparsejax.generate(model, batch, **kw)   # compile
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    out = sparsejax.generate(model, batch, **kw)
    jax.block_until_ready(out.tokens)
    dt = time.perf_counter() - t0
    n = int(out.num_generated[0])
    print(tok.decode(np.asarray(out.tokens[0, :n]), skip_special_tokens=True))
    print(f"[{n} tokens in {dt:.3f} s: {n / dt:.1f} tokens/s; method {method!r}; "
          f"prompt {len(ids)} tokens; {jax.default_backend()}]", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="sparsejax", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="complete a prompt")
    p.add_argument("--model", required=True, help="HF checkpoint directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["bf16", "f32"], default="f32")
    add_method_args(p)
    p.set_defaults(func=cmd_generate)

    from sparsejax import demo, eval as evaluation
    from sparsejax.train import calibrate, gates, pretrain
    demo.add_parser(sub)
    evaluation.add_parser(sub)
    pretrain.add_parser(sub)
    gates.add_parser(sub)
    calibrate.add_parser(sub)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"sparsejax {args.command}: error: {e}", file=sys.stderr)
        return 2
