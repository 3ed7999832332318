"""Metrics: one JSONL line per step, TensorBoard scalars (tensorboardX), optional Weights & Biases.

Names follow cleanRL's `group/name` habit: `reward/mean`, `policy/ratio_max`, `time/generate_busy`.

Weights & Biases (`wandb_project`; the `wandb` extra): the run's configuration as the W&B config, every
logged row as its history, and the end-of-run sections (`log_summary`: the time breakdown, the memory
plan) in its summary, flattened to `section/key`. `wandb_mode="offline"` writes the run under
`<run_dir>/wandb/` with no network (`wandb sync` uploads it later); None takes W&B's own default
(`WANDB_MODE`, else online). The W&B run id is kept in `<run_dir>/wandb_run_id`, so a resumed run
continues the same W&B run.

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
import uuid
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


WANDB_MODES = (None, "online", "offline", "disabled")


def wandb_available() -> bool:
  """Whether the `wandb` package imports (the `wandb` extra: pip install -e '.[wandb]')."""
  import importlib.util
  return importlib.util.find_spec("wandb") is not None


def flatten(tree: Mapping, prefix: str = "") -> dict[str, float]:
  """{"a": {"b": 1.0, "c": "x"}} -> {"a/b": 1.0}: the numeric leaves of nested mappings, keys joined by '/'."""
  out = {}
  for k, v in tree.items():
    key = f"{prefix}{k}"
    if isinstance(v, Mapping):
      out.update(flatten(v, key + "/"))
    elif not isinstance(v, str) and (p := _plain(v)) is not None and isinstance(p, float):
      out[key] = p
  return out


def _plain(v):
  try:
    v = float(v)
  except (TypeError, ValueError):
    return None
  return v if math.isfinite(v) else str(v)


class MetricsLogger:
  """Logs rows of metrics by step to JSONL, TensorBoard and (with `wandb_project`) Weights & Biases.

  config: the run's settings, W&B's config. rewind_to: see the module docstring. breakdown: a run's
  `time_breakdown.TimeBreakdown`, whose "logging" part gets the seconds of every `log` (W&B's and
  TensorBoard's writes are not free, and a loaded machine makes them slower).
  """

  def __init__(self, run_dir: str | os.PathLike, *, tensorboard: bool = True, wandb_project: str | None = None,
               wandb_mode: str | None = None, config: Mapping | None = None, rewind_to: int | None = None,
               breakdown=None):
    self.breakdown = breakdown
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
      if not wandb_available():
        raise ImportError(f"wandb_project={wandb_project!r} needs the wandb package: pip install -e '.[wandb]'")
      import wandb

      id_file = self.run_dir / "wandb_run_id"
      run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
      id_file.write_text(run_id)
      self._wandb = wandb.init(project=wandb_project, dir=str(self.run_dir), config=dict(config or {}), id=run_id,
                               resume="allow", mode=wandb_mode)

  def log(self, step: int, metrics: Mapping[str, float]) -> None:
    if self.breakdown is None:
      self._log(step, metrics)
      return
    with self.breakdown.timed("logging"):
      self._log(step, metrics)

  def _log(self, step: int, metrics: Mapping[str, float]) -> None:
    row = {"step": int(step)}
    row.update({k: p for k, v in metrics.items() if (p := _plain(v)) is not None})
    self._jsonl.write(json.dumps(row) + "\n")
    if self._tb is not None:
      for k, v in row.items():
        if k != "step" and isinstance(v, float):
          self._tb.add_scalar(k, v, step)
    if self._wandb is not None:  # numbers only, as TensorBoard (JSONL keeps a non-finite value as a string)
      self._wandb.log({k: v for k, v in row.items() if k != "step" and isinstance(v, float)}, step=step)

  def log_summary(self, sections: Mapping[str, Mapping]) -> None:
    """End-of-run sections (e.g. {"time_breakdown": ..., "memory_plan": ...}) into W&B's run summary,
    flattened to `section/key` numbers (summary.json holds them for the other sinks)."""
    if self._wandb is not None:
      self._wandb.summary.update(flatten(sections))

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

