"""The sandboxed Python tool: hostile code is contained within its limits, yields an error observation
with the right status, and leaves the parent, its environment and its files as they were.

Most cases run twice where it means something: with every layer, and with the audit hook off, to show
that the operating-system layers (resource limits, process group, the unprivileged uid and the network
namespace when the parent is root) contain the case on their own. Those variants skip, saying why,
where the layer they rely on is not in force (e.g. not root). Limits are small so the file runs in
about 20 s on 2 cores; every time bound below is the limit plus a slack for a loaded machine.
"""

import dataclasses
import importlib.util
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from llamarl_jax.tools import STATUSES, SandboxLimits, SandboxPool, ToolResult, capabilities, run_python
from llamarl_jax.tools import sandbox

ROOT = os.geteuid() == 0
LIMITS = SandboxLimits(cpu_s=5, wall_s=5, memory_bytes=256 * 2**20, max_output_bytes=4096, max_processes=8)
NO_HOOK = dataclasses.replace(LIMITS, audit_hook=False)
SLACK_S = 1.5  # start-up (~0.2 s here), clean-up and a loaded 2-core machine


@pytest.fixture(scope="module")
def caps():
  return capabilities(LIMITS)


def live_processes_of(uid: int) -> list[int]:
  """Pids of live (not zombie) processes whose real uid is `uid`."""
  out = []
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      status = Path(f"/proc/{name}/status").read_text()
    except OSError:
      continue
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith(("Z", "X")):
      out.append(int(name))
  return out


@pytest.fixture(autouse=True)
def parent_unharmed():
  """Around every test: the parent's own limits are unchanged, and (as root) no process of the
  sandbox's uid is left running."""
  limits_before = {r: resource.getrlimit(r) for r in (resource.RLIMIT_AS, resource.RLIMIT_CPU, resource.RLIMIT_NPROC)}
  cwd_before = os.getcwd()
  yield
  assert {r: resource.getrlimit(r) for r in limits_before} == limits_before
  assert os.getcwd() == cwd_before
  if ROOT:
    assert live_processes_of(LIMITS.uid) == [], "a sandboxed process outlived its call"


# ------------------------------------------------------------------------------------------------
# Ordinary code


def test_print_gives_the_digits():
  result = run_python("print(2**100)", LIMITS)
  assert (result.status, result.exit_code, result.output) == ("ok", 0, "1267650600228229401496703205376\n")
  assert result.observation() == result.output
  assert result.refused == ()


def test_an_exception_is_a_traceback_observation():
  result = run_python("x = 1\nprint('before')\n1 / 0\n", LIMITS)
  assert (result.status, result.exit_code) == ("error", 1)
  assert result.output.startswith("before\nTraceback (most recent call last):\n")
  assert 'File "main.py", line 3, in <module>' in result.output
  assert result.output.endswith("ZeroDivisionError: division by zero\n")
  assert "<string>" not in result.output  # the bootstrap's frames are not shown


def test_a_syntax_error_is_an_error_observation():
  result = run_python("def f(:\n", LIMITS)
  assert (result.status, result.exit_code) == ("error", 1)
  assert "SyntaxError" in result.output and "main.py" in result.output


def test_sys_exit_sets_the_exit_code():
  result = run_python("import sys\nprint('bye')\nsys.exit(3)", LIMITS)
  assert (result.status, result.exit_code, result.output) == ("error", 3, "bye\n")
  assert result.observation() == "bye\n"
  silent = run_python("import sys; sys.exit(4)", LIMITS)
  assert silent.observation() == "[exit code 4]"


def test_scratch_directory_is_the_working_directory_and_is_removed():
  code = ("import os\nopen('notes.txt', 'w').write('kept')\nos.mkdir('sub')\nopen('sub/a', 'w').close()\n"
          "print(open('notes.txt').read())\nprint(sorted(os.listdir('.')))\nprint(os.getcwd())")
  result = run_python(code, LIMITS)
  assert result.status == "ok", result.output
  text, listing, cwd = result.output.splitlines()
  assert (text, listing) == ("kept", "['main.py', 'notes.txt', 'sub']")
  assert Path(cwd).parent == Path(tempfile.gettempdir()).resolve() and Path(cwd).name.startswith("llamarl_sandbox_")
  assert not Path(cwd).exists()


