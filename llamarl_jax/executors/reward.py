"""RewardExecutor: scores (response, ground truth) pairs in a pool of worker processes, time-limited.

Reward functions are untrusted in the sense that matters for a long run: one may raise, hang
forever, blow up on a pathological response, or kill its own process. Each runs in a worker process
(never a thread, so a hung one can be killed; never `fork`ed, since the parent runs JAX threads) and
every sample has a timeout. A sample whose function raises, returns a non-finite value, runs past
`timeout_s` or takes its worker down scores 0 and is counted; the worker is killed if needed and
replaced; the batch always completes. Metrics of one `score` call:

  reward/errors          samples that raised, returned NaN/inf, or crashed their worker
  reward/timeouts        samples that ran past timeout_s
  reward/worker_restarts workers replaced (after a timeout, a crash, or a failed start)
  reward/worker_recycles workers retired between chunks for memory or age (below)
  reward/worker_rss_mb   the largest worker resident set (MB) seen at the end of the call
  time/reward            wall seconds spent in `score`

Memory: a reward function that leaks would grow its worker without bound over a long run. A worker is
recycled (replaced by a fresh one once it has answered its chunk) after `worker_max_tasks` samples or
when its resident set exceeds `worker_max_rss_mb`; `worker_memory_limit_mb` is a hard cap
(RLIMIT_DATA / RLIMIT_AS in the worker), so one runaway sample fails with MemoryError (scored 0,
counted as an error, its worker recycled) instead of taking the host down. RSS is read from /proc
(Linux); elsewhere only the task count and the hard cap apply.

Workers receive the reward function by pickled reference, so it must be a top-level function of an
importable module (see `llamarl_jax.rewards`); the parent's sys.path is given to the workers.
This module must not import JAX: workers import it.
"""

from __future__ import annotations

import collections
import logging
import math
import multiprocessing as mp
import os
import pickle
import resource
import signal
import sys
import threading
import time
import weakref
from multiprocessing.connection import wait as wait_any
from typing import Callable, Sequence

import gin
import numpy as np

from llamarl_jax.live import LiveResource
from llamarl_jax.rewards import get_reward_fn

log = logging.getLogger(__name__)

_OK, _ERROR = "ok", "error"


def _limit_memory(limit_mb: float | None) -> None:
  """Hard cap on this process's data memory (RLIMIT_DATA: heap and anonymous mappings; RLIMIT_AS where
  the former does not exist). Allocations past it raise MemoryError."""
  if not limit_mb:
    return
  which = getattr(resource, "RLIMIT_DATA", None) or resource.RLIMIT_AS
  limit = int(limit_mb * 2**20)
  _, hard = resource.getrlimit(which)
  resource.setrlimit(which, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))


