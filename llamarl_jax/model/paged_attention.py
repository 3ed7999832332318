"""Decode attention over a paged KV cache: each row reads only its live blocks.

The pool (per layer) holds `k`, `v` of shape `[NB, bs, KV, D]`: NB blocks of `bs` positions. Keys
are stored after RoPE, so where a block sits in the pool says nothing about the positions it holds:
a row's sequence is any list of blocks, each filled from its start (a prefix of `bs` positions).
Several rows may list the same block (the n samples of one prompt share its prompt blocks).

One decode step is described by a flat list of TB entries (TB static; entries past the live ones
are padding):

  entry_row    int32 [TB]  the query row (batch index) the block is attended by; >= B for padding
  entry_block  int32 [TB]  the physical block (padding entries point at any valid block, e.g. a trash block)
  entry_len    int32 [TB]  valid positions in the block (a prefix of it); 0 for padding

The order of the entries is free (a row's entries need not be contiguous). The gathered bytes are
TB x bs x KV x D per layer for k and v: they follow each row's live length, rounded up to blocks,
not the longest row and not the pool's size.

Attention per entry, then a merge per row (flash-decoding's split-K with a shared row maximum):
  scores s[e, t, h] = q[row_e, h] . k[block_e, t, kv(h)] / sqrt(D)        (fp32, t < entry_len[e])
  M[r, h]  = max over the row's entries and positions (segment_max: exact, order-free)
  p[e, t, h] = exp(s - M[row_e, h]);  l[e, h] = sum_t p;  o[e, h] = sum_t p v[block_e, t]
  out[r, h] = sum_{e of r} o[e, h] / sum_{e of r} l[e, h]   (one-hot [B, TB] matmuls in fp32)
The probabilities are the dense softmax's exp(s - max) exactly; only the summation order of the
normaliser and the weighted values differs (fp32 rounding, ~1e-7 relative). The per-row sums are
matmuls with a 0/1 matrix rather than a scatter-add: deterministic on every backend (no atomics).
A row with no entries (idle) gets zeros.

Two ways to form the per-entry products (`implementation`), the same math:
  'reduce'  multiply-reduce over the gathered blocks: a GPU's XLA fuses each gather into the reduction
            that consumes it, so every live block is read once and nothing block-sized is written.
  'dot'     batched matmuls over the gathered blocks: the CPU's XLA materialises a gather whatever
            consumes it, and a multiply-reduce there also materialises the products, G = H / KV
            times the blocks; as matmuls it writes and reads each gathered block once more instead.
  'pallas'  one Pallas kernel (`paged_kernel`): each live block of each KV head read once, the
            softmax state in registers, no per-entry partials; needs the entries row-contiguous and
            row-ascending (`paged.live_entries` lists them so). Triton on a GPU; on the CPU it runs in
            Pallas' interpret mode (tests). Read-only: the new key and value are rotated and written
            by XLA ops before it (`write_and_attend`).
  'pallas_fused'  the same kernel doing the whole step's attention (`write_and_attend`): it rotates
            the new key, writes key and value into the pools in place and reads q from the fused
            projection; with fp8 weights the decode step's fp8 activation kernels go with it
            (`llama.Model.fused_fp8_decode`). Which of these the slot engine runs on one GPU
            follows `gpu_paths` (the paths that have passed on a GPU).
  'auto'    'reduce' on accelerators, 'dot' on the CPU: the platform of the program being traced,
            i.e. the default backend's unless `target_platform` names another (the slot engine names
            its mesh's, so a program compiled for an H100 from a CPU-only machine takes 'reduce'),
            unless `target_platform` also names an implementation (the slot engine's
            `paged_attention` setting).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

Array = jax.Array


class PagedLayer(NamedTuple):
  """One layer's view of a `PagedKVCache` (what `Attention` receives): pools and this step's plan."""

  k: Array             # [NB, bs, KV, D]
  v: Array             # [NB, bs, KV, D]
  write_block: Array   # int32 [B]
  write_offset: Array  # int32 [B]
  entry_row: Array     # int32 [TB]
  entry_block: Array   # int32 [TB]
  entry_len: Array     # int32 [TB]


@flax.struct.dataclass
class PagedKVCache:
  """A paged KV cache plus the plan of one decode step (one new token per row).

  k, v          per layer `[NB, bs, KV, D]` in the compute dtype (keys after RoPE)
  write_block   int32 [B]   block the row's new token's key/value is written to
  write_offset  int32 [B]   its position within that block (rows that must not write point at a
                            block nobody reads, e.g. a trash block)
  entry_row, entry_block, entry_len   int32 [TB]   the blocks each row attends to (see the module
                            docstring); they must include the block and position just written.
  """

  k: tuple[Array, ...]
  v: tuple[Array, ...]
  write_block: Array
  write_offset: Array
  entry_row: Array
  entry_block: Array
  entry_len: Array

  def layer(self, i: int) -> PagedLayer:
    return PagedLayer(self.k[i], self.v[i], self.write_block, self.write_offset, self.entry_row,
                      self.entry_block, self.entry_len)

  @property
  def block_size(self) -> int:
    return self.k[0].shape[1]


def write_token(pool: Array, new: Array, block: Array, offset: Array) -> Array:
  """The pool `[NB, bs, KV, D]` with row b's `new [B, KV, D]` written at (block[b], offset[b]).

  A scatter of B positions (in place when the pool is donated). Rows sharing a target (e.g. the
  trash block of idle rows) write in an unspecified order: point only rows nobody reads there.
  """
  return pool.at[block, offset].set(new.astype(pool.dtype), mode="promise_in_bounds")


def position_slots(entry_row: Array, entry_block: Array, entry_len: Array, rows: int,
                   block_size: int) -> tuple[Array, Array]:
  """Where each position of each row's sequence lies in the pool, from a step's entries (the exact
  decode's `exact.paged_attention` reads a row's positions in sequence order): (index `[rows, TB *
  block_size]` int32, the pool slot block * block_size + offset of position p of row r, 0 past the
  row's length; lengths `[rows]`, the row's positions, the new one included). Needs each row's
  entries in sequence order (`paged.live_entries` lists a row's prompt blocks, then its response
  blocks); padding entries (row >= rows, length 0) are dropped."""
  TB = entry_row.shape[0]
  row, length = entry_row.astype(jnp.int32), entry_len.astype(jnp.int32)
  e = jnp.arange(TB)
  before = (row[None, :] == row[:, None]) & (e[None, :] < e[:, None])  # [TB, TB]: entry j precedes i in i's row
  start = jnp.sum(jnp.where(before, length[None, :], 0), axis=1)  # integer sums: exact in any order
  j = jnp.arange(block_size, dtype=jnp.int32)
  pos = start[:, None] + j[None, :]  # [TB, bs]
  live = (j[None, :] < length[:, None]) & (row[:, None] < rows)
  target_row = jnp.where(live, row[:, None], rows)  # dead: out of range, dropped
  slots = entry_block.astype(jnp.int32)[:, None] * block_size + j[None, :]
  index = jnp.zeros((rows, TB * block_size), jnp.int32).at[target_row, pos].set(slots, mode="drop")
  lengths = jax.ops.segment_sum(length, jnp.minimum(row, rows), num_segments=rows + 1)[:rows]
  return index, lengths


PAGED_IMPLEMENTATIONS = ("auto", "reduce", "dot", "pallas", "pallas_fused")
KERNEL_FORMS = ("pallas", "pallas_fused")  # the forms that run `paged_kernel`


_TARGET_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("paged_target_platform", default=None)
_CHOSEN: contextvars.ContextVar[str] = contextvars.ContextVar("paged_implementation", default="auto")


@contextlib.contextmanager
def target_platform(platform: str | None, implementation: str = "auto"):
  """While tracing inside, 'auto' resolves for `platform` ('cpu', 'gpu', ...; None: the default
  backend): the platform of the devices the program is compiled for; and to `implementation` when
  that is not 'auto' (a caller's choice reaching the model's attention)."""
  if implementation not in PAGED_IMPLEMENTATIONS:
    raise ValueError(f"paged attention implementation must be one of {PAGED_IMPLEMENTATIONS}, got {implementation!r}")
  tokens = _TARGET_PLATFORM.set(platform), _CHOSEN.set(implementation)
  try:
    yield
  finally:
    _TARGET_PLATFORM.reset(tokens[0])
    _CHOSEN.reset(tokens[1])


def _platform(platform: str | None = None) -> str:
  return platform or _TARGET_PLATFORM.get() or jax.default_backend()


def interpret_kernels() -> bool:
  """Whether Pallas kernels traced now run in Pallas' interpret mode: the program is for the CPU."""
  return _platform() == "cpu"


