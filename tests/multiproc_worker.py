"""Worker processes for tests/test_multiprocess.py, started by scripts/launch_local.py (`--script`).

  --case transfer  3 processes x 2 CPU devices: the weight push (WeightPlan) and the row transfer
                   (RowPlan) between meshes of different sizes, every received value checked exactly:
                   A trainer 2 devices -> generator dp2 x tp2 on two processes (fan-out),
                   B trainer fsdp2 x tp2 on two processes -> generator tp2 on one (one replica sent),
                   C trainer fsdp2 -> generator dp2 (same size).
  --case fault     3 processes: process 1 raises (or, with --kill, kills itself) after start-up; the
                   others must exit EXIT_PEER_FAILED naming it.
"""

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def transfer_case() -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  from llamarl_jax import parallel
  from llamarl_jax.transfer import RowPlan, WeightPlan, to_host

  d = jax.devices()
  rng = np.random.default_rng(0)
  host = {"w": rng.standard_normal((8, 12)).astype(np.float32), "v": rng.standard_normal((6,)).astype(np.float32)}
  rows = {"tok": np.arange(8 * 5, dtype=np.int32).reshape(8, 5), "adv": np.linspace(-1, 1, 8).astype(np.float32)}
  for name, t_dev, (fsdp, ttp), g_dev, (dp, gtp), expect in (
      ("A", d[0:2], (2, 1), d[2:6], (2, 2), (1, 2)), ("B", d[0:4], (2, 2), d[4:6], (1, 2), (1, 1)),
      ("C", d[0:2], (2, 1), d[2:4], (2, 1), (2, 1))):
    tm, gm = parallel.make_mesh(t_dev, fsdp=fsdp, tp=ttp), parallel.make_mesh(g_dev, data=dp, tp=gtp)
    tsh = {"w": NamedSharding(tm, P("fsdp", "tp")), "v": NamedSharding(tm, P())}
    gsh = {"w": NamedSharding(gm, P(None, "tp")), "v": NamedSharding(gm, P())}
    shapes = {k: jax.ShapeDtypeStruct(v.shape, jnp.bfloat16) for k, v in host.items()}
    plan = WeightPlan(gsh, shapes, tm, transform=lambda p: jax.tree.map(lambda x: x.astype(jnp.bfloat16), p))
    assert (plan.replicas_sent, plan.replica_copies) == expect, (name, plan.replicas_sent, plan.replica_copies)
    params = jax.device_put(host, tsh) if plan.is_trainer else None
    for version in range(2):
      out = plan.push(jax.tree.map(lambda x, v=version: x + v, params) if params is not None else None)
      if out is not None:
        got = to_host(out)
        for k in host:
          want = (host[k] + version).astype(jnp.bfloat16)  # the cast happens on the trainer: bf16 exactly
          assert got[k].dtype == want.dtype and np.array_equal(got[k], want), (name, k, version)
          assert out[k].sharding == gsh[k], (name, k, out[k].sharding)
        print(f"{name} weights v{version} ok", flush=True)
    dst = {"tok": parallel.batch_sharding(tm, 2), "adv": parallel.batch_sharding(tm, 1)}
    plan_rows = RowPlan({k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in rows.items()}, dst, gm)
    got = plan_rows.send(rows if plan_rows.is_sender else None)
    if got is not None:
      back = to_host(got)
      for k in rows:
        assert np.array_equal(back[k], rows[k]) and got[k].sharding == dst[k], (name, k)
      print(f"{name} rows ok ({len(plan_rows.chunks)} chunks)", flush=True)


def fault_case(kill: bool, consequence: bool = False) -> None:
  """Through `distributed.run_process`, as scripts/train.py runs every process of a job.

  consequence: process 0 raises too, 0.5 s after process 1 was killed (before its heartbeats are
  missed), as a trainer's receive does when the generator's socket closes.
  """
  import jax

  from llamarl_jax import distributed

  def work():
    if jax.process_index() == 1:
      time.sleep(1.0)
      if kill:
        os.kill(os.getpid(), signal.SIGKILL)
      raise ValueError("injected failure")
    if consequence and jax.process_index() == 0:
      time.sleep(1.5)
      raise ConnectionResetError("the peer closed the transfer socket")
    time.sleep(120)  # the watch ends this process long before
    print("still running: the failure was not noticed", flush=True)

  distributed.run_process(work, distributed.Roles((0,), (1, 2)))


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--case", choices=("transfer", "fault"), required=True)
  parser.add_argument("--kill", action="store_true")
  parser.add_argument("--consequence", action="store_true")
  parser.add_argument("--coordinator_address")
  parser.add_argument("--num_processes", type=int)
  parser.add_argument("--process_id", type=int)
  parser.add_argument("--transfer_address")
  parser.add_argument("--heartbeat_timeout_s", type=int, default=5)
  args = parser.parse_args()

  from llamarl_jax import distributed

  distributed.initialize(args.coordinator_address, args.num_processes, args.process_id, cpu_devices=2,
                         transfer_address=args.transfer_address, heartbeat_timeout_s=args.heartbeat_timeout_s)
  if args.case == "transfer":
    transfer_case()
    distributed.finish(None)
  else:
    fault_case(args.kill, args.consequence)


if __name__ == "__main__":
  main()
