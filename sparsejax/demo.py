"""`sparsejax demo` (behind `make demo`): the main job on the embedded default model.

Without a shipped model it builds a tiny Llama from the committed config
`models/configs/tiny-llama.json` with a fixed seed (random weights), saves it in HF format,
loads it back through `from_pretrained` and generates with dense attention and each method.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np



def random_tiny_model(path: Path, seed: int = 0):
    """Build the committed tiny config with random weights, save it, load it back."""
    import sparsejax
    from sparsejax.models import ModelConfig, init_params

    from sparsejax import models as _models
    config = ModelConfig.from_json(Path(_models.__file__).resolve().parent / "configs" /
                                   "tiny-llama.json")
    model = sparsejax.Model(config=config, params=init_params(config, jax.random.key(seed)))
    sparsejax.save_pretrained(model, path)
    return sparsejax.from_pretrained(path, dtype=jnp.float32)


def run(args) -> int:
    import sparsejax
    from sparsejax import methods as M

    with tempfile.TemporaryDirectory() as tmp:
        print("sparsejax demo: no trained model is shipped yet, so this runs a tiny Llama with "
              "RANDOM weights (seed 0) built from models/configs/tiny-llama.json, saved in HF "
              "format and loaded back through from_pretrained. Its tokens are meaningless; what "
              "it shows is every method running through one jitted generate().")
        model = random_tiny_model(Path(tmp))
    c = model.config
    rng = np.random.default_rng(0)
    lengths = np.array([900, 1200, 1500], np.int32)
    ids = np.zeros((3, lengths.max()), np.int32)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(3, c.vocab_size, n)
    methods = M.budget_ratio_methods(c, 0.1, int(lengths.max()))
    dense = None
    print(f"{'method':<10} {'agree w/ dense':>14} {'tokens/s':>10}")
    for name, method in methods.items():
        kw = dict(lengths=lengths, max_new_tokens=args.max_new_tokens, method=method)
        jax.block_until_ready(sparsejax.generate(model, ids, **kw))
        t0 = time.perf_counter()
        out = sparsejax.generate(model, ids, **kw)
        jax.block_until_ready(out.tokens)
        dt = time.perf_counter() - t0
        toks = np.asarray(out.tokens)
        dense = toks if dense is None else dense
        agree = float(np.mean(toks == dense))
        print(f"{name:<10} {agree:>14.2f} {toks.size / dt:>10.1f}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="run the main job on the embedded default model")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.set_defaults(func=run)
