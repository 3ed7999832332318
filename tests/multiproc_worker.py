"""Worker processes for tests/test_multiprocess.py, started by scripts/launch_local.py (`--script`).

  --case transfer  3 processes x 2 CPU devices: the weight push (WeightPlan) and the row transfer
                   (RowPlan) between meshes of different sizes, every received value checked exactly:
                   A trainer 2 devices -> generator dp2 x tp2 on two processes (fan-out),
                   B trainer fsdp2 x tp2 on two processes -> generator tp2 on one (one replica sent),
                   C trainer fsdp2 -> generator dp2 (same size).
  --case lora      3 processes: LoRA's push (LoraPlan: the base when it changed, the adapters every time,
                   merged on the generator) over case A's meshes.
  --case lora_experts  the same for a tiny Qwen3-MoE with LoRA on every expert (and q); each
                   generator process also checks that its merged model's logits are the trainer's
                   unmerged forward's.
  --case reward_mesh  2 processes x 2 CPU devices: a reward model (--path) on a mesh over both
                   processes (data across them, tp inside each) scores rows; every process reads every
                   score, equal to the same model's on one local device.
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
  from llamarl_jax.parallel import to_host
  from llamarl_jax.transfer import RowPlan, WeightPlan

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


def lora_case(experts: bool = False) -> None:
  """`LoraPlan` over multiproc_worker's case A meshes (trainer: 2 devices of process 0; generator dp2 x
  tp2 over processes 1-2, one replica sent and fanned out), a 2-layer model's params and rank-4
  adapters: v0 carries the base, v1 only the adapters, v2 a changed base again. Each version must be
  the host's merge `w + 2 a @ b` (fp32: the same four-term sums, 1e-6 relative), and a push without
  the base must move exactly the adapters' bytes. experts: a Qwen3-MoE (4 experts, top-2) whose
  experts and q are adapted (per-expert `a` `[X, in, r]`, `b` `[X, r, out]`), and each version's
  merged model (layers unrolled, on this process's device) gives the logits of the trainer's scanned
  forward with the adapters unmerged on the host's base and adapters (fp32 order: 1e-5 on logits
  below 1)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from llamarl_jax import parallel
  from llamarl_jax.config import LoraConfig
  from llamarl_jax.model import lora as lora_lib
  from llamarl_jax.model.config import ModelConfig
  from llamarl_jax.model.llama import Llama, split_params
  from llamarl_jax.parallel import to_host
  from llamarl_jax.transfer import LoraPlan, WeightPlan

  config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, max_position_embeddings=64)
  lora = LoraConfig(rank=4, alpha=8.0)
  if experts:
    config = config.replace(model_type="qwen3_moe", head_dim=8, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=16)
    lora = lora.replace(targets=("q", "expert_gate", "expert_up", "expert_down"))
  d = jax.devices()
  tm, gm = parallel.make_mesh(d[0:2], fsdp=2, tp=1), parallel.make_mesh(d[2:6], data=2, tp=2)
  abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
  axes, shapes = parallel.logical_axes(abstract), split_params(abstract)[1]
  a_shapes, a_axes = lora_lib.adapter_shapes(config, lora), lora_lib.adapter_axes(axes, lora)
  rng = np.random.default_rng(0)
  weight_scale = 0.2 if experts else 1.0  # activations of a few units through the forward
  host_base = jax.tree.map(lambda s: (weight_scale * rng.standard_normal(s.shape)).astype(np.float32), shapes)
  host_adapters = [jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), a_shapes) for _ in range(3)]
  base_plan = WeightPlan(parallel.param_shardings(shapes, axes, gm), shapes, tm)
  adapter_plan = WeightPlan(parallel.param_shardings(a_shapes, a_axes, gm), a_shapes, tm)
  trainer = {}
  plan = LoraPlan(base_plan, adapter_plan, base=lambda: trainer["base"], lora_scale=lora_lib.scale(lora),
                  dtype=jnp.float32)
  if plan.is_trainer:
    trainer["base"] = jax.device_put(host_base, parallel.param_shardings(shapes, axes, tm))
  adapter_bytes = sum(int(np.prod(s.shape)) * 4 for s in jax.tree.leaves(a_shapes))
  base_bytes = sum(int(np.prod(s.shape)) * 4 for s in jax.tree.leaves(shapes))
  assert plan.nbytes == adapter_bytes and plan.base_bytes == base_bytes
  want_base = host_base
  for version in range(3):
    if plan.is_trainer:
      if version == 2:  # a warm start or a restore gives the trainer another base
        trainer["base"] = jax.tree.map(lambda x: x * 2, trainer["base"])
      plan.stage_base()
      with_base = plan.base_pending
      wire = plan.stage(jax.device_put(host_adapters[version], parallel.param_shardings(a_shapes, a_axes, tm)))
      assert with_base == (version != 1), (version, with_base)
      plan.send(wire)
      continue
    with_base = version != 1  # what the store mark says across processes (multiprocess.protocol)
    params = plan.finish(plan.send(None, with_base=with_base))
    if version == 2:
      want_base = jax.tree.map(lambda x: x * 2, host_base)
    assert plan.last_bytes == adapter_bytes + (base_bytes if with_base else 0), (version, plan.last_bytes)
    want = lora_lib.merge_adapters(want_base, host_adapters[version], lora_lib.scale(lora))
    got = to_host(params)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(g, np.asarray(w), rtol=1e-6, atol=1e-6)
    assert all(x.sharding == s for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(base_plan.gen_shardings)))
    if experts:
      _check_merged_forward(config, abstract, got, want_base, host_adapters[version], lora_lib.scale(lora))
    print(f"lora v{version} ok: {plan.last_bytes} bytes", flush=True)