def resolve_paged_implementation(implementation: str = "auto", platform: str | None = None) -> str:
  """'reduce', 'dot', 'pallas' or 'pallas_fused' (see the module docstring); 'auto' is `target_platform`'s choice if
  it made one, else 'dot' on the CPU, 'reduce' elsewhere (platform: this argument, else
  `target_platform`'s, else the default backend)."""
  if implementation not in PAGED_IMPLEMENTATIONS:
    raise ValueError(f"paged attention implementation must be one of {PAGED_IMPLEMENTATIONS}, got {implementation!r}")
  if implementation == "auto":
    chosen = _CHOSEN.get()
    if chosen != "auto":
      return chosen
    return "dot" if _platform(platform) == "cpu" else "reduce"
  return implementation


def paged_decode_attention(q: Array, k_pool: Array, v_pool: Array, entry_row: Array, entry_block: Array,
                           entry_len: Array, implementation: str = "auto") -> Array:
  """Attention of one query per row over the row's listed blocks (see the module docstring).

  q `[B, 1, H, D]`; k_pool, v_pool `[NB, bs, KV, D]`; entry_* int32 `[TB]`. Returns `[B, 1, H, D]`
  in q's dtype; scores, softmax and sums in fp32. implementation: 'auto', 'reduce', 'dot', or a
  kernel form ('pallas', 'pallas_fused': the read-only kernel here; it needs row-contiguous,
  row-ascending entries).
  """
  B, _, H, D = q.shape
  _, bs, KV, _ = k_pool.shape
  G = H // KV
  f32 = jnp.float32
  hi = jax.lax.Precision.HIGHEST  # fp32 products and sums (no TF32 on a GPU)
  form = resolve_paged_implementation(implementation)
  if form in KERNEL_FORMS:
    from llamarl_jax.model.paged_kernel import paged_decode_attention_kernel
    return paged_decode_attention_kernel(q, k_pool, v_pool, entry_row, entry_block, entry_len,
                                         interpret=_platform() == "cpu")
  dot = form == "dot"
  qe = jnp.take(q.reshape(B, KV, G, D), entry_row, axis=0, mode="clip")  # [TB, KV, G, D]
  qe = qe.astype(f32) * (1.0 / math.sqrt(D))
  kb = jnp.take(k_pool, entry_block, axis=0, mode="clip")  # [TB, bs, KV, D]
  vb = jnp.take(v_pool, entry_block, axis=0, mode="clip")  # [TB, bs, KV, D]
  if dot:
    scores = jnp.einsum("tkgd,tbkd->tbkg", qe, kb.astype(f32), precision=hi)  # [TB, bs, KV, G]
  else:
    scores = jnp.sum(qe[:, None] * kb[:, :, :, None, :].astype(f32), axis=-1)  # [TB, bs, KV, G]
  valid = (jnp.arange(bs)[None, :] < entry_len[:, None])[:, :, None, None]  # [TB, bs, 1, 1]
  scores = jnp.where(valid, scores, -jnp.inf)
  row_max = jax.ops.segment_max(jnp.max(scores, axis=1), entry_row, num_segments=B)  # [B, KV, G]
  m = jnp.take(row_max, entry_row, axis=0, mode="clip")[:, None]  # [TB, 1, KV, G]
  p = jnp.where(valid, jnp.exp(scores - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)  # padding / idle: 0
  if dot:  # stale positions past entry_len are finite (the pool holds only model outputs and zeros)
    o = jnp.einsum("tbkg,tbkd->tkgd", p, vb.astype(f32), precision=hi)  # [TB, KV, G, D]
  else:
    o = jnp.sum(jnp.where(valid[..., None], p[..., None] * vb[:, :, :, None, :].astype(f32), 0.0), axis=1)
  l = jnp.sum(p, axis=1)  # [TB, KV, G]
  onehot = (entry_row[None, :] == jnp.arange(B, dtype=entry_row.dtype)[:, None]).astype(f32)  # [B, TB]
  TB = entry_row.shape[0]
  num = jnp.dot(onehot, o.reshape(TB, H * D), precision=hi).reshape(B, H, D)
  den = jnp.dot(onehot, l.reshape(TB, H), precision=hi)[..., None]  # [B, H, 1]
  out = jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)
  return out.reshape(B, 1, H, D).astype(q.dtype)


