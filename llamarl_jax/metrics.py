"""Metrics: one JSONL line per step, TensorBoard scalars (tensorboardX), optional wandb.

Names follow cleanRL's `group/name` habit: `reward/mean`, `policy/ratio_max`, `time/generate_busy`.

Resume: `MetricsLogger(..., rewind_to=step)` makes the logs continue from the restored checkpoint, so
every step appears once: JSONL rows with a larger step (logged by the interrupted run after its last
checkpoint, or a line cut short by a kill) move to `metrics.dropped.jsonl`, and TensorBoard is told to
purge its events from step `rewind_to + 1` on (`purge_step`). `rewind_to=START` starts the logs over
(a run restarted from scratch keeps nothing of an attempt that left no checkpoint).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Mapping

START = -(2**62)  # `rewind_to` value that drops every row (SFT logs at negative steps)
KEEP = 10_000  # entries a run keeps of a history or timeline (a long run must not grow without bound)


def append_bounded(items: list, item, keep: int = KEEP) -> None:
  """Append `item`; once `items` holds 2 * keep entries, drop all but the newest `keep` (amortised O(1))."""
  items.append(item)
  if len(items) >= 2 * keep:
    del items[:-keep]


def _plain(v):
  try:
    v = float(v)
  except (TypeError, ValueError):
    return None
  return v if math.isfinite(v) else str(v)


class MetricsLogger:

  def __init__(self, run_dir: str | os.PathLike, *, tensorboard: bool = True, wandb_project: str | None = None,
               config: Mapping | None = None, rewind_to: int | None = None):
    self.run_dir = Path(run_dir)
    self.run_dir.mkdir(parents=True, exist_ok=True)
    self.jsonl_path = self.run_dir / "metrics.jsonl"
    self.dropped_rows = rewind_jsonl(self.jsonl_path, rewind_to) if rewind_to is not None else 0
    self._jsonl = open(self.jsonl_path, "a", buffering=1)
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter
      tb_dir = self.run_dir / "tb"
      purge = rewind_to + 1 if rewind_to is not None and any(tb_dir.glob("events.out.tfevents.*")) else None
      self._tb = SummaryWriter(str(tb_dir), purge_step=purge)
    self._wandb = None
    if wandb_project:
      try:
        import wandb
      except ImportError:
        print("wandb is not installed; logging to JSONL and TensorBoard only")
      else:
        self._wandb = wandb.init(project=wandb_project, dir=str(self.run_dir), config=dict(config or {}))

  def log(self, step: int, metrics: Mapping[str, float]) -> None:
    row = {"step": int(step)}
    row.update({k: p for k, v in metrics.items() if (p := _plain(v)) is not None})
    self._jsonl.write(json.dumps(row) + "\n")
    if self._tb is not None:
      for k, v in row.items():
        if k != "step" and isinstance(v, float):
          self._tb.add_scalar(k, v, step)
    if self._wandb is not None:
      self._wandb.log(row, step=step)

  def close(self) -> None:
    self._jsonl.close()
    if self._tb is not None:
      self._tb.close()
    if self._wandb is not None:
      self._wandb.finish()


def rewind_jsonl(path: str | os.PathLike, step: int) -> int:
  """Keep the rows of `path` with step <= `step`; move the others (and unreadable lines) to
  `<name>.dropped.jsonl` beside it. Atomic (temporary file + rename). Returns the rows moved."""
  path = Path(path)
  if not path.exists():
    return 0
  keep, drop = [], []
  with open(path) as f:
    for line in f:
      if not line.strip():
        continue
      try:
        row_step = json.loads(line)["step"]
        ok = row_step <= step
      except (ValueError, KeyError, TypeError):  # a line cut short by a kill
        ok = False
      (keep if ok else drop).append(line if line.endswith("\n") else line + "\n")
  if drop:
    with open(path.with_name(path.stem + ".dropped.jsonl"), "a") as f:
      f.writelines(drop)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
      f.writelines(keep)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  return len(drop)

