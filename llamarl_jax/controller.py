"""The single controller: generator, reward and trainer executors running concurrently (LlamaRL).

Data flow (one Python process):

  generator thread:  wait until policy version >= k - max_policy_lag; take the newest generator weights;
                     draw prompts; Sampler.generate on the generator mesh -> RolloutBatch (host)
  reward thread:     decode, score in the RewardExecutor's process pool, advantages -> ScoredBatch
                     -> ReplayBuffer.put (blocks when full: backpressure)
  controller thread: ReplayBuffer.get (drops data older than the lag bound) -> TrainerExecutor.step
                     on the trainer mesh -> WeightSync.push (cast + device_put reshard) -> metrics,
                     checkpoints

Policy versions: the trainer's params after s optimizer steps are version s. Batch k is generated
with version >= k - max_policy_lag and trained at step k, so every trained rollout satisfies
s - v <= max_policy_lag. `max_policy_lag=0` is the synchronous on-policy baseline (generate, score,
train, sync in sequence). JAX dispatch releases the GIL, so generation and training compute at the
same time on their disjoint meshes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import gin
import jax
import numpy as np

from llamarl_jax import parallel
from llamarl_jax.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from llamarl_jax.checkpoint import Checkpointer
from llamarl_jax.executors.reward import RewardExecutor
from llamarl_jax.executors.trainer import OptimizerConfig, TrainerExecutor
from llamarl_jax.executors.weight_sync import WeightSync
from llamarl_jax.generation.rollout import FINISH_LENGTH, ScoredBatch
from llamarl_jax.generation.sampler import Sampler, SamplingParams
from llamarl_jax.metrics import MetricsLogger
from llamarl_jax.model.llama import ModelConfig
from llamarl_jax.replay import BufferClosed, ReplayBuffer


class ExecutorFailed(RuntimeError):
  """An executor thread raised; the run was shut down."""


@dataclass
class _Timer:
  busy: float = 0.0
  wait: float = 0.0

  def take(self) -> tuple[float, float]:
    b, w = self.busy, self.wait
    self.busy = self.wait = 0.0
    return b, w


@dataclass
class _Generated:
  index: int
  rollout: Any
  examples: list
  data_state: dict
  metrics: dict = field(default_factory=dict)


def encode_prompts(tokenizer, examples) -> list[list[int]]:
  """Token ids of each example's prompt (`PromptExample.encode`: BOS for plain prompts; a chat-templated
  prompt already carries its special tokens)."""
  return [ex.encode(tokenizer) for ex in examples]


def decode_responses(tokenizer, rollout) -> list[str]:
  toks = np.asarray(rollout.response_tokens)
  lengths = np.asarray(rollout.lengths)
  return [tokenizer.decode(toks[i, :lengths[i]].tolist(), skip_special_tokens=True) for i in range(len(lengths))]


@gin.configurable(denylist=["model_config", "params", "tokenizer", "prompt_source", "run_dir", "logger"])
class Controller:
  """Wires the executors and runs them; see the module docstring for the data flow.

  `generator_delay_s` adds a sleep per generated batch, emulating a latency-bound remote inference
  engine (used by the overlap test and `scripts/bench_async.py`).
  """

  def __init__(self, model_config: ModelConfig, params: Any, tokenizer, prompt_source, *,
               run_dir: str | Path,
               reward_fn: str | Callable = "arithmetic",
               max_policy_lag: int = 1,
               prompts_per_step: int = 8,
               samples_per_prompt: int = 4,
               temperature: float = 1.0,
               top_p: float = 1.0,
               top_k: int = 0,
               max_new_tokens: int = 16,
               advantage_estimator: str = "group_mean",
               loss: str = "aipo",
               loss_kwargs: dict | None = None,
               optimizer: OptimizerConfig | None = None,
               microbatches: int = 1,
               remat: bool = False,
               trainer_fsdp: int = 1,
               trainer_tp: int = 1,
               generator_dp: int = 1,
               generator_tp: int = 1,
               colocated: bool = False,
               generator_dtype: str = "float32",
               quantize: str | None = None,
               buffer_capacity: int = 2,
               reward_workers: int = 2,
               reward_timeout_s: float = 5.0,
               seed: int = 0,
               checkpoint_every: int = 0,
               keep_checkpoints: int = 2,
               generator_delay_s: float = 0.0,
               step_timeout_s: float = 600.0,
               logger: MetricsLogger | None = None,
               progress: bool = True):
    if max_policy_lag < 0:
      raise ValueError(f"max_policy_lag must be >= 0, got {max_policy_lag}")
    if prompts_per_step < 1 or samples_per_prompt < 1:
      raise ValueError(f"prompts_per_step and samples_per_prompt must be >= 1, got {prompts_per_step}, "
                       f"{samples_per_prompt}")
    if advantage_estimator not in ADVANTAGE_ESTIMATORS:
      raise ValueError(f"unknown advantage estimator {advantage_estimator!r}; expected one of "
                       f"{ADVANTAGE_ESTIMATORS}")
    if samples_per_prompt < 2:
      raise ValueError(f"advantage_estimator {advantage_estimator!r} compares the samples of a prompt: "
                       f"samples_per_prompt must be >= 2, got {samples_per_prompt}")
    self.model_config = model_config
    self.tokenizer = tokenizer
    self.prompt_source = prompt_source
    self.run_dir = Path(run_dir)
    self.max_policy_lag = max_policy_lag
    self.prompts_per_step = prompts_per_step
    self.samples_per_prompt = samples_per_prompt
    self.advantage_estimator = advantage_estimator
    self.seed = seed
    self.checkpoint_every = checkpoint_every
    self.generator_delay_s = generator_delay_s
    self.step_timeout_s = step_timeout_s
    self.progress = progress
    self.colocated = colocated
    stop_ids = tuple(i for i in (tokenizer.eos_token_id,) if i is not None)
    self.sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                   max_new_tokens=max_new_tokens, n=samples_per_prompt,
                                   stop_token_ids=stop_ids, seed=seed)

    self.trainer_mesh, self.generator_mesh = parallel.make_meshes(
        trainer_fsdp=trainer_fsdp, trainer_tp=trainer_tp, generator_dp=generator_dp,
        generator_tp=generator_tp, colocated=colocated)
    rows, multiple = prompts_per_step * samples_per_prompt, microbatches * parallel.batch_divisor(self.trainer_mesh)
    if rows % multiple:
      raise ValueError(f"prompts_per_step * samples_per_prompt = {rows} rows per step must be a multiple of "
                       f"microbatches ({microbatches}) x trainer data*fsdp ({multiple // microbatches})")
    axes = _axes_for(model_config)
    self.trainer = TrainerExecutor(model_config, self.trainer_mesh, params,
                                   optimizer=optimizer or OptimizerConfig(), loss=loss,
                                   loss_kwargs=loss_kwargs or {}, microbatches=microbatches, remat=remat,
                                   temperature=max(temperature, 1e-6) if temperature > 0 else 1.0)
    gen_config = model_config.replace(param_dtype=generator_dtype, dtype=generator_dtype)
    self.sampler = Sampler(gen_config, self.generator_mesh, pad_id=tokenizer.pad_token_id or 0)
    gen_shapes = jax.eval_shape(lambda p: p, self.trainer.params)
    self.weight_sync = WeightSync(parallel.param_shardings(gen_shapes, axes, self.generator_mesh),
                                  dtype=generator_dtype, quantize=quantize, axes=axes)
    self.reward = reward_fn if isinstance(reward_fn, RewardExecutor) else RewardExecutor(
        reward_fn, num_workers=reward_workers, timeout_s=reward_timeout_s)
    self.buffer = ReplayBuffer(buffer_capacity)
    self.checkpointer = Checkpointer(self.run_dir / "checkpoints", max_to_keep=keep_checkpoints)
    self.logger = logger
    self.step = 0
    self.last_data_state: dict | None = None
    self._errors: list[tuple[str, BaseException]] = []
    self._stop = threading.Event()
    self._scoring: queue.Queue = queue.Queue(maxsize=1)
    self._gen_timer, self._reward_timer = _Timer(), _Timer()
    self._lock = threading.Lock()
    # Colocated: one mesh, so the generator and the trainer (step + weight sync) take turns on it. The
    # sampler's KV cache only lives inside its jitted calls, so it is freed before the trainer runs.
    self._device_turn = threading.Lock() if colocated else contextlib.nullcontext()
    self.history: list[dict] = []
    # (executor, start, end) perf_counter intervals of real work: "generate", "reward", "train"
    # (train includes the weight sync). Tests and scripts/bench_async.py measure overlap with it.
    self.timeline: list[tuple[str, float, float]] = []

  # ----------------------------------------------------------------------------------------------
  # executor threads

  def _fail(self, who: str, e: BaseException) -> None:
    with self._lock:
      self._errors.append((who, e))
    self._shutdown()

  def _shutdown(self) -> None:
    self._stop.set()
    self.buffer.close()
    self.weight_sync.close()

  def _generator_loop(self, start_index: int) -> None:
    k = start_index
    try:
      while not self._stop.is_set():
        t0 = time.perf_counter()
        while not self.weight_sync.wait_for_version(k - self.max_policy_lag, timeout=0.2):
          if self._stop.is_set():
            return
        params, version = self.weight_sync.latest()
        t1 = time.perf_counter()
        examples = self.prompt_source.next_batch(self.prompts_per_step)
        data_state = self.prompt_source.state_dict()
        prompts = encode_prompts(self.tokenizer, examples)
        sampling = dataclasses.replace(self.sampling, seed=self.seed * 1_000_003 + k)
        with self._device_turn:
          t_dev = time.perf_counter()
          rollout = self.sampler.generate(params, prompts, sampling, policy_version=version).to_host()
          if self.generator_delay_s:  # emulated extra generation time: it holds the devices like real work
            time.sleep(self.generator_delay_s)
          t_dev_end = t2 = time.perf_counter()
        with self._lock:
          self._gen_timer.wait += t1 - t0
          self._gen_timer.busy += t2 - t1
          self.timeline.append(("generate", t_dev, t_dev_end))
        n_tokens = float(np.sum(rollout.lengths))
        item = _Generated(k, rollout, examples, data_state, {
            "throughput/gen_tokens_per_s": n_tokens / max(t2 - t1, 1e-9),
            "generate/response_length_mean": float(np.mean(rollout.lengths)),
            "generate/frac_truncated": float(np.mean(rollout.finish_reason == FINISH_LENGTH))})
        while not self._stop.is_set():
          try:
            self._scoring.put(item, timeout=0.2)
            break
          except queue.Full:
            continue
        k += 1
    except BaseException as e:  # noqa: BLE001 - reported to the controller thread
      self._fail("generator", e)

  def _reward_loop(self) -> None:
    try:
      while not self._stop.is_set():
        t0 = time.perf_counter()
        try:
          item: _Generated = self._scoring.get(timeout=0.2)
        except queue.Empty:
          continue
        t1 = time.perf_counter()
        texts = decode_responses(self.tokenizer, item.rollout)
        truths = [ex.ground_truth for ex in item.examples for _ in range(self.samples_per_prompt)]
        rewards, reward_metrics = self.reward.score(texts, truths)
        rewards = np.asarray(rewards, np.float32)
        adv = np.asarray(compute_advantages(rewards, item.rollout.group_ids, len(item.examples),
                                            self.advantage_estimator), np.float32)
        scored = ScoredBatch(rollout=item.rollout, rewards=rewards, advantages=adv)
        t2 = time.perf_counter()
        with self._lock:
          self._reward_timer.wait += t1 - t0
          self._reward_timer.busy += t2 - t1
          self.timeline.append(("reward", t1, t2))
        metrics = dict(item.metrics)
        metrics.update({k: v for k, v in reward_metrics.items() if not k.startswith("time/")})
        metrics.update({"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
                        "reward/accuracy": float(np.mean(rewards >= 1.0)),
                        "advantage/abs_mean": float(np.abs(adv).mean())})
        version = int(np.max(item.rollout.policy_version))
        self.buffer.put(scored, version, meta={"index": item.index, "data_state": item.data_state,
                                               "metrics": metrics, "texts": texts[:2]})
    except BufferClosed:
      return
    except BaseException as e:  # noqa: BLE001
      self._fail("reward", e)

  # ----------------------------------------------------------------------------------------------
  # the controller thread

  def _checkpoint_state(self) -> dict:
    return self.trainer.state_dict()

  def save_checkpoint(self) -> None:
    meta = {"step": self.step, "policy_version": self.step, "seed": self.seed,
            "data_state": self.last_data_state, "max_policy_lag": self.max_policy_lag}
    self.checkpointer.save(self.step, self._checkpoint_state(), meta)

  def restore_checkpoint(self, step: int | None = None) -> int:
    """Load the latest (or given) checkpoint into the trainer; returns the restored step."""
    step, state, meta = self.checkpointer.restore(self._checkpoint_state(), step)
    self.trainer.load_state_dict(state)
    self.step = int(meta["step"])
    if meta.get("data_state") is not None:
      self.prompt_source.load_state_dict(meta["data_state"])
      self.last_data_state = meta["data_state"]
    return self.step

  def run(self, num_steps: int) -> list[dict]:
    """Train `num_steps` more steps; returns each step's metrics. Shuts the executors down on return."""
    self._stop.clear()
    start = self.step
    self.weight_sync.push(self.trainer.params, start)
    threads = [threading.Thread(target=self._generator_loop, args=(start,), name="generator", daemon=True),
               threading.Thread(target=self._reward_loop, name="reward", daemon=True)]
    for t in threads:
      t.start()
    bar = None
    if self.progress:
      from tqdm.auto import tqdm
      bar = tqdm(total=num_steps, desc="RL", dynamic_ncols=True)
    steps: list[dict] = []
    interrupted = False
    try:
      for _ in range(num_steps):
        steps.append(self._train_one())
        if bar is not None:
          m = steps[-1]
          bar.set_postfix(reward=f"{m['reward/mean']:.3f}", acc=f"{m['reward/accuracy']:.2f}",
                          lag=f"{m['policy/lag_mean']:.1f}",
                          gen_tok_s=f"{m.get('throughput/gen_tokens_per_s', 0):.0f}")
          bar.update(1)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM routed here by scripts/train.py
      interrupted = True
      raise
    finally:
      if bar is not None:
        bar.close()
      self._shutdown()
      for t in threads:
        t.join(timeout=30)
      self._drain()
      # At exit (and always on an interrupt): the last finished step, unless it was just saved.
      if (self.checkpoint_every or interrupted) and self.checkpointer.latest_step() != self.step:
        self.save_checkpoint()
    return steps

  def _drain(self) -> None:
    """Reset the pipeline so `run` can be called again (in-flight batches are discarded)."""
    self.buffer = ReplayBuffer(self.buffer.capacity)
    self.weight_sync.reopen()
    self._scoring = queue.Queue(maxsize=1)
    self._gen_timer, self._reward_timer = _Timer(), _Timer()

  def _raise_if_failed(self, cause: BaseException | None = None) -> None:
    with self._lock:
      errors = list(self._errors)
    if errors:
      who, e = errors[0]
      raise ExecutorFailed(f"{who} executor failed: {type(e).__name__}: {e}") from e
    if cause is not None:
      raise cause

  def _train_one(self) -> dict:
    s = self.step
    t0 = time.perf_counter()
    try:
      entry = self.buffer.get(min_version=s - self.max_policy_lag, timeout=self.step_timeout_s)
    except (BufferClosed, TimeoutError) as e:
      self._raise_if_failed(e)
      raise
    t1 = time.perf_counter()
    scored: ScoredBatch = entry.item
    lags = s - np.asarray(scored.rollout.policy_version)
    if lags.max() > self.max_policy_lag or lags.min() < 0:
      raise AssertionError(f"policy lag {lags.max()} outside [0, {self.max_policy_lag}] at step {s}")
    with self._device_turn:
      t_dev = time.perf_counter()
      train_metrics = self.trainer.step(scored)
      t2 = time.perf_counter()
      self.step = s + 1
      self.last_data_state = entry.meta["data_state"]
      sync_metrics = self.weight_sync.push(self.trainer.params, self.step)
      t3 = time.perf_counter()
    with self._lock:
      self.timeline.append(("train", t_dev, t3))
      gen_busy, gen_wait = self._gen_timer.take()
      rew_busy, rew_wait = self._reward_timer.take()
    metrics = dict(entry.meta["metrics"])
    metrics.update(train_metrics)
    metrics.update(sync_metrics)
    n_train_tokens = float(np.sum(scored.rollout.response_mask))
    metrics.update({
        "policy/lag_mean": float(lags.mean()), "policy/lag_max": float(lags.max()),
        "buffer/dropped_stale": float(self.buffer.dropped_stale), "buffer/occupancy": float(len(self.buffer)),
        "time/step": t3 - t0, "time/trainer_wait": t1 - t0, "time/train": t2 - t1, "time/sync": t3 - t2,
        "time/generate": gen_busy, "time/generator_wait": gen_wait,
        "time/reward": rew_busy, "time/reward_wait": rew_wait,
        "throughput/train_tokens_per_s": n_train_tokens / max(t2 - t1, 1e-9),
    })
    self.history.append(metrics)
    if self.logger is not None:
      self.logger.log(self.step, metrics)
    if self.checkpoint_every and self.step % self.checkpoint_every == 0:
      self.save_checkpoint()
    return metrics

  # ----------------------------------------------------------------------------------------------

  def evaluate(self, examples: Sequence, *, params=None) -> dict:
    """Greedy accuracy on `examples` with the generator (current trainer weights by default)."""
    if params is None:
      self.weight_sync.push(self.trainer.params, self.step)
      params, _ = self.weight_sync.latest()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=self.sampling.max_new_tokens, n=1,
                            stop_token_ids=self.sampling.stop_token_ids, seed=0)
    rollout = self.sampler.generate(params, encode_prompts(self.tokenizer, examples), greedy).to_host()
    texts = decode_responses(self.tokenizer, rollout)
    rewards, _ = self.reward.score(texts, [ex.ground_truth for ex in examples])
    rewards = np.asarray(rewards)
    return {"eval/accuracy": float(np.mean(rewards >= 1.0)), "eval/reward_mean": float(rewards.mean()),
            "eval/samples": [(ex.prompt, t) for ex, t in zip(examples[:3], texts[:3])]}

  def close(self) -> None:
    self._shutdown()
    self.reward.close()
    self.checkpointer.close()


def _axes_for(config: ModelConfig):
  from flax import nnx

  from llamarl_jax.model.llama import Llama

  return parallel.logical_axes(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))))


def overlap_seconds(timeline: Sequence[tuple[str, float, float]], a: str, b: str) -> float:
  """Seconds during which an `a` interval and a `b` interval of `timeline` ran at the same time."""
  spans_a = [(s, e) for name, s, e in timeline if name == a]
  spans_b = [(s, e) for name, s, e in timeline if name == b]
  return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in spans_a for s2, e2 in spans_b)
