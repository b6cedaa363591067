"""Probe: bad files, paths, flags and signals against the command line and the loaders.

    python tests/probe_cli.py [--only NAME,...] [--workers 2]

Every case runs in a subprocess with a timeout (cases that need no fresh process share one
batch process, each judged on its own) and gets one outcome:

  OK        a clean refusal (one error line naming the flag or file, no traceback), or the
            right result
  SILENT    accepted without a word where it should be refused or warned about
  UNCLEAR   refused, but by a raw exception / traceback instead of a message
  DATALOSS  a file that should have been left alone was changed or replaced
  HANG      no answer within the timeout
  LATE      the refusal came only after the long work (outputs not checked first)
  CRASH     the process died of a signal it was not sent, or of a segfault

It prints a table (case x outcome) and exits 1 when any case is HANG, CRASH, DATALOSS, SILENT
or LATE. UNCLEAR is reported but does not fail the run.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import io
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

FAILING = ("HANG", "CRASH", "DATALOSS", "SILENT", "LATE")
PY = sys.executable
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "SPARSEJAX_DEBUG": "", "PYTHONUNBUFFERED": "1"}
# the eval the output and signal cases run: the smallest that still compiles a decode loop
SMALL_EVAL = ["eval", "--task", "niah", "--context", "64", "--samples", "1", "--batch", "1",
              "--no-timing"]


def embedded() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("sparsejax")
    root = Path(spec.origin).resolve().parent
    for candidate in (root / "models", root.parent / "models"):
        if (candidate / "assets" / "retrieval-tiny" / "config.json").exists():
            return candidate / "assets" / "retrieval-tiny"
    raise SystemExit("probe: the embedded model is not found")


# ---- judging ---------------------------------------------------------------------------------
def judge_refusal(rc, err: str, *, expect=()) -> tuple[str, str]:
    """A command that must be refused: rc != 0, an error line, no traceback."""
    last = err.strip().splitlines()[-1] if err.strip() else ""
    if rc == 0:
        return "SILENT", "exit 0"
    if "Traceback" in err:
        return "UNCLEAR", last[:110]
    if rc is not None and rc < 0:
        return "CRASH", f"signal {-rc}"
    missing = [w for w in expect if w.lower() not in err.lower()]
    if missing:
        return "UNCLEAR", f"message lacks {missing}: {last[:80]}"
    return "OK", last[:110]


def _capture_cli(argv):
    """(rc, stdout, stderr) of sparsejax.cli.main(argv) in this process; an exception that
    escapes main is a traceback."""
    from sparsejax import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main([str(a) for a in argv])
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:       # noqa: BLE001 (the probe reports whatever escapes)
            err.write(traceback.format_exc())
            rc = 1
    return rc, out.getvalue(), err.getvalue()


def _library_call(fn, *, expect=()) -> tuple[str, str]:
    """A library call that must raise ValueError naming `expect` (or warn, for warn cases)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn()
        except ValueError as e:
            text = str(e)
            missing = [w for w in expect if w.lower() not in text.lower()]
            if missing:
                return "UNCLEAR", f"ValueError lacks {missing}: {text[:80]}"
            return "OK", text.splitlines()[0][:110]
        except Exception as e:   # noqa: BLE001
            return "UNCLEAR", f"{type(e).__name__}: {str(e)[:90]}"
    return "SILENT", "accepted"


