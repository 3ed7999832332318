"""Llama 3 / 3.1 / 3.2, the dense Qwen2 / Qwen2.5 / Qwen3 families and Qwen3-MoE in Flax NNX: the
modules (Attention, MLP, MoE, Block, Llama, built of `model.layers`' parameters, projections and
RMSNorm) and the model's forwards (prefill, decode over a KV cache, decode over a paged cache).

One model file (gpt-fast style) over one config dataclass, `model.config.ModelConfig`, whose
`model_type` sets the attention block's switches (`model.config.FAMILIES`); a sparse layer
(`ModelConfig.is_moe_layer`) replaces the MLP by experts (`MoE`, `model.moe`). The trainer's scanned
forward over the same `Block` is `model.forward`.

Every parameter carries a `logical_axes` metadata tuple (`vocab`, `embed`, `heads`, `kv_heads`,
`head_dim`, `mlp`, `norm`) that `llamarl_jax.parallel` maps onto mesh axes (fsdp, tp).

Weight layouts (ours, einsum-friendly; `hf.py` converts from/to the HF `[out, in]` layout):
  embed      [vocab, embed]
  wq         [embed, heads, head_dim]      wk, wv [embed, kv_heads, head_dim]
  bq         [heads, head_dim]             bk, bv [kv_heads, head_dim]       (qwen2 only)
  q_norm     [head_dim]                    k_norm [head_dim]                 (qwen3 only)
  wo         [heads, head_dim, embed]
  w_gate     [embed, mlp]   w_up [embed, mlp]   w_down [mlp, embed]
  MoE layer: router [embed, experts]; w_gate, w_up [expert, embed, mlp]; w_down [expert, mlp, embed]
             (logical axis `expert` for the experts; `mlp` is moe_intermediate_size there)
  lm_head    [embed, vocab]  (absent when embeddings are tied, and with a score head)
  score      [embed, num_labels]  (a score head, `num_labels` >= 1, instead of lm_head: HF's
             `*ForSequenceClassification`, no bias; with one label a reward model or a critic)
The generator's serving layout (`WeightLayout`, built by `model.serving.serving_params`) replaces
  wq, wk, wv by wqkv [embed, kv_heads, heads / kv_heads + 2, head_dim] (each KV head's group of
  query heads, then its key, then its value: one GEMM of (heads + 2 kv_heads) * head_dim columns whose
  shards over `kv_heads` hold their own q, k, v), bq, bk, bv by bqkv [kv_heads, group + 2, head_dim],
  and w_gate, w_up by w_gate_up [embed, 2, mlp] (one GEMM of 2 * mlp columns, sharded over `mlp`).
  With `WeightLayout.fp8` (the fp8 generator, `model.fp8`) every projection is float8_e4m3fn with a
  `<name>_scale` [*out] fp32 beside it (e.g. wo_scale [embed]) and runs as an fp8 GEMM (`layers.dense`); a
  MoE layer's experts too, per expert (w_down_scale [expert, embed]; weight-only, `moe.ScaledExperts`), the
  router in the compute dtype.
  With `WeightLayout.fp8_lm_head` the model holds lm_head [embed, vocab] in float8_e4m3fn and
  lm_head_scale [vocab] (tied embeddings too: a copy for the logits; the lookup reads `embed`).

KV cache layout (`KVCache`): per layer `k`, `v` of shape `[batch, max_len, kv_heads, head_dim]`
in the compute dtype, and `index`: the cache slot the next token is written to. A scalar `index`
is shared by all rows (the static sampler: shorter prompts are left-padded and the caller's
`attention_mask` marks the padded slots invalid). An `index` of shape `[batch]` gives every row its
own write slot (the slot engine: each row is an independent sequence at its own length; the causal
mask then follows each row's index). RoPE uses each token's own `positions`, so a left-padded prompt
produces the same continuation as the same prompt alone. A `PagedKVCache` (`paged_attention.py`:
per-layer pools of fixed-size blocks plus one step's write locations and list of live blocks) takes
one token per row: the decode step of the slot engine, reading only each row's live blocks.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from llamarl_jax.model import exact as exact_lib
from llamarl_jax.model import fp8 as fp8_lib
from llamarl_jax.model import fp8_kernels
from llamarl_jax.model import moe as moe_lib
from llamarl_jax.model import paged_attention
from llamarl_jax.model.attention import Segments, apply_rope, decode_attention, rope_cos_sin, segment_attention
from llamarl_jax.model.config import HF_LAYOUT, ModelConfig, WeightLayout, rope_attention_factor, rope_frequencies
from llamarl_jax.model.layers import LoraLayer, RMSNorm, dense, param, projection, with_lora
from llamarl_jax.model.paged_attention import PagedKVCache, PagedLayer, rope_rotate, write_and_attend

Array = jax.Array


@flax.struct.dataclass
class KVCache:
  """Preallocated KV cache: per-layer `[batch, max_len, kv_heads, head_dim]` and the write slot.

  `index`: int32 scalar (one write slot for all rows) or int32 `[batch]` (a write slot per row).
  """

  k: tuple[Array, ...]
  v: tuple[Array, ...]
  index: Array  # int32 [] or [batch]

  @classmethod
  def init(cls, config: ModelConfig, batch: int, max_len: int, dtype=None) -> "KVCache":
    dtype = jnp.dtype(dtype or config.dtype)
    shape = (batch, max_len, config.num_kv_heads, config.head_dim)
    zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
    return cls(k=zeros(), v=zeros(), index=jnp.zeros((), jnp.int32))

  @property
  def max_len(self) -> int:
    return self.k[0].shape[1]


class Attention(nnx.Module):
  def __init__(self, config: ModelConfig, rngs: nnx.Rngs, fused: bool = False, fp8: bool = False):
    c, pd = config, jnp.dtype(config.param_dtype)
    self.config, self.fused = config, fused
    d, h, kv, hd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    proj = functools.partial(projection, self, rngs=rngs, dtype=pd, fp8=fp8)
    if fused:  # the serving layout: one [embed, kv_heads, group + 2, head_dim] matrix (module docstring)
      proj("wqkv", shape=(d, kv, h // kv + 2, hd), axes=("embed", "kv_heads", None, "head_dim"), scale=1 / math.sqrt(d))
    else:
      proj("wq", shape=(d, h, hd), axes=("embed", "heads", "head_dim"), scale=1 / math.sqrt(d))
      proj("wk", shape=(d, kv, hd), axes=("embed", "kv_heads", "head_dim"), scale=1 / math.sqrt(d))
      proj("wv", shape=(d, kv, hd), axes=("embed", "kv_heads", "head_dim"), scale=1 / math.sqrt(d))
    proj("wo", shape=(h, hd, d), axes=("heads", "head_dim", "embed"), scale=1 / math.sqrt(h * hd), n_in=2)
    if c.qkv_bias and fused:
      self.bqkv = nnx.Param(jnp.zeros((kv, h // kv + 2, hd), pd), logical_axes=("kv_heads", None, "head_dim"))
    elif c.qkv_bias:  # zeros, as HF initialises them
      self.bq = nnx.Param(jnp.zeros((h, hd), pd), logical_axes=("heads", "head_dim"))
      self.bk = nnx.Param(jnp.zeros((kv, hd), pd), logical_axes=("kv_heads", "head_dim"))
      self.bv = nnx.Param(jnp.zeros((kv, hd), pd), logical_axes=("kv_heads", "head_dim"))
    if c.qk_norm:  # one [head_dim] scale shared by all heads, replicated like head_dim
      self.q_norm = RMSNorm(hd, c.rms_norm_eps, pd, axis="head_dim", exact=c.exact)
      self.k_norm = RMSNorm(hd, c.rms_norm_eps, pd, axis="head_dim", exact=c.exact)

  def __call__(self, x, positions, inv_freq, mask, layer_cache, lengths=None, implementation="xla", lora=None):
    """x `[B, T, E]`; mask `[B, T, S]` bool; layer_cache None, (k, v, index), or a `PagedLayer`
    (one token per row, mask unused: the new key/value is written to its page and attention reads
    the listed live blocks, `paged_attention.write_and_attend`).

    With `lengths` `[B]` (and mask None, no cache) the rows are right-padded sequences from position
    0: causal attention with per-row lengths by `jax.nn.dot_product_attention(implementation=...)`,
    the form cuDNN's fused kernel takes ('cudnn'), or XLA's ('xla'). Outputs past a row's length
    are not meaningful. With `lengths` a `Segments`, each row packs several sequences: causal
    attention within each (`segment_attention`). lora: `LoraLayer` adapters of this block's projections (the trainer's
    unmerged LoRA forward), or None.

    x may be `fp8.Rows` (fp8 weights, a `PagedLayer`: `Block.decode_fp8`): x quantised before, and
    the output is the O projection's `fp8.Product` (its scales not applied), its input quantised by
    `fp8_kernels.quantize_heads` where the attention is the fused Pallas kernel."""
    rows_in = isinstance(x, fp8_lib.Rows)
    dt, c = (jnp.dtype(self.config.dtype) if rows_in else x.dtype), self.config
    source = None  # where the fused projection's k and v lie (`_fused_qkv`)
    if c.exact and (self.fused or rows_in):
      raise ValueError("ModelConfig.exact computes Hugging Face's projections in the compute dtype; this model "
                       "holds a fused or fp8 layout (build the generator with serving.serving_layout)")
    if self.fused:
      q, k, v, source = self._fused_qkv(x, lora, dt)
    else:
      proj = functools.partial(jnp.einsum, "bte,ehd->bthd")
      q = with_lora(dense(x, self, "wq", proj, dt, exact=c.exact), x, "wq", lora)
      k = with_lora(dense(x, self, "wk", proj, dt, exact=c.exact), x, "wk", lora)
      v = with_lora(dense(x, self, "wv", proj, dt, exact=c.exact), x, "wv", lora)
      if c.qkv_bias and c.exact:
        q, k, v = (exact_lib.add(q, self.bq[...].astype(dt)), exact_lib.add(k, self.bk[...].astype(dt)),
                   exact_lib.add(v, self.bv[...].astype(dt)))
      elif c.qkv_bias:
        q, k, v = q + self.bq[...].astype(dt), k + self.bk[...].astype(dt), v + self.bv[...].astype(dt)
    if c.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    if c.exact:
      return self._exact_attention(q, k, v, positions, inv_freq, mask, layer_cache, lengths, lora)
    if isinstance(layer_cache, PagedLayer):  # the slot engine's decode step over pages: k rotated with its write
      return self._paged_attention(q, k, v, source, positions, inv_freq, layer_cache, rows_in, dt)
    scale = rope_attention_factor(c)
    q, k = apply_rope(q, positions, inv_freq, scale), apply_rope(k, positions, inv_freq, scale)
    new_cache = None
    if layer_cache is not None:
      ck, cv, index = layer_cache
      if index.ndim == 0:  # one write slot shared by every row
        k = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, index, 0, 0))
        v = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, index, 0, 0))
      else:  # each row writes at its own slot (a scatter)
        write = jax.vmap(lambda c, x, i: jax.lax.dynamic_update_slice(c, x, (i, 0, 0)))
        k, v = write(ck, k.astype(ck.dtype), index), write(cv, v.astype(cv.dtype), index)
      new_cache = (k, v)
    if isinstance(lengths, Segments):  # the packed trainer: causal within each segment of a row
      out = segment_attention(q, k, v, lengths, implementation)
    elif lengths is not None:  # the trainer: right-padded rows, causal with per-row lengths
      out = jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lengths,
                                         key_value_seq_lengths=lengths, implementation=implementation)
    elif q.shape[1] == 1 and layer_cache is not None:  # one new token per row: the decode step
      out = decode_attention(q, k, v, mask[:, 0])
    else:
      out = jax.nn.dot_product_attention(q, k.astype(dt), v.astype(dt), mask=mask[:, None])
    B, T, H, D = out.shape  # a plain [B*T, H*D] @ [H*D, E] matmul: no per-call transpose of wo
    out = out.reshape(B, T, H * D)
    return with_lora(dense(out, self, "wo", lambda o, w: o @ w.reshape(H * D, -1)), out, "wo", lora), new_cache

  def _paged_attention(self, q, k, v, source, positions, inv_freq, layer_cache: PagedLayer, rows_in: bool, dt):
    """`__call__`'s decode step over a paged cache (one token per row) after the projections: q
    `[B, 1, H, D]`, k, v `[B, 1, KV, D]`, source where the fused projection's k and v lie (`_fused_qkv`,
    or None), rows_in whether x came as `fp8.Rows`. Returns (the O projection's output, or its
    `fp8.Product` with rows_in, and the new (k, v) pools)."""
    cos, sin = rope_cos_sin(positions[:, 0], inv_freq, rope_attention_factor(self.config))  # [B, D]
    kv_scales, q_group = None, None
    if source is not None and not self.config.qk_norm:  # k and v read from the projection's output as they lie
      kv, scales = source
      kv, channels = kv[:, 0], (kv.shape[3] - 2, kv.shape[3] - 1)
      kv_scales = None if scales is None else (scales[0][:, 0], scales[1])
      group = kv.shape[2] - 2
      if group & (group - 1) == 0:  # and q (a power-of-two group: the Pallas kernel's loads)
        q, q_group = None, group
    else:
      kv, channels = jnp.stack([k[:, 0], v[:, 0]], axis=2), (0, 1)
    if q_group is None:
      q = rope_rotate(q, cos[:, None, None, :], sin[:, None, None, :])
    out, ck, cv = write_and_attend(q, kv, channels, cos.astype(dt), sin.astype(dt), layer_cache,
                                   kv_scales=kv_scales, quantize_out=rows_in, q_group=q_group)
    if rows_in:  # out: `fp8.Rows` [B, 1, H * D]
      return fp8_lib.Product(*fp8_lib.dense_unscaled(out, self.wo[...]), self.wo_scale[...]), (ck, cv)
    B, T, H, D = out.shape
    return dense(out.reshape(B, T, H * D), self, "wo", lambda o, w: o @ w.reshape(H * D, -1)), (ck, cv)

  def _exact_attention(self, q, k, v, positions, inv_freq, mask, layer_cache, lengths, lora):
    """`__call__` after the projections with every op in its batch-invariant form (`model.exact`,
    `ModelConfig.exact`): q `[B, T, H, D]`, k, v `[B, T, KV, D]`. Each query attends its own
    sequence's keys from the sequence's first position (`exact.attention`): the trainer's rows from
    position 0 (`lengths` `[B]`) or packed (`Segments`: starts at t - positions), a dense cache's rows
    from their first valid slot (`mask`: a row's valid slots must be contiguous, as the static
    sampler's left-padded prompts and the slot engine's prefill are), a paged cache's positions where
    `paged_attention.position_slots` finds them."""
    c = self.config
    cos, sin = exact_lib.rope_cos_sin(positions, inv_freq, rope_attention_factor(c))  # [B, T, D]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    q, k = exact_lib.rope(q, cos, sin), exact_lib.rope(k, cos, sin)
    B, T = q.shape[:2]
    new_cache = None
    if isinstance(layer_cache, PagedLayer):  # the slot engine's decode step: write, then read the row's positions
      ck = paged_attention.write_token(layer_cache.k, k[:, 0], layer_cache.write_block, layer_cache.write_offset)
      cv = paged_attention.write_token(layer_cache.v, v[:, 0], layer_cache.write_block, layer_cache.write_offset)
      index, row_len = paged_attention.position_slots(layer_cache.entry_row, layer_cache.entry_block, layer_cache.entry_len,
                                      B, ck.shape[1])
      out = exact_lib.paged_attention(q, ck, cv, index, row_len)
      new_cache = (ck, cv)
    elif isinstance(lengths, Segments):  # packed rows: each sequence starts where its positions restart
      out = exact_lib.attention(q, k, v, positions + 1, jnp.arange(T, dtype=jnp.int32)[None] - positions)
    elif lengths is not None:  # right-padded rows from position 0
      out = exact_lib.attention(q, k, v, jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None] + 1, (B, T)))
    else:
      if layer_cache is not None:
        ck, cv, index = layer_cache
        if index.ndim == 0:
          k = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, index, 0, 0))
          v = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, index, 0, 0))
          q_slot = jnp.broadcast_to(index + jnp.arange(T, dtype=jnp.int32)[None], (B, T))
        else:
          write = jax.vmap(lambda c, x, i: jax.lax.dynamic_update_slice(c, x, (i, 0, 0)))
          k, v = write(ck, k.astype(ck.dtype), index), write(cv, v.astype(cv.dtype), index)
          q_slot = index[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
        new_cache = (k, v)
      else:
        q_slot = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
      start = jnp.argmax(mask[:, -1, :], axis=-1).astype(jnp.int32)[:, None]  # [B, 1] first valid slot
      out = exact_lib.attention(q, k, v, jnp.maximum(q_slot - start + 1, 0), jnp.broadcast_to(start, (B, T)))
    H, D = out.shape[2:]
    y = dense(out, self, "wo", None, n_in=2, exact=True)
    return with_lora(y, out.reshape(B, T, H * D), "wo", lora), new_cache

  def _fused_qkv(self, x, lora, dt):
    """q `[B, T, H, D]`, k, v `[B, T, KV, D]` from one GEMM of x `[B, T, E]` with wqkv, and where they
    lie: (that GEMM's output `[B, T, KV, G + 2, D]` (bias added), None), or with fp8 weights and no
    bias (its fp32 product, (row scales `[B, T]`, column scales `[KV, G + 2, D]`)) (`fp8.dense_unscaled`)."""
    if lora is not None:
      raise ValueError("LoRA adapters apply to the unfused projections (the trainer's layout); merge them "
                       "(lora.merge_adapters) before fusing (model.serving.serving_params)")
    w_scale = getattr(self, "wqkv" + fp8_lib.SCALE, None)
    if w_scale is not None and not self.config.qkv_bias:
      y, sx = fp8_lib.dense_unscaled(x, self.wqkv[...])
      qkv = fp8_lib.apply_scales(y, sx, w_scale[...], dt)  # `dense`'s result  [B, T, KV, G + 2, D]
      source = (y, (sx, w_scale[...]))
    else:
      qkv = dense(x, self, "wqkv", functools.partial(jnp.einsum, "bte,ekgd->btkgd"), dt)  # [B, T, KV, G + 2, D]
      if self.config.qkv_bias:
        qkv = qkv + self.bqkv[...].astype(dt)
      source = (qkv, None)
    B, T, KV, G2, D = qkv.shape
    return qkv[:, :, :, :G2 - 2].reshape(B, T, KV * (G2 - 2), D), qkv[:, :, :, G2 - 2], qkv[:, :, :, G2 - 1], source


class MLP(nnx.Module):
  def __init__(self, config: ModelConfig, rngs: nnx.Rngs, fused: bool = False, fp8: bool = False):
    d, f, pd = config.hidden_size, config.intermediate_size, jnp.dtype(config.param_dtype)
    self.fused, self.exact = fused, config.exact
    proj = functools.partial(projection, self, rngs=rngs, dtype=pd, fp8=fp8)
    if fused:  # the serving layout: [embed, 2, mlp], gate then up
      proj("w_gate_up", shape=(d, 2, f), axes=("embed", None, "mlp"), scale=1 / math.sqrt(d))
    else:
      proj("w_gate", shape=(d, f), axes=("embed", "mlp"))
      proj("w_up", shape=(d, f), axes=("embed", "mlp"))
    proj("w_down", shape=(f, d), axes=("mlp", "embed"))

  def __call__(self, x, lora=None):
    if self.exact:  # the batch-invariant forms (`model.exact`), Hugging Face's projections
      if self.fused:
        raise ValueError("ModelConfig.exact computes the unfused w_gate, w_up (a fused column sums differently)")
      gate = with_lora(dense(x, self, "w_gate", None, exact=True), x, "w_gate", lora)
      h = exact_lib.swiglu(gate, with_lora(dense(x, self, "w_up", None, exact=True), x, "w_up", lora))
      return with_lora(dense(h, self, "w_down", None, exact=True), h, "w_down", lora)
    if self.fused:  # one GEMM of 2 * mlp columns
      if lora is not None:
        raise ValueError("LoRA adapters apply to the unfused projections (the trainer's layout); merge them "
                         "(lora.merge_adapters) before fusing (model.serving.serving_params)")
      gate_up = dense(x, self, "w_gate_up", functools.partial(jnp.einsum, "bte,egf->btgf"))
      return dense(jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :], self, "w_down", jnp.matmul)
    gate = with_lora(dense(x, self, "w_gate", jnp.matmul), x, "w_gate", lora)
    h = jax.nn.silu(gate) * with_lora(dense(x, self, "w_up", jnp.matmul), x, "w_up", lora)
    return with_lora(dense(h, self, "w_down", jnp.matmul), h, "w_down", lora)

  def decode_fp8(self, x: fp8_lib.Rows, dtype, interpret: bool) -> fp8_lib.Product:
    """`__call__` of the fused fp8 layout on x quantised before (`fp8.Rows` `[B, T, E]`), the SwiGLU
    and its quantise in one kernel (`fp8_kernels.swiglu_quantize`, silu and product in `dtype`);
    returns the down projection's `fp8.Product` `[B, T, E]` (its scales not applied)."""
    gate_up = fp8_lib.Product(*fp8_lib.dense_unscaled(x, self.w_gate_up[...]), self.w_gate_up_scale[...])
    h = fp8_kernels.swiglu_quantize(gate_up, dtype, interpret=interpret)
    return fp8_lib.Product(*fp8_lib.dense_unscaled(h, self.w_down[...]), self.w_down_scale[...])


class MoE(nnx.Module):
  """A sparse layer's MLP (Qwen3-MoE): a router `[embed, experts]` and `num_experts` SwiGLU experts,
  w_gate, w_up `[experts, embed, moe_mlp]` (the serving layout: w_gate_up `[experts, embed, 2,
  moe_mlp]`), w_down `[experts, moe_mlp, embed]` (`model.moe`). fp8: the experts in float8_e4m3fn
  with `<name>_scale` `[experts, *out]` per (expert, output channel) beside them (`model.fp8`), the
  router in the compute dtype."""

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs, fused: bool = False, fp8: bool = False):
    d, f, X, pd = config.hidden_size, config.moe_intermediate_size, config.num_experts, jnp.dtype(config.param_dtype)
    self.config, self.fused = config, fused
    self.router = param(rngs, (d, X), ("embed", None), pd, 1 / math.sqrt(d))
    proj = functools.partial(projection, self, rngs=rngs, dtype=pd, fp8=fp8, experts=True)
    if fused:
      proj("w_gate_up", shape=(X, d, 2, f), axes=("expert", "embed", None, "mlp"), scale=1 / math.sqrt(d))
    else:
      proj("w_gate", shape=(X, d, f), axes=("expert", "embed", "mlp"), scale=1 / math.sqrt(d))
      proj("w_up", shape=(X, d, f), axes=("expert", "embed", "mlp"), scale=1 / math.sqrt(d))
    proj("w_down", shape=(X, f, d), axes=("expert", "mlp", "embed"), scale=1 / math.sqrt(f))

  def expert(self, name: str):
    """Expert weight `name` as `moe.grouped_swiglu` takes it: the array, or fp8 `moe.ScaledExperts`."""
    scale = getattr(self, name + fp8_lib.SCALE, None)
    w = getattr(self, name)[...]
    return w if scale is None else moe_lib.ScaledExperts(w, scale[...])

  def __call__(self, x, routing: "Routing | None" = None, lora: "LoraLayer | None" = None):
    """x `[B, T, E]` -> (`[B, T, E]`, `moe.RouterStats`); routing: the tokens counted in the
    statistics and the experts to replay (`Routing`), or None (every token, no replay); lora: the
    experts' adapters (`w_gate`, `w_up`, `w_down`: `a` `[X, in, r]`, `b` `[X, r, out]`), added to each
    row's projections by grouped matmuls (`moe.grouped_swiglu`), or None."""
    c = self.config
    B, T, E = x.shape
    k = c.num_experts_per_tok
    replay = None if routing is None or routing.replay is None else routing.replay.reshape(B * T, k)
    flat = x.reshape(B * T, E)
    weights, experts, probs, own = moe_lib.route(flat, self.router[...], k, c.norm_topk_prob, replay, exact=c.exact)
    gate_up = self.expert("w_gate_up") if self.fused else (self.expert("w_gate"), self.expert("w_up"))
    mesh = None if routing is None else routing.mesh
    if c.exact and mesh is None:
      mesh = exact_lib.traced_mesh()  # the program's mesh: each device computes its own rows' experts
    out = moe_lib.grouped_swiglu(flat, experts, weights, gate_up, self.expert("w_down"), mesh,
                                 lora=lora if lora is not None and lora.weights else None,
                                 grouped_gemm="exact" if c.exact else c.grouped_gemm)
    mask = None if routing is None or routing.token_mask is None else routing.token_mask.reshape(B * T)
    counts, prob_sum = moe_lib.router_stats(own, probs, c.num_experts, mask)
    return out.reshape(B, T, E), moe_lib.RouterStats(topk=own.reshape(B, T, k), counts=counts, prob_sum=prob_sum)