def rope_rotate(x: Array, cos: Array, sin: Array) -> Array:
  """Rotate-half RoPE (HF convention) of x `[..., D]` with cos, sin broadcastable to it, in x's dtype:
  x * cos + concat(-x2, x1) * sin (`llama.apply_rope`'s math)."""
  x1, x2 = jnp.split(x, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x * cos.astype(x.dtype) + rotated * sin.astype(x.dtype)).astype(x.dtype)


def write_and_attend(q: Array | None, kv: Array, channels: tuple[int, int], cos: Array, sin: Array, layer: PagedLayer,
                     implementation: str = "auto", kv_scales=None, quantize_out: bool = False,
                     q_group: int | None = None):
  """One decode step's attention of a layer. q `[B, 1, H, D]` (after RoPE); kv `[B, KV, C, D]`: each
  row's new key (channel `channels[0]`, before RoPE) and value (`channels[1]`), e.g. the fused Q/K/V
  projection's output as it is; cos, sin `[B, D]` (the rows' RoPE, `llama.rope_cos_sin`). The key is
  rotated (`rope_rotate`), key and value are written at (layer.write_block, layer.write_offset)
  (`write_token`), then q attends over the row's listed blocks, the new position included
  (`paged_decode_attention`). Returns (out `[B, 1, H, D]`, k pool, v pool). The 'pallas_fused' form does
  it in one kernel (`paged_kernel`: rotation and write inside it, no scatter kernels, kv read where it
  lies; the new token's score in the same fp32 math, added to the online softmax last: summation
  order only). kv_scales: (row `[B]`, column `[KV, C, D]`) where kv is an fp8 GEMM's fp32 product
  (`fp8.dense_unscaled`): k and v are `fp8.apply_scales` of it in cos' dtype. quantize_out: out
  is `fp8.Rows` `[B, 1, H * D]`, quantised per row (`fp8.quantize_rows`; after the fused kernel
  `fp8_kernels.quantize_heads`, which reads the kernel's output as it lies). q_group: q is None and
  the queries are kv's channels [0, q_group) of each KV head, before RoPE (the fused projection's
  output as it lies): rotated as the key is (the Pallas kernel reads them from kv itself)."""
  k_at, v_at = channels
  if resolve_paged_implementation(implementation) == "pallas_fused":
    from llamarl_jax.model.paged_kernel import paged_decode_attention_kernel
    new = (kv, cos, sin, layer.write_block, layer.write_offset)
    return paged_decode_attention_kernel(q, layer.k, layer.v, layer.entry_row, layer.entry_block, layer.entry_len,
                                         new, kv_scales, channels=(k_at, v_at), interpret=interpret_kernels(),
                                         quantize_out=quantize_out, q_group=q_group)
  if kv_scales is not None:
    from llamarl_jax.model.fp8 import apply_scales
    kv = apply_scales(kv, kv_scales[0], kv_scales[1], cos.dtype)
  if q_group is not None:
    B, KV, _, D = kv.shape
    q = rope_rotate(kv[:, :, :q_group].reshape(B, 1, KV * q_group, D), cos[:, None, None], sin[:, None, None])
  k = rope_rotate(kv[:, :, k_at], cos[:, None], sin[:, None])
  ck = write_token(layer.k, k, layer.write_block, layer.write_offset)
  cv = write_token(layer.v, kv[:, :, v_at], layer.write_block, layer.write_offset)
  out = paged_decode_attention(q, ck, cv, layer.entry_row, layer.entry_block, layer.entry_len, implementation)
  if quantize_out:
    from llamarl_jax.model.fp8 import Rows, quantize_rows
    B, _, H, D = out.shape
    values, scale = quantize_rows(out.reshape(B, 1, H * D))
    out = Rows(values, scale[..., 0])
  return out, ck, cv