def _warned_or_refused(fn, words) -> tuple[str, str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn()
        except ValueError as e:
            return ("OK" if all(w in str(e) for w in words) else "UNCLEAR"), str(e)[:110]
        except Exception as e:   # noqa: BLE001
            return "UNCLEAR", f"{type(e).__name__}: {str(e)[:90]}"
    texts = [str(w.message) for w in caught if all(x in str(w.message) for x in words)]
    return ("OK", "warned: " + texts[0][:100]) if texts else ("SILENT", "no warning")


# ---- fixtures --------------------------------------------------------------------------------
class Scratch:
    """Files the cases need, in one temporary directory."""

    def __init__(self, root: Path):
        self.root = root
        self.model = embedded()

    def checkpoint(self, name: str, *, link_weights=True) -> Path:
        """A copy of the embedded model's JSON files; its weights a symlink to the original
        (a link that leaves the checkpoint: the loaders then need allow_outside=True)."""
        d = self.root / name
        d.mkdir()
        for f in self.model.glob("*.json"):
            shutil.copy(f, d / f.name)
        if link_weights:
            (d / "model.safetensors").symlink_to(self.model / "model.safetensors")
        return d

    def device(self, name: str) -> Path:
        """A character device like /dev/null, made here so that replacing it harms nothing."""
        path = self.root / name
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        return path


def _is_device(path: Path) -> bool:
    try:
        return stat.S_ISCHR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


# ---- the cases that share one process ----------------------------------------------------------
BATCH: dict = {}


def batch_case(fn):
    BATCH[fn.__name__] = fn
    return fn


def _index_checkpoint(s: Scratch, name: str, target: str) -> Path:
    from safetensors import safe_open

    d = s.checkpoint(name, link_weights=False)
    with safe_open(s.model / "model.safetensors", "numpy") as f:
        names = list(f.keys())
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: target for n in names}}))
    return d


@batch_case
def index_shard_outside_relative(s):
    outside = s.root / "elsewhere"
    outside.mkdir(exist_ok=True)
    shutil.copy(s.model / "model.safetensors", outside / "x.safetensors")
    d = _index_checkpoint(s, "ck_rel", "../elsewhere/x.safetensors")
    import sparsejax
    return _library_call(lambda: sparsejax.from_pretrained(d), expect=("outside",))


@batch_case
def index_shard_outside_absolute(s):
    d = _index_checkpoint(s, "ck_abs", str(s.model / "model.safetensors"))
    import sparsejax
    return _library_call(lambda: sparsejax.from_pretrained(d), expect=("outside",))


@batch_case
def weights_symlink_outside(s):
    d = s.checkpoint("ck_link")          # model.safetensors is a symlink to the embedded one
    import sparsejax
    return _library_call(lambda: sparsejax.from_pretrained(d), expect=("outside",))


@batch_case
def config_json_too_large(s):
    d = s.checkpoint("ck_big")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg) + " " * (17 << 20))
    import sparsejax
    return _library_call(lambda: sparsejax.from_pretrained(d, allow_outside=True)
                         if _takes_allow_outside() else sparsejax.from_pretrained(d),
                         expect=("config.json", "MiB"))


def _takes_allow_outside() -> bool:
    import inspect

    import sparsejax
    return "allow_outside" in inspect.signature(sparsejax.from_pretrained).parameters


def _config(**changes):
    cfg = json.loads((embedded() / "config.json").read_text())
    cfg.update(changes)
    return cfg


def _from_dict(**changes):
    from sparsejax.models import ModelConfig
    return lambda: ModelConfig.from_hf_dict(_config(**changes))


@batch_case
def config_model_type_gpt2(s):
    cfg = {"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12,
           "n_head": 12}
    from sparsejax.models import ModelConfig
    return _library_call(lambda: ModelConfig.from_hf_dict(cfg),
                         expect=("model_type", "gpt2", "llama"))


@batch_case
def config_tie_embeddings_string(s):
    return _library_call(_from_dict(tie_word_embeddings="false"),
                         expect=("tie_word_embeddings",))


@batch_case
def config_rope_theta_zero(s):
    return _library_call(_from_dict(rope_theta=0), expect=("rope_theta",))


@batch_case
def config_max_positions_negative(s):
    return _library_call(_from_dict(max_position_embeddings=-5),
                         expect=("max_position_embeddings",))


@batch_case
def config_eos_outside_vocab(s):
    return _library_call(_from_dict(eos_token_id=5000), expect=("eos_token_id",))


@batch_case
def config_eos_float(s):
    return _library_call(_from_dict(eos_token_id=2.5), expect=("eos_token_id",))


