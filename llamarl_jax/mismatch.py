"""Trainer-generator mismatch, measured every step under the names verl and NeMo-RL use.

The generator reports log mu(y_t), the log-prob of each sampled token under the distribution that
actually sampled it; the trainer recomputes log pi(y_t) with its own forward pass. At policy lag 0
they are the same weights, so any difference is numerics (bf16 vs fp32, kernels, summation order,
a KV-cache decode vs a full forward); at lag k > 0 it also holds k optimizer steps of policy change.
Splitting by lag separates the two.

With d = log pi - log mu per valid response token (clipped to +-20 before exponentiation, as in
`llamarl_jax.losses`), over the valid tokens:

  rollout_corr/kl_k3          mean of (e^d - 1) - d: Schulman's k3 estimator of KL(mu || pi) from
                              tokens sampled from mu; unbiased, >= 0 per token, ~d^2/2 when small.
                              verl computes the same estimator (`compute_offpolicy_metrics` in
                              verl/trainer/ppo/rollout_corr_helper.py: log_ratio = old_log_prob -
                              rollout_log_prob, k3 = exp(log_ratio) - log_ratio - 1) and logs it
                              as `rollout_corr/k3_kl`.
  rollout_corr/ratio_mean     mean of pi/mu = e^d          (verl: rollout_corr/rollout_is_mean)
  rollout_corr/ratio_max      max of pi/mu                 (verl: rollout_corr/rollout_is_max)
  rollout_corr/token_mult_prob_error
                              mean of e^|d|: NeMo-RL's multiplicative probability error
                              (nemo_rl/algorithms/loss_functions.py: exp(|generation_logprobs -
                              prev_logprobs|) averaged over valid tokens; docs/adding-new-models.md).
                              1 when the two agree exactly; NeMo-RL's tests expect < 1.05-1.1.
  rollout_corr/num_tokens     the valid tokens these are over

and the same five under `rollout_corr/lag{k}/` for the tokens generated k versions before the
trainer's current one (k < `num_lags`). Pure and jittable; the trainer calls it inside its step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llamarl_jax.losses import LOG_RATIO_LIMIT, masked_mean

Array = jax.Array

PREFIX = "rollout_corr"
MISMATCH_LAGS = 4  # per-lag metrics for lags 0 .. 3 by default (LlamaRL runs at lag 1)


def _summary(d: Array, valid: Array) -> dict[str, Array]:
  """The mismatch metrics of log-ratios `d` over the positions where `valid` (same shapes); 0 where
  there are none (token_mult_prob_error and ratio_mean are then 0, not 1: num_tokens says why)."""
  any_valid = jnp.any(valid)
  ratio = jnp.exp(d)
  return {"kl_k3": masked_mean(jnp.expm1(d) - d, valid),
          "ratio_mean": masked_mean(ratio, valid),
          "ratio_max": jnp.where(any_valid, jnp.max(jnp.where(valid, ratio, -jnp.inf)), 0.0),
          "token_mult_prob_error": masked_mean(jnp.exp(jnp.abs(d)), valid),
          "num_tokens": jnp.sum(valid).astype(jnp.float32)}


def mismatch_metrics(logprobs: Array, behaviour_logprobs: Array, mask: Array, lags: Array | None = None, *,
                     num_lags: int = MISMATCH_LAGS) -> dict[str, Array]:
  """Mismatch between the trainer's `logprobs` (log pi) and the generator's `behaviour_logprobs`
  (log mu) of the same tokens, over the valid tokens of `mask` (see the module docstring).

  logprobs, behaviour_logprobs, mask: `[..., R]` (any matching shapes, e.g. `[B, R]` or the trainer's
  microbatched `[M, B/M, R]`); masked positions may hold anything (inf, NaN) and count for nothing.
  lags: int `[..., R]`, each token's policy lag (trainer version - generating version); negative =
  unknown (counted in the totals, in no lag's split). With `lags`, also `rollout_corr/lag{k}/*` for
  k in 0 .. num_lags - 1 (all present; `num_tokens` 0 for a lag with no tokens). Scalar float32 each.
  """
  if jnp.shape(logprobs) != jnp.shape(behaviour_logprobs) or jnp.shape(logprobs) != jnp.shape(mask):
    raise ValueError(f"logprobs {jnp.shape(logprobs)}, behaviour_logprobs {jnp.shape(behaviour_logprobs)} "
                     f"and mask {jnp.shape(mask)} must have the same shape")
  if lags is not None and jnp.shape(lags) != jnp.shape(mask):
    raise ValueError(f"lags has shape {jnp.shape(lags)}, expected the mask's {jnp.shape(mask)}")
  if num_lags < 0:
    raise ValueError(f"num_lags must be >= 0, got {num_lags}")
  valid = jnp.asarray(mask) != 0
  d = jnp.asarray(logprobs, jnp.float32) - jnp.asarray(behaviour_logprobs, jnp.float32)
  d = jax.lax.stop_gradient(jnp.clip(jnp.where(valid, d, 0.0), -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
  out = {f"{PREFIX}/{k}": v for k, v in _summary(d, valid).items()}
  if lags is not None:
    for lag in range(num_lags):
      out.update({f"{PREFIX}/lag{lag}/{k}": v for k, v in _summary(d, valid & (lags == lag)).items()})
  return out


def drop_empty_lags(metrics: dict[str, float]) -> dict[str, float]:
  """Host-side: leave out the `rollout_corr/lag{k}/*` entries of lags that had no tokens this step
  (a 0 there would read as "no mismatch" in TensorBoard)."""
  empty = {k[:-len("num_tokens")] for k, v in metrics.items()
           if k.startswith(f"{PREFIX}/lag") and k.endswith("/num_tokens") and v == 0}
  return {k: v for k, v in metrics.items() if not any(k.startswith(p) for p in empty)}
