"""Llama 3 / 3.1 / 3.2, the dense Qwen2 / Qwen2.5 / Qwen3 families and Qwen3-MoE in Flax NNX.

One config dataclass, one model file (gpt-fast style). The families share one decoder and differ in
two switches of the attention block, chosen by `ModelConfig.model_type` (see `FAMILIES`):
  llama   the base decoder: RMSNorm, GQA, RoPE (optionally llama3- or yarn-scaled), SwiGLU MLP
  qwen2   + a bias on the q, k and v projections (Qwen2 and Qwen2.5)
  qwen3   + RMSNorm over each q and k head (its own `[head_dim]` scale) before RoPE; no bias.
          `head_dim` is explicit and may differ from hidden_size / num_heads.
  qwen3_moe  qwen3 whose sparse layers (`ModelConfig.is_moe_layer`) replace the MLP by experts
          (`MoE`: a router and `num_experts` SwiGLU experts, top-k routing, `model.moe`).
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
  `<name>_scale` [*out] fp32 beside it (e.g. wo_scale [embed]) and runs as an fp8 GEMM (`dense`).
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

import dataclasses
import functools
import math
import types
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from llamarl_jax import compat, gpu_paths
from llamarl_jax.model import fp8 as fp8_lib
from llamarl_jax.model import fp8_kernels
from llamarl_jax.model import moe as moe_lib
from llamarl_jax.model import paged_attention
from llamarl_jax.model.paged_attention import PagedKVCache, PagedLayer, rope_rotate, write_and_attend

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Family:
  """What sets a model family apart: its HF class name and the attention block's two switches."""

  architecture: str  # the transformers class `save_hf_checkpoint` names in config.json
  qkv_bias: bool     # bias on the q, k, v projections (not on o)
  qk_norm: bool      # RMSNorm over each q and k head before RoPE


