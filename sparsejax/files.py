"""Output files of the jobs: checked before the work, replaced only when complete, never on
an interrupted run; and the Ctrl-C / SIGTERM handling of the command line.

An output path must be a regular file or not exist yet: a device, FIFO or directory there is
refused (renaming a temporary file onto `/dev/null` would replace the device). A symlink is
written through: its target is replaced, the link stays.
"""
from __future__ import annotations

# Imported first by the package when run as the command line (`guard_startup`): only cheap
# modules here, so the guard is in place within milliseconds of the interpreter starting.

import errno
import os
import signal
import stat
import sys
import threading
from collections.abc import Callable
from pathlib import Path


def _kind(mode: int) -> str:
    return ("a directory" if stat.S_ISDIR(mode) else "a character device" if stat.S_ISCHR(mode)
            else "a block device" if stat.S_ISBLK(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")


def output_target(path: str | Path, flag: str = "output") -> Path:
    """The file an output at `path` really writes: `path` with its symlinks resolved. ValueError
    when something other than a regular file is there."""
    path = Path(path)
    target = Path(os.path.realpath(path))
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return target
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot be inspected ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        shown = path if target == path.absolute() else f"{path} (-> {target})"
        raise ValueError(f"{flag} {shown} is {_kind(mode)}: expected a regular file path (an "
                         "output is replaced by a complete new file, which a device, FIFO or "
                         "directory cannot be)")
    return target


def check_writable(path: str | Path, flag: str, *, directory: bool = False) -> Path:
    """ValueError naming `flag` unless `path` (a file, or with `directory` a folder that may
    not exist yet) can be written; run before any model work so no result is lost. Returns the
    path to write (for a file: its symlinks resolved, see `output_target`)."""
    path = Path(path)
    if directory:
        existing = next(p for p in (path, *path.parents) if p.exists())
        if not existing.is_dir():
            raise ValueError(f"{flag} {path}: {existing} is a file, expected a directory "
                             "(or a path where one can be created)")
        if not os.access(existing, os.W_OK | os.X_OK) or _read_only_fs(existing):
            raise ValueError(f"{flag} {path}: {existing} is not a writable directory")
        _try_create(existing, flag, path)
        return path
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a directory, expected a file path")
    target = output_target(path, flag)
    parent = target.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or _read_only_fs(parent) or (
            target.exists() and not os.access(target, os.W_OK)):
        raise ValueError(f"{flag} {path}: not writable")
    _try_create(parent, flag, path)
    return target


def _try_create(directory: Path, flag: str, path: Path) -> None:
    """Create and remove an empty file in `directory`: the one test of writability that root,
    read-only mounts and pseudo file systems (/proc, /sys) cannot fool."""
    probe = directory / f".{os.urandom(4).hex()}.write-test"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write in {directory} ({e.strerror})") from None
    probe.unlink(missing_ok=True)


def _read_only_fs(directory: Path) -> bool:
    """True on a read-only file system (root passes os.access there)."""
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def check_outputs(outputs: dict[str, str | Path | None]) -> dict[str, Path]:
    """{flag: path} -> {flag: path to write}: each checked (`check_writable`), and no two on
    one file (the second would overwrite the first)."""
    checked = {flag: check_writable(path, flag) for flag, path in outputs.items() if path}
    seen: dict[Path, str] = {}
    for flag, target in checked.items():
        if target in seen:
            raise ValueError(f"{seen[target]} and {flag} both name {outputs[flag]}: the second "
                             "would overwrite the first; give them different paths")
        seen[target] = flag
    return checked


def read_text(path: str | Path, flag: str, *, max_bytes: int = 1 << 30) -> str:
    """The UTF-8 text of an input file a flag names; ValueError naming the flag and the file
    when it is missing, not a regular file, too large or not text."""
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{flag} {path} is {_kind(st.st_mode)}: expected a text file")
    if st.st_size > max_bytes:
        raise ValueError(f"{flag} {path} holds {st.st_size} bytes: expected at most {max_bytes}")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at "
                         f"offset {e.start}): expected a text file") from None
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror}") from None


