"""The sandbox's child side: confines a fresh interpreter, then runs the tool's code in it.

Never imported: `sandbox.run_python` passes this file's source to
`python -I [-S] -u -X utf8 -c <source> <config json>` in a new session whose working directory is the
call's scratch directory, and reads what it reports on the status pipe (`config["status_fd"]`), one
line each:

  start <json>        the layers that are in force (before the tool's code runs; see `_sandbox_main`)
  refused <event> ... the audit hook refused an operation (the first `_MAX_REPORTS` of them)
  memory              the code raised MemoryError (its memory limit)

Order matters and is the point of this file: leave the network (needs privileges), drop privileges,
tie this process's life to the parent's (after the drop, which would undo it), lower the resource
limits (hard limits too: the code cannot raise them again), install the audit hook last, then run the
code. Standard library only, Python >= 3.10: the sandbox's interpreter has no
site-packages and cannot import llamarl_jax.
"""

import json
import os
import resource
import signal
import sys
import traceback
import types

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
_MAX_REPORTS = 16  # refusal lines per call

# Modules whose import the hook refuses: they reach the OS without an audit event (process creation
# in _posixsubprocess, raw memory and syscalls in ctypes, shared memory, a second interpreter with no
# hook, C-level file or socket access, the C API test modules).
_REFUSED_IMPORTS = frozenset({
    "_posixsubprocess", "ctypes", "_ctypes", "_posixshmem", "_multiprocessing", "_xxsubinterpreters",
    "_xxinterpchannels", "_interpreters", "_interpchannels", "_interpqueues", "_testcapi",
    "_testinternalcapi", "_testbuffer", "_testmultiphase", "_testsinglephase", "_testclinic",
    "_testimportmultiple", "readline", "_gdbm", "_dbm", "_tkinter", "_curses", "_curses_panel",
})

# Events refused outright (a prefix ending in "." refuses the family): network, new processes and
# programs, signals to other processes, links (the path checks assume the code makes none), ownership,
# the working directory (relative paths are checked against it), resource limits, reaching objects the
# code was not given (the hook itself), native extensions of sqlite, the system log.
_REFUSED_EVENTS = (
    "socket.", "subprocess.", "ctypes.", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn",
    "os.system", "os.kill", "os.killpg", "signal.pthread_kill", "os.link", "os.symlink", "os.chown",
    "os.lchown", "os.chflags", "os.lchflags", "os.setxattr", "os.removexattr", "os.chdir", "os.chroot",
    "os.startfile", "resource.setrlimit", "resource.prlimit", "gc.get_objects", "gc.get_referrers",
    "gc.get_referents", "sqlite3.enable_load_extension", "sqlite3.load_extension", "syslog.",
    "_xxsubinterpreters.", "webbrowser.", "winreg.", "msvcrt.", "sys.remote_exec",
)

# Path events: event -> ((index of a path argument, index of its dir_fd argument or None), ...).
_WRITE_EVENTS = {
    "os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),), "os.chmod": ((0, 2),),
    "os.utime": ((0, 3),), "os.truncate": ((0, None),), "os.rename": ((0, 2), (1, 3)), "shutil.rmtree": ((0, 1),),
}
_READ_EVENTS = {"os.listdir": ((0, None),), "os.scandir": ((0, None),), "os.getxattr": ((0, None),),
                "os.listxattr": ((0, None),)}

# Files outside the read roots that ordinary code opens.
_READ_FILES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")


def _sandbox_say(fd: int, line: str) -> None:
  """One status line to the parent (ignored if the pipe is gone)."""
  try:
    os.write(fd, (line.replace("\n", " ") + "\n").encode("utf-8", "replace"))
  except OSError:
    pass


def _sandbox_unshare_network(ctypes, as_root: bool) -> str:
  """Move into a new, empty network namespace (only a loopback that is down: nothing is reachable).
  As root: unshare(CLONE_NEWNET) (needs CAP_SYS_ADMIN). Otherwise: a new user namespace too, mapping
  only our own uid and gid, after which every capability the new namespace granted is dropped (capset),
  so the code holds no privilege in it. Returns "isolated" or why not."""
  if ctypes is None:
    return "not available: no ctypes"
  libc = ctypes.CDLL(None, use_errno=True)
  uid, gid = os.getuid(), os.getgid()
  flags = CLONE_NEWNET if as_root else CLONE_NEWUSER | CLONE_NEWNET
  if libc.unshare(flags) != 0:
    what = "CLONE_NEWNET" if as_root else "CLONE_NEWUSER|CLONE_NEWNET"
    return f"not permitted: unshare({what}): {os.strerror(ctypes.get_errno())}"
  if as_root:
    return "isolated"
  try:
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
      with open(f"/proc/self/{name}", "w") as f:
        f.write(text)
  except OSError as e:
    return f"failed: writing /proc/self/{name}: {e}"

  class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

  class Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

  if libc.capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)()) != 0:  # _LINUX_CAPABILITY_VERSION_3
    return f"failed: capset: {os.strerror(ctypes.get_errno())}"
  return "isolated"


