"""Our Flax model against transformers' PyTorch Llama / Qwen2 / Qwen3 on the same weights.

Tolerance: fp32 end to end on both sides; the only differences are summation order in matmuls and
softmax (~1e-6 relative on logits of magnitude ~1), so 1e-4 absolute is a generous but meaningful bound
(a wrong RoPE convention or a missing norm gives errors of order 0.1-1). The reference models have
random biases and norm scales (`conftest.tiny_hf_model`), so a dropped or misplaced one shows.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from llamarl_jax import parallel
from flax import nnx

from llamarl_jax.model import KVCache, ModelConfig, init_model, load_hf_checkpoint, save_hf_checkpoint
from llamarl_jax.model.llama import abstract_model

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}

# factor 4 = max_position_embeddings 128 / 32, as transformers expects of a yarn config
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}

CONFIGS = {  # name: (family, overrides of conftest.tiny_hf_config); all GQA (4 heads, 2 kv) unless stated
    "gqa": ("llama", {}),
    "mha": ("llama", {"num_key_value_heads": 4}),
    "tied": ("llama", {"tie_word_embeddings": True}),
    "llama3_rope": ("llama", {"rope_scaling": LLAMA3_ROPE}),
    "odd_vocab": ("llama", {"vocab_size": 101, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 24}),
    "qwen2": ("qwen2", {}),
    "qwen2_tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3_head_dim": ("qwen3", {"head_dim": 16}),  # 4 heads x 16 != hidden 32, as in Qwen3-0.6B
    "qwen3_tied_yarn": ("qwen3", {"tie_word_embeddings": True, "rope_scaling": YARN_ROPE}),
}
FAMILIES = ["llama", "qwen2", "qwen3"]


@nnx.jit
def run(model, tokens, positions=None, cache=None, attention_mask=None):
  """Jitted forward (eager op-by-op dispatch is ~10x slower on CPU)."""
  return model(tokens, positions=positions, cache=cache, attention_mask=attention_mask)


def torch_logits(model, tokens, attention_mask=None, position_ids=None):
  with torch.no_grad():
    kw = {}
    if attention_mask is not None:
      kw = dict(attention_mask=torch.tensor(attention_mask), position_ids=torch.tensor(position_ids))
    return model(torch.tensor(tokens), **kw).logits.numpy()


def left_padded_batch(lengths, vocab, seed):
  """tokens, attention mask and positions `[len(lengths), max(lengths)]`: row i holds lengths[i] random
  tokens after left padding; positions count the row's real tokens (0 on padding), as the sampler does."""
  rng = np.random.RandomState(seed)
  T = max(lengths)
  tokens = np.zeros((len(lengths), T), np.int64)
  mask = np.zeros((len(lengths), T), np.int64)
  for i, n in enumerate(lengths):
    tokens[i, T - n:] = rng.randint(1, vocab, n)
    mask[i, T - n:] = 1
  return tokens, mask, np.maximum(np.cumsum(mask, axis=1) - 1, 0)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(make_hf_model, name):
  """Every position of a left-padded batch (a full row of 24 tokens, rows of 17 and 9 after padding)."""
  family, overrides = CONFIGS[name]
  ref, path = make_hf_model(family=family, **overrides)
  config, model = load_hf_checkpoint(path)
  assert config.model_type == family
  tokens, mask, positions = left_padded_batch([24, 17, 9], config.vocab_size, seed=1)
  ours = np.asarray(run(model, jnp.asarray(tokens), positions=jnp.asarray(positions), attention_mask=jnp.asarray(mask)))
  assert ours.shape == (3, 24, config.vocab_size)
  valid = mask.astype(bool)
  np.testing.assert_allclose(ours[valid], torch_logits(ref, tokens, mask, positions)[valid], atol=1e-4, rtol=0)


