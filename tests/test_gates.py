"""Head-gate training (sparsejax.train.gates) on tiny random models: the student against an
independent loop implementation, training towards the head budget, checkpoints and resume, the
gate file formats, Lychee(gates=PATH) through generate, and the command line."""
import argparse
import dataclasses
import itertools
import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax
from sparsejax import artifacts
from sparsejax import methods as M
from sparsejax.models import (ModelConfig, attention_inputs, embed, finish_layer, forward,
                              init_params)
from sparsejax import hardkuma
from sparsejax.train import gates
from sparsejax.train.passkey import GateBatch, PasskeyData
from sparsejax.train.tokenizer import default_vocab, save_tokenizer

CFG = ModelConfig(model_type="llama", vocab_size=1024, hidden_size=64, num_layers=4, num_heads=4,
                  num_kv_heads=2, head_dim=16, intermediate_size=96)
GATED = (CFG.num_layers - 1) * CFG.num_kv_heads
# short prompts, so the sparse heads' sinks + recent window stay small
SELECT = dict(sinks=4, recent=8)
TRAIN = dict(lr=0.1, lambda_lr=0.3, progress=False, **SELECT)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return save_tokenizer(tmp_path_factory.mktemp("tokenizer"), 4096)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return sparsejax.load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="module")
def model():
    return sparsejax.Model(CFG, init_params(CFG, jax.random.key(0), std=0.3))


@pytest.fixture(scope="module")
def data(tokenizer):
    return PasskeyData(tokenizer, min_length=120, max_length=200, num_passkeys=2,
                       passkey_words=8)


# ---- data -----------------------------------------------------------------------------------
def test_passkey_data(tokenizer, tmp_path):
    data = PasskeyData(tokenizer, min_length=500, max_length=700, batch_size=2, seed=3)
    vocab = default_vocab()
    batch = data.batch(5)
    assert batch.tokens.shape == (2, data.width) and data.width == 700 + data.target_width
    for x, y in zip(batch, data.batch(5)):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(batch.tokens, data.batch(6).tokens)
    prompt, targets = data.sample(5, 0)
    assert 500 <= prompt.size <= 700 and prompt[0] == tokenizer.bos_token_id
    assert tokenizer.unk_token_id not in prompt and tokenizer.unk_token_id not in targets
    row = batch.tokens[0]
    np.testing.assert_array_equal(row[:prompt.size], prompt)
    np.testing.assert_array_equal(row[prompt.size:prompt.size + targets.size], targets)
    np.testing.assert_array_equal(batch.target_positions[0],
                                  prompt.size + np.arange(data.target_width))
    assert batch.target_mask[0].sum() == targets.size
    # ten needles of 32 numbers; the targets ask for each and answer with its passkey
    words, asked = vocab.decode(prompt).split(), vocab.decode(targets).split("what is ")[1:]
    assert len(asked) == 10
    for question in asked:
        key = question.split()[5]
        answer = question.split(f"answer : the special magic number for {key} ")[-1].split()
        assert len(answer) == 33 and answer[-1] == "."
        at = [i for i in range(1, len(words) - 1) if words[i - 1:i + 1] == ["for", key]]
        assert len(at) == 1 and words[at[0] + 1:at[0] + 34] == answer
    # a filler file: windows of its tokens
    filler = tmp_path / "filler.txt"
    filler.write_text("the cat sat on the mat . " * 50)
    with_file = PasskeyData(tokenizer, min_length=500, max_length=520, filler=filler)
    assert with_file.describe()["filler"].startswith("filler.txt:")
    assert with_file.sample(0, 0)[0].size >= 500
    with pytest.raises(ValueError, match="min_length=300 cannot hold 10 passkeys"):
        PasskeyData(tokenizer, min_length=300, max_length=700)


