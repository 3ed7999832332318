"""The single controller: holds the executors the builders make (`build`), runs them, evaluates, checkpoints (LlamaRL).

The loops live in `llamarl_jax/runners/` (one process; a trainer, generator or reward process of a
multi-process job): each takes (Executors, RunState, StepRecorder, RunConfig) and returns the new
RunState; the version schedule they share is `schedule.py`. docs/ARCHITECTURE.md has the picture.

Policy versions: the trainer's params after s optimizer steps are version s. Batch k is generated
with version >= k - max_policy_lag and trained at step k, so every trained rollout satisfies
s - v <= max_policy_lag. `max_policy_lag=0` is the synchronous on-policy baseline.

Many processes (one jax.distributed job): the same Controller is built in every process; each
builds only its role's executors (`distributed.derive_roles`) and `run` runs that role's loop.
`evaluate`, `restore_checkpoint`, `checkpoint_dirs` and `latest_checkpoint_step` are then called by
every process, like collectives.

Exact resume ('fixed' schedule): a checkpoint also holds the generator weights of the versions the
next batches are generated with (`runners.common.checkpoint_contents`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

import jax

from llamarl_jax import build, distributed, parallel
from llamarl_jax.checkpoint import Checkpointer
from llamarl_jax.compile_cache import enable_persistent_cache
from llamarl_jax.config import RunConfig
from llamarl_jax.envs import make_environment
from llamarl_jax.executors.reward import RewardExecutor
from llamarl_jax.executors.scoring import score_evaluation
from llamarl_jax.metrics import MetricsLogger
from llamarl_jax.model.config import ModelConfig
from llamarl_jax.model.llama import abstract_model
from llamarl_jax.multiprocess.protocol import Context
from llamarl_jax.runners import generator_process, reward_process, single_process, trainer_process
from llamarl_jax.runners.common import (Executors, RunState, StepRecorder, checkpoint_contents, checkpoint_position,
                                        checkpoint_target)
from llamarl_jax.runners.common import overlap_seconds, schedule_metrics  # noqa: F401  (re-exported)
from llamarl_jax.runners.single_process import ExecutorFailed  # noqa: F401  (re-exported)
from llamarl_jax.schedule import versions_kept
from llamarl_jax.shapes import RunShapes

log = logging.getLogger(__name__)


class Controller:
  """Wires the executors and runs them; see the module docstring for the data flow.

  config: the run's `RunConfig` (config.py). `shapes`: its geometry (default `RunShapes.of(model_config,
  config)`; the memory plan's). `reward`: a `RewardExecutor` the caller owns and closes (e.g. one
  worker pool shared by a study's runs; its name must be `RewardConfig.fn`'s, which checkpoints
  record); default one the Controller builds from `config.reward`. `logger`: where the trainer
  leader logs metrics.
  """

  def __init__(self, model_config: ModelConfig, params: Any, tokenizer, prompt_source, *, run_dir: str | Path,
               config: RunConfig | None = None, shapes: RunShapes | None = None, reward: RewardExecutor | None = None,
               logger: MetricsLogger | None = None, progress: bool = True):
    config = config if config is not None else RunConfig()
    if not isinstance(config, RunConfig):
      raise TypeError(f"Controller(config=...) takes a llamarl_jax.config.RunConfig, got {type(config).__name__}")
    if reward is not None and reward.name != config.reward.name:
      raise ValueError(f"Controller(reward=...) scores with {reward.name!r} but RewardConfig.fn is "
                       f"{config.reward.name!r} (what checkpoints record); set RewardConfig.fn = {reward.name!r}")
    self.shapes = RunShapes.of(model_config, config) if shapes is None else shapes
    self.config, self.model_config, self.tokenizer = config, model_config, tokenizer
    self.prompt_source, self.run_dir, self.progress = prompt_source, Path(run_dir), progress
    r, t = config.rollout, config.train
    self.sampling = build.rollout_sampling(r, tokenizer)
    self.trainer_mesh, self.generator_mesh = parallel.make_meshes(**dataclasses.asdict(config.mesh))
    enable_persistent_cache()  # on a GPU: a restarted or repeated run loads its programs (`compile_cache`)
    config.check_layout(parallel.batch_divisor(self.trainer_mesh), jax.process_count())
    config.check_model(model_config)
    # Roles: in one process all; across processes each process builds only its role's executors.
    self.reward_mesh = parallel.make_reward_mesh(**dataclasses.asdict(config.mesh))
    self.roles = distributed.derive_roles(self.trainer_mesh, self.generator_mesh, reward_mesh=self.reward_mesh)
    multi = jax.process_count() > 1
    self.is_trainer = jax.process_index() in self.roles.trainer
    self.is_generator = jax.process_index() in self.roles.generator
    self.is_reward = multi and jax.process_index() in self.roles.reward  # a process of the reward model's group
    self.is_main = jax.process_index() == self.roles.trainer_leader  # logs, checkpoints' metadata, summary
    axes = parallel.logical_axes(abstract_model(model_config))
    shapes = self._model_shapes = build.model_shapes(model_config)
    gen_shardings = parallel.param_shardings(shapes, axes, self.generator_mesh)
    ex = Executors(tokenizer=tokenizer, prompt_source=prompt_source,
                   device_turn=threading.Lock() if config.mesh.colocated else contextlib.nullcontext())
    self.checkpointer = None
    if self.is_trainer:
      ex.trainer = build.trainer(model_config, config, self.trainer_mesh, params)
      self.checkpointer = Checkpointer(self.run_dir / "checkpoints", max_to_keep=t.keep_checkpoints,
                                       processes=self.roles.trainer if multi else None)
    self._owns_reward = reward is None
    self.sampler = self.env = None
    if self.is_generator:
      self.sampler = build.sampler(model_config, config, self.generator_mesh, tokenizer)
      ex.reward = reward if reward is not None else build.reward(config)
      if config.reward.model_path:  # in many processes it scores in the reward processes: here its rows only
        ex.reward_model = (build.reward_model(config.reward, tokenizer, weights=False) if multi else
                           build.run_reward_model(config, tokenizer, self.generator_mesh, ex.device_turn))
      self.env = make_environment(config.env)
      ex.generator = build.generator(self.sampler, tokenizer, prompt_source, self.sampling, config, self.shapes,
                                     device_turn=ex.device_turn if config.mesh.colocated else None,
                                     score=ex.reward.score, env=self.env)
    if self.is_reward:
      ex.reward_model = build.reward_model(config.reward, tokenizer, mesh=self.reward_mesh)
    base = lambda: ex.trainer.base_params  # noqa: E731  (LoRA: the frozen base the generator merges into)
    if multi:
      plan = build.weight_plan(config, model_config, shapes, axes, gen_shardings, self.trainer_mesh,
                               self.generator_mesh, base=base)
      ex.mp = Context(self.roles, plan, self.trainer_mesh, self.generator_mesh)
    else:
      ex.weights = build.weights(config, model_config, axes, gen_shardings, self.generator_mesh, base=base)
    self.ex = ex
    self.state = RunState()
    self.recorder = StepRecorder(logger=logger if self.is_main else None, checkpoint_every=t.checkpoint_every,
                                 save=self._save if self.is_trainer else None,
                                 latest_saved=self.checkpointer.latest_step if self.is_trainer else (lambda: None))
    # The caller's held-out evaluation settings (run_experiment's eval_*): recorded in checkpoints for
    # the record; they may change on resume (checkpoint.RESUMABLE_CHANGES).
    self.evaluation_config: dict = {}

  # ----------------------------------------------------------------------------------------------
  # the parts and the state, as the callers see them

  trainer = property(lambda self: self.ex.trainer)
  mp = property(lambda self: self.ex.mp)
  step = property(lambda self: self.state.step)
  prompt_limit = property(lambda self: self.shapes.prompt_limit)  # the data sources cut prompts at it
  history = property(lambda self: self.recorder.history)

  @property
  def logger(self) -> MetricsLogger | None:
    return self.recorder.logger

  @logger.setter
  def logger(self, logger: MetricsLogger | None) -> None:
    self.recorder.logger = logger if self.is_main else None

  timeline = property(lambda self: self.ex.work_timeline())  # (executor, start, end): `Executors.work_timeline`

  def run_record(self) -> dict:
    """What a checkpoint records about the run that wrote it; a resume compares it (checkpoint.py)."""
    source = self.prompt_source
    # a policy (an LM head, num_labels 0) records only the fields of a causal LM config
    model = {k: v for k, v in dataclasses.asdict(self.model_config).items()
             if k != "grouped_gemm" and (k not in ("num_labels", "exact") or v)}
    return {"model": model, **self.config.record(),
            "kl_reference": (None if self.trainer.ref_params is None
                             else self.config.train.reference_path or "initial policy"),
            "mesh": {"trainer": dict(self.trainer_mesh.shape), "generator": dict(self.generator_mesh.shape),
                     "colocated": self.config.mesh.colocated},
            "data": source.fingerprint(), "evaluation": dict(self.evaluation_config)}

  # ----------------------------------------------------------------------------------------------
  # running

  def run(self, num_steps: int, *, on_step: Callable[[int, dict], None] | None = None) -> list[dict]:
    """Train `num_steps` more steps; returns each step's metrics. Shuts the executors down on return.

    on_step(step, metrics): called after each step (e.g. a held-out evaluation), one process only: the
    generator keeps generating meanwhile, within the lag bound. Across processes every process calls
    `run` (trainer processes get the metrics, generator and reward processes []); to evaluate between steps,
    call `run` for the steps up to the evaluation, then `evaluate` in every process
    (`experiment.run_with_evals` does; under the 'fixed' schedule the split does not change training).
    """
    show = self.progress and self.is_main
    self.recorder.state = None
    if self.mp is None:
      def callback(state: RunState, metrics: dict) -> None:
        self.state = state  # what the callback sees (evaluate, checkpoints) is the step just finished
        on_step(state.step, metrics)

      try:
        self.state, steps = single_process.run(self.ex, self.state, self.recorder, self.config, num_steps,
                                               on_step=None if on_step is None else callback, progress=show)
      finally:
        if self.recorder.state is not None and self.recorder.state.step > self.state.step:
          self.state = self.recorder.state  # the steps finished before an exception
      return steps
    if on_step is not None:
      raise ValueError("Controller.run(on_step=...) is single-process only: across processes call run() "
                       "for the steps between two callbacks, then the callback (every process)")
    if self.is_trainer:
      self.state, steps = trainer_process.run(self.ex, self.state, self.recorder, self.config, num_steps,
                                              progress=show)
      return steps
    if self.is_generator:
      self.state = generator_process.run(self.ex, self.state, self.config, num_steps)
    else:
      self.state = reward_process.run(self.ex, self.state, self.config, num_steps)
    return []

  # ----------------------------------------------------------------------------------------------
  # checkpoints

  def _save(self, state: RunState) -> None:
    payload, meta = checkpoint_contents(state, self.trainer.state_dict(), self.config)
    self.checkpointer.save(state.step, payload, meta, config=self.run_record())

  def restore_checkpoint(self, step: int | None = None, *, allow_changes: Sequence[str] = ()) -> int:
    """Load the newest complete (or the given) checkpoint; returns the restored step.

    The run config is compared with the checkpoint's first (`IncompatibleCheckpoint` lists each
    setting that differs, unless allowed); damaged newer checkpoints are skipped and reported
    (`checkpointer.skipped`). Restores trainer state, data position, and the generator weights that
    make the resumed 'fixed' schedule identical to an uninterrupted run.
    """
    restored, kept = None, {}
    if self.is_trainer:
      step, payload, meta = self.checkpointer.restore(
          lambda meta: checkpoint_target(meta, self.trainer.state_dict(), self._generator_abstract), step,
          config=self.run_record(), allow_changes=allow_changes)
      gen = payload.pop("generator_versions", {})
      self.trainer.load_state_dict(payload)
      if self.mp is not None:  # the wire arrays the trainer sends (numpy when they were host-local)
        gen = {v: jax.device_put(p, self.mp.weights.wire_src) for v, p in gen.items()}
      kept = {int(v): p for v, p in gen.items()}
      restored = checkpoint_position(meta, kept, self.config)
    restored = self._from_trainer_leader("restored", restored)  # the generator processes take the position
    self.state = RunState(**restored, kept=kept)
    if restored["data_state"] is not None:
      self.prompt_source.load_state_dict(restored["data_state"])
    if self.ex.weights is not None:  # a restore into a controller that had run on: its versions are stale
      self.ex.weights.clear()
    lag, schedule = self.config.schedule.max_policy_lag, self.config.schedule.version_schedule
    if self.state.first_version is None and versions_kept(self.step, lag, 0, schedule) and self.is_main:
      log.warning("checkpoint step %d holds no generator weights for the versions before it: batches %d.. "
                  "are generated from version %d on (valid under the lag bound, not identical to an "
                  "uninterrupted run)", self.step, self.step, self.step)
    return self.step

  def _generator_abstract(self) -> Any:
    """A kept version as a checkpoint holds it: one process, generator params; across processes the
    wire arrays (a LoRA policy's: its adapters)."""
    if self.mp is None:
      return self.ex.weights.version_layout(self._model_shapes)
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                        self.mp.weights.shapes, self.mp.weights.wire_src)

  def checkpoint_dirs(self) -> list[int]:
    """Every checkpoint step directory of the run (complete or not). Every process calls it."""
    return self._from_trainer_leader("checkpoint_dirs", self.checkpointer.step_dirs() if self.is_trainer else None)

  def latest_checkpoint_step(self) -> int | None:
    """The newest complete checkpoint step (None if none). Every process calls it."""
    return self._from_trainer_leader("latest_checkpoint", self.checkpointer.latest_step() if self.is_trainer else None)

  def _from_trainer_leader(self, name: str, value: Any) -> Any:
    """`value` as the trainer leader has it (across processes every process calls this, in the same order)."""
    return value if self.mp is None else self.mp.facts.share(name, value, source=self.roles.trainer_leader)

  # ----------------------------------------------------------------------------------------------
  # evaluation

  def evaluate(self, examples: Sequence, *, params=None, samples: int = 0, seed: int = 0) -> dict:
    """Held-out accuracy of the current trainer weights (or `params`, generator layout) on `examples`.

    eval/accuracy: greedy exact-match accuracy (fraction of problems with reward >= 1).
    eval/pass1_sampled (only with `samples` > 0): the pass@1 of the training sampling distribution,
    estimated from `samples` draws per problem; `seed` fixes its noise, so an evaluation is a pure
    function of (weights, seed). One process: safe between steps while `run` is in progress (the
    weights are converted without being registered in the WeightSync; colocated, it takes its turn).
    Across processes every process calls it, outside `run`: the trainer pushes its weights, the
    generator processes sample, the generator leader scores (rule rewards: the reward model, in its
    own processes, takes no part), and every process gets the result.
    """
    if samples < 0:
      raise ValueError(f"samples (draws per problem for the sampled pass@1) must be >= 0, got {samples}")
    if self.mp is not None and not self.is_reward:  # the push runs between trainer and generator processes
      params = self.mp.push_weights(self.trainer.params if self.is_trainer else None)
    result = None
    if self.is_generator:
      if params is None:
        with self.ex.device_turn:
          params, _ = self.ex.weights.to_generator(self.trainer.params)
      # episodes as in training (one turn, or turns with tools), each generate call taking the device turn
      rollout, sampled = self.ex.generator.evaluation_episodes(examples, params, samples=samples, seed=seed)
      if self.mp is None or jax.process_index() == self.roles.generator_leader:
        result = score_evaluation(self.tokenizer, self.ex.reward, examples, rollout, sampled, samples)
    if self.mp is not None:
      result = self.mp.facts.share("evaluate", result, source=self.roles.generator_leader)
      result["eval/samples"] = [tuple(x) for x in result["eval/samples"]]
    return result

  def close(self) -> None:
    """Stop the executors the Controller owns (a caller's reward executor stays open)."""
    for part in (self.ex.generator, self.ex.weights, self.ex.reward if self._owns_reward else None, self.checkpointer):
      if part is not None:
        part.close()