def _tiny_model(layers=4):
    import jax.numpy as jnp
    import numpy as np

    import sparsejax
    from sparsejax.models import ModelConfig, param_shapes
    import jax

    cfg = ModelConfig(model_type="llama", vocab_size=32, hidden_size=16, num_layers=layers,
                      num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32,
                      max_position_embeddings=64, eos_token_id=2)
    rng = np.random.default_rng(0)
    return sparsejax.Model(cfg, jax.tree.map(
        lambda shape: jnp.asarray(0.1 * rng.standard_normal(shape), jnp.float32),
        param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple)))


@batch_case
def generate_eos_outside_vocab(s):
    import sparsejax
    m = _tiny_model()
    return _library_call(lambda: sparsejax.generate(m, [[1, 2]], max_new_tokens=1,
                                                    eos_token_id=99), expect=("eos_token_id",))


@batch_case
def generate_top_p_at_temperature_zero(s):
    import sparsejax
    m = _tiny_model()
    return _warned_or_refused(lambda: sparsejax.generate(m, [[1, 2]], max_new_tokens=1,
                                                         top_p=0.5), ("top_p",))


@batch_case
def decode_step_past_capacity(s):
    import jax.numpy as jnp
    import numpy as np

    import sparsejax
    from sparsejax.plan import dense_plan
    m = _tiny_model()
    cache = sparsejax.allocate(m.config, 1, 8, page_size=4, dtype=jnp.float32)
    plan = dense_plan(m.config, 4)

    def run():
        _, c = sparsejax.prefill(m, cache, np.arange(8)[None] % 32, np.array([8]), plan)
        sparsejax.decode_step(m, c, np.array([3]), plan)
    return _library_call(run, expect=("capacity",))


@batch_case
def decode_step_plan_for_fewer_layers(s):
    import jax.numpy as jnp
    import numpy as np

    import sparsejax
    from sparsejax.plan import dense_plan
    m = _tiny_model(4)
    small = _tiny_model(2).config
    cache = sparsejax.allocate(m.config, 1, 16, page_size=4, dtype=jnp.float32)

    def run():
        _, c = sparsejax.prefill(m, cache, np.array([[1, 2, 3]]), np.array([3]),
                                 dense_plan(m.config, 4))
        sparsejax.decode_step(m, c, np.array([3]), dense_plan(small, 4))
    return _library_call(run, expect=("layers",))


def _method(make, expect):
    return _library_call(make, expect=expect)


@batch_case
def delta_layers_empty(s):
    from sparsejax import methods as M
    return _method(lambda: M.DELTA(delta_layers=()).to_plan(_tiny_model(8).config),
                   ("delta_layers",))


@batch_case
def delta_layers_string(s):
    from sparsejax import methods as M
    return _method(lambda: M.DELTA(delta_layers="35"), ("delta_layers",))


@batch_case
def delta_layers_float(s):
    from sparsejax import methods as M
    return _method(lambda: M.DELTA(delta_layers=(2.7,)), ("delta_layers",))


@batch_case
def delta_scaled_to_zero(s):
    from sparsejax import methods as M
    return _method(lambda: M.DELTA().scaled_to(0), ("num_layers",))


@batch_case
def delta_scaled_to_negative(s):
    from sparsejax import methods as M
    return _method(lambda: M.DELTA().scaled_to(-3), ("num_layers",))


@batch_case
def lychee_heads_and_gates(s):
    import numpy as np

    from sparsejax import methods as M
    heads = np.ones((8, 4), bool)
    gates = sorted((s.model / "gates").glob("*.json"))[0]
    return _method(lambda: M.Lychee(heads, gates=str(gates)), ("gates", "retrieval_heads"))


@batch_case
def calibration_without_fingerprint(s):
    from sparsejax import methods as M
    calib = json.loads((s.model / "calibration" / "delta.json").read_text())
    calib.pop("model", None)
    path = s.root / "delta-nofp.json"
    path.write_text(json.dumps(calib))
    return _method(lambda: M.DELTA.from_calibration(path).to_plan(_tiny_model(8).config),
                   ("fingerprint",))


@batch_case
def gates_without_fingerprint(s):
    from sparsejax import methods as M
    record = json.loads(sorted((s.model / "gates").glob("*.json"))[0].read_text())
    record.pop("fingerprint", None)
    path = s.root / "gates-nofp.json"
    path.write_text(json.dumps(record))
    return _method(lambda: M.Lychee(gates=str(path)), ("fingerprint",))