# ---- the student ----------------------------------------------------------------------------
def _reference_student(model, batch, z, ratio, sinks, recent, refresh=True):
    """Final hidden states [B, A, H], one row / layer / KV head / target position at a time in
    float64 numpy: dense attention, and sparse attention over the set that the previous layer's
    group-mean query chose (floor(ratio * length) tokens, the first `sinks` and the last
    `recent` always in), mixed with weight z[layer, kv_head]. refresh=False keeps layer 0's
    sets for every layer instead."""
    c = model.config
    group, D = c.num_heads // c.num_kv_heads, c.head_dim
    softmax_mix = lambda logits, vals: (np.exp(logits - logits.max())  # noqa: E731
                                        / np.exp(logits - logits.max()).sum()) @ vals
    rows = []
    for b in range(batch.tokens.shape[0]):
        P = int(batch.prompt_lengths[b])
        A = batch.target_positions.shape[1]
        cache = forward(model, jnp.asarray(batch.tokens[b:b + 1, :P]))
        h = embed(model, jnp.asarray(batch.tokens[b, P:P + A]))
        positions = jnp.arange(P, P + A)
        sets = None
        for layer in range(c.num_layers):
            lp = jax.tree.map(lambda x: x[layer], model.params["layers"])
            q, k, v = (np.asarray(x, np.float64) for x in attention_inputs(c, lp, h, positions))
            K = np.concatenate([np.asarray(cache.keys[layer, 0], np.float64), k])
            V = np.concatenate([np.asarray(cache.values[layer, 0], np.float64), v])
            out = np.zeros((A, c.num_heads, D))
            chosen = {}
            for j in range(A):
                n = P + j + 1
                for kv in range(c.num_kv_heads):
                    for hq in range(kv * group, (kv + 1) * group):
                        logits = K[:n, kv] @ q[j, hq] / math.sqrt(D)
                        dense = softmax_mix(logits, V[:n, kv])
                        idx = np.arange(n) if sets is None else sets[j, kv]
                        sparse = softmax_mix(logits[idx], V[idx, kv])
                        out[j, hq] = z[layer, kv] * dense + (1 - z[layer, kv]) * sparse
                    score = K[:n, kv] @ q[j, kv * group:(kv + 1) * group].mean(0) / math.sqrt(D)
                    forced = set(range(sinks)) | set(range(n - recent, n))
                    count = min(n, max(math.floor(ratio * n), len(forced)))
                    rest = [i for i in np.argsort(-score, kind="stable") if i not in forced]
                    chosen[j, kv] = np.asarray(sorted(forced | set(rest[:count - len(forced)])))
            sets = chosen if refresh or sets is None else sets
            h = finish_layer(c, lp, h, jnp.asarray(out, jnp.float32))
        rows.append(np.asarray(h))
    return np.stack(rows)


def _batch(tokens, prompt_lengths, targets):
    B = len(prompt_lengths)
    W = max(prompt_lengths) + targets
    ids = np.zeros((B, W), np.int32)
    for b, P in enumerate(prompt_lengths):
        ids[b, :P + targets] = tokens[b, :P + targets]
    positions = (np.asarray(prompt_lengths)[:, None] + np.arange(targets)).astype(np.int32)
    return GateBatch(ids, np.asarray(prompt_lengths, np.int32), positions,
                     np.ones((B, targets), np.float32))


def test_student_matches_independent_implementation():
    cfg = dataclasses.replace(CFG, num_layers=3)
    small = sparsejax.Model(cfg, init_params(cfg, jax.random.key(4), std=0.3))
    tokens = np.random.default_rng(0).integers(4, cfg.vocab_size, (2, 60))
    batch = _batch(tokens, [40, 33], 8)
    plan = M.Lychee(np.ones((3, 2), bool), budget=M.Ratio(0.3), sinks=2, recent=3).to_plan(cfg)
    keys, values, _ = gates.teacher(small, GateBatch(*map(jnp.asarray, batch)), "hidden")
    z = np.concatenate([np.ones((1, 2)), np.random.default_rng(1).uniform(0, 1, (2, 2))])
    got = np.asarray(gates.student(small, plan, GateBatch(*map(jnp.asarray, batch)), keys,
                                   values, jnp.asarray(z, jnp.float32)))
    want = _reference_student(small, batch, z, 0.3, 2, 3)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    # negative control: layer 2 reading layer 0's sets instead of layer 1's
    stale = _reference_student(small, batch, z, 0.3, 2, 3, refresh=False)
    assert np.abs(stale - want).max() > 10 * 2e-4


