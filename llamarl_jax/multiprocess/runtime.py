"""The threads of a multi-process run's processes: workers that keep their errors, hand-off slots
between threads, the generator side's landing store of weight versions, store waits that give way
to a stopping run. The protocol they carry out is `protocol.py`.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable


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
