"""The grouped GEMM's tile kernels (`model.grouped_gemm`, Pallas interpret mode on the CPU) equal
`jax.lax.ragged_dot`: values and both gradients, fp32 to summation order and bf16 to bf16 rounding, with
empty groups, groups that are not multiples of the tile, and rows past the groups' sum."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llamarl_jax.model import grouped_gemm as gg
from llamarl_jax.model import moe

BLOCKS = dict(block_m=8, block_n=16, block_k=16, interpret=True)  # several tiles of each kind at these sizes
M, K, N = 64, 32, 48  # N: three column tiles; K: two contraction steps
SIZES = {
    "uneven, an empty group, rows past the sum": [7, 0, 20, 3, 15, 0],
    "multiples of the tile": [8, 16, 0, 24, 8, 8],
    "one group takes every row": [0, 0, 64, 0, 0, 0],
    "no rows in any group": [0, 0, 0, 0, 0, 0],
}
HIGHEST = jax.lax.Precision.HIGHEST


def _operands(dtype, seed=0):
  rng = np.random.RandomState(seed)
  lhs, ct = (jnp.asarray(rng.normal(size=s), dtype) for s in ((M, K), (M, N)))
  rhs = jnp.asarray(rng.normal(size=(6, K, N)) / np.sqrt(K), dtype)
  return lhs, rhs, ct


def _both(lhs, rhs, ct, sizes):
  """(value, d lhs, d rhs) of the kernels and of ragged_dot, for cotangent ct."""
  sizes = jnp.asarray(sizes, jnp.int32)
  mine = lambda a, b: gg.grouped_gemm(a, b, sizes, **BLOCKS)
  ref = lambda a, b: jax.lax.ragged_dot(a, b, sizes, precision=HIGHEST)
  out = []
  for fn in (mine, ref):
    y, vjp = jax.vjp(fn, lhs, rhs)
    out.append([np.asarray(a.astype(jnp.float32)) for a in (y, *vjp(ct))])
  return out


@pytest.mark.parametrize("case", list(SIZES))
def test_fp32_values_and_gradients_equal_ragged_dot(case):
  """fp32: equal to summation order (the kernels add K in steps of 16, the rows of a group in tiles of
  8): 1e-5 of the largest magnitude."""
  got, want = _both(*_operands(jnp.float32), SIZES[case])
  for name, g, w in zip(("value", "d lhs", "d rhs"), got, want):
    np.testing.assert_allclose(g, w, atol=1e-5 * max(1.0, np.abs(w).max()), rtol=0, err_msg=name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_an_fp8_matrix_is_read_as_fp8_and_gives_the_widened_matrixs_product(dtype):
  """An fp8 rhs goes into the kernel as fp8 (no widened copy of it outside), and each tile's widening
  is exact: bit for bit the product of the same kernel on rhs widened first."""
  lhs, rhs, _ = _operands(dtype)
  sizes = jnp.asarray(SIZES["uneven, an empty group, rows past the sum"], jnp.int32)
  q = rhs.astype(jnp.float8_e4m3fn)
  got = gg.grouped_gemm(lhs, q, sizes, **BLOCKS)
  want = gg.grouped_gemm(lhs, q.astype(dtype), sizes, **BLOCKS)
  np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
  jaxpr = str(jax.make_jaxpr(lambda l, r: gg.grouped_gemm(l, r, sizes, **BLOCKS))(lhs, q))
  assert f"{jnp.dtype(dtype).name.replace('float', 'f')}[6,32,48]" not in jaxpr  # f32 / bf16: no widened copy
  with pytest.raises(ValueError, match="cast rhs"):
    gg.grouped_gemm(lhs, rhs.astype(jnp.float16), sizes, **BLOCKS)


def test_rows_outside_every_group_get_zero_value_and_zero_gradient():
  got, _ = _both(*_operands(jnp.float32), SIZES["uneven, an empty group, rows past the sum"])
  value, d_lhs, d_rhs = got
  assert not value[45:].any() and not d_lhs[45:].any()
  assert not d_rhs[1].any() and not d_rhs[5].any()  # the empty groups' matrices


def test_bf16_values_and_gradients_equal_ragged_dot_to_bf16_rounding():
  """bf16 operands, fp32 accumulation in both, one rounding to bf16 at the end: each element within one
  bf16 ulp of the fp32-accumulated reference's magnitude (2^-8 relative), plus fp32 summation order."""
  lhs, rhs, ct = _operands(jnp.bfloat16, seed=1)
  got, want = _both(lhs, rhs, ct, SIZES["uneven, an empty group, rows past the sum"])
  for name, g, w in zip(("value", "d lhs", "d rhs"), got, want):
    np.testing.assert_allclose(g, w, rtol=2.0 ** -8, atol=1e-5 * np.abs(w).max(), err_msg=name)


