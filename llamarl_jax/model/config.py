"""The architecture of a model: `ModelConfig`, the families it chooses among, the weight layouts a
model may hold, and RoPE's frequencies as functions of the config.

The families share one decoder (`model.llama`) and differ in two switches of the attention block,
chosen by `ModelConfig.model_type` (see `FAMILIES`):
  llama   the base decoder: RMSNorm, GQA, RoPE (optionally llama3- or yarn-scaled), SwiGLU MLP
  qwen2   + a bias on the q, k and v projections (Qwen2 and Qwen2.5)
  qwen3   + RMSNorm over each q and k head (its own `[head_dim]` scale) before RoPE; no bias.
          `head_dim` is explicit and may differ from hidden_size / num_heads.
  qwen3_moe  qwen3 whose sparse layers (`ModelConfig.is_moe_layer`) replace the MLP by experts
          (`model.llama.MoE`: a router and `num_experts` SwiGLU experts, top-k routing, `model.moe`).
`WeightLayout`: which projections a model holds fused (the generator's serving layout,
`model.serving`) and its precision (`QUANTIZATIONS`, checked by `quantize_problem` only);
`HF_LAYOUT`, nothing fused or quantised, is the trainer's and checkpoints'.
RoPE: `rope_frequencies` and `rope_attention_factor` (default, llama3- or yarn-scaled, as HF's
`rope_scaling` says).
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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


# The experts' grouped matmul implementations (`ModelConfig.grouped_gemm`, `model.moe`).
GROUPED_GEMMS = ("ragged_dot", "pallas")
# ModelConfig fields that say how the model is computed, not what it is: never exported, never
# compared between checkpoints or with a KL reference.
COMPUTE_FIELDS = ("exact", "grouped_gemm")


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
  # Not the architecture: how it is computed. True runs every op in its batch-invariant form
  # (`model.exact`: the `exact_logprobs` run switch, `RolloutConfig.exact_logprobs`), so the
  # generator's and the trainer's log-probs of the same tokens agree bit for bit. Never exported.
  exact: bool = False
  # How a MoE layer's experts compute their grouped matmuls (GROUPED_GEMMS): 'ragged_dot'
  # (`jax.lax.ragged_dot`) or 'pallas' (`model.grouped_gemm`'s tile kernels); a role's run setting
  # (`TrainConfig.moe_grouped_gemm`, `GeneratorConfig.moe_grouped_gemm`) resolved for its devices.
  grouped_gemm: str = "ragged_dot"

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
    if self.grouped_gemm not in GROUPED_GEMMS:
      raise ValueError(f"grouped_gemm must be one of {GROUPED_GEMMS}, got {self.grouped_gemm!r}")
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


# The generator's weight precisions (`GeneratorConfig.quantize`, `WeightLayout.quantize`; `model.fp8`):
#   None           every weight in the generator dtype
#   'fp8'          every projection of a layer in float8_e4m3fn with a scale per output channel
#   'fp8+lm_head'  the lm_head too, a scale per vocabulary row (tied embeddings: an fp8 copy for the
#                  logits, the lookup in the generator dtype)
QUANTIZATIONS = (None, "fp8", "fp8+lm_head")


def quantize_problem(quantize: Any) -> str | None:
  """None if `quantize` is one of `QUANTIZATIONS`, else what was expected: the one check of the
  generator's precision (`GeneratorConfig`'s rule and `WeightLayout`'s)."""
  if quantize in QUANTIZATIONS:
    return None
  return ("None, 'fp8' or 'fp8+lm_head' ('fp8': the projections in float8_e4m3fn decoded as fp8 GEMMs; "
          "'fp8+lm_head': the lm_head too; there is no 'int8')")


@dataclasses.dataclass(frozen=True)
class WeightLayout:
  """Which projections a model holds fused (the generator's serving layout) and in which precision;
  the default, nothing fused and nothing quantised, is the trainer's and checkpoints' (Hugging Face's
  projections)."""

  fused_qkv: bool = False  # wqkv (and bqkv) instead of wq, wk, wv (bq, bk, bv)
  fused_mlp: bool = False  # w_gate_up instead of w_gate, w_up
  quantize: str | None = None  # one of QUANTIZATIONS

  def __post_init__(self):
    problem = quantize_problem(self.quantize)
    if problem:
      raise ValueError(f"WeightLayout.quantize (GeneratorConfig.quantize): expected {problem}, got {self.quantize!r}")

  @property
  def fp8(self) -> bool:
    """The projections in float8_e4m3fn + per-output-channel scales (`model.fp8`)."""
    return self.quantize is not None

  @property
  def fp8_lm_head(self) -> bool:
    """The lm_head in float8_e4m3fn + a scale per vocabulary row (tied: its own copy)."""
    return self.quantize == "fp8+lm_head"


HF_LAYOUT = WeightLayout()


ROPE_TYPES = ("default", "llama3", "yarn")


def _rope_type(scaling: dict | None) -> str:
  rope_type = "default" if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))
  if rope_type not in ROPE_TYPES:
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
  return rope_type


def rope_frequencies(config: ModelConfig) -> Array:
  """Inverse frequencies `[head_dim // 2]` (fp32), with llama3 or yarn `rope_scaling` applied. With
  `ModelConfig.exact` they are computed on the host in float64 and rounded to fp32 once, so every
  program holds the same constant: computed in fp32 inside a program, `theta ** x` takes whichever
  pow that program gets (XLA's constant folder, a fused vector pow, an eager op), 1 ulp apart for
  some theta (500000, Llama 3's), and that moves every angle of the frequency."""
  if config.exact:
    return jnp.asarray(frequencies_in(config, np).astype(np.float32))
  return frequencies_in(config, jnp)


def frequencies_in(config: ModelConfig, xp) -> Array:
  """`rope_frequencies` in the array module `xp`: numpy (float64) or jax.numpy (fp32)."""
  dim = config.head_dim
  dtype = xp.float64 if xp is np else xp.float32
  inv_freq = 1.0 / (config.rope_theta ** (xp.arange(0, dim, 2, dtype=dtype) / dim))
  scaling = config.rope_scaling_dict
  rope_type = _rope_type(scaling)
  if rope_type == "default":
    return inv_freq
  factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
  if rope_type == "yarn":
    return _yarn_frequencies(xp, inv_freq, dim, config.rope_theta, factor, old_len, scaling)
  low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
  wavelen = 2 * math.pi / inv_freq
  scaled = xp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
  return xp.where(is_medium, smoothed, scaled)


def _yarn_frequencies(xp, inv_freq: Array, dim: int, theta: float, factor: float, old_len: int, scaling: dict) -> Array:
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
  ramp = xp.clip((xp.arange(dim // 2, dtype=inv_freq.dtype) - low) / (high - low), 0, 1)
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
