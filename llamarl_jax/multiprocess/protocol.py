"""The controller's protocol across processes: trainer processes <-> generator processes.

One `jax.distributed` job; the trainer mesh belongs to the trainer processes, the generator mesh to
the generator processes (`distributed.derive_roles`). Two kinds of cross-process transfer, both a
`jax.device_put` that every process issues in the same order (`transfer.py`):

  W(v)  policy version v, trainer -> generator (`WeightPlan`: staged on the trainer, one wire
        transfer, fan-out inside the generator mesh)
  R(k)  scored batch k, generator -> trainer, straight into the trainer's batch shardings (`RowPlan`)

With the 'fixed' version schedule every version the generator uses is known in advance, so the
order of transfers is a pure function of (start step, steps, max_policy_lag): `transfer_schedule`.
W(v) goes just before R(v + max(lag - 1, 0)): late enough that the trainer has trained step v - 1
(it needs R(v - 1), earlier in the order), early enough that the generator has it when batch
v + lag starts. Each process walks that list in one transfer thread, so sends and receives always
match and never deadlock.

Small facts travel through the coordination key-value store (JSON, kilobytes): each batch's
metrics, data position, shapes and timings (set by the generator leader before R(k)), each
generator process's share of the rewards, "W(v) is staged" (so the receiver never waits inside a
transfer), and `Facts` shared once (checkpoint step, evaluation results). Arrays never do.

Threads in a trainer process: the controller thread (train step, then stage W(s + 1): both run
programs on the trainer mesh, in step order on every trainer process) and the transfer thread.
In a generator process: the generator thread (every program on the generator mesh: sampling, the
gather of the rollout to host, the weight fan-out), the reward thread (host only: its share of the
rewards in its process pool) and the transfer thread.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from llamarl_jax.executors.generator import scheduled_version

BATCH_FIELDS = ("prompt_tokens", "prompt_mask", "response_tokens", "response_mask", "behaviour_logprobs",
                "advantages")


def transfer_schedule(start: int, num_steps: int, max_policy_lag: int,
                      first_version: int | None = None) -> list[tuple[str, int]]:
  """The order of every cross-process transfer of a run of `num_steps` steps from step `start`:
  [("W", version) | ("R", batch index)], every version the 'fixed' schedule uses, each once.

  first_version: the schedule's v0 (default `start`). After an exact resume it is older than `start`:
  versions v(start) .. start - 1 then come from the checkpoint and go first, with `start`'s.
  """
  if num_steps <= 0:
    return []
  first = start if first_version is None else first_version
  lo = scheduled_version(start, max_policy_lag, first)
  hi = scheduled_version(start + num_steps - 1, max_policy_lag, first)
  keyed = [((start - 1, 0, v), ("W", v)) for v in range(lo, min(start, hi) + 1)]
  keyed += [((v + max(max_policy_lag - 1, 0), 0, v), ("W", v)) for v in range(max(start + 1, lo), hi + 1)]
  keyed += [((k, 1, 0), ("R", k)) for k in range(start, start + num_steps)]
  return [op for _, op in sorted(keyed)]


def share_rows(num_prompts: int, num_shares: int, share: int) -> slice:
  """Prompts of generator process number `share` (of `num_shares`) when the rewards are split."""
  per, extra = divmod(num_prompts, num_shares)
  lo = share * per + min(share, extra)
  return slice(lo, lo + per + (share < extra))


class Facts:
  """A value one process knows and every process needs, shared through the key-value store.

  Every process calls `share` the same number of times in the same order (like a collective); the
  source passes the value (JSON-able), the others get it back.
  """

  def __init__(self, kv, timeout_s: float = 3600.0):
    self.kv, self.timeout_s, self.seq = kv, timeout_s, 0

  def share(self, name: str, value: Any = None, *, source: int) -> Any:
    key = f"facts/{self.seq}/{name}"
    self.seq += 1
    if jax.process_index() == source:
      self.kv.set_json(key, value)
      return value
    return self.kv.get_json(key, self.timeout_s)


class RemoteWeights:
  """Generator side of the weight push, with `WeightSync`'s `take` (so `GeneratorExecutor` runs on it).

  The transfer thread `put`s landed versions; `take(v)` runs in the generator thread and finishes
  the landing there (the fan-out is a program on the generator mesh: one thread issues them all).
  """

  def __init__(self, plan):
    self.plan = plan
    self._cond = threading.Condition()
    self._landed: dict[int, Any] = {}
    self._current: tuple[int, Any] | None = None
    self._closed = False
    self.last_metrics: dict = {}

  def put(self, version: int, landed: Any, metrics: dict) -> None:
    with self._cond:
      self._landed[version] = landed
      self.last_metrics = metrics
      self._cond.notify_all()

  def take(self, version: int, timeout: float | None = None) -> tuple[Any, int] | None:
    if self._current is not None and self._current[0] == version:
      return self._current[1], version
    with self._cond:
      self._cond.wait_for(lambda: self._closed or version in self._landed, timeout)
      if version not in self._landed:
        return None
      landed = self._landed.pop(version)
      for v in [v for v in self._landed if v < version]:
        del self._landed[v]
    params = self.plan.finish(landed)
    self._current = (version, params)
    return params, version

  def wait_for_version(self, version: int, timeout: float | None = None) -> bool:
    raise NotImplementedError("the 'latest' version schedule is single-process only")

  def close(self) -> None:
    with self._cond:
      self._closed = True
      self._cond.notify_all()


class Stopped(Exception):
  """The run is shutting down (another thread failed)."""


class Worker(threading.Thread):
  """A daemon thread that keeps its exception for the controller thread and sets `stop` on failure."""

  def __init__(self, target: Callable[[], None], name: str, stop: threading.Event):
    super().__init__(name=name, daemon=True)
    self._target_fn, self._stop_event, self.error = target, stop, None

  def run(self) -> None:
    try:
      self._target_fn()
    except BaseException as e:  # noqa: BLE001 - re-raised by the controller thread
      self.error = e
      self._stop_event.set()


class Slots:
  """Values by integer key, waited for by another thread (version -> staged weights, batch -> data)."""

  def __init__(self):
    self._cond = threading.Condition()
    self._items: dict[int, Any] = {}

  def put(self, key: int, value: Any) -> None:
    with self._cond:
      self._items[key] = value
      self._cond.notify_all()

  def __len__(self) -> int:
    with self._cond:
      return len(self._items)

  def pop(self, key: int, stop: threading.Event, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    with self._cond:
      while key not in self._items:
        if stop.is_set():
          raise Stopped()
        left = deadline - time.monotonic()
        if left <= 0:
          raise TimeoutError(f"{what} {key} was not ready within {timeout_s:.0f} s")
        self._cond.wait(min(left, 0.2))
      return self._items.pop(key)


def wait_key(kv, key: str, stop: threading.Event, timeout_s: float) -> str:
  """A store value, waited for in short slices so that a stopping run is not held up."""
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      return kv.get(key, min(1.0, max(deadline - time.monotonic(), 0.001)))
    except TimeoutError:
      if stop.is_set():
        raise Stopped() from None
      if time.monotonic() >= deadline:
        raise


def raise_failed(threads: list[Worker]) -> None:
  """Raise the first real error of `threads` (a thread that merely saw the stop is not one)."""
  for t in threads:
    if t.error is not None and not isinstance(t.error, Stopped):
      raise RuntimeError(f"{t.name} thread failed: {type(t.error).__name__}: {t.error}") from t.error


def join_all(threads: list[Worker], stop: threading.Event, poll_s: float = 0.1) -> None:
  """Wait for `threads`; as soon as one fails, set `stop` and raise its error."""
  while any(t.is_alive() for t in threads):
    if any(t.error is not None for t in threads):
      stop.set()
      raise_failed(threads)
    time.sleep(poll_s)
  raise_failed(threads)


# The trainer's batch fields and dtypes (TrainerExecutor._BATCH_DTYPES): R(k) moves exactly these.
BATCH_DTYPES = {"prompt_tokens": np.int32, "prompt_mask": np.int32, "response_tokens": np.int32,
                "response_mask": np.int32, "behaviour_logprobs": np.float32, "advantages": np.float32,
                "token_versions": np.int32}


def batch_arrays(scored) -> dict[str, np.ndarray]:
  """The host arrays R(k) moves, in the trainer's dtypes."""
  r = scored.rollout
  arrays = {"prompt_tokens": r.prompt_tokens, "prompt_mask": r.prompt_mask,
            "response_tokens": r.response_tokens, "response_mask": r.response_mask,
            "behaviour_logprobs": r.behaviour_logprobs, "advantages": scored.advantages,
            "token_versions": r.token_versions}
  return {k: np.asarray(arrays[k], BATCH_DTYPES[k]) for k in BATCH_DTYPES}


