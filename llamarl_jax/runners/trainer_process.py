"""The run loop of a trainer process in a multi-process run (the protocol: `multiprocess/protocol.py`).

  trainer thread:    wait for batch s (R(s), delivered by the transfer thread) -> lag check ->
                     TrainerExecutor.step -> stage W(s + 1) (cast + reshard into the generator layout,
                     dispatched before the next step donates the params) -> StepRecorder
  transfer thread:   walks `schedule.transfer_schedule`: W(v) marks version v staged in the store
                     (trainer leader; LoRA: "base" when the frozen base goes first) and sends it; R(k) reads batch k's facts from the store and
                     receives its arrays straight into the trainer's batch shardings
After an exact resume the first versions sent are the checkpoint's generator weights (`RunState.kept`).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

from llamarl_jax.config import RunConfig
from llamarl_jax.batch import ScoredBatch
from llamarl_jax.multiprocess.protocol import run_key
from llamarl_jax.multiprocess.runtime import Slots, Worker, raise_failed, wait_key
from llamarl_jax.runners.common import Executors, RunState, StepRecorder, progress_bar, show_progress
from llamarl_jax.schedule import check_lag, keeps_versions, transfer_schedule


def run(ex: Executors, state: RunState, recorder: StepRecorder, config: RunConfig, num_steps: int, *,
        progress: bool = False) -> tuple[RunState, list[dict]]:
  """Train `num_steps` steps from `state`; returns the new state and the steps' metrics."""
  mp, sched = ex.mp, config.schedule
  state = state.started()
  start, run_id, first = state.step, mp.new_run(), state.first_version
  ops = transfer_schedule(start, num_steps, sched.max_policy_lag, first)
  sent_versions = {v for op, v in ops if op == "W"}
  leader = mp.me == mp.roles.trainer_leader
  stop = threading.Event()
  staged, batches = Slots(), Slots()
  timeout = sched.step_timeout_s
  worker = Worker(lambda: _transfer(mp, ops, run_id, staged, batches, stop, timeout), "transfer", stop)
  for v in sorted(sent_versions):
    if v < start:  # an exact resume: the generator weights of versions before `start`, from the checkpoint
      staged.put(v, state.kept[v])
  keep = keeps_versions(sched.max_policy_lag, sched.version_schedule)

  def stage(s: RunState) -> RunState:
    """After step s.step - 1: stage its weights if they are sent, or a checkpoint may hold them."""
    version = s.step
    if version in sent_versions or keep:
      wire = mp.weights.stage(ex.trainer.params)
      if keep:
        s = s.keep(version, wire, sched.max_policy_lag)
      if version in sent_versions:
        staged.put(version, wire)
    return s

  mp.stage_base()  # LoRA: the frozen base goes with the first push when it changed (a warm start, a restore)
  state = stage(state)
  worker.start()
  bar = progress_bar(progress, num_steps)
  steps: list[dict] = []
  finished = interrupted = False
  try:
    for s in range(start, start + num_steps):
      t0 = time.perf_counter()
      try:
        arrays, meta = batches.pop(s, stop, timeout, "batch")
      except Exception:
        raise_failed([worker])
        raise
      t1 = time.perf_counter()
      check_lag(meta["lag"], s, sched.max_policy_lag)
      train_metrics = ex.trainer.step(ScoredBatch.from_train_arrays(arrays))
      t2 = time.perf_counter()
      state = stage(dataclasses.replace(state, step=s + 1, data_state=meta["data_state"]))
      t3 = time.perf_counter()
      sync = _sync_metrics(meta["sync"], mp.weights.nbytes, state.step)
      metrics = recorder.record(state, batch=meta["metrics"], train=train_metrics, sync=sync, lag=meta["lag"],
                                train_tokens=meta["tokens"], times=(t0, t1, t2, t3),
                                generator_times=meta["generator_times"], reward_times=meta["reward_times"],
                                dropped=0, occupancy=len(batches))
      steps.append(metrics)
      if leader and s - 2 >= start:  # every trainer process has read batch s - 2's facts by now
        mp.kv.delete(run_key(run_id, "batch", s - 2))
      show_progress(bar, metrics)
    worker.join(timeout)
    raise_failed([worker])
    finished = True
  except KeyboardInterrupt:  # Ctrl-C, or SIGTERM routed here by scripts/train.py
    interrupted = True
    raise
  finally:
    stop.set()
    if bar is not None:
      bar.close()
    # Every trainer process writes its shards of a checkpoint together: at the end, and on an interrupt
    # (which reaches them all), as the one-process runner does. After another failure a peer may be gone
    # and never join the write; the newest periodic checkpoint stands.
    if finished or interrupted:
      recorder.finish(state, interrupted=interrupted)
  return state, steps


def _transfer(mp, ops, run_id: int, staged: Slots, batches: Slots, stop: threading.Event, timeout: float) -> None:
  """The transfer thread: walks `ops` (`schedule.transfer_schedule`) in order. W(v): sends the staged
  version v (the trainer leader first marks it staged in the store); R(k): reads batch k's facts from
  the store and receives its arrays into `batches`."""
  leader = mp.me == mp.roles.trainer_leader
  for op, i in ops:
    if op == "W":
      wire = staged.pop(i, stop, timeout, "staged policy version")
      if leader:  # before the send: a send may block until its receive is issued (as NCCL's does)
        mp.kv.set(run_key(run_id, "staged", i), mp.staged_mark())
      mp.weights.send(wire)
    else:
      meta = json.loads(wait_key(mp.kv, run_key(run_id, "batch", i), stop, timeout))
      arrays = mp.rows(meta["shapes"]).send(None)
      batches.put(i, (arrays, meta))


def _sync_metrics(received: dict, nbytes: int, version: int) -> dict:
  """The step's sync metrics: `received`, the generator's last receive before it sent the batch."""
  return {"sync/seconds": received.get("seconds", 0.0), "sync/bytes": float(nbytes),
          "sync/gbps": received.get("gbps", 0.0), "sync/version": float(version)}
