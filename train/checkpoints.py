"""Orbax checkpoints of a training run: one directory per step, each holding `state` (a
pytree) and `meta` (JSON), shared by pretraining and gate training.

Saves are synchronous: a save that fails stops the run at the step that made it, with an error
naming the directory. (Orbax's asynchronous save, when it fails, leaves threads waiting minutes
for a signal that never comes, and the process cannot exit.) Each save records a checksum of the
state and the record, because Orbax reads a bit-flipped array file back without complaint.
Resuming takes the newest step that reads back whole and matches its checksum; a damaged newer
step (missing or truncated files, a flipped bit, a stray empty directory) is named on stderr
and moved aside to `<step>.damaged`, so that the run can save that step again.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import zlib
from pathlib import Path

import jax
import numpy as np

logger = logging.getLogger(__name__)

CHECKSUM = "checksum"   # the meta key holding the checksum


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; the run stops rather than train on unsaved."""


def open_manager(directory: str | Path, every: int | None = None):
    """Orbax's manager of `directory`: saving every `every` steps (the directory is created),
    or only reading (None)."""
    import orbax.checkpoint as ocp

    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise ValueError(f"checkpoint_dir={str(directory)!r} is a file: expected a directory")
    if every is not None:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"checkpoint_dir={str(directory)!r} cannot be created: {e}") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"checkpoint_dir={str(directory)!r} is not writable")
    options = ocp.CheckpointManagerOptions(save_interval_steps=every or 1, max_to_keep=3,
                                           create=every is not None,
                                           enable_async_checkpointing=False)
    return ocp.CheckpointManager(path.resolve(), options=options)


def _checksum(state, meta: dict) -> str:
    """CRC-32 of the record's JSON and of every state leaf's dtype and bytes (it guards
    against damage on disk, not tampering; CRC-32 reads a GB in about a second)."""
    crc = zlib.crc32(json.dumps(meta, sort_keys=True).encode())
    for leaf in jax.tree.leaves(jax.device_get(state)):
        leaf = np.asarray(leaf)
        crc = zlib.crc32(np.ascontiguousarray(leaf).tobytes(),
                         zlib.crc32(leaf.dtype.str.encode(), crc))
    return f"crc32:{crc:08x}"


def save(manager, step: int, state, meta: dict, *, force: bool = False) -> None:
    """Write step `step` to disk; any failure raises CheckpointSaveError naming the directory."""
    import orbax.checkpoint as ocp

    meta = json.loads(json.dumps(meta))    # the form it reads back in
    meta[CHECKSUM] = _checksum(state, meta)
    try:
        manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                   meta=ocp.args.JsonSave(meta)), force=force)
    except Exception as e:
        raise CheckpointSaveError(f"saving the step-{step} checkpoint to {manager.directory} "
                                  f"failed ({type(e).__name__}: {e}); training stopped") from e


def restore(manager, abstract_state, *, set_aside_damaged: bool = False):
    """(state, meta) of the newest intact step, or None when there is no checkpoint.

    abstract_state: the state's shapes and dtypes (jax.eval_shape).
    set_aside_damaged: move damaged newer steps aside (a run about to save them again).
    Raises ValueError when every step is damaged."""
    import orbax.checkpoint as ocp

    damaged = []
    for step in sorted(manager.all_steps(), reverse=True):
        try:
            out = manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
            state, meta = out.state, dict(out.meta)
            stored = meta.pop(CHECKSUM, None)
            if stored is not None and stored != _checksum(state, meta):
                raise ValueError(f"checksum {stored} does not match the data read back")
        except Exception as e:   # Orbax and TensorStore raise many kinds
            damaged.append(step)
            logger.warning("checkpoint %s is damaged (%s: %s); trying the step before it",
                           Path(manager.directory) / str(step), type(e).__name__,
                           str(e).partition("\n")[0][:200])
            continue
        if damaged:
            logger.warning("using step %d of %s, the newest intact one", step, manager.directory)
            if set_aside_damaged:
                _move_aside(manager, damaged)
        return state, meta
    if damaged:
        raise ValueError(f"every checkpoint in {manager.directory} is damaged (steps "
                         f"{sorted(damaged)}): use another checkpoint directory")
    return None


def _move_aside(manager, steps) -> None:
    """Rename damaged step directories to `<step>.damaged` (kept for inspection) so that the
    run can write those steps again."""
    for step in steps:
        path = Path(manager.directory) / str(step)
        aside = path.with_name(f"{step}.damaged")
        if aside.exists():
            shutil.rmtree(aside)
        os.replace(path, aside)
        logger.warning("moved the damaged checkpoint %s aside to %s", path, aside)
    manager.reload()