@batch_case
def gates_tsv_nan(s):
    from sparsejax import artifacts
    path = s.root / "full_attention_heads.tsv"
    path.write_text("1\t1\t1\t1\n" + "nan\t0.9\t0.1\t0.2\n" * 7)
    return _method(lambda: artifacts.load_gates(path), ("NaN",))


@batch_case
def cli_generate_top_k_without_temperature(s):
    rc, out, err = _capture_cli(["generate", "--prompt", "a b", "--max-new-tokens", "1",
                                 "--top-k", "5"])
    if rc == 0:
        return ("OK", "warned") if "--top-k" in err and "temperature" in err else \
            ("SILENT", "greedy, no word")
    return judge_refusal(rc, err, expect=("--top-k",))


@batch_case
def cli_generate_huge_seed(s):
    rc, out, err = _capture_cli(["generate", "--prompt", "a b", "--max-new-tokens", "1",
                                 "--seed", "99999999999999999999"])
    return judge_refusal(rc, err, expect=("--seed",))


@batch_case
def cli_eval_methods_empty(s):
    rc, out, err = _capture_cli(SMALL_EVAL + ["--methods", ""])
    return judge_refusal(rc, err, expect=("--methods",))


@batch_case
def cli_eval_task_empty(s):
    rc, out, err = _capture_cli(SMALL_EVAL + ["--methods", "dense", "--task", ""])
    return judge_refusal(rc, err, expect=("--task",))


def _kascade_calibrate_refuses(s, flag: str, value: str, out_name: str):
    """A tiny Kascade calibration with one bad `flag`: refused, naming it."""
    rc, out, err = _capture_cli(["calibrate", "--method", "kascade", "--task", "niah",
                                 "--context", "64", "--samples", "1", "--decode-steps", "1",
                                 flag, value, "--out", s.root / out_name])
    return judge_refusal(rc, err, expect=(flag,))


@batch_case
def cli_calibrate_too_many_anchors(s):
    return _kascade_calibrate_refuses(s, "--anchors", "99", "c1.json")


@batch_case
def cli_calibrate_k_too_large(s):
    return _kascade_calibrate_refuses(s, "--k", "100000", "c2.json")


@batch_case
def cli_calibrate_missing_prompts(s):
    rc, out, err = _capture_cli(["calibrate", "--method", "delta", "--prompts",
                                 s.root / "no-such-prompts.txt", "--out", s.root / "c3.json"])
    return judge_refusal(rc, err, expect=("--prompts", "no-such-prompts.txt"))


@batch_case
def cli_calibrate_binary_prompts(s):
    path = s.root / "binary.txt"
    path.write_bytes(bytes(range(128, 256)) * 4)
    rc, out, err = _capture_cli(["calibrate", "--method", "delta", "--prompts", path,
                                 "--out", s.root / "c4.json"])
    return judge_refusal(rc, err, expect=("--prompts", "binary.txt"))


@batch_case
def cli_gates_pt_pickle(s):
    import pickle

    d = s.root / "ptgates"
    d.mkdir()
    (d / "full_head.pt").write_bytes(pickle.dumps({"x": os.getcwd}))
    rc, out, err = _capture_cli(["generate", "--prompt", "a b", "--max-new-tokens", "1",
                                 "--method", "lychee", "--gates", d])
    return judge_refusal(rc, err, expect=("full_head.pt",))


@batch_case
def cli_eval_json_device(s):
    dev = s.device("null")
    rc, out, err = _capture_cli(SMALL_EVAL + ["--methods", "dense", "--json", dev])
    if not _is_device(dev):
        return "DATALOSS", "the device node was replaced by a regular file"
    return judge_refusal(rc, err, expect=("--json",))


