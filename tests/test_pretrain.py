"""The pretraining recipe (sparsejax.train.pretrain) on a CPU-sized run of the tiny model."""
import argparse
import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsejax
from sparsejax.train import data, pretrain, tokenizer

from hf_checkpoints import NEEDS_TORCH

STEPS = 6


@pytest.fixture(scope="module")
def small():
    """The tiny model on 96-token prompts, 8 per step, one eval sample per cell."""
    r = pretrain.recipe("tiny", max_context=96, batch=8)
    return dataclasses.replace(r, num_evals=1, eval_samples=1, final_eval_samples=1)


@pytest.fixture(scope="module")
def first_run(small, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ckpt")
    run = pretrain.train(small, steps=STEPS, seed=0, checkpoint_dir=ckpt, checkpoint_every=3,
                         log_every=1, progress=False)
    return run, ckpt


def test_recipe_and_plan():
    r = pretrain.recipe("default")
    assert [s.context for s in r.stages][-1] == 4096 and r.model.head_dim == 64
    assert r.model.max_position_embeddings == 4096 + data.MAX_ANSWER_TOKENS
    cut = pretrain.recipe("default", max_context=1500, batch=64)
    assert [s.context for s in cut.stages][-1] == 1500
    assert cut.stages[-1].batch == 64 and cut.max_context == 1500
    assert sum(s.share for s in cut.stages) == pytest.approx(1.0)
    plan = pretrain.plan_by_steps(r, 101)
    assert plan.total == 101 and [plan.stage_of(s) for s in (0, 100)] == [0, len(r.stages) - 1]
    # sample indices run on across steps and stages
    starts = [plan.first_sample(s, r) for s in range(plan.total)]
    sizes = [r.stages[plan.stage_of(s)].batch for s in range(plan.total)]
    assert starts == list(np.cumsum([0] + sizes[:-1]))
    with pytest.raises(ValueError, match="size='huge'"):
        pretrain.recipe("huge")
    with pytest.raises(ValueError, match="max_context=10"):
        pretrain.recipe("tiny", max_context=10)


def test_default_model_fits_one_returned_file():
    config = pretrain.recipe("default").model
    n = pretrain.num_params(jax.eval_shape(lambda: sparsejax.models.init_params(
        config, jax.random.key(0))))
    assert 2 * n < 16 * 2**20 and config.num_layers >= 8


def test_batches_are_deterministic(small):
    plan = pretrain.plan_by_steps(small, STEPS)
    a, b = (pretrain.make_batch(small, plan, 0, 4) for _ in range(2))
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert a.tokens.shape == (8, small.seq_len(plan.stage_of(4)))
    assert sorted(set(a.task_ids.tolist())) == list(range(len(data.TRAIN_TASKS)))
    c = pretrain.make_batch(small, plan, 0, 5)
    assert not np.array_equal(a.tokens, c.tokens)


def test_loss_falls(first_run):
    run, _ = first_run
    losses = [r["loss"] for r in run.log["records"]]
    assert len(losses) == STEPS and all(np.isfinite(losses))
    assert np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.2
    assert run.log["steps_done"] == STEPS and run.log["evals"]


def test_resume_equals_uninterrupted(small, first_run):
    """6 steps in one go == 3 steps, an interruption, then a resume from the step-3 checkpoint."""
    run, ckpt = first_run
    shutil.rmtree(ckpt / str(STEPS))   # the run "died" after its step-3 checkpoint
    resumed = pretrain.train(small, steps=STEPS, seed=0, checkpoint_dir=ckpt,
                             checkpoint_every=3, log_every=1, progress=False)
    assert int(resumed.state.step) == STEPS
    for want, got in zip(jax.tree.leaves(run.state), jax.tree.leaves(resumed.state)):
        np.testing.assert_array_equal(np.asarray(want), np.asarray(got))
    assert [r["loss"] for r in resumed.log["records"]] == [r["loss"] for r in run.log["records"]]
    with pytest.raises(ValueError, match="planned for 6 steps"):
        pretrain.train(small, steps=7, seed=0, checkpoint_dir=ckpt, progress=False)


def test_export_loads_in_sparsejax_and_transformers(small, first_run, tmp_path):
    torch = pytest.importorskip("torch", reason=NEEDS_TORCH)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, _ = first_run
    out = pretrain.export(run, small, tmp_path / "model")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "training_curve.png", "training_log.json"]
    log = json.loads((out / "training_log.json").read_text())
    assert log["final_eval"]["exact_match"].keys() == set(data.TASKS)
    assert [r["step"] for r in log["records"]] == list(range(1, STEPS + 1))

    model = sparsejax.from_pretrained(out, dtype=jnp.float32)
    want = np.asarray(pretrain.cast_params(run.state.params, jnp.bfloat16)["embed"],
                      np.float32)
    np.testing.assert_array_equal(np.asarray(model.params["embed"]), want)
    sample = data.make_sample("multikey", 96, 5, 0)
    ours = np.asarray(sparsejax.logits(model, sample.input_ids[None]))[0]
    hf = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(torch.tensor(sample.input_ids[None], dtype=torch.long)).logits[0].numpy()
    np.testing.assert_allclose(ours, theirs, atol=2e-4, rtol=2e-4)

    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    text = tokenizer.default_vocab().decode(sample.input_ids[1:])
    assert tok(text)["input_ids"] == sample.input_ids.tolist()


def test_cli(tmp_path):
    parser = argparse.ArgumentParser()
    pretrain.add_parser(parser.add_subparsers())
    args = parser.parse_args(["pretrain", "--out", str(tmp_path), "--size", "tiny",
                              "--max-context", "200", "--batch", "4"])
    assert (args.size, args.max_context, args.batch, args.seed) == ("tiny", 200, 4, 0)
    with pytest.raises(ValueError, match="--minutes M or --steps S"):
        args.func(args)
    assert pretrain.main(["--out", str(tmp_path), "--steps", "0", "--size", "tiny"]) == 2
