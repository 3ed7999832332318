"""Many processes, one `jax.distributed` job: start-up, roles, the key-value store, shared fate.

  initialize(...)   `jax.distributed.initialize` from explicit arguments, or from a SLURM / Open MPI
                    environment (JAX's own cluster detection) when one with > 1 task is present; on
                    CPU it also sets the per-process device count and the cross-process transfer
                    socket. Returns False (and does nothing) for a plain single-process run.
  Roles             which processes own trainer, generator and reward-model devices, derived from
                    the meshes; a process owns devices of one role only.
  KVStore           a thin wrapper over the coordination service's key-value store, for small facts
                    (metrics, data positions, failures). It is JAX's private API: only this file
                    touches it, so only this file changes if JAX moves it.
  FaultWatch        a thread that ends this process within seconds when a peer raised (it wrote its
                    error to the store) or died (the coordination service stopped hearing its
                    heartbeats), with a message naming the failed rank and role.

Fate sharing. JAX's default is to abort every process when one stops sending heartbeats, after
100 s and with a message that names only a task number. We start the service with a short heartbeat
timeout and `jax_enable_recoverability` (the service then reports dead tasks instead of aborting
everyone), and `FaultWatch` turns the report into an exit naming the rank and its role. A process
that loses the coordinator (process 0) exits too. A send that can never be matched therefore never
hangs: its peer is gone, and the watch ends the process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import threading
import time
from typing import Any, Sequence

import jax

from llamarl_jax import compat
from llamarl_jax.ports import free_ports

# Exit status of a process that stops because another one failed (the failed one exits with its own).
EXIT_PEER_FAILED = 75
_FAILED = "llamarl/failed/"


def _env_world_size() -> int:
  """Tasks of the SLURM step / Open MPI job this process runs in (1 when neither is present)."""
  if "OMPI_MCA_orte_hnp_uri" in os.environ:
    return int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
  if all(k in os.environ for k in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID")):
    return int(os.environ["SLURM_NTASKS"])
  return 1


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port nobody listens on right now, below the ephemeral range (`ports.free_ports`)."""
  return free_ports(1, host)[0]


def on_cpu() -> bool:
  """Whether JAX is configured for the CPU backend (JAX_PLATFORMS or jax_platforms names cpu first)."""
  platforms = (os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or "").lower()
  return platforms.split(",")[0].strip() == "cpu"


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids: Sequence[int] | None = None, *,
               cpu_devices: int | None = None, transfer_address: str | None = None,
               heartbeat_timeout_s: int = 10, initialization_timeout_s: int = 300) -> bool:
  """Join the job (see the module docstring); must run before anything touches `jax.devices()`.

  With none of coordinator_address / num_processes / process_id given and no SLURM or Open MPI job
  of more than one task around, returns False and leaves JAX alone (one process, as always).
  cpu_devices: CPU devices of this process (`jax_num_cpu_devices`; CPU only).
  transfer_address: "host:port" of this process's cross-process transfer socket; on CPU one is
  chosen (a free port; 127.0.0.1 when the coordinator is local) when not given.
  heartbeat_timeout_s: a peer silent this long counts as dead (JAX's default is 100 s).
  """
  explicit = (coordinator_address, num_processes, process_id)
  if all(a is None for a in explicit):
    if _env_world_size() <= 1:
      return False
  elif any(a is None for a in explicit) and _env_world_size() <= 1:
    raise ValueError(f"a multi-process run needs --coordinator_address, --num_processes and --process_id "
                     f"together (or a SLURM / Open MPI job to read them from); got coordinator_address="
                     f"{coordinator_address!r}, num_processes={num_processes!r}, process_id={process_id!r}")
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"num_processes must be >= 1, got {num_processes}")
  if cpu_devices is not None:
    jax.config.update("jax_num_cpu_devices", int(cpu_devices))
  if transfer_address is None and on_cpu():
    local = coordinator_address is not None and coordinator_address.rsplit(":", 1)[0] in ("127.0.0.1", "localhost")
    host = "127.0.0.1" if local else socket.gethostbyname(socket.gethostname())
    transfer_address = f"{host}:{free_port(host)}"
  if transfer_address:
    jax.config.update("jax_cross_host_transfer_socket_address", transfer_address)
    # A receiver looks up the sender's socket when it first pulls; the protocol only starts a receive
    # after the sender has sent (a store key says so), so this is a backstop, not a wait we rely on.
    jax.config.update("jax_cross_host_transfer_timeout_seconds", 600)
  global _heartbeat_timeout_s
  _heartbeat_timeout_s = float(heartbeat_timeout_s)
  jax.config.update("jax_enable_recoverability", True)  # dead peers are reported, FaultWatch exits
  jax.config.update("jax_enable_preemption_service", False)  # else JAX takes SIGTERM as a preemption notice
  jax.distributed.initialize(coordinator_address, num_processes, process_id,
                             local_device_ids=list(local_device_ids) if local_device_ids else None,
                             initialization_timeout=initialization_timeout_s,
                             heartbeat_timeout_seconds=heartbeat_timeout_s, shutdown_timeout_seconds=10)
  return True


