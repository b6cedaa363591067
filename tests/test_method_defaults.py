"""Methods built without layer choices fit any depth: the papers' choices scaled to the model
they are planned for, explicit choices kept and checked, budgets whose defaults depend on each
other adapted; and the README's and the package docstring's method snippets plan and run on
the embedded 8-layer model and on 12- and 32-layer checkpoints."""
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax
from sparsejax import methods as M
from sparsejax.models import ModelConfig, init_params
from sparsejax.plan import Role

README = Path(__file__).resolve().parents[1] / "README.md"
DEPTHS = (8, 12, 32)


def config(num_layers: int) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=1024, hidden_size=32,
                       num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=8,
                       intermediate_size=64, max_position_embeddings=1024)


def unset_layer_methods():
    """Every method with its layer choices and budgets left to the defaults."""
    return {"dense": M.Dense(), "oracle": M.OracleTopK(), "streaming": M.StreamingLLM(),
            "quest": M.Quest(), "tidal": M.TidalDecode(), "delta": M.DELTA(),
            "kascade": M.Kascade(), "kascade-sparse": M.Kascade(sparse_prefill=True),
            "kascade-anchors": M.Kascade(sparse_anchors=True),
            "delta+resa": M.RESA(M.DELTA())}


def selecting(plan) -> tuple[int, ...]:
    return tuple(i for i, r in enumerate(plan.roles) if r in (Role.SELECT, Role.SELF))


@pytest.mark.parametrize("depth", DEPTHS)
def test_unset_layers_are_the_papers_scaled_to_the_depth(depth):
    cfg = config(depth)
    for name, method in unset_layer_methods().items():
        assert method.to_plan(cfg).num_layers == depth, name
    # the same choice `scaled_to` spells out, and on 28 layers the papers' own
    for method, paper in ((M.DELTA(), (2, 14, 22)), (M.TidalDecode(), (2, 13)),
                          (M.Kascade(), (0, 2, 8, 13, 14))):
        plan = method.to_plan(cfg)
        assert selecting(plan) == selecting(method.scaled_to(depth).to_plan(cfg))
        assert selecting(method.to_plan(config(28))) == paper
        chosen = selecting(plan)
        assert len(chosen) == len(paper) and chosen[-1] < depth and chosen[0] == paper[0]
        # scaled, not cut: the last choice sits where the paper's does in 28 layers, or later
        # where earlier choices pushed it
        assert chosen[-1] >= round(paper[-1] * (depth - 1) / 27)
    # DELTA's and Tidal's first two layers are dense; Quest's too
    for method in (M.DELTA(), M.TidalDecode(), M.Quest()):
        assert method.to_plan(cfg).roles[:2] == (Role.DENSE,) * 2


def test_explicit_layers_are_kept_and_checked():
    cfg = config(8)
    assert selecting(M.DELTA(delta_layers=(3, 7)).to_plan(cfg)) == (3, 7)
    assert selecting(M.Kascade(anchor_layers=(0, 5)).to_plan(cfg)) == (0, 5)
    for make, field in ((lambda: M.DELTA(delta_layers=(2, 14, 22)), "delta_layers"),
                        (lambda: M.TidalDecode(select_layers=(2, 13)), "select_layers"),
                        (lambda: M.Kascade(anchor_layers=(0, 2, 8)), "anchor_layers")):
        with pytest.raises(ValueError, match=rf"{field}=.* out of range for a model with 8 "
                                             rf"layers \(leave {field} unset"):
            make().to_plan(cfg)


def test_dependent_budget_defaults_adapt_or_name_the_argument():
    cfg = config(8)
    # the recent window follows a small page budget: a quarter of it, 8 at most
    for pages, recent in ((1, 1), (4, 1), (16, 4), (64, 8), (512, 8)):
        plan = M.DELTA(budget_pages=pages).to_plan(cfg)
        assert (plan.selector.budget.value, plan.selector.recent) == (pages, recent * 16)
    assert M.DELTA(ratio=0.1).to_plan(cfg).selector.recent == 16      # the current page
    with pytest.raises(ValueError, match="recent_pages=8 exceeds budget_pages=4: lower "
                                         "recent_pages or raise budget_pages"):
        M.DELTA(budget_pages=4, recent_pages=8)
    for make, words in ((lambda: M.DELTA(budget_pages=8, ratio=0.1), "give one budget"),
                        (lambda: M.Quest(token_budget=64, ratio=0.1), "give one budget"),
                        (lambda: M.TidalDecode(ratio=1.5), "ratio=1.5"),
                        (lambda: M.StreamingLLM(window=0), "window=0"),
                        (lambda: M.Kascade(k=2.5), "k=2.5")):
        with pytest.raises(ValueError, match=words):
            make()
    # a shallow model keeps what it has of the papers' early dense layers
    assert M.Quest().to_plan(config(1)).roles == (Role.DENSE,)
    assert M.TidalDecode().to_plan(config(2)).roles == (Role.DENSE,) * 2