FAMILIES = types.MappingProxyType({  # HF config.json `model_type` -> Family (read-only)
    "llama": Family("LlamaForCausalLM", qkv_bias=False, qk_norm=False),
    "qwen2": Family("Qwen2ForCausalLM", qkv_bias=True, qk_norm=False),
    "qwen3": Family("Qwen3ForCausalLM", qkv_bias=False, qk_norm=True),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", qkv_bias=False, qk_norm=True),
})


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of a Llama 3 / Qwen2 / Qwen3 model (field names follow HF's configs where they exist)."""

  vocab_size: int = 128256
  hidden_size: int = 4096
  intermediate_size: int = 14336
  num_layers: int = 32
  num_heads: int = 32
  num_kv_heads: int = 8
  head_dim: int | None = None  # defaults to hidden_size // num_heads
  rms_norm_eps: float = 1e-5
  rope_theta: float = 500000.0
  # None, or as in HF config.json: {"rope_type": "llama3", "factor", "low_freq_factor",
  # "high_freq_factor", "original_max_position_embeddings"}, or {"rope_type": "yarn", "factor",
  # "original_max_position_embeddings", optional "beta_fast", "beta_slow", "attention_factor",
  # "mscale", "mscale_all_dim", "truncate"}.
  rope_scaling: tuple[tuple[str, Any], ...] | None = None
  max_position_embeddings: int = 8192
  tie_word_embeddings: bool = False
  model_type: str = "llama"  # the family, a key of FAMILIES: "llama", "qwen2", "qwen3"
  # The head: 0 = the causal LM's lm_head (logits over the vocabulary); n >= 1 = a score head of n
  # outputs per position (HF `*ForSequenceClassification`; num_labels = 1: a reward model or critic).
  num_labels: int = 0
  # Mixture of experts (qwen3_moe; HF's names): layer i is sparse when num_experts > 0, i is not in
  # mlp_only_layers and (i + 1) % decoder_sparse_step == 0; a sparse layer's MLP is num_experts SwiGLU
  # experts of moe_intermediate_size, num_experts_per_tok of them per token (`model.moe`), the others
  # are dense MLPs of intermediate_size. router_aux_loss_coef: the load-balancing loss's weight.
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = False
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple[int, ...] = ()
  router_aux_loss_coef: float = 0.0
  param_dtype: str = "float32"
  dtype: str = "float32"  # compute dtype (activations, matmuls, KV cache)

  def __post_init__(self):
    if self.head_dim is None:
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
    if isinstance(self.rope_scaling, dict):
      object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
    if self.model_type not in FAMILIES:
      raise ValueError(f"model_type {self.model_type!r} is not a supported family; supported: {sorted(FAMILIES)}")
    if self.num_labels < 0:
      raise ValueError(f"num_labels must be 0 (a causal LM) or >= 1 (a score head), got {self.num_labels}")
    object.__setattr__(self, "mlp_only_layers", tuple(sorted(int(i) for i in self.mlp_only_layers)))
    if self.num_experts:
      if self.model_type != "qwen3_moe":
        raise ValueError(f"num_experts={self.num_experts} needs model_type 'qwen3_moe' (got {self.model_type!r})")
      if not 1 <= self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size < 1:
        raise ValueError(f"a MoE config needs 1 <= num_experts_per_tok ({self.num_experts_per_tok}) <= num_experts "
                         f"({self.num_experts}) and moe_intermediate_size >= 1 (got {self.moe_intermediate_size})")
      if self.decoder_sparse_step < 1:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")

  @property
  def family(self) -> Family:
    return FAMILIES[self.model_type]

  @property
  def architecture(self) -> str:
    """The transformers class of this model: the family's causal LM, or its sequence classifier."""
    causal = self.family.architecture
    return causal.replace("ForCausalLM", "ForSequenceClassification") if self.num_labels else causal

  @property
  def qkv_bias(self) -> bool:
    return self.family.qkv_bias

  @property
  def qk_norm(self) -> bool:
    return self.family.qk_norm

  def is_moe_layer(self, i: int) -> bool:
    """Whether layer i's MLP is the experts (transformers' Qwen3MoeDecoderLayer rule)."""
    return bool(self.num_experts) and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

  @property
  def moe_layers(self) -> tuple[int, ...]:
    return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

  @property
  def rope_scaling_dict(self) -> dict | None:
    return None if self.rope_scaling is None else dict(self.rope_scaling)

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  def num_params(self) -> int:
    d, f, v, L, hd = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_layers, self.head_dim
    qkv_out = hd * (self.num_heads + 2 * self.num_kv_heads)
    attn = d * qkv_out + self.num_heads * hd * d + self.qkv_bias * qkv_out + self.qk_norm * 2 * hd
    n_moe = len(self.moe_layers)
    per_layer = attn + 2 * d
    moe = n_moe * (d * self.num_experts + 3 * d * self.moe_intermediate_size * self.num_experts)
    head = d * self.num_labels if self.num_labels else (0 if self.tie_word_embeddings else v * d)
    return L * per_layer + (L - n_moe) * 3 * d * f + moe + v * d + head + d


@dataclasses.dataclass(frozen=True)
class WeightLayout:
  """Which projections a model holds fused (the generator's serving layout); the default, nothing
  fused, is the trainer's and checkpoints' (Hugging Face's projections)."""

  fused_qkv: bool = False  # wqkv (and bqkv) instead of wq, wk, wv (bq, bk, bv)
  fused_mlp: bool = False  # w_gate_up instead of w_gate, w_up
  fp8: bool = False        # projections in float8_e4m3fn + per-output-channel scales (`model.fp8`)
  fp8_lm_head: bool = False  # the lm_head in float8_e4m3fn + a scale per vocabulary row (tied: its own copy)


HF_LAYOUT = WeightLayout()


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


ROPE_TYPES = ("default", "llama3", "yarn")


def _rope_type(scaling: dict | None) -> str:
  rope_type = "default" if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))
  if rope_type not in ROPE_TYPES:
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
  return rope_type


def rope_frequencies(config: ModelConfig) -> Array:
  """Inverse frequencies `[head_dim // 2]` (fp32), with llama3 or yarn `rope_scaling` applied."""
  dim = config.head_dim
  inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  scaling = config.rope_scaling_dict
  rope_type = _rope_type(scaling)
  if rope_type == "default":
    return inv_freq
  factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
  if rope_type == "yarn":
    return _yarn_frequencies(inv_freq, dim, config.rope_theta, factor, old_len, scaling)
  low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
  wavelen = 2 * math.pi / inv_freq
  scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
  return jnp.where(is_medium, smoothed, scaled)


def _yarn_frequencies(inv_freq: Array, dim: int, theta: float, factor: float, old_len: int, scaling: dict) -> Array:
  """YaRN (arXiv 2309.00071): dimensions that rotate fewer than `beta_slow` times over the original
  context are interpolated (divided by `factor`), those rotating more than `beta_fast` times are kept,
  with a linear ramp between (the correction range, rounded outwards unless `truncate` is false)."""
  beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

  def dim_of(rotations):  # the dimension index that turns `rotations` times over old_len positions
    return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

  low, high = dim_of(beta_fast), dim_of(beta_slow)
  if scaling.get("truncate", True):
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  high = high + 0.001 if low == high else high
  ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
  return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(config: ModelConfig) -> float:
  """The factor YaRN multiplies cos and sin by (so attention logits by its square); 1 otherwise."""
  scaling = config.rope_scaling_dict
  if _rope_type(scaling) != "yarn":
    return 1.0
  if scaling.get("attention_factor") is not None:
    return float(scaling["attention_factor"])
  mscale = lambda m: 1.0 if scaling["factor"] <= 1 else 0.1 * m * math.log(scaling["factor"]) + 1.0
  if scaling.get("mscale") and scaling.get("mscale_all_dim"):
    return mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"])
  return mscale(1.0)


