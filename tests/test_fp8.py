"""The fp8 generator: float8_e4m3fn projections with per-output-channel scales, per-token fp8
activations, and behaviour log-probs that are the fp8 policy's own.

A tiny random Llama (vocab 67, 2 layers, fp32 compute so that the only precision change is fp8's).
Tolerances:
- `fp8.dense` against a float64 numpy product of the de-quantised operands (x's fp8 values times
  its row scales, w's fp8 values times its column scales): the operands are exact in fp32 (e4m3
  has 4 significant bits), so they differ only by fp32 accumulation over K = 64 terms, < 1e-6
  relative to the sum of |terms|; asserted at 2e-6 of that sum.
- behaviour log-probs against a teacher-forced full forward of the same fp8 weights: both quantise
  each token's activations alone (per-token scales), so they agree as fp32 decode and full forward
  do (1e-4, as test_sampler: summation order ~1e-6), unless an activation lies within that rounding
  noise of an fp8 rounding boundary; measured here: at most 5.5e-7.
- against the unquantised policy they differ (over the whole vocabulary at temperature 0.8): e4m3's
  4 significant bits per weight and activation move a token's log-prob by 0.075 nats on average on
  this 32-wide model, 0.29 at most (measured); asserted > 1e-2 and < 1 nat at the largest token.
- the fp8 lm_head (`quantize='fp8+lm_head'`, tied embeddings as Llama-3.2-1B's): behaviour log-probs against
  the teacher-forced fp8 trunk's final hidden states quantised per row (ml_dtypes' e4m3 rounding)
  times the de-quantised lm_head in float64: the hidden states agree with decode's as above, the
  32-term product differs by fp32 accumulation (~1e-7 relative), so 1e-4 as above (measured: at most
  3.2e-7). Against the fp8 policy with the lm_head in the generator dtype they differ by the head's
  own rounding: 0.013 nats at most, 0.003 on average over the whole vocabulary (small: the embedding's
  init std 0.02 gives small logits), against ~1e-6 for two computations of one head; asserted
  > 1e-3 and < 1 nat.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from llamarl_jax import parallel
from llamarl_jax.config import ConfigError, GeneratorConfig, LoraConfig, RunConfig, TrainConfig
from llamarl_jax.executors.weight_sync import WeightSync
from llamarl_jax.generation import Sampler, SamplingParams
from llamarl_jax.generation.engine import SlotEngine, rollout_from_groups
from llamarl_jax.model import fp8, lora as lora_lib
from llamarl_jax.model.config import WeightLayout
from llamarl_jax.model.llama import abstract_model, merge_params, split_params
from llamarl_jax.model.serving import serving_params
from sequence_layout import sequence_layout
from test_sampler import R, full_forward_logits, intended_logprobs
from test_serving import random_params, tiny

CONFIG = tiny()
TIED = tiny(tie_word_embeddings=True)  # the fp8 lm_head's case: a copy of the embedding for the logits
SAMPLED = SamplingParams(temperature=0.8, top_k=20, max_new_tokens=R, n=2, seed=5)
FUSED_FP8 = WeightLayout(fused_qkv=True, fused_mlp=True, quantize="fp8")


def assert_same_samples(batch, static) -> None:
  """The slot engine's rollouts are the static sampler's: the same tokens, lengths and finish reasons,
  behaviour log-probs within 1e-5 (fp32 summation order)."""
  for name in ("response_tokens", "lengths", "finish_reason"):
    np.testing.assert_array_equal(getattr(batch, name), np.asarray(getattr(static, name)), err_msg=name)
  np.testing.assert_allclose(batch.behaviour_logprobs, static.behaviour_logprobs, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def params():
  return random_params(CONFIG)


def perturbed(params):
  """The weights perturbed by 20% multiplicative noise."""
  rng = np.random.RandomState(1)
  return jax.tree.map(lambda x: jnp.asarray(np.asarray(x) * (1 + 0.2 * rng.randn(*x.shape)), x.dtype), params)


@pytest.fixture(scope="module")
def params_b(params):
  """Version 1."""
  return perturbed(params)


@pytest.fixture(scope="module")
def tied_params():
  return random_params(TIED)


@pytest.fixture(scope="module")
def head_sampler():
  """fp8 projections and an fp8 lm_head, tied embeddings."""
  return Sampler(TIED, quantize="fp8+lm_head", batch_multiple=8)


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.RandomState(0)
  return [rng.randint(3, 67, n).tolist() for n in (5, 9, 3)]


@pytest.fixture(scope="module")
def sampler():
  return Sampler(CONFIG, quantize="fp8", batch_multiple=8)


def fp8_model(sampler, params):
  """The fp8 serving model the sampler computes with, for a teacher-forced forward."""
  return merge_params(sampler.graphdef, sampler.place_params(params))


def token_logprobs(model, batch, sampling=SAMPLED):
  lp = intended_logprobs(full_forward_logits(model, batch), sampling.temperature, sampling.top_k, sampling.top_p)
  return np.take_along_axis(lp, np.asarray(batch.response_tokens)[..., None], -1)[..., 0]


# -- the arithmetic ------------------------------------------------------------------------------


def test_quantize_weight_per_output_channel_on_a_known_matrix():
  """Column maxima 2 and 0.5 -> scales 2/448, 0.5/448; 1.0 / (2/448) = 224 and 0.25 / (0.5/448) = 224
  are e4m3 values (exact), -0.3 / (0.5/448) = -268.8 rounds to -256 (e4m3 step 32 in [256, 448])."""
  w = jnp.array([[1.0, -0.3], [-2.0, 0.25], [0.0, 0.5]])
  q, scale = fp8.quantize_weight(w, 1)
  assert q.dtype == fp8.FP8 and scale.shape == (2,)
  np.testing.assert_allclose(np.asarray(scale), [2.0 / 448, 0.5 / 448], rtol=1e-7)
  np.testing.assert_array_equal(np.asarray(q, np.float32), [[224, -256], [-448, 224], [0, 448]])
  zero_q, zero_scale = fp8.quantize_weight(jnp.zeros((3, 2, 2)), 2)  # an all-zero channel: scale 1, values 0
  assert zero_scale.shape == (2,) and np.all(np.asarray(zero_scale) == 1) and not np.asarray(zero_q, np.float32).any()


def test_dense_is_the_product_of_the_dequantised_operands():
  """x quantised per row, w per column: `dense` = (q(x) * sx) @ (q(w) * sw), against float64 numpy
  (ml_dtypes' e4m3 rounding, independent of XLA's)."""
  rng = np.random.RandomState(0)
  x = (rng.randn(3, 5, 64) * np.exp(rng.randn(3, 5, 1))).astype(np.float32)  # rows of different magnitudes
  w = rng.randn(64, 4, 6).astype(np.float32)
  q, s = fp8.quantize_weight(jnp.asarray(w), 1)
  got = np.asarray(fp8.dense(jnp.asarray(x), q, s))
  sx = np.abs(x).max(-1, keepdims=True) / 448
  xq = (x / sx).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * sx
  wq = np.asarray(q, np.float32).astype(np.float64) * np.asarray(s, np.float64)
  want = np.einsum("btk,kod->btod", xq, wq)
  bound = np.einsum("btk,kod->btod", np.abs(xq), np.abs(wq))
  assert got.shape == (3, 5, 4, 6) and got.dtype == np.float32
  assert np.all(np.abs(got - want) <= 2e-6 * bound)
  # and it is the unquantised product up to fp8 rounding (4 significant bits per operand)
  exact = np.einsum("btk,kod->btod", x.astype(np.float64), w.astype(np.float64))
  assert 1e-3 < np.abs(got - exact).max() / bound.max() < 0.1


def test_quantising_commutes_with_the_serving_fusion(params):
  """Per output channel: quantising the trainer's layout and fusing (what crosses the wire, then the
  sampler) gives bit for bit the fused layout quantised (`serving_params` with fp8)."""
  wire_then_fuse = serving_params(fp8.quantize_params(params), FUSED_FP8)
  fuse_then_quantise = fp8.quantize_params(serving_params(params, WeightLayout(fused_qkv=True, fused_mlp=True)))
  assert jax.tree.structure(wire_then_fuse) == jax.tree.structure(fuse_then_quantise)
  for a, b in zip(jax.tree.leaves(wire_then_fuse), jax.tree.leaves(fuse_then_quantise)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  layer = wire_then_fuse["layers"][0]
  assert layer["attn"]["wqkv"].dtype == fp8.FP8 and layer["attn"]["wqkv_scale"].shape == (2, 4, 8)
  assert layer["mlp"]["w_gate_up_scale"].shape == (2, 64) and wire_then_fuse["embed"].dtype == jnp.float32
  # the de-quantised weights are the originals within half an e4m3 step: 2^-4 relative, or the
  # subnormal step's half (2^-10 of the scale) near 0
  back = fp8.dequantize_params(fp8.quantize_params(params))
  for i in params["layers"]:
    for m, name, n_in in fp8.projections(params["layers"][i]):
      w, d = np.asarray(params["layers"][i][m][name]), np.asarray(back["layers"][i][m][name])
      scale = np.abs(w).max(axis=tuple(range(n_in))) / 448
      assert np.all(np.abs(d - w) <= np.maximum(2.0**-4 * np.abs(w), 2.0**-10 * scale) * (1 + 1e-6))


# -- the policy that samples is the policy that is scored -------------------------------------------


def test_behaviour_logprobs_are_the_fp8_policys_own(sampler, params, prompts):
  batch = sampler.generate(params, prompts, SAMPLED)
  assert np.asarray(batch.response_mask).all()
  own = token_logprobs(fp8_model(sampler, params), batch)
  np.testing.assert_allclose(batch.behaviour_logprobs, own, atol=1e-4, rtol=0)
  # the gap to the unquantised policy, over the whole vocabulary (a token may leave its top-k)
  whole = SamplingParams(temperature=SAMPLED.temperature)
  unquantised = token_logprobs(merge_params(split_params(abstract_model(CONFIG))[0], params), batch, whole)
  gap = np.abs(token_logprobs(fp8_model(sampler, params), batch, whole) - unquantised)
  assert 1e-2 < gap.max() < 1.0, gap.max()


@pytest.mark.slow
@pytest.mark.parametrize("lm_head", [False, True], ids=["dtype_head", "fp8_head"])
def test_the_slot_engine_samples_what_the_fp8_sampler_samples(lm_head, request, prompts):
  """Same seed and rows: the fp8 engine's tokens and log-probs are the static fp8 sampler's; with an
  in-flight swap (KV recomputed) every token is the full forward of its own version's fp8 weights.
  The program set stays the engine's (at most 8 programs). fp8_head: the fp8 lm_head (tied
  embeddings), version 1 arriving with its head quantised on the trainer."""
  config = TIED if lm_head else CONFIG
  sampler = request.getfixturevalue("head_sampler" if lm_head else "sampler")
  params = request.getfixturevalue("tied_params" if lm_head else "params")
  params_b = perturbed(params) if lm_head else request.getfixturevalue("params_b")
  eng = SlotEngine(config, lanes=4, sampling=SAMPLED, max_prompt_len=16, chunk_steps=3, max_insert=2,
                   kv_block_size=4, quantize="fp8+lm_head" if lm_head else "fp8")
  assert eng.sampler.layout.fp8 and eng.sampler.layout.fp8_lm_head == lm_head and eng.programs.num_compiled <= 8
  static = sampler.generate(params, prompts, SAMPLED)
  batch = eng.generate(params, prompts, SAMPLED)
  assert_same_samples(batch, static)

  # version 1 arrives quantised, as a push delivers it
  wire = jax.jit(lambda p: fp8.quantize_params(p, lm_head=lm_head))(params_b)
  eng.swap(params, 0)
  eng.submit(prompts[:2], seed=5)
  groups = eng.step()
  eng.swap(wire, 1, recompute_kv=True)
  groups += eng.run()
  assert eng.take_metrics()["generate/swaps_in_flight"] == 1
  batch = rollout_from_groups(sorted(groups, key=lambda g: g.tag), prompt_width=16)
  mask = batch.response_mask > 0
  pre = mask & (np.arange(R) < 1 + eng.chunk_steps)
  np.testing.assert_array_equal(batch.token_versions[mask], np.where(pre, 0, 1)[mask])
  assert (mask & ~pre).sum() >= 8, "too few tokens after the swap to test"
  lp_a = token_logprobs(fp8_model(sampler, params), batch)
  lp_b = token_logprobs(fp8_model(sampler, wire), batch)
  np.testing.assert_allclose(batch.behaviour_logprobs[mask], np.where(pre, lp_a, lp_b)[mask], atol=1e-4, rtol=0)
  assert np.abs(lp_a - lp_b)[mask & ~pre].max() > 1e-2  # the versions really differ


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_the_fused_fp8_decode_samples_what_the_fp8_sampler_samples(model_type, sampler, params, prompts):
  """The paged decode step with the fused Pallas attention and fp8 weights makes each fp8 GEMM's input in
  one kernel (`Block.decode_fp8`, `fp8_kernels`; Pallas interpret mode here), the attention kernel
  reading q from the Q/K/V GEMM's output (with Qwen2's bias; Qwen3's q/k norms: q given): the
  static fp8 sampler's tokens and log-probs (1e-5: fp32 summation order, as the unfused engine).
  Qwen3 here with tied embeddings and the fp8 lm_head ('fp8+lm_head') after the fused layers."""
  from llamarl_jax.model.paged_attention import target_platform
  head = model_type == "qwen3"
  quantize = "fp8+lm_head" if head else "fp8"
  config = CONFIG if model_type == "llama" else tiny(model_type, tie_word_embeddings=head)
  if model_type != "llama":
    params = random_params(config)
    sampler = Sampler(config, quantize=quantize, batch_multiple=8)
  eng = SlotEngine(config, lanes=4, sampling=SAMPLED, max_prompt_len=16, chunk_steps=3, max_insert=2,
                   kv_block_size=4, quantize=quantize, paged_attention="pallas_fused")
  assert eng.sampler.layout.fp8_lm_head == head
  with target_platform("cpu", "pallas_fused"):
    assert abstract_model(config, eng.sampler.layout).fused_fp8_decode()
  with target_platform("cpu", "pallas"):  # the read-only kernel: XLA's quantise ops around it
    assert not abstract_model(config, eng.sampler.layout).fused_fp8_decode()
  with target_platform("cpu", "dot"):
    assert not abstract_model(config, eng.sampler.layout).fused_fp8_decode()
  static = sampler.generate(params, prompts, SAMPLED)
  batch = eng.generate(params, prompts, SAMPLED)
  assert_same_samples(batch, static)


@pytest.mark.devices(4)
@pytest.mark.slow
def test_lora_push_merges_then_quantises_on_the_generator(params, prompts):
  """A LoRA push moves the fp32 adapters; the generator merges them into its base and quantises the
  merged weights, the (untied) lm_head too ('fp8+lm_head'), in one program on its devices:
  exactly `quantize_params(merge_adapters(...), lm_head=True)`, and the sampler's log-probs are that
  fp8 policy's."""
  lora = LoraConfig(rank=4, alpha=8.0)
  trainer_mesh, gen_mesh = parallel.make_meshes(trainer_fsdp=2, generator_dp=2)
  abstract = abstract_model(CONFIG)
  axes = parallel.logical_axes(abstract)
  adapters = jax.tree.map(lambda s: 0.05 * np.random.RandomState(s.size % 97).randn(*s.shape).astype(np.float32),
                          lora_lib.adapter_shapes(CONFIG, lora))
  sync = WeightSync(parallel.param_shardings(split_params(abstract)[1], axes, gen_mesh), dtype=jnp.float32,
                    quantize="fp8+lm_head", lora_scale=lora_lib.scale(lora), base=lambda: params,
                    adapter_shardings=parallel.param_shardings(lora_lib.adapter_shapes(CONFIG, lora),
                                                               lora_lib.adapter_axes(axes, lora), gen_mesh))
  metrics = sync.push(jax.device_put(adapters, parallel.param_shardings(adapters, lora_lib.adapter_axes(axes, lora),
                                                                        trainer_mesh)), 1)
  assert metrics["sync/bytes"] == sum(x.nbytes for x in jax.tree.leaves(adapters))  # fp32 adapters only
  got = sync.latest()[0]
  want = fp8.quantize_params(lora_lib.merge_adapters(params, adapters, lora_lib.scale(lora), jnp.float32), lm_head=True)
  assert got["lm_head"].dtype == fp8.FP8 and got["lm_head_scale"].shape == (CONFIG.vocab_size,)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.dtype == b.dtype and a.sharding.mesh == gen_mesh
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  sampler = Sampler(CONFIG, gen_mesh, quantize="fp8+lm_head")
  batch = sampler.generate(got, prompts, SAMPLED)
  np.testing.assert_allclose(batch.behaviour_logprobs, token_logprobs(fp8_model(sampler, want), batch),
                             atol=1e-4, rtol=0)


