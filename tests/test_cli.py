"""The command line: the README's commands as written, the method registry behind every
command, defaults in every --help, bad values named by their flag, outputs checked first."""
import contextlib
import dataclasses
import io
import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

import sparsejax
from sparsejax import cli, demo, evaluation, methods as M
from sparsejax.files import write_atomic

README = Path(__file__).resolve().parents[1] / "README.md"


def run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def subcommands():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return parser, sub.choices


def test_help_lists_each_command_once_and_a_default_for_every_option():
    parser, commands = subcommands()
    text = parser.format_help()
    for name in commands:
        assert len(re.findall(rf"^ +{re.escape(name)}(?: |$)", text, re.M)) == 1, name
    for name, p in commands.items():
        formatter = p._get_formatter()
        for action in p._actions:
            if action.dest == "help":
                continue
            shown = formatter._expand_help(action) if action.help else ""
            assert action.required or "default" in shown, (name, action.option_strings, shown)
        assert len(p.format_help().splitlines()) < 100, name     # options, not an essay


def test_every_registry_method_is_accepted_by_the_cli_eval_and_demo(monkeypatch):
    from sparsejax.models import ModelConfig

    config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, num_layers=4,
                         num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                         max_position_embeddings=512)
    parser, _ = subcommands()
    for name, spec in M.REGISTRY.items():
        assert parser.parse_args(["generate", "--prompt", "x", "--method", name]).method == name
        for budget in (M.TopK(32), M.Ratio(0.125)):
            method = spec.at_budget(config, budget, M.Fitted())
            assert isinstance(method, spec.constructor) and method.to_plan(config).roles
    assert evaluation.parse_methods(",".join(M.REGISTRY)) == list(M.REGISTRY)
    assert set(M.REGISTRY) <= set(evaluation.parse_methods(demo.DEMO_METHODS))
    # a method added to the registry alone reaches the CLI (with its option) and eval
    knob = M.Option("--streaming-window", "window", "recent tokens")
    spec = dataclasses.replace(M.REGISTRY["streaming"], options=(knob,))
    monkeypatch.setitem(M.REGISTRY, "mine", spec)
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--method", "mine",
                                          "--streaming-window", "7"])
    assert cli.method_options(args) == {"--streaming-window": 7}
    assert evaluation.parse_methods("mine+resa") == ["mine+resa"]
    args.method = "dense"
    with pytest.raises(ValueError, match="--streaming-window applies to --method mine"):
        cli.method_options(args)


@pytest.mark.parametrize("argv, flag", [
    (["eval", "--budget-ratio", "abc"], "--budget-ratio"),
    (["eval", "--budget-ratio", "0"], "--budget-ratio"),
    (["eval", "--samples", "0"], "--samples"),
    (["eval", "--batch", "0"], "--batch"),
    (["demo", "--budget-tokens", "-4"], "--budget-tokens"),
    (["generate", "--prompt", "x", "--method", "lychee", "--budget-tokens", "0"], "--budget-tokens"),
    (["generate", "--prompt", "x", "--method", "quest", "--budget-tokens", "0"], "--budget-tokens"),
    (["generate", "--prompt", "x", "--resa", "nan"], "--resa"),
    (["generate", "--prompt", "x", "--method", "delta", "--sinks", "4"], "--sinks"),
    (["generate", "--prompt", "x", "--method", "delta", "--draft-tokens", "0"], "--draft-tokens"),
    (["eval", "--draft-tokens", "1.5"], "--draft-tokens"),
    (["eval", "--methods", "dense,delta", "--draft-tokens", "4"], "--draft-tokens"),
    (["eval", "--methods", "dense+spec"], "--methods"),
    (["demo", "--methods", "dense", "--draft-tokens", "2"], "--draft-tokens"),
    (["generate", "--prompt", "x", "--tp", "64"], "--tp"),      # more devices than there are
    (["eval", "--tp", "64"], "--tp"),
    (["eval", "--tp", "0"], "--tp"),
    (["generate", "--prompt", "x", "--kv-dtype", "int8"], "--kv-dtype"),
    (["eval", "--kv-dtype", "e5m2"], "--kv-dtype"),
    (["calibrate", "--method", "delta", "--out", "x.json", "--samples", "0"], "--samples"),
    (["train-gates", "--model", "x", "--target-heads", "2", "--out", "o", "--steps", "0"],
     "--steps"),
])
def test_bad_values_are_errors_naming_the_flag(capsys, monkeypatch, argv, flag):
    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(sparsejax, "from_pretrained", no_model)
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and flag in err, err


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_eval_checks_its_outputs_before_any_model_work(capsys, monkeypatch, tmp_path, flag):
    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the outputs were checked")

    monkeypatch.setattr(sparsejax, "from_pretrained", no_model)
    for path in (tmp_path / "missing" / "out.x", tmp_path):
        rc, _, err = run(capsys, "eval", flag, path)
        assert rc == 2 and f"{flag} {path}" in err, err
    (tmp_path / "file").write_text("")
    rc, _, err = run(capsys, "calibrate", "--method", "delta", "--out", tmp_path / "c.json",
                     "--plot", tmp_path / "file" / "plots")
    assert rc == 2 and "--plot" in err, err
    rc, _, err = run(capsys, "calibrate", "--method", "delta", "--out",
                     tmp_path / "no" / "c.json")
    assert rc == 2 and "--out" in err, err


