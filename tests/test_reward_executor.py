"""RewardExecutor: a reward function that raises, hangs, or kills its process never stops a run.

One executor (2 spawned workers, 1 s per-sample timeout) serves the whole module: worker start-up
is the slow part. Helper reward functions live in tests/reward_fns_for_tests.py (importable by the
workers).
"""

import importlib
import sys
import time

import numpy as np
import pytest

import reward_fns_for_tests as fns
from llamarl_jax.executors.reward import RewardExecutor
from llamarl_jax.rewards import register_reward

TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def executor():
  with RewardExecutor(fns.troublesome, num_workers=2, timeout_s=TIMEOUT_S) as ex:
    yield ex


def _alive(ex):
  return sum(w.proc.is_alive() for w in ex._workers)


def test_scores_a_normal_batch(executor):
  rewards, metrics = executor.score(["a", "b", "c"], ["a", "x", "c"])
  assert rewards.dtype == np.float32 and rewards.tolist() == [1.0, 0.0, 1.0]
  assert {k: metrics[k] for k in ("reward/errors", "reward/timeouts", "reward/worker_restarts")} == {
      "reward/errors": 0.0, "reward/timeouts": 0.0, "reward/worker_restarts": 0.0}
  assert metrics["time/reward"] > 0


def test_empty_batch(executor):
  rewards, metrics = executor.score([], [])
  assert rewards.shape == (0,) and metrics["reward/errors"] == 0


def test_exceptions_and_nan_score_zero_and_are_counted(executor):
  rewards, metrics = executor.score(["a", "raise", "b", "nan", "c"], ["a", "x", "b", "x", "c"])
  assert rewards.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]
  assert metrics["reward/errors"] == 2 and metrics["reward/worker_restarts"] == 0  # the worker survives


def test_hung_functions_time_out_and_their_workers_are_replaced(executor):
  t0 = time.perf_counter()
  rewards, metrics = executor.score(["hang", "a", "spin", "b", "c"], ["x", "a", "x", "b", "c"])
  elapsed = time.perf_counter() - t0
  assert rewards.tolist() == [0.0, 1.0, 0.0, 1.0, 1.0]
  assert metrics["reward/timeouts"] == 2 and metrics["reward/worker_restarts"] == 2
  assert elapsed < 4 * TIMEOUT_S  # both hangs run concurrently on the two workers, then get killed


def test_functions_that_kill_their_process(executor):
  rewards, metrics = executor.score(["a", "exit", "b", "kill", "c", "d"], ["a", "x", "b", "x", "c", "d"])
  assert rewards.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
  assert metrics["reward/errors"] == 2 and metrics["reward/worker_restarts"] == 2


def test_everything_at_once_then_the_pool_has_recovered(executor):
  bad = ["raise", "hang", "exit", "kill", "nan", "spin"]
  responses = [r for b in bad for r in (b, "ok")]
  rewards, metrics = executor.score(responses, ["ok"] * len(responses))
  assert rewards.tolist() == [0.0, 1.0] * len(bad)
  assert metrics["reward/errors"] == 4 and metrics["reward/timeouts"] == 2
  # later batches score normally, with the full complement of workers
  rewards, metrics = executor.score([str(i) for i in range(200)], [str(i) for i in range(100)] + ["x"] * 100)
  assert rewards.tolist() == [1.0] * 100 + [0.0] * 100
  assert metrics["reward/errors"] == metrics["reward/timeouts"] == metrics["reward/worker_restarts"] == 0
  assert _alive(executor) == 2
  assert executor.totals["timeouts"] >= 4 and executor.totals["errors"] >= 8


def test_the_timeout_is_per_sample_not_per_batch(executor):
  # 12 x 0.2 s on 2 workers: 1.2 s per worker, more than the timeout, but each sample is fast.
  rewards, metrics = executor.score(["sleep"] * 12, ["x"] * 12)
  assert rewards.tolist() == [1.0] * 12 and metrics["reward/timeouts"] == 0


def test_mismatched_lengths_raise(executor):
  with pytest.raises(ValueError, match="ground truths"):
    executor.score(["a"], [])


