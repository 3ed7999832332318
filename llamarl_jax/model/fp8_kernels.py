"""Pallas kernels that end in an fp8 GEMM's input: an activation's producer, its per-token amax and
its cast to float8_e4m3fn in one kernel (the fp8 decode step over a paged cache, `Block.decode_fp8`).

`fp8.dense` quantises its input per row (amax / 448); compiled for a GPU, XLA runs the producer of
that input (the norm, the SwiGLU, the attention output's slice), the row amax and the cast as two or
three kernels, each re-reading the activation. Each kernel here reads its inputs once, keeps the row
in registers and writes the fp8 row and its scale:

  add_rms_norm_quantize   residual + an fp8 GEMM's product (its scales applied, `fp8.apply_scales`),
                          RMSNorm, quantise: the residual stream and the next GEMM's input
  swiglu_quantize         the fused gate/up GEMM's product -> silu(gate) * up, quantise
  quantize_heads          the paged attention kernel's output `[B, KV, G or Gp, D]` -> its first G
                          rows of each head group (the padding never read), quantised per row

The arithmetic is the plain path's op for op (`layers.rms_norm`, `jax.nn.silu`, `fp8.quantize_rows`,
the same dtypes and rounding points): in Pallas' interpret mode (the CPU) the results are the plain
path's compiled as one program (XLA may keep a bfloat16 intermediate in fp32 there, and does alike
for both); a GPU's Triton reductions (the norm's mean) sum in another order. One program per row;
Triton loads need power-of-two sizes: the norm's and the attention output's rows and the head group
G are powers of two, the SwiGLU's row a few power-of-two chunks (`supported`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from llamarl_jax import compat
from llamarl_jax.model import fp8
from llamarl_jax.model.fp8 import Product, Rows

Array = jax.Array


def _pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def _chunk(width: int) -> int:
  """The largest power of two dividing `width`: `swiglu_quantize` loads a row in chunks of it."""
  return width & -width


MAX_CHUNKS = 16  # `swiglu_quantize` holds a row's chunks in registers: at most this many


def supported(hidden: int, intermediate: int, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
  """Whether the kernels take a model of these sizes: the rows the norm and the attention output's
  kernels load (hidden, heads x head_dim) and the head group (heads / KV heads) powers of two, the
  MLP's row (intermediate) at most `MAX_CHUNKS` power-of-two chunks (8B's 14336: 7 x 2048)."""
  return (all(_pow2(n) for n in (hidden, num_heads * head_dim, num_heads // num_kv_heads, head_dim))
          and intermediate // _chunk(intermediate) <= MAX_CHUNKS)


def _quantize(h: Array) -> tuple[Array, Array]:
  """`fp8.quantize_rows` of one row h `[...]` (all of it one row): (float8_e4m3fn values, fp32 scale [])."""
  hf = h.astype(jnp.float32)
  scale = jnp.max(jnp.abs(hf)) / fp8.E4M3_MAX
  scale = jnp.where(scale == 0, 1.0, scale)
  return (hf / scale).astype(fp8.FP8), scale


def _compiler_params(interpret: bool, num_warps: int):
  if interpret:
    return None
  return compat.pallas_triton_compiler_params(num_warps=num_warps, num_stages=1)


_ROW = pl.BlockSpec((None,), lambda r: (r,))  # one scalar per row


def _row_spec(width: int) -> pl.BlockSpec:
  return pl.BlockSpec((None, width), lambda r: (r, 0))


def _whole(shape) -> pl.BlockSpec:
  return pl.BlockSpec(tuple(shape), lambda r: (0,) * len(shape))


def _norm_kernel(*refs, eps: float, added: bool):
  if added:
    x_ref, y_ref, row_ref, col_ref, w_ref, x_out, q_out, s_out = refs
  else:
    x_ref, w_ref, q_out, s_out = refs
  x = x_ref[...]
  dt = x.dtype
  if added:  # the residual add: x + apply_scales(y, row, col) in x's dtype
    x = x + ((y_ref[...] * row_ref[...]) * col_ref[...]).astype(dt)
    x_out[...] = x
  xf = x.astype(jnp.float32)  # `layers.rms_norm`
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf) + eps)
  q_out[...], s_out[...] = _quantize(w_ref[...].astype(dt) * xf.astype(dt))


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "num_warps"))
def add_rms_norm_quantize(x: Array, norm_scale: Array, delta: Product | None, *, eps: float, interpret: bool = False,
                          num_warps: int = 4) -> tuple[Array, Rows]:
  """x `[..., E]` the residual stream; delta: an fp8 GEMM's product `[..., E]` to add first (its
  value in x's dtype, `Product.value`), or None. Returns (x + delta `[..., E]` (x itself when delta is
  None), `Rows` of rms_norm(x + delta, norm_scale, eps) quantised per row): `layers.rms_norm` then
  `fp8.quantize_rows`, in one kernel."""
  lead, E = x.shape[:-1], x.shape[-1]
  N = x.size // E
  args, specs = [x.reshape(N, E)], [_row_spec(E)]
  if delta is not None:
    args += [delta.y.reshape(N, E).astype(jnp.float32), delta.row.reshape(N).astype(jnp.float32),
             delta.col.reshape(E).astype(jnp.float32)]
    specs += [_row_spec(E), _ROW, _whole((E,))]
  args.append(norm_scale)
  specs.append(_whole((E,)))
  out_shape = [jax.ShapeDtypeStruct((N, E), fp8.FP8), jax.ShapeDtypeStruct((N,), jnp.float32)]
  out_specs = [_row_spec(E), _ROW]
  if delta is not None:
    out_shape.insert(0, jax.ShapeDtypeStruct((N, E), x.dtype))
    out_specs.insert(0, _row_spec(E))
  out = pl.pallas_call(
      functools.partial(_norm_kernel, eps=eps, added=delta is not None), grid=(N,), in_specs=specs,
      out_specs=out_specs, out_shape=out_shape, interpret=interpret,
      compiler_params=_compiler_params(interpret, num_warps), name="fp8_add_rms_norm_quantize")(*args)
  x_new, (q, s) = (x, out) if delta is None else (out[0].reshape(x.shape), out[1:])
  return x_new, Rows(q.reshape(x.shape), s.reshape(lead))


def _swiglu_kernel(y_ref, row_ref, col_ref, q_out, s_out, *, dtype, chunk: int):
  r = row_ref[...]
  hs = []
  for c in range(y_ref.shape[1] // chunk):  # the row in power-of-two chunks, all held (one read)
    at = pl.ds(c * chunk, chunk)
    gate = ((y_ref[0, at] * r) * col_ref[0, at]).astype(dtype)  # `fp8.apply_scales` of each half
    up = ((y_ref[1, at] * r) * col_ref[1, at]).astype(dtype)
    g = gate.astype(jnp.float32)  # `jax.nn.silu` (x * sigmoid(x)) with its products in fp32 (Triton
    silu = (g * jax.nn.sigmoid(g)).astype(dtype)  # has no bfloat16 division), rounded to dtype as XLA's is
    hs.append((silu * up).astype(jnp.float32))
  if len(hs) == 1:
    q_out[...], s_out[...] = _quantize(hs[0])
    return
  amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(h)) for h in hs])
  scale = amax / fp8.E4M3_MAX  # `_quantize` over the whole row (a max: the same in any order)
  scale = jnp.where(scale == 0, 1.0, scale)
  for c, h in enumerate(hs):
    q_out[pl.ds(c * chunk, chunk)] = (h / scale).astype(fp8.FP8)
  s_out[...] = scale


@functools.partial(jax.jit, static_argnames=("dtype", "interpret", "num_warps"))
def swiglu_quantize(gate_up: Product, dtype, *, interpret: bool = False, num_warps: int = 8) -> Rows:
  """gate_up: the fused gate/up GEMM's product, y `[..., 2, F]` (gate then up); its value in `dtype`
  -> `Rows` of silu(gate) * up `[..., F]` quantised per row (`llama.MLP`'s SwiGLU, then
  `fp8.quantize_rows`), in one kernel: F in power-of-two chunks (`_chunk`), at most `MAX_CHUNKS`."""
  lead, F = gate_up.y.shape[:-2], gate_up.y.shape[-1]
  if F // _chunk(F) > MAX_CHUNKS:
    raise ValueError(f"swiglu_quantize takes rows of at most {MAX_CHUNKS} power-of-two chunks; {F} is "
                     f"{F // _chunk(F)} x {_chunk(F)}")
  N = gate_up.y.size // (2 * F)
  q, s = pl.pallas_call(
      functools.partial(_swiglu_kernel, dtype=jnp.dtype(dtype), chunk=_chunk(F)), grid=(N,),
      in_specs=[pl.BlockSpec((None, 2, F), lambda r: (r, 0, 0)), _ROW, _whole((2, F))],
      out_specs=[_row_spec(F), _ROW],
      out_shape=[jax.ShapeDtypeStruct((N, F), fp8.FP8), jax.ShapeDtypeStruct((N,), jnp.float32)],
      interpret=interpret, compiler_params=_compiler_params(interpret, num_warps), name="fp8_swiglu_quantize",
  )(gate_up.y.reshape(N, 2, F).astype(jnp.float32), gate_up.row.reshape(N).astype(jnp.float32),
    gate_up.col.reshape(2, F).astype(jnp.float32))
  return Rows(q.reshape(*lead, F), s.reshape(lead))


def _heads_kernel(o_ref, q_out, s_out):
  q_out[...], s_out[...] = _quantize(o_ref[...])


@functools.partial(jax.jit, static_argnames=("group", "interpret", "num_warps"))
def quantize_heads(out: Array, group: int, *, interpret: bool = False, num_warps: int = 4) -> Rows:
  """out `[B, KV, Gp, D]`: per row and KV head, Gp >= group rows of which the first `group` are the
  heads' outputs (the paged attention kernel's padded output) -> `Rows` of the heads' outputs
  `[B, 1, KV * group * D]` (the output projection's input) quantised per row, in one kernel (the
  padding is never read)."""
  B, KV, Gp, D = out.shape
  if Gp % group:
    raise ValueError(f"the padded head group ({Gp}) must be a multiple of the group ({group})")
  q, s = pl.pallas_call(
      _heads_kernel, grid=(B,), in_specs=[pl.BlockSpec((None, KV, group, D), lambda r: (r, 0, 0, 0))],
      out_specs=[pl.BlockSpec((None, KV, group, D), lambda r: (r, 0, 0, 0)), _ROW],
      out_shape=[jax.ShapeDtypeStruct((B, KV, group, D), fp8.FP8), jax.ShapeDtypeStruct((B,), jnp.float32)],
      interpret=interpret, compiler_params=_compiler_params(interpret, num_warps), name="fp8_quantize_heads",
  )(out)
  return Rows(q.reshape(B, 1, KV * group * D), s.reshape(B, 1))


KERNEL_NAMES = ("fp8_add_rms_norm_quantize", "fp8_swiglu_quantize", "fp8_quantize_heads")  # `pallas_call`s' names
