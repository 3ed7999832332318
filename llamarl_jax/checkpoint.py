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
import orbax.checkpoint as ocp


class Checkpointer:

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 3):
    self.directory = Path(directory).absolute()
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                             enable_async_checkpointing=False),
        item_names=("state", "meta"))

  def save(self, step: int, state: Any, meta: dict) -> None:
    """state: pytree of arrays (params, opt_state, ...); meta: JSON-able dict (versions, data position, rng)."""
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
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), target)
    out = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                              meta=ocp.args.JsonRestore()))
    return step, out["state"], dict(out["meta"])

  def close(self) -> None:
    self._manager.close()
