"""The static sampler's decode step moves the bytes it must, and no more.

The trainer runs its layers under `lax.scan` over stacked parameters; the decode path must not follow
it there: carrying a stacked `[L, B, T, KV, D]` cache through a scan copies the whole cache every step
(on the H100: 5.97 ms against 1.78 ms per step at B64, ../shared/GPU.md). The decode step keeps one
cache array per layer, updated in place (donated). XLA's cost analysis of the compiled step shows it on
any backend: bytes accessed ~ the weights read (every matrix but the gathered embedding table) + the
cache read by attention. Measured on CPU: 1.23-1.29x that sum for caches of 128-2048 positions (the
rest: the in-place update counted as read + write, activations, logits); a per-step copy of the cache
would add at least 2x the cache bytes (read + write), i.e. a ratio above 2 at 2048 positions. Bound: 1.4.
"""

import jax
import jax.numpy as jnp
import pytest

from llamarl_jax.model import KVCache, ModelConfig
from llamarl_jax.model.llama import abstract_model, merge_params, split_params

CONFIG = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
                     num_kv_heads=2, head_dim=32, max_position_embeddings=4096, tie_word_embeddings=False)


def decode_step_bytes(config, batch, cache_len):
  """(bytes accessed by one compiled decode step, weights read + cache bytes), from abstract shapes."""
  graphdef, params = split_params(abstract_model(config))

  def step(params, cache, token, position, mask):  # the body of `Sampler._decode`'s loop
    model = merge_params(graphdef, params)
    x, cache = model.hidden_states(token[:, None], position[:, None], cache, mask)
    return model.logits(x[:, 0]), cache

  cache = jax.eval_shape(lambda: KVCache.init(config, batch, cache_len))
  vec = jax.ShapeDtypeStruct((batch,), jnp.int32)
  compiled = jax.jit(step, donate_argnums=1).lower(
      params, cache, vec, vec, jax.ShapeDtypeStruct((batch, cache_len), jnp.bool_)).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
  weights = nbytes(params) - nbytes(params["embed"])  # the embedding table is only gathered (B rows)
  return float(cost["bytes accessed"]), weights + nbytes((cache.k, cache.v))


@pytest.mark.parametrize("cache_len", [128, 2048])
def test_decode_step_reads_weights_and_cache_once(cache_len):
  got, ideal = decode_step_bytes(CONFIG, 8, cache_len)
  assert got <= 1.4 * ideal, (got, ideal, got / ideal)


def test_decode_step_bytes_grow_with_depth_like_the_weights_and_cache():
  """Twice the layers: the step's bytes at most twice (plus the unchanged lm_head), no copy per layer."""
  one, ideal_one = decode_step_bytes(CONFIG, 8, 512)
  two, ideal_two = decode_step_bytes(CONFIG.replace(num_layers=8), 8, 512)
  assert two / one <= 1.1 * ideal_two / ideal_one, (one, two, ideal_one, ideal_two)