def test_limits_are_validated_with_every_problem_named():
  with pytest.raises(ValueError) as e:
    SandboxLimits(cpu_s=0, memory_bytes=2**20, uid=0)
  message = str(e.value)
  assert "SandboxLimits.cpu_s: expected > 0, got 0" in message
  assert "SandboxLimits.memory_bytes" in message and "SandboxLimits.uid" in message


# ------------------------------------------------------------------------------------------------
# Time


def test_infinite_loop_is_stopped_at_the_wall_limit():
  limits = dataclasses.replace(LIMITS, wall_s=1.0, cpu_s=30)
  t0 = time.monotonic()
  result = run_python("while True:\n  pass\n", limits)
  elapsed = time.monotonic() - t0
  assert (result.status, result.exit_code) == ("timeout", -9)
  assert 1.0 <= result.wall_s < 1.0 + 0.5, result.wall_s  # killed at the deadline, not later
  assert elapsed < 1.0 + SLACK_S
  assert result.observation().endswith("[the code ran past its time limit and was stopped]")


def test_cpu_limit_stops_a_busy_loop_before_the_wall_limit():
  limits = dataclasses.replace(LIMITS, wall_s=30, cpu_s=1)
  result = run_python("while True:\n  pass\n", limits)
  assert result.status == "timeout"
  assert result.exit_code == -24  # SIGXCPU: the kernel's CPU limit stopped it, not the parent's wall limit
  assert 0.5 <= result.cpu_s < 2.0  # the kernel's tick-based check and wait4's accounting differ a little
  assert result.wall_s < 30


def test_sleeping_is_stopped_at_the_wall_limit():
  result = run_python("import time\nprint('start')\ntime.sleep(60)\n", dataclasses.replace(LIMITS, wall_s=1.0))
  assert (result.status, result.output) == ("timeout", "start\n")  # output up to the kill is kept
  assert result.wall_s < 1.5


# ------------------------------------------------------------------------------------------------
# Processes

FORK_BOMB = """
import os, time
print(os.getpid(), flush=True)
for _ in range(64):
  try:
    if os.fork() == 0:
      print(os.getpid(), flush=True)
  except OSError:
    pass
time.sleep(60)
"""


def session_of(pid: int) -> int | None:
  """The session of process `pid`, zombies included (None: no such process)."""
  try:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])
  except OSError:
    return None


def test_fork_bomb_is_refused_by_the_audit_hook():
  result = run_python("import os\nwhile True:\n  os.fork()\n", LIMITS)
  assert result.status == "forbidden"
  assert result.refused == ("os.fork",)
  assert "PermissionError: sandbox: os.fork is not allowed" in result.output
  # The same refusal, caught by the code (FORK_BOMB catches OSError, then sleeps): recorded, and the
  # call then ends at its wall limit.
  caught = run_python(FORK_BOMB, dataclasses.replace(LIMITS, wall_s=1.0))
  assert caught.status == "timeout" and caught.refused == ("os.fork",) * 16  # the first 16 are reported


def test_fork_bomb_is_contained_without_the_audit_hook():
  """RLIMIT_NPROC caps the processes; at the wall limit the whole session is killed, none is left."""
  limits = dataclasses.replace(NO_HOOK, wall_s=1.5)
  t0 = time.monotonic()
  result = run_python(FORK_BOMB, limits)
  assert result.status == "timeout"
  assert time.monotonic() - t0 < 1.5 + SLACK_S
  pids = [int(line) for line in result.output.split()]
  session = pids[0]  # the child leads its own session; every descendant is in it
  assert sandbox.session_members(session) == []
  if ROOT:  # NPROC counts the processes of the sandbox's own uid: the bomb had at most max_processes
    assert len(pids) <= limits.max_processes
  # ... and every one was reaped (by the child, their subreaper), none left as a zombie.
  assert [pid for pid in pids if session_of(pid) == session] == []


def test_subprocess_and_os_system_are_refused():
  for code, event in (("import os\nos.system('true')", "os.system"),
                      ("import os\nos.execv('/bin/sh', ['sh'])", "os.exec"),
                      ("import os\nos.posix_spawn('/bin/true', ['true'], {})", "os.posix_spawn"),
                      ("import _posixsubprocess", "import _posixsubprocess"),
                      ("import ctypes", "import ctypes")):
    result = run_python(code, LIMITS)
    assert result.status == "forbidden", (code, result.output)
    assert result.refused == (event,), code