def test_behaviour_logprobs_with_the_fp8_lm_head_are_that_heads_own(head_sampler, tied_params, prompts):
  """The fp8 lm_head: a float8_e4m3fn copy of the tied embedding with a scale per vocabulary row,
  the logits an fp8 GEMM of the per-row quantised hidden states; the lookup still reads the embedding
  in the generator dtype. The behaviour log-probs are that policy's, and not the dtype head's."""
  placed = head_sampler.place_params(tied_params)
  np.testing.assert_array_equal(placed["embed"], tied_params["embed"])  # the lookup's table, as it was
  values, scale = np.asarray(placed["lm_head"], np.float32), np.asarray(placed["lm_head_scale"])
  assert placed["lm_head"].dtype == fp8.FP8 and values.shape == (32, 67) and scale.shape == (67,)
  head = values.astype(np.float64) * scale  # the de-quantised head: the embedding within half an e4m3 step
  table = np.asarray(tied_params["embed"], np.float64).T
  assert np.all(np.abs(head - table) <= np.maximum(2.0**-4 * np.abs(table), 2.0**-10 * scale) * (1 + 1e-6))
  np.testing.assert_allclose(fp8.dequantize_params(placed)["lm_head"], head, rtol=1e-6)

  batch = head_sampler.generate(tied_params, prompts, SAMPLED)
  model = merge_params(head_sampler.graphdef, placed)
  tokens, positions, mask = sequence_layout(batch.prompt_tokens, batch.prompt_mask, batch.response_tokens,
                                            batch.response_mask)
  Pb = batch.prompt_tokens.shape[1]
  x = np.asarray(model.hidden_states(tokens, positions, attention_mask=mask)[0])[:, Pb - 1:Pb - 1 + R]
  sx = np.abs(x).max(-1, keepdims=True) / np.float32(448)  # fp32, as `fp8.quantize_rows`
  xq = (x / sx).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * sx
  logits = xq @ head
  lp = np.take_along_axis(intended_logprobs(logits, SAMPLED.temperature, SAMPLED.top_k),
                          np.asarray(batch.response_tokens)[..., None], -1)[..., 0]
  np.testing.assert_allclose(batch.behaviour_logprobs, lp, atol=1e-4, rtol=0)
  # the fp8 policy with its lm_head in the generator dtype: the same trunk, another head
  whole = SamplingParams(temperature=SAMPLED.temperature)
  own = token_logprobs(model, batch, whole)
  dtype_head = token_logprobs(fp8_model(Sampler(TIED, quantize="fp8"), tied_params), batch, whole)
  gap = np.abs(own - dtype_head)
  assert 1e-3 < gap.max() < 1.0, gap.max()