def _sandbox_reap_and_follow_parent(ctypes, parent_pid: int) -> bool:
  """Die with the parent (PR_SET_PDEATHSIG: SIGKILL), and reap every descendant of this process:
  orphans are re-parented here (PR_SET_CHILD_SUBREAPER) and, SIGCHLD being ignored, released as they
  exit, so the parent's kill of the session leaves no zombie behind (not even under an init that does
  not reap). After the privilege drop, which clears the death signal. False where prctl is missing."""
  signal.signal(signal.SIGCHLD, signal.SIG_IGN)
  if ctypes is None:
    return False
  libc = ctypes.CDLL(None, use_errno=True)
  ok = libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
  ok &= libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
  if os.getppid() != parent_pid:  # the parent died before the death signal was set
    os._exit(1)
  return ok


def _sandbox_forget_ctypes() -> None:
  """ctypes is used above, before the hook exists; out of sys.modules, importing it again is an
  audited import, which the hook refuses."""
  for name in [m for m in sys.modules if m in ("ctypes", "_ctypes") or m.startswith("ctypes.")]:
    del sys.modules[name]


def _sandbox_drop_privileges(uid: int, gid: int) -> None:
  """Root only: become uid/gid with no supplementary groups, for good (real, effective and saved ids)."""
  os.setgroups([])
  os.setresgid(gid, gid, gid)
  os.setresuid(uid, uid, uid)
  if os.getuid() != uid or os.geteuid() != uid:
    raise OSError(f"could not drop privileges to uid {uid}")


def _sandbox_set_limits(limits: dict) -> dict:
  """Lower soft and hard limits to `limits` ({RLIMIT name: value}); the CPU hard limit is one second
  above the soft one (SIGXCPU first, then SIGKILL). Returns the soft limits now in force."""
  applied = {}
  for name, value in limits.items():
    which = getattr(resource, name, None)
    if which is None:
      continue
    soft, hard = resource.getrlimit(which)
    new_hard = value + 1 if name == "RLIMIT_CPU" else value
    if hard != resource.RLIM_INFINITY:
      value, new_hard = min(value, hard), min(new_hard, hard)
    resource.setrlimit(which, (value, new_hard))
    applied[name] = resource.getrlimit(which)[0]
  return applied


