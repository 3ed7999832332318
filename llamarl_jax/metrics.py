"""Metrics: one JSONL line per step, TensorBoard scalars (tensorboardX), optionally Weights & Biases.

Weights & Biases (`wandb_project`; the `wandb` extra): the run's config at start, every logged row as
its history, and `summarize`'s results (the time breakdown, the memory plan) in its summary. Offline by
default (`wandb_mode`): the run is written under `run_dir/wandb` without a network or an account, for
`wandb sync` later; 'online' streams it.

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
WANDB_MODES = ("offline", "online", "disabled")


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
  """Logs rows of metrics by step to JSONL, TensorBoard and (with `wandb_project`) Weights & Biases.

  config: the run's settings, recorded by wandb at start. rewind_to: see the module docstring.
  """

  def __init__(self, run_dir: str | os.PathLike, *, tensorboard: bool = True, wandb_project: str | None = None,
               wandb_mode: str = "offline", config: Mapping | None = None, rewind_to: int | None = None):
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
      if wandb_mode not in WANDB_MODES:
        raise ValueError(f"wandb_mode must be one of {WANDB_MODES}, got {wandb_mode!r}")
      try:
        import wandb
      except ImportError:
        raise ImportError(f"wandb_project={wandb_project!r} needs Weights & Biases, which is not installed: "
                          "pip install -e '.[wandb]' (or leave run_experiment.wandb_project unset)") from None
      self._wandb = wandb.init(project=wandb_project, dir=str(self.run_dir), config=dict(config or {}),
                               mode=wandb_mode)

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

  @property
  def wandb_run(self):
    """The Weights & Biases run (None without `wandb_project`)."""
    return self._wandb

  def summarize(self, results: Mapping) -> None:
    """A run's results that are not per step (e.g. {"time_breakdown": ..., "memory_plan": ...}): in the
    wandb run's summary (JSONL and TensorBoard: the run directory's summary.json holds them)."""
    if self._wandb is not None:
      self._wandb.summary.update(dict(results))

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