def test_native_code_from_the_scratch_directory_is_refused():
  """An extension module the code wrote itself would run native code below the audit hook."""
  code = ("import importlib.util, os\nopen('evil.so', 'wb').write(b'not even ELF')\n"
          "spec = importlib.util.spec_from_file_location('evil', os.path.abspath('evil.so'))\n"
          "importlib.util.module_from_spec(spec)\n")
  result = run_python(code, dataclasses.replace(LIMITS, preimport=LIMITS.preimport + ("importlib.util",)))
  assert result.status == "forbidden", result.output
  assert len(result.refused) == 1 and result.refused[0].startswith("import evil from ")
  assert result.refused[0].endswith("/evil.so")


# ------------------------------------------------------------------------------------------------
# Memory and output


def test_memory_hog_fails_with_memory_status():
  rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  code = "chunks = []\nwhile True:\n  chunks.append(bytearray(10**7))\n"
  result = run_python(code, dataclasses.replace(LIMITS, memory_bytes=128 * 2**20))
  assert result.status == "memory"
  assert result.output.rstrip().endswith("MemoryError")
  assert result.observation().endswith("[the code ran out of memory]")
  assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 50 * 1024  # KB: the parent did not grow


def test_one_huge_allocation_fails_with_memory_status():
  result = run_python("x = bytearray(10**10)\n", LIMITS)
  assert result.status == "memory"


@pytest.mark.parametrize("code", ["while True:\n  print('x' * 1000)\n",
                                  "import sys\nsys.stdout.write('y' * 50_000_000)\n"])
def test_huge_print_is_cut_at_the_cap_and_returns_at_once(code):
  t0 = time.monotonic()
  result = run_python(code, LIMITS)
  assert result.status == "output_limit"
  assert result.exit_code == -9  # killed as soon as the cap was passed
  marker = sandbox.TRUNCATION_MARKER.format(cap=LIMITS.max_output_bytes)
  assert result.output.endswith(marker)
  assert len(result.output[:-len(marker)].encode()) == LIMITS.max_output_bytes
  assert time.monotonic() - t0 < SLACK_S


def test_big_files_are_capped():
  code = f"with open('big', 'wb') as f:\n  f.write(b'0' * {2**20 + 1})\n"
  result = run_python(code, dataclasses.replace(LIMITS, max_file_bytes=2**20))
  assert result.status == "error"
  assert "File too large" in result.output


# ------------------------------------------------------------------------------------------------
# The environment, the run's files, the network

SECRET = "hunter2-llamarl-sandbox-secret"


def test_environment_is_not_inherited(monkeypatch):
  monkeypatch.setenv("LLAMARL_SANDBOX_SECRET", SECRET)
  monkeypatch.setenv("PYTHONPATH", "/nonexistent/should/not/apply")
  result = run_python("import os, sys\nprint(sorted(os.environ))\nprint(sys.path)", LIMITS)
  assert result.status == "ok"
  assert SECRET not in result.output and "/nonexistent" not in result.output
  names = json.loads(result.output.splitlines()[0].replace("'", '"'))
  assert set(names) <= {"HOME", "TMPDIR", "LC_CTYPE"}  # LC_CTYPE: Python's own C-locale coercion


@pytest.mark.parametrize("limits", [LIMITS, NO_HOOK], ids=["all layers", "no audit hook"])
def test_the_parents_environment_cannot_be_read_through_proc(monkeypatch, limits):
  if not limits.audit_hook and not ROOT:
    pytest.skip("without the audit hook only the uid drop (root parents) hides /proc/<parent>/environ")
  monkeypatch.setenv("LLAMARL_SANDBOX_SECRET", SECRET)
  code = f"print(open('/proc/{os.getpid()}/environ', 'rb').read())"
  result = run_python(code, limits)
  assert SECRET not in result.output
  assert result.status == ("forbidden" if limits.audit_hook else "error")
  assert "PermissionError" in result.output


@pytest.fixture
def run_files(tmp_path):
  """A fake run directory: a checkpoint and a metrics file, and their contents."""
  step = tmp_path / "run" / "checkpoints" / "step_00000010"
  step.mkdir(parents=True)
  (step / "params.msgpack").write_bytes(b"weights")
  (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 10}\n')
  return tmp_path / "run"