def _sandbox_make_hook(scratch: str, read_roots: tuple, read_files: tuple, status_fd: int):
  """The audit hook (PEP 578): refuses the events above, writes outside `scratch`, and reads outside
  `scratch`, `read_roots` and `read_files`, by raising PermissionError before the operation happens
  (and saying so on the status pipe).

  It must not be steerable by the code it watches. Everything it calls is bound here, in its closure:
  the code can replace builtins and module attributes, but not closure cells without the function
  itself, which nothing the code can reach refers to. Paths are resolved with the raw posix functions
  (symlinks followed, '.' and '..' collapsed). Relative paths with '..' are refused: `os.open` takes a
  dir_fd that its audit event does not show, and a relative path is only checked right when it cannot
  climb out of whatever directory it is relative to (directories can only be opened inside `scratch`,
  the code cannot chdir, and it can make no links). The nested functions are named _sandbox_* so that
  tracebacks leave them out."""
  import posix

  lstat, readlink, getcwd, fspath, write = posix.lstat, posix.readlink, posix.getcwd, posix.fspath, posix.write
  _isinstance, _int, _bytes, _str, _len, _any = isinstance, int, bytes, str, len, any
  _OSError, _PermissionError = OSError, PermissionError
  write_flags = posix.O_WRONLY | posix.O_RDWR | posix.O_CREAT | posix.O_TRUNC | posix.O_APPEND
  refused_imports, refused_events, max_reports = _REFUSED_IMPORTS, _REFUSED_EVENTS, _MAX_REPORTS
  write_events, read_events = dict(_WRITE_EVENTS), dict(_READ_EVENTS)
  reports = [0]

  def _sandbox_refuse(event, detail, why):
    line = f"refused {event} {detail}".strip()[:300].replace("\n", " ")
    if reports[0] < max_reports:
      reports[0] += 1
      try:
        write(status_fd, line.encode("utf-8", "replace") + b"\n")
      except _OSError:
        pass
    raise _PermissionError(f"sandbox: {why} ({line[8:]})")

  def _sandbox_within(path, root):
    return path == root or path.startswith(root if root.endswith("/") else root + "/")

  def _sandbox_readable(path):
    return (_sandbox_within(path, scratch) or path in read_files
            or _any(_sandbox_within(path, root) for root in read_roots))

  def _sandbox_is_dir(path):
    try:
      return (lstat(path).st_mode & 0o170000) == 0o040000
    except _OSError:
      return False

  def _sandbox_resolve(path):
    """`path` (absolute) with '.' and '..' collapsed and symlinks followed; None if the links loop."""
    todo = path.split("/")[::-1]
    done = []
    hops = 0
    while todo:
      part = todo.pop()
      if part == "" or part == ".":
        continue
      if part == "..":
        if done:
          done.pop()
        continue
      here = "/" + "/".join(done + [part])
      try:
        mode = lstat(here).st_mode
      except _OSError:  # missing or not searchable: the rest is taken as written
        done.append(part)
        continue
      if (mode & 0o170000) != 0o120000:
        done.append(part)
        continue
      hops += 1
      if hops > 40:
        return None
      target = readlink(here)
      if target.startswith("/"):
        done = []
      todo.extend(target.split("/")[::-1])
    return "/" + "/".join(done)

  def _sandbox_absolute(event, arg, dir_fd=None):
    """The resolved absolute path that `arg` names (None for a file descriptor)."""
    if _isinstance(arg, _int):
      return None
    path = fspath(arg)
    if _isinstance(path, _bytes):
      path = path.decode("utf-8", "surrogateescape")
    if not path.startswith("/"):
      if ".." in path.split("/"):
        _sandbox_refuse(event, path, "relative paths with '..' are not allowed")
      base = readlink(f"/proc/self/fd/{dir_fd}") if dir_fd is not None and dir_fd >= 0 else getcwd()
      path = base + "/" + path
    resolved = _sandbox_resolve(path)
    if resolved is None:
      _sandbox_refuse(event, path, "too many symbolic links")
    return resolved

  def _sandbox_hook(event, args):
    if event == "open":
      path, mode, flags = args
      where = _sandbox_absolute(event, path)
      if where is None or _sandbox_within(where, scratch):
        return
      if _isinstance(flags, _int):
        writing = (flags & write_flags) != 0
      else:
        writing = mode is not None and _any(c in mode for c in "wax+")
      if writing:
        _sandbox_refuse(event, where, "writing outside the scratch directory is not allowed")
      if not _sandbox_readable(where):
        _sandbox_refuse(event, where, "reading outside the scratch directory and the standard library is not allowed")
      if _sandbox_is_dir(where):
        _sandbox_refuse(event, where, "opening a directory outside the scratch directory is not allowed")
      return
    spec = write_events.get(event) or read_events.get(event)
    if spec is not None:
      for at, dir_fd_at in spec:
        dir_fd = args[dir_fd_at] if dir_fd_at is not None and dir_fd_at < _len(args) else None
        where = _sandbox_absolute(event, args[at] if args[at] is not None else ".", dir_fd)
        if where is None or _sandbox_within(where, scratch):
          continue
        if event in write_events:
          _sandbox_refuse(event, where, "changing files outside the scratch directory is not allowed")
        if not _sandbox_readable(where):
          _sandbox_refuse(event, where, "listing directories outside the scratch directory is not allowed")
      return
    if event == "import":
      name = _str(args[0])
      if name in refused_imports or name.split(".")[0] in refused_imports:
        _sandbox_refuse(event, name, f"importing {name} is not allowed")
      if _len(args) > 1 and args[1] is not None:  # an extension module loaded from a file: native code
        where = _sandbox_absolute(event, args[1])
        if where is None or not _any(_sandbox_within(where, root) for root in read_roots):
          _sandbox_refuse(event, f"{name} from {where}", "loading native code from outside the standard library "
                          "is not allowed")
      return
    if event.startswith(refused_events):
      _sandbox_refuse(event, "", f"{event} is not allowed")
    if event == "sqlite3.connect" and args[0] not in (":memory:", "", b":memory:", b""):
      database = args[0]
      if _isinstance(database, (_str, _bytes)) and database[:5] in ("file:", b"file:"):
        _sandbox_refuse(event, database, "sqlite URIs are not allowed")
      where = _sandbox_absolute(event, database)
      if where is not None and not _sandbox_within(where, scratch):
        _sandbox_refuse(event, where, "databases outside the scratch directory are not allowed")

  return _sandbox_hook


