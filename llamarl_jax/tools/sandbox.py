"""A sandboxed Python tool: run untrusted code in a fresh, confined interpreter, one process per call.

`run_python(code, limits)` writes the code to a fresh scratch directory, runs it there in
`python -I -S -u -X utf8` (no user site, no site-packages, no PYTHON* variables, unbuffered UTF-8
output), with only HOME and TMPDIR (both the scratch directory) in its environment, and returns a
`ToolResult`: stdout and stderr together (at most `max_output_bytes`, then a marker), a status, the exit
code, wall and CPU seconds. The scratch directory is removed afterwards. `SandboxPool` runs calls
concurrently on a bounded thread pool (usable from any worker thread) and counts them for metrics.

Defence in depth, from the strongest layer to the weakest; `capabilities()` reports which are active:

  (a) resource limits in the child, soft = hard so the code cannot raise them: RLIMIT_CPU (`cpu_s`,
      SIGXCPU, then SIGKILL a second later), RLIMIT_AS (`memory_bytes`: allocation fails with
      MemoryError), RLIMIT_FSIZE (`max_file_bytes` per file written), RLIMIT_NPROC (`max_processes`),
      RLIMIT_NOFILE (`max_open_files`), RLIMIT_CORE = 0. Stops: runaway CPU, memory, file size, fork
      bombs (with (c)). Does not stop: the total size of many files (only time bounds it), sleeping.
  (b) the child leads its own session and process group; the parent enforces `wall_s` and the output
      cap while reading the pipe (never more than `max_output_bytes` in memory), and at the end of every
      call SIGKILLs every process in the session, the child last: the child is the subreaper of its
      descendants and ignores SIGCHLD, so they are reaped as they die and no zombie is left. The child
      dies with the parent (PR_SET_PDEATHSIG). Stops: infinite loops, sleeping, huge prints, orphans,
      fork bombs. Does not stop: a process that leaves its session (fork, then setsid: both need a way
      around (d)) and so outlives the call, within its rlimits.
  (c) when the parent is root: the child drops to `uid`/`gid` (nobody/nogroup) with no supplementary
      groups, so RLIMIT_NPROC applies and root-owned files of the run are not writable (nor readable,
      where their modes say so); and it enters a new network namespace (unshare(CLONE_NEWNET)) with no
      interface up, so no socket reaches anything. When not root, the network namespace is tried
      inside a new user namespace mapping only the caller's own uid (all capabilities dropped); where the
      kernel refuses (no CAP_SYS_ADMIN, unprivileged user namespaces disabled), the call goes on
      without it and `capabilities().network` says why.
  (d) a Python audit hook (PEP 578) installed by the bootstrap before the code runs, raising
      PermissionError (status 'forbidden' if the code then fails) on: socket creation and use, new
      processes and programs (fork, exec, spawn, system, subprocess), signals to other processes, ctypes,
      native extension modules loaded from outside the standard library, the modules that reach the OS
      without an audit event (_posixsubprocess, ...), writing, removing, renaming or chmod-ing files
      outside the scratch directory, reading or listing outside it and the interpreter's standard
      library, links, chdir, setrlimit, gc.get_objects. It is the only file and network barrier when the
      parent is not root and the kernel refuses the namespaces. It is a tripwire, not a security
      boundary: calls without an audit event (os.mknod and os.mkfifo make empty files wherever the uid
      may write), crafted bytecode (code.replace) that corrupts the interpreter, or interpreter bugs run
      below it.

Not protected against: kernel exploits; anything the OS layers allow once (d) is got round (as root:
writing world-writable places such as /tmp, reading world-readable files, and other calls of the same
uid, e.g. their scratch directories; not root: everything the caller's uid may do, except the network
where the namespace is in force); reading files inside the standard library's directories; filling
the disk under `scratch_root` within the time limit (put it on a size-limited tmpfs); CPU and memory
contention with the run (the limits are per call; bound concurrency with `SandboxPool.max_workers`);
timing side channels; status lines forged by the code (they only mislabel its own call). Linux only.
The parent never runs the code and never `fork`s without exec (the child is started by subprocess'
fork-exec, safe next to JAX's threads).

Standard library only (no JAX, no gin): the multi-turn environment calls it from worker threads, and
a test runs it under another interpreter as an unprivileged user.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import math
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
import typing
from typing import Literal

Status = Literal["ok", "error", "timeout", "memory", "output_limit", "forbidden"]
STATUSES: tuple[str, ...] = typing.get_args(Status)
"""What a call's status means:
  ok            exited with status 0 (refused operations it caught are in `ToolResult.refused`)
  error         exited with a non-zero status or a signal (the traceback is in the output)
  timeout       ran past `wall_s` (killed by the parent) or `cpu_s` (killed by the kernel)
  memory        ran out of `memory_bytes` (MemoryError), or was killed by the kernel without using its CPU time
  output_limit  wrote more than `max_output_bytes` to stdout/stderr; killed at once, output truncated
  forbidden     the audit hook refused an operation and the code then failed
