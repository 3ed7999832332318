"""A trainer process's side of a multi-process run (the protocol: `protocol.py`).

  controller thread: wait for batch s (R(s), delivered by the transfer thread) -> TrainerExecutor.step
                     -> stage W(s + 1) (cast + reshard into the generator layout, dispatched before the
                     next step donates the params) -> metrics, checkpoints
  transfer thread:   walks `transfer_schedule`: W(v) sends the staged version v (and the trainer leader
                     then marks it staged in the store); R(k) reads batch k's facts from the store and
                     receives its arrays straight into the trainer's batch shardings
"""

from __future__ import annotations

import json
import threading
import time

from llamarl_jax.generation.rollout import RolloutBatch, ScoredBatch
from llamarl_jax.multiprocess.protocol import Slots, Worker, raise_failed, run_key, transfer_schedule, wait_key


def run(c, num_steps: int) -> list[dict]:
  """`Controller.run` in a trainer process: train `num_steps` steps; returns their metrics."""
  mp = c.mp
  start, run_id = c.step, mp.new_run()
  ops = transfer_schedule(start, num_steps, c.max_policy_lag)
  sent_versions = {v for op, v in ops if op == "W"}
  leader = mp.me == mp.roles.trainer_leader
  stop = threading.Event()
  staged, batches = Slots(), Slots()
  timeout = c.step_timeout_s

  def transfer() -> None:
    for op, i in ops:
      if op == "W":
        wire = staged.pop(i, stop, timeout, "staged policy version")
        if leader:  # before the send: a send may block until its receive is issued (as NCCL's does)
          mp.kv.set(run_key(run_id, "staged", i), "1")
        mp.weights.send(wire)
      else:
        meta = json.loads(wait_key(mp.kv, run_key(run_id, "batch", i), stop, timeout))
        arrays = mp.rows(meta["shapes"]).send(None)
        batches.put(i, (arrays, meta))

  worker = Worker(transfer, "transfer", stop)
  if ops:
    staged.put(start, mp.weights.stage(c.trainer.params))
  worker.start()
  bar = _progress(c, num_steps)
  steps: list[dict] = []
  try:
    for s in range(start, start + num_steps):
      t0 = time.perf_counter()
      try:
        arrays, meta = batches.pop(s, stop, timeout, "batch")
      except Exception:
        raise_failed([worker])
        raise
      t1 = time.perf_counter()
      rollout = RolloutBatch(prompt_tokens=arrays["prompt_tokens"], prompt_mask=arrays["prompt_mask"],
                             response_tokens=arrays["response_tokens"], response_mask=arrays["response_mask"],
                             behaviour_logprobs=arrays["behaviour_logprobs"], lengths=None, finish_reason=None,
                             group_ids=None, policy_version=None)
      train_metrics = c.trainer.step(ScoredBatch(rollout=rollout, rewards=None, advantages=arrays["advantages"]))
      t2 = time.perf_counter()
      c.step = s + 1
      c.last_data_state = meta["data_state"]
      if c.step in sent_versions:
        staged.put(c.step, mp.weights.stage(c.trainer.params))
      t3 = time.perf_counter()
      received = meta["sync"]  # the generator's last receive before it sent this batch
      sync = {"sync/seconds": received.get("seconds", 0.0), "sync/bytes": float(mp.weights.nbytes),
              "sync/gbps": received.get("gbps", 0.0), "sync/version": float(c.step)}
      metrics = c._finish_step(meta["metrics"], train_metrics, sync, [s - meta["version"]], meta["tokens"],
                               (t0, t1, t2, t3), meta["generator_times"], meta["reward_times"], dropped=0,
                               occupancy=len(batches))
      steps.append(metrics)
      if leader and s - 2 >= start:  # every trainer process has read batch s - 2's facts by now
        mp.kv.delete(run_key(run_id, "batch", s - 2))
      if bar is not None:
        bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", acc=f"{metrics['reward/accuracy']:.2f}",
                        lag=f"{metrics['policy/lag_mean']:.1f}")
        bar.update(1)
    worker.join(timeout)
    raise_failed([worker])
  finally:
    stop.set()
    if bar is not None:
      bar.close()
  if c.checkpoint_every and c.checkpointer.latest_step() != c.step:
    c.save_checkpoint()
  return steps


def _progress(c, num_steps: int):
  if not (c.progress and c.is_main):
    return None
  from tqdm.auto import tqdm
  return tqdm(total=num_steps, desc="RL", dynamic_ncols=True)