_heartbeat_timeout_s = 10.0  # initialize's: how long a dead peer takes to be noticed


def _client():
  return compat.coordination_client()


class KVStore:
  """String values under `prefix` in the coordination service (small facts only: kilobytes).

  Values are write-once unless `overwrite`; `get` blocks until the key exists or `timeout_s` passes
  (TimeoutError). A dead peer never leaves `get` hanging: `FaultWatch` ends the process first.
  """

  def __init__(self, prefix: str = "llamarl/"):
    self.prefix = prefix
    self._client = _client()

  def set(self, key: str, value: str, *, overwrite: bool = False) -> None:
    self._client.key_value_set(self.prefix + key, value, allow_overwrite=overwrite)

  def get(self, key: str, timeout_s: float) -> str:
    try:
      return self._client.blocking_key_value_get(self.prefix + key, max(int(timeout_s * 1000), 1))
    except Exception as e:  # the client raises XlaRuntimeError DEADLINE_EXCEEDED on a timeout
      if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower():
        raise TimeoutError(f"key {self.prefix + key!r} did not appear within {timeout_s:.0f} s") from e
      raise

  def delete(self, key: str) -> None:
    self._client.key_value_delete(self.prefix + key)

  def live_processes(self, process_ids: Sequence[int]) -> list[int]:
    """Those of `process_ids` whose heartbeat the coordination service still receives."""
    return list(self._client.get_live_nodes(list(process_ids)))

  def dir(self, key: str) -> list[tuple[str, str]]:
    """(full key, value) pairs of every key under `prefix + key` (a directory: end it with '/')."""
    return list(self._client.key_value_dir_get(self.prefix + key))

  def set_json(self, key: str, value: Any, **kw) -> None:
    self.set(key, json.dumps(value), **kw)

  def get_json(self, key: str, timeout_s: float) -> Any:
    return json.loads(self.get(key, timeout_s))

  def barrier(self, name: str, timeout_s: float, process_ids: Sequence[int] | None = None) -> None:
    """Wait until every process (or every one of `process_ids`) reached the barrier `name`."""
    ids = None if process_ids is None else sorted(process_ids)
    self._client.wait_at_barrier(self.prefix + name, max(int(timeout_s * 1000), 1), ids)


# --------------------------------------------------------------------------------------------------
# roles


TRAINER, GENERATOR, REWARD = "trainer", "generator", "reward"


@dataclasses.dataclass(frozen=True)
class Roles:
  """Process ids of each role (sorted). In one process, that process is in every role it has devices of.

  reward: the processes of the reward model's own mesh (`MeshConfig.reward_dp`), empty without one."""

  trainer: tuple[int, ...]
  generator: tuple[int, ...]
  reward: tuple[int, ...] = ()

  def _groups(self):
    return ((TRAINER, self.trainer), (GENERATOR, self.generator), (REWARD, self.reward))

  def of(self, process_id: int) -> str:
    roles = [r for r, ids in self._groups() if process_id in ids]
    return "+".join(roles) or "none"

  @property
  def trainer_leader(self) -> int:
    return self.trainer[0]

  @property
  def generator_leader(self) -> int:
    return self.generator[0]

  @property
  def reward_leader(self) -> int:
    return self.reward[0]

  def describe(self) -> str:
    return ", ".join(f"{p}={self.of(p)}" for p in sorted(set(self.trainer) | set(self.generator) | set(self.reward)))