# ---- the README's and the docstring's snippets ------------------------------------------------
def snippets() -> list[str]:
    """Every Python block of the README and docs/architecture.md, and the package docstring's
    example."""
    blocks = [block for doc in (README, README.parent / "docs" / "architecture.md")
              for block in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)]
    doc = sparsejax.__doc__
    blocks.append("\n".join(line[4:] for line in doc.splitlines() if line.startswith("    ")))
    return blocks


def method_expressions() -> list[str]:
    """The `methods.X(...)` constructions the snippets show (nested ones whole)."""
    found = []
    for block in snippets():
        for m in re.finditer(r"methods\.(?:RESA|DELTA|Kascade|TidalDecode|Quest|OracleTopK|"
                             r"StreamingLLM|Dense)\(", block):
            depth, i = 0, m.start()
            for j in range(m.end() - 1, len(block)):
                depth += {"(": 1, ")": -1}.get(block[j], 0)
                if depth == 0:
                    break
            expr = block[i:j + 1]
            if not any(expr in f for f in found):
                found.append(expr)
    return found


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The embedded model and random 12- and 32-layer checkpoints beside its tokenizer."""
    embedded = sparsejax.embedded_model_path()
    paths = {8: embedded}
    for depth in (12, 32):
        path = tmp_path_factory.mktemp(f"tiny{depth}")
        model = sparsejax.Model(config(depth), init_params(config(depth), jax.random.key(depth),
                                                           std=0.1))
        sparsejax.save_pretrained(model, path)
        for f in embedded.iterdir():
            if f.is_file() and "token" in f.name:
                shutil.copy(f, path / f.name)
        paths[depth] = path
    return paths


def test_snippets_show_the_methods_that_failed_on_shallow_models():
    exprs = method_expressions()
    for wanted in ("methods.DELTA()", "methods.TidalDecode()",
                   "methods.Kascade(sparse_prefill=True, prefill_tile=128)"):
        assert wanted in exprs, exprs


@pytest.mark.slow      # a compile per method and depth: ~2 min of CPU for the three depths
@pytest.mark.parametrize("depth", DEPTHS)
def test_snippet_methods_run_on_every_depth(depth):
    """Each method a snippet builds, as written, plans for the model and decodes (draft_tokens
    as the lossless snippet). The weights are stacked (the layer scan compiles once per run
    of equal roles, where the checkpoints' per-layer weights unroll every layer)."""
    if depth == 8:
        model = sparsejax.from_pretrained(sparsejax.embedded_model_path(), dtype=jnp.float32)
    else:
        model = sparsejax.Model(config(depth), init_params(config(depth), jax.random.key(depth),
                                                           std=0.1))
    rng = np.random.default_rng(depth)
    ids = rng.integers(3, 1024, (2, 40)).astype(np.int32)
    lengths = np.array([40, 23], np.int32)
    namespace = {"methods": M, "model": model}
    for expr in method_expressions():
        method = eval(expr, namespace)
        out = sparsejax.generate(model, ids, lengths=lengths, max_new_tokens=3, method=method,
                                 draft_tokens=2 if "DELTA()" in expr else None)
        assert np.asarray(out.num_generated).min() >= 1, expr


@pytest.mark.parametrize("depth", DEPTHS)
def test_docstring_and_text_to_text_snippets_run(checkpoints, depth):
    """The package docstring's example and the README's `LLM` example, with the checkpoint's
    path for the embedded one's (`"path/to/hf-checkpoint"` in the docstring)."""
    path = str(checkpoints[depth])
    ids = np.random.default_rng(0).integers(3, 1024, (2, 30)).astype(np.int32)
    code = snippets()[-1].replace('"path/to/hf-checkpoint"', repr(path))
    namespace = {"sparsejax": sparsejax, "ids": ids, "lengths": np.array([30, 17], np.int32)}
    exec(compile(code, "sparsejax/__init__.py", "exec"), namespace)
    assert np.asarray(namespace["out"].tokens).shape == (2, 64)
    llm_block = snippets()[0].replace("sparsejax.embedded_model_path()", repr(path))
    exec(compile(llm_block.replace("print(", "result = ("), "README.md", "exec"), namespace)
    assert len(namespace["result"]) == 2


def test_llm_completion_does_not_depend_on_the_batch():
    """`LLM`'s registry methods attend to a share of each row's own length: one method for
    every batch, and a prompt completed alone as beside a longer one."""
    from sparsejax.train import data

    llm = sparsejax.LLM(sparsejax.embedded_model_path(), method="quest")
    assert llm.method_for() == llm.method_for(10) == llm.method_for(4000)
    assert llm.method_for().ratio == llm.budget_ratio
    tok = llm.tokenizer
    short, long = (tok.decode(data.make_sample("niah", n, 0, 0).input_ids[1:]) for n in (96, 400))
    params = sparsejax.SamplingParams(max_tokens=6)
    alone = llm.generate([short], params)[0].outputs[0]
    beside = llm.generate([short, long], params)[0].outputs[0]
    assert alone.token_ids == beside.token_ids and alone.text == beside.text