def test_left_padded_row_equals_the_prompt_alone(make_hf_model):
  _, path = make_hf_model(rope_scaling=LLAMA3_ROPE)
  _, model = load_hf_checkpoint(path)
  tokens, mask, positions = left_padded_batch([20, 13, 5], 67, seed=2)
  T = tokens.shape[1]
  ours = np.asarray(run(model, jnp.asarray(tokens), positions=jnp.asarray(positions), attention_mask=jnp.asarray(mask)))
  alone = np.asarray(run(model, jnp.asarray(tokens[2:3, T - 5:])))
  np.testing.assert_allclose(ours[2, T - 5:], alone[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_kv_cache_decode_equals_full_forward(make_hf_model, family):
  # Qwen2's biases take the same path (tests/test_sampler.py checks its cached decode against the full forward)
  extra = {"head_dim": 16, "rope_scaling": YARN_ROPE} if family == "qwen3" else {}
  config, model = load_hf_checkpoint(make_hf_model(family=family, seed=3, **extra)[1])  # random q/k norms
  tokens = jnp.asarray(np.random.RandomState(3).randint(0, 67, (2, 10)))
  full = run(model, tokens)
  cache = KVCache.init(config, batch=2, max_len=16)
  mask = jnp.ones((2, 16), jnp.int32)
  logits, cache = run(model, tokens[:, :6], cache=cache, attention_mask=mask)
  steps = [logits]
  for t in range(6, 10):
    logits, cache = run(model, tokens[:, t:t + 1], cache=cache, attention_mask=mask)
    steps.append(logits)
  assert int(cache.index) == 10
  np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5, rtol=0)


def test_bf16_compute_with_fp32_params_close_to_fp32():
  config = ModelConfig(vocab_size=50, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                       num_kv_heads=2)
  tokens = jnp.asarray(np.random.RandomState(4).randint(0, 50, (2, 12)))
  f32 = run(init_model(config, seed=5), tokens)
  bf16_model = init_model(config.replace(dtype="bfloat16"), seed=5)
  assert bf16_model.embed[...].dtype == jnp.float32
  bf16 = run(bf16_model, tokens)
  assert bf16.dtype == jnp.float32  # logits are always fp32
  # bf16 has 8 mantissa bits (rel. error ~4e-3 per op); through 2 layers logits stay within 0.1
  assert float(jnp.abs(bf16 - f32).max()) < 0.1
  assert float(jnp.abs(bf16 - f32).max()) > 0  # really computed in bf16


BF16_UNIT_ROUNDOFF = 2.0**-8  # bf16 keeps 8 significant bits: each rounding is off by <= 2^-8 relative


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_matches_transformers_bf16(make_hf_model, family):
  """Our bf16 forward (bf16 params and compute) against transformers' bf16 forward of the same weights.

  Both round the same values with relative error <= u = 2^-8, at slightly different points (fused bias
  adds, accumulation order, when a product is rounded), so they differ by a sum of rounding errors.
  Each of the 2L sublayers, the embedding and the final norm adds errors of ~u times the values it
  writes to the residual stream, and they reach the logits scaled by at most the logit scale:
  max |ours - theirs| <= u (2L + 2) max|logit|  (measured 0.9-2.0 u max|logit| at L = 2, 3 seeds).
  And ours must be about as accurate as theirs against the exact (fp32) logits: mean |ours - exact|
  <= 1.25 mean |theirs - exact| (measured 0.94-1.00), which an implementation that rounds more often
  (or in lower precision) than transformers fails. Structural bugs are caught in fp32 above at 1e-4.
  """
  import torch

  ref, path = make_hf_model(family=family, **({"tie_word_embeddings": True} if family == "qwen3" else {}))
  config, model = load_hf_checkpoint(path, dtype=jnp.bfloat16)
  assert model.embed[...].dtype == jnp.bfloat16 and config.dtype == "bfloat16"
  tokens = np.random.RandomState(7).randint(0, 67, (2, 24))
  ours = np.asarray(run(model, jnp.asarray(tokens)))
  exact = torch_logits(ref, tokens)
  with torch.no_grad():
    theirs = ref.to(torch.bfloat16)(torch.tensor(tokens)).logits.float().numpy()
  tol = BF16_UNIT_ROUNDOFF * (2 * config.num_layers + 2) * np.abs(exact).max()
  assert np.abs(ours - theirs).max() <= tol, (np.abs(ours - theirs).max(), tol)
  assert np.abs(ours - exact).mean() <= 1.25 * np.abs(theirs - exact).mean()
  assert np.abs(ours - exact).max() > 1e-4  # really computed in bf16


@pytest.mark.parametrize("family,shard_bytes", [("llama", None), ("llama", 20_000), ("qwen2", None), ("qwen3", None)])
def test_round_trip_through_transformers(make_hf_model, tmp_path, family, shard_bytes):
  """Export -> transformers loads the family's own class with identical logits -> we load it back equal."""
  import transformers

  rope = {"llama": LLAMA3_ROPE, "qwen3": YARN_ROPE}.get(family)
  ref, path = make_hf_model(family=family, tie_word_embeddings=family != "qwen2",
                            **({"rope_scaling": rope} if rope else {}))
  config, model = load_hf_checkpoint(path)
  out = tmp_path / "export"
  kw = {} if shard_bytes is None else {"max_shard_bytes": shard_bytes}
  save_hf_checkpoint(model, config, out, **kw)
  if shard_bytes:
    assert (out / "model.safetensors.index.json").exists()
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert type(reloaded) is type(ref)  # LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM
  tokens = np.random.RandomState(5).randint(0, 67, (2, 16))
  np.testing.assert_array_equal(torch_logits(reloaded, tokens), torch_logits(ref, tokens))
  config2, model2 = load_hf_checkpoint(out)
  assert config2 == config
  np.testing.assert_array_equal(np.asarray(run(model2, jnp.asarray(tokens))), np.asarray(run(model, jnp.asarray(tokens))))


# config.json as Qwen ships them (Qwen2.5-1.5B-Instruct, Qwen3-1.7B; fields that do not matter left out)
QWEN_CONFIGS = {
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
              "hidden_size": 1536, "intermediate_size": 8960, "max_position_embeddings": 32768,
              "max_window_layers": 21, "num_attention_heads": 12, "num_hidden_layers": 28, "num_key_value_heads": 2,
              "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
              "use_sliding_window": False, "vocab_size": 151936},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "head_dim": 128,
              "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
              "max_window_layers": 28, "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
              "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
              "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936},
}


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_released_qwen_configs_translate(family):
  """The released shapes load as the right family with the released parameter counts (the same count
  as perf_model's), and Qwen's documented long-context switch (yarn, factor 4 over 32768) is applied."""
  from llamarl_jax.measure import perf_model
  from llamarl_jax.model.hf import config_from_hf
  from llamarl_jax.model.config import rope_attention_factor

  config = config_from_hf(QWEN_CONFIGS[family])
  assert (config.model_type, config.qkv_bias, config.qk_norm) == (family, family == "qwen2", family == "qwen3")
  assert config.tie_word_embeddings and config.rope_theta == 1e6 and config.rope_scaling is None
  assert config.head_dim == 128
  shape = perf_model.QWEN["qwen2.5-1.5b" if family == "qwen2" else "qwen3-1.7b"]
  assert config.num_params() == shape.params
  yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
  long = config_from_hf({**QWEN_CONFIGS[family], "rope_scaling": yarn})
  assert long.rope_scaling_dict == yarn
  assert rope_attention_factor(long) == pytest.approx(0.1 * np.log(4.0) + 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_num_params_counts_every_family_parameter(family):
  config = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, model_type=family)
  model = abstract_model(config)  # shapes only: no init compute
  assert sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == config.num_params()
  attn = model.layers[0].attn
  assert hasattr(attn, "bq") == (family == "qwen2") and hasattr(attn, "q_norm") == (family == "qwen3")