def snapshot(directory: Path) -> dict[str, bytes]:
  return {str(p.relative_to(directory)): p.read_bytes() if p.is_file() else b"<dir>"
          for p in sorted(directory.rglob("*"))}


def attempts(run: Path) -> str:
  """Code that tries to read, list, change, remove and add to the run's files, printing each outcome."""
  ckpt = run / "checkpoints" / "step_00000010"
  ops = {
      "read": f"open({str(ckpt / 'params.msgpack')!r}, 'rb').read()",
      "list": f"os.listdir({str(run / 'checkpoints')!r})",
      "overwrite": f"open({str(ckpt / 'params.msgpack')!r}, 'wb').write(b'pwned')",
      "append": f"open({str(run / 'metrics.jsonl')!r}, 'a').write('pwned')",
      "remove": f"os.remove({str(run / 'metrics.jsonl')!r})",
      "rename": f"os.rename({str(ckpt)!r}, {str(run / 'moved')!r})",
      "mkdir": f"os.mkdir({str(run / 'checkpoints' / 'step_99999999')!r})",
      "chmod": f"os.chmod({str(ckpt / 'params.msgpack')!r}, 0o777)",
      "create": f"open({str(run / 'new.txt')!r}, 'x').write('pwned')",
      "os.open": f"os.close(os.open({str(run / 'new2.txt')!r}, os.O_WRONLY | os.O_CREAT))",
      "relative": "open('../../' + {0!r}.lstrip('/'), 'w')".format(str(run / "rel.txt")),
  }
  lines = ["import os"]
  for name, op in ops.items():
    lines.append(f"try:\n  {op}\n  print({name!r}, 'done')\nexcept OSError as e:\n  print({name!r}, 'failed')")
  return "\n".join(lines) + "\n"


@pytest.mark.parametrize("limits", [LIMITS, NO_HOOK], ids=["all layers", "no audit hook"])
def test_the_runs_files_cannot_be_read_or_changed(run_files, limits):
  if not limits.audit_hook and not ROOT:
    pytest.skip("without the audit hook only the uid drop (root parents) protects the caller's files")
  before = snapshot(run_files)
  result = run_python(attempts(run_files), limits)
  assert result.status == "ok", result.output  # each attempt's error was caught by the code
  outcomes = dict(line.split() for line in result.output.splitlines())
  assert outcomes == {name: "failed" for name in outcomes} and len(outcomes) == 11
  assert snapshot(run_files) == before
  if limits.audit_hook:
    assert len(result.refused) == 11
    assert all(entry.startswith(("open ", "os.", "open ../")) for entry in result.refused), result.refused


def test_writing_outside_fails_with_forbidden_status(tmp_path):
  victim = tmp_path / "victim.txt"
  victim.write_text("original")
  result = run_python(f"open({str(victim)!r}, 'w').write('pwned')\n", LIMITS)
  assert result.status == "forbidden"
  assert result.refused == (f"open {victim}",)
  assert "writing outside the scratch directory is not allowed" in result.output
  assert result.observation().endswith(f"[not allowed in the sandbox: open {victim}]")
  assert victim.read_text() == "original"


def test_symlinks_and_links_are_refused(tmp_path):
  target = tmp_path / "target.txt"
  target.write_text("original")
  for code in (f"import os\nos.symlink({str(target)!r}, 'link')", f"import os\nos.link({str(target)!r}, 'hard')"):
    result = run_python(code, LIMITS)
    assert result.status == "forbidden", result.output
  assert target.read_text() == "original"


@pytest.fixture
def listener():
  """A TCP socket listening on localhost, as a service of the run would be; yields its port and a
  function returning whether anything connected."""
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen(8)
  server.settimeout(0.2)

  def connected() -> bool:
    try:
      conn, _ = server.accept()
    except socket.timeout:
      return False
    conn.close()
    return True

  yield server.getsockname()[1], connected
  server.close()


def connect_code(port: int) -> str:
  # A numeric address: no name lookup (whose idna codec, too, may be unreadable by the sandbox's uid).
  return f"import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(('127.0.0.1', {port}))\ns.sendall(b'pwned')\n"