def test_tile_plan_pads_each_group_to_the_tile_and_bounds_the_tiles():
  sizes = jnp.asarray([7, 0, 20, 3], jnp.int32)
  tile_group, first, count, dst, src = gg.tile_plan(sizes, 32, block_m=8)
  T = gg.num_tiles(32, 4, 8)
  assert T == 4 + 3 and tile_group.shape == (T,) and src.shape == (T * 8,)
  assert count.tolist() == [1, 0, 3, 1] and first.tolist() == [0, 1, 1, 4]
  assert tile_group.tolist() == [0, 2, 2, 2, 3, 4, 4]  # 4: unused tiles
  assert dst.tolist()[:8] == [0, 1, 2, 3, 4, 5, 6, 8] and dst.tolist()[30:] == [T * 8] * 2  # rows 30, 31: no group
  assert np.all(np.asarray(src)[np.asarray(dst)[:30]] == np.arange(30))


def test_kernel_flops_at_qwen3_30b_a3b_shapes_are_within_1_25x_of_the_routed_flops():
  """4096 tokens x top-8 = 32768 rows over 128 experts in tiles of 64: T = 512 + 127 tiles."""
  rows, X, E, F = 32768, 128, 2048, 768
  f = gg.kernel_flops(rows, X, E, F)
  routed = 2 * rows * E * F
  assert f["forward"] / routed == (512 + 127) / 512 < 1.25 and f["backward"] == 2 * f["forward"]


def test_moe_layer_by_the_pallas_grouped_gemm_equals_ragged_dots():
  """`moe.grouped_swiglu(..., grouped_gemm='pallas')` (interpret mode here) against the default
  (ragged_dot) on a small layer, fp32: value and gradients."""
  rng = np.random.RandomState(2)
  T, E, F, X, k = 12, 32, 16, 4, 2
  x = jnp.asarray(rng.normal(size=(T, E)), jnp.float32)
  experts = jnp.asarray(np.stack([rng.choice(X, k, replace=False) for _ in range(T)]), jnp.int32)
  weights = jax.nn.softmax(jnp.asarray(rng.normal(size=(T, k)), jnp.float32), -1)
  w = [jnp.asarray(rng.normal(size=s) / np.sqrt(s[1]), jnp.float32) for s in ((X, E, F), (X, E, F), (X, F, E))]

  def loss(x, w, impl):
    with jax.default_matmul_precision("highest"):
      return jnp.sum(moe.grouped_swiglu(x, experts, weights, (w[0], w[1]), w[2], grouped_gemm=impl) ** 2)

  got = jax.value_and_grad(loss, argnums=(0, 1))(x, w, "pallas")
  want = jax.value_and_grad(loss, argnums=(0, 1))(x, w, "ragged_dot")
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5 * float(np.abs(r).max()))


def test_auto_is_ragged_dot_until_the_kernels_pass_on_a_gpu():
  assert moe.GROUPED_GEMM_IMPLEMENTATIONS == ("ragged_dot", "pallas")
  assert moe.resolve_grouped_gemm("auto", "cpu") == "ragged_dot"
  from llamarl_jax import gpu_paths
  expect = "pallas" if gpu_paths.passed("moe_grouped_gemm", "pallas") else "ragged_dot"
  assert moe.resolve_grouped_gemm("auto", "gpu") == expect
  assert moe.resolve_grouped_gemm("pallas", "cpu") == "pallas"  # by name: opt-in anywhere
  with pytest.raises(ValueError, match="grouped_gemm must be"):
    moe.resolve_grouped_gemm("triton")


def _tiny_moe():
  from test_moe import moe_params, tiny_moe_config

  config = tiny_moe_config()
  return config, moe_params(config)


@pytest.mark.devices(4)
@pytest.mark.slow  # the interpreted kernels in 6 training steps: ~1 min on 2 cores
def test_the_trainers_setting_picks_its_grouped_gemm():
  """`TrainConfig.moe_grouped_gemm` (`TrainerExecutor(grouped_gemm=)`) reaches the trainer's step:
  'pallas' (interpreted here) gives ragged_dot's training steps (losses, gradient norms, params: fp32,
  1e-5) on one device and on fsdp 4, where each device plans its own rows' tiles inside a shard_map;
  'auto' on the CPU is ragged_dot."""
  from test_trainer import LOSS_KW, OPT, rows_batch

  from llamarl_jax import parallel
  from llamarl_jax.executors.trainer import TrainerExecutor

  config, params = _tiny_moe()
  rng = np.random.RandomState(1)
  batch = rows_batch(rng, rng.randint(1, 7, 4), np.r_[8, rng.randint(1, 9, 3)], 6, 8)
  one, fsdp = parallel.make_mesh(jax.devices()[:1]), parallel.make_mesh(jax.devices()[:4], fsdp=4)
  runs = {}
  for name, impl, mesh in (("auto", "auto", one), ("pallas", "pallas", one), ("pallas fsdp", "pallas", fsdp)):
    trainer = TrainerExecutor(config, mesh, params, optimizer=OPT, loss_kwargs=LOSS_KW, grouped_gemm=impl)
    runs[name] = ([trainer.step(batch) for _ in range(2)], jax.device_get(trainer.params))
    assert trainer.config.grouped_gemm == ("ragged_dot" if impl == "auto" else impl)
  for name in ("pallas", "pallas fsdp"):
    for a, b in zip(runs["auto"][0], runs[name][0]):
      for key in ("loss/total", "train/grad_norm"):
        np.testing.assert_allclose(b[key], a[key], rtol=1e-5, err_msg=f"{name} {key}")
    for a, b in zip(jax.tree.leaves(runs["auto"][1]), jax.tree.leaves(runs[name][1])):
      np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=0, err_msg=name)


