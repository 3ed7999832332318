"""The run loop of one process: generator, reward and trainer executors on three threads.

  generator thread:  GeneratorExecutor.run: wait for the scheduled policy version of batch k (exactly
                     max(v0, k - max_policy_lag) under 'fixed', schedule.py); draw prompts; sample on
                     the generator mesh -> RolloutBatch (host) with per-token policy versions
  reward thread:     decode, score in the RewardExecutor's process pool (and the reward model, when
                     there is one), advantages -> ScoredBatch
                     -> ReplayBuffer.put (blocks when full: backpressure)
  trainer (caller):  ReplayBuffer.get (drops data older than the lag bound) -> lag check ->
                     TrainerExecutor.step on the trainer mesh -> WeightSync.push (cast + device_put
                     reshard) -> StepRecorder (metrics, logs, checkpoints)

JAX dispatch releases the GIL, so generation and training compute at the same time on their meshes.
In colocated mode they take turns on one mesh (`Executors.device_turn`).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Callable

import numpy as np

from llamarl_jax.config import RunConfig
from llamarl_jax.executors.generator import Generated, Timer
from llamarl_jax.executors.scoring import score_generated
from llamarl_jax.replay import BufferClosed, ReplayBuffer
from llamarl_jax.runners.common import Executors, RunState, StepRecorder, progress_bar, show_progress
from llamarl_jax.schedule import check_lag, keeps_versions, lag_metrics, versions_kept
from llamarl_jax.time_breakdown import recent

log = logging.getLogger(__name__)


class ExecutorFailed(RuntimeError):
  """An executor thread raised; the run was shut down."""


class _Pipeline:
  """One run call's threads and queues (a new one per call: in-flight batches never outlive a run)."""

  def __init__(self, ex: Executors, config: RunConfig):
    self.ex, self.config = ex, config
    self.buffer = ReplayBuffer(config.schedule.buffer_capacity)
    self.scoring: queue.Queue = queue.Queue(maxsize=1)
    self.stop = threading.Event()
    self.errors: list[tuple[str, BaseException]] = []
    self.lock = threading.Lock()
    self.reward_timer = Timer()
    self.reward_status = ("not started", time.monotonic())
    self.lag = config.schedule.max_policy_lag
    self.keeps = keeps_versions(self.lag, config.schedule.version_schedule)
    self.threads: list[threading.Thread] = []

  def fail(self, who: str, e: BaseException) -> None:
    with self.lock:
      self.errors.append((who, e))
    self.shutdown()

  def shutdown(self) -> None:
    self.stop.set()
    self.buffer.close()
    self.ex.weights.close()

  def generate(self, start: int, first_version: int) -> None:
    def emit(item: Generated) -> bool:
      while not self.stop.is_set():
        try:
          self.scoring.put(item, timeout=0.2)
          return True
        except queue.Full:
          continue
      return False

    try:
      self.ex.generator.run(self.ex.weights, emit, self.stop, start_index=start, first_version=first_version)
    except BaseException as e:  # noqa: BLE001 - reported to the trainer thread
      self.fail("generator", e)

  def score(self) -> None:
    rollout_cfg = self.config.rollout
    try:
      while not self.stop.is_set():
        t0 = time.perf_counter()
        try:
          item: Generated = self.scoring.get(timeout=0.2)
        except queue.Empty:
          if self.reward_status[0] != "waiting for a generated batch":
            self.reward_status = ("waiting for a generated batch", time.monotonic())
          continue
        t1 = time.perf_counter()
        self.reward_status = (f"scoring batch {item.index}", time.monotonic())
        scored, metrics, texts = score_generated(item, self.ex.reward, self.ex.tokenizer,
                                                 samples_per_prompt=rollout_cfg.samples_per_prompt,
                                                 advantage_estimator=rollout_cfg.advantage_estimator,
                                                 overlong=rollout_cfg.overlong,
                                                 max_new_tokens=rollout_cfg.max_new_tokens,
                                                 reward_model=self.ex.reward_model)
        t2 = time.perf_counter()
        self.reward_timer.add(busy=t2 - t1, wait=t1 - t0)
        with self.lock:
          self.ex.mark("reward", t1, t2)
        version = int(np.min(item.rollout.policy_version))  # the oldest token: what the lag bound limits
        self.reward_status = (f"putting batch {item.index} into the replay buffer", time.monotonic())
        self.buffer.put(scored, version, meta={"index": item.index, "data_state": item.data_state,
                                               "metrics": metrics, "texts": texts[:2]})
    except BufferClosed:
      return
    except BaseException as e:  # noqa: BLE001
      self.fail("reward", e)

  def start(self, start: int, first_version: int) -> None:
    """The generator thread (batches `start`.. of the schedule from `first_version`) and the reward thread."""
    self.threads = [threading.Thread(target=self.generate, args=(start, first_version), name="generator", daemon=True),
                    threading.Thread(target=self.score, name="reward", daemon=True)]
    for t in self.threads:
      t.start()

  def close(self) -> None:
    """Shut down and join the threads (30 s each; one still running then is abandoned, with a warning)."""
    self.shutdown()
    for t in self.threads:
      t.join(timeout=30)
      if t.is_alive():
        status = self.ex.generator.status if t.name == "generator" else self.reward_status
        log.warning("the %s thread did not stop within 30 s (it was %s); it is abandoned (daemon)", t.name,
                    status[0])

  def remember(self, state: RunState, version: int) -> RunState:
    """Keep the generator weights of `version` (just pushed) while a checkpoint may need them."""
    if not self.keeps:
      return state
    params, newest = self.ex.weights.latest()
    assert newest == version, (newest, version)
    return state.keep(version, params, self.lag)

  def next_batch(self, step: int):
    """The replay buffer's next entry that step `step` may train on (within the lag bound); an executor's
    failure raises `ExecutorFailed`, no batch within `step_timeout_s` a TimeoutError with the stall report."""
    try:
      return self.buffer.get(min_version=step - self.lag, timeout=self.config.schedule.step_timeout_s)
    except BufferClosed as e:
      self.raise_if_failed(e)
      raise
    except TimeoutError:
      self.raise_if_failed(TimeoutError(self.stall_report(step)))
      raise

  def step_times(self, since: float, trained: tuple[float, float]) -> tuple[tuple, tuple, list]:
    """(generator seconds, reward seconds, the other threads' intervals since `since`) of the step that
    trained over `trained` (perf_counter start, end: marked on the timeline)."""
    with self.lock:
      self.ex.mark("train", *trained)
      gen_times = self.ex.generator.timer.take()
      reward_times = self.reward_timer.take()
      waited_on = recent(list(self.ex.generator.timeline), since) + recent(list(self.ex.timeline), since)
    return gen_times, reward_times, waited_on

  def raise_if_failed(self, cause: BaseException | None = None) -> None:
    with self.lock:
      errors = list(self.errors)
    if errors:
      who, e = errors[0]
      raise ExecutorFailed(f"{who} executor failed: {type(e).__name__}: {e}") from e
    if cause is not None:
      raise cause

  def stall_report(self, step: int) -> str:
    """Why no scored batch arrived: each executor's state and for how long, and which one is stalled."""
    now = time.monotonic()
    gen, gen_since = self.ex.generator.status
    rew, rew_since = self.reward_status
    if rew.startswith("scoring"):
      stalled = "the reward executor (a reward function, its worker pool or the reward model is stuck)"
    elif gen.startswith("generating"):
      stalled = "the generator (sampling or the prompt source is stuck)"
    elif gen.startswith("waiting for the weights"):
      stalled = "the weight sync (the generator waits for a policy version the trainer has not pushed)"
    else:
      stalled = "unclear: no executor is busy"
    timeout = self.config.schedule.step_timeout_s
    return (f"step {step}: no scored batch within step_timeout_s = {timeout:g} s. Stalled: {stalled}. "
            f"generator: {gen} for {now - gen_since:.0f} s; reward executor: {rew} for {now - rew_since:.0f} s; "
            f"replay buffer: {len(self.buffer)} batch(es). Raise ScheduleConfig.step_timeout_s if the step is just "
            "slow (e.g. the first compilation of a large model)")


