#!/usr/bin/env python
"""Start a multi-process job on this machine: `launch_local.py --num_processes N -- <train.py arguments>`.

Each process is a fresh interpreter running `scripts/train.py <arguments> --coordinator_address=...
--num_processes=N --process_id=i` (free ports chosen here by binding port 0; on CPU each process
also gets its own cross-process transfer port). Output is streamed line by line with a `[rank i]`
prefix. As soon as one process exits non-zero the others are killed and the launcher exits with
that status, naming the rank (and its role, read from its start-up line); `--timeout_s` bounds the
whole job (exit 124).

  python scripts/launch_local.py --num_processes 2 -- --gin_file=configs/tiny_cpu.gin --run_dir=runs/mp
  python scripts/launch_local.py --num_processes 2 --cpu_devices 2 -- --gin_file=... (devices per process)

`--script` runs another entry point with the same protocol (tests use it).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from llamarl_jax import compat  # noqa: E402  (no jax: the launcher stays light)
from llamarl_jax.ports import free_ports  # noqa: E402
_ROLE = re.compile(r"\[llamarl\] process (\d+)/\d+ role=(\S+)")


def _child_env(cpu: bool) -> dict:
  env = dict(os.environ)
  env["PYTHONUNBUFFERED"] = "1"
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
  if cpu:  # the per-process device count comes from --cpu_devices / the config, not a global flag
    env["XLA_FLAGS"] = compat.without_cpu_devices(env.get("XLA_FLAGS", ""))
  return env


def launch(num_processes: int, args: list[str], *, script: str | os.PathLike = ROOT / "scripts" / "train.py",
           cpu_devices: int | None = None, timeout_s: float | None = None, heartbeat_timeout_s: int | None = None,
           out=None, python: str = sys.executable, on_start=None, fail_fast: bool = True,
           cpu_affinity: list[list[int]] | None = None) -> int:
  """Run the job; returns 0 when every process exited 0, else the first failure's exit status.

  out: where the prefixed output goes (default stdout). on_start: called with the list of Popen
  objects once every process started (tests use it to kill one). fail_fast=False: after a failure,
  let the other processes end on their own (as they must under SLURM; tests check that they do).
  cpu_affinity: one core list per rank; each process (and its children) runs pinned there (taskset).
  """
  if cpu_affinity is not None and len(cpu_affinity) != num_processes:
    raise ValueError(f"cpu_affinity needs one core list per process ({num_processes}), got {len(cpu_affinity)}")
  out = out or sys.stdout
  cpu = (os.environ.get("JAX_PLATFORMS") or "cpu").split(",")[0] == "cpu"
  ports = free_ports(1 + (num_processes if cpu else 0))
  coordinator = f"127.0.0.1:{ports[0]}"
  env = _child_env(cpu)
  if cpu:
    env.setdefault("JAX_PLATFORMS", "cpu")
  roles: dict[int, str] = {}
  lock = threading.Lock()
  procs: list[subprocess.Popen] = []
  for rank in range(num_processes):
    pin = ["taskset", "-c", ",".join(map(str, cpu_affinity[rank]))] if cpu_affinity else []
    cmd = [*pin, python, str(script), *args, f"--coordinator_address={coordinator}",
           f"--num_processes={num_processes}", f"--process_id={rank}"]
    if cpu:
      cmd.append(f"--transfer_address=127.0.0.1:{ports[1 + rank]}")
    if cpu_devices:
      cmd.append(f"--cpu_devices={cpu_devices}")
    if heartbeat_timeout_s:
      cmd.append(f"--heartbeat_timeout_s={heartbeat_timeout_s}")
    procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  bufsize=1, start_new_session=True))

  def pump(rank: int, proc: subprocess.Popen) -> None:
    for line in proc.stdout:
      if (m := _ROLE.search(line)) and int(m.group(1)) == rank:
        roles[rank] = m.group(2)
      with lock:
        out.write(f"[rank {rank}] {line}")
        out.flush()

  pumps = [threading.Thread(target=pump, args=(r, p), daemon=True) for r, p in enumerate(procs)]
  for t in pumps:
    t.start()
  if on_start is not None:
    on_start(procs)
  deadline = None if timeout_s is None else time.monotonic() + timeout_s
  status = 0
  try:
    while True:
      codes = [p.poll() for p in procs]
      failed = any(c not in (None, 0) for c in codes)
      if failed and (fail_fast or all(c is not None for c in codes)):  # name the process that caused it
        _await_cause(procs)
        rank, code = _first_failure(procs)
        what = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        with lock:
          out.write(f"[launch_local] rank {rank} ({roles.get(rank, 'role unknown')}) failed with {what}; "
                    f"stopping the other processes\n")
        status = code if code > 0 else 128 - code
        break
      if all(c == 0 for c in codes):
        break
      if deadline is not None and time.monotonic() > deadline:
        with lock:
          out.write(f"[launch_local] the job ran past --timeout_s={timeout_s}; stopping every process\n")
        status = 124
        break
      time.sleep(0.1)
  except KeyboardInterrupt:
    status = 130
  finally:
    _stop(procs)
    for t in pumps:
      t.join(timeout=5)
  return status


def _await_cause(procs: list[subprocess.Popen], wait_s: float = 5.0) -> None:
  """Processes that stop because a peer failed (exit status 75) often exit before the peer itself
  has finished exiting: give the one that failed on its own a moment to report its status."""
  deadline = time.monotonic() + wait_s
  while time.monotonic() < deadline:
    codes = [p.poll() for p in procs]
    if any(c not in (None, 0, 75) for c in codes) or all(c is not None for c in codes):
      return
    time.sleep(0.1)


def _first_failure(procs: list[subprocess.Popen]) -> tuple[int, int]:
  """(rank, status) of the process that failed on its own: not one that stopped because a peer
  failed (exit status EXIT_PEER_FAILED, 75); the lowest such rank, else the lowest failed rank."""
  failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode not in (None, 0)]
  own = [f for f in failed if f[1] != 75]
  return (own or failed)[0]


def _stop(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
  """SIGTERM each process group still running, then SIGKILL what is left after `grace_s`."""
  running = [p for p in procs if p.poll() is None]
  for p in running:
    try:
      os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError:
      pass
  deadline = time.monotonic() + grace_s
  for p in running:
    try:
      p.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
      pass
  for p in procs:  # the whole group: reward workers too
    try:
      os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass
    p.wait()


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  rest: list[str] = []
  if "--" in argv:
    i = argv.index("--")
    argv, rest = argv[:i], argv[i + 1:]
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--num_processes", type=int, required=True)
  parser.add_argument("--cpu_devices", type=int, default=None,
                      help="CPU devices per process (default: the config's trainer + generator devices / N)")
  parser.add_argument("--timeout_s", type=float, default=None, help="kill the whole job after this long")
  parser.add_argument("--heartbeat_timeout_s", type=int, default=None,
                      help="a process silent this long counts as dead (default: scripts/train.py's)")
  parser.add_argument("--script", default=str(ROOT / "scripts" / "train.py"), help="entry point to run")
  parser.add_argument("--cpu_affinity", nargs="+", default=None, metavar="CORES",
                      help="pin each rank to cores with taskset: one list per rank, e.g. --cpu_affinity 0 1 or 0,1 2,3")
  args = parser.parse_args(argv)
  if args.num_processes < 1:
    parser.error(f"--num_processes must be >= 1, got {args.num_processes}")
  affinity = [[int(c) for c in cores.split(",")] for cores in args.cpu_affinity] if args.cpu_affinity else None
  return launch(args.num_processes, rest, script=args.script, cpu_devices=args.cpu_devices,
                timeout_s=args.timeout_s, heartbeat_timeout_s=args.heartbeat_timeout_s, cpu_affinity=affinity)


if __name__ == "__main__":
  sys.exit(main())
