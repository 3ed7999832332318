"""The generator executor: draws prompts, waits for the scheduled policy version, samples rollouts.

It owns its loop, so it can run beside the trainer in one process (the controller's thread) or alone
in a generator process. It takes weights from a weight source (`take(version, timeout)`: in one
process the `WeightSync`) and hands each `Generated` batch to a sink callable.

The version schedule decides which policy generates batch k:
  'fixed'  (default): exactly v(k) = max(first_version, k - max_policy_lag). With seeds derived from k
           and the k-th draw of the prompt source, every batch (and so every per-step metric) is a pure
           function of (config, seed), whatever the thread timing.
  'latest': the newest version available once it is >= k - max_policy_lag (the fastest, not reproducible).

Two engines:
  static (`Sampler`): batch k is one `Sampler.generate` call under its version.
  slots (`SlotEngine`, continuous batching): prompts stream through the engine's KV slots. Batch k
           is drawn when the queued prompts can no longer fill the free slots; a batch is handed on as
           soon as its last group completes, while the slots already decode the next batches. Swap
           points are a function of the schedule only: before drawing (and admitting) batch k the
           engine swaps to v(k); in-flight sequences continue under the new weights, each token
           recording its version. While v(k) is not available the engine keeps decoding what it holds
           as long as some batch < v(k) is unfinished (the trainer needs it to make v(k)), and
           otherwise waits, in-flight sequences included (the price of reproducibility when the
           trainer is the slower side). So the engine's steps, and each token's version, are the same
           whatever the timing. Batch k trains at step k, so the oldest token of every trained sequence
           has version v(k) >= k - max_policy_lag: the lag bound is never violated, and no group is
           moved to a later step (that would break the bound or, if such groups were dropped, bias
           training against long responses). 'latest' swaps to any newer version between chunks
           (PipelineRL's in-flight updates) and never pauses running sequences to wait for one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import numpy as np

from llamarl_jax.generation.engine import SlotEngine, rollout_from_groups
from llamarl_jax.batch import FINISH_LENGTH
from llamarl_jax.generation.sampler import Sampler, SamplingParams
from llamarl_jax.config import DynamicSampling
from llamarl_jax.envs import Episodes, SingleTurn, run_episodes
from llamarl_jax.envs.episodes import TOOL_STATUS_METRICS, EpisodeRows, ToolSteps, turn_seed
from llamarl_jax.metrics import append_bounded
from llamarl_jax.schedule import batch_seed, draw_seed, scheduled_version


def informative_groups(rewards, num_groups: int, samples_per_prompt: int) -> np.ndarray:
  """Per group `[num_groups]` bool: do its rewards (contiguous `[num_groups * samples_per_prompt]`) differ?"""
  r = np.asarray(rewards, np.float64).reshape(num_groups, samples_per_prompt)
  return r.max(axis=1) > r.min(axis=1)


def pick_groups(informative: list[np.ndarray], wanted: int) -> list[tuple[int, int]]:
  """(draw, group) of the batch's groups: the first `wanted` informative groups in draw order, then (if
  there are not enough) the uninformative ones in draw order. Pure; `informative[d]` is draw d's mask."""
  order = [(d, g) for d, mask in enumerate(informative) for g in np.flatnonzero(mask)]
  order += [(d, g) for d, mask in enumerate(informative) for g in np.flatnonzero(~np.asarray(mask))]
  return [(int(d), int(g)) for d, g in order[:wanted]]


