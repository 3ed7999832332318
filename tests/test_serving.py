"""The generator's serving layout (fused Q/K/V and gate/up): the same model as the trainer's layout.

Fusing moves weights only; the model computes every output column from the same weights with the
same fp32 accumulation, but in wider GEMMs ([E, (H + 2 KV) D] instead of three, [E, 2F] instead of
two), whose blocking over the reduction axis XLA:CPU (Eigen) picks from the GEMM's shape: a logit
may differ by a few ulps. Measured on these tiny models (logits up to ~4, ulp 4.8e-7): at most
2.3e-6 per logit over two layers. Sampled tokens must be identical; log-probs agree to 1e-5 (the
tolerance the engine's sharded test uses for a changed reduction order), 4x the largest difference
measured, small against the 1e-3 change a wrong column or head would make.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llamarl_jax import parallel
from llamarl_jax.generation import Sampler, SamplingParams
from llamarl_jax.generation.engine import SlotEngine
from llamarl_jax.model import save_hf_checkpoint
from llamarl_jax.model.config import HF_LAYOUT, ModelConfig, WeightLayout
from llamarl_jax.model.llama import abstract_model, init_model, merge_params, split_params
from llamarl_jax.model.serving import serving_layout, serving_params

FUSED = WeightLayout(fused_qkv=True, fused_mlp=True)
LOGPROB_TOL = 1e-5
R = 6
GREEDY = SamplingParams(temperature=0, max_new_tokens=R)
SAMPLED = SamplingParams(temperature=0.8, top_k=20, max_new_tokens=R, n=2, seed=5)


def tiny(model_type="llama", **kw):
  return ModelConfig(vocab_size=67, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=8, model_type=model_type, rope_theta=10000.0, max_position_embeddings=128, **kw)


def random_params(config, seed=0):
  """Random weights, with non-zero q/k/v biases (Qwen2) so their fusion is checked too."""
  _, params = split_params(init_model(config, seed))
  rng = np.random.RandomState(seed)
  for layer in params["layers"].values():
    for b in ("bq", "bk", "bv"):
      if b in layer["attn"]:
        layer["attn"][b] = jnp.asarray(0.3 * rng.randn(*layer["attn"][b].shape), jnp.float32)
  return params


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.RandomState(0)
  return [rng.randint(3, 67, n).tolist() for n in (5, 9, 3)]


def test_fused_qkv_holds_each_kv_heads_queries_key_and_value():
  """wqkv[:, j] = [wq's heads of KV group j, wk[:, j], wv[:, j]]; w_gate_up = [w_gate, w_up] on axis 1."""
  c = tiny("qwen2")
  params = random_params(c)
  fused = serving_params(params, FUSED)
  a, f = params["layers"][1], fused["layers"][1]
  G = c.num_heads // c.num_kv_heads
  assert f["attn"]["wqkv"].shape == (c.hidden_size, c.num_kv_heads, G + 2, c.head_dim)
  assert set(f["attn"]) == {"wqkv", "bqkv", "wo"} and set(f["mlp"]) == {"w_gate_up", "w_down"}
  for j in range(c.num_kv_heads):
    np.testing.assert_array_equal(f["attn"]["wqkv"][:, j, :G], a["attn"]["wq"][:, j * G:(j + 1) * G])
    np.testing.assert_array_equal(f["attn"]["wqkv"][:, j, G], a["attn"]["wk"][:, j])
    np.testing.assert_array_equal(f["attn"]["wqkv"][:, j, G + 1], a["attn"]["wv"][:, j])
    np.testing.assert_array_equal(f["attn"]["bqkv"][j, :G], a["attn"]["bq"][j * G:(j + 1) * G])
  np.testing.assert_array_equal(f["mlp"]["w_gate_up"][:, 0], a["mlp"]["w_gate"])
  np.testing.assert_array_equal(f["mlp"]["w_gate_up"][:, 1], a["mlp"]["w_up"])
  assert f["attn"]["wo"] is a["attn"]["wo"] and fused["embed"] is params["embed"]  # the rest is not copied


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_serving_forward_equals_the_trainers_layout(family):
  c = tiny(family)
  params = random_params(c)
  hf = merge_params(split_params(abstract_model(c))[0], params)
  fused = merge_params(split_params(abstract_model(c, FUSED))[0], serving_params(params, FUSED))
  tokens = jnp.asarray(np.random.RandomState(1).randint(0, c.vocab_size, (3, 9)))
  forward = jax.jit(lambda m, t: m(t))
  want, got = forward(hf, tokens), forward(fused, tokens)
  np.testing.assert_allclose(got, want, atol=LOGPROB_TOL, rtol=0)
  assert float(jnp.max(jnp.abs(want))) > 1.0  # logits of the size the tolerance was reasoned for


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.slow
def test_sampler_and_engine_sample_what_the_unfused_layout_samples(prompts, sampling):
  c = tiny("qwen2")
  params = random_params(c)
  fused, hf = Sampler(c), Sampler(c, layout=HF_LAYOUT)
  assert fused.layout == FUSED
  want = hf.generate(params, prompts, sampling)
  got = fused.generate(params, prompts, sampling)
  np.testing.assert_array_equal(got.response_tokens, want.response_tokens)
  np.testing.assert_allclose(got.behaviour_logprobs, want.behaviour_logprobs, atol=LOGPROB_TOL, rtol=0)
  engine = SlotEngine(c, lanes=4, sampling=sampling, max_prompt_len=16, chunk_steps=2, kv_block_size=4,
                      progress=False)
  assert engine.sampler.layout == FUSED and "wqkv" in engine.programs.param_avals["layers"][0]["attn"]
  out = engine.generate(params, prompts, sampling)
  np.testing.assert_array_equal(out.response_tokens, want.response_tokens)
  np.testing.assert_allclose(out.behaviour_logprobs, want.behaviour_logprobs, atol=LOGPROB_TOL, rtol=0)


def test_place_params_fuses_once_and_takes_fused_params_as_they_are():
  c = tiny()
  sampler = Sampler(c)
  placed = sampler.place_params(random_params(c))
  assert "wqkv" in placed["layers"][0]["attn"] and "w_gate_up" in placed["layers"][0]["mlp"]
  again = sampler.place_params(placed)
  assert all(x is y for x, y in zip(jax.tree.leaves(again), jax.tree.leaves(placed)))
  with pytest.raises(ValueError, match="do not match the sampler's model structure"):
    sampler.place_params({"layers": {0: {"attn": {}}}})


def test_the_serving_layout_refuses_lora_and_checkpoints(tmp_path):
  """LoRA adapts the unfused projections and is merged before fusing; a fused copy is never exported."""
  c = tiny()
  fused = merge_params(split_params(abstract_model(c, FUSED))[0], serving_params(random_params(c), FUSED))
  with pytest.raises(ValueError, match="serving layout"):
    save_hf_checkpoint(fused, c, tmp_path / "x")


@pytest.mark.devices(8)
@pytest.mark.slow
def test_tensor_parallel_shards_hold_their_own_heads_and_sample_the_same(prompts):
  """Generator TP=2 (data=4 x tp=2, 8 devices): wqkv shards over its KV-head axis, each device's shard
  is the fusion of that device's wq, wk, wv shards (its own heads), and the engine samples what one
  device samples in the trainer's layout."""
  c = tiny("qwen2")
  params = random_params(c)
  mesh = parallel.make_mesh(jax.devices()[:8], data=4, tp=2)
  sampler = Sampler(c, mesh)
  assert sampler.layout == FUSED
  fused = sampler.place_params(params)
  parts = jax.device_put(params, sampler.hf_shardings)
  wqkv = fused["layers"][0]["attn"]["wqkv"]
  assert wqkv.sharding.spec == jax.sharding.PartitionSpec(None, "tp", None, None)
  assert fused["layers"][0]["mlp"]["w_gate_up"].sharding.spec == jax.sharding.PartitionSpec(None, None, "tp")
  local = lambda x: {s.device: np.asarray(s.data) for s in x.addressable_shards}
  q, k, v = (local(parts["layers"][0]["attn"][n]) for n in ("wq", "wk", "wv"))
  G = c.num_heads // c.num_kv_heads
  for device, shard in local(wqkv).items():
    assert shard.shape == (c.hidden_size, c.num_kv_heads // 2, G + 2, c.head_dim)
    own = np.concatenate([q[device].reshape(c.hidden_size, -1, G, c.head_dim), k[device][:, :, None],
                          v[device][:, :, None]], axis=2)
    np.testing.assert_array_equal(shard, own)
  want = Sampler(c, layout=HF_LAYOUT).generate(params, prompts, SAMPLED)
  engine = SlotEngine(c, mesh, lanes=4, sampling=SAMPLED, max_prompt_len=16, chunk_steps=2, kv_block_size=4,
                      progress=False)
  got = engine.generate(params, prompts, SAMPLED)
  np.testing.assert_array_equal(got.response_tokens, want.response_tokens)
  np.testing.assert_allclose(got.behaviour_logprobs, want.behaviour_logprobs, atol=LOGPROB_TOL, rtol=0)


@pytest.mark.devices(4)
def test_qkv_stays_unfused_where_kv_heads_do_not_shard_like_heads(prompts):
  """2 KV heads on tp=4: q shards over heads, k and v are replicated; a fused matrix could not shard
  like both, so only gate/up fuse, and the samples are the same."""
  c = tiny()
  mesh = parallel.make_mesh(jax.devices()[:4], tp=4)
  assert serving_layout(c, mesh) == WeightLayout(fused_qkv=False, fused_mlp=True)
  assert serving_layout(c, parallel.make_mesh(jax.devices()[:2], tp=2)) == FUSED
  params = random_params(c)
  sampler = Sampler(c, mesh)
  placed = sampler.place_params(params)
  assert placed["layers"][0]["attn"]["wq"].sharding.spec[1] == "tp"
  got = sampler.generate(placed, prompts, GREEDY)
  want = Sampler(c, layout=HF_LAYOUT).generate(params, prompts, GREEDY)
  np.testing.assert_array_equal(got.response_tokens, want.response_tokens)
  np.testing.assert_allclose(got.behaviour_logprobs, want.behaviour_logprobs, atol=LOGPROB_TOL, rtol=0)


def test_kernel_counts_reads_launches_from_a_compiled_modules_text():
  """Entry instructions that launch a kernel, by kind; a known-trip-count loop's body and condition
  once per trip; bookkeeping (parameters, tuples, bitcasts) none."""
  from llamarl_jax.measure.hlo import kernel_counts

  text = """HloModule m

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  %a = f32[4]{0} fusion(%p), kind=kLoop, calls=%f1
  %b = f32[4]{0} fusion(%a), kind=kLoop, calls=%f2
  ROOT %t = (s32[], f32[4]{0}) tuple(%a, %b)
}

%cond (p: (s32[], f32[4])) -> pred[] {
  %p = (s32[], f32[4]{0}) parameter(0)
  ROOT %c = pred[] fusion(%p), kind=kLoop, calls=%f3
}

ENTRY %main (x: f32[4,4], w: f32[4,4]) -> f32[4] {
  %x = f32[4,4]{1,0} parameter(0)
  %w = f32[4,4]{1,0} parameter(1)
  %g = f32[4,4]{1,0} fusion(%x, %w), kind=kCustom, calls=%gf, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %c = (f32[4,4]{1,0}, s8[0]{0}) custom-call(%g, %w), custom_call_target="__cublas$gemm"
  %k = f32[4]{0} custom-call(%x), custom_call_target="__gpu$xla.gpu.triton"
  %e = f32[4]{0} fusion(%k), kind=kLoop, calls=%f4
  %bc = f32[4]{0} bitcast(%e)
  %cp = f32[4]{0} copy(%bc)
  %init = (s32[], f32[4]{0}) tuple(%cp, %cp)
  %l = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %r = f32[4]{0} get-tuple-element(%l), index=1
}
"""
  # gemm: the Triton GEMM fusion and the cuBLAS call; custom: the Pallas (Triton) kernel; fusion: %e
  # plus 3 x (2 in the body + 1 in the condition); other: the copy
  assert kernel_counts(text) == {"total": 14, "gemm": 2, "fusion": 10, "custom": 1, "other": 1}