@batch_case
def cli_calibrate_out_device(s):
    dev = s.device("full")
    rc, out, err = _capture_cli(["calibrate", "--method", "delta", "--task", "niah",
                                 "--context", "64", "--samples", "1", "--decode-steps", "1",
                                 "--out", dev])
    if not _is_device(dev):
        return "DATALOSS", "the device node was replaced by a regular file"
    return judge_refusal(rc, err, expect=("--out",))


@batch_case
def cli_eval_json_fifo(s):
    fifo = s.root / "out.fifo"
    os.mkfifo(fifo)
    rc, out, err = _capture_cli(SMALL_EVAL + ["--methods", "dense", "--json", fifo])
    if not stat.S_ISFIFO(os.lstat(fifo).st_mode):
        return "DATALOSS", "the FIFO was replaced by a regular file"
    return judge_refusal(rc, err, expect=("--json",))


@batch_case
def cli_eval_json_directory(s):
    d = s.root / "a-directory"
    d.mkdir()
    rc, out, err = _capture_cli(SMALL_EVAL + ["--methods", "dense", "--json", d])
    return judge_refusal(rc, err, expect=("--json",))


@batch_case
def cli_eval_json_symlink(s):
    target = s.root / "target.json"
    target.write_text("{}")
    link = s.root / "link.json"
    link.symlink_to(target)
    rc, out, err = _capture_cli(SMALL_EVAL + ["--methods", "dense", "--json", link])
    if not link.is_symlink():
        return "DATALOSS", "the symlink was replaced by a regular file"
    if rc == 0:
        return ("OK", "written through the link") if target.read_text() != "{}" else \
            ("SILENT", "exit 0, nothing written")
    return judge_refusal(rc, err, expect=("--json",))


@batch_case
def cli_eval_json_and_plot_same_path(s):
    path = s.root / "same.out"
    rc, out, err = _capture_cli(SMALL_EVAL + ["--methods", "dense", "--json", path,
                                              "--plot", path])
    if rc == 0:
        return "DATALOSS", "the plot overwrote the JSON"
    return judge_refusal(rc, err, expect=("--json", "--plot"))


@batch_case
def cli_eval_json_read_only(s):
    rc, out, err = _capture_cli(SMALL_EVAL + ["--methods", "dense", "--json",
                                              "/proc/sparsejax-probe.json"])
    return judge_refusal(rc, err, expect=("--json",))


@batch_case
def cli_eval_json_disk_full(s):
    """Disk full while the JSON is written (simulated): the message names the path."""
    from pathlib import Path as P

    import errno
    real = P.write_text

    def full(self, *a, **k):
        if self.name.endswith(".json") and "disk-full" in str(self.parent):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real(self, *a, **k)
    d = s.root / "disk-full"
    d.mkdir()
    P.write_text = full
    try:
        rc, out, err = _capture_cli(SMALL_EVAL + ["--methods", "dense", "--json", d / "r.json"])
    finally:
        P.write_text = real
    return judge_refusal(rc, err, expect=("r.json", "space"))


@batch_case
def cli_eval_json_parent_is_file(s):
    f = s.root / "plain-file"
    f.write_text("x")
    rc, out, err = _capture_cli(SMALL_EVAL + ["--methods", "dense", "--json", f / "r.json"])
    return judge_refusal(rc, err, expect=("--json",))


def run_batch(names, root: Path):
    s = Scratch(root)
    for name in names:
        t0 = time.perf_counter()
        try:
            outcome, detail = BATCH[name](s)
        except BaseException as e:    # noqa: BLE001 (a probe bug must not hide the others)
            outcome, detail = "UNCLEAR", f"probe: {type(e).__name__}: {str(e)[:90]}"
        print("PROBE " + json.dumps({"case": name, "outcome": outcome, "detail": detail,
                                     "seconds": round(time.perf_counter() - t0, 1)}),
              flush=True)


# ---- the cases that need a process of their own --------------------------------------------------
SOLO: dict = {}


def solo_case(fn):
    SOLO[fn.__name__] = fn
    return fn