@pytest.mark.devices(4)
@pytest.mark.parametrize("family,fsdp,tp", [("llama", 4, 1), ("qwen2", 2, 2)])
def test_sharded_logits_equal_single_device(make_hf_model, family, fsdp, tp):
  _, path = make_hf_model(family=family, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                          vocab_size=68)
  _, single = load_hf_checkpoint(path)
  mesh = parallel.make_mesh(jax.devices()[:fsdp * tp], fsdp=fsdp, tp=tp)
  _, sharded = load_hf_checkpoint(path, mesh=mesh)
  P = jax.sharding.PartitionSpec
  spec = sharded.layers[0].mlp.w_up[...].sharding.spec
  assert spec == P("fsdp" if fsdp > 1 else None, "tp" if tp > 1 else None)
  if family == "qwen2":  # the q/k/v biases follow their projections' heads over tp
    assert sharded.layers[0].attn.bq[...].sharding.spec == P("tp", None)
    assert sharded.layers[0].attn.bk[...].sharding.spec == P("tp", None)
  tokens = jnp.asarray(np.random.RandomState(6).randint(0, 68, (4, 12)))
  tokens = jax.device_put(tokens, parallel.batch_sharding(mesh))
  np.testing.assert_allclose(np.asarray(run(sharded, tokens)), np.asarray(run(single, tokens)),
                             atol=1e-5, rtol=0)


@pytest.mark.devices(8)
def test_make_meshes_disjoint_and_colocated():
  trainer, generator = parallel.make_meshes(trainer_fsdp=2, trainer_tp=2, generator_dp=2, generator_tp=2)
  assert set(trainer.devices.flat).isdisjoint(generator.devices.flat)
  assert dict(trainer.shape) == {"data": 1, "fsdp": 2, "expert": 1, "tp": 2}
  assert dict(generator.shape) == {"data": 2, "fsdp": 1, "expert": 1, "tp": 2}
  t, g = parallel.make_meshes(trainer_fsdp=4, generator_dp=2, generator_tp=2, colocated=True)
  assert set(t.devices.flat) == set(g.devices.flat)
  t, g = parallel.make_meshes(trainer_fsdp=2, trainer_expert=2, generator_expert=2, generator_tp=2)
  assert dict(t.shape) == {"data": 1, "fsdp": 2, "expert": 2, "tp": 1}
  assert dict(g.shape) == {"data": 1, "fsdp": 1, "expert": 2, "tp": 2}
  assert set(t.devices.flat).isdisjoint(g.devices.flat)


def test_make_meshes_names_the_devices_it_needs():
  with pytest.raises(ValueError, match=f"need 16 devices, only {len(jax.devices())} available"):
    parallel.make_meshes(trainer_fsdp=8, generator_dp=8)