def test_write_atomic_replaces_only_with_a_complete_file(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")

    def half_then_fail(tmp):
        tmp.write_text("half")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        write_atomic(path, half_then_fail)
    assert path.read_text() == "old" and sorted(tmp_path.iterdir()) == [path]
    write_atomic(path, lambda tmp: tmp.write_text("new"))
    assert path.read_text() == "new" and sorted(tmp_path.iterdir()) == [path]


# ---- the README as written ------------------------------------------------------------------
def readme_commands() -> list[list[str]]:
    text = README.read_text()
    block = text[text.index("## Command line"):]
    block = block[block.index("```bash\n") + 8:]
    block = block[:block.index("```")]
    return [shlex.split(line.split("  #")[0])[1:] for line in block.splitlines()
            if line.startswith("sparsejax ")]


def shorten(argv, **values):
    """The command with these --flag values replaced (or added): small enough for the CPU."""
    argv = list(argv)
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        if flag in argv:
            argv[argv.index(flag) + 1] = str(value)
        else:
            argv += [flag, str(value)]
    return argv


def test_readme_python_examples_print_what_the_readme_shows():
    text = README.read_text()
    # a python block followed by the text it prints (other python blocks are not run)
    examples = re.findall(r"```python\n((?:(?!```).)*?)```\n\n```text\n(.*?)```", text, re.S)
    assert len(examples) == 2
    for code, shown in examples:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md", "exec"), {})
        assert out.getvalue() == shown, code


def test_readme_commands_run_as_written(capsys, tmp_path):
    commands = {argv[0]: argv for argv in readme_commands()}
    assert set(commands) == {"generate", "demo", "eval", "calibrate", "train-gates", "pretrain"}
    parser = cli.build_parser()
    for argv in commands.values():
        parser.parse_args(argv)                  # every flag the README shows exists
    # generate: exactly as written, printing what the README says it prints
    rc, out, err = run(capsys, *commands["generate"])
    shown = re.search(r"`generate` prints `(.*?)`", README.read_text()).group(1)
    assert rc == 0 and out == shown + "\n", err
    assert "only meaningful on a GPU" in err          # the CPU timing note
    # eval, demo, calibrate: the same commands on fewer, shorter prompts
    rc, out, err = run(capsys, *shorten(commands["eval"], context=128, samples=1,
                                        budget_ratio=0.25, methods="dense,delta+resa",
                                        json=tmp_path / "out.json", plot=tmp_path / "out.png"),
                       "--repeats", 1)
    assert rc == 0, err
    doc = json.loads((tmp_path / "out.json").read_text())
    assert {r["method"] for r in doc["results"]} == {"dense", "delta+resa"}
    assert doc["timing"]["repeats"] == 1 and (tmp_path / "out.png").stat().st_size > 0
    rc, out, err = run(capsys, *shorten(commands["demo"], context=128, samples=1, repeats=1,
                                        methods="dense", plot=tmp_path / "demo.png"))
    assert rc == 0 and "dense accuracy per task" in out and "only meaningful" in out, err
    rc, out, err = run(capsys, *shorten(commands["calibrate"], samples=2, context=96,
                                        decode_steps=2, out=tmp_path / "calib.json",
                                        plot=tmp_path / "plots"))
    assert rc == 0 and json.loads((tmp_path / "calib.json").read_text())["method"] == "kascade"
    assert (tmp_path / "plots" / "kascade_layer_similarity.png").stat().st_size > 0
    # train-gates and pretrain run through their CLIs in test_gates.py and test_pretrain.py


def test_generate_with_draft_tokens_prints_dense_text(capsys):
    """StreamingLLM with a 4-token window loses the number; drafting for dense attention it
    prints dense's text, with the drafts the dense verify accepted."""
    readme = next(argv for argv in readme_commands() if argv[0] == "generate")
    argv = ["generate", "--prompt", readme[readme.index("--prompt") + 1], "--max-new-tokens", 8]
    streaming = ["--method", "streaming", "--budget-tokens", 8]
    dense = run(capsys, *argv)
    sparse = run(capsys, *argv, *streaming)
    lossless = run(capsys, *argv, *streaming, "--draft-tokens", 3)
    assert dense[0] == sparse[0] == lossless[0] == 0, lossless[2]
    assert lossless[1] == dense[1] != sparse[1], (dense[1], sparse[1])
    accepted, drafted = map(int, re.search(r"lossless, (\d+) of (\d+) drafted tokens accepted",
                                           lossless[2]).groups())
    assert 0 <= accepted < drafted and drafted % 3 == 0, lossless[2]


def test_importing_and_plotting_leave_global_state_alone(tmp_path):
    """No warning filter added at import, and plotting leaves the user's backend (a notebook's,
    here svg) as it was."""
    import os
    import subprocess
    import sys

    code = f"""
import warnings
before = list(warnings.filters)
import matplotlib
backend = matplotlib.get_backend()
import sparsejax
from sparsejax import evaluation
added = [f for f in warnings.filters if f not in before and "riton" in str(f[1])]
assert not added, added
doc = {{"model": None, "tasks": ["niah"], "context": 8, "results": [
    dict(task="niah", method=m, budget_ratio=0.1, accuracy=a, mean_recall=r,
         mean_attn_error=e, tokens_per_s=None)
    for m, a, r, e in (("dense", 1, 1, 0), ("delta", 0.5, 0.4, 0.6), ("delta+resa", 1, 0.4, 0.1))]}}
evaluation.plot(doc, {str(tmp_path / "p.png")!r})
assert backend == "svg" and matplotlib.get_backend() == backend, matplotlib.get_backend()
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "MPLBACKEND": "svg"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


# ---- --tp end to end on host devices ---------------------------------------------------------
@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    """cli_tp_checks.py on 2 host devices (--tp 1 and --tp 2 on explicit- and auto-axes
    meshes) and on 8 (--tp 8), each in its own process: the device count is fixed when JAX
    starts."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    runs = {}
    for devices in (2, 8):
        out = tmp_path_factory.mktemp("tp") / f"tp{devices}.json"
        proc = subprocess.run([sys.executable, str(Path(__file__).parent / "cli_tp_checks.py"),
                               str(devices), str(out)], env=env, capture_output=True, text=True,
                              timeout=1800)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[devices] = json.loads(out.read_text())
    return runs


@pytest.mark.slow      # three processes' compiles: ~1.5 min of CPU
@pytest.mark.parametrize("run_name", ["tp2/explicit", "tp2/auto", "tp8/explicit"])
def test_tp_commands_match_one_device(tp_runs, run_name):
    """generate, eval and calibrate with --tp print and write what --tp 1 does: the same text,
    accuracy, recall and error, and the same calibration (the file names the same model:
    the fingerprint of the sharded weights is the unsharded one's)."""
    devices = int(run_name[2])
    assert tp_runs[devices]["devices"] == devices
    assert tp_runs[devices][f"{run_name}/axis_types"] == (
        ["Explicit"] if run_name.endswith("explicit") else ["Auto"])
    want, got = tp_runs[2]["tp1"], tp_runs[devices][run_name]
    assert want["generate"]["delta"] == "39 20 34\n"        # the model answers at --tp 1
    assert got["generate"] == want["generate"]
    for w, g in zip(want["eval"], got["eval"], strict=True):
        assert (g["method"], g["task"], g["accuracy"]) == (w["method"], w["task"], w["accuracy"])
        assert g["mean_recall"] == pytest.approx(w["mean_recall"], abs=1e-4)
        assert g["mean_attn_error"] == pytest.approx(w["mean_attn_error"], abs=1e-4)
    assert got["calibrate"]["layers"] == want["calibrate"]["layers"]
    assert got["calibrate"]["model"] == want["calibrate"]["model"]
    np.testing.assert_allclose(np.asarray(got["calibrate"]["curves"]["shift"], float),
                               np.asarray(want["calibrate"]["curves"]["shift"], float),
                               atol=1e-5)


@pytest.mark.slow
def test_tp_builds_an_explicit_axes_mesh(tp_runs):
    assert tp_runs[2]["cli_mesh_axis_types"] == ["Explicit"]
    assert tp_runs[8]["cli_mesh_axis_types"] == ["Explicit"]