def paged_attention_reference(q: Array, k_pool: Array, v_pool: Array, entry_row: Array, entry_block: Array,
                              entry_len: Array) -> Array:
  """The same attention the dense way (tests): each row's listed positions copied into a dense
  `[B, TB * bs, KV, D]` sequence, then a plain masked softmax in fp32. Shapes as
  `paged_decode_attention`; rows with no entries give zeros."""
  B, _, H, D = q.shape
  TB = entry_row.shape[0]
  _, bs, KV, _ = k_pool.shape
  G = H // KV
  t = jnp.arange(bs)
  valid = (t[None, :] < entry_len[:, None]) & (entry_row[:, None] < B)  # [TB, bs]
  # each valid position's place in its row's dense sequence: entries in list order, then t
  flat_row = jnp.broadcast_to(entry_row[:, None], (TB, bs)).reshape(-1)
  flat_valid = valid.reshape(-1)
  onehot = (flat_row[:, None] == jnp.arange(B)[None, :]) & flat_valid[:, None]  # [TB*bs, B]
  place = jnp.cumsum(onehot, axis=0) - 1  # running count within each row
  slot = jnp.where(flat_valid, jnp.take_along_axis(place, jnp.minimum(flat_row, B - 1)[:, None], 1)[:, 0], TB * bs)
  keys = k_pool[entry_block].reshape(TB * bs, KV, D).astype(jnp.float32)
  vals = v_pool[entry_block].reshape(TB * bs, KV, D).astype(jnp.float32)
  dense_k = jnp.zeros((B, TB * bs, KV, D), jnp.float32).at[flat_row, slot].set(keys, mode="drop")
  dense_v = jnp.zeros((B, TB * bs, KV, D), jnp.float32).at[flat_row, slot].set(vals, mode="drop")
  lengths = jnp.sum(onehot, axis=0)  # [B]
  mask = jnp.arange(TB * bs)[None, :] < lengths[:, None]  # [B, TB*bs]
  qg = q.reshape(B, KV, G, D).astype(jnp.float32) / math.sqrt(D)
  scores = jnp.einsum("bkgd,bskd->bkgs", qg, dense_k, precision=jax.lax.Precision.HIGHEST)
  scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1)
  probs = jnp.where(lengths[:, None, None, None] > 0, probs, 0.0)
  out = jnp.einsum("bkgs,bskd->bkgd", probs, dense_v, precision=jax.lax.Precision.HIGHEST)
  return out.reshape(B, 1, H, D).astype(q.dtype)