def _sandbox_format_exception(exc: BaseException) -> str:
  """Python's usual traceback text, without this bootstrap's frames."""
  te = traceback.TracebackException(type(exc), exc, exc.__traceback__)
  seen = set()
  todo = [te]
  while todo:
    t = todo.pop()
    if id(t) in seen:
      continue
    seen.add(id(t))
    t.stack = traceback.StackSummary.from_list(
        [f for f in t.stack if not (f.filename == "<string>" and f.name.startswith("_sandbox_"))])
    todo.extend(x for x in (t.__cause__, t.__context__) if x is not None)
  return "".join(te.format())


def _sandbox_run(source: str, status_fd: int) -> int:
  """Run the tool's code as __main__ in a fresh module; the exit status."""
  module = types.ModuleType("__main__")
  module.__file__ = "main.py"
  sys.modules["__main__"] = module
  try:
    exec(compile(source, "main.py", "exec"), module.__dict__)
  except SystemExit:
    raise
  except MemoryError as e:
    module.__dict__.clear()  # let go of what the code allocated before reporting
    _sandbox_say(status_fd, "memory")
    _sandbox_print_error(e)
    return 1
  except BaseException as e:  # noqa: BLE001 - the code's error is the observation
    _sandbox_print_error(e)
    return 1
  return 0


def _sandbox_print_error(exc: BaseException) -> None:
  try:
    text = _sandbox_format_exception(exc)
  except BaseException:  # noqa: BLE001 - e.g. out of memory again: the bare name
    text = f"{type(exc).__name__}: {exc}\n"
  try:
    sys.stdout.flush()
  except BaseException:  # noqa: BLE001
    pass
  try:
    os.write(2, text.encode("utf-8", "replace"))
  except OSError:
    pass


def _sandbox_main(config: dict) -> int:
  """Confine this process (preimport, network, privileges, limits, hook: see the module docstring),
  report the layers in force, then run main.py from the working directory."""
  status_fd = config["status_fd"]
  for name in config["preimport"]:  # while the standard library is still readable (see drop below)
    try:
      __import__(name)
    except Exception:  # noqa: BLE001 - a missing optional module is not the code's problem
      pass

  try:
    import ctypes
  except ImportError:
    ctypes = None
  as_root = os.geteuid() == 0
  report = {"parent_root": as_root, "network": "disabled", "privileges_dropped": False}
  if config["network"] and as_root:
    report["network"] = _sandbox_unshare_network(ctypes, as_root=True)
  if as_root and config["uid"] is not None:
    _sandbox_drop_privileges(config["uid"], config["gid"])
    report["privileges_dropped"] = True
  if config["network"] and report["network"] != "isolated":
    report["network"] = _sandbox_unshare_network(ctypes, as_root=False)
  report["reaper"] = _sandbox_reap_and_follow_parent(ctypes, config["parent_pid"])
  del ctypes
  _sandbox_forget_ctypes()
  report["uid"], report["gid"] = os.getuid(), os.getgid()
  report["rlimits"] = _sandbox_set_limits(config["rlimits"])
  stdlib = os.path.dirname(os.path.dirname(json.__file__))
  report["stdlib_readable"] = os.access(stdlib, os.R_OK | os.X_OK)
  roots = [p for p in sys.path if p.startswith((sys.base_prefix, sys.base_exec_prefix))]
  if config["site_packages"]:
    import site

    roots += site.getsitepackages()
  read_roots = tuple(sorted({os.path.realpath(p) for p in roots if p}))
  report["audit_hook"] = bool(config["audit_hook"])
  report["read_roots"] = list(read_roots)
  _sandbox_say(status_fd, "start " + json.dumps(report))
  with open("main.py", encoding="utf-8") as f:
    source = f.read()
  if config["audit_hook"]:
    sys.addaudithook(_sandbox_make_hook(config["scratch"], read_roots, _READ_FILES, status_fd))
  return _sandbox_run(source, status_fd)


if __name__ == "__main__":
  sys.exit(_sandbox_main(json.loads(sys.argv[1])))