def mesh_processes(mesh) -> tuple[int, ...]:
  return tuple(sorted({d.process_index for d in mesh.devices.flat}))


def derive_roles(trainer_mesh, generator_mesh, num_processes: int | None = None, reward_mesh=None) -> Roles:
  """The processes owning each mesh's devices (`reward_mesh`: the reward model's own, or None).
  Across processes a process must own devices of one role only and every process must own some; a
  clear error says which layout rule is broken."""
  n = jax.process_count() if num_processes is None else num_processes
  roles = Roles(mesh_processes(trainer_mesh), mesh_processes(generator_mesh),
                mesh_processes(reward_mesh) if reward_mesh is not None else ())
  if n == 1:
    return roles
  both = sorted(set(roles.trainer) & set(roles.generator))
  if both:
    raise ValueError(
        f"process(es) {both} own both trainer and generator devices (trainer processes {roles.trainer}, "
        f"generator processes {roles.generator}); across processes each process runs one role. Give each "
        "process a whole number of one mesh's devices (devices per process must divide trainer_fsdp*"
        "trainer_tp and generator_dp*generator_tp), and colocated=False")
  shared = sorted(set(roles.reward) & (set(roles.trainer) | set(roles.generator)))
  if shared:
    raise ValueError(
        f"process(es) {shared} own reward-model devices and trainer or generator devices (reward processes "
        f"{roles.reward}, trainer {roles.trainer}, generator {roles.generator}); across processes the reward "
        "model runs in processes of its own: devices per process must divide MeshConfig.reward_dp*reward_tp "
        "as well as the trainer's and the generator's device counts")
  idle = sorted(set(range(n)) - set(roles.trainer) - set(roles.generator) - set(roles.reward))
  if idle:
    used = sum(m.devices.size for m in (trainer_mesh, generator_mesh, reward_mesh) if m is not None)
    raise ValueError(f"process(es) {idle} own no trainer, generator or reward-model device: the meshes use "
                     f"{used} of the job's {len(jax.devices())} devices; start fewer processes or give them "
                     "fewer devices")
  return roles


# --------------------------------------------------------------------------------------------------
# shared fate