"""

DEFAULT_PREIMPORT = ("math", "cmath", "decimal", "fractions", "itertools", "functools", "collections",
                     "statistics", "random", "re", "string", "heapq", "bisect", "operator", "json", "datetime",
                     "textwrap")
"""Modules imported before privileges are dropped: where the interpreter's standard library is not
readable by `uid` (e.g. a pyenv Python under /root), only these (and built-in modules) are importable."""

_CHILD_SOURCE = (Path(__file__).parent / "_sandbox_child.py").read_text(encoding="utf-8")
_STATUS_CAP = 64 * 1024  # bytes of status lines read from the child; the rest is dropped
TRUNCATION_MARKER = "\n[output truncated: more than {cap} bytes]"


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  """The limits of one call.

  cpu_s           CPU seconds (RLIMIT_CPU, rounded up to whole seconds; counts the ~0.1 s start-up)
  wall_s          wall-clock seconds from start to kill, start-up included
  memory_bytes    address space (RLIMIT_AS); the interpreter itself takes ~30 MB of it
  max_output_bytes  stdout + stderr kept; more kills the call (status 'output_limit')
  max_file_bytes  largest file the code may write (RLIMIT_FSIZE)
  max_processes   RLIMIT_NPROC. Counts every process of the child's user: as root, all concurrent
                  calls under `uid` together (give it a pool's max_workers plus a margin); not root,
                  per call inside the user namespace, or all of the caller's processes without one
  max_open_files  RLIMIT_NOFILE
  uid, gid        whom the child becomes when the parent is root (None: stay root, for tests only)
  network_isolation  try the new network namespace (layer (c))
  audit_hook      install the audit hook (layer (d)); False only to test the other layers alone
  site_packages   let the code import the interpreter's site-packages (read-only)
  preimport       modules imported before the drop (see DEFAULT_PREIMPORT)
  scratch_root    where scratch directories are made (None: the system temp directory)
  python          the interpreter (None: sys.executable)
  """
  cpu_s: float = 5.0
  wall_s: float = 10.0
  memory_bytes: int = 512 * 2**20
  max_output_bytes: int = 16 * 1024
  max_file_bytes: int = 16 * 2**20
  max_processes: int = 32
  max_open_files: int = 64
  uid: int | None = 65534
  gid: int | None = 65534
  network_isolation: bool = True
  audit_hook: bool = True
  site_packages: bool = False
  preimport: tuple[str, ...] = DEFAULT_PREIMPORT
  scratch_root: str | None = None
  python: str | None = None

  def __post_init__(self):
    rules = {
        "cpu_s": (self.cpu_s > 0, "> 0"),
        "wall_s": (self.wall_s > 0, "> 0"),
        "memory_bytes": (self.memory_bytes >= 64 * 2**20, ">= 64 MiB (the interpreter alone takes ~30 MB)"),
        "max_output_bytes": (self.max_output_bytes >= 1, ">= 1"),
        "max_file_bytes": (self.max_file_bytes >= 0, ">= 0"),
        "max_processes": (self.max_processes >= 1, ">= 1"),
        "max_open_files": (self.max_open_files >= 8, ">= 8"),
        "uid": (self.uid is None or self.uid > 0, "None or > 0 (0 would not drop privileges)"),
        "gid": (self.gid is None or self.gid > 0, "None or > 0"),
        "preimport": (isinstance(self.preimport, tuple), "a tuple of module names"),
    }
    problems = [f"SandboxLimits.{name}: expected {want}, got {getattr(self, name)!r}"
                for name, (ok, want) in rules.items() if not ok]
    if (self.uid is None) != (self.gid is None):
      problems.append(f"SandboxLimits.uid and gid: set both or neither, got {self.uid!r} and {self.gid!r}")
    if problems:
      raise ValueError("invalid SandboxLimits: " + "; ".join(problems))

  def rlimits(self) -> dict[str, int]:
    """The child's resource limits, by `resource` name."""
    return {"RLIMIT_CORE": 0, "RLIMIT_CPU": max(1, math.ceil(self.cpu_s)), "RLIMIT_AS": self.memory_bytes,
            "RLIMIT_FSIZE": self.max_file_bytes, "RLIMIT_NPROC": self.max_processes,
            "RLIMIT_NOFILE": self.max_open_files}


@dataclasses.dataclass(frozen=True)
class ToolResult:
  """One call's observation. `output`: stdout and stderr as the code wrote them (UTF-8, undecodable bytes
  replaced), cut at `max_output_bytes` with a marker; `status`: one of STATUSES; `exit_code`: the
  child's (negative: killed by that signal; None: it never started); `refused`: what the audit hook
  refused ("event detail")."""
  output: str
  status: Status
  exit_code: int | None
  wall_s: float
  cpu_s: float = 0.0
  refused: tuple[str, ...] = ()

  @property
  def ok(self) -> bool:
    return self.status == "ok"

  def observation(self) -> str:
    """The text to show the model: the output, plus one line saying why the call failed, if it did."""
    note = {
        "timeout": "[the code ran past its time limit and was stopped]",
        "memory": "[the code ran out of memory]",
        "forbidden": "[not allowed in the sandbox: " + ", ".join(self.refused[:3]) + "]",
        "error": f"[exit code {self.exit_code}]" if not self.output.strip() else "",
    }.get(self.status, "")
    if not note:
      return self.output
    return self.output + ("" if not self.output or self.output.endswith("\n") else "\n") + note


@dataclasses.dataclass(frozen=True)
class SandboxCapabilities:
  """Which layers are in force for calls with given limits (measured by running one; see the module
  docstring). `network`: "isolated", "disabled", or why the namespace could not be made; `reaper`: the
  child follows the parent's death and reaps its descendants (prctl available)."""
  parent_root: bool
  privileges_dropped: bool
  uid: int
  gid: int
  network: str
  audit_hook: bool
  reaper: bool
  rlimits: dict
  stdlib_readable: bool
  read_roots: tuple[str, ...]

  @property
  def network_isolated(self) -> bool:
    return self.network == "isolated"

  def summary(self) -> str:
    """One line for a log."""
    return (f"sandbox: parent {'root' if self.parent_root else 'not root'}, child uid {self.uid}"
            f"{' (privileges dropped)' if self.privileges_dropped else ''}, network {self.network}, "
            f"audit hook {'on' if self.audit_hook else 'OFF'}, rlimits {self.rlimits}"
            f"{'' if self.stdlib_readable else ', standard library not readable: only preimported modules'}")


# ------------------------------------------------------------------------------------------------
# One call


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> ToolResult:
  """Run `code` in a fresh confined interpreter (module docstring); never raises for anything the code
  does. Blocks for at most `limits.wall_s` plus clean-up (milliseconds)."""
  return _run(code, limits)[0]


def capabilities(limits: SandboxLimits = SandboxLimits()) -> SandboxCapabilities:
  """Run an empty program with `limits` and report the layers its child put in place."""
  result, report = _run("pass", limits)
  if report is None:
    raise RuntimeError(f"the sandbox's child did not start (status {result.status}, exit code "
                       f"{result.exit_code}): {result.output[-2000:]}")
  return SandboxCapabilities(
      parent_root=report["parent_root"], privileges_dropped=report["privileges_dropped"], uid=report["uid"],
      gid=report["gid"], network=report["network"], audit_hook=report["audit_hook"], reaper=report["reaper"],
      rlimits=report["rlimits"], stdlib_readable=report["stdlib_readable"], read_roots=tuple(report["read_roots"]))


def _run(code: str, limits: SandboxLimits) -> tuple[ToolResult, dict | None]:
  if not isinstance(code, str):
    raise TypeError(f"code must be a str, got {type(code).__name__}")
  t0 = time.monotonic()
  root = os.geteuid() == 0
  scratch = os.path.realpath(tempfile.mkdtemp(prefix="llamarl_sandbox_", dir=limits.scratch_root))
  try:
    # The code file first, then hand the directory over: a process of `uid` left over from an earlier
    # call cannot plant a symlink where root is about to write.
    with open(os.path.join(scratch, "main.py"), "w", encoding="utf-8") as f:
      f.write(code)
    os.chmod(os.path.join(scratch, "main.py"), 0o644)
    if root and limits.uid is not None:
      os.chown(scratch, limits.uid, limits.gid)
    return _run_in(scratch, limits, t0)
  finally:
    _remove_tree(scratch)


def _run_in(scratch: str, limits: SandboxLimits, t0: float) -> tuple[ToolResult, dict | None]:
  status_r, status_w = os.pipe()
  config = {"status_fd": status_w, "scratch": scratch, "parent_pid": os.getpid(), "uid": limits.uid,
            "gid": limits.gid, "network": limits.network_isolation, "audit_hook": limits.audit_hook,
            "site_packages": limits.site_packages, "preimport": list(limits.preimport), "rlimits": limits.rlimits()}
  argv = [limits.python or sys.executable, "-I", *(() if limits.site_packages else ("-S",)), "-u", "-X", "utf8",
          "-c", _CHILD_SOURCE, json.dumps(config)]
  try:
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            cwd=scratch, env={"HOME": scratch, "TMPDIR": scratch}, start_new_session=True,
                            close_fds=True, pass_fds=(status_w,))
  except OSError as e:  # e.g. out of processes: the call fails, the run goes on
    os.close(status_r)
    os.close(status_w)
    return ToolResult(f"the sandbox could not start: {e}", "error", None, time.monotonic() - t0), None
  os.close(status_w)
  try:
    output, status_bytes, stopped = _read_until_done(proc, status_r, limits, t0)
    _kill_session(proc.pid)  # before reaping: the session id cannot be reused while the child is unreaped
    _, wait_status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(wait_status)
    status_bytes += _read_available(status_r, _STATUS_CAP - len(status_bytes))
  finally:
    if proc.returncode is None:  # interrupted (e.g. KeyboardInterrupt): nothing may outlive the call
      _kill_session(proc.pid)
      proc.wait()
    os.close(status_r)
    proc.stdout.close()
  wall_s = time.monotonic() - t0
  cpu_s = usage.ru_utime + usage.ru_stime
  report, refused, out_of_memory = _parse_status(status_bytes)
  text = output.decode("utf-8", "replace")
  if stopped == "output_limit":
    text += TRUNCATION_MARKER.format(cap=limits.max_output_bytes)
  status = _classify(stopped, proc.returncode, cpu_s, limits, refused, out_of_memory)
  return ToolResult(text, status, proc.returncode, wall_s, cpu_s, refused), report


