"""The fp8 activation kernels (`model.fp8_kernels`, Pallas interpret mode on the CPU) against the
plain path they replace: `layers.rms_norm`, the SwiGLU of `llama.MLP`, the attention output's slice,
then `fp8.quantize_rows`, in bfloat16 as the generator computes.

Exact: the kernels run the plain path's ops in the same dtypes and order, so interpreted on the CPU
they give its fp8 values and scales bit for bit, against the plain path compiled as one program as
the generator's step is (XLA may keep a bfloat16 intermediate in fp32 inside one program, its
default `xla_allow_excess_precision`: both sides alike). A GPU's Triton reductions sum in another order.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llamarl_jax.model import fp8, fp8_kernels
from llamarl_jax.model.fp8 import Product
from llamarl_jax.model.layers import rms_norm

BF16 = jnp.bfloat16


def assert_rows_equal(rows, values, scale):
  np.testing.assert_array_equal(np.asarray(rows.scale), np.asarray(scale))
  np.testing.assert_array_equal(np.asarray(rows.values.astype(jnp.float32)), np.asarray(values.astype(jnp.float32)))


def product(rng, shape, col_shape):
  """A random fp8 GEMM product: fp32 y, row scales [B, 1], column scales."""
  return Product(jnp.asarray(30 * rng.randn(*shape), jnp.float32), jnp.asarray(rng.uniform(1e-3, 2e-3, shape[:2])),
                 jnp.asarray(rng.uniform(1e-3, 3e-3, col_shape), jnp.float32))


def test_add_rms_norm_quantize_is_the_residual_add_norm_and_quantise():
  rng = np.random.RandomState(0)
  B, E, eps = 5, 64, 1e-5
  x = jnp.asarray(rng.randn(B, 1, E), BF16)
  w = jnp.asarray(1 + 0.1 * rng.randn(E), BF16)
  delta = product(rng, (B, 1, E), (E,))
  x_new, rows = fp8_kernels.add_rms_norm_quantize(x, w, delta, eps=eps, interpret=True)
  plain = jax.jit(lambda x, d: x + fp8.apply_scales(d.y, d.row, d.col, BF16))
  ref_x = plain(x, delta)
  np.testing.assert_array_equal(np.asarray(x_new, np.float32), np.asarray(ref_x, np.float32))
  values, scale = jax.jit(lambda x, d: fp8.quantize_rows(rms_norm(plain(x, d), w, eps)))(x, delta)
  assert rows.values.shape == (B, 1, E) and rows.scale.shape == (B, 1)
  assert_rows_equal(rows, values, scale[..., 0])
  # no delta (the first layer's input: the embeddings): the norm and quantise alone, x returned as it is
  x0, rows0 = fp8_kernels.add_rms_norm_quantize(x, w, None, eps=eps, interpret=True)
  np.testing.assert_array_equal(np.asarray(x0, np.float32), np.asarray(x, np.float32))
  values, scale = jax.jit(lambda x: fp8.quantize_rows(rms_norm(x, w, eps)))(x)
  assert_rows_equal(rows0, values, scale[..., 0])


@pytest.mark.parametrize("F", [128, 7 * 32])  # one chunk; 7 chunks of 32 (8B's 14336 is 7 x 2048)
def test_swiglu_quantize_is_silu_gate_times_up_then_quantise(F):
  rng = np.random.RandomState(1)
  B = 6
  gate_up = product(rng, (B, 1, 2, F), (2, F))
  rows = fp8_kernels.swiglu_quantize(gate_up, BF16, interpret=True)

  @jax.jit
  def plain(p):  # `llama.MLP`'s fused path, then `fp8.dense`'s quantise
    both = fp8.apply_scales(p.y, p.row, p.col, BF16)
    return fp8.quantize_rows(jax.nn.silu(both[..., 0, :]) * both[..., 1, :])

  values, scale = plain(gate_up)
  assert rows.values.shape == (B, 1, F)
  assert_rows_equal(rows, values, scale[..., 0])


def test_quantize_heads_reads_the_group_rows_of_the_padded_attention_output():
  rng = np.random.RandomState(2)
  B, KV, G, Gp, D = 3, 2, 4, 16, 8
  out = jnp.asarray(rng.randn(B, KV, Gp, D), BF16)
  out = out.at[:, :, G:].set(1e4)  # the padding rows: never read (they would set the scale)
  rows = fp8_kernels.quantize_heads(out, G, interpret=True)
  values, scale = fp8.quantize_rows(out[:, :, :G].reshape(B, 1, KV * G * D))
  assert rows.values.shape == (B, 1, KV * G * D)
  assert_rows_equal(rows, values, scale[..., 0])


def test_an_all_zero_row_gets_scale_one():
  """A zero activation row (e.g. an idle slot's attention output) quantises to zeros with scale 1,
  as `fp8.quantize_rows` does, never 0/0."""
  out = jnp.zeros((2, 1, 4, 8), BF16).at[1].set(1.0)
  rows = fp8_kernels.quantize_heads(out, 4, interpret=True)
  np.testing.assert_array_equal(np.asarray(rows.scale[:, 0]), np.float32([1.0, np.float32(1.0) / np.float32(448)]))
  np.testing.assert_array_equal(np.asarray(rows.values[0].astype(jnp.float32)), 0.0)


def test_dense_takes_rows_quantised_before_it():
  """`fp8.dense` of `Rows` is `dense` of the array they quantise (the GEMM skips its own quantise)."""
  rng = np.random.RandomState(3)
  x = jnp.asarray(rng.randn(4, 1, 32), BF16)
  w, s = fp8.quantize_weight(jnp.asarray(rng.randn(32, 16), jnp.float32), 1)
  values, scale = fp8.quantize_rows(x)
  given = fp8.dense(fp8.Rows(values, scale[..., 0]), w, s, BF16)
  np.testing.assert_array_equal(np.asarray(given, np.float32), np.asarray(fp8.dense(x, w, s), np.float32))


def test_supported_sizes_are_powers_of_two_or_few_chunks():
  assert fp8_kernels.supported(2048, 8192, 32, 8, 64)  # 1B
  assert fp8_kernels.supported(4096, 14336, 32, 8, 128)  # 8B: its MLP row in 7 chunks of 2048
  assert not fp8_kernels.supported(896, 4864, 14, 2, 64)  # Qwen2.5-0.5B: hidden 7 x 128, group 7
  assert not fp8_kernels.supported(2048, 17 * 256, 32, 8, 64)  # 17 chunks
