"""The attention math the decoder's modules call (pure functions): RoPE at each token's positions,
attention of one query per row over a KV cache (the decode step), and causal attention within the
segments of packed rows (`Segments`: the trainer). The paged decode attention is `paged_attention`'s.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp

from llamarl_jax import compat
from llamarl_jax.model.paged_attention import rope_rotate

Array = jax.Array


def rope_cos_sin(positions: Array, inv_freq: Array, scale: float = 1.0) -> tuple[Array, Array]:
  """fp32 cos, sin `[*positions.shape, D]` of RoPE at `positions`, times `scale`."""
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [..., D/2]
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: Array, positions: Array, inv_freq: Array, scale: float = 1.0) -> Array:
  """Rotate-half RoPE (HF convention). x `[B, T, H, D]`, positions `[B, T]`; cos, sin times `scale`."""
  cos, sin = rope_cos_sin(positions, inv_freq, scale)
  return rope_rotate(x, cos[:, :, None, :], sin[:, :, None, :])


def decode_attention(q: Array, k: Array, v: Array, mask: Array) -> Array:
  """Attention of one query per row over the cache, reading `k`, `v` in their cache layout.

  q `[B, 1, H, D]`; k, v `[B, S, KV, D]`; mask `[B, S]` bool. Returns `[B, 1, H, D]`. Written as
  multiply-reduce (fp32 accumulation) rather than a batched matmul: a dot with batch dims (B, KV)
  makes XLA transpose the whole cache to `[B, KV, S, D]` every decode step, which costs more than
  the attention itself.
  """
  B, _, H, D = q.shape
  KV = k.shape[2]
  qg = q.reshape(B, KV, H // KV, D).astype(jnp.float32) * (1.0 / math.sqrt(D))
  scores = jnp.sum(qg[:, None] * k[:, :, :, None, :].astype(jnp.float32), axis=-1)  # [B, S, KV, G]
  scores = jnp.where(mask[:, :, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=1)
  out = jnp.sum(probs[..., None] * v[:, :, :, None, :].astype(jnp.float32), axis=1)  # [B, KV, G, D]
  return out.reshape(B, 1, H, D).astype(q.dtype)


@flax.struct.dataclass
class Segments:
  """Packed rows: several sequences (segments) laid end to end in each row of `[B, T]` tokens.

  ids `[B, T]` int32: the segment of each position (equal ids = one sequence; 0 at a row's unused
  end, after its last segment). seqlens `[B, S]` int32: each row's segment lengths in
  order, -1 past its last segment; offsets `[B, S + 1]` int32: their first positions, -1 past the
  last (the form cuDNN's packed fused attention takes). Positions restart at 0 in each segment (the
  caller's `positions`)."""

  ids: Array
  seqlens: Array
  offsets: Array


def segment_attention(q: Array, k: Array, v: Array, segments: Segments, implementation: str) -> Array:
  """Causal attention that never crosses a segment: q `[B, T, H, D]`, k, v `[B, T, KV, D]` ->
  `[B, T, H, D]`. 'cudnn': cuDNN's fused kernel over packed segments (per-segment lengths and offsets,
  nothing `[T, T]` in memory; JAX offers it on Hopper GPUs and newer), the outputs outside every
  segment set to 0 (the kernel does not define them); 'xla': a `[B, T, T]` mask of equal segment ids
  under the causal one."""
  if implementation == "cudnn":
    cudnn_attention, MaskType = compat.cudnn_dot_product_attention()
    out = cudnn_attention(q, k, v, None, None, segments.seqlens, segments.seqlens, segments.offsets,
                          segments.offsets, scale=1.0 / math.sqrt(q.shape[-1]), mask_type=MaskType.CAUSAL)
    return jnp.where((segments.ids > 0)[:, :, None, None], out, jnp.zeros((), out.dtype))
  same = segments.ids[:, :, None] == segments.ids[:, None, :]
  return jax.nn.dot_product_attention(q, k, v, mask=same[:, None], is_causal=True, implementation="xla")