def test_sockets_are_refused_by_the_audit_hook(listener):
  port, connected = listener
  # socket preimported: where the standard library is unreadable by the sandbox's uid, the import would
  # fail before the hook is reached.
  result = run_python(connect_code(port), dataclasses.replace(LIMITS, preimport=LIMITS.preimport + ("socket",)))
  assert result.status == "forbidden"
  assert result.refused[0].startswith("socket.")
  assert not connected()


def test_the_network_namespace_alone_reaches_nothing(listener, caps):
  if not caps.network_isolated:
    pytest.skip(f"no network namespace here: {caps.network}")
  port, connected = listener
  result = run_python(connect_code(port), dataclasses.replace(NO_HOOK, preimport=LIMITS.preimport + ("socket",)))
  assert result.status == "error"
  assert "Network is unreachable" in result.output or "Connection refused" in result.output
  assert not connected()


# ------------------------------------------------------------------------------------------------
# Layers, pool


def test_capabilities_report_the_layers_in_force(caps):
  assert caps.parent_root == ROOT
  assert caps.audit_hook and caps.reaper
  assert caps.rlimits == LIMITS.rlimits()
  if ROOT:
    assert caps.privileges_dropped and (caps.uid, caps.gid) == (LIMITS.uid, LIMITS.gid)
  else:
    assert not caps.privileges_dropped and caps.uid == os.getuid()
  assert caps.network_isolated or caps.network.startswith(("not permitted", "failed", "not available"))
  assert "sandbox: parent" in caps.summary()


def test_pool_runs_calls_concurrently_and_counts_them():
  limits = dataclasses.replace(LIMITS, wall_s=1.0)
  codes = ["print(1)", "1/0", "while True: pass", "import os; os.fork()"]
  results: list[ToolResult] = []
  with SandboxPool(limits, max_workers=2) as pool:
    worker = threading.Thread(target=lambda: results.extend(f.result() for f in [pool.submit(c) for c in codes]))
    worker.start()  # from a worker thread, as the environment will
    worker.join(timeout=30)
    assert [r.status for r in results] == ["ok", "error", "timeout", "forbidden"]
    metrics = pool.metrics()
    assert {k: v for k, v in metrics.items() if not k.startswith("tool/latency")} == {
        "tool/calls": 4.0, "tool/errors": 3.0, "tool/timeouts": 1.0, "tool/memory": 0.0,
        "tool/output_limit": 0.0, "tool/forbidden": 1.0}
    assert 1.0 <= metrics["tool/latency_max_s"] < 1.0 + SLACK_S
    assert metrics["tool/latency_mean_s"] < metrics["tool/latency_max_s"]
    assert pool.metrics()["tool/calls"] == 0.0  # a window per call of metrics()
    assert pool.totals["calls"] == 4
  assert set(r.status for r in results) <= set(STATUSES)


# ------------------------------------------------------------------------------------------------
# A parent that is not root

_UNPRIVILEGED_SCRIPT = """
import dataclasses, importlib.util, json, os, sys, tempfile
spec = importlib.util.spec_from_file_location("sandbox", sys.argv[1])
sandbox = importlib.util.module_from_spec(spec)
sys.modules["sandbox"] = sandbox
spec.loader.exec_module(sandbox)
victim = sys.argv[2]
limits = sandbox.SandboxLimits(cpu_s=5, wall_s=1.0, memory_bytes=256 * 2**20, max_processes=8)
caps = sandbox.capabilities(limits)
out = {"caps": dataclasses.asdict(caps)}
for name, code in {
    "print": "print(2**100)",
    "fork": "import os; os.fork()",
    "write": f"open({victim!r}, 'w').write('pwned')",
    "environ": f"print(open('/proc/{os.getppid()}/environ').read())",
    "loop": "while True: pass",
    "memory": "x = bytearray(10**10)",
}.items():
  r = sandbox.run_python(code, limits)
  out[name] = [r.status, r.output[-200:]]
print(json.dumps(out))
"""


def _traversable_temp_root() -> str:
  """A temporary-files directory whose every ancestor other users may enter (/tmp, mode 1777, where the
  configured one is not): another uid must reach what the test puts there."""
  root = Path(tempfile.gettempdir()).resolve()
  if all(p.stat().st_mode & 0o001 for p in (root, *root.parents)):
    return str(root)
  return "/tmp"


