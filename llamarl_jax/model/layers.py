"""The pieces the decoder's modules (`model.llama`) are built of: parameters with `logical_axes`
metadata, projections (a Param, or float8_e4m3fn values with a per-output-channel scale beside them)
and their products (`dense`), RMSNorm, and the LoRA adapters' unmerged low-rank path (`LoraLayer`,
`with_lora`)."""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from llamarl_jax.model import exact as exact_lib
from llamarl_jax.model import fp8 as fp8_lib

Array = jax.Array


def param(rngs: nnx.Rngs, shape, axes, dtype, scale=None) -> nnx.Param:
  fan_in = shape[0] if scale is None else None
  std = scale if scale is not None else 1.0 / math.sqrt(fan_in)
  value = std * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape, jnp.float32)
  return nnx.Param(value.astype(dtype), logical_axes=axes)


def projection(module: nnx.Module, name: str, rngs: nnx.Rngs, shape, axes, dtype, scale=None, *,
                n_in: int = 1, fp8: bool = False, experts: bool = False) -> None:
  """Set projection `name` of `module`: a Param `[*in, *out]` (n_in input axes) in `dtype`, or with
  fp8 its float8_e4m3fn values and a `name_scale` Param `[*out]` (`model.fp8.quantize_weight`).
  experts: `[experts, *in, *out]`, the scale `[experts, *out]`."""
  w = param(rngs, shape, axes, jnp.float32 if fp8 else dtype, scale)
  if not fp8:
    setattr(module, name, w)
    return
  values, w_scale = fp8_lib.quantize_weight(w[...], n_in, experts)
  setattr(module, name, nnx.Param(values, logical_axes=axes))
  setattr(module, name + fp8_lib.SCALE, nnx.Param(w_scale, logical_axes=fp8_lib.scale_of(axes, n_in, experts)))


def dense(x: Array | fp8_lib.Rows, module: nnx.Module, name: str, plain, dtype=None, *, n_in: int = 1,
          exact: bool = False) -> Array:
  """Projection `name` of `module` applied to x `[..., K]`: `plain(x, w)` with w cast to x's dtype,
  or, where the projection is fp8 (a `name_scale` beside it), the fp8 product `model.fp8.dense` in
  `dtype` (default x's; x may be `fp8.Rows`, quantised before). exact: the batch-invariant product
  `model.exact.dense` of x's last `n_in` axes with w's leading ones instead of `plain`."""
  w = getattr(module, name)[...]
  scale = getattr(module, name + fp8_lib.SCALE, None)
  if scale is not None:
    return fp8_lib.dense(x, w, scale[...], dtype)
  if exact:
    return exact_lib.dense(x, w, n_in=n_in, out_dtype=dtype)
  return plain(x, w.astype(x.dtype))


class RMSNorm(nnx.Module):
  """RMSNorm over the last axis (fp32 statistics, HF's rounding order); `axis` names the scale's axis;
  exact: `model.exact.rms_norm`."""

  def __init__(self, dim: int, eps: float, param_dtype, axis: str = "norm", exact: bool = False):
    self.eps, self.exact = eps, exact
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=(axis,))

  def __call__(self, x: Array) -> Array:
    return rms_norm(x, self.scale[...], self.eps, exact=self.exact)


def rms_norm(x: Array, scale: Array, eps: float, *, exact: bool = False) -> Array:
  """RMSNorm of x `[..., D]` with scale `[D]`: fp32 statistics, the result in x's dtype (exact: the
  batch-invariant form, `model.exact.rms_norm`)."""
  if exact:
    return exact_lib.rms_norm(x, scale, eps)
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return scale.astype(x.dtype) * xf.astype(x.dtype)


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