@flax.struct.dataclass
class Routing:
  """What a MoE forward is told about routing. token_mask `[B, T]` (1 = a real token, counted in the
  load-balancing statistics) or None (all); replay `[B, T, k]` int32: the experts each token must use
  in one layer (routing replay), or None (the layer's own top-k). mesh: the mesh whose `expert` axis
  holds the experts (expert parallelism, `moe.grouped_swiglu`), or None."""

  token_mask: Array | None = None
  replay: Array | None = None
  mesh: Any = flax.struct.field(pytree_node=False, default=None)


def _layer_routing(replay: Array | None, j: int, mesh=None) -> Routing | None:
  """The `Routing` of the j-th MoE layer given replay `[B, T, moe layers, k]` (or None) and the mesh
  whose `expert` axis holds the experts (or None)."""
  if replay is None and mesh is None:
    return None
  return Routing(replay=None if replay is None else replay[:, :, j], mesh=mesh)


class Block(nnx.Module):
  def __init__(self, config: ModelConfig, rngs: nnx.Rngs, layout: WeightLayout = HF_LAYOUT, moe: bool = False):
    pd = jnp.dtype(config.param_dtype)
    self.exact = config.exact
    self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, pd, exact=config.exact)
    self.attn = Attention(config, rngs, layout.fused_qkv, layout.fp8)
    self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, pd, exact=config.exact)
    self.mlp = (MoE(config, rngs, layout.fused_mlp, layout.fp8) if moe
                else MLP(config, rngs, layout.fused_mlp, layout.fp8))

  def __call__(self, x, positions, inv_freq, mask, layer_cache, lengths=None, implementation="xla", lora=None,
               routing=None):
    """-> (x, new layer cache or None, `moe.RouterStats` of a MoE layer or None)."""
    attn_lora, mlp_lora = (None, None) if lora is None else (lora.part("attn"), lora.part("mlp"))
    h, new_cache = self.attn(self.attn_norm(x), positions, inv_freq, mask, layer_cache, lengths, implementation,
                             attn_lora)
    add = exact_lib.add if self.exact else jnp.add  # the residual stream
    x = add(x, h)
    if isinstance(self.mlp, MoE):
      out, stats = self.mlp(self.mlp_norm(x), routing, mlp_lora)
      return add(x, out), new_cache, stats
    return add(x, self.mlp(self.mlp_norm(x), mlp_lora)), new_cache, None

  def decode_fp8(self, x: Array, pending: fp8_lib.Product | None, positions, inv_freq, layer: PagedLayer,
                 interpret: bool):
    """`__call__`'s decode step over a paged cache with fp8 weights in the fused layout, each fp8
    GEMM's input made by one kernel (`fp8_kernels`): the residual add, the norm and the quantise;
    the SwiGLU and its quantise; the attention output's quantise. x `[B, 1, E]`: the residual stream
    without `pending`, the previous layer's down projection (`fp8.Product`, added by this layer's
    first kernel; None for the first layer). Returns (x, pending) likewise after this layer (x +
    pending is `__call__`'s output) and the new (k, v) pools."""
    eps, dt = self.attn_norm.eps, x.dtype
    x, rows = fp8_kernels.add_rms_norm_quantize(x, self.attn_norm.scale[...], pending, eps=eps, interpret=interpret)
    o, new_cache = self.attn(rows, positions, inv_freq, None, layer)
    x, rows = fp8_kernels.add_rms_norm_quantize(x, self.mlp_norm.scale[...], o, eps=eps, interpret=interpret)
    return x, self.mlp.decode_fp8(rows, dt, interpret), new_cache


