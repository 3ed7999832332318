"""A trainer process's side of a multi-process run (the protocol: `protocol.py`).

  controller thread: wait for batch s (R(s), delivered by the transfer thread) -> TrainerExecutor.step
                     -> stage W(s + 1) (cast + reshard into the generator layout, dispatched before the
                     next step donates the params) -> metrics, checkpoints
  transfer thread:   walks `transfer_schedule`: W(v) marks version v staged in the store (trainer
                     leader) and sends it; R(k) reads batch k's facts from the store and receives
                     its arrays straight into the trainer's batch shardings
After an exact resume the first versions sent are the checkpoint's generator weights (`_recent_gen`).
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
  start, run_id, first = c.step, mp.new_run(), c._first_version
  ops = transfer_schedule(start, num_steps, c.max_policy_lag, first)
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
  for v in sorted(sent_versions):
    if v < start:  # an exact resume: the generator weights of versions before `start`, from the checkpoint
      staged.put(v, c._recent_gen[v])
  end = start + num_steps

  def stage(version: int) -> None:
    """After step version - 1: stage the weights if they are sent, or a checkpoint will hold them."""
    keep = _kept_for_checkpoint(c, version, end)
    if version in sent_versions or keep:
      wire = mp.weights.stage(c.trainer.params)
      if keep:
        c._remember_gen_weights(version, wire)
      if version in sent_versions:
        staged.put(version, wire)

  stage(start)
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
                             group_ids=None, policy_version=None,
                             token_versions=arrays["token_versions"])
      train_metrics = c.trainer.step(ScoredBatch(rollout=rollout, rewards=None, advantages=arrays["advantages"]))
      t2 = time.perf_counter()
      c.step = s + 1
      c.last_data_state = meta["data_state"]
      stage(c.step)
      t3 = time.perf_counter()
      received = meta["sync"]  # the generator's last receive before it sent this batch
      sync = {"sync/seconds": received.get("seconds", 0.0), "sync/bytes": float(mp.weights.nbytes),
              "sync/gbps": received.get("gbps", 0.0), "sync/version": float(c.step)}
      if meta["lag"]["policy/lag_max"] > c.max_policy_lag or meta["lag"]["policy/lag_min"] < 0:
        raise AssertionError(f"policy lag {meta['lag']['policy/lag_max']} outside [0, {c.max_policy_lag}] at step {s}")
      metrics = c._finish_step(meta["metrics"], train_metrics, sync, meta["lag"], meta["tokens"],
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


def _kept_for_checkpoint(c, version: int, end: int) -> bool:
  """Whether a checkpoint of this run, or the next `run` call, will need `version`'s generator weights
  (a checkpoint at step r, like a run starting at r, needs versions r - max_policy_lag .. r - 1):
  checkpoints come every `checkpoint_every` steps, and the run's `end` is where a next `run` call
  (e.g. after an evaluation, `experiment.run_with_evals`) or a checkpoint starts. Only those are
  kept, on the trainer's devices."""
  if c.version_schedule != "fixed" or not c.max_policy_lag:
    return False
  return any((c.checkpoint_every and (version + j) % c.checkpoint_every == 0) or version + j == end
             for j in range(1, c.max_policy_lag + 1))


def _progress(c, num_steps: int):
  if not (c.progress and c.is_main):
    return None
  from tqdm.auto import tqdm
  return tqdm(total=num_steps, desc="RL", dynamic_ncols=True)