def test_a_reward_registered_by_name():
  register_reward("test_troublesome", fns.troublesome)
  with RewardExecutor("test_troublesome", num_workers=1, timeout_s=TIMEOUT_S) as ex:
    rewards, metrics = ex.score(["a", "raise"], ["a", "a"])
  assert rewards.tolist() == [1.0, 0.0] and metrics["reward/errors"] == 1


def test_inline_mode_counts_errors_in_process():
  with RewardExecutor(fns.troublesome, inline=True) as ex:
    rewards, metrics = ex.score(["a", "raise", "nan"], ["a", "x", "x"])
  assert rewards.tolist() == [1.0, 0.0, 0.0] and metrics["reward/errors"] == 2
  with RewardExecutor("math", inline=True) as ex:
    assert ex.score(["#### 5"], ["5"])[0].tolist() == [1.0]


def test_functions_workers_cannot_load_are_rejected_up_front(tmp_path, monkeypatch):
  with pytest.raises(ValueError, match="top level"):
    RewardExecutor(lambda r, g: 1.0, num_workers=1)
  (tmp_path / "vanishing_reward.py").write_text("def fn(r, g):\n  return 1.0\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  module = importlib.import_module("vanishing_reward")
  monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])  # workers cannot import it
  with pytest.raises(RuntimeError, match="could not be loaded"):
    RewardExecutor(module.fn, num_workers=1, startup_timeout_s=30)


def test_fork_is_refused_and_a_closed_executor_cannot_score():
  with pytest.raises(ValueError, match="fork"):
    RewardExecutor("math", mp_context="fork")
  ex = RewardExecutor("math", inline=True)
  ex.close()
  with pytest.raises(RuntimeError, match="closed"):
    ex.score(["1"], ["1"])


def test_a_leaking_reward_function_is_recycled_and_capped():
  """leaky_match keeps 1 MB per sample. Unchecked, 300 samples grow its worker from ~35 MB to ~335 MB;
  with worker_max_rss_mb=80 the worker is replaced between chunks (chunks of <= 32 samples, so it
  never exceeds 80 + 32 MB, plus slack for the interpreter), every recycle counted. A sample that
  asks for 1 GB at once hits the 400 MB hard cap: MemoryError, scored 0, counted, worker recycled."""
  with RewardExecutor(fns.leaky_match, num_workers=1, timeout_s=5.0, worker_max_rss_mb=80,
                      worker_memory_limit_mb=400) as ex:
    recycles, rss = 0, []
    for _ in range(3):
      rewards, m = ex.score(["a"] * 100, ["a"] * 100)
      assert rewards.tolist() == [1.0] * 100 and m["reward/errors"] == 0
      recycles += m["reward/worker_recycles"]
      rss.append(ex.worker_rss_mb()[0])
    assert recycles >= 2 and max(rss) < 80 + 32 + 16, (recycles, rss)
    rewards, m = ex.score(["a", "huge", "a"], ["a", "a", "a"])
    assert rewards.tolist() == [1.0, 0.0, 1.0]
    assert m["reward/errors"] == 1 and "MemoryError" in ex.recent_errors[-1]
    assert m["reward/worker_recycles"] >= 1 and m["reward/worker_restarts"] == 0
    assert ex.totals["worker_recycles"] == recycles + m["reward/worker_recycles"]


def test_worker_max_tasks_recycles_by_age():
  with RewardExecutor(fns.slow_match, num_workers=1, timeout_s=5.0, worker_max_tasks=4, max_chunk=2) as ex:
    rewards, m = ex.score(["a"] * 8, ["a"] * 8)
  assert rewards.tolist() == [1.0] * 8
  assert m["reward/worker_recycles"] == 2  # after samples 4 and 8


def test_memory_settings_are_checked():
  with pytest.raises(ValueError, match="worker_max_rss_mb must be > 0"):
    RewardExecutor(fns.slow_match, worker_max_rss_mb=0, inline=True)


def test_the_worker_side_imports_no_jax():
  """A reward worker process imports this module: it must stay free of JAX and Flax (hundreds of MB
  in each worker, past `worker_max_rss_mb` at once)."""
  import subprocess
  import sys
  code = "import sys, llamarl_jax.executors.reward; print(sorted(m for m in ('jax', 'flax') if m in sys.modules))"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
  assert out.stdout.strip() == "[]", out.stdout + out.stderr
