"""The controller's protocol across processes: trainer processes <-> generator processes.

One `jax.distributed` job; the trainer mesh belongs to the trainer processes, the generator mesh to
the generator processes (`distributed.derive_roles`). Two kinds of cross-process transfer, both a
`jax.device_put` that every process issues in the same order (`transfer.py`):

  W(v)  policy version v, trainer -> generator (`WeightPlan`: staged on the trainer, one wire
        transfer, fan-out inside the generator mesh; LoRA: `LoraPlan`, the adapters, preceded by the
        frozen base when it changed, which the store mark "staged" = "base" announces)
  R(k)  scored batch k, generator -> trainer, straight into the trainer's batch shardings (`RowPlan`)

With the 'fixed' version schedule every version the generator uses is known in advance, so the
order of transfers is a pure function of (start step, steps, max_policy_lag): `schedule.transfer_schedule`.
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

from llamarl_jax.generation.rollout import TRAIN_FIELDS


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

  @property
  def version(self) -> int:
    """The newest version received (-1: none yet)."""
    with self._cond:
      return self._newest()

  def _newest(self) -> int:
    return max(max(self._landed, default=-1), self._current[0] if self._current is not None else -1)

  def latest(self) -> tuple[Any, int]:
    """The newest received version's (params, version); finishes its landing if needed."""
    newest = self.version
    if newest < 0:
      raise RuntimeError("no policy version has been received yet")
    got = self.take(newest, timeout=0)
    return got if got is not None else (self._current[1], self._current[0])

  def wait_for_version(self, version: int, timeout: float | None = None) -> bool:
    """Whether some version >= `version` was received within `timeout` seconds."""
    with self._cond:
      return bool(self._cond.wait_for(lambda: self._closed or self._newest() >= version, timeout)) and \
          self._newest() >= version

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

  @property
  def lora(self) -> bool:
    """The push is a `LoraPlan`'s (adapters, and the frozen base when it changed)."""
    from llamarl_jax.transfer import LoraPlan

    return isinstance(self.weights, LoraPlan)

  def stage_base(self) -> None:
    """Trainer processes, in step order: LoRA's frozen base is staged if it changed (else nothing)."""
    if self.lora:
      self.weights.stage_base()

  def staged_mark(self) -> str:
    """The store value that marks a push staged: "base" when it carries LoRA's frozen base."""
    return "base" if self.lora and self.weights.base_pending else "1"

  def receive_weights(self, mark: str) -> Any:
    """Generator processes: the receive matching a push whose store mark is `mark`."""
    return self.weights.send(None, with_base=mark == "base") if self.lora else self.weights.send(None)

  def push_weights(self, params: Any = None, timeout_s: float = 3600.0) -> Any:
    """A weight push outside a run (evaluation): every process calls it; trainer processes pass
    their params, generator processes get the generator params back. The receivers start only once
    the trainer has staged the weights (a store key), so no receive waits long inside the transfer."""
    key = f"pushes/{self.pushes}"
    self.pushes += 1
    if self.is_trainer:
      self.stage_base()
      wire = self.weights.stage(params)
      if self.me == self.roles.trainer_leader:  # before the send, which may wait for its receive
        self.kv.set(key, self.staged_mark())
      self.weights.send(wire)
      return None
    return self.weights.finish(self.receive_weights(self.kv.get(key, timeout_s)))

  def new_run(self) -> int:
    self.runs += 1
    return self.runs

  def rows(self, shapes: dict[str, list[int]]):
    from llamarl_jax import parallel
    from llamarl_jax.transfer import RowPlan

    key = tuple((k, tuple(shapes[k])) for k in TRAIN_FIELDS)
    if key not in self._rows:
      structs = {k: jax.ShapeDtypeStruct(tuple(shapes[k]), TRAIN_FIELDS[k]) for k in TRAIN_FIELDS}
      dst = {k: parallel.batch_sharding(self.trainer_mesh, len(shapes[k])) for k in TRAIN_FIELDS}
      self._rows[key] = RowPlan(structs, dst, self.generator_mesh)
    return self._rows[key]