def _check_merged_forward(config, abstract, merged, base, adapters, lora_scale) -> None:
  """The merged model's logits (`Llama`, layers unrolled) == the trainer's scanned forward over the
  base with the adapters unmerged (`scan_hidden_states`), on this process's first device."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from llamarl_jax.model.forward import lm_head_weight, prepare_params, scan_hidden_states
  from llamarl_jax.model.llama import merge_params, split_params

  graphdef = split_params(abstract)[0]
  tokens = jnp.asarray(np.random.default_rng(1).integers(1, config.vocab_size, (2, 10)), jnp.int32)
  lengths = jnp.asarray([10, 7], jnp.int32)
  mask = (jnp.arange(10)[None] < lengths[:, None]).astype(jnp.int32)
  with jax.default_device(jax.local_devices()[0]):
    generator = jax.jit(lambda p: merge_params(graphdef, p)(tokens, attention_mask=mask))(merged)

    def trainer(base, adapters):
      prepared = prepare_params(base, jnp.float32)
      hidden = scan_hidden_states(config, prepared, tokens, lengths, lora=prepare_params(adapters, jnp.float32),
                                  lora_scale=lora_scale)
      return hidden @ lm_head_weight(config, prepared)

    unmerged = jax.jit(trainer)(base, adapters)
    valid = np.asarray(mask, bool)
    got, want = np.asarray(generator)[valid], np.asarray(unmerged)[valid]
  assert np.abs(want).max() > 0.1, np.abs(want).max()
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def reward_mesh_case(path: str) -> None:
  import jax
  import numpy as np

  from llamarl_jax import parallel
  from llamarl_jax.rewards.reward_model import RewardModel

  mesh = parallel.make_mesh(jax.devices()[:4], data=2, tp=2)
  assert mesh.is_multi_process
  rng = np.random.default_rng(0)
  rows = [rng.integers(1, 60, size=n).tolist() for n in (3, 9, 17, 5, 12)]  # 5 rows: one chunk of 8, padded
  scores = RewardModel.from_pretrained(path, mesh=mesh).score_tokens(rows)
  local = RewardModel.from_pretrained(path).score_tokens(rows)  # this process's default device
  # tp 2 splits the projections' sums: fp32 reordered, ~1e-6
  np.testing.assert_allclose(scores, local, rtol=1e-5, atol=1e-5)
  assert np.ptp(scores) > 0.01, scores
  print(f"reward mesh ok: {np.round(scores, 4).tolist()}", flush=True)


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
  parser.add_argument("--case", choices=("transfer", "lora", "lora_experts", "reward_mesh", "fault"), required=True)
  parser.add_argument("--path", help="reward_mesh: the reward model's directory")
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
  if args.case in ("transfer", "lora", "lora_experts", "reward_mesh"):
    {"transfer": transfer_case, "lora": lora_case, "lora_experts": lambda: lora_case(experts=True),
     "reward_mesh": lambda: reward_mesh_case(args.path)}[args.case]()
    distributed.finish(None)
  else:
    fault_case(args.kill, args.consequence)


if __name__ == "__main__":
  main()