def test_dense_student_is_the_teacher(model, data):
    batch = GateBatch(*map(jnp.asarray, data.batch(0)))
    plan = M.Lychee(np.ones((4, 2), bool), budget=M.Ratio(0.3), **SELECT).to_plan(CFG)
    for loss in gates.LOSSES:
        keys, values, wanted = gates.teacher(model, batch, loss)
        for z, same in ((1.0, True), (0.0, False)):
            hidden = gates.student(model, plan, batch, keys, values, jnp.full((4, 2), z))
            got = gates.features(model, hidden, loss)
            err = float(jnp.max(jnp.abs(got - wanted) * batch.target_mask[..., None]))
            assert (err < 1e-4 * float(jnp.max(jnp.abs(wanted)))) == same, (loss, z, err)


# ---- training -------------------------------------------------------------------------------
def test_training_reaches_the_head_budget(model, data):
    log = []
    state = gates.train_gates(model, data, target_retrieval_heads=3, steps=50, seed=0,
                              callback=lambda step, m: log.append(m), **TRAIN)
    assert int(state.step) == 50 and len(log) == 50
    assert abs(state.expected_l0() - 3) < 1.0 and abs(log[-1]["expected_l0"] - 3) < 1.0
    heads = state.retrieval_heads()
    assert heads.shape == (4, 2) and heads[0].all()
    np.testing.assert_array_equal(heads[1:], state.mean() > 0.5)
    assert log[-1]["heads"] == heads[1:].sum()

    # the distillation loss on held-out batches, gates at their means (layer 0 dense): lower
    # than at the start (every E[z] = 0.5), and the learned heads beat most head sets of
    # the same size
    plan = M.Lychee(np.ones((4, 2), bool), budget=M.Ratio(0.3), **SELECT).to_plan(CFG)
    batches = [GateBatch(*map(jnp.asarray, data.batch(1000 + i))) for i in range(4)]

    @jax.jit
    def distill(batch, gated):
        keys, values, wanted = gates.teacher(model, batch, "logits")
        z = jnp.concatenate([jnp.ones((1, 2)), gated])
        got = gates.features(model, gates.student(model, plan, batch, keys, values, z),
                             "logits")
        err = jnp.mean(jnp.square(got - wanted), axis=-1)
        return jnp.sum(err * batch.target_mask) / jnp.sum(batch.target_mask)

    def loss(gated):
        return np.mean([float(distill(b, jnp.asarray(gated, jnp.float32))) for b in batches])

    learned = heads[1:].reshape(-1)
    assert loss(state.mean()) < loss(np.full((3, 2), 0.5))
    others = [loss(np.isin(np.arange(6), chosen).reshape(3, 2))
              for chosen in itertools.combinations(range(6), int(learned.sum()))]
    assert loss(learned.reshape(3, 2)) <= np.median(others)


def test_retrieval_heads_use_the_hardkuma_mean():
    """E[z] (clamped) and the plain Kuma mean fall on opposite sides of 0.5 here (rare: the
    stretch maps 0.5 to 0.5, so the two means mostly agree on the side)."""
    a, b = 0.1225, 0.2725
    kuma_mean = b * math.exp(math.lgamma(1 + 1 / a) + math.lgamma(b) - math.lgamma(1 + 1 / a + b))
    assert kuma_mean < 0.5 < float(hardkuma.mean(a, b))
    training = gates.GateTraining(2.0, 10, 0.1, 0.1, M.Ratio(0.3), 4, 8, 1, "logits")
    state = gates.init_gate_state(4, 2, training, seed=0)
    state = state.replace(params={"log_a": jnp.full((3, 2), math.log(a)),
                                  "log_b": jnp.full((3, 2), math.log(b))})
    assert state.retrieval_heads().all()


@pytest.fixture(scope="module")
def checkpointed(model, data, tmp_path_factory):
    """10 steps with Orbax checkpoints every 5."""
    ckpt = tmp_path_factory.mktemp("gates-ckpt")
    state = gates.train_gates(model, data, target_retrieval_heads=3, steps=10, seed=1,
                              checkpoint_dir=ckpt, checkpoint_every=5, **TRAIN)
    return state, ckpt


