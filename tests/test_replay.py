"""ReplayBuffer: a bounded FIFO of policy-version-tagged batches. Full -> producers block (backpressure);
too old -> dropped and counted; close() -> every waiter wakes with BufferClosed."""

import threading
import time

import pytest

from llamarl_jax.replay import BufferClosed, ReplayBuffer

BLOCKED = 0.1  # seconds a thread must stay blocked to count as blocked


def _start(fn):
  """Run fn in a daemon thread; returns (thread, outcome list: the result or the exception raised)."""
  out = []

  def run():
    try:
      out.append(fn())
    except Exception as e:  # noqa: BLE001 - the test inspects it
      out.append(e)

  thread = threading.Thread(target=run, daemon=True)
  thread.start()
  return thread, out


def test_put_get_is_fifo_with_version_and_meta():
  buf = ReplayBuffer(capacity=3)
  buf.put("a", policy_version=0, meta={"step": 0})
  buf.put("b", policy_version=1)
  assert len(buf) == 2 and buf.total_put == 2
  first, second = buf.get(), buf.get()
  assert (first.item, first.policy_version, first.meta) == ("a", 0, {"step": 0})
  assert (second.item, second.policy_version, second.meta) == ("b", 1, {})
  assert len(buf) == 0


def test_min_version_drops_and_counts_stale_batches():
  buf = ReplayBuffer(capacity=4)
  for version in (0, 1, 2, 3):
    buf.put(f"v{version}", policy_version=version)
  entry = buf.get(min_version=2)
  assert entry.item == "v2" and buf.dropped_stale == 2  # v0 and v1 were too old to train on
  assert buf.get(min_version=2).item == "v3" and buf.dropped_stale == 2


def test_capacity_must_be_positive():
  with pytest.raises(ValueError, match="capacity must be >= 1"):
    ReplayBuffer(0)


def test_full_buffer_blocks_put_until_a_get():
  buf = ReplayBuffer(capacity=1)
  buf.put("first", policy_version=0)
  thread, out = _start(lambda: buf.put("second", policy_version=1))
  thread.join(BLOCKED)
  assert thread.is_alive() and len(buf) == 1  # backpressure: the producer waits
  assert buf.get().item == "first"
  thread.join(5)
  assert out == [None] and buf.get(timeout=1).item == "second"
  assert buf.put_wait_seconds >= BLOCKED * 0.9


def test_put_on_a_full_buffer_times_out():
  buf = ReplayBuffer(capacity=1)
  buf.put("x", policy_version=0)
  start = time.perf_counter()
  with pytest.raises(TimeoutError, match="full"):
    buf.put("y", policy_version=0, timeout=0.05)
  assert time.perf_counter() - start >= 0.05 and len(buf) == 1


def test_get_on_an_empty_buffer_times_out():
  with pytest.raises(TimeoutError, match="no batch arrived"):
    ReplayBuffer(capacity=1).get(timeout=0.05)


def test_dropping_stale_batches_frees_room_for_a_blocked_producer():
  buf = ReplayBuffer(capacity=1)
  buf.put("stale", policy_version=0)
  producer, _ = _start(lambda: buf.put("fresh", policy_version=5))
  producer.join(BLOCKED)
  assert producer.is_alive()
  assert buf.get(min_version=5, timeout=5).item == "fresh"  # drop wakes the producer, whose put wakes us
  assert buf.dropped_stale == 1


def test_close_wakes_a_blocked_get_with_buffer_closed():
  buf = ReplayBuffer(capacity=1)
  thread, out = _start(buf.get)
  thread.join(BLOCKED)
  assert thread.is_alive()
  buf.close()
  thread.join(5)
  assert len(out) == 1 and isinstance(out[0], BufferClosed) and buf.closed


def test_close_wakes_a_blocked_put_with_buffer_closed():
  buf = ReplayBuffer(capacity=1)
  buf.put("x", policy_version=0)
  thread, out = _start(lambda: buf.put("y", policy_version=0))
  thread.join(BLOCKED)
  assert thread.is_alive()
  buf.close()
  thread.join(5)
  assert len(out) == 1 and isinstance(out[0], BufferClosed)
  with pytest.raises(BufferClosed):
    buf.put("z", policy_version=0)


def test_after_close_queued_batches_drain_then_get_raises():
  buf = ReplayBuffer(capacity=2)
  buf.put("x", policy_version=0)
  buf.close()
  assert buf.get().item == "x"
  with pytest.raises(BufferClosed):
    buf.get()