def process_rss_mb(pid: int) -> float | None:
  """Resident set size of process `pid` in MB (Linux /proc; None where unavailable)."""
  try:
    with open(f"/proc/{pid}/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
  except (OSError, ValueError, IndexError):
    return None


def _worker_main(conn, fn_bytes: bytes, sys_path: list[str], memory_limit_mb: float | None = None) -> None:
  """Worker process: load the reward function, then score chunks [(index, response, truth)] in order,
  sending one (index, reward, status, message) per sample as soon as it is done."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
  _limit_memory(memory_limit_mb)
  sys.path[:0] = [p for p in sys_path if p not in sys.path]
  try:
    fn = pickle.loads(fn_bytes)
  except BaseException as e:  # noqa: BLE001 - reported to the parent
    conn.send(("load_error", f"{type(e).__name__}: {e}"))
    return
  conn.send(("ready", os.getpid()))
  while True:
    try:
      chunk = conn.recv()
    except (EOFError, OSError):
      return
    if chunk is None:
      return
    for index, response, truth in chunk:
      try:
        r = float(fn(response, truth))
        out = (index, r, _OK, None) if math.isfinite(r) else (index, 0.0, _ERROR, f"non-finite reward {r}")
      except BaseException as e:  # noqa: BLE001 - SystemExit, KeyboardInterrupt included: score 0
        out = (index, 0.0, _ERROR, f"{type(e).__name__}: {str(e)[:200]}")
      conn.send(out)


class _Worker:

  def __init__(self, ctx, fn_bytes: bytes, memory_limit_mb: float | None = None):
    self.conn, child_conn = ctx.Pipe(duplex=True)
    self.proc = ctx.Process(target=_worker_main, args=(child_conn, fn_bytes, list(sys.path), memory_limit_mb),
                            name="reward-worker", daemon=True)
    self.proc.start()
    child_conn.close()
    self.started = time.monotonic()
    self.ready = False
    self.closed = False
    self.chunk: collections.deque[int] = collections.deque()  # sample indices sent, not yet answered
    self.progress = 0.0  # when the sample at chunk[0] started
    self.tasks = 0  # samples answered
    self.out_of_memory = False  # a sample raised MemoryError: recycle once the chunk is answered

  def kill(self) -> None:
    """SIGKILL (a hung function may ignore anything gentler), reap, release handles. Idempotent."""
    if self.closed:
      return
    self.closed = True
    if self.proc.is_alive():
      self.proc.kill()
    self.proc.join(timeout=5)
    self.conn.close()
    try:
      self.proc.close()
    except ValueError:  # still running after SIGKILL + 5 s: nothing more to do from here
      pass


def _shutdown(workers: list[_Worker]) -> None:
  for w in workers:  # ask politely first: idle workers exit at once
    try:
      w.conn.send(None)
    except (OSError, ValueError):
      pass
  deadline = time.monotonic() + 2.0
  for w in workers:
    if not w.closed:
      w.proc.join(timeout=max(deadline - time.monotonic(), 0.0))
    w.kill()
  workers.clear()


class _PoolCall:
  """One `score` call's work in the worker pool: the samples not handed out yet (`todo`) and not
  answered yet (`remaining`), the rewards and counts it fills, and the worker starts that failed since
  the last one came up (past 3 per worker the call gives up)."""

  def __init__(self, responses: list[str], ground_truths: list[str], rewards: np.ndarray, counts):
    self.responses, self.ground_truths, self.rewards, self.counts = responses, ground_truths, rewards, counts
    self.todo = collections.deque(range(len(responses)))
    self.remaining = len(responses)
    self.failed_starts = 0


@gin.configurable(allowlist=["worker_max_tasks", "worker_max_rss_mb", "worker_memory_limit_mb", "max_chunk",
                             "startup_timeout_s"])
class RewardExecutor(LiveResource):
  """Scores responses with `reward_fn` in `num_workers` processes; never raises on a reward function.

  reward_fn: a registered name ("math", "arithmetic", "countdown", or one added with
    `rewards.register_reward`) or a top-level callable `fn(response_text, ground_truth) -> float`.
  timeout_s: per-sample limit; a sample past it scores 0 and its worker is killed and replaced.
  mp_context: "forkserver" (default where available: fast restarts) or "spawn". "fork" is refused.
  inline: score in this process instead (no timeouts, no isolation; for tests and debugging).
  worker_max_tasks / worker_max_rss_mb / worker_memory_limit_mb: recycling and the hard memory cap
    (module docstring); None disables each. Gin-configurable (`RewardExecutor.worker_max_rss_mb = 1024`).
  """

  def __init__(self, reward_fn: str | Callable[[str, str], float] = "math", *, num_workers: int = 2,
               timeout_s: float = 5.0, mp_context: str | None = None, inline: bool = False,
               startup_timeout_s: float = 120.0, max_chunk: int = 32, worker_max_tasks: int | None = None,
               worker_max_rss_mb: float | None = 2048.0, worker_memory_limit_mb: float | None = 8192.0):
    if num_workers < 1:
      raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if timeout_s <= 0:
      raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    for name, v in (("worker_max_tasks", worker_max_tasks), ("worker_max_rss_mb", worker_max_rss_mb),
                    ("worker_memory_limit_mb", worker_memory_limit_mb)):
      if v is not None and v <= 0:
        raise ValueError(f"RewardExecutor.{name} must be > 0 (or None to disable), got {v}")
    self.worker_max_tasks, self.worker_max_rss_mb = worker_max_tasks, worker_max_rss_mb
    self.worker_memory_limit_mb = worker_memory_limit_mb
    self.fn = get_reward_fn(reward_fn)
    self.name = reward_fn if isinstance(reward_fn, str) else getattr(self.fn, "__qualname__", repr(self.fn))
    self.num_workers, self.timeout_s, self.inline = num_workers, timeout_s, inline
    self.startup_timeout_s, self.max_chunk = startup_timeout_s, max_chunk
    self.totals = collections.Counter()  # cumulative counts over all calls
    self.recent_errors: collections.deque[str] = collections.deque(maxlen=20)
    self._lock = threading.Lock()
    self._workers: list[_Worker] = []
    self._closed = False
    if inline:
      return
    if mp_context is None:
      mp_context = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    if mp_context not in ("spawn", "forkserver"):
      raise ValueError(f"mp_context must be 'spawn' or 'forkserver', got {mp_context!r}: forking a process "
                       "that runs JAX threads can deadlock")
    try:
      self._fn_bytes = pickle.dumps(self.fn)
    except Exception as e:
      raise ValueError(f"reward function {self.name!r} cannot be sent to worker processes ({e}); define it at "
                       "the top level of an importable module (not a lambda, closure or nested function)") from e
    self._ctx = mp.get_context(mp_context)
    self._workers = [self._new_worker() for _ in range(num_workers)]
    self._finalizer = weakref.finalize(self, _shutdown, self._workers)
    self._wait_ready()

  def _wait_ready(self) -> None:
    """Block until every worker has loaded the function; raise with the worker's message if it cannot."""
    deadline = time.monotonic() + self.startup_timeout_s
    for w in self._workers:
      while not w.ready:
        left = deadline - time.monotonic()
        if left <= 0 or not w.conn.poll(min(left, 0.5)) and not w.proc.is_alive():
          message = f"reward worker for {self.name!r} did not start (exit code {w.proc.exitcode})"
          self.close()
          raise RuntimeError(message)
        if w.conn.poll():
          try:
            msg = w.conn.recv()
          except (EOFError, OSError):
            msg = ("load_error", f"the worker process exited during start-up (exit code {w.proc.exitcode}); "
                   "see its traceback above")
          if msg[0] == "load_error":
            self.close()
            raise RuntimeError(f"reward function {self.name!r} could not be loaded in a worker process: {msg[1]}. "
                               "Define it at the top level of a module importable from sys.path.")
          w.ready = True

  def _new_worker(self) -> _Worker:
    return _Worker(self._ctx, self._fn_bytes, self.worker_memory_limit_mb)

  def _worn_out(self, w: _Worker) -> str | None:
    """Why an idle worker should be recycled (None: keep it)."""
    if w.out_of_memory:
      return "a sample ran out of memory"
    if self.worker_max_tasks and w.tasks >= self.worker_max_tasks:
      return f"{w.tasks} samples >= worker_max_tasks"
    if self.worker_max_rss_mb:
      rss = process_rss_mb(w.proc.pid)
      if rss is not None and rss > self.worker_max_rss_mb:
        return f"resident set {rss:.0f} MB > worker_max_rss_mb {self.worker_max_rss_mb:.0f}"
    return None

  def worker_rss_mb(self) -> list[float]:
    """Current resident set (MB) of each live worker (empty inline or off Linux)."""
    out = []
    for w in self._workers:
      if not w.closed and w.proc.pid is not None:
        rss = process_rss_mb(w.proc.pid)
        if rss is not None:
          out.append(rss)
    return out

  # ----------------------------------------------------------------------------------------------

  def score(self, responses: Sequence[str], ground_truths: Sequence[str]) -> tuple[np.ndarray, dict]:
    """Rewards [n] float32 (0 for failed samples) and this call's metrics (see the module docstring)."""
    if len(responses) != len(ground_truths):
      raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
    if self._closed:
      raise RuntimeError("RewardExecutor is closed")
    t0 = time.perf_counter()
    counts = collections.Counter(errors=0, timeouts=0, worker_restarts=0, worker_recycles=0)
    rewards = np.zeros(len(responses), np.float32)
    with self._lock:
      if self.inline:
        self._score_inline(responses, ground_truths, rewards, counts)
      else:
        self._score_pool(list(responses), list(ground_truths), rewards, counts)
    self.totals.update(counts)
    if counts["errors"] or counts["timeouts"]:
      log.warning("reward %s: %d errors, %d timeouts, %d worker restarts in %d samples; last error: %s",
                  self.name, counts["errors"], counts["timeouts"], counts["worker_restarts"], len(rewards),
                  self.recent_errors[-1] if self.recent_errors else "-")
    metrics = {f"reward/{k}": float(v) for k, v in counts.items()}
    rss = self.worker_rss_mb()
    if rss:
      metrics["reward/worker_rss_mb"] = max(rss)
    metrics["time/reward"] = time.perf_counter() - t0
    return rewards, metrics

  def _score_inline(self, responses, ground_truths, rewards, counts) -> None:
    for i, (response, truth) in enumerate(zip(responses, ground_truths)):
      try:
        r = float(self.fn(response, truth))
        if not math.isfinite(r):
          raise ValueError(f"non-finite reward {r}")
        rewards[i] = r
      except Exception as e:  # noqa: BLE001
        counts["errors"] += 1
        self.recent_errors.append(f"{type(e).__name__}: {str(e)[:200]}")

  def _score_pool(self, responses: list[str], ground_truths: list[str], rewards: np.ndarray, counts) -> None:
    """Score in the worker pool: hand out chunks, wait for an answer, a death or a deadline, collect,
    until every sample is answered or scored 0 (also when workers keep failing to start)."""
    call = _PoolCall(responses, ground_truths, rewards, counts)
    while call.remaining:
      self._hand_out(call)
      deadlines = [w.progress + self.timeout_s if w.chunk else w.started + self.startup_timeout_s
                   for w in self._workers if w.chunk or not w.ready]
      timeout = max(min(deadlines) - time.monotonic(), 0.0) if deadlines else 1.0
      wait_any([w.conn for w in self._workers if not w.closed] +
               [w.proc.sentinel for w in self._workers if not w.closed], timeout=timeout)
      self._collect(call)
      if not call.remaining:  # start the replacements of worn-out workers now, off the next call's path
        for slot, w in enumerate(self._workers):
          if not w.closed and (why := self._worn_out(w)):
            log.info("reward worker %d recycled: %s", w.proc.pid, why)
            self._replace(call, slot, "worker_recycles")
      if call.failed_starts > 3 * self.num_workers:  # workers cannot start at all: give up on this batch
        call.counts["errors"] += call.remaining
        self.recent_errors.append("reward workers keep failing to start; remaining samples scored 0")
        for slot in range(len(self._workers)):  # fresh workers: no stale answers in the next call
          self._replace(call, slot)
        return

  def _hand_out(self, call: _PoolCall) -> None:
    """A chunk of the samples not handed out yet to each idle worker (a worn-out one is recycled first)."""
    now = time.monotonic()
    for slot, w in enumerate(self._workers):
      if w.ready and not w.chunk and call.todo and (why := self._worn_out(w)):
        log.info("reward worker %d recycled: %s", w.proc.pid, why)
        self._replace(call, slot, "worker_recycles")
        continue
      if w.ready and not w.chunk and call.todo:
        size = max(1, min(self.max_chunk, len(call.todo) // (2 * self.num_workers)))
        w.chunk.extend(call.todo.popleft() for _ in range(min(size, len(call.todo))))
        w.progress = now
        try:
          w.conn.send([(i, call.responses[i], call.ground_truths[i]) for i in w.chunk])
        except (OSError, ValueError):  # died while idle: nothing was running on it
          call.todo.extendleft(reversed(w.chunk))
          w.chunk.clear()
          self._replace(call, slot)

  def _collect(self, call: _PoolCall) -> None:
    """Every worker's answers taken; a worker that died, ran past `timeout_s` on a sample or did not
    start within `startup_timeout_s` replaced (its current sample failed, the rest of its chunk back)."""
    for slot, w in enumerate(self._workers):
      if w.closed:  # a failed start left this slot empty: try again
        self._replace(call, slot)
        continue
      dead = self._drain(call, w)
      if not dead and not w.proc.is_alive():
        dead = True
        self._drain(call, w)  # answers sent just before it died are still in the pipe
      if dead:
        if not w.ready:
          call.failed_starts += 1
        w.proc.join(timeout=1.0)  # its pipe closed: it is exiting; reap it for the exit code
        self._fail_current(call, w, "errors", f"worker exited (exit code {w.proc.exitcode})")
        self._replace(call, slot)
      elif w.chunk and time.monotonic() - w.progress > self.timeout_s:
        self._fail_current(call, w, "timeouts", f"sample ran past {self.timeout_s}s")
        self._replace(call, slot)
      elif not w.ready and time.monotonic() - w.started > self.startup_timeout_s:
        call.failed_starts += 1
        self.recent_errors.append(f"worker did not start within {self.startup_timeout_s}s")
        self._replace(call, slot)

  def _drain(self, call: _PoolCall, w: _Worker) -> bool:
    """Handle every message waiting from w; True when w is gone (EOF, load error, cut-off message)."""
    try:
      while w.conn.poll():
        msg = w.conn.recv()
        if msg[0] == "ready":
          w.ready, call.failed_starts = True, 0
        elif msg[0] == "load_error":
          self.recent_errors.append(f"load_error: {msg[1]}")
          return True
        else:
          index, r, status, message = msg
          if not w.chunk or w.chunk[0] != index:
            continue  # stale (cannot happen with in-order workers; be safe)
          w.chunk.popleft()
          call.remaining -= 1
          w.tasks += 1
          w.progress = time.monotonic()
          if status == _OK:
            call.rewards[index] = r
          else:
            call.counts["errors"] += 1
            self.recent_errors.append(message)
            w.out_of_memory |= message.startswith("MemoryError")
    except Exception:  # noqa: BLE001 - EOF, closed handle, or a message cut off by a kill
      return True
    return False

  def _fail_current(self, call: _PoolCall, w: _Worker, kind: str, message: str) -> None:
    """The sample w is working on scores 0 (counted as `kind`); the rest of its chunk goes back."""
    if w.chunk:
      call.counts[kind] += 1
      self.recent_errors.append(f"{kind}: {message}")
      w.chunk.popleft()  # rewards already 0
      call.remaining -= 1
      call.todo.extendleft(reversed(w.chunk))
    w.chunk.clear()

  def _replace(self, call: _PoolCall, slot: int, kind: str = "worker_restarts") -> None:
    """A fresh worker in `slot` (counted as `kind`); a failed start leaves the dead one there, retried later."""
    self._workers[slot].kill()
    call.counts[kind] += 1
    try:
      self._workers[slot] = self._new_worker()
    except Exception as e:  # noqa: BLE001 - e.g. out of processes: the dead worker stays, retried later
      call.failed_starts += 1
      self.recent_errors.append(f"could not start a reward worker: {type(e).__name__}: {e}")
      time.sleep(0.1)

  # ----------------------------------------------------------------------------------------------

  def close(self) -> None:
    """Stop the workers (idempotent)."""
    self._closed = True
    if self._workers:
      self._finalizer()

  def __enter__(self) -> "RewardExecutor":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
