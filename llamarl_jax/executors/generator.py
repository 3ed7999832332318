"""The generator executor: draws prompts, waits for the scheduled policy version, samples rollouts.

It owns its loop, so it can run beside the trainer in one process (the controller's thread) or alone
in a generator process. It takes weights from a weight source (`take(version, timeout)`: in one
process the `WeightSync`) and hands each `Generated` batch to a sink callable.

The version schedule decides which policy generates batch k:
  'fixed'  (default): exactly v(k) = max(first_version, k - max_policy_lag). With seeds derived from k
           and the k-th draw of the prompt source, every batch (and so every per-step metric) is a pure
           function of (config, seed), whatever the thread timing.
  'latest': the newest version available once it is >= k - max_policy_lag (the fastest, not reproducible).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from llamarl_jax.generation.rollout import FINISH_LENGTH
from llamarl_jax.generation.sampler import Sampler, SamplingParams

VERSION_SCHEDULES = ("fixed", "latest")


def scheduled_version(index: int, max_policy_lag: int, first_version: int = 0) -> int:
  """The policy version that generates batch `index` under the 'fixed' schedule."""
  return max(first_version, index - max_policy_lag)


def batch_seed(seed: int, index: int) -> int:
  """The sampling seed of batch `index` (a pure function, so any process can recompute it)."""
  return seed * 1_000_003 + index


@dataclass
class Timer:
  """Seconds busy and waiting since the last `take` (thread-safe enough: one writer, one reader)."""
  busy: float = 0.0
  wait: float = 0.0

  def take(self) -> tuple[float, float]:
    b, w = self.busy, self.wait
    self.busy = self.wait = 0.0
    return b, w


@dataclass
class Generated:
  """One generated batch: batch index, rollout on host, its prompts, the data position after them."""
  index: int
  rollout: Any
  examples: list
  data_state: dict
  metrics: dict = field(default_factory=dict)


def encode_prompts(tokenizer, examples) -> list[list[int]]:
  """Token ids of each example's prompt (`PromptExample.encode`: BOS for plain prompts; a chat-templated
  prompt already carries its special tokens)."""
  return [ex.encode(tokenizer) for ex in examples]


class GeneratorExecutor:
  """Generates batch after batch on the generator mesh under the version schedule.

  device_turn: a lock shared with the trainer in colocated mode (one mesh, taking turns); None otherwise.
  delay_s: an emulated extra generation time per batch (holds the devices like real work); benchmarks.
  """

  def __init__(self, sampler: Sampler, tokenizer, prompt_source, sampling: SamplingParams, *,
               prompts_per_step: int, max_policy_lag: int, version_schedule: str = "fixed", seed: int = 0,
               delay_s: float = 0.0, device_turn: Any = None):
    if version_schedule not in VERSION_SCHEDULES:
      raise ValueError(f"version_schedule must be one of {VERSION_SCHEDULES}, got {version_schedule!r}")
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
    self.timeline: list[tuple[str, float, float]] = []  # ("generate", start, end) of device work

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
    examples = self.prompt_source.next_batch(self.prompts_per_step)
    data_state = self.prompt_source.state_dict()
    sampling = dataclasses.replace(self.sampling, seed=batch_seed(self.seed, index))
    with self.device_turn:
      t_dev = time.perf_counter()
      rollout = self.sampler.generate(params, encode_prompts(self.tokenizer, examples), sampling,
                                      policy_version=version).to_host()
      if self.delay_s:
        time.sleep(self.delay_s)
      t2 = time.perf_counter()
    self.timer.busy += t2 - t1
    self.timeline.append(("generate", t_dev, t2))
    return Generated(index, rollout, examples, data_state, {
        "throughput/gen_tokens_per_s": float(np.sum(rollout.lengths)) / max(t2 - t1, 1e-9),
        "generate/response_length_mean": float(np.mean(rollout.lengths)),
        "generate/frac_truncated": float(np.mean(rollout.finish_reason == FINISH_LENGTH))})

  def run(self, weights, emit: Callable[[Generated], bool], stop: threading.Event, *, start_index: int,
          first_version: int) -> None:
    """Generate batches start_index, start_index + 1, ... until `stop` is set or `emit` returns False."""
    k = start_index
    while not stop.is_set():
      t0 = time.perf_counter()
      got = self.wait_for_weights(weights, k, first_version, stop)
      if got is None:
        return
      self.timer.wait += time.perf_counter() - t0
      params, version = got
      if not emit(self.generate(k, params, version)):
        return
      k += 1
