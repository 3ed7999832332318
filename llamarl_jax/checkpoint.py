"""Orbax checkpoints of a run: params, optimizer state, step, policy version, RNG, data position.

Orbax writes each step into a temporary directory and renames it into place when complete, so a
crash mid-save never corrupts the last good checkpoint; `max_to_keep` keeps the last K.
Arrays are restored straight onto the shardings of the `target` pytree (the trainer mesh).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


def _host_local(x) -> bool:
  """An array whose devices all belong to this process, in a job of several processes (a trainer
  mesh inside one process). Orbax only writes global arrays there, so such arrays go as numpy."""
  return jax.process_count() > 1 and isinstance(x, jax.Array) and x.is_fully_addressable


def _savable(x):
  return np.asarray(x) if _host_local(x) else x


class Checkpointer:
  """processes: the process ids that save and restore together (the trainer processes of a
  multi-process run; the first writes the metadata); None = every process (one process)."""

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 3, processes=None):
    self.directory = Path(directory).absolute()
    multiprocessing = ocp.options.MultiprocessingOptions()
    if processes is not None:
      processes = sorted(processes)
      self.directory.mkdir(parents=True, exist_ok=True)  # Orbax leaves it to us with a process subset
      multiprocessing = ocp.options.MultiprocessingOptions(primary_host=processes[0],
                                                           active_processes=set(processes),
                                                           barrier_sync_key_prefix="trainer")
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=processes is None,
                                             enable_async_checkpointing=False,
                                             multiprocessing_options=multiprocessing),
        item_names=("state", "meta"))

  def save(self, step: int, state: Any, meta: dict) -> None:
    """state: pytree of arrays (params, opt_state, ...); meta: JSON-able dict (versions, data position, rng)."""
    state = jax.tree.map(_savable, state)
    self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                     meta=ocp.args.JsonSave(meta)), force=True)
    self._manager.wait_until_finished()

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def restore(self, target: Any, step: int | None = None) -> tuple[int, Any, dict]:
    """Restore (step, state, meta); `target` gives structure, dtypes and shardings of the state."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint found in {self.directory}")
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=None if _host_local(x) else getattr(x, "sharding", None)),
        target)
    out = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                              meta=ocp.args.JsonRestore()))
    return step, out["state"], dict(out["meta"])

  def close(self) -> None:
    self._manager.close()