def write_atomic(path: str | Path, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` into a temporary file beside the target, then rename it onto the target: an
    existing file is replaced only by a complete new one, and not at all once the run was
    interrupted (`interrupted()`). A symlink is written through (its target replaced, the link
    kept); a device, FIFO or directory at `path` is refused. Errors name `path`."""
    path = Path(path)
    target = output_target(path)
    tmp = target.with_name(f".{target.stem}.{os.urandom(4).hex()}.tmp{target.suffix}")
    try:
        write(tmp)
        if interrupted():
            raise Interrupted(_state["signal"])
        os.replace(tmp, target)
    except OSError as e:
        if e.errno is None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_atomic(path, lambda tmp: tmp.write_text(text))


# ---- Ctrl-C and SIGTERM ----------------------------------------------------------------------
class Interrupted(KeyboardInterrupt):
    """The run was stopped by a signal (SIGINT or SIGTERM); its exit status is 128 + signal."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def status(self) -> int:
        return 128 + self.signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


_state: dict = {"signal": None, "handled": threading.Event(), "ran": False}
GRACE_S = 5.0   # after a signal, how long the run may take to stop before it is ended


def interrupted() -> bool:
    """True once SIGINT or SIGTERM arrived while the active `handle_signals` block runs."""
    return _state["signal"] is not None


class handle_signals:
    """Context manager for a command: SIGINT and SIGTERM raise `Interrupted` in the main thread
    (and stop every later `write_atomic` from replacing an output). The exception can be lost
    where Python ignores exceptions (a gc callback such as JAX's) and cannot be raised while
    the main thread is inside a long native call (an XLA compile): a watcher thread, woken by
    the signal itself (`signal.set_wakeup_fd`), raises it again every half second and, if the
    run has not stopped after `GRACE_S`, calls `on_timeout(Interrupted)` (the command line
    prints its message and exits at once)."""

    def __init__(self, on_timeout: Callable[[Interrupted], None] | None = None):
        self.on_timeout = on_timeout

    def __enter__(self):
        self.active = threading.current_thread() is threading.main_thread()
        _state["signal"] = None
        _state["handled"].clear()
        if not self.active:
            return self
        _state["ran"] = True    # from here on `guard_startup`'s handler is past the start
        self.previous, self.previous_wakeup, self.watcher = {}, None, None
        self.previous_unraisable = sys.unraisablehook
        self.read_fd, self.write_fd = os.pipe()
        try:
            # The wakeup pipe and its watcher first, the handlers last: a signal arriving from
            # the moment they are in place is both raised and re-raised (before it, the
            # handler already there, e.g. `guard_startup`'s, takes it).
            os.set_blocking(self.write_fd, False)
            self.previous_wakeup = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
            sys.unraisablehook = self._unraisable
            self.watcher = threading.Thread(target=self._watch, daemon=True,
                                            name="sparsejax-signals")
            self.watcher.start()
            for s in (signal.SIGINT, signal.SIGTERM):
                self.previous[s] = signal.getsignal(s)
                signal.signal(s, self._on_signal)
        except BaseException:       # a signal raised here: the caller gets it, nothing is left set
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        if not self.active:
            return False
        _state["handled"].set()
        if self.previous_wakeup is not None:
            signal.set_wakeup_fd(self.previous_wakeup)
        sys.unraisablehook = self.previous_unraisable
        for s, handler in self.previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        if self.watcher is not None:
            os.write(self.write_fd, b"\0")      # wakes the watcher, which then ends
            self.watcher.join(timeout=1)
        for fd in (self.read_fd, self.write_fd):
            os.close(fd)
        # The signal stopped this command only: later writes in this process (a library
        # caller's, a test's) are not refused for it.
        _state["signal"] = None
        return False

    def _unraisable(self, info):
        # An Interrupted lost in a gc callback is raised again by the watcher: no traceback.
        if not isinstance(info.exc_value, Interrupted):
            self.previous_unraisable(info)

    @staticmethod
    def _on_signal(signum, frame):
        if _state["signal"] is None:
            _state["signal"] = signum
        raise Interrupted(_state["signal"])

    def _watch(self):
        import _thread

        while True:
            try:
                data = os.read(self.read_fd, 64)
            except OSError:
                return
            if _state["handled"].is_set() or not data:
                return
            signum = next((b for b in data if b in (signal.SIGINT, signal.SIGTERM)), None)
            if signum is None:
                continue
            for _ in range(int(GRACE_S / 0.5)):
                if _state["handled"].wait(0.5):
                    return
                if _state["signal"] is not None:    # raised, but not stopping the run: again
                    _thread.interrupt_main(_state["signal"])
            if not _state["handled"].is_set() and self.on_timeout is not None:
                self.on_timeout(Interrupted(_state["signal"] or signum))


def started_as_command(argv: list[str] | None = None,
                       orig_argv: list[str] | None = None) -> bool:
    """True when this process is the command line: the `sparsejax` program, or `python [OPTIONS]
    -m sparsejax` (while the package is imported then, `sys.argv[0]` is "-m"; the module is
    read from `sys.orig_argv`, past interpreter options such as `-u`, `-X importtime`,
    `-W ignore`, and in their joined forms `-um sparsejax`, `-msparsejax`)."""
    argv = sys.argv if argv is None else argv
    orig_argv = getattr(sys, "orig_argv", []) if orig_argv is None else orig_argv
    if argv and Path(argv[0]).name == "sparsejax":
        return True
    args = iter(orig_argv[1:])
    for arg in args:
        if arg == "--check-hash-based-pycs":
            next(args, None)
            continue
        if not arg.startswith("-") or arg in ("-", "--") or arg.startswith("--"):
            return False                # a script, stdin, or an option that ends the line
        for i, flag in enumerate(arg[1:], start=1):
            if flag in "mc":
                module = arg[i + 1:] or next(args, "")
                return flag == "m" and module in ("sparsejax", "sparsejax.__main__")
            if flag in "XW":            # takes a value: the rest of this word, else the next
                if i == len(arg) - 1:
                    next(args, None)
                break
    return False


def guard_startup() -> None:
    """Until `handle_signals` takes over, SIGINT and SIGTERM end the program at once with one
    line and 128 + the signal: nothing has been written yet, and the KeyboardInterrupt Python
    raises by default is lost when it lands in a gc callback (JAX's), letting the run go on.

    Taken also when the parent left them ignored (SIG_IGN: any `command &` of a shell script
    or CI step, which `handle_signals` takes over anyway) or blocked: else a signal sent while
    the program starts (its imports take seconds on a loaded machine) is dropped and the run
    goes on to replace its outputs. After the command (`handle_signals` gives the signals
    back to this handler), a signal while the interpreter exits ends it the same way, saying
    so: what the command wrote was complete before."""
    def stop(signum, frame):
        when = ("exiting: stopped after the command ended" if _state["ran"] else
                "starting: stopped, nothing written")
        try:
            os.write(2, f"sparsejax: interrupted by {signal.Signals(signum).name} while "
                     f"{when}\n".encode())
        finally:
            os._exit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(s) in (signal.default_int_handler, signal.SIG_DFL,
                                       signal.SIG_IGN):
                signal.signal(s, stop)
        if hasattr(signal, "pthread_sigmask"):     # POSIX
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def mark_handled() -> None:
    """The command caught its `Interrupted`: the watcher stops re-raising it."""
    _state["handled"].set()


def strerror_of(e: OSError) -> str:
    """'PATH: reason' of an OSError, with what to do about a full disk or missing permission."""
    where = e.filename or "a file"
    hint = {errno.ENOSPC: ": the disk is full; free space or write elsewhere",
            errno.EDQUOT: ": the disk quota is exhausted; free space or write elsewhere",
            errno.EROFS: ": read-only file system; write elsewhere",
            errno.EACCES: ": permission denied (check the path and its permissions)",
            errno.EPERM: ": not permitted (check the path and its permissions)"}
    return f"{where}: {e.strerror or e}" + hint.get(e.errno, "")