def _run(argv, timeout, *, prelude=None, **kw):
    """(rc or None on timeout, stdout, stderr, seconds)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=ENV, start_new_session=True, **kw)
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out, err, time.perf_counter() - t0
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return None, out, err, time.perf_counter() - t0


@solo_case
def weights_fifo(s):
    d = s.checkpoint("ck_fifo", link_weights=False)
    os.mkfifo(d / "model.safetensors")
    rc, out, err, t = _run([PY, "-c", "import sparsejax, sys; "
                            f"sparsejax.from_pretrained({str(d)!r})"], 40)
    if rc is None:
        return "HANG", "from_pretrained blocked on the FIFO"
    return _library_rc(rc, err, ("model.safetensors",))


@solo_case
def config_json_is_dev_zero(s):
    d = s.checkpoint("ck_zero")
    (d / "config.json").unlink()
    (d / "config.json").symlink_to("/dev/zero")
    code = ("import resource, sparsejax; "
            "resource.setrlimit(resource.RLIMIT_DATA, (3 << 30, 3 << 30)); "
            f"sparsejax.from_pretrained({str(d)!r}, "
            + ("allow_outside=True)" if _takes_allow_outside() else ")"))
    rc, out, err, t = _run([PY, "-c", code], 40)
    if rc is None:
        return "HANG", "reading /dev/zero"
    return _library_rc(rc, err, ("config.json",))


def _library_rc(rc, err, expect):
    last = err.strip().splitlines()[-1] if err.strip() else ""
    if rc == 0:
        return "SILENT", "loaded"
    if rc < 0:
        return "CRASH", f"signal {-rc}"
    if last.startswith("ValueError") and all(w in last for w in expect):
        return "OK", last[:110]
    return "UNCLEAR", last[:110]


def _eval_interrupted(s, sig, *, after_line=None, delay=0.0, name="prev.json"):
    """Start the small eval over an existing complete output; send `sig` after the first
    stderr line containing `after_line` (else after `delay` s). -> (outcome, detail)."""
    out_file = s.root / name
    out_file.write_text('{"previous": "complete"}\n')
    before = out_file.read_bytes()
    argv = [PY, "-m", "sparsejax", *SMALL_EVAL, "--methods", "dense,delta",
            "--json", str(out_file)]
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=ENV, start_new_session=True)
    err_lines = []
    if after_line:
        for line in p.stderr:
            err_lines.append(line)
            if after_line in line:
                break
    else:
        time.sleep(delay)
    sent = time.perf_counter()
    if p.poll() is None:
        os.kill(p.pid, sig)
    try:
        out, err = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return "HANG", f"still running 30 s after signal {sig}"
    err = "".join(err_lines) + err
    waited = time.perf_counter() - sent
    expected_rc = 128 + sig
    last = err.strip().splitlines()[-1] if err.strip() else ""
    if out_file.read_bytes() != before:
        return "DATALOSS", f"the previous output changed (rc {p.returncode})"
    if p.returncode is not None and p.returncode < 0 and -p.returncode != sig:
        return "CRASH", f"died of signal {-p.returncode}"
    if p.returncode == 0:
        return "SILENT" if waited > 10 else "HANG", f"ran to the end ({waited:.0f} s after)"
    if "Traceback" in err:
        return "UNCLEAR", f"rc {p.returncode}, traceback: {last[:80]}"
    if p.returncode != expected_rc:
        return "UNCLEAR", f"rc {p.returncode} (expected {expected_rc}): {last[:70]}"
    return "OK", f"rc {p.returncode} after {waited:.1f} s: {last[:80]}"


@solo_case
def eval_sigint_mid_run(s):
    return _eval_interrupted(s, signal.SIGINT, after_line="dense ", name="int.json")


@solo_case
def eval_sigterm_mid_run(s):
    return _eval_interrupted(s, signal.SIGTERM, after_line="dense ", name="term.json")


@solo_case
def eval_sigint_at_start(s):
    return _eval_interrupted(s, signal.SIGINT, delay=2.0, name="early.json")


@solo_case
def gates_out_is_a_file(s):
    """train-gates --out on an existing file: refused before training."""
    f = s.root / "gates-out-file"
    f.write_text("x")
    rc, out, err, t = _run([PY, "-m", "sparsejax", "train-gates", "--model", str(s.model),
                            "--target-heads", "4", "--steps", "2", "--min-length", "512",
                            "--out", str(f)], 45)
    if rc is None:
        return "LATE", "still training 45 s in; the output was not checked first"
    outcome, detail = judge_refusal(rc, err, expect=("--out",))
    return ("LATE", detail) if outcome != "SILENT" and t > 40 else (outcome, detail)


@solo_case
def pretrain_negative_workers(s):
    rc, out, err, t = _run([PY, "-m", "sparsejax", "pretrain", "--size", "tiny", "--steps", "1",
                            "--workers", "-1", "--out", str(s.root / "pt")], 40)
    if rc is None:
        return "SILENT", "--workers -1 accepted: still training 40 s in"
    return judge_refusal(rc, err, expect=("--workers",))


@solo_case
def pretrain_out_read_only(s):
    rc, out, err, t = _run([PY, "-m", "sparsejax", "pretrain", "--size", "tiny", "--steps", "2",
                            "--out", "/proc/sparsejax-probe"], 45)
    if rc is None:
        return "LATE", "still training 45 s in; the output was not checked first"
    return judge_refusal(rc, err, expect=("--out",))


# ---- the driver ------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=None, help="comma-separated case names")
    p.add_argument("--workers", type=int, default=2, help="solo cases run at a time")
    p.add_argument("--batch-timeout", type=int, default=240)
    p.add_argument("--batch-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--root", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help="also write the outcomes here")
    args = p.parse_args(argv)
    if args.batch_child is not None:
        run_batch(args.batch_child.split(","), Path(args.root))
        return 0
    only = set(args.only.split(",")) if args.only else None
    batch = [n for n in BATCH if only is None or n in only]
    solo = [n for n in SOLO if only is None or n in only]
    results: dict = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sparsejax-probe-") as tmp:
        root = Path(tmp)
        (root / "batch").mkdir()
        s = Scratch(root)

        def run_batch_child():
            if not batch:
                return
            rc, out, err, t = _run([PY, os.path.abspath(__file__), "--batch-child",
                                    ",".join(batch), "--root", str(root / "batch")],
                                   args.batch_timeout)
            for line in out.splitlines():
                if line.startswith("PROBE "):
                    r = json.loads(line[6:])
                    results[r["case"]] = (r["outcome"], r["detail"], r["seconds"])
            for name in batch:
                if name not in results:
                    tail = err.strip().splitlines()[-1][:100] if err.strip() else ""
                    results[name] = ("HANG" if rc is None else
                                     "CRASH" if rc < 0 else "UNCLEAR",
                                     f"the batch process stopped here (rc {rc}) {tail}", round(t, 1))

        def run_solo(name):
            t = time.perf_counter()
            try:
                outcome, detail = SOLO[name](s)
            except Exception as e:   # noqa: BLE001
                outcome, detail = "UNCLEAR", f"probe: {type(e).__name__}: {e}"
            results[name] = (outcome, detail, round(time.perf_counter() - t, 1))

        with concurrent.futures.ThreadPoolExecutor(max(1, args.workers) + 1) as pool:
            jobs = [pool.submit(run_batch_child)]
            solo_pool = concurrent.futures.ThreadPoolExecutor(max(1, args.workers))
            jobs += [solo_pool.submit(run_solo, n) for n in solo]
            for j in jobs:
                j.result()
            solo_pool.shutdown()
    names = batch + solo
    width = max(len(n) for n in names)
    print(f"{'case':<{width}}  {'outcome':<8}  {'s':>5}  detail")
    for n in names:
        outcome, detail, seconds = results[n]
        print(f"{n:<{width}}  {outcome:<8}  {seconds:>5}  {detail}")
    counts = {o: sum(r[0] == o for r in results.values()) for o in
              ("OK", "UNCLEAR") + FAILING}
    print("; ".join(f"{k} {v}" for k, v in counts.items() if v) +
          f"  ({len(names)} cases, {time.perf_counter() - t0:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({n: results[n] for n in names}, indent=1))
    return 1 if any(results[n][0] in FAILING for n in names) else 0


if __name__ == "__main__":
    sys.exit(main())
