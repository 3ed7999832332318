"""A bounded, thread-safe FIFO of scored rollout batches tagged with their policy version.

Producers (the reward executor's thread) block when the buffer is full: backpressure instead of
unbounded memory growth. The consumer (the trainer) takes the oldest batch that is still within the
off-policy bound; older ones are dropped and counted. `close()` wakes every waiter.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, NamedTuple


class BufferClosed(RuntimeError):
  """The buffer was closed (shutdown or a failure elsewhere) while waiting on it."""


class Entry(NamedTuple):
  item: Any
  policy_version: int
  meta: dict


class ReplayBuffer:

  def __init__(self, capacity: int):
    if capacity < 1:
      raise ValueError(f"ReplayBuffer capacity must be >= 1, got {capacity}")
    self.capacity = capacity
    self._items: collections.deque[Entry] = collections.deque()
    self._cond = threading.Condition()
    self._closed = False
    self.dropped_stale = 0
    self.total_put = 0
    self.put_wait_seconds = 0.0
    self.get_wait_seconds = 0.0

  def put(self, item: Any, policy_version: int, meta: dict | None = None, timeout: float | None = None) -> None:
    """Append; blocks while full. Raises BufferClosed if closed, TimeoutError on timeout."""
    start = time.perf_counter()
    with self._cond:
      ok = self._cond.wait_for(lambda: self._closed or len(self._items) < self.capacity, timeout)
      self.put_wait_seconds += time.perf_counter() - start
      if self._closed:
        raise BufferClosed("replay buffer closed")
      if not ok:
        raise TimeoutError(f"replay buffer full ({self.capacity}) for {timeout}s")
      self._items.append(Entry(item, int(policy_version), meta or {}))
      self.total_put += 1
      self._cond.notify_all()

  def get(self, min_version: int = -(2**62), timeout: float | None = None) -> Entry:
    """Pop the oldest entry with policy_version >= min_version; older entries are dropped (counted)."""
    start = time.perf_counter()
    with self._cond:
      while True:
        while self._items and self._items[0].policy_version < min_version:
          self._items.popleft()
          self.dropped_stale += 1
          self._cond.notify_all()
        if self._items:
          entry = self._items.popleft()
          self._cond.notify_all()
          self.get_wait_seconds += time.perf_counter() - start
          return entry
        if self._closed:
          raise BufferClosed("replay buffer closed")
        remaining = None if timeout is None else timeout - (time.perf_counter() - start)
        if remaining is not None and remaining <= 0:
          raise TimeoutError(f"no batch arrived within {timeout}s")
        self._cond.wait(remaining)

  def close(self) -> None:
    with self._cond:
      self._closed = True
      self._cond.notify_all()

  @property
  def closed(self) -> bool:
    return self._closed

  def __len__(self) -> int:
    with self._cond:
      return len(self._items)
