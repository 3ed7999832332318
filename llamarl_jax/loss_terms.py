"""The pieces the losses of `llamarl_jax.losses` are built from, as pure JAX functions.

Building blocks any JAX code may use (`losses` re-exports them): `kl_estimate` (k1/k2/k3 per
token), `entropy_from_logits`, `aggregate` (token / sequence means of `[batch, seq]` values) and
`masked_mean`.

The plumbing the policy losses share: `policy_inputs` checks a loss's arguments, upcasts them and
zeroes them at masked positions; the loss builds its per-token policy-gradient term and token
statistics from `clipped_log_ratio`, `ratio_stats`, `detached_pg`, `clipped_surrogate` and
`sequence_log_ratio`; `finish_policy_loss` adds the KL and entropy terms, aggregates, and reduces
the metrics. The conventions (masking, aggregation modes, metric names) are in `losses`' docstring.
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

Array = jax.Array

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_sum_norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
LOG_RATIO_LIMIT = 20.0


# ----------------------------------------------------------------------------- small helpers


def as_float(x) -> Array:
  """`x` as an array of at least float32 (bf16/f16 are upcast; f64 stays f64 under x64)."""
  x = jnp.asarray(x)
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def masked_mean(values: Array, mask: Array) -> Array:
  """Mean of `values` over positions where `mask` is nonzero; 0 when there are none."""
  valid = jnp.asarray(mask) != 0
  total = jnp.sum(jnp.where(valid, values, 0))
  return total / jnp.maximum(jnp.sum(valid), 1)


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
  """Raise ValueError unless `value` is one of `choices`."""
  if value not in choices:
    raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_positive(name: str, value) -> None:
  """Raise ValueError if `value` is a Python number <= 0 (traced values are not checked)."""
  if isinstance(value, (int, float)) and not value > 0:
    raise ValueError(f"{name} must be > 0, got {value}")


def float32_metrics(metrics: dict[str, Array]) -> dict[str, Array]:
  """The metric dict as constant float32 scalars (what every loss returns)."""
  return {k: jax.lax.stop_gradient(jnp.asarray(v, jnp.float32)) for k, v in metrics.items()}


def count_metrics(valid: Array) -> dict[str, Array]:
  """policy/num_tokens (valid tokens) and policy/num_seqs (rows with one or more) of `valid` `[B, T]`."""
  return {"policy/num_tokens": jnp.sum(valid), "policy/num_seqs": jnp.sum(jnp.any(valid, axis=-1))}


# ----------------------------------------------------------------------------- building blocks


def kl_estimate(logprobs: Array, ref_logprobs: Array, kind: str = "k3") -> Array:
  """Per-token estimate of KL(q || p) from tokens sampled from q (Schulman, "Approximating KL").

  logprobs = log q(x), ref_logprobs = log p(x), any matching shapes; returns that shape. With
  log_r = log p(x) - log q(x) (clipped to +-20):
    k1 = -log_r                 unbiased, high variance, can be negative per token
    k2 = log_r^2 / 2            biased (accurate when q ~ p), nonnegative
    k3 = (e^log_r - 1) - log_r  unbiased, nonnegative, low variance (the GRPO penalty)
  E.g. the KL-to-reference penalty is kl_estimate(log pi, log pi_ref); the off-policyness
  KL(mu || pi) of a batch sampled from mu is kl_estimate(log mu, log pi).
  """
  check_choice("kind", kind, KL_ESTIMATORS)
  logprobs, ref_logprobs = as_float(logprobs), as_float(ref_logprobs)
  chex.assert_equal_shape([logprobs, ref_logprobs],
                          custom_message="kl_estimate: logprobs and ref_logprobs must have the same shape")
  log_r = jnp.clip(ref_logprobs - logprobs, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
  if kind == "k1":
    return -log_r
  if kind == "k2":
    return 0.5 * jnp.square(log_r)
  return jnp.expm1(log_r) - log_r


def entropy_from_logits(logits: Array) -> Array:
  """Entropy H = -sum_v p_v log p_v of softmax(logits) over the last axis.

  logits [..., V] (any float dtype; computed in float32) -> [...] float32. Safe for -inf logits
  (masked vocabulary entries): their 0 * log 0 terms are 0 in value and gradient.
  """
  logp = jax.nn.log_softmax(as_float(logits), axis=-1)
  p = jnp.exp(logp)
  return -jnp.sum(p * jnp.where(p > 0, logp, 0.0), axis=-1)


def _aggregate(values: Array, valid: Array, mode: str, loss_norm_constant) -> Array:
  values = jnp.where(valid, values, 0)
  if mode == "token_mean":
    return jnp.sum(values) / jnp.maximum(jnp.sum(valid), 1)
  tokens_per_seq = jnp.sum(valid, axis=-1)
  num_seqs = jnp.maximum(jnp.sum(tokens_per_seq > 0), 1)
  if mode == "seq_mean_token_mean":
    seq_means = jnp.sum(values, axis=-1) / jnp.maximum(tokens_per_seq, 1)
    return jnp.sum(seq_means) / num_seqs
  norm = values.shape[-1] if loss_norm_constant is None else loss_norm_constant
  return jnp.sum(values) / (norm * num_seqs)


def aggregate(values: Array, mask: Array, mode: str = "token_mean",
              loss_norm_constant: float | None = None) -> Array:
  """Reduce per-token values `[B, T]` to a scalar over the valid (mask != 0) tokens.

  "token_mean":          sum(m * v) / sum(m)
  "seq_mean_token_mean": mean over sequences with >= 1 valid token of sum_t(m v) / sum_t(m)
  "seq_sum_norm":        mean over sequences with >= 1 valid token of sum_t(m v) / C, where
                         C = loss_norm_constant (default: T, the padded length). Dr. GRPO: a
                         constant C keeps long and short responses' tokens on the same scale.
  Empty batches give 0.
  """
  check_choice("aggregation", mode, AGGREGATIONS)
  if loss_norm_constant is not None:
    check_positive("loss_norm_constant", loss_norm_constant)
  values = as_float(values)
  chex.assert_rank(values, 2, custom_message="aggregate: values must be [batch, seq]")
  chex.assert_shape(mask, values.shape,
                    custom_message=f"aggregate: mask must have the shape of values {values.shape}")
  return _aggregate(values, jnp.asarray(mask) != 0, mode, loss_norm_constant)


# ----------------------------------------------------------------------------- policy-loss plumbing


class PolicyInputs(NamedTuple):
  """A policy loss's checked, upcast inputs and the options of its shared terms.

  Every array is 0 at masked positions (so nothing there can leak); all are constants except
  `logprobs` and `entropy`, through which the gradient flows.
  """

  logprobs: Array            # [B, T] log pi, differentiable
  behaviour_logprobs: Array  # [B, T] log mu
  advantages: Array          # [B, T] (per-sequence advantages broadcast over tokens)
  valid: Array               # [B, T] bool: mask != 0
  ref_logprobs: Array | None  # [B, T] log pi_ref, for the KL term
  entropy: Array | None      # [B, T] per-token entropy, differentiable
  extras: dict[str, Array]   # further [B, T] constants of one loss, by keyword (proximal_logprobs)
  kl_coef: float
  kl_estimator: str
  entropy_coef: float
  aggregation: str
  loss_norm_constant: float | None


def policy_inputs(loss_name: str, logprobs, behaviour_logprobs, advantages, mask, *, ref_logprobs, kl_coef,
                  kl_estimator, entropy, entropy_coef, aggregation, loss_norm_constant,
                  **extra_token_arrays) -> PolicyInputs:
  """Check the options and the shapes and dtypes of a policy loss's arguments (errors name
  `loss_name`); upcast, mask and stop-gradient them into `PolicyInputs`. advantages: `[B]` or
  `[B, T]`; every other array (extra_token_arrays too) `[B, T]` like logprobs."""
  check_choice("aggregation", aggregation, AGGREGATIONS)
  check_choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
  if loss_norm_constant is not None:
    check_positive("loss_norm_constant", loss_norm_constant)
  chex.assert_rank(logprobs, 2, custom_message=(
      f"{loss_name}: logprobs must be [batch, seq]; for one sequence add a leading axis (x[None])"))
  chex.assert_type(logprobs, float, custom_message=f"{loss_name}: logprobs must be floating point")
  shape = jnp.shape(logprobs)
  token_arrays = dict(behaviour_logprobs=behaviour_logprobs, ref_logprobs=ref_logprobs,
                      entropy=entropy, **extra_token_arrays)
  for name, x in token_arrays.items():
    if x is not None:
      chex.assert_shape(x, shape, custom_message=(
          f"{loss_name}: {name} must have the shape of logprobs {shape}, got {jnp.shape(x)}"))
      chex.assert_type(x, float, custom_message=f"{loss_name}: {name} must be floating point")
  chex.assert_shape(mask, shape, custom_message=(
      f"{loss_name}: mask must have the shape of logprobs {shape}, got {jnp.shape(mask)}"))
  adv_msg = (f"{loss_name}: advantages must be per sequence [batch] = {shape[:1]} or per token "
             f"[batch, seq] = {shape}, got {jnp.shape(advantages)}")
  if jnp.ndim(advantages) == 1:
    chex.assert_shape(advantages, shape[:1], custom_message=adv_msg)
    advantages = jnp.asarray(advantages)[:, None]
  else:
    chex.assert_shape(advantages, shape, custom_message=adv_msg)

  valid = jnp.asarray(mask) != 0

  def clean(x, constant=True):
    if x is None:
      return None
    x = jnp.where(valid, as_float(x), 0.0)
    return jax.lax.stop_gradient(x) if constant else x

  return PolicyInputs(logprobs=clean(logprobs, constant=False),
                      behaviour_logprobs=clean(behaviour_logprobs),
                      advantages=clean(jnp.broadcast_to(as_float(advantages), shape)),
                      valid=valid, ref_logprobs=clean(ref_logprobs), entropy=clean(entropy, constant=False),
                      extras={name: clean(x) for name, x in extra_token_arrays.items()},
                      kl_coef=kl_coef, kl_estimator=kl_estimator, entropy_coef=entropy_coef,
                      aggregation=aggregation, loss_norm_constant=loss_norm_constant)


def clipped_log_ratio(numerator: Array, denominator: Array) -> Array:
  """log(numerator / denominator) from two log-probabilities, clipped to +-LOG_RATIO_LIMIT."""
  return jnp.clip(numerator - denominator, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def detached_pg(weight: Array, inputs: PolicyInputs) -> Array:
  """The importance-weighted REINFORCE term -stop_gradient(w_t) * A_t * log pi_t, `[B, T]`."""
  return -jax.lax.stop_gradient(weight) * inputs.advantages * inputs.logprobs


def reduce_token_metrics(stats: dict[str, tuple[str, Array]], valid: Array) -> dict[str, Array]:
  """{name: (reduction, per-token values [B, T])} -> {name: scalar} over the valid tokens.

  reduction is "mean", "max" or "min"; an empty mask gives 0.
  """
  any_valid = jnp.any(valid)
  out = {}
  for name, (reduction, values) in stats.items():
    values = jax.lax.stop_gradient(jnp.asarray(values, jnp.float32))
    if reduction == "mean":
      out[name] = masked_mean(values, valid)
    elif reduction == "max":
      out[name] = jnp.where(any_valid, jnp.max(jnp.where(valid, values, -jnp.inf)), 0.0)
    else:
      out[name] = jnp.where(any_valid, jnp.min(jnp.where(valid, values, jnp.inf)), 0.0)
  return out


def sequence_log_ratio(log_ratio: Array, valid: Array, *, geometric: bool) -> Array:
  """Per row `[B, 1]`: log prod_t r_t (sum over valid tokens) or, geometric, its mean over them.

  Clipped to +-LOG_RATIO_LIMIT like every log-ratio here; rows without valid tokens give 0 (ratio 1).
  """
  total = jnp.sum(jnp.where(valid, log_ratio, 0.0), axis=-1, keepdims=True)
  if geometric:
    total = total / jnp.maximum(jnp.sum(valid, axis=-1, keepdims=True), 1)
  return jnp.clip(total, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def sequence_mean(values: Array, valid: Array) -> Array:
  """Mean of per-row `values` `[B]` over the rows with at least one valid token; 0 when none."""
  has = jnp.any(valid, axis=-1)
  values = jax.lax.stop_gradient(jnp.asarray(values, jnp.float32))
  return jnp.sum(jnp.where(has, values, 0.0)) / jnp.maximum(jnp.sum(has), 1)


def ratio_stats(log_ratio: Array) -> dict[str, tuple[str, Array]]:
  """The token statistics policy/ratio_mean|max|min of the ratio exp(log_ratio) `[B, T]`."""
  ratio = jnp.exp(log_ratio)
  return {"policy/ratio_mean": ("mean", ratio), "policy/ratio_max": ("max", ratio),
          "policy/ratio_min": ("min", ratio)}


def clipped_surrogate(log_ratio: Array, advantages: Array, eps_low, eps_high):
  """Per-token PPO loss -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) and its clip statistics."""
  check_positive("eps_low", eps_low)
  check_positive("eps_high", eps_high)
  ratio = jnp.exp(log_ratio)
  clipped_ratio = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  per_token = -jnp.minimum(ratio * advantages, clipped_ratio * advantages)
  ratio_sg = jax.lax.stop_gradient(ratio)
  clipped_high = (advantages > 0) & (ratio_sg > 1.0 + eps_high)
  clipped_low = (advantages < 0) & (ratio_sg < 1.0 - eps_low)
  stats = {"policy/frac_clipped": ("mean", clipped_high | clipped_low),
           "policy/frac_clipped_low": ("mean", clipped_low),
           "policy/frac_clipped_high": ("mean", clipped_high)}
  return per_token, stats


def finish_policy_loss(pg: Array, inputs: PolicyInputs,
                       stats: dict[str, tuple[str, Array]]) -> tuple[Array, dict[str, Array]]:
  """The tail every policy loss shares: its per-token policy-gradient term `pg` `[B, T]` plus the
  optional KL-to-reference and entropy terms, each aggregated by `inputs.aggregation`, summed into
  the loss; the loss-specific token statistics `stats` ({name: (reduction, [B, T])}) plus
  policy/kl_ref, policy/entropy and policy/kl_behaviour reduced over the valid tokens, and the
  counts. Returns (loss, metrics) as in `losses`' docstring."""
  valid = inputs.valid
  terms = {"loss/pg": (1.0, pg)}  # name: (coefficient, per-token values)
  if inputs.ref_logprobs is not None:
    kl = kl_estimate(inputs.logprobs, inputs.ref_logprobs, inputs.kl_estimator)
    terms["loss/kl"] = (inputs.kl_coef, kl)
    stats["policy/kl_ref"] = ("mean", kl)
  if inputs.entropy is not None:
    terms["loss/entropy"] = (-inputs.entropy_coef, inputs.entropy)
    stats["policy/entropy"] = ("mean", inputs.entropy)
  stats["policy/kl_behaviour"] = ("mean", kl_estimate(inputs.behaviour_logprobs, inputs.logprobs))

  metrics = {name: coef * _aggregate(values, valid, inputs.aggregation, inputs.loss_norm_constant)
             for name, (coef, values) in terms.items()}
  total = sum(metrics.values())
  metrics["loss/total"] = total
  metrics.update(reduce_token_metrics(stats, valid))
  metrics.update(count_metrics(valid))
  return total, float32_metrics(metrics)