def rope_cos_sin(positions: Array, inv_freq: Array, scale: float = 1.0) -> tuple[Array, Array]:
  """fp32 cos, sin `[*positions.shape, D]` of RoPE at `positions`, times `scale`."""
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [..., D/2]
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: Array, positions: Array, inv_freq: Array, scale: float = 1.0) -> Array:
  """Rotate-half RoPE (HF convention). x `[B, T, H, D]`, positions `[B, T]`; cos, sin times `scale`."""
  cos, sin = rope_cos_sin(positions, inv_freq, scale)
  return rope_rotate(x, cos[:, :, None, :], sin[:, :, None, :])


def _param(rngs: nnx.Rngs, shape, axes, dtype, scale=None) -> nnx.Param:
  fan_in = shape[0] if scale is None else None
  std = scale if scale is not None else 1.0 / math.sqrt(fan_in)
  value = std * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape, jnp.float32)
  return nnx.Param(value.astype(dtype), logical_axes=axes)


def _projection(module: nnx.Module, name: str, rngs: nnx.Rngs, shape, axes, dtype, scale=None, *,
                n_in: int = 1, fp8: bool = False) -> None:
  """Set projection `name` of `module`: a Param `[*in, *out]` (n_in input axes) in `dtype`, or with
  fp8 its float8_e4m3fn values and a `name_scale` Param `[*out]` (`model.fp8.quantize_weight`)."""
  w = _param(rngs, shape, axes, jnp.float32 if fp8 else dtype, scale)
  if not fp8:
    setattr(module, name, w)
    return
  values, w_scale = fp8_lib.quantize_weight(w[...], n_in)
  setattr(module, name, nnx.Param(values, logical_axes=axes))
  setattr(module, name + fp8_lib.SCALE, nnx.Param(w_scale, logical_axes=tuple(axes[n_in:])))


def dense(x: Array | fp8_lib.Rows, module: nnx.Module, name: str, plain, dtype=None) -> Array:
  """Projection `name` of `module` applied to x `[..., K]`: `plain(x, w)` with w cast to x's dtype,
  or, where the projection is fp8 (a `name_scale` beside it), the fp8 product `model.fp8.dense` in
  `dtype` (default x's; x may be `fp8.Rows`, quantised before)."""
  w = getattr(module, name)[...]
  scale = getattr(module, name + fp8_lib.SCALE, None)
  if scale is not None:
    return fp8_lib.dense(x, w, scale[...], dtype)
  return plain(x, w.astype(x.dtype))


class RMSNorm(nnx.Module):
  """RMSNorm over the last axis (fp32 statistics, HF's rounding order); `axis` names the scale's axis."""

  def __init__(self, dim: int, eps: float, param_dtype, axis: str = "norm"):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=(axis,))

  def __call__(self, x: Array) -> Array:
    return rms_norm(x, self.scale[...], self.eps)


def rms_norm(x: Array, scale: Array, eps: float) -> Array:
  """RMSNorm of x `[..., D]` with scale `[D]`: fp32 statistics, the result in x's dtype."""
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return scale.astype(x.dtype) * xf.astype(x.dtype)


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
class LoraLayer:
  """One block's LoRA adapters for the trainer's unmerged forward (`llamarl_jax.model.lora`).

  weights: {"attn": {"wq": {"a", "b"}, ...}, "mlp": {"w_gate": ...}}, the adapted projections only;
  a projection `w` `[*in, *out]` has `a` `[*in, rank]` and `b` `[rank, *out]`. scale: alpha / rank.
  dropout: LoRA dropout on each adapted projection's input to `a` (PEFT's `lora_dropout`), drawn from
  `key` (one mask per projection); 0 or no key: none.
  """

  weights: dict
  scale: float = flax.struct.field(pytree_node=False)
  key: Array | None = None
  dropout: float = flax.struct.field(pytree_node=False, default=0.0)

  def part(self, module: str) -> "LoraLayer":
    return LoraLayer(self.weights.get(module, {}), self.scale, self.key, self.dropout)


LORA_PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # what LoRA may adapt