def _read_until_done(proc: subprocess.Popen, status_r: int, limits: SandboxLimits,
                     t0: float) -> tuple[bytes, bytes, str | None]:
  """Read the child's output (at most max_output_bytes) and status lines until the child has exited
  and closed both pipes, its wall time is up ("timeout") or it wrote too much ("output_limit")."""
  out_fd = proc.stdout.fileno()
  deadline = t0 + limits.wall_s
  output, status = bytearray(), bytearray()
  with selectors.DefaultSelector() as sel:
    for fd in (out_fd, status_r):
      os.set_blocking(fd, False)
      sel.register(fd, selectors.EVENT_READ)
    while sel.get_map():
      left = deadline - time.monotonic()
      if left <= 0:
        return bytes(output), bytes(status), "timeout"
      for key, _ in sel.select(left):
        try:
          data = os.read(key.fd, 65536)
        except BlockingIOError:
          continue
        if not data:
          sel.unregister(key.fd)
        elif key.fd == out_fd:
          room = limits.max_output_bytes - len(output)
          output += data[:room]
          if len(data) > room:
            return bytes(output), bytes(status), "output_limit"
        else:
          status += data[:max(0, _STATUS_CAP - len(status))]
  while True:  # both pipes closed: wait (without reaping) for the child itself to exit
    try:
      if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
        return bytes(output), bytes(status), None
    except ChildProcessError:
      return bytes(output), bytes(status), None
    if time.monotonic() >= deadline:
      return bytes(output), bytes(status), "timeout"
    time.sleep(0.002)


