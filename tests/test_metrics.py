"""MetricsLogger's Weights & Biases output, offline (no network, no account): what a run logs is what
the offline run file holds, read back record by record (`wandb_offline`)."""

import pytest

from llamarl_jax.metrics import MetricsLogger


def test_an_offline_wandb_run_holds_the_config_the_rows_and_the_summary(tmp_path, monkeypatch):
  pytest.importorskip("wandb")
  import wandb_offline

  monkeypatch.setenv("WANDB_SILENT", "true")
  logger = MetricsLogger(tmp_path, tensorboard=False, wandb_project="llamarl-test",
                         config={"rollout": {"max_new_tokens": 8}, "max_policy_lag": 1})
  logger.log(1, {"reward/mean": 0.25, "time/step": 2.0, "time/wait_generate": 1.5, "note": "not a number"})
  logger.log(2, {"reward/mean": 0.5, "time/step": 1.0})
  logger.summarize({"memory_plan": {"totals": {"trainer + generator": 3e9}},
                    "time_breakdown": {"wall_seconds": 10.0}})
  logger.close()
  run = wandb_offline.read_run(tmp_path / "wandb")
  assert run["config"].get("rollout") == {"max_new_tokens": 8} and run["config"]["max_policy_lag"] == 1, run["config"]
  rows = [{k: v for k, v in r.items() if not k.startswith("_")} for r in run["history"]]
  assert rows == [{"step": 1, "reward/mean": 0.25, "time/step": 2.0, "time/wait_generate": 1.5},
                  {"step": 2, "reward/mean": 0.5, "time/step": 1.0}]  # non-numbers left out, as in JSONL
  assert [r["_step"] for r in run["history"]] == [1, 2]
  assert run["summary"]["memory_plan"] == {"totals": {"trainer + generator": 3e9}}
  assert run["summary"]["time_breakdown"] == {"wall_seconds": 10.0}


def test_a_wandb_mode_that_does_not_exist_is_refused(tmp_path):
  with pytest.raises(ValueError, match="wandb_mode must be one of"):
    MetricsLogger(tmp_path, tensorboard=False, wandb_project="p", wandb_mode="offlin")