def with_lora(y: Array, x: Array, name: str, lora: LoraLayer | None) -> Array:
  """`y` (projection `name` of `x`) plus LoRA's `scale * (x @ a) @ b` when `lora` adapts `name`, else `y`.

  x `[B, T, *in]`, y `[B, T, *out]`; the low-rank path runs in x's dtype (`[B, T, rank]` in between).
  With `b` = 0 (an adapter's initial value) the sum is exactly `y`."""
  if lora is None or name not in lora.weights:
    return y
  a, b = lora.weights[name]["a"], lora.weights[name]["b"]
  rank = a.shape[-1]
  if lora.dropout > 0 and lora.key is not None:
    keep = jax.random.bernoulli(jax.random.fold_in(lora.key, LORA_PROJECTIONS.index(name)), 1.0 - lora.dropout,
                                x.shape)
    x = jnp.where(keep, x / jnp.asarray(1.0 - lora.dropout, x.dtype), jnp.zeros((), x.dtype))
  h = x.reshape(*x.shape[:2], -1) @ a.reshape(-1, rank).astype(x.dtype)
  delta = (h @ b.reshape(rank, -1).astype(x.dtype)) * jnp.asarray(lora.scale, x.dtype)
  return y + delta.reshape(y.shape).astype(y.dtype)


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


