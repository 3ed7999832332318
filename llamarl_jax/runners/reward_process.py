"""The run loop of a reward process in a multi-process run: the reward model on its own process group.

  controller thread: for each batch k of the run, in batch order: wait for its token rows in the store
                     (the generator leader publishes them as soon as batch k is generated, before its
                     rule rewards) -> `RewardModelExecutor.score_rows` on the reward mesh (every reward
                     process issues the same programs; the scores come out replicated) -> the reward
                     leader publishes the scores and their metrics
The generator processes combine the scores with the rule rewards (`RewardModelExecutor.combine`), as
one process does; the trainer processes only see the combined rewards and the metrics. Nothing
crosses between devices of different groups: rows and scores are kilobytes in the store
(`multiprocess/protocol.py`). A failure here (the model raises, returns non-finite scores) is this
process's error, which `distributed.run_process` publishes: every other process stops naming it.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

from llamarl_jax.config import RunConfig
from llamarl_jax.multiprocess.protocol import run_key
from llamarl_jax.multiprocess.runtime import wait_key
from llamarl_jax.runners.common import Executors, RunState


def run(ex: Executors, state: RunState, config: RunConfig, num_steps: int) -> RunState:
  """Score batches state.step .. state.step + num_steps - 1; returns the state after them."""
  mp = ex.mp
  state = state.started()
  start, run_id = state.step, mp.new_run()
  leader = mp.me == mp.roles.reward_leader
  running = threading.Event()  # never set: a failed peer ends this process (`distributed.FaultWatch`)
  timeout = config.schedule.step_timeout_s
  for k in range(start, start + num_steps):
    try:
      rows = json.loads(wait_key(mp.kv, run_key(run_id, "rm_rows", k), running, timeout))
    except TimeoutError:
      raise TimeoutError(f"batch {k}: no token rows from the generator leader (process "
                         f"{mp.roles.generator_leader}) within ScheduleConfig.step_timeout_s = {timeout:g} s: "
                         "generation or training is stuck, or a step is slower than that (then raise "
                         "step_timeout_s)") from None
    t0 = time.perf_counter()
    scores, metrics = ex.reward_model.score_rows(rows, k)
    ex.mark("reward", t0, time.perf_counter())
    if leader:  # every reward process has read rows k: scoring them took all of them
      mp.kv.set_json(run_key(run_id, "rm_scores", k), {"scores": [float(s) for s in scores], "metrics": metrics})
      mp.kv.delete(run_key(run_id, "rm_rows", k))
  return dataclasses.replace(state, step=start + num_steps)
