"""A signal while the command line starts (its imports take seconds on a loaded machine) stops
it at once, writing nothing: also when the parent left SIGINT and SIGTERM ignored (a shell
script's or CI step's `command &` does) or blocked, and when interpreter options come before
`-m sparsejax`. Each case waits until the program has taken the signals (read from /proc) and
sends one then, long before the command's own handling starts: deterministic, ~1 s a case."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparsejax.files import started_as_command

EVAL = ["eval", "--task", "niah", "--context", "64", "--samples", "1", "--batch", "1",
        "--no-timing"]
# run `argv[1:]` with SIGINT and SIGTERM ignored / blocked, as the parent left them
IGNORED = ("import os, signal, sys; [signal.signal(s, signal.SIG_IGN) for s in "
           "(signal.SIGINT, signal.SIGTERM)]; os.execv(sys.argv[1], sys.argv[1:])")
BLOCKED = ("import os, signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, "
           "{signal.SIGINT, signal.SIGTERM}); os.execv(sys.argv[1], sys.argv[1:])")


def _caught(pid: int, sig: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(status.split("SigCgt:")[1].split()[0], 16)
    return bool(mask & (1 << (sig - 1)))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/PID/status")
@pytest.mark.parametrize("parent,options,sig", [
    (IGNORED, [], signal.SIGINT),
    (IGNORED, [], signal.SIGTERM),
    (BLOCKED, [], signal.SIGINT),
    (None, ["-X", "utf8", "-u"], signal.SIGINT),
    (None, ["-Wignore", "-um"], signal.SIGTERM),
], ids=["sigint-ignored", "sigterm-ignored", "sigint-blocked", "options-before-m",
        "joined-options"])
def test_a_signal_while_the_command_starts_stops_it_writing_nothing(tmp_path, parent, options,
                                                                    sig):
    out = tmp_path / "prev.json"
    out.write_text("previous\n")
    module = ["sparsejax"] if options[-1:] == ["-um"] else ["-m", "sparsejax"]
    argv = [sys.executable, *options, *module, *EVAL, "--json", str(out)]
    if parent:
        argv = [sys.executable, "-c", parent, *argv]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu", "SPARSEJAX_DEBUG": ""})
    try:
        # the guard takes SIGINT then SIGTERM (SIGTERM is not caught before it), first thing
        # in the package: the imports, then the command's own handling, come after
        deadline = time.monotonic() + 60
        while not _caught(p.pid, signal.SIGTERM):
            assert p.poll() is None and time.monotonic() < deadline, "never took the signals"
            time.sleep(0.002)
        os.kill(p.pid, sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 128 + sig, err
    assert f"sparsejax: interrupted by {signal.Signals(sig).name} while starting: stopped, " \
        "nothing written" in err, err
    assert out.read_text() == "previous\n" and list(tmp_path.iterdir()) == [out]


@pytest.mark.parametrize("command_ran", [False, True])
def test_the_startup_guard_says_whether_the_command_ran(command_ran):
    """The guard's handler, given the signals back after the command (`handle_signals`'
    exit), says the program was exiting, not starting, when one arrives then."""
    code = ("import os, signal, time; from sparsejax import files; files.guard_startup()\n"
            + ("with files.handle_signals():\n    pass\n" if command_ran else "")
            + "os.kill(os.getpid(), signal.SIGINT); time.sleep(30)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert p.returncode == 128 + signal.SIGINT, p.stderr
    when = ("exiting: stopped after the command ended" if command_ran
            else "starting: stopped, nothing written")
    assert p.stderr.strip().endswith(f"sparsejax: interrupted by SIGINT while {when}"), p.stderr


@pytest.mark.parametrize("orig_argv,expected", [
    (["py", "-m", "sparsejax", "eval"], True),
    (["py", "-X", "importtime", "-m", "sparsejax", "eval"], True),
    (["py", "-Ximporttime", "-um", "sparsejax"], True),
    (["py", "-W", "ignore", "-I", "-msparsejax"], True),
    (["py", "-m", "sparsejax.__main__"], True),
    (["py", "-m", "pytest", "-m", "sparsejax"], False),
    (["py", "-c", "import sparsejax", "-m", "sparsejax"], False),
    (["py", "script.py", "-m", "sparsejax"], False),
    (["py", "-m", "sparsejaxx"], False),
])
def test_the_command_line_is_told_from_the_interpreter_line(orig_argv, expected):
    assert started_as_command(["-m"], orig_argv) is expected
    assert started_as_command(["/usr/bin/sparsejax", "eval"], ["py", "/usr/bin/sparsejax"])
    assert not started_as_command(["-c"], ["py", "-c", "import sparsejax"])


def test_a_signal_while_the_command_sets_up_its_handling_stops_it(monkeypatch, capsys, tmp_path):
    """A signal landing between the command's handler going in and its `try`: the command is
    stopped (128 + the signal, its one line), and nothing of the handling stays set."""
    import threading

    from sparsejax import cli, files

    install = signal.signal

    def install_then_signal(signum, handler):
        previous = install(signum, handler)
        if signum == signal.SIGINT and handler is files.handle_signals._on_signal:
            signal.raise_signal(signal.SIGINT)      # raised here, inside __enter__
        return previous

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    monkeypatch.setattr(signal, "signal", install_then_signal)
    out = tmp_path / "prev.json"
    out.write_text("previous\n")
    try:
        rc = cli.main([*EVAL, "--json", str(out)])
    except KeyboardInterrupt as e:      # Interrupted is one: keep it from ending the session
        pytest.fail(f"the signal escaped the command: {e!r}")
    monkeypatch.undo()
    assert rc == 130
    assert "sparsejax eval: interrupted by SIGINT: stopped" in capsys.readouterr().err
    assert {s: signal.getsignal(s) for s in before} == before
    assert signal.set_wakeup_fd(wakeup) == wakeup and sys.unraisablehook is not None
    assert not any(t.name == "sparsejax-signals" and t.is_alive() for t in threading.enumerate())
    assert out.read_text() == "previous\n" and list(tmp_path.iterdir()) == [out]