def take_groups(rollouts: list, picks: list[tuple[int, int]], samples_per_prompt: int, pad_id: int):
  """One host `RolloutBatch` of the picked groups (group ids renumbered 0..), prompts left-padded to the
  widest draw's width."""
  width = max(np.shape(r.prompt_tokens)[1] for r in rollouts)
  n = samples_per_prompt
  parts = []
  for new_id, (d, g) in enumerate(picks):
    rows = slice(g * n, (g + 1) * n)
    r = jax.tree.map(lambda x, rows=rows: np.asarray(x)[rows], rollouts[d])
    extra = width - r.prompt_tokens.shape[1]
    r = r.replace(prompt_tokens=np.pad(r.prompt_tokens, ((0, 0), (extra, 0)), constant_values=pad_id),
                  prompt_mask=np.pad(r.prompt_mask, ((0, 0), (extra, 0))),
                  group_ids=np.full(n, new_id, np.int32),
                  routing=None if r.routing is None else np.pad(r.routing, ((0, 0), (extra, 0), (0, 0), (0, 0)),
                                                                constant_values=-1))
    parts.append(r)
  return jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *parts)


class Timer:
  """Seconds busy and waiting since the last `take`; written by an executor's thread, taken by the
  trainer's (every access holds the lock, so no second is lost between a read and the reset)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._busy = self._wait = 0.0

  def add(self, *, busy: float = 0.0, wait: float = 0.0) -> None:
    with self._lock:
      self._busy += busy
      self._wait += wait

  def take(self) -> tuple[float, float]:
    """(busy, wait) since the last take, and both reset to 0."""
    with self._lock:
      out = (self._busy, self._wait)
      self._busy = self._wait = 0.0
    return out


@dataclass
class Generated:
  """One generated batch: batch index, rollout on host, its prompts, the data position after them."""
  index: int
  rollout: Any
  examples: list
  data_state: dict
  metrics: dict = field(default_factory=dict)
  rewards: Any = None  # [B] when scored in the generator loop (dynamic sampling), else None
  reward_metrics: dict = field(default_factory=dict)  # the reward executor's metrics of those rewards
  answers: list[str] | None = None  # [B] what the reward function scores (multi-turn); None: the responses
  env_rewards: Any = None  # [B] the environments' reward contributions (multi-turn), else None


def encode_prompts(tokenizer, examples) -> list[list[int]]:
  """Token ids of each example's prompt (`PromptExample.encode`: BOS for plain prompts; a chat-templated
  prompt already carries its special tokens)."""
  return [ex.encode(tokenizer) for ex in examples]


class GeneratorExecutor:
  """Generates batch after batch on the generator mesh under the version schedule.

  device_turn: a lock shared with the trainer in colocated mode (one mesh, taking turns); None otherwise.
  delay_s: an emulated extra generation time per batch (holds the devices like real work); benchmarks.
  engine: a `SlotEngine` (built with `sampling`) to stream batches through; None = static batches.
  dynamic_sampling: a `DynamicSampling` (static batches only), with `score(texts, ground_truths) ->
    (rewards, metrics)` (a `RewardExecutor.score`); None = every drawn group is kept.
  env: the `Environment` of an episode (None = `SingleTurn`), with `env_config` (its `EnvConfig`:
    response width, observation budget, tool threads). Static batches run episodes through
    `envs.run_episodes`; the slot engine sends a row's later turns back through its slots
    (`_resume_rows`); tool steps run on this executor's tool threads either way.
  """

  def __init__(self, sampler: Sampler, tokenizer, prompt_source, sampling: SamplingParams, *,
               prompts_per_step: int, max_policy_lag: int, version_schedule: str = "fixed", seed: int = 0,
               delay_s: float = 0.0, device_turn: Any = None, engine: SlotEngine | None = None,
               dynamic_sampling: DynamicSampling | None = None, score: Callable | None = None,
               env: Any = None, env_config: Any = None):
    self.env = env if env is not None else SingleTurn()
    self.env_config = env_config
    self.tool_steps = None  # env.step on the tool threads, time-limited (multi-turn)
    if not isinstance(self.env, SingleTurn):
      if env_config is None:
        raise ValueError("multi-turn episodes need their EnvConfig (response width, observation budget, tool threads)")
      self.tool_steps = ToolSteps(self.env, env_config.tool_workers, env_config.step_limit_s)
    if dynamic_sampling is not None and (engine is not None or score is None):
      raise ValueError("dynamic sampling needs the static engine (GeneratorConfig.engine='static') and a score "
                       "function; the slot engine streams batches and does not redraw one")
    self.dynamic_sampling, self.score = dynamic_sampling, score
    if engine is not None and dataclasses.replace(engine.sampling, seed=0) != dataclasses.replace(sampling, seed=0):
      raise ValueError(f"the SlotEngine samples with {engine.sampling}, the generator with {sampling}; build the "
                       "engine with the generator's SamplingParams")
    self.engine = engine
    self.sampler = sampler
    self.tokenizer = tokenizer
    self.prompt_source = prompt_source
    self.sampling = sampling
    self.prompts_per_step = prompts_per_step
    self.max_policy_lag = max_policy_lag
    self.version_schedule = version_schedule
    self.seed = seed
    self.delay_s = delay_s
    self.device_turn = device_turn if device_turn is not None else contextlib.nullcontext()
    self.timer = Timer()
    self.timeline: list[tuple[str, float, float]] = []  # ("generate" | "swap", start, end) of device work
    self.status = ("not started", time.monotonic())  # what the loop is doing, since when (stall reports)

  def wait_for_weights(self, weights, index: int, first_version: int, stop: threading.Event):
    """(params, version) for batch `index` under the schedule; None if `stop` was set while waiting."""
    while not stop.is_set():
      if self.version_schedule == "fixed":
        got = weights.take(scheduled_version(index, self.max_policy_lag, first_version), timeout=0.2)
        if got is not None:
          return got
      elif weights.wait_for_version(index - self.max_policy_lag, timeout=0.2):
        return weights.latest()
    return None

  def generate(self, index: int, params: Any, version: int) -> Generated:
    """Draw the next prompts and sample batch `index` with `params` (policy `version`)."""
    t1 = time.perf_counter()
    if self.dynamic_sampling is not None:
      item = self.generate_informative(index, params, version)
      t2 = time.perf_counter()
      self.timer.add(busy=t2 - t1)
      tokens = item.metrics.pop("generate/tokens")
      item.metrics["throughput/gen_tokens_per_s"] = tokens / max(t2 - t1, 1e-9)
      return item
    examples = self.prompt_source.next_batch(self.prompts_per_step)
    data_state = self.prompt_source.state_dict()
    episodes = self.sample(examples, batch_seed(self.seed, index), params, version)
    rollout = episodes.rollout
    t2 = time.perf_counter()
    self.timer.add(busy=t2 - t1)
    counters = self.prompt_source.counters()  # data/truncated_prompts, data/skipped_rows
    return Generated(index, rollout, examples, data_state, {
        "throughput/gen_tokens_per_s": float(np.sum(rollout.response_mask)) / max(t2 - t1, 1e-9),
        "generate/response_length_mean": float(np.mean(rollout.lengths)),
        "generate/frac_truncated": float(np.mean(rollout.finish_reason == FINISH_LENGTH)), **counters,
        **episodes.metrics}, answers=episodes.answers, env_rewards=episodes.env_rewards)

  def sample(self, examples, seed: int, params: Any, version: int, *, greedy: bool = False,
             n: int | None = None, record: bool = True) -> Episodes:
    """The episodes of `examples` (`envs.run_episodes`: one `Sampler.generate` call per turn on the
    generator's devices, each taking the device turn) -> host batch, answers, environment rewards and
    metrics. greedy / n: temperature 0 / samples per prompt instead of the run's (evaluations);
    record=False: not in the timeline and without the emulated delay (evaluations)."""
    sampling = dataclasses.replace(self.sampling, seed=seed, n=self.sampling.n if n is None else n,
                                   **({"temperature": 0.0} if greedy else {}))

    def generate(prompts, sampling):
      with self.device_turn:
        t_dev = time.perf_counter()
        rollout = self.sampler.generate(params, prompts, sampling, policy_version=version).to_host()
        if self.delay_s and record:
          time.sleep(self.delay_s)
        t2 = time.perf_counter()
      if record:
        append_bounded(self.timeline, ("generate", t_dev, t2))
      return rollout

    env_config = self.env_config
    return run_episodes(generate, self.env, examples, encode_prompts(self.tokenizer, examples), sampling,
                        tokenizer=self.tokenizer,
                        response_width=(env_config.response_width(sampling.max_new_tokens) if env_config
                                        else sampling.max_new_tokens),
                        max_observation_tokens=env_config.max_observation_tokens if env_config else 0,
                        tool_steps=self.tool_steps, batch_multiple=self.sampler.batch_multiple,
                        pad_id=self.sampler.pad_id)

  def evaluation_episodes(self, examples, params: Any, *, samples: int, seed: int) -> tuple[Episodes, Episodes | None]:
    """A held-out evaluation's episodes of `examples` under `params` (not recorded): greedy, and with
    `samples` > 0 that many sampled per problem, drawn with `seed`."""
    greedy = self.sample(examples, 0, params, 0, greedy=True, n=1, record=False)
    sampled = self.sample(examples, seed, params, 0, n=samples, record=False) if samples else None
    return greedy, sampled

  def close(self) -> None:
    """Stop the tool threads and the environment's tools (idempotent)."""
    if self.tool_steps is not None:
      self.tool_steps.close()
    if hasattr(self.env, "close"):
      self.env.close()

  def generate_informative(self, index: int, params: Any, version: int) -> Generated:
    """Batch `index` under DAPO's dynamic sampling (see `DynamicSampling`): draw prompts_per_step prompts,
    sample and score them, keep the groups whose rewards differ; repeat (same version, seeds
    `draw_seed(seed, index, d)`) until prompts_per_step informative groups or max_draws draws."""
    from llamarl_jax.executors.scoring import decode_responses  # scoring imports this module's users

    pps, n = self.prompts_per_step, self.sampling.n
    rollouts, examples, rewards, informative, reward_metrics = [], [], [], [], {}
    answers, env_rewards, episode_metrics = [], [], []
    for d in range(self.dynamic_sampling.max_draws):
      drawn = self.prompt_source.next_batch(pps)
      if len(drawn) < pps and d > 0:  # a finite source ran out: keep what the earlier draws have
        break
      episodes = self.sample(drawn, draw_seed(self.seed, index, d), params, version)
      rollout = episodes.rollout
      texts = episodes.answers if episodes.answers is not None else decode_responses(self.tokenizer, rollout)
      r, m = self.score(texts, [ex.ground_truth for ex in drawn for _ in range(n)])
      for k, v in m.items():  # counts add up over the draws; a peak memory is a max
        reward_metrics[k] = max(reward_metrics.get(k, v), v) if k.endswith("_mb") else reward_metrics.get(k, 0) + v
      rollouts.append(rollout)
      examples.append(drawn)
      rewards.append(np.asarray(r, np.float32))
      env_r = (np.zeros(len(texts), np.float32) if episodes.env_rewards is None
               else np.asarray(episodes.env_rewards, np.float32))
      answers.append(texts)
      env_rewards.append(env_r)
      episode_metrics.append(episodes.metrics)
      informative.append(informative_groups(r if episodes.env_rewards is None else rewards[-1] + env_r, len(drawn), n))
      if sum(int(np.sum(x)) for x in informative) >= pps:
        break
    data_state = self.prompt_source.state_dict()
    picks = pick_groups(informative, pps)
    rollout = take_groups(rollouts, picks, n, self.sampler.pad_id)
    batch_rewards = np.concatenate([rewards[d][g * n:(g + 1) * n] for d, g in picks])
    multi_turn = not isinstance(self.env, SingleTurn)
    batch_env_rewards = np.concatenate([env_rewards[d][g * n:(g + 1) * n] for d, g in picks]) if multi_turn else None
    batch_answers = [answers[d][i] for d, g in picks for i in range(g * n, (g + 1) * n)] if multi_turn else None
    drawn_groups = sum(len(x) for x in informative)
    kept_informative = sum(bool(informative[d][g]) for d, g in picks)
    counters = self.prompt_source.counters()
    metrics = {
        "generate/tokens": float(sum(np.sum(r.response_mask) for r in rollouts)),
        "generate/response_length_mean": float(np.mean(rollout.lengths)),
        "generate/frac_truncated": float(np.mean(rollout.finish_reason == FINISH_LENGTH)),
        "dynamic_sampling/draws": float(len(rollouts)),
        "dynamic_sampling/drop_rate": float(1 - sum(int(np.sum(x)) for x in informative) / drawn_groups),
        "dynamic_sampling/frac_groups_uninformative": float(1 - kept_informative / len(picks)),
        **counters}
    for k in episode_metrics[0]:  # the episode metrics of all draws: means of means, sums of counts
      values = [m.get(k, 0.0) for m in episode_metrics]
      metrics[k] = float(sum(values) if k in ("tool/calls", "tool/errors", *TOOL_STATUS_METRICS) else np.mean(values))
    return Generated(index, rollout, [examples[d][g] for d, g in picks], data_state, metrics,
                     rewards=batch_rewards, reward_metrics=reward_metrics, answers=batch_answers,
                     env_rewards=batch_env_rewards)

  def run(self, weights, emit: Callable[[Generated], bool], stop: threading.Event, *, start_index: int,
          first_version: int) -> None:
    """Generate batches start_index, start_index + 1, ... until `stop` is set or `emit` returns False."""
    if self.engine is not None:
      return self._run_slots(weights, emit, stop, start_index=start_index, first_version=first_version)
    k = start_index
    while not stop.is_set():
      t0 = time.perf_counter()
      self.status = (f"waiting for the weights of batch {k}", time.monotonic())
      got = self.wait_for_weights(weights, k, first_version, stop)
      if got is None:
        return
      self.timer.add(wait=time.perf_counter() - t0)
      params, version = got
      self.status = (f"generating batch {k} with policy version {version}", time.monotonic())
      item = self.generate(k, params, version)
      self.status = (f"handing batch {k} to the reward executor", time.monotonic())
      if not emit(item):
        return
      k += 1

  # -- the streaming engine ------------------------------------------------------------------------

  def _wait(self, weights, version: int, stop: threading.Event):
    """(params, version) for admitting prompts that need `version`; None if stopped while waiting."""
    t0 = time.perf_counter()
    try:
      while not stop.is_set():
        if self.version_schedule == "fixed":
          got = weights.take(version, timeout=0.2)
          if got is not None:
            return got
        elif weights.wait_for_version(version, timeout=0.2):
          return weights.latest()
      return None
    finally:
      self.timer.add(wait=time.perf_counter() - t0)

  def _run_slots(self, weights, emit, stop, *, start_index: int, first_version: int) -> None:
    """The streaming loop (see the module docstring): draw when slots free up, swap on schedule, step, hand on."""
    eng, pps, fixed = self.engine, self.prompts_per_step, self.version_schedule == "fixed"
    multi_turn = not isinstance(self.env, SingleTurn)
    eng.reset()
    draws: dict[int, dict] = {}  # batch index -> its prompts, data state and completed groups
    pending: list[tuple[int, int, int, Any]] = []  # tool steps in flight: (batch, row, turn, PendingStep)
    next_draw = next_emit = start_index
    self._busy = 0.0  # seconds of work since the last batch was handed on
    while not stop.is_set():
      t_busy = time.perf_counter()
      while eng.queue_depth * eng.n < eng.num_free:  # queued prompts cannot fill the free slots: draw batch k
        version = scheduled_version(next_draw, self.max_policy_lag, first_version)
        if eng.version is None or eng.version < version:
          # Swap only once the queued prompts (of older versions) are admitted, and wait for the version
          # only once nothing it depends on is still running here: under 'fixed' every batch < version
          # was handed on (the trainer needs them to make it); under 'latest' the slots are idle.
          if eng.version is not None and (eng.queue_depth or (next_emit < version if fixed else eng.num_busy)):
            break
          self._busy += time.perf_counter() - t_busy
          self.status = (f"waiting for policy version {version} to admit batch {next_draw}", time.monotonic())
          got = self._wait(weights, version, stop)
          if got is None:
            return
          t_busy = time.perf_counter()
          with self.device_turn:
            t_swap = time.perf_counter()
            eng.swap(*got)
            append_bounded(self.timeline, ("swap", t_swap, time.perf_counter()))
        examples = self.prompt_source.next_batch(pps)
        prompts = encode_prompts(self.tokenizer, examples)
        draws[next_draw] = {"examples": examples, "data_state": self.prompt_source.state_dict(), "groups": {},
                            "counters": self.prompt_source.counters(), "t0": time.perf_counter()}
        if multi_turn:
          draws[next_draw]["episodes"] = self._episode_rows(examples, prompts)
        eng.submit(prompts, seed=batch_seed(self.seed, next_draw),
                   version=version, tags=[(next_draw, i) for i in range(len(examples))])
        next_draw += 1
      if not fixed and weights.version > eng.version:
        with self.device_turn:
          t_swap = time.perf_counter()
          eng.swap(*weights.latest())  # an in-flight update: the newest weights, between chunks
          append_bounded(self.timeline, ("swap", t_swap, time.perf_counter()))
      self.status = (f"decoding (batches {next_emit}..{next_draw - 1} drawn, policy version {eng.version})",
                     time.monotonic())
      with self.device_turn:
        t_dev = time.perf_counter()
        completed = eng.step()
        t_end = time.perf_counter()
      append_bounded(self.timeline, ("generate", t_dev, t_end))
      for g in completed:
        if len(g.tag) == 2:  # a prompt's n samples (an episode's first turn)
          draws[g.tag[0]]["groups"][g.tag[1]] = g
        if multi_turn:
          pending += self._turns_done(draws[g.tag[0]], g)
      if pending:
        pending = self._resume_rows(draws, pending, wait=fixed or (eng.idle and not eng.queue_depth))
      self._busy += time.perf_counter() - t_busy
      while next_emit in draws and self._batch_done(draws[next_emit], next_emit, pending):
        self.status = (f"handing batch {next_emit} to the reward executor", time.monotonic())
        if not emit(self._generated(next_emit, draws.pop(next_emit))):
          return
        next_emit += 1

  # -- multi-turn episodes on the slot engine --------------------------------------------------------

  def _episode_rows(self, examples, prompts) -> EpisodeRows:
    c = self.env_config
    return EpisodeRows(self.env, examples, prompts, self.sampling.n, tokenizer=self.tokenizer,
                       response_width=c.response_width(self.sampling.max_new_tokens),
                       max_observation_tokens=c.max_observation_tokens, stop_token_ids=self.sampling.stop_token_ids,
                       max_context=self.engine.max_prompt_len)

  def _turns_done(self, draw: dict, g) -> list[tuple[int, int, int, Any]]:
    """A completed group's turns into its batch's episodes; the tool steps they start (on the tool
    threads): (batch, row, turn, PendingStep). A first turn's group holds a prompt's n rows; a later turn's
    group is one row, tagged (batch, row, turn)."""
    ep: EpisodeRows = draw["episodes"]
    if len(g.tag) == 2:
      k, i = g.tag
      rows, turn = [i * self.sampling.n + j for j in range(len(g.lengths))], 1
    else:
      k, row, turn = g.tag
      rows = [row]
    started = []
    for j, row in enumerate(rows):
      text = ep.add_turn(row, g.tokens[j], g.logprobs[j], g.versions[j], g.lengths[j], g.finish[j])
      if text is not None:
        started.append((k, row, turn, self.tool_steps.submit(*ep.request(row, text))))
    return started

  def _resume_rows(self, draws: dict, pending: list, *, wait: bool) -> list:
    """Rows whose tool step finished go back into the engine: their whole episode so far is the prompt
    of their next turn (one row, seed `turn_seed(batch seed, turn, row)`), re-prefilled into a free
    slot while other rows keep decoding; a row whose episode outgrew the engine's longest prompt ends
    there, cut (`EpisodeRows.max_context`). wait=True (the 'fixed' schedule, or nothing else to do):
    every pending step is awaited here, in submission order, so that when a row re-enters the engine
    is a function of the schedule, not of the tools' timing; otherwise only the finished ones.
    Returns the steps still pending."""
    left = []
    t0 = time.perf_counter()
    steps = self.tool_steps
    for k, row, turn, step in pending:
      if not wait and not step.done() and not steps.overdue(step):
        left.append((k, row, turn, step))
        continue
      ep: EpisodeRows = draws[k]["episodes"]
      if ep.add_transition(row, steps.result(step)):  # EnvironmentFailed: the environment's bug stops the run
        self.engine.submit([ep.context(row)], seed=turn_seed(batch_seed(self.seed, k), turn, row), n=1,
                           tags=[(k, row, turn + 1)])
    waited = time.perf_counter() - t0
    for k in {p[0] for p in pending}:
      draws[k]["episodes"].tool_wait += waited
    return left

  def _batch_done(self, draw: dict, index: int, pending: list) -> bool:
    if len(draw["groups"]) < self.prompts_per_step:
      return False
    if "episodes" not in draw:
      return True
    return bool(draw["episodes"].done.all()) and not any(p[0] == index for p in pending)

  def _generated(self, index: int, draw: dict) -> Generated:
    """Batch `index` from its completed groups (prompt order), with the engine's metrics since the last one."""
    groups = [draw["groups"][i] for i in range(self.prompts_per_step)]
    width = self.engine.sampler.prompt_bucket(max(len(g.prompt) for g in groups))
    rollout = rollout_from_groups(groups, pad_id=self.engine.pad_id, prompt_width=width)
    episodes = {}
    if "episodes" in draw:  # multi-turn: the episodes' turns and observations, prompts as the first turn's
      ep: EpisodeRows = draw["episodes"]
      rollout = ep.batch(rollout.prompt_tokens, rollout.prompt_mask, rollout.group_ids, self.engine.pad_id)
      episodes = {"answers": ep.answers(), "env_rewards": ep.reward.copy()}
      draw["counters"] = {**draw["counters"], **ep.metrics(time.perf_counter() - draw["t0"])}
    if self.delay_s:
      with self.device_turn:
        t0 = time.perf_counter()
        time.sleep(self.delay_s)
        append_bounded(self.timeline, ("generate", t0, time.perf_counter()))
      self._busy += self.delay_s
    metrics = self.engine.take_metrics()
    tokens = metrics.pop("generate/tokens")
    self.timer.add(busy=self._busy)
    metrics.update({
        "throughput/gen_tokens_per_s": tokens / max(self._busy, 1e-9),
        "generate/response_length_mean": float(np.mean(rollout.lengths)),
        "generate/frac_truncated": float(np.mean(rollout.finish_reason == FINISH_LENGTH)),
        **draw["counters"]})  # data/truncated_prompts, data/skipped_rows as of this batch's draw (+ episodes)
    self._busy = 0.0
    return Generated(index, rollout, draw["examples"], draw["data_state"], metrics, **episodes)