class FaultWatch:
  """Ends this process (exit EXIT_PEER_FAILED) soon after any other process raised or died.

  Two daemon threads: one reads the failures other processes published (`report`), one asks the
  coordination service which processes are alive (a barrier-like call among the live processes:
  a dead one drops out after the heartbeat timeout). `report(exc)` publishes this process's own
  failure first, so the others name it and its error. `stop()` before a clean shutdown.
  """

  def __init__(self, roles: Roles, *, poll_s: float = 0.25):
    self.roles = roles
    self.me = jax.process_index()
    self.n = jax.process_count()
    self.kv = KVStore("")
    self._stop = threading.Event()
    self._poll_s = poll_s
    self._threads = [threading.Thread(target=self._guard(self._watch_reports), name="fault-reports", daemon=True),
                     threading.Thread(target=self._guard(self._watch_alive), name="fault-alive", daemon=True)]

  def start(self) -> "FaultWatch":
    for t in self._threads:
      t.start()
    return self

  def name(self, process_id: int) -> str:
    return f"process {process_id} ({self.roles.of(process_id)})"

  def report(self, exc: BaseException) -> None:
    """Publish this process's failure (best effort: the store may be gone already)."""
    self._stop.set()
    message = f"{type(exc).__name__}: {str(exc)[:500]}"
    try:
      self.kv.set(f"{_FAILED}{self.me}", message, overwrite=True)
    except Exception:  # noqa: BLE001 - the coordinator is gone: the heartbeat path reports us
      pass

  def wait(self, seconds: float) -> None:
    """Give the watch threads `seconds` to find a failed peer (they end the process if they do)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(t.is_alive() for t in self._threads):
      time.sleep(self._poll_s)

  def stop(self) -> None:
    """From now on nothing ends this process (its threads may stay blocked in a call: daemons)."""
    self._stop.set()

  def _exit(self, message: str) -> None:
    if self._stop.is_set():  # a clean shutdown (or our own failure) is under way
      return
    print(f"\n[llamarl] {self.name(self.me)} stops: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    if self.me == 0:  # it hosts the store: let the others read the report before it goes
      time.sleep(8 * self._poll_s)
    os._exit(EXIT_PEER_FAILED)

  def _guard(self, loop):
    def run():
      try:
        loop()
      except Exception as e:  # noqa: BLE001 - the coordination service (process 0) is unreachable
        self._exit(f"lost the coordination service on {self.name(0)}: it died or exited "
                   f"({str(e).splitlines()[0][:200]})")
    return run

  def _watch_reports(self) -> None:
    while not self._stop.wait(self._poll_s):
      failed = [(int(k.rsplit("/", 1)[1]), v) for k, v in self.kv.dir(_FAILED)]
      others = [f for f in failed if f[0] != self.me]
      if others:
        pid, why = min(others)
        return self._exit(f"{self.name(pid)} failed: {why}")

  def _watch_alive(self) -> None:
    everyone = list(range(self.n))
    while not self._stop.wait(self._poll_s):
      dead = sorted(set(everyone) - set(self.kv.live_processes(everyone)))
      if dead:
        time.sleep(2 * self._poll_s)  # a process that failed on its own has published why: name that
        return self._exit(f"{', '.join(self.name(p) for p in dead)} died (no heartbeat: killed, crashed or hung)")


def finish(watch: FaultWatch | None, *, timeout_s: float = 24 * 3600.0) -> None:
  """Clean end of a multi-process run. Does not return on processes other than 0: they exit(0).

  Every process stops its watch (a peer leaving is no longer a failure) and meets the others at a
  barrier. Process 0 hosts the coordination service, so it leaves last: the others say they are
  leaving and exit at once; process 0 waits for all of them, then shuts the service down.
  """
  if watch is not None:
    watch.stop()
  kv = KVStore()
  kv.barrier("finished", timeout_s)
  me = jax.process_index()
  if me != 0:
    kv.set(f"left/{me}", "1")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
  for p in range(1, jax.process_count()):
    kv.get(f"left/{p}", 60.0)
  time.sleep(0.5)  # their last store call has returned before the service goes
  jax.distributed.shutdown()


def run_process(fn, roles: Roles):
  """Run `fn()` as this process's part of the job, sharing fate with the others.

  Prints this process's role line, watches the others (`FaultWatch`). If `fn` raises, the error is
  published (every other process exits within a poll, naming this one), its traceback printed, and
  this process exits 1. Otherwise `finish` (the clean end): returns fn's result on process 0 only.

  An error is often the consequence of a peer's death rather than a failure of its own: a transfer
  socket closes the moment the peer is killed, seconds before its heartbeats are missed. So before
  publishing, the error waits up to the heartbeat timeout (+ 2 s) for the watch to see a peer that
  failed first; if it does, this process exits EXIT_PEER_FAILED naming that peer (as if the watch had
  stopped it first), and the job's report names the real cause. A failure of its own is published
  that much later (12 s at the default 10 s heartbeat), still well inside the job's bound.
  """
  import traceback

  print(describe_process(roles), flush=True)
  watch = FaultWatch(roles).start()
  try:
    result = fn()
  except BaseException as e:  # noqa: BLE001 - reported to the other processes, then an exit
    traceback.print_exc()
    sys.stderr.flush()
    if not isinstance(e, KeyboardInterrupt):
      print(f"[llamarl] {watch.name(watch.me)}: {type(e).__name__}; waiting up to "
            f"{_heartbeat_timeout_s + 2:.0f} s for a peer that failed first", file=sys.stderr, flush=True)
      watch.wait(_heartbeat_timeout_s + 2.0)  # the watch ends this process (75) if a peer failed first
    watch.report(e)
    if jax.process_index() == 0:  # it hosts the store: the others read the report before it goes
      time.sleep(1.0)
    os._exit(1)
  finish(watch)
  return result


def describe_process(roles: Roles) -> str:
  me = jax.process_index()
  local = [d.id for d in jax.local_devices()]
  return (f"[llamarl] process {me}/{jax.process_count()} role={roles.of(me)} local devices {local}; "
          f"roles: {roles.describe()}")
