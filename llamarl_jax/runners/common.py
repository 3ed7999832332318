"""What every runner takes and returns: the typed executors, the run's state, the step recorder.

A runner is one loop (`single_process.run`, `trainer_process.run`, `generator_process.run`) that takes
(Executors, RunState, StepRecorder, RunConfig) and returns the new RunState with the steps' metrics.
Runners never see the Controller: what they may touch is in these types.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from llamarl_jax.config import RunConfig
from llamarl_jax.metrics import append_bounded
from llamarl_jax.schedule import prune_kept, versions_kept
from llamarl_jax.time_breakdown import TimeBreakdown, overlap_seconds, split_wait  # noqa: F401


@dataclass(frozen=True)
class RunState:
  """The run's position, what a checkpoint holds besides the trainer state, and what a run continues from.

  step: optimizer steps taken (= the trainer's policy version). first_version: v0 of the 'fixed'
  schedule (None: the next run starts the schedule at `step`). data_state: the prompt source's position
  after the last trained batch. kept: generator weights (generator layout and dtype) of the versions
  older than `step` that the next batches are generated with (schedule.versions_kept).
  """
  step: int = 0
  first_version: int | None = None
  data_state: dict | None = None
  kept: Mapping[int, Any] = field(default_factory=dict)

  def replace(self, **changes) -> "RunState":
    return dataclasses.replace(self, **changes)

  def started(self) -> "RunState":
    """This state with the schedule's v0 fixed (a run that starts the schedule starts it at `step`)."""
    return self if self.first_version is not None else dataclasses.replace(self, first_version=self.step)

  def keep(self, version: int, weights: Any, max_policy_lag: int) -> "RunState":
    """With `version`'s generator weights kept, and the ones no later checkpoint can need dropped (the
    runners keep every version when `schedule.keeps_versions`)."""
    return dataclasses.replace(self, kept=prune_kept({**self.kept, version: weights}, version, max_policy_lag))


def checkpoint_contents(state: RunState, trainer_state: dict, config: RunConfig) -> tuple[dict, dict]:
  """(payload, metadata) of a checkpoint of `state`: the trainer's state dict with the kept generator
  weights of the versions the next batches are generated with (under "generator_versions"), and the
  run's position, seed and version schedule.

  Exact resume ('fixed' schedule): a checkpoint at step r holds the generator-dtype weights of versions
  max(v0, r - max_policy_lag) .. r - 1 (`schedule.versions_kept`), so the resumed run generates every
  batch with the same version, prompts and seed as an uninterrupted run."""
  lag, schedule = config.schedule.max_policy_lag, config.schedule.version_schedule
  first = state.step if state.first_version is None else state.first_version
  versions = [v for v in versions_kept(state.step, lag, first, schedule) if v in state.kept]
  payload = trainer_state
  if versions:
    payload = {**payload, "generator_versions": {str(v): state.kept[v] for v in versions}}
  meta = {"step": state.step, "policy_version": state.step, "seed": config.rollout.seed,
          "data_state": state.data_state, "max_policy_lag": lag, "version_schedule": schedule,
          "first_version": first, "generator_versions": versions}
  return payload, meta


def checkpoint_target(meta: dict, trainer_state: dict, version_layout: Callable[[], Any]) -> dict:
  """What a checkpoint with metadata `meta` restores into (abstract arrays): the trainer's state dict
  and, for each kept generator version it lists, `version_layout()`."""
  if not meta.get("generator_versions"):
    return trainer_state
  layout = version_layout()
  return {**trainer_state, "generator_versions": {str(v): layout for v in meta["generator_versions"]}}


def checkpoint_position(meta: dict, kept: Mapping[int, Any], config: RunConfig) -> dict:
  """The `RunState` fields a checkpoint's metadata restores: step, data_state and first_version, the
  last None (the schedule restarts at the step) unless `kept` holds every version the schedule needs."""
  lag, schedule = config.schedule.max_policy_lag, config.schedule.version_schedule
  first = meta.get("first_version")
  exact = first is not None and all(v in kept for v in versions_kept(int(meta["step"]), lag, int(first), schedule))
  return {"step": int(meta["step"]), "data_state": meta.get("data_state"),
          "first_version": int(first) if exact else None}


@dataclass
class Executors:
  """The typed parts a runner drives. In one process all are present; a trainer process has no
  generator, sampler or reward pool, a generator process no trainer (their fields are None).

  weights: the single-process `WeightSync` (None across processes, where `mp` moves weights).
  mp: the multi-process `Context` (roles, store, transfer plans), None in one process.
  device_turn: a lock the generator and the trainer share in colocated mode (one mesh, taking turns).
  timeline: ("generate" | "reward" | "train", start, end) perf_counter intervals of real work.
  """
  trainer: Any = None       # executors.trainer.TrainerExecutor
  generator: Any = None     # executors.generator.GeneratorExecutor
  reward: Any = None        # executors.reward.RewardExecutor
  reward_model: Any = None  # executors.reward_model.RewardModelExecutor (RewardConfig.model_path), else None
  weights: Any = None       # executors.weight_sync.WeightSync
  mp: Any = None            # multiprocess.protocol.Context
  tokenizer: Any = None
  prompt_source: Any = None
  device_turn: Any = field(default_factory=contextlib.nullcontext)
  timeline: list = field(default_factory=list)

  def mark(self, what: str, start: float, end: float) -> None:
    append_bounded(self.timeline, (what, start, end))

  def work_timeline(self) -> list[tuple[str, float, float]]:
    """(executor, start, end) perf_counter intervals of real work, the generator's included, by start:
    "generate", "swap", "reward", "train" (with the weight sync). Tests and scripts/bench_async.py
    measure overlap with it."""
    generated = self.generator.timeline if self.generator is not None else []
    return sorted(generated + self.timeline, key=lambda t: t[1])


# Metrics that measure time or depend on thread timing (how far ahead the generator ran); everything
# else in a step's metrics is a pure function of (config, seed) under the 'fixed' version schedule.
TIMING_KEYS = ("time/", "throughput/", "sync/seconds", "sync/gbps", "buffer/occupancy",
               "reward/worker_",  # worker restarts/recycles/RSS: timeouts and memory, not the schedule
               "reward_model/latency_s", "reward_model/rows_per_s")


def schedule_metrics(metrics: dict) -> dict:
  """The per-step metrics that the 'fixed' schedule makes reproducible (timings dropped)."""
  return {k: v for k, v in metrics.items() if not k.startswith(TIMING_KEYS)}


class StepRecorder:
  """One step's metrics (the same keys in every runner), their history, logging and periodic checkpoints.

  save(state): write a checkpoint of `state` (the Controller's; trainer processes only).
  latest_saved(): the newest complete checkpoint step, so a run's end does not write it twice.
  breakdown: the run's `TimeBreakdown`; every recorded step and checkpoint is added to it.
  """

  def __init__(self, *, logger=None, checkpoint_every: int = 0, save: Callable[[RunState], None] | None = None,
               latest_saved: Callable[[], int | None] = lambda: None):
    self.logger = logger
    self.checkpoint_every = checkpoint_every
    self.save = save
    self.latest_saved = latest_saved
    self.history: list[dict] = []
    self.state: RunState | None = None  # the state after the last recorded step (also when a run raised)
    self.breakdown = TimeBreakdown()

  def record(self, state: RunState, *, batch: dict, train: dict, sync: dict, lag: dict, train_tokens: float,
             times: tuple[float, float, float, float], generator_times: tuple, reward_times: tuple,
             dropped: int, occupancy: int, waited_on: Sequence[tuple[str, float, float]] = ()) -> dict:
    """state: after the step. times: (the step's start - the previous step's end or the ask for a batch -,
    got the batch, trained, synced) perf_counter stamps.
    waited_on: ("generate" | "swap" | "reward", start, end) intervals of the other threads, which split
    the trainer's wait (`time_breakdown.split_wait`; none: all of it is "time/wait_other").
    `time/step` = the sum of `time_breakdown.STEP_PARTS`. Beside them, each executor's own busy seconds
    since the previous step (`time/generate_busy`, `time/reward_busy`): in an asynchronous run most of
    the generator's is hidden behind training, in a synchronous one it is the wait. A checkpoint due after the step is written
    once its metrics are logged (a kill in between loses no logged step: the resume rewinds the logs to
    the checkpoint); its seconds go to the run's breakdown."""
    t0, t1, t2, t3 = times
    self.state = state
    metrics = {**batch, **train, **sync, **lag,
               "buffer/dropped_stale": float(dropped), "buffer/occupancy": float(occupancy),
               "time/step": t3 - t0, "time/trainer_wait": t1 - t0, **split_wait(t0, t1, waited_on),
               "time/train": t2 - t1, "time/sync": t3 - t2,
               "time/generate_busy": generator_times[0], "time/generator_wait": generator_times[1],
               "time/reward_busy": reward_times[0], "time/reward_wait": reward_times[1],
               "throughput/train_tokens_per_s": train_tokens / max(t2 - t1, 1e-9)}
    append_bounded(self.history, metrics)
    self.breakdown.add_step(metrics)
    if self.logger is not None:
      self.logger.log(state.step, metrics)
    if self.save is not None and self.checkpoint_every and state.step % self.checkpoint_every == 0:
      with self.breakdown.timed("checkpointing"):
        self.save(state)
    return metrics

  def finish(self, state: RunState, *, interrupted: bool = False) -> None:
    """At a run's end (always on an interrupt): a checkpoint of the last finished step unless just saved."""
    if self.save is not None and (self.checkpoint_every or interrupted) and self.latest_saved() != state.step:
      with self.breakdown.timed("checkpointing"):
        self.save(state)


def progress_bar(show: bool, num_steps: int):
  if not show:
    return None
  from tqdm.auto import tqdm
  return tqdm(total=num_steps, desc="RL", dynamic_ncols=True)


def show_progress(bar, metrics: dict) -> None:
  if bar is None:
    return
  bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", acc=f"{metrics['reward/accuracy']:.2f}",
                  lag=f"{metrics['policy/lag_mean']:.1f}",
                  gen_tok_s=f"{metrics.get('throughput/gen_tokens_per_s', 0):.0f}")
  bar.update(1)