def _read_available(fd: int, limit: int) -> bytes:
  """Up to `limit` bytes already waiting on non-blocking `fd`."""
  out = bytearray()
  while len(out) < limit:
    try:
      data = os.read(fd, 65536)
    except (BlockingIOError, OSError):
      break
    if not data:
      break
    out += data[:limit - len(out)]
  return bytes(out)


def _parse_status(data: bytes) -> tuple[dict | None, tuple[str, ...], bool]:
  """(the child's start report or None, the refusals, whether it reported MemoryError)."""
  report, refused, out_of_memory = None, [], False
  for line in data.decode("utf-8", "replace").splitlines():
    kind, _, rest = line.partition(" ")
    if kind == "start" and report is None:
      try:
        report = json.loads(rest)
      except ValueError:
        pass
    elif kind == "refused":
      refused.append(rest.strip())
    elif kind == "memory":
      out_of_memory = True
  return report, tuple(refused), out_of_memory


def _classify(stopped: str | None, returncode: int, cpu_s: float, limits: SandboxLimits,
              refused: tuple[str, ...], out_of_memory: bool) -> Status:
  if stopped is not None:
    return stopped  # "timeout" or "output_limit": the parent killed it
  if returncode == -signal.SIGXCPU:
    return "timeout"
  if returncode == -signal.SIGKILL:  # not by us: the CPU hard limit (one second past the soft one, where
    # the code ignored SIGXCPU), or the kernel's OOM killer
    return "timeout" if cpu_s >= limits.rlimits()["RLIMIT_CPU"] else "memory"
  if out_of_memory and returncode != 0:
    return "memory"
  if returncode != 0:
    return "forbidden" if refused else "error"
  return "ok"