def _assert_same_state(a, b):
    assert (a.target, a.fingerprint) == (b.target, b.fingerprint)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_checkpoint_round_trip(checkpointed, tmp_path):
    state, ckpt = checkpointed
    assert int(state.step) == 10 and state.fingerprint
    _assert_same_state(state, gates.restore_gate_state(ckpt))
    path = gates.save_gates(state, tmp_path / "gates.json")
    record = json.loads(path.read_text())
    np.testing.assert_array_equal(np.asarray(record["a"], np.float32), np.asarray(state.a))
    np.testing.assert_array_equal(np.asarray(record["b"], np.float32), np.asarray(state.b))
    assert record["target"] == 3 and record["fingerprint"] == state.fingerprint.to_json()
    for source in (path, tmp_path, ckpt):
        np.testing.assert_array_equal(artifacts.load_retrieval_heads(source),
                                      state.retrieval_heads())


class _Crash(Exception):
    pass


class _CrashingData:
    """Batches of `data`, raising once at step `at` (a run killed mid-way)."""

    def __init__(self, data, at):
        self.data, self.at = data, at

    def batch(self, step):
        if step == self.at:
            self.at = None
            raise _Crash
        return self.data.batch(step)

    def describe(self):
        return self.data.describe()


def test_resume_equals_uninterrupted(model, data, checkpointed, tmp_path):
    state, _ = checkpointed
    crashing = _CrashingData(data, at=7)
    kwargs = dict(target_retrieval_heads=3, steps=10, seed=1, checkpoint_dir=tmp_path,
                  checkpoint_every=5, **TRAIN)
    with pytest.raises(_Crash):
        gates.train_gates(model, crashing, **kwargs)
    assert int(gates.restore_gate_state(tmp_path).step) == 5
    resumed = gates.train_gates(model, crashing, **kwargs)
    _assert_same_state(state, resumed)
    with pytest.raises(ValueError, match="holds a run with other training"):
        gates.train_gates(model, data, **{**kwargs, "target_retrieval_heads": 2})


def test_arguments_are_checked(model, data):
    too_many = f"target_retrieval_heads={GATED + 1}: expected 0..{GATED}"
    with pytest.raises(ValueError, match=too_many):
        gates.train_gates(model, data, target_retrieval_heads=GATED + 1, **TRAIN)
    with pytest.raises(ValueError, match="loss='kl'"):
        gates.train_gates(model, data, target_retrieval_heads=2, loss="kl", **TRAIN)


# ---- gate files -----------------------------------------------------------------------------
def test_duoattention_tsv(tmp_path):
    scores = np.array([[0.1, 0.2], [0.7, 0.4], [0.5, 1.3], [-0.2, 0.49]])
    np.savetxt(tmp_path / "full_attention_heads.tsv", scores, delimiter="\t")
    want = np.array([[1, 1], [1, 0], [1, 1], [0, 0]], bool)
    for source in (tmp_path, tmp_path / "full_attention_heads.tsv"):
        np.testing.assert_array_equal(artifacts.load_retrieval_heads(source), want)
    np.testing.assert_array_equal(
        artifacts.load_retrieval_heads(tmp_path, threshold=0.3),
        np.array([[1, 1], [1, 1], [1, 1], [0, 1]], bool))