def run_key(run: int, *parts) -> str:
  return "/".join([f"run{run}", *map(str, parts)])


class Context:
  """What every process of a multi-process run keeps: roles, the store, facts, the transfer plans.

  weights: the `WeightPlan` (trainer params -> generator layout). `rows(shapes)`: the `RowPlan`
  moving a batch with these shapes into the trainer's batch shardings (cached per shape: prompt
  buckets vary).
  """

  def __init__(self, roles, weights, trainer_mesh, generator_mesh):
    from llamarl_jax.distributed import KVStore

    self.roles, self.weights = roles, weights
    self.trainer_mesh, self.generator_mesh = trainer_mesh, generator_mesh
    self.kv = KVStore()
    self.facts = Facts(self.kv)
    self.me = jax.process_index()
    self.runs = self.pushes = 0
    self._rows: dict = {}

  @property
  def is_trainer(self) -> bool:
    return self.me in self.roles.trainer

  @property
  def is_generator(self) -> bool:
    return self.me in self.roles.generator

  @property
  def generator_rank(self) -> int:
    """This process's index among the generator processes (its share of the rewards)."""
    return self.roles.generator.index(self.me)

  def push_weights(self, params: Any = None, timeout_s: float = 3600.0) -> Any:
    """A weight push outside a run (evaluation): every process calls it; trainer processes pass
    their params, generator processes get the generator params back. The receivers start only once
    the trainer has staged the weights (a store key), so no receive waits long inside the transfer."""
    key = f"pushes/{self.pushes}"
    self.pushes += 1
    if self.is_trainer:
      wire = self.weights.stage(params)
      if self.me == self.roles.trainer_leader:  # before the send, which may wait for its receive
        self.kv.set(key, "1")
      self.weights.send(wire)
      return None
    self.kv.get(key, timeout_s)
    return self.weights.finish(self.weights.send(None))

  def new_run(self) -> int:
    self.runs += 1
    return self.runs

  def rows(self, shapes: dict[str, list[int]]):
    from llamarl_jax import parallel
    from llamarl_jax.transfer import RowPlan

    key = tuple((k, tuple(shapes[k])) for k in BATCH_DTYPES)
    if key not in self._rows:
      structs = {k: jax.ShapeDtypeStruct(tuple(shapes[k]), BATCH_DTYPES[k]) for k in BATCH_DTYPES}
      dst = {k: parallel.batch_sharding(self.trainer_mesh, len(shapes[k])) for k in BATCH_DTYPES}
      self._rows[key] = RowPlan(structs, dst, self.generator_mesh)
    return self._rows[key]