# -- fp8 experts (Qwen3-MoE) ----------------------------------------------------------------------


def moe_setup():
  """(config, fp32 host params) of test_moe's tiny Qwen3-MoE (sparse, dense, sparse; 4 experts, top-2)."""
  from test_moe import moe_params, tiny_moe_config
  config = tiny_moe_config()
  return config, moe_params(config)


@pytest.fixture(scope="module")
def moe_sampler():
  return Sampler(moe_setup()[0], quantize="fp8", batch_multiple=8)


@pytest.fixture(scope="module")
def moe_prompts():
  rng = np.random.RandomState(0)
  return [rng.randint(3, 64, n).tolist() for n in (5, 9, 3)]


def test_experts_are_quantised_per_expert_and_output_channel():
  """A MoE layer's w_gate, w_up `[X, E, F]` and w_down `[X, F, E]` in fp8 with scales `[X, F]`, `[X, E]`
  (amax over the one input axis of each expert alone), the router as it was; fusing gate/up after
  (the wire, then the sampler) is bit for bit quantising the fused w_gate_up `[X, E, 2, F]`; the
  de-quantised experts are the originals within half an e4m3 step, as a dense projection's."""
  config, params = moe_setup()
  q = fp8.quantize_params(params)
  mlp = q["layers"][0]["mlp"]
  X, E, F = config.num_experts, config.hidden_size, config.moe_intermediate_size
  assert mlp["router"].dtype == jnp.float32 and "router_scale" not in mlp
  assert mlp["w_gate"].dtype == mlp["w_down"].dtype == fp8.FP8
  assert mlp["w_gate_scale"].shape == mlp["w_up_scale"].shape == (X, F) and mlp["w_down_scale"].shape == (X, E)
  w = np.asarray(params["layers"][0]["mlp"]["w_down"])
  np.testing.assert_allclose(np.asarray(mlp["w_down_scale"]), np.abs(w).max(axis=1) / 448, rtol=1e-6)
  assert q["layers"][1]["mlp"]["w_gate_scale"].shape == (F * 4,)  # the dense layer: per output channel
  wire_then_fuse = serving_params(q, FUSED_FP8)
  fuse_then_quantise = fp8.quantize_params(serving_params(params, WeightLayout(fused_qkv=True, fused_mlp=True)))
  assert wire_then_fuse["layers"][2]["mlp"]["w_gate_up_scale"].shape == (X, 2, F)
  assert jax.tree.structure(wire_then_fuse) == jax.tree.structure(fuse_then_quantise)
  for a, b in zip(jax.tree.leaves(wire_then_fuse), jax.tree.leaves(fuse_then_quantise)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  back = fp8.dequantize_params(q)["layers"]
  for i in config.moe_layers:
    for name in ("w_gate", "w_up", "w_down"):
      w, d = np.asarray(params["layers"][i]["mlp"][name]), np.asarray(back[i]["mlp"][name])
      scale = np.abs(w).max(axis=1, keepdims=True) / 448
      assert np.all(np.abs(d - w) <= np.maximum(2.0**-4 * np.abs(w), 2.0**-10 * scale) * (1 + 1e-6)), name


@pytest.mark.parametrize("grouped_gemm", ["ragged_dot", "pallas"])
@pytest.mark.parametrize("fused", [False, True], ids=["gate_up", "fused_gate_up"])
def test_the_fp8_grouped_matmul_is_the_dequantised_experts_swiglu(fused, grouped_gemm):
  """`moe.grouped_swiglu` on `ScaledExperts` (fp8 values cast to the rows' dtype, each row's product
  times its expert's scales) equals it on the de-quantised fp32 experts: the same products in another
  order (fp32 rounding, < 1e-5 relative to the output's scale); rows routed to no expert of a
  contiguous range included (the first device's half of an expert-parallel mesh); by ragged_dot, and by
  the Pallas kernels reading the fp8 values (interpreted here)."""
  from llamarl_jax.model import moe
  rng = np.random.RandomState(0)
  N, k, X, E, F = 40, 2, 4, 32, 16
  x = jnp.asarray(rng.randn(N, E), jnp.float32)
  experts = jnp.asarray(np.stack([rng.permutation(X)[:k] for _ in range(N)]), jnp.int32)
  weights = jnp.asarray(rng.rand(N, k), jnp.float32)
  ws = [jnp.asarray(rng.randn(X, E, F) * np.exp(rng.randn(X, 1, F)), jnp.float32) for _ in range(2)]
  down = jnp.asarray(rng.randn(X, F, E) / 4, jnp.float32)
  gate_up = [jnp.stack(ws, axis=-2)] if fused else ws
  q = [moe.ScaledExperts(*fp8.quantize_weight(w, 1, experts=True)) for w in (*gate_up, down)]
  deq = [(s.values.astype(jnp.float32) * s.scale[:, None]) for s in q]
  pack = (lambda ws: ws[0]) if fused else tuple
  for first, Xl in ((0, X), (0, X // 2)):  # all experts here; the first half (the rest elsewhere: 0)
    part = lambda w: jax.tree.map(lambda a: a[first:first + Xl], w)
    got = moe._local_swiglu(x, experts, weights, pack([part(w) for w in q[:-1]]), part(q[-1]), first, grouped_gemm)
    want = moe._local_swiglu(x, experts, weights, pack([part(w) for w in deq[:-1]]), part(deq[-1]), first)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5 * float(jnp.abs(want).max()), rtol=0)
  unquantised = moe.grouped_swiglu(x, experts, weights, pack(gate_up), down)
  got = moe.grouped_swiglu(x, experts, weights, pack(q[:-1]), q[-1])
  assert 1e-3 < float(jnp.abs(got - unquantised).max() / jnp.abs(unquantised).max()) < 0.1  # fp8's rounding


def test_fp8_moe_behaviour_logprobs_are_the_fp8_policys_own(moe_sampler, moe_prompts):
  """The fp8 MoE generator (fp8 attention and dense-MLP projections, fp8 experts, the router in the
  compute dtype): behaviour log-probs are a teacher-forced forward of its own fp8 weights (1e-4, as
  the dense model's), and not the unquantised policy's."""
  config, params = moe_setup()
  placed = moe_sampler.place_params(params)
  assert placed["layers"][0]["mlp"]["w_gate_up"].dtype == fp8.FP8 and placed["layers"][0]["mlp"]["router"].dtype == jnp.float32
  batch = moe_sampler.generate(params, moe_prompts, SAMPLED)
  assert np.asarray(batch.response_mask).all()
  own = token_logprobs(fp8_model(moe_sampler, params), batch)
  np.testing.assert_allclose(batch.behaviour_logprobs, own, atol=1e-4, rtol=0)
  whole = SamplingParams(temperature=SAMPLED.temperature)
  unquantised = token_logprobs(merge_params(split_params(abstract_model(config))[0], jax.tree.map(jnp.asarray, params)),
                               batch, whole)
  gap = np.abs(token_logprobs(fp8_model(moe_sampler, params), batch, whole) - unquantised)
  assert 1e-2 < gap.max() < 1.0, gap.max()


@pytest.mark.slow
def test_the_fp8_moe_slot_engine_samples_what_the_fp8_moe_sampler_samples(moe_sampler, moe_prompts):
  """Same seed and rows: the fp8 MoE slot engine's tokens, experts and log-probs are the static fp8
  sampler's (1e-5: fp32 summation order)."""
  config, params = moe_setup()
  eng = SlotEngine(config, lanes=4, sampling=SAMPLED, max_prompt_len=16, chunk_steps=3, max_insert=2,
                   kv_block_size=4, quantize="fp8", progress=False)
  static = moe_sampler.generate(params, moe_prompts, SAMPLED)
  batch = eng.generate(params, moe_prompts, SAMPLED)
  assert_same_samples(batch, static)


@pytest.mark.devices(8)
@pytest.mark.slow
def test_an_expert_parallel_fp8_moe_generator_samples_what_one_device_samples(moe_prompts):
  """fp8 experts on data=2 x expert=2 x tp=2: a push quantises on the trainer (fsdp=2 x expert=2) and
  the scales arrive sharded over `expert` like their experts; the static sampler and the slot engine
  sample the one-device fp8 generator's tokens (log-probs 1e-5: partial sums in another order)."""
  from test_moe import EP_MESH
  config, params = moe_setup()
  trainer_mesh = parallel.make_mesh(jax.devices()[4:8], fsdp=2, expert=2)
  gen_mesh = parallel.make_mesh(jax.devices()[:8], **EP_MESH)
  abstract = abstract_model(config)
  shapes, axes = split_params(abstract)[1], parallel.logical_axes(abstract)
  sync = WeightSync(parallel.param_shardings(shapes, axes, gen_mesh), dtype=jnp.float32, quantize="fp8")
  sync.push(jax.device_put(params, parallel.param_shardings(shapes, axes, trainer_mesh)), 1)
  wire = sync.latest()[0]
  P = jax.sharding.PartitionSpec
  assert wire["layers"][0]["mlp"]["w_gate"].sharding.spec == P("expert", None, "tp")
  assert wire["layers"][0]["mlp"]["w_gate_scale"].sharding.spec == P("expert", "tp")
  sampling = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=1)
  runs = {}
  for name, mesh, p in (("one", parallel.make_mesh(jax.devices()[:1]), params), ("ep", gen_mesh, wire)):
    static = jax.device_get(Sampler(config, mesh, batch_multiple=8, quantize="fp8").generate(p, moe_prompts, sampling))
    engine = SlotEngine(config, mesh, lanes=8, sampling=sampling, max_prompt_len=16, chunk_steps=3,
                        prompt_buckets=(16,), kv_block_size=4, min_decode_width=8, progress=False, quantize="fp8")
    runs[name] = {"static": static, "slots": engine.generate(p, moe_prompts, sampling)}
  for way in ("static", "slots"):
    one, ep = runs["one"][way], runs["ep"][way]
    np.testing.assert_array_equal(ep.response_tokens, one.response_tokens, err_msg=way)
    np.testing.assert_array_equal(ep.routing, one.routing, err_msg=way)
    np.testing.assert_allclose(ep.behaviour_logprobs, one.behaviour_logprobs, atol=1e-5, rtol=0, err_msg=way)


# -- the setting ---------------------------------------------------------------------------------


def test_quantize_takes_fp8_and_names_it_for_int8():
  assert GeneratorConfig(quantize="fp8").quantize == "fp8"
  with pytest.raises(ConfigError, match=r"GeneratorConfig.quantize.*'fp8'.*there is no 'int8'"):
    GeneratorConfig(quantize="int8")
  with pytest.raises(ValueError, match=r"WeightLayout.quantize \(GeneratorConfig.quantize\): expected None, 'fp8' or "
                                       r"'fp8\+lm_head'.*got 'int8'"):
    Sampler(CONFIG, quantize="int8")
  # the fp8 lm_head is one precision of the three, and a causal LM's head only
  layout = Sampler(CONFIG, quantize="fp8+lm_head").layout
  assert GeneratorConfig(quantize="fp8+lm_head").quantize == layout.quantize == "fp8+lm_head"
  assert layout.fp8 and layout.fp8_lm_head and not Sampler(CONFIG, quantize="fp8").layout.fp8_lm_head
  with pytest.raises(ValueError, match="score-head model .* no lm_head"):
    Sampler(tiny(num_labels=1), quantize="fp8+lm_head")
  # with LoRA and across processes
  config = RunConfig(generator=GeneratorConfig(quantize="fp8"), train=TrainConfig(lora=LoraConfig(rank=4)))
  config.check_layout(1, 2)