def test_reference_pt_files(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    a = torch.nn.Parameter(torch.tensor([[1.0, 1.0], [4.0, 0.3], [1.0, 0.2], [0.3, 3.0]]))
    b = torch.nn.Parameter(torch.tensor([[1.0, 1.0], [0.3, 4.0], [0.2, 1.0], [3.0, 0.3]]))
    full = torch.tensor([[1.0, 1.0], [0.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    for name, x in (("a.pt", a), ("b.pt", b), ("full_head.pt", full)):
        torch.save(x, tmp_path / name)
    np.testing.assert_array_equal(artifacts.load_retrieval_heads(tmp_path), full.numpy() > 0.5)
    (tmp_path / "full_head.pt").unlink()
    means = np.asarray(hardkuma.mean(jnp.asarray(a.detach().numpy()),
                                     jnp.asarray(b.detach().numpy())))
    want = means > 0.5
    want[0] = True
    assert want[1:].any() and not want[1:].all()
    for source in (tmp_path, tmp_path / "a.pt"):
        np.testing.assert_array_equal(artifacts.load_retrieval_heads(source), want)
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ValueError, match="needs torch"):
        artifacts.load_retrieval_heads(tmp_path)


def test_unknown_gate_sources(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        artifacts.load_retrieval_heads(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="holds none of"):
        artifacts.load_retrieval_heads(tmp_path)
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(ValueError, match="is not a gate file"):
        artifacts.load_retrieval_heads(tmp_path / "x.json")


def test_lychee_gates_through_generate(model, checkpointed, tmp_path):
    state, ckpt = checkpointed
    path = gates.save_gates(state, tmp_path / "gates.json")
    ids = np.random.default_rng(0).integers(4, CFG.vocab_size, (2, 80)).astype(np.int32)
    lengths = np.array([80, 61], np.int32)
    for source in (path, ckpt):
        method = M.Lychee(gates=source, budget=M.TopK(32), sinks=4, recent=8)
        np.testing.assert_array_equal(np.asarray(method.retrieval_heads),
                                      state.retrieval_heads())
        out = sparsejax.generate(model, ids, lengths=lengths, max_new_tokens=4, method=method)
        assert out.tokens.shape == (2, 4)
    other = dataclasses.replace(CFG, num_layers=6)
    with pytest.raises(ValueError, match=r"expected \[6, 2\]"):
        M.Lychee(gates=path).to_plan(other)


# ---- command line ---------------------------------------------------------------------------
def test_cli(model, tmp_path):
    model_dir = sparsejax.save_pretrained(model, tmp_path / "model")
    save_tokenizer(model_dir, 4096)
    parser = argparse.ArgumentParser()
    gates.add_parser(parser.add_subparsers())
    args = parser.parse_args(["train-gates", "--model", str(model_dir), "--target-heads", "2",
                              "--steps", "2", "--out", str(tmp_path / "out"), "--min-length",
                              "450", "--max-length", "480", "--sinks", "4", "--recent", "8",
                              "--loss", "hidden"])
    assert (args.budget_ratio, args.seed, args.checkpoint_dir) == (0.3, 0, None)
    assert args.func(args) == 0
    heads = artifacts.load_retrieval_heads(tmp_path / "out")
    assert heads.shape == (CFG.num_layers, CFG.num_kv_heads) and heads[0].all()
    assert json.loads((tmp_path / "out" / "gates.json").read_text())["step"] == 2


def test_off_target_runs_are_named():
    assert gates.off_target(8, 8, 2.0, 1.0) == []
    assert gates.off_target(8, 10, 2.0, 1.0) == []          # within 25%
    (heads,) = gates.off_target(2, 6, 2.0, 1.0)             # the run the defaults once gave
    assert heads.startswith("WARNING: 6 retrieval heads, asked for 2")
    (loss,) = gates.off_target(2, 2, 1.0, 1.5)
    assert "loss ended at 1.5, not below its first step's 1" in loss


def test_defaults_fit_the_model(tokenizer):
    tok = tokenizer
    config = dataclasses.replace(CFG, num_layers=30, num_heads=9, num_kv_heads=3)
    assert gates.default_target_heads(config) == round(0.125 * 29 * 3) == 11
    assert gates.default_target_heads(CFG) == 1
    # needles fill at most half the prompt: a 32-word passkey is ~36 word tokens here
    one = PasskeyData(tok, min_length=10 ** 6, max_length=10 ** 6, num_passkeys=1)
    needle = one._bound("needle", "key", "answer")
    for length in (200, 400, 4096):
        n = gates.passkeys_that_fit(tok, length)
        assert n == max(1, min(10, (length // 2 - one._ids["prefix"].size) // needle))
        PasskeyData(tok, min_length=length, max_length=length, num_passkeys=n)  # fits