class Llama(nnx.Module):
  """The decoder of every family in `FAMILIES` (Llama 3, Qwen2/2.5, Qwen3 dense), chosen by
  `config.model_type`. `model(tokens, positions=None, cache=None, attention_mask=None)`.

  tokens `[B, T]` int; positions `[B, T]` (default `arange(T)`, offset by `cache.index` when a
  cache is given); attention_mask `[B, S]` (1 = real token; S = T without a cache, S = cache
  length with one). Returns fp32 logits `[B, T, vocab]` (with a score head, `config.num_labels` >= 1:
  scores `[B, T, num_labels]`), and the updated `KVCache` when a cache is given. With `remat=True` each block's activations are recomputed in the backward pass.
  layout: which projections are fused (`WeightLayout`; the generator's serving layout), the same
  function of the same weights either way.
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, layout: WeightLayout = HF_LAYOUT):
    self.config, self.layout = config, layout
    pd = jnp.dtype(config.param_dtype)
    self.embed = param(rngs, (config.vocab_size, config.hidden_size), ("vocab", "embed"), pd, 0.02)
    self.layers = nnx.List([Block(config, rngs, layout, config.is_moe_layer(i)) for i in range(config.num_layers)])
    self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, pd, exact=config.exact)
    if config.num_labels:
      if layout.fp8_lm_head:
        raise ValueError(f"a score-head model ({config.architecture}) has no lm_head to hold in fp8; use "
                         "WeightLayout(quantize='fp8') (GeneratorConfig.quantize = 'fp8')")
      self.score = param(rngs, (config.hidden_size, config.num_labels), ("embed", None), pd)
    elif layout.fp8_lm_head:  # the logits' own fp8 matrix, tied or not (`model.fp8`)
      projection(self, "lm_head", rngs, (config.hidden_size, config.vocab_size), ("embed", "vocab"), pd, fp8=True)
    elif not config.tie_word_embeddings:
      self.lm_head = param(rngs, (config.hidden_size, config.vocab_size), ("embed", "vocab"), pd)

  def hidden_states(self, tokens, positions=None, cache=None, attention_mask=None, remat=False, mesh=None):
    """Final-norm hidden states `[B, T, E]` (and the new cache); the shared trunk of `__call__`."""
    x, new_cache, _ = self.routed_hidden_states(tokens, positions, cache, attention_mask, remat, mesh=mesh)
    return x, new_cache

  def routed_hidden_states(self, tokens, positions=None, cache=None, attention_mask=None, remat=False, replay=None,
                           mesh=None):
    """`hidden_states` and the experts each token was routed to: (x `[B, T, E]`, new cache or None,
    topk `[B, T, moe layers, k]` int32, or None for a dense model). replay `[B, T, moe layers, k]`:
    the experts to use instead of each MoE layer's own top-k (routing replay; `model.moe`). mesh: the
    mesh the forward runs on (the generator's), whose `expert` axis (if > 1) computes the experts in
    parallel and whose batch axes route each device's own rows (`moe.grouped_swiglu`); None: XLA
    partitions the MoE layers itself."""
    c = self.config
    dt = jnp.dtype(c.dtype)
    B, T = tokens.shape
    if isinstance(cache, PagedKVCache):
      return self._paged_hidden_states(tokens, positions, cache, replay, mesh)
    offset = 0 if cache is None else cache.index
    if cache is not None and cache.index.ndim == 1:  # a write slot per row: offsets [B, 1]
      offset = cache.index[:, None]
    q_slot = offset + jnp.arange(T, dtype=jnp.int32)  # cache slot of each query: [T] or [B, T]
    if positions is None:
      positions = jnp.broadcast_to(q_slot, (B, T))
    S = T if cache is None else cache.max_len
    mask = jnp.arange(S) <= q_slot[..., None]  # causal over cache slots: [T, S] or [B, T, S]
    mask = jnp.broadcast_to(mask, (B, T, S))
    if attention_mask is not None:
      if attention_mask.shape != (B, S):
        raise ValueError(f"attention_mask must be [batch, {S}] = {(B, S)}, got {attention_mask.shape}")
      mask = mask & attention_mask[:, None, :].astype(bool)
    inv_freq = rope_frequencies(c)
    x = jnp.take(self.embed[...], tokens, axis=0).astype(dt)

    def run_block(block, x, layer_cache, routing):
      return block(x, positions, inv_freq, mask, layer_cache, routing=routing)

    if remat:
      run_block = nnx.remat(run_block)
    new_k, new_v, topk = [], [], []
    for i, block in enumerate(self.layers):
      layer_cache = None if cache is None else (cache.k[i], cache.v[i], cache.index)
      x, kv, stats = run_block(block, x, layer_cache,
                               _layer_routing(replay, len(topk), mesh) if c.is_moe_layer(i) else None)
      if kv is not None:
        new_k.append(kv[0])
        new_v.append(kv[1])
      if stats is not None:
        topk.append(stats.topk)
    x = self.final_norm(x)
    new_cache = None
    if cache is not None:
      new_cache = KVCache(k=tuple(new_k), v=tuple(new_v), index=cache.index + T)
    return x, new_cache, (jnp.stack(topk, axis=2) if topk else None)

  def _paged_hidden_states(self, tokens, positions, cache: PagedKVCache, replay=None, mesh=None):
    """One decode step over a paged cache: tokens, positions `[B, 1]` (positions required: a row's
    RoPE position is not implied by where its pages are). Returns `[B, 1, E]`, the cache with the
    new keys/values written, and the routing (`routed_hidden_states`)."""
    if tokens.shape[1] != 1 or positions is None:
      raise ValueError(f"a paged cache takes one token per row with explicit positions; got tokens "
                       f"{tokens.shape}, positions {None if positions is None else positions.shape}")
    dt = jnp.dtype(self.config.dtype)
    inv_freq = rope_frequencies(self.config)
    x = jnp.take(self.embed[...], tokens, axis=0).astype(dt)
    new_k, new_v, topk = [], [], []
    fused, pending = self.fused_fp8_decode(), None
    interpret = paged_attention.interpret_kernels()
    for i, block in enumerate(self.layers):
      if fused:
        x, pending, (k, v) = block.decode_fp8(x, pending, positions, inv_freq, cache.layer(i), interpret)
      else:
        routing = _layer_routing(replay, len(topk), mesh) if self.config.is_moe_layer(i) else None
        x, (k, v), stats = block(x, positions, inv_freq, None, cache.layer(i), routing=routing)
        if stats is not None:
          topk.append(stats.topk)
      new_k.append(k)
      new_v.append(v)
    if pending is not None:
      x = x + pending.value(dt)
    return (self.final_norm(x), cache.replace(k=tuple(new_k), v=tuple(new_v)),
            jnp.stack(topk, axis=2) if topk else None)

  def fused_fp8_decode(self) -> bool:
    """Whether the paged decode step runs `Block.decode_fp8` (each fp8 GEMM's input made by one
    kernel, `fp8_kernels`): fp8 weights in the fused serving layout, the fused Pallas paged attention
    ('pallas_fused', `paged_attention.resolve_paged_implementation`: one unsharded device), sizes the kernels take
    (`fp8_kernels.supported`)."""
    c, layout = self.config, self.layout
    return (layout.fp8 and layout.fused_qkv and layout.fused_mlp and not c.moe_layers
            and paged_attention.resolve_paged_implementation() == "pallas_fused"
            and fp8_kernels.supported(c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim))

  def logits(self, x: Array) -> Array:
    """Project hidden states `[..., E]` through the head: fp32 logits `[..., vocab]`, or with a score
    head (`config.num_labels` >= 1) fp32 scores `[..., num_labels]`. An fp8 lm_head
    (`WeightLayout.fp8_lm_head`) is an fp8 GEMM (`model.fp8.dense`: x quantised per row)."""
    if self.layout.fp8_lm_head:
      return dense(x, self, "lm_head", None, jnp.float32)
    if self.config.num_labels:
      w = self.score[...]
    else:
      w = self.embed[...].T if self.config.tie_word_embeddings else self.lm_head[...]
    if self.config.exact:
      return exact_lib.dense(x, w, out_dtype=jnp.float32)
    return jnp.einsum("...e,ev->...v", x, w.astype(x.dtype), preferred_element_type=jnp.float32)

  def __call__(self, tokens, positions=None, cache=None, attention_mask=None, remat=False):
    x, new_cache = self.hidden_states(tokens, positions, cache, attention_mask, remat)
    logits = self.logits(x)
    return logits if cache is None else (logits, new_cache)


def init_model(config: ModelConfig, seed: int = 0) -> Llama:
  """A randomly initialised model (tests, the tiny embedded default)."""
  return Llama(config, rngs=nnx.Rngs(params=seed))


def split_params(model: Llama):
  """(graphdef, params) with params a plain nested dict of arrays (optax/orbax/device_put friendly)."""
  graphdef, state = nnx.split(model)
  return graphdef, nnx.to_pure_dict(state)


def merge_params(graphdef, params) -> Llama:
  """Inverse of `split_params`; cheap inside jit (trace time only)."""
  return nnx.merge(graphdef, params)


def abstract_model(config: ModelConfig, layout: WeightLayout = HF_LAYOUT) -> Llama:
  """The model with shape/dtype stand-ins instead of arrays (nnx.eval_shape: nothing allocated or
  computed): for graphdefs, parameter shapes, logical axes and abstract inputs of lowered programs."""
  return nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0), layout=layout))