class Attention(nnx.Module):
  def __init__(self, config: ModelConfig, rngs: nnx.Rngs, fused: bool = False, fp8: bool = False):
    c, pd = config, jnp.dtype(config.param_dtype)
    self.config, self.fused = config, fused
    d, h, kv, hd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    proj = functools.partial(_projection, self, rngs=rngs, dtype=pd, fp8=fp8)
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
      self.q_norm = RMSNorm(hd, c.rms_norm_eps, pd, axis="head_dim")
      self.k_norm = RMSNorm(hd, c.rms_norm_eps, pd, axis="head_dim")

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
    if self.fused:
      q, k, v, source = self._fused_qkv(x, lora, dt)
    else:
      proj = functools.partial(jnp.einsum, "bte,ehd->bthd")
      q = with_lora(dense(x, self, "wq", proj, dt), x, "wq", lora)
      k = with_lora(dense(x, self, "wk", proj, dt), x, "wk", lora)
      v = with_lora(dense(x, self, "wv", proj, dt), x, "wv", lora)
      if c.qkv_bias:
        q, k, v = q + self.bq[...].astype(dt), k + self.bk[...].astype(dt), v + self.bv[...].astype(dt)
    if c.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    scale = rope_attention_factor(c)
    if isinstance(layer_cache, PagedLayer):  # the slot engine's decode step over pages: k rotated with its write
      cos, sin = rope_cos_sin(positions[:, 0], inv_freq, scale)  # [B, D]
      kv_scales, q_group = None, None
      if source is not None and not c.qk_norm:  # k and v read from the projection's output as they lie
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
    self.fused = fused
    proj = functools.partial(_projection, self, rngs=rngs, dtype=pd, fp8=fp8)
    if fused:  # the serving layout: [embed, 2, mlp], gate then up
      proj("w_gate_up", shape=(d, 2, f), axes=("embed", None, "mlp"), scale=1 / math.sqrt(d))
    else:
      proj("w_gate", shape=(d, f), axes=("embed", "mlp"))
      proj("w_up", shape=(d, f), axes=("embed", "mlp"))
    proj("w_down", shape=(f, d), axes=("mlp", "embed"))

  def __call__(self, x, lora=None):
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
  moe_mlp]`), w_down `[experts, moe_mlp, embed]` (`model.moe`)."""

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs, fused: bool = False):
    d, f, X, pd = config.hidden_size, config.moe_intermediate_size, config.num_experts, jnp.dtype(config.param_dtype)
    self.config, self.fused = config, fused
    self.router = _param(rngs, (d, X), ("embed", None), pd, 1 / math.sqrt(d))
    if fused:
      self.w_gate_up = _param(rngs, (X, d, 2, f), ("expert", "embed", None, "mlp"), pd, 1 / math.sqrt(d))
    else:
      self.w_gate = _param(rngs, (X, d, f), ("expert", "embed", "mlp"), pd, 1 / math.sqrt(d))
      self.w_up = _param(rngs, (X, d, f), ("expert", "embed", "mlp"), pd, 1 / math.sqrt(d))
    self.w_down = _param(rngs, (X, f, d), ("expert", "mlp", "embed"), pd, 1 / math.sqrt(f))

  def __call__(self, x, routing: "Routing | None" = None):
    """x `[B, T, E]` -> (`[B, T, E]`, `moe.RouterStats`); routing: the tokens counted in the
    statistics and the experts to replay (`Routing`), or None (every token, no replay)."""
    c = self.config
    B, T, E = x.shape
    k = c.num_experts_per_tok
    replay = None if routing is None or routing.replay is None else routing.replay.reshape(B * T, k)
    flat = x.reshape(B * T, E)
    weights, experts, probs, own = moe_lib.route(flat, self.router[...], k, c.norm_topk_prob, replay)
    gate_up = self.w_gate_up[...] if self.fused else (self.w_gate[...], self.w_up[...])
    mesh = None if routing is None else routing.mesh
    out = moe_lib.grouped_swiglu(flat, experts, weights, gate_up, self.w_down[...], mesh)
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


def _layer_routing(replay: Array | None, j: int) -> Routing | None:
  """The `Routing` of the j-th MoE layer given replay `[B, T, moe layers, k]` (or None)."""
  return None if replay is None else Routing(replay=replay[:, :, j])


class Block(nnx.Module):
  def __init__(self, config: ModelConfig, rngs: nnx.Rngs, layout: WeightLayout = HF_LAYOUT, moe: bool = False):
    pd = jnp.dtype(config.param_dtype)
    self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, pd)
    self.attn = Attention(config, rngs, layout.fused_qkv, layout.fp8)
    self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, pd)
    if moe and layout.fp8:
      raise ValueError("an fp8 generator (WeightLayout.fp8) does not quantise MoE experts; serve a MoE model in "
                       "its compute dtype (GeneratorConfig.quantize = None)")
    self.mlp = MoE(config, rngs, layout.fused_mlp) if moe else MLP(config, rngs, layout.fused_mlp, layout.fp8)

  def __call__(self, x, positions, inv_freq, mask, layer_cache, lengths=None, implementation="xla", lora=None,
               routing=None):
    """-> (x, new layer cache or None, `moe.RouterStats` of a MoE layer or None)."""
    attn_lora, mlp_lora = (None, None) if lora is None else (lora.part("attn"), lora.part("mlp"))
    h, new_cache = self.attn(self.attn_norm(x), positions, inv_freq, mask, layer_cache, lengths, implementation,
                             attn_lora)
    x = x + h
    if isinstance(self.mlp, MoE):
      if lora is not None and lora.weights.get("mlp"):
        raise ValueError("LoRA adapters of MoE experts are not supported; adapt the attention projections only")
      out, stats = self.mlp(self.mlp_norm(x), routing)
      return x + out, new_cache, stats
    return x + self.mlp(self.mlp_norm(x), mlp_lora), new_cache, None

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
    self.embed = _param(rngs, (config.vocab_size, config.hidden_size), ("vocab", "embed"), pd, 0.02)
    self.layers = nnx.List([Block(config, rngs, layout, config.is_moe_layer(i)) for i in range(config.num_layers)])
    self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, pd)
    if config.num_labels:
      if layout.fp8_lm_head:
        raise ValueError(f"a score-head model ({config.architecture}) has no lm_head to hold in fp8; use "
                         "WeightLayout(fp8_lm_head=False) (GeneratorConfig.quantize_lm_head = False)")
      self.score = _param(rngs, (config.hidden_size, config.num_labels), ("embed", None), pd)
    elif layout.fp8_lm_head:  # the logits' own fp8 matrix, tied or not (`model.fp8`)
      _projection(self, "lm_head", rngs, (config.hidden_size, config.vocab_size), ("embed", "vocab"), pd, fp8=True)
    elif not config.tie_word_embeddings:
      self.lm_head = _param(rngs, (config.hidden_size, config.vocab_size), ("embed", "vocab"), pd)

  def hidden_states(self, tokens, positions=None, cache=None, attention_mask=None, remat=False):
    """Final-norm hidden states `[B, T, E]` (and the new cache); the shared trunk of `__call__`."""
    x, new_cache, _ = self.routed_hidden_states(tokens, positions, cache, attention_mask, remat)
    return x, new_cache

  def routed_hidden_states(self, tokens, positions=None, cache=None, attention_mask=None, remat=False, replay=None):
    """`hidden_states` and the experts each token was routed to: (x `[B, T, E]`, new cache or None,
    topk `[B, T, moe layers, k]` int32, or None for a dense model). replay `[B, T, moe layers, k]`:
    the experts to use instead of each MoE layer's own top-k (routing replay; `model.moe`)."""
    c = self.config
    dt = jnp.dtype(c.dtype)
    B, T = tokens.shape
    if isinstance(cache, PagedKVCache):
      return self._paged_hidden_states(tokens, positions, cache, replay)
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
      x, kv, stats = run_block(block, x, layer_cache, _layer_routing(replay, len(topk)) if c.is_moe_layer(i) else None)
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

  def _paged_hidden_states(self, tokens, positions, cache: PagedKVCache, replay=None):
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
        routing = _layer_routing(replay, len(topk)) if self.config.is_moe_layer(i) else None
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


# --------------------------------------------------------------------------------------------------
# The trainer's forward: right-padded rows from position 0, layers under `lax.scan` over stacked
# parameters (compile time flat in depth), fused causal attention with per-row lengths, and the
# lm_head + log-prob + entropy in chunks of the sequence. The model, checkpoints and the sampler keep
# the unrolled per-layer layout (decode updates each layer's cache in place); `prepare_params` stacks
# the layers for the trainer, cast to the compute dtype in the same pass (once per step).

ATTENTION_IMPLEMENTATIONS = ("auto", "cudnn", "xla")
REMAT_POLICIES = ("none", "matmuls", "full")
# Positions per chunk of the trainer's lm_head + log-prob (`chunked_token_logprobs`): a [rows, 256,
# vocab] fp32 block at a time (8 rows x 256 x 128256 = 0.98 x 2^28 elements); a response of at most
# 256 tokens is one chunk, the unchunked computation.
DEFAULT_LOGPROB_CHUNK = 256


def resolve_attention(implementation: str, platform: str, dtype, packed: bool = False) -> str:
  """The attention kernel the trainer runs: 'auto' is 'cudnn' on a CUDA GPU in bf16/fp16 (the only
  dtypes cuDNN's fused kernel takes) where `gpu_paths` records cuDNN's form for the layout as passed
  on a GPU (packed: its segment-offset form, `segment_attention`), 'xla' elsewhere. 'cudnn' where it
  cannot run is an error (never a silent fallback); chosen by name it runs whether or not it has
  passed (opt-in). `platform`: a device platform ('cpu', 'gpu', 'cuda', 'tpu')."""
  if implementation not in ATTENTION_IMPLEMENTATIONS:
    raise ValueError(f"attention implementation must be one of {ATTENTION_IMPLEMENTATIONS}, got {implementation!r}")
  gpu = platform in ("gpu", "cuda")
  half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
  if implementation == "auto":
    setting = "packed_attention" if packed else "trainer_attention"
    return "cudnn" if gpu and half and gpu_paths.passed(setting, "cudnn") else "xla"
  if implementation == "cudnn" and not (gpu and half):
    raise ValueError(f"attention='cudnn' (cuDNN fused attention) needs a CUDA GPU and a bfloat16/float16 "
                     f"compute dtype; got platform {platform!r}, dtype {jnp.dtype(dtype).name}. Use "
                     "attention='xla', or 'auto' (cuDNN where it can run, XLA elsewhere)")
  return implementation


def remat_policy(remat) -> str:
  """Normalise a remat setting: True -> 'full', False/None -> 'none', else one of REMAT_POLICIES.

  'none' keeps every activation; 'matmuls' saves the outputs of the (non-batched) matmuls and
  recomputes the rest (norms, RoPE, activations, attention); 'full' keeps only each layer's input."""
  if remat is None or remat is False:
    return "none"
  if remat is True:
    return "full"
  if remat not in REMAT_POLICIES:
    raise ValueError(f"remat must be one of {REMAT_POLICIES} (or a bool: True = 'full'), got {remat!r}")
  return remat


def layer_runs(layers: dict) -> list[tuple[int, int]]:
  """Maximal runs `[(start, stop), ...]` of consecutive layers with the same parameter structure and
  shapes: one run for a dense model or a MoE model whose every layer is sparse, several when dense
  and sparse layers alternate (`decoder_sparse_step`, `mlp_only_layers`). `layers`: {i: layer tree}."""
  sig = lambda t: (jax.tree.structure(t), tuple(getattr(x, "shape", None) for x in jax.tree.leaves(t)))
  runs, start = [], 0
  for i in range(1, len(layers) + 1):
    if i == len(layers) or sig(layers[i]) != sig(layers[start]):
      runs.append((start, i))
      start = i
  return runs


def _stack(layers, runs, f):
  """{i: tree} -> one stacked tree (a single run) or a tuple of stacked trees, one per run."""
  stacked = tuple(jax.tree.map(lambda *xs: jnp.stack([f(x) for x in xs]), *[layers[i] for i in range(a, b)])
                  for a, b in runs)
  return stacked[0] if len(stacked) == 1 else stacked


def prepare_params(params: dict, dtype) -> dict:
  """The trainer's compute copy of `params` (the `split_params` dict): every leaf cast to `dtype` and
  the per-layer dicts stacked on a leading `[num_layers]` axis under "layers" (a tuple of such stacks,
  one per `layer_runs` run, when layers of different structure alternate). Differentiable: the
  gradient w.r.t. the result maps back with `unstack_layers` (and a cast)."""
  dtype = jnp.dtype(dtype)
  layers = params["layers"]
  out = {k: jax.tree.map(lambda x: x.astype(dtype), v) for k, v in params.items() if k != "layers"}
  out["layers"] = _stack(layers, layer_runs(layers), lambda x: x.astype(dtype))
  return out


def stacked_shardings(shardings: dict, mesh) -> dict:
  """`prepare_params`' layout of a `split_params`-shaped tree of shardings: each layer leaf's sharding
  with a replicated leading `[num_layers]` axis (per run of layers of one structure, `layer_runs`)."""
  from jax.sharding import NamedSharding, PartitionSpec

  stack = lambda layer: jax.tree.map(lambda sh: NamedSharding(mesh, PartitionSpec(None, *sh.spec)), layer)  # noqa: E731
  runs = layer_runs(shardings["layers"])
  stacked = tuple(stack(shardings["layers"][a]) for a, _ in runs)
  return {**{k: v for k, v in shardings.items() if k != "layers"}, "layers": stacked[0] if len(stacked) == 1 else stacked}


def stacked_runs(layers) -> tuple:
  """`prepare_params`' "layers" as a tuple of stacked runs (one element for a single run)."""
  return layers if isinstance(layers, tuple) else (layers,)


def unstack_layers(prepared: dict) -> dict:
  """Inverse layout of `prepare_params` (dtypes unchanged): "layers" back to {0: ..., 1: ...}."""
  out = {k: v for k, v in prepared.items() if k != "layers"}
  out["layers"], i = {}, 0
  for run in stacked_runs(prepared["layers"]):
    for j in range(jax.tree.leaves(run)[0].shape[0]):
      out["layers"][i] = jax.tree.map(lambda x: x[j], run)
      i += 1
  return out


@functools.lru_cache(maxsize=None)
def _block_graphdef(config: ModelConfig, moe: bool = False):
  return nnx.split(nnx.eval_shape(lambda: Block(config, nnx.Rngs(0), moe=moe)))[0]


@flax.struct.dataclass
class MoeTrace:
  """The routing of a MoE forward, over its MoE layers in order: topk `[B, T, moe layers, k]` int32
  (each token's experts), counts and prob_sum `[moe layers, experts]` (`moe.RouterStats`, over the
  real tokens), num_tokens: the real tokens counted (`moe.load_balancing_loss`'s denominator)."""

  topk: Array
  counts: Array
  prob_sum: Array
  num_tokens: Array

  def aux_loss(self) -> Array:
    """transformers' load-balancing loss (`moe.load_balancing_loss`) of this forward."""
    return moe_lib.load_balancing_loss(self.counts, self.prob_sum, self.num_tokens)


def scan_hidden_states(config: ModelConfig, prepared: dict, tokens: Array, lengths: Array, *,
                       attention: str = "xla", remat="none", scan_layers: bool = True,
                       lora: dict | None = None, lora_scale: float = 1.0, lora_dropout: float = 0.0,
                       dropout_key: Array | None = None, positions: Array | None = None,
                       replay: Array | None = None, with_routing: bool = False, mesh=None):
  """Final-norm hidden states `[B, T, E]` of right-padded rows, the layers under `lax.scan`.

  prepared: `prepare_params(params, config.dtype)`. tokens `[B, T]`: each row's sequence from
  position 0 (positions are 0..T-1), valid up to `lengths` `[B]`; states past a row's length are
  not meaningful. attention: 'xla' or 'cudnn' (see `resolve_attention`); remat: see `remat_policy`.
  Packed rows: `lengths` a `Segments` and `positions` `[B, T]` (restarting at 0 in each segment):
  attention stays within each segment (`segment_attention`).
  scan_layers=False unrolls the scan (the same program, one copy per layer): compile time grows with
  depth, but a small model on a CPU steps faster unrolled (the main job's trainer step: BENCHMARKS.md),
  XLA:CPU's loop over stacked layers costing more than the layers themselves.
  The same math as `Llama.hidden_states` (the same Block code runs on each layer's slice); layers of
  different structure (dense and MoE) run as consecutive scans, one per `layer_runs` run.
  lora: LoRA adapters in the layout `prepare_params` gives (`model.lora.init_adapters`' tree with
  "layers" stacked), added unmerged to the projections they adapt, times `lora_scale` (alpha / rank),
  their inputs dropped out with probability `lora_dropout` from `dropout_key` (a key per layer).
  MoE models: replay `[B, T, moe layers, k]` int32 replays those experts (`model.moe`); with
  `with_routing=True` the result is (hidden, `MoeTrace`) (the trace None for a dense model); mesh:
  the trainer's mesh, whose `expert` axis (if > 1) computes the experts in parallel (`moe.grouped_swiglu`).
  """
  dt = jnp.dtype(config.dtype)
  B, T = tokens.shape
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  inv_freq = rope_frequencies(config)
  if isinstance(lengths, Segments):
    token_mask = lengths.ids > 0
  else:
    lengths = lengths.astype(jnp.int32)
    token_mask = jnp.arange(T)[None, :] < lengths[:, None]
  runs = stacked_runs(prepared["layers"])
  if lora is not None and len(runs) > 1:
    raise ValueError("LoRA adapters need layers of one structure; this model alternates dense and MoE layers")

  def make_layer(graphdef):
    def layer(x, xs):
      layer_params, layer_lora, layer_key, layer_replay = xs
      adapters = None if layer_lora is None else LoraLayer(layer_lora, lora_scale, layer_key, lora_dropout)
      routing = Routing(token_mask=token_mask, replay=layer_replay, mesh=mesh)
      x, _, stats = nnx.merge(graphdef, layer_params)(x, positions, inv_freq, None, None, lengths, attention,
                                                      adapters, routing)
      return x, stats

    policy = remat_policy(remat)
    if policy == "full":
      layer = jax.checkpoint(layer, prevent_cse=False)
    elif policy == "matmuls":
      layer = jax.checkpoint(layer, prevent_cse=False,
                             policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    return layer

  x = jnp.take(prepared["embed"], tokens, axis=0).astype(dt)
  keys = None
  if lora is not None and lora_dropout > 0 and dropout_key is not None:
    keys = jax.random.split(dropout_key, config.num_layers)
  traces, start, moe_index = [], 0, 0
  for run in runs:
    n = jax.tree.leaves(run)[0].shape[0]
    moe = config.is_moe_layer(start)
    run_replay = None
    if moe and replay is not None:  # [B, T, moe layers, k] -> this run's [n, B, T, k]
      run_replay = jnp.moveaxis(replay[:, :, moe_index:moe_index + n], 2, 0).astype(jnp.int32)
    run_keys = None if keys is None else keys[start:start + n]
    run_lora = None if lora is None else lora["layers"]
    x, stats = jax.lax.scan(make_layer(_block_graphdef(config, moe)), x, (run, run_lora, run_keys, run_replay),
                            unroll=not scan_layers)
    if stats is not None:
      traces.append(stats)
      moe_index += n
    start += n
  x = rms_norm(x, prepared["final_norm"]["scale"], config.rms_norm_eps)
  if not with_routing:
    return x
  if not traces:
    return x, None
  cat = lambda name: jnp.concatenate([getattr(t, name) for t in traces], axis=0)
  trace = MoeTrace(topk=jnp.moveaxis(cat("topk"), 0, 2), counts=cat("counts"), prob_sum=cat("prob_sum"),
                   num_tokens=jnp.sum(token_mask.astype(jnp.float32)))
  return x, trace


def lm_head_weight(config: ModelConfig, prepared: dict) -> Array:
  """The `[embed, vocab]` output projection (the embedding's transpose when tied)."""
  if config.num_labels:
    raise ValueError(f"a score-head model ({config.architecture}) has no lm_head; its head is "
                     "prepared['score'] [embed, num_labels]")
  return prepared["embed"].T if config.tie_word_embeddings else prepared["lm_head"]


def chunked_token_logprobs(hidden: Array, w: Array, tokens: Array, *, temperature: float = 1.0,
                           chunk: int | None = None, with_entropy: bool = True) -> tuple[Array, Array | None]:
  """Log-prob and entropy of `tokens` under softmax(hidden @ w / temperature), without the full logits.

  hidden `[B, R, E]`, w `[E, V]`, tokens `[B, R]` int. Returns (logprobs, entropy), both fp32
  `[B, R]` (entropy None unless `with_entropy`). With `chunk` (positions per chunk) smaller than R, the R axis is cut into chunks that a
  `lax.scan` visits one at a time under `jax.checkpoint`: only one `[B, chunk, V]` logits array is
  alive, in the forward and in the backward pass (which recomputes it). `chunk=None` (or >= R):
  one piece, the plain computation. The logits are accumulated in fp32 whatever hidden's dtype; the
  backward pass sums w's gradient over chunks in w's dtype (bf16 when the trainer computes in bf16:
  a few chunks' partial sums, each from an fp32-accumulated matmul).
  """
  B, R, _ = hidden.shape

  def piece(h, t):  # h [B, c, E], t [B, c] -> logprobs, entropy [B, c]
    logits = jnp.einsum("bce,ev->bcv", h, w.astype(h.dtype), preferred_element_type=jnp.float32)
    logits = logits / temperature
    log_z = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, t[..., None].astype(jnp.int32), axis=-1)[..., 0]
    if not with_entropy:
      return picked - log_z, None
    entropy = log_z - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)
    return picked - log_z, entropy

  if chunk is None or chunk >= R:
    return piece(hidden, tokens)
  if chunk < 1:
    raise ValueError(f"chunk must be a positive number of positions (or None), got {chunk}")
  n = -(-R // chunk)
  pad = n * chunk - R
  h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(B, n, chunk, -1).swapaxes(0, 1)
  t = jnp.pad(tokens, ((0, 0), (0, pad))).reshape(B, n, chunk).swapaxes(0, 1)
  step = jax.checkpoint(lambda carry, ht: (carry, piece(*ht)), prevent_cse=False)
  _, (logprobs, entropy) = jax.lax.scan(step, None, (h, t))
  unchunk = lambda x: None if x is None else x.swapaxes(0, 1).reshape(B, n * chunk)[:, :R]
  return unchunk(logprobs), unchunk(entropy)