def test_the_generators_setting_picks_its_grouped_gemm():
  """`GeneratorConfig.moe_grouped_gemm` reaches the generator's forwards: 'pallas' puts the tile kernels
  in the MoE layers' programs (ragged_dot does not) and samples ragged_dot's greedy tokens, routing and
  log-probs (fp32, 1e-5); 'auto' on the CPU is ragged_dot; a bad value of either role's is refused."""
  from llamarl_jax import build, parallel
  from llamarl_jax.config import ConfigError, run_config
  from llamarl_jax.generation.sampler import SamplingParams
  from llamarl_jax.model.llama import MoE

  config, params = _tiny_moe()
  mesh = parallel.make_mesh(jax.devices()[:1])

  class Tokenizer:
    pad_token_id, eos_token_id = 0, None

  prompts = [[3, 5, 7], [11, 2], [9, 9, 9, 4]]
  sampling = SamplingParams(temperature=0.0, max_new_tokens=5)
  out = {}
  for impl in ("auto", "pallas"):
    sampler = build.sampler(config, run_config(generator_moe_grouped_gemm=impl), mesh, Tokenizer())
    assert sampler.config.grouped_gemm == ("ragged_dot" if impl == "auto" else impl)
    out[impl] = sampler.generate(params, prompts, sampling)
  np.testing.assert_array_equal(out["pallas"].response_tokens, out["auto"].response_tokens)
  np.testing.assert_array_equal(out["pallas"].routing, out["auto"].routing)
  np.testing.assert_allclose(out["pallas"].behaviour_logprobs, out["auto"].behaviour_logprobs, rtol=0, atol=1e-5)

  for impl, kernel in (("pallas", True), ("ragged_dot", False)):
    layer = MoE(config.replace(grouped_gemm=impl), nnx.Rngs(0))
    jaxpr = str(jax.make_jaxpr(lambda x: layer(x)[0])(jnp.ones((1, 4, config.hidden_size))))
    assert ("pallas_call" in jaxpr) == kernel, impl

  for key in ("moe_grouped_gemm", "generator_moe_grouped_gemm"):
    with pytest.raises(ConfigError, match="moe_grouped_gemm"):
      run_config(**{key: "triton"})


@pytest.mark.devices(4)
def test_inside_a_shard_map_each_devices_rows_give_ragged_dots_values_and_gradients():
  """Each of 4 devices' rows and group sizes (varying over the axis) times replicated matrices, under
  shard_map's varying-axis checks: the kernels' operands are made to vary alike, and the matrices'
  gradient is the sum of the devices' (fp32, to summation order)."""
  from jax.sharding import Mesh, PartitionSpec as P

  mesh = Mesh(np.array(jax.devices()[:4]), ("fsdp",))
  rng = np.random.RandomState(3)
  lhs = jnp.asarray(rng.normal(size=(4 * M, K)), jnp.float32)
  rhs = jnp.asarray(rng.normal(size=(3, K, N)) / np.sqrt(K), jnp.float32)
  sizes = jnp.asarray([10, 0, 15, 64, 0, 0, 0, 7, 7, 20, 20, 20], jnp.int32)  # 3 groups per device

  def loss(lhs, rhs):
    body = lambda l, r, s: gg.grouped_gemm(l, r, s, **BLOCKS)
    out = jax.shard_map(body, mesh=mesh, in_specs=(P("fsdp"), P(), P("fsdp")), out_specs=P("fsdp"))(lhs, rhs, sizes)
    return jnp.sum(out ** 2)

  def reference(lhs, rhs):
    parts = [jax.lax.ragged_dot(lhs[i * M:(i + 1) * M], rhs, sizes[3 * i:3 * i + 3], precision=HIGHEST)
             for i in range(4)]
    return jnp.sum(jnp.concatenate(parts) ** 2)

  got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(lhs, rhs)
  want = jax.value_and_grad(reference, argnums=(0, 1))(lhs, rhs)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5 * float(np.abs(r).max()))
