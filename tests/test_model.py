"""Our Flax Llama against transformers' PyTorch Llama on the same weights.

Tolerance: fp32 end to end on both sides; the only differences are summation order in matmuls and
softmax (~1e-6 relative on logits of magnitude ~1), so 1e-4 absolute is a generous but meaningful bound
(a wrong RoPE convention or a missing norm gives errors of order 0.1-1).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from llamarl_jax import parallel
from flax import nnx

from llamarl_jax.model import KVCache, ModelConfig, init_model, load_hf_checkpoint, save_hf_checkpoint

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}

CONFIGS = {
    "gqa": {},
    "mha": {"num_key_value_heads": 4},
    "tied": {"tie_word_embeddings": True},
    "llama3_rope": {"rope_scaling": LLAMA3_ROPE},
    "odd_vocab": {"vocab_size": 101, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 24},
}


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


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(make_hf_model, name):
  ref, path = make_hf_model(**CONFIGS[name])
  config, model = load_hf_checkpoint(path)
  tokens = np.random.RandomState(1).randint(0, config.vocab_size, (2, 24))
  ours = np.asarray(run(model, jnp.asarray(tokens)))
  assert ours.shape == (2, 24, config.vocab_size)
  np.testing.assert_allclose(ours, torch_logits(ref, tokens), atol=1e-4, rtol=0)


def test_left_padded_batch_matches_transformers(make_hf_model):
  ref, path = make_hf_model(rope_scaling=LLAMA3_ROPE)
  _, model = load_hf_checkpoint(path)
  rng = np.random.RandomState(2)
  lengths = [20, 13, 5]
  T = max(lengths)
  tokens = np.zeros((3, T), np.int64)
  mask = np.zeros((3, T), np.int64)
  for i, n in enumerate(lengths):
    tokens[i, T - n:] = rng.randint(1, 67, n)
    mask[i, T - n:] = 1
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  ours = np.asarray(run(model, jnp.asarray(tokens), positions=jnp.asarray(positions), attention_mask=jnp.asarray(mask)))
  theirs = torch_logits(ref, tokens, mask, positions)
  valid = mask.astype(bool)
  np.testing.assert_allclose(ours[valid], theirs[valid], atol=1e-4, rtol=0)
  # a padded row equals the same prompt run alone
  alone = np.asarray(run(model, jnp.asarray(tokens[2:3, T - 5:])))
  np.testing.assert_allclose(ours[2, T - 5:], alone[0], atol=1e-5, rtol=0)


def test_kv_cache_decode_equals_full_forward():
  config = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                       num_kv_heads=2)
  model = init_model(config, seed=3)
  tokens = jnp.asarray(np.random.RandomState(3).randint(0, 50, (2, 10)))
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


@pytest.mark.parametrize("shard_bytes", [None, 20_000])
def test_round_trip_through_transformers(make_hf_model, tmp_path, shard_bytes):
  import transformers

  ref, path = make_hf_model(rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True)
  config, model = load_hf_checkpoint(path)
  out = tmp_path / "export"
  kw = {} if shard_bytes is None else {"max_shard_bytes": shard_bytes}
  save_hf_checkpoint(model, config, out, **kw)
  if shard_bytes:
    assert (out / "model.safetensors.index.json").exists()
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  tokens = np.random.RandomState(5).randint(0, 67, (2, 16))
  np.testing.assert_array_equal(torch_logits(reloaded, tokens), torch_logits(ref, tokens))
  config2, model2 = load_hf_checkpoint(out)
  assert config2 == config
  np.testing.assert_array_equal(np.asarray(run(model2, jnp.asarray(tokens))), np.asarray(run(model, jnp.asarray(tokens))))


@pytest.mark.parametrize("fsdp,tp", [(4, 1), (2, 2)])
def test_sharded_logits_equal_single_device(make_hf_model, fsdp, tp):
  assert len(jax.devices()) >= 4, "conftest sets 8 fake CPU devices"
  _, path = make_hf_model(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=68)
  _, single = load_hf_checkpoint(path)
  mesh = parallel.make_mesh(jax.devices()[:fsdp * tp], fsdp=fsdp, tp=tp)
  _, sharded = load_hf_checkpoint(path, mesh=mesh)
  spec = sharded.layers[0].mlp.w_up[...].sharding.spec
  assert spec == jax.sharding.PartitionSpec("fsdp" if fsdp > 1 else None, "tp" if tp > 1 else None)
  tokens = jnp.asarray(np.random.RandomState(6).randint(0, 68, (4, 12)))
  tokens = jax.device_put(tokens, parallel.batch_sharding(mesh))
  np.testing.assert_allclose(np.asarray(run(sharded, tokens)), np.asarray(run(single, tokens)),
                             atol=1e-5, rtol=0)


def test_make_meshes_disjoint_and_colocated():
  trainer, generator = parallel.make_meshes(trainer_fsdp=2, trainer_tp=2, generator_dp=2, generator_tp=2)
  assert set(trainer.devices.flat).isdisjoint(generator.devices.flat)
  assert dict(trainer.shape) == {"data": 1, "fsdp": 2, "tp": 2}
  assert dict(generator.shape) == {"data": 2, "fsdp": 1, "tp": 2}
  t, g = parallel.make_meshes(trainer_fsdp=4, generator_dp=2, generator_tp=2, colocated=True)
  assert set(t.devices.flat) == set(g.devices.flat)
  with pytest.raises(ValueError, match="need 16 devices"):
    parallel.make_meshes(trainer_fsdp=8, generator_dp=8)
