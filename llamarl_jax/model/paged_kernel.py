"""Paged decode attention as one Pallas kernel (GPU, Triton): each live block read once, no partials.

The XLA forms of `paged_attention.paged_decode_attention` gather every listed block, write per-entry
partial outputs `[TB, H, D]` in fp32 and merge them per row with a matmul; on the GPU compiler's
program that moves a multiple of the live KV bytes (measured: BENCHMARKS.md). This kernel runs one
program per (row, KV head): it walks the row's entries `P` blocks at a time, keeps the online-softmax
state (running max, normaliser, weighted values) in registers and writes only the row's output, so a
step reads each live block of each KV head once and nothing block-sized is written. Entries past a
row's count (the bucket's padding) are never read.

The decode step's call (`paged_attention.write_and_attend`) also does the step's KV write: the
program rotates its row's new key (RoPE), stores key and value into the pools (aliased: in place)
and attends to the new token from registers, so a layer's attention is this kernel alone (no scatter
kernels, no copy of k and v: they are read from the Q/K/V projection's output where they lie, an
fp8 GEMM's fp32 product with its scales applied here). With `q_group` the queries are read there too,
rotated and padded to 16 rows in the kernel, and the output is written unpadded (a power-of-two
group): no kernel before or after it for q or the output.

Entry list: the one `paged_attention` documents, with one more requirement: each row's entries are
contiguous and rows appear in increasing order (`paged.live_entries` lists them so); padding entries
(row >= B) come last. The XLA forms take any order.

Numerics: scores, softmax and sums in fp32 (the blocks are cast to fp32 before each product), the
same math as the XLA forms up to summation order; `interpret=True` runs the kernel with JAX ops on
any backend (the CPU tests compare it with the XLA forms and the dense reference).

The slot engine uses it on one GPU by default; its time per layer against XLA's 'reduce' form is
`make bench-gpu`'s profile section (BENCHMARKS.md).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from llamarl_jax import compat

Array = jax.Array

NEG = -0.7 * float(np.finfo(np.float32).max)  # a finite "minus infinity" for the running maximum


def _kernel(start_ref, count_ref, block_ref, len_ref, q_ref, k_ref, v_ref, *refs, per_step: int, scale: float,
            write: bool, scaled: bool, q_rope: bool, padded: int):
  """One (row, KV head): q_ref [Gp, D]; k_ref, v_ref [NB, bs, D] (this head's slice of the pools);
  start_ref, count_ref [] the row's first entry and entry count; block_ref, len_ref [TBp] (the entry
  list, padded so that `per_step` entries past any start stay in bounds); then o_ref [Gp, D].
  write: refs are (write block [], write offset [], new key before RoPE [D], new value [D], cos [D],
  sin [D], [scaled: the row's scale [], the key's and the value's column scales [D] each], o_ref, k
  out, v out (the pools, aliased)): the key is rotated (`llama.apply_rope`'s
  rotate-half, in the key's dtype), key and value are stored at (write block, write offset), that
  position is left out of the blocks' reads (whatever they see of the store) and the new token is
  attended from registers instead, after the listed blocks; a row with no entries (idle) attends to
  nothing. q_rope (with write): q_ref [G, D] is the row's queries of this KV head before RoPE (the
  first G channels of the projection's output, scaled like the key where `scaled`, the query's
  column scales [G, D] after the value's), rotated here (`paged_attention.rope_rotate`'s math) and
  padded to `padded` rows with zeros. o_ref: [Gp, D], or [G, D] when G is a power of two (no
  padding in the output)."""
  if write:
    wb_ref, wo_ref, kn_ref, vn_ref, cos_ref, sin_ref, *refs = refs
    if scaled:  # kv is an fp8 GEMM's fp32 product: its row scale and the key's / value's column scales
      sx_ref, ks_ref, vs_ref, *refs = refs
      if q_rope:
        qs_ref, *refs = refs
    o_ref, k_out_ref, v_out_ref = refs
    wb, wo = wb_ref[...], wo_ref[...]
    half = kn_ref.shape[0] // 2
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    dt = cos_ref.dtype  # the compute dtype
    if scaled:  # `fp8.apply_scales`: (y * row) * column, then the compute dtype
      sx = sx_ref[...]
      k1, k2 = ((kn_ref[lo] * sx) * ks_ref[lo]).astype(dt), ((kn_ref[hi] * sx) * ks_ref[hi]).astype(dt)
      v_new = ((vn_ref[...] * sx) * vs_ref[...]).astype(dt).astype(v_out_ref.dtype)  # [D]
    else:
      k1, k2 = kn_ref[lo], kn_ref[hi]
      v_new = vn_ref[...].astype(v_out_ref.dtype)  # [D]
    k_lo = (k1 * cos_ref[lo] + (-k2) * sin_ref[lo]).astype(k_out_ref.dtype)  # [D/2] each
    k_hi = (k2 * cos_ref[hi] + k1 * sin_ref[hi]).astype(k_out_ref.dtype)
    k_out_ref[wb, wo, lo] = k_lo
    k_out_ref[wb, wo, hi] = k_hi
    v_out_ref[wb, wo] = v_new
  else:
    o_ref, = refs
  start, count = start_ref[...], count_ref[...]
  bs = k_ref.shape[1]
  if q_rope:  # rotate-half of the queries, as x * cos + concat(-x2, x1) * sin, rows padded with zeros
    G, D = q_ref.shape
    rows = jnp.minimum(jnp.arange(padded, dtype=jnp.int32), G - 1)[:, None]  # [Gp, 1]
    cols = jnp.arange(D, dtype=jnp.int32)[None, :]  # [1, D]
    turned = (cols + half) % D  # concat(x2, x1)'s source column
    x, xt = q_ref[rows, cols], q_ref[rows, turned]  # [Gp, D]
    if scaled:
      x, xt = ((x * sx) * qs_ref[rows, cols]).astype(dt), ((xt * sx) * qs_ref[rows, turned]).astype(dt)
    rotated = jnp.where(cols < half, -xt, xt)
    qv = (x * cos_ref[...][None, :] + rotated * sin_ref[...][None, :]).astype(dt)
    qv = jnp.where(jnp.arange(padded, dtype=jnp.int32)[:, None] < G, qv, jnp.zeros_like(qv))
  else:
    qv = q_ref[...]
  q = qv.astype(jnp.float32) * scale  # [Gp, D]
  Gp, D = q.shape
  width = per_step * bs
  offsets = jnp.arange(per_step, dtype=jnp.int32)
  positions = jnp.arange(bs, dtype=jnp.int32)

  def body(i, carry):
    o, m, l = carry
    first = start + i * per_step
    blocks = block_ref[pl.ds(first, per_step)]  # [P]
    lens = jnp.where(i * per_step + offsets < count, len_ref[pl.ds(first, per_step)], 0)  # the row's only
    k = k_ref[blocks].reshape(width, D).astype(jnp.float32)  # [P * bs, D]
    v = v_ref[blocks].reshape(width, D).astype(jnp.float32)
    live = positions[None, :] < lens[:, None]  # [P, bs]
    if write:  # the new token's position: attended from registers below
      live = live & ~((blocks[:, None] == wb) & (positions[None, :] == wo))
    valid = live.reshape(1, width)
    s = jnp.where(valid, jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                             preferred_element_type=jnp.float32), NEG)  # [Gp, P * bs]
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0)
    alpha = jnp.exp(m - m_new)
    o = alpha[:, None] * o + jax.lax.dot_general(p, v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return o, m_new, alpha * l + jnp.sum(p, axis=1)

  init = (jnp.zeros((Gp, D), jnp.float32), jnp.full((Gp,), NEG, jnp.float32), jnp.zeros((Gp,), jnp.float32))
  o, m, l = jax.lax.fori_loop(0, (count + per_step - 1) // per_step, body, init)
  if write:  # one more online-softmax step: the new token (a running row always has entries)
    q1, q2 = jnp.split(qv, 2, axis=1)  # [Gp, D/2] each
    s = (jnp.sum((q1.astype(jnp.float32) * scale) * k_lo.astype(jnp.float32)[None, :], axis=1)
         + jnp.sum((q2.astype(jnp.float32) * scale) * k_hi.astype(jnp.float32)[None, :], axis=1))  # [Gp]
    vf = v_new.astype(jnp.float32)
    m_new = jnp.maximum(m, s)
    alpha, p = jnp.exp(m - m_new), jnp.exp(s - m_new)
    running = count > 0
    o = jnp.where(running, alpha[:, None] * o + p[:, None] * vf[None, :], o)
    l = jnp.where(running, alpha * l + p, l)
  o = jnp.where(l[:, None] > 0, o / jnp.where(l > 0, l, 1.0)[:, None], 0.0).astype(o_ref.dtype)
  if o_ref.shape[0] < Gp:  # the output unpadded: its first G rows (equal power-of-two parts)
    o = jnp.split(o, Gp // o_ref.shape[0], axis=0)[0]
  o_ref[...] = o


def kernel_bytes(*, num_rows: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 live_entries: int, itemsize: int, write: bool = True, source_itemsize: int | None = None) -> int:
  """Bytes one call of the kernel moves, counted from its structure (XLA's cost analysis does not see
  inside a custom call): every live entry's block of every KV head read once for k and once for v;
  q read ([rows, KV, Gp, D], padded) and the output written ([rows, KV, G, D], or Gp rows where G is
  not a power of two); with `write` (the decode step's call) each row's new key and value read and
  stored ([rows, KV, D] each, twice). source_itemsize: the new key and value and q (`q_group`: its
  G rows, unpadded) are read from the projection's output at this itemsize (4: an fp8 GEMM's fp32
  product). The entry list and spans are ints."""
  G = num_heads // num_kv_heads
  Gp = max(16, pl.next_power_of_2(G))
  Go = G if G == pl.next_power_of_2(G) else Gp
  src = itemsize if source_itemsize is None else source_itemsize
  kv = 2 * live_entries * block_size * num_kv_heads * head_dim * itemsize
  new = 2 * num_rows * num_kv_heads * head_dim * (src + itemsize) if write else 0
  q = num_rows * num_kv_heads * head_dim * (Gp * itemsize if source_itemsize is None else G * src)
  return int(kv + new + q + num_rows * num_kv_heads * Go * head_dim * itemsize)


def row_spans(entry_row: Array, num_rows: int) -> Array:
  """int32 `[num_rows, 2]`: each row's first entry and entry count in a row-contiguous, row-ascending
  entry list (entries of rows >= num_rows are padding)."""
  count = jnp.sum(entry_row[None, :] == jnp.arange(num_rows, dtype=entry_row.dtype)[:, None], axis=1,
                  dtype=jnp.int32)
  return jnp.stack([jnp.cumsum(count) - count, count], axis=1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("per_step", "interpret", "num_warps", "channels", "quantize_out",
                                             "q_group"))
def paged_decode_attention_kernel(q: Array | None, k_pool: Array, v_pool: Array, entry_row: Array, entry_block: Array,
                                  entry_len: Array, new=None, kv_scales=None, *, channels: tuple[int, int] = (0, 1),
                                  per_step: int = 4, interpret: bool = False, num_warps: int = 4,
                                  quantize_out: bool = False, q_group: int | None = None):
  """`paged_attention.paged_decode_attention` as one Pallas kernel (see the module docstring).

  q `[B, 1, H, D]`; k_pool, v_pool `[NB, bs, KV, D]`; entry_* int32 `[TB]`, row-contiguous and
  row-ascending. per_step: blocks per loop step (a power of two; per_step x bs positions at a time).
  Returns `[B, 1, H, D]` in q's dtype. interpret: run the kernel with JAX ops (any backend).
  new: (kv `[B, KV, C, D]`, cos, sin `[B, D]`, write_block, write_offset int32 `[B]`): the decode
  step's write in the same kernel (`paged_attention.write_and_attend`, no scatter kernels): each
  row's new key (channel `channels[0]` of kv, before RoPE; cos, sin `llama.rope_cos_sin`'s in its
  dtype) and value (channel `channels[1]`) stored at (write_block, write_offset) of the pools
  (updated in place: aliased) and attended; the entries must list that position (as
  `paged_decode_attention`'s do after the write). kv may be the fused Q/K/V projection's output as
  it is (no copy of k or v is made). Returns (out, k_pool, v_pool) then. kv_scales: (row `[B]`,
  column `[KV, C, D]`) where kv is an fp8 GEMM's fp32 product (`fp8.dense_unscaled`): k and v are
  `fp8.apply_scales` of it in cos' dtype. quantize_out: out is `fp8.Rows` `[B, 1, H * D]` instead,
  quantised per row by a second kernel reading the output (`fp8_kernels.quantize_heads`).
  q_group (with new): q is None and the queries are kv's channels [0, q_group) of each KV head,
  before RoPE (the fused projection's output as it lies, scaled by kv_scales' columns like k),
  rotated and padded inside the kernel (no kernel before it for q).
  """
  NB, bs, KV, D = k_pool.shape
  if q_group is not None:
    if new is None or q is not None:
      raise ValueError("q_group reads the queries from new's kv: pass new and q=None")
    B, G = new[0].shape[0], q_group
  else:
    B, G = q.shape[0], q.shape[2] // KV
  H = G * KV
  dtype = (q if q_group is None else new[1]).dtype  # the compute dtype (cos' with q_group)
  if per_step < 1 or per_step & (per_step - 1):
    raise ValueError(f"per_step must be a power of two, got {per_step}")
  Gp = max(16, pl.next_power_of_2(G))  # the GPU's matrix units take at least 16 rows: q padded with zeros
  Go = G if G == pl.next_power_of_2(G) else Gp  # the output's rows per KV head: unpadded where Triton can slice
  TB = entry_row.shape[0]
  TBp = pl.next_power_of_2(TB + per_step)  # loads of per_step entries from any start stay in bounds
  blocks = jnp.pad(entry_block.astype(jnp.int32), (0, TBp - TB))
  lens = jnp.pad(entry_len.astype(jnp.int32), (0, TBp - TB))
  spans = row_spans(entry_row, B)
  if q_group is None:
    qg = jnp.pad(q.reshape(B, KV, G, D), ((0, 0), (0, 0), (0, Gp - G), (0, 0)))
  starts, counts = spans[:, 0], spans[:, 1]
  itemsize = jnp.dtype(k_pool.dtype).itemsize
  cost = pl.CostEstimate(  # at most every listed block of every head once, plus q and the output
      flops=int(4 * TB * bs * H * D), transcendentals=int(TB * bs * H),
      bytes_accessed=int(2 * TB * bs * KV * D * itemsize + 2 * B * KV * Gp * D * jnp.dtype(dtype).itemsize
                         + 2 * TBp * 4 + B * 8))
  compiler_params = None
  if not interpret:
    compiler_params = compat.pallas_triton_compiler_params(num_warps=num_warps, num_stages=2)
  row = pl.BlockSpec((None,), lambda r, h: (r,))  # one int per row
  pool = pl.BlockSpec((NB, bs, None, D), lambda r, h: (0, 0, h, 0))  # a pool, this KV head
  head = pl.BlockSpec((None, None, Gp, D), lambda r, h: (r, h, 0, 0))  # [Gp, D] of the row's head group
  group = pl.BlockSpec((None, None, G, D), lambda r, h: (r, h, 0, 0))  # [G, D]: the first G channels
  in_specs = [row, row,  # the row's first entry and entry count
              pl.BlockSpec((TBp,), lambda r, h: (0,)), pl.BlockSpec((TBp,), lambda r, h: (0,)),  # entry blocks, lengths
              head if q_group is None else group, pool, pool]
  out_specs = pl.BlockSpec((None, None, Go, D), lambda r, h: (r, h, 0, 0))
  out_shape = jax.ShapeDtypeStruct((B, KV, Go, D), dtype)
  args, aliases = [starts, counts, blocks, lens, qg if q_group is None else new[0], k_pool, v_pool], {}
  if new is not None:
    kv, cos, sin, write_block, write_offset = new
    k_at, v_at = channels
    in_specs += [row, row,
                 pl.BlockSpec((None, None, None, D), lambda r, h: (r, h, k_at, 0)),  # the row's new key, this head
                 pl.BlockSpec((None, None, None, D), lambda r, h: (r, h, v_at, 0)),  # and value
                 pl.BlockSpec((None, D), lambda r, h: (r, 0)), pl.BlockSpec((None, D), lambda r, h: (r, 0))]
    args += [write_block.astype(jnp.int32), write_offset.astype(jnp.int32), kv, kv, cos, sin]
    if kv_scales is not None:
      row_scale, col_scale = kv_scales
      in_specs += [row, pl.BlockSpec((None, None, D), lambda r, h: (h, k_at, 0)),
                   pl.BlockSpec((None, None, D), lambda r, h: (h, v_at, 0))]
      args += [row_scale.astype(jnp.float32), col_scale.astype(jnp.float32), col_scale.astype(jnp.float32)]
      if q_group is not None:  # the queries' column scales
        in_specs.append(pl.BlockSpec((None, G, D), lambda r, h: (h, 0, 0)))
        args.append(col_scale.astype(jnp.float32))
    out_specs = [out_specs, pool, pool]
    out_shape = [out_shape, jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype),
                 jax.ShapeDtypeStruct(v_pool.shape, v_pool.dtype)]
    aliases = {5: 1, 6: 2}  # the pools, updated in place
  out = pl.pallas_call(
      functools.partial(_kernel, per_step=per_step, scale=1.0 / math.sqrt(D), write=new is not None,
                        scaled=kv_scales is not None, q_rope=q_group is not None, padded=Gp),
      grid=(B, KV), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape, input_output_aliases=aliases,
      interpret=interpret, compiler_params=compiler_params, cost_estimate=cost,
      name=f"paged_decode_attention_bs{bs}_p{per_step}",
  )(*args)
  pools = () if new is None else out[1:]
  out = out if new is None else out[0]
  if quantize_out:
    from llamarl_jax.model.fp8_kernels import quantize_heads
    out = quantize_heads(out, G, interpret=interpret)
  else:
    out = out[:, :, :G].reshape(B, 1, H, D)  # a view where the output is unpadded (Go = G)
  return (out, *pools) if new is not None else out
