"""Metrics: one JSONL line per step, TensorBoard scalars (tensorboardX), optional wandb.

Names follow cleanRL's `group/name` habit: `reward/mean`, `policy/ratio_max`, `time/generate`.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Mapping


def _plain(v):
  try:
    v = float(v)
  except (TypeError, ValueError):
    return None
  return v if math.isfinite(v) else str(v)


class MetricsLogger:

  def __init__(self, run_dir: str | os.PathLike, *, tensorboard: bool = True, wandb_project: str | None = None,
               config: Mapping | None = None):
    self.run_dir = Path(run_dir)
    self.run_dir.mkdir(parents=True, exist_ok=True)
    self.jsonl_path = self.run_dir / "metrics.jsonl"
    self._jsonl = open(self.jsonl_path, "a", buffering=1)
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(str(self.run_dir / "tb"))
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


def read_jsonl(path: str | os.PathLike) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]
