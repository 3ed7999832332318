"""The slot engine's decode chunks in flight: each one's results on their way to the host, and the
watcher thread that notes when the device finished each one.

`SlotEngine` dispatches up to `chunks_in_flight` decode chunks before it blocks on the oldest; an
`InFlight` holds one dispatched chunk (its `ChunkResult` copying to the host, the slots' generation
numbers at dispatch). One watcher thread per engine (`start_watcher`) blocks on the chunks in
dispatch order, so the device's idle time between chunks is timed without polling, and a chunk that
failed on the device raises in the engine's thread (`InFlight.get`).
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import weakref

import jax
import numpy as np

from llamarl_jax.generation.slot_programs import ChunkResult


class InFlight:
  """A dispatched decode chunk: its `ChunkResult` on its way to the host, the slots' generation
  numbers when it was dispatched, whether prompts were queued then (the steady state of a stream:
  `slot_utilization_queued`), and what the engine's watcher thread saw when it blocked on the result:
  when the device finished it (`done_at`: exact to a thread wake-up, no polling) or the error it
  failed with (`error`); `done` is set after either."""

  def __init__(self, result: ChunkResult, gen: np.ndarray, queued: bool, width: int):
    # a replicated result: every process reads its own local copy (one device's shard)
    # A MoE model's routing stays on the device: the engine's harvest copies only the finished slots' rows.
    self.local = jax.tree.map(lambda x: x.addressable_data(0), result)
    for x in jax.tree.leaves(self.local.replace(routing=None)):
      x.copy_to_host_async()
    self.gen, self.queued, self.width = gen, queued, width
    self.done_at: float | None = None
    self.error: Exception | None = None
    self.done = threading.Event()

  def get(self) -> ChunkResult:
    """The results as host numpy (`routing`: still on the device), once the watcher saw the device
    finish the chunk; a chunk that failed on the device raises its error here, in the thread that
    drives the engine."""
    self.done.wait()
    if self.error is not None:
      raise self.error
    return jax.tree.map(np.asarray, self.local.replace(routing=None)).replace(routing=self.local.routing)


# Seconds the engine's end waits for its watcher thread, blocked on the last chunk dispatched: a
# healthy chunk (chunk_steps decode steps) takes milliseconds to a few seconds even on the largest
# models; a chunk still running after this is a hung device, and the process ends without it.
WATCHER_EXIT_S = 10.0


def watch(chunks: "queue.SimpleQueue[InFlight | None]") -> None:
  """The watcher thread: block on each chunk in dispatch order; note when the device finished it, or
  the error it failed with (`InFlight.get` raises it in the engine's thread)."""
  while (chunk := chunks.get()) is not None:
    try:
      chunk.local.steps.block_until_ready()
    except Exception as e:  # noqa: BLE001 - handed to the engine's thread by get()
      chunk.error = e
    chunk.done_at = time.perf_counter()
    chunk.done.set()


def stop_watcher(chunks: "queue.SimpleQueue[InFlight | None]", watcher: threading.Thread) -> None:
  """End the watcher thread and wait for it (at most WATCHER_EXIT_S): when the engine is collected,
  or at interpreter exit (weakref.finalize's atexit hook), where a daemon thread still running when
  finalization starts is killed mid-call (an abort: 'terminate called after throwing an instance of
  ...', exit status 134). A watcher still blocked after the wait is on a hung device: said on stderr."""
  chunks.put(None)
  if watcher is not threading.current_thread():
    watcher.join(timeout=WATCHER_EXIT_S)
    if watcher.is_alive():
      print(f"slot engine: a decode chunk was still running on the device {WATCHER_EXIT_S:g} s after the engine "
            "ended (a hung device?); not waiting for it (at interpreter exit the process may abort)",
            file=sys.stderr, flush=True)


def start_watcher(owner: object) -> "queue.SimpleQueue[InFlight | None]":
  """Start the watcher thread of `owner` (an engine): put each dispatched chunk on the returned queue.
  The thread ends with the owner (`stop_watcher` when it is collected, or at interpreter exit)."""
  chunks: queue.SimpleQueue[InFlight | None] = queue.SimpleQueue()
  watcher = threading.Thread(target=watch, args=(chunks,), name="slot-engine-watcher", daemon=True)
  watcher.start()
  weakref.finalize(owner, stop_watcher, chunks, watcher)
  return chunks
