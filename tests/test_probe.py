"""The bad-input probe (tests/probe_cli.py): every case as a user would meet it, in
subprocesses with timeouts; none may hang, crash, lose data, pass silently or refuse only
after the long work."""
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).with_name("probe_cli.py")


def test_probe_finds_no_hang_crash_data_loss_or_silent_acceptance():
    done = subprocess.run([sys.executable, str(PROBE), "--workers", "2"], capture_output=True,
                          text=True, timeout=420)
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "UNCLEAR" not in done.stdout.split("\n", 1)[1], done.stdout