def run(ex: Executors, state: RunState, recorder: StepRecorder, config: RunConfig, num_steps: int, *,
        on_step: Callable[[RunState, dict], None] | None = None,
        progress: bool = False) -> tuple[RunState, list[dict]]:
  """Train `num_steps` more steps from `state`; returns the new state and each step's metrics.

  on_step(state, metrics): called on this thread after each step (e.g. a held-out evaluation); the
  generator keeps generating meanwhile, within the lag bound. The executors are stopped on return;
  in-flight batches are discarded (the next call draws their prompts again from `state.data_state`).
  """
  state = state.started()
  start, first = state.step, state.first_version
  pipe = _Pipeline(ex, config)
  ex.weights.reopen()
  ex.weights.drop_pending()
  ex.generator.timer.take()  # this run's generator seconds start at 0
  if state.data_state is not None:  # prompts drawn for batches that were never trained are drawn again
    ex.prompt_source.load_state_dict(state.data_state)
  with recorder.breakdown.timed("weight_sync"):
    ex.weights.push(ex.trainer.params, start)
  state = pipe.remember(state, start)
  for v in versions_kept(start, pipe.lag, first, config.schedule.version_schedule):  # batches start.. need them
    ex.weights.insert(state.kept[v], v)
  pipe.start(start, first)
  bar = progress_bar(progress, num_steps)
  steps: list[dict] = []
  interrupted = False
  try:
    t_end = blocks = None  # the previous step's end and the breakdown's blocks then
    for _ in range(num_steps):
      s = state.step
      # the step's clock: from the previous step's end, unless a checkpoint, an evaluation or the
      # metrics' logging ran since (parts of their own)
      t0 = t_end if t_end is not None and recorder.breakdown.blocks == blocks else time.perf_counter()
      entry = pipe.next_batch(s)
      t1 = time.perf_counter()
      scored = entry.item
      lags = lag_metrics(scored.rollout.token_versions, scored.rollout.response_mask, s)
      check_lag(lags, s, pipe.lag)
      with ex.device_turn:
        t_dev = time.perf_counter()
        train_metrics = ex.trainer.step(scored)
        t2 = time.perf_counter()
        state = dataclasses.replace(state, step=s + 1, data_state=entry.meta["data_state"])
        sync_metrics = ex.weights.push(ex.trainer.params, state.step)
        state = pipe.remember(state, state.step)
        t3 = time.perf_counter()
      t_end, blocks = t3, recorder.breakdown.blocks
      gen_times, reward_times, waited_on = pipe.step_times(t0, (t_dev, t3))
      metrics = recorder.record(state, batch=entry.meta["metrics"], train=train_metrics, sync=sync_metrics, lag=lags,
                                train_tokens=float(np.sum(scored.rollout.response_mask)), times=(t0, t1, t2, t3),
                                generator_times=gen_times, reward_times=reward_times,
                                dropped=pipe.buffer.dropped_stale, occupancy=len(pipe.buffer), waited_on=waited_on)
      steps.append(metrics)
      if on_step is not None:
        on_step(state, metrics)
      show_progress(bar, metrics)
  except KeyboardInterrupt:  # Ctrl-C, or SIGTERM routed here by scripts/train.py
    interrupted = True
    raise
  finally:
    t_stop = time.perf_counter()
    if bar is not None:
      bar.close()
    pipe.close()
    ex.weights.reopen()
    ex.weights.drop_pending()
    recorder.breakdown.add("waits_other", time.perf_counter() - t_stop)  # the threads' stop
    recorder.finish(state, interrupted=interrupted)
  return state, steps
