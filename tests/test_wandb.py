"""Weights & Biases beside JSONL and TensorBoard, offline (no network): what a run writes, read back
from W&B's own log file (tests/wandb_records.py), not from the logger's memory."""

import json

import pytest

from llamarl_jax.metrics import MetricsLogger, flatten
from wandb_records import run_contents

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_offline_run_holds_the_config_every_row_and_the_summary(tmp_path, monkeypatch):
  monkeypatch.setenv("WANDB_SILENT", "true")
  logger = MetricsLogger(tmp_path, tensorboard=False, wandb_project="llamarl-test", wandb_mode="offline",
                         config={"train": {"lr": 1e-5, "loss": "aipo"}, "seed": 3})
  logger.log(1, {"reward/mean": 0.25, "time/step": 2.0})
  logger.log(2, {"reward/mean": 0.5, "time/step": float("nan")})  # not finite: JSONL keeps it as a string
  logger.log_summary({"time_breakdown": {"parts": {"sft": {"seconds": 3.0, "share": 0.3}}, "wall_seconds": 10.0},
                      "memory_plan": {"totals": {"total": 1024}, "device": "cpu", "fits": True}})
  logger.close()
  run = run_contents(tmp_path)
  assert run["config"] == {"train": {"lr": 1e-5, "loss": "aipo"}, "seed": 3}
  rows = [{k: v for k, v in h.items() if k in ("_step", "reward/mean", "time/step")} for h in run["history"]]
  assert rows == [{"_step": 1, "reward/mean": 0.25, "time/step": 2.0}, {"_step": 2, "reward/mean": 0.5}]
  assert run["summary"]["time_breakdown/parts/sft/seconds"] == 3.0
  assert run["summary"]["time_breakdown/wall_seconds"] == 10.0
  assert run["summary"]["memory_plan/totals/total"] == 1024.0 and run["summary"]["memory_plan/fits"] == 1.0
  assert "memory_plan/device" not in run["summary"]  # strings stay in summary.json
  jsonl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert jsonl[1] == {"step": 2, "reward/mean": 0.5, "time/step": "nan"}


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, monkeypatch):
  monkeypatch.setenv("WANDB_SILENT", "true")
  first = MetricsLogger(tmp_path, tensorboard=False, wandb_project="p", wandb_mode="offline")
  run_id = (tmp_path / "wandb_run_id").read_text()
  first.close()
  second = MetricsLogger(tmp_path, tensorboard=False, wandb_project="p", wandb_mode="offline", rewind_to=0)
  assert second._wandb.id == run_id
  second.close()


def test_flatten_keeps_numeric_leaves_under_joined_keys():
  assert flatten({"a": {"b": 1, "c": "x", "d": {"e": 2.5}}, "f": None, "g": True}) == {"a/b": 1.0, "a/d/e": 2.5,
                                                                                        "g": 1.0}


def test_a_wrong_mode_is_named(tmp_path):
  with pytest.raises(ValueError, match="wandb_mode must be one of .*'offline'.*got 'ofline'"):
    MetricsLogger(tmp_path, tensorboard=False, wandb_project="p", wandb_mode="ofline")