def session_members(sid: int) -> list[int]:
  """Live (not zombie) processes whose session or process group is `sid` (Linux /proc)."""
  members = []
  try:
    names = os.listdir("/proc")
  except OSError:
    return members
  for name in names:
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
      continue
    state, pgrp, session = fields[0], int(fields[2]), int(fields[3])
    if (pgrp == sid or session == sid) and state not in (b"Z", b"X"):
      members.append(int(name))
  return members


def _kill_session(sid: int) -> None:
  """SIGKILL every process of the child's session: first all but the child (it is their reaper while it
  lives, see _sandbox_child), then the child's process group, then anything still in the session."""
  for _ in range(200):
    others = [pid for pid in session_members(sid) if pid != sid]
    if not others:
      break
    _kill_all(others)
  try:
    os.killpg(sid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
  for _ in range(200):
    members = session_members(sid)
    if not members:
      return
    _kill_all(members)


def _kill_all(pids: list[int]) -> None:
  for pid in pids:
    try:
      os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass
  time.sleep(0.002)


def _remove_tree(path: str) -> None:
  """Remove a scratch directory, also where the code made parts of it unreadable (chmod 000)."""

  def fix(function, failed, _exc):
    try:
      os.chmod(os.path.dirname(failed), stat.S_IRWXU)
      os.chmod(failed, stat.S_IRWXU)
    except OSError:
      pass
    try:
      if os.path.isdir(failed) and not os.path.islink(failed):
        shutil.rmtree(failed, ignore_errors=True)
      else:
        os.unlink(failed)
    except OSError:
      pass

  if sys.version_info >= (3, 12):
    shutil.rmtree(path, onexc=fix)
  else:
    shutil.rmtree(path, onerror=fix)


# ------------------------------------------------------------------------------------------------
# A pool


class SandboxPool:
  """Concurrent sandbox calls: at most `max_workers` children at a time, at most `max_pending` calls
  queued or running (`submit` blocks beyond that: backpressure on the caller). Thread-safe.

  Metrics (`metrics()`, counts since the previous call; `totals` cumulative):
    tool/calls           calls finished
    tool/errors          calls whose status is not 'ok' (each kind below is also counted on its own)
    tool/timeouts, tool/memory, tool/output_limit, tool/forbidden
    tool/latency_mean_s, tool/latency_max_s   wall seconds per call, start-up and clean-up included
  """

  def __init__(self, limits: SandboxLimits = SandboxLimits(), *, max_workers: int = 2,
               max_pending: int | None = None):
    if max_workers < 1:
      raise ValueError(f"SandboxPool.max_workers must be >= 1, got {max_workers}")
    self.limits = limits
    self.max_workers = max_workers
    self._executor = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="sandbox")
    self._pending = threading.BoundedSemaphore(max_pending or 4 * max_workers)
    self._lock = threading.Lock()
    self.totals: collections.Counter = collections.Counter()
    self._window: collections.Counter = collections.Counter()
    self._latency_sum = self._latency_max = 0.0  # of the window's calls (constant memory over a run)

  def submit(self, code: str) -> concurrent.futures.Future:
    """Start a call; a Future of its ToolResult."""
    self._pending.acquire()
    try:
      future = self._executor.submit(self._call, code)
    except BaseException:
      self._pending.release()
      raise
    future.add_done_callback(lambda _: self._pending.release())
    return future

  def run(self, code: str) -> ToolResult:
    """One call, blocking until its result."""
    return self.submit(code).result()

  def _call(self, code: str) -> ToolResult:
    t0 = time.monotonic()
    try:
      result = run_python(code, self.limits)
    except Exception as e:  # noqa: BLE001 - the sandbox's own failure (e.g. no temp dir): an error observation
      result = ToolResult(f"the sandbox failed: {type(e).__name__}: {e}", "error", None, time.monotonic() - t0)
    latency = time.monotonic() - t0
    with self._lock:
      for counter in (self.totals, self._window):
        counter["calls"] += 1
        counter["errors"] += result.status != "ok"
        counter[result.status] += 1
      self._latency_sum += latency
      self._latency_max = max(self._latency_max, latency)
    return result

  def metrics(self) -> dict[str, float]:
    """Counts and latencies of the calls finished since the previous `metrics()` (see the class doc)."""
    with self._lock:
      window, latency_sum, latency_max = self._window, self._latency_sum, self._latency_max
      self._window, self._latency_sum, self._latency_max = collections.Counter(), 0.0, 0.0
    out = {"tool/calls": float(window["calls"]), "tool/errors": float(window["errors"]),
           "tool/timeouts": float(window["timeout"]), "tool/memory": float(window["memory"]),
           "tool/output_limit": float(window["output_limit"]), "tool/forbidden": float(window["forbidden"])}
    if window["calls"]:
      out["tool/latency_mean_s"] = latency_sum / window["calls"]
      out["tool/latency_max_s"] = latency_max
    return out

  def close(self) -> None:
    """Wait for the calls in flight, then stop the threads (idempotent)."""
    self._executor.shutdown(wait=True)

  def __enter__(self) -> "SandboxPool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