def _copy_sandbox_module(directory: Path) -> Path:
  """Copy the sandbox's two source files into `directory`/sandbox; the path of the copied sandbox.py."""
  target = directory / "sandbox"
  target.mkdir()
  source = Path(sandbox.__file__).resolve().parent
  for name in ("sandbox.py", "_sandbox_child.py"):
    shutil.copyfile(source / name, target / name)
  return target / "sandbox.py"


def test_the_child_reads_nothing_of_the_checkout(monkeypatch):
  """The sandbox loaded from a directory only root may enter (mode 0700, like a `mktemp -d` clone)
  still runs code as uid 65534: the child gets its bootstrap as `-c` source from the parent, its
  config on the command line, and works in its own scratch directory, never reading the checkout.
  The child's own attempt to list that directory fails, so the call cannot have depended on it."""
  if not ROOT:
    pytest.skip("needs root: the child drops to uid 65534 only under a root parent")
  hidden = Path(tempfile.mkdtemp(prefix="llamarl_sandbox_hidden_"))
  try:
    os.chmod(hidden, 0o700)
    spec = importlib.util.spec_from_file_location("llamarl_sandbox_hidden_copy", _copy_sandbox_module(hidden))
    hidden_sandbox = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, hidden_sandbox)  # dataclasses look their module up
    spec.loader.exec_module(hidden_sandbox)
    limits = hidden_sandbox.SandboxLimits(cpu_s=5, wall_s=5, memory_bytes=256 * 2**20, max_processes=8,
                                          audit_hook=False)  # the uid alone must keep the child out
    caps = hidden_sandbox.capabilities(limits)
    assert (caps.privileges_dropped, caps.uid) == (True, 65534)
    result = hidden_sandbox.run_python(f"import os\nprint(6 * 7)\nos.listdir({str(hidden)!r})", limits)
  finally:
    shutil.rmtree(hidden, ignore_errors=True)
  assert result.status == "error" and result.output.startswith("42\n"), result.output
  assert "PermissionError" in result.output


def test_a_parent_that_is_not_root_keeps_the_other_layers(tmp_path):
  """The parent itself runs as an unprivileged user (uid 65534), under an interpreter whose standard
  library that user can read: no privilege drop, but rlimits, process group and audit hook apply (and
  the network namespace inside a user namespace, where the kernel allows one)."""
  python = shutil.which("python3", path="/usr/bin:/usr/local/bin")
  if not ROOT:
    pytest.skip("needs root to start a parent as another user")
  if python is None or subprocess.run([python, "-c", "import sys; assert sys.version_info >= (3, 10)"]).returncode:
    pytest.skip("no system python3 >= 3.10 readable by an unprivileged user")
  home = Path(tempfile.mkdtemp(prefix="llamarl_sandbox_test_", dir=_traversable_temp_root()))
  try:
    os.chown(home, 65534, 65534)
    # The unprivileged parent loads the sandbox from its own directory: the checkout may sit where
    # uid 65534 cannot read (a `mktemp -d` clone, a home directory).
    module = _copy_sandbox_module(home)
    for path in (home / "sandbox", *(home / "sandbox").iterdir()):
      os.chown(path, 65534, 65534)
    victim = home / "victim.txt"  # the unprivileged parent's own file: only the audit hook protects it
    victim.write_text("original")
    os.chown(victim, 65534, 65534)
    proc = subprocess.run([python, "-I", "-c", _UNPRIVILEGED_SCRIPT, str(module), str(victim)], cwd=home,
                          capture_output=True, text=True, timeout=60, user=65534, group=65534, extra_groups=[],
                          env={"LLAMARL_SANDBOX_SECRET": SECRET})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert victim.read_text() == "original"
  finally:
    shutil.rmtree(home, ignore_errors=True)
  caps = out["caps"]
  assert (caps["parent_root"], caps["privileges_dropped"], caps["uid"]) == (False, False, 65534)
  assert caps["rlimits"]["RLIMIT_NPROC"] == 8 and caps["audit_hook"]
  assert out["print"] == ["ok", "1267650600228229401496703205376\n"]
  assert out["fork"][0] == "forbidden"
  assert out["write"][0] == "forbidden"
  assert out["environ"][0] == "forbidden" and SECRET not in out["environ"][1]
  assert out["loop"][0] == "timeout"
  assert out["memory"][0] == "memory"
