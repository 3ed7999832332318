"""Policy-gradient losses for LLM RL as pure JAX functions over `[batch, seq]` token arrays.

Every loss has the same signature shape and the same conventions:

  loss, metrics = some_loss(logprobs, behaviour_logprobs, advantages, mask, *, <loss knobs>,
                            ref_logprobs=None, kl_coef=0.0, kl_estimator="k3",
                            entropy=None, entropy_coef=0.0,
                            aggregation="token_mean", loss_norm_constant=None)

  logprobs            f [B, T]  log pi(y_t): the trainer's current policy at the sampled tokens. The
                                gradient flows through this array (and through `entropy`) only.
  behaviour_logprobs  f [B, T]  log mu(y_t): the distribution that actually sampled y_t (a stale policy
                                version and/or a quantised generator). Treated as a constant.
  advantages          f [B] (per sequence, broadcast over tokens) or f [B, T] (per token); a constant.
  mask                  [B, T]  nonzero = valid response token (bool, int or float).

Masked positions contribute exactly 0 to the loss, the gradient and every metric, even when the
arrays hold inf or NaN there. All inputs are upcast to at least float32; the loss is a scalar.
All-masked batches give loss 0, zero gradients and finite (zero) metrics.

Loss aggregation (`aggregation`, the same names for every loss), for per-token terms l[b, t]:
  "token_mean"           sum_{b,t} m l / sum_{b,t} m            (DAPO's token-level mean; default)
  "seq_mean_token_mean"  mean over non-empty sequences of (sum_t m l / sum_t m)  (GRPO's original)
  "seq_sum_norm"         mean over non-empty sequences of (sum_t m l / C)        (Dr. GRPO), with
                         C = `loss_norm_constant` (e.g. the max response length; default: T).
To accumulate microbatches into the full-batch value, weight each microbatch's loss by
`metrics["policy/num_tokens"]` (token_mean) or `metrics["policy/num_seqs"]` (the two others).

Metrics (flat dict of scalar float32 arrays, cleanRL-style names; token statistics are taken over
valid tokens only, and are 0 when there is none):
  loss/total              the returned loss: loss/pg + loss/kl + loss/entropy
  loss/pg                 the aggregated policy-gradient term
  loss/kl                 kl_coef * aggregated KL-to-reference      (only with ref_logprobs)
  loss/entropy            -entropy_coef * aggregated entropy        (only with entropy)
  policy/ratio_mean|max|min  statistics of the importance ratio the loss truncates or clips
                          (pi/mu for aipo, ppo_clip, cispo, seq_tis and mis; pi/pi_prox for
                          decoupled_ppo; the sequence ratio s_i of each token's sequence for gspo)
  policy/frac_truncated   fraction of tokens whose weight hit its upper bound (aipo, decoupled_ppo,
                          cispo: 1 + eps_high, seq_tis: the sequence weight hit is_threshold)
  policy/frac_truncated_low  fraction of tokens whose weight was raised to 1 - eps_low (cispo)
  policy/frac_clipped     fraction of tokens where the PPO clip is active, i.e. zero gradient
                          (ppo_clip, decoupled_ppo); split into policy/frac_clipped_low (A < 0,
                          ratio < 1 - eps_low) and policy/frac_clipped_high (A > 0, ratio > 1 + eps_high)
  policy/behaviour_ratio_mean|max  pi_prox/mu before truncation (decoupled_ppo only)
  policy/kl_behaviour     KL(mu || pi), k3 estimate with the sampled tokens: how off-policy the batch is
  policy/kl_ref           mean per-token KL(pi || ref) estimate     (only with ref_logprobs)
  policy/entropy          mean per-token entropy                    (only with entropy)
  policy/num_tokens       number of valid tokens
  policy/num_seqs         number of sequences with at least one valid token
  rollout_corr/*          the rollout-correction statistics of seq_tis and mis, named as verl's
                          `rollout_corr` metrics (see those functions)

Every metric above is a mean over valid tokens, a max / min, or a count, except the names in
`SEQUENCE_METRICS`: means over the sequences with at least one valid token (to combine
microbatches, weight those by policy/num_seqs, the others by policy/num_tokens).

Sequence-level quantities (gspo, seq_tis, mis) reduce over the `seq` axis of each row, so a row must
never be split across microbatches (splitting the batch axis is fine).

For numerical safety, log-ratios are clipped to +-20 before exponentiation (a ratio beyond
e^20 ~ 5e8 is treated as e^20; its gradient is then 0 in the ratio-through-clamp/PPO forms).

The pieces every loss shares (the checks and masking of the inputs, the KL and entropy terms, the
aggregation, the metric reductions) live in `loss_terms`; the building blocks
`kl_estimate`, `entropy_from_logits`, `aggregate` and `masked_mean` are importable from here too.
"""

from __future__ import annotations

import types
from typing import Callable

import jax
import jax.numpy as jnp

from llamarl_jax.loss_terms import (AGGREGATIONS, KL_ESTIMATORS, LOG_RATIO_LIMIT, aggregate, as_float,
                                    check_choice, check_positive, clipped_log_ratio, clipped_surrogate,
                                    count_metrics, detached_pg, entropy_from_logits, finish_policy_loss,
                                    float32_metrics, kl_estimate, masked_mean, policy_inputs, ratio_stats,
                                    sequence_log_ratio, sequence_mean)

__all__ = ["AGGREGATIONS", "AIPO_FORMS", "DEFAULT_RHO_MAX", "KL_ESTIMATORS", "LOG_RATIO_LIMIT", "LOSSES", "MIS_LEVELS",
           "SEQUENCE_METRICS", "TRAINER_LOSSES", "aggregate", "aipo_loss", "bradley_terry_loss", "cispo_loss",
           "decoupled_ppo_loss", "entropy_from_logits", "get_loss", "gspo_loss", "kl_estimate", "masked_mean",
           "mis_loss", "nll_loss", "ppo_clip_loss", "seq_tis_loss", "value_loss"]

Array = jax.Array

AIPO_FORMS = ("detached", "clamped")
DEFAULT_RHO_MAX = 2.0
MIS_LEVELS = ("token", "sequence", "geometric")
# Metrics that are means over sequences (not tokens): combine microbatches weighted by policy/num_seqs.
SEQUENCE_METRICS = frozenset({"rollout_corr/rollout_rs_seq_masked_fraction"})

# ----------------------------------------------------------------------------- the losses


def aipo_loss(logprobs: Array, behaviour_logprobs: Array, advantages: Array, mask: Array, *,
              rho_max: float = DEFAULT_RHO_MAX,
              form: str = "detached",
              ref_logprobs: Array | None = None,
              kl_coef: float = 0.0,
              kl_estimator: str = "k3",
              entropy: Array | None = None,
              entropy_coef: float = 0.0,
              aggregation: str = "token_mean",
              loss_norm_constant: float | None = None) -> tuple[Array, dict[str, Array]]:
  """LlamaRL's AIPO (Asynchronous Importance-weighted Policy Optimisation) loss.

  pi = current policy (logprobs), mu = behaviour policy (behaviour_logprobs), r_t = pi/mu,
  w_t = min(r_t, rho_max): a one-sided truncated importance weight; no PPO two-sided clip.

  form="detached" (default; the paper's update):
      l_t = -stop_gradient(w_t) * A_t * log pi_t
      grad = -sum_t w_t A_t grad log pi_t  (aggregated). Tokens with r_t > rho_max keep the
      gradient rho_max * A_t * grad log pi_t. At pi == mu this is exactly REINFORCE. The loss
      value itself is not a surrogate objective (it scales with log pi); only its gradient matters.
  form="clamped" (ratio through the clamp, what some peers call AIPO):
      l_t = -min(r_t, rho_max) * A_t
      grad = -r_t A_t grad log pi_t where r_t < rho_max and 0 where r_t > rho_max (for either
      sign of A_t). Below rho_max both forms have the same gradient (not the same loss value).

  Plus kl_coef * KL(pi || ref) (estimator `kl_estimator` with ref_logprobs) and
  -entropy_coef * entropy (entropy: per-token [B, T], e.g. entropy_from_logits(logits)), each
  aggregated like the policy term. Shapes, aggregation and metrics: see the module docstring;
  policy/frac_truncated is the fraction of valid tokens with r_t > rho_max.
  rho_max: > 0; typically 2..10; float("inf") disables truncation.
  """
  check_choice("form", form, AIPO_FORMS)
  check_positive("rho_max", rho_max)
  inputs = policy_inputs("aipo_loss", logprobs, behaviour_logprobs, advantages, mask,
                         ref_logprobs=ref_logprobs, kl_coef=kl_coef, kl_estimator=kl_estimator, entropy=entropy,
                         entropy_coef=entropy_coef, aggregation=aggregation,
                         loss_norm_constant=loss_norm_constant)
  log_ratio = clipped_log_ratio(inputs.logprobs, inputs.behaviour_logprobs)
  log_rho = jnp.log(jnp.asarray(rho_max, log_ratio.dtype))
  weight = jnp.exp(jnp.minimum(log_ratio, log_rho))
  if form == "detached":
    pg = detached_pg(weight, inputs)
  else:
    pg = -weight * inputs.advantages
  stats = {**ratio_stats(log_ratio), "policy/frac_truncated": ("mean", log_ratio > log_rho)}
  return finish_policy_loss(pg, inputs, stats)


def ppo_clip_loss(logprobs: Array, behaviour_logprobs: Array, advantages: Array, mask: Array, *,
                  eps_low: float = 0.2,
                  eps_high: float = 0.2,
                  ref_logprobs: Array | None = None,
                  kl_coef: float = 0.0,
                  kl_estimator: str = "k3",
                  entropy: Array | None = None,
                  entropy_coef: float = 0.0,
                  aggregation: str = "token_mean",
                  loss_norm_constant: float | None = None) -> tuple[Array, dict[str, Array]]:
  """PPO/GRPO clipped surrogate with asymmetric clip range (DAPO's clip-higher).

  r_t = pi/mu (mu = the behaviour policy, PPO's "old" policy):
      l_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)
  The gradient is -r_t A_t grad log pi_t, except 0 where the clip is active: A_t > 0 and
  r_t > 1 + eps_high, or A_t < 0 and r_t < 1 - eps_low. Symmetric PPO: eps_low = eps_high = 0.2;
  DAPO: eps_low = 0.2, eps_high = 0.28. KL/entropy terms, shapes, aggregation and metrics: see
  `aipo_loss` and the module docstring.
  """
  inputs = policy_inputs("ppo_clip_loss", logprobs, behaviour_logprobs, advantages, mask,
                         ref_logprobs=ref_logprobs, kl_coef=kl_coef, kl_estimator=kl_estimator, entropy=entropy,
                         entropy_coef=entropy_coef, aggregation=aggregation,
                         loss_norm_constant=loss_norm_constant)
  log_ratio = clipped_log_ratio(inputs.logprobs, inputs.behaviour_logprobs)
  pg, clip_stats = clipped_surrogate(log_ratio, inputs.advantages, eps_low, eps_high)
  return finish_policy_loss(pg, inputs, {**ratio_stats(log_ratio), **clip_stats})


def decoupled_ppo_loss(logprobs: Array, behaviour_logprobs: Array, advantages: Array, mask: Array, *,
                       proximal_logprobs: Array,
                       eps_low: float = 0.2,
                       eps_high: float = 0.2,
                       rho_max: float = DEFAULT_RHO_MAX,
                       ref_logprobs: Array | None = None,
                       kl_coef: float = 0.0,
                       kl_estimator: str = "k3",
                       entropy: Array | None = None,
                       entropy_coef: float = 0.0,
                       aggregation: str = "token_mean",
                       loss_norm_constant: float | None = None) -> tuple[Array, dict[str, Array]]:
  """Decoupled PPO (Hilton et al. 2021; AReaL): the clip is around a proximal policy, not mu.

  pi_prox (proximal_logprobs [B, T], a constant: e.g. the trainer's weights before this update)
  anchors the trust region; mu (the generator that sampled) is corrected by an importance weight:
      w_t = min(pi_prox / mu, rho_max)            (constant, truncated at rho_max)
      r_t = pi / pi_prox
      l_t = -w_t * min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)
  With pi_prox == mu it is exactly `ppo_clip_loss`. Metrics as in `ppo_clip_loss` (policy/ratio_*
  describe r_t = pi/pi_prox), plus policy/frac_truncated (pi_prox/mu > rho_max) and
  policy/behaviour_ratio_mean|max (pi_prox/mu before truncation).
  """
  check_positive("rho_max", rho_max)
  inputs = policy_inputs("decoupled_ppo_loss", logprobs, behaviour_logprobs, advantages, mask,
                         ref_logprobs=ref_logprobs, kl_coef=kl_coef, kl_estimator=kl_estimator, entropy=entropy,
                         entropy_coef=entropy_coef, aggregation=aggregation,
                         loss_norm_constant=loss_norm_constant, proximal_logprobs=proximal_logprobs)
  prox = inputs.extras["proximal_logprobs"]
  log_ratio = clipped_log_ratio(inputs.logprobs, prox)
  log_weight = clipped_log_ratio(prox, inputs.behaviour_logprobs)
  log_rho = jnp.log(jnp.asarray(rho_max, log_weight.dtype))
  weight = jnp.exp(jnp.minimum(log_weight, log_rho))
  surrogate, clip_stats = clipped_surrogate(log_ratio, inputs.advantages, eps_low, eps_high)
  pg = weight * surrogate
  behaviour_ratio = jnp.exp(log_weight)
  stats = {**ratio_stats(log_ratio), **clip_stats,
           "policy/frac_truncated": ("mean", log_weight > log_rho),
           "policy/behaviour_ratio_mean": ("mean", behaviour_ratio),
           "policy/behaviour_ratio_max": ("max", behaviour_ratio)}
  return finish_policy_loss(pg, inputs, stats)


def gspo_loss(logprobs: Array, behaviour_logprobs: Array, advantages: Array, mask: Array, *,
              eps_low: float = 3e-4,
              eps_high: float = 4e-4,
              ref_logprobs: Array | None = None,
              kl_coef: float = 0.0,
              kl_estimator: str = "k3",
              entropy: Array | None = None,
              entropy_coef: float = 0.0,
              aggregation: str = "token_mean",
              loss_norm_constant: float | None = None) -> tuple[Array, dict[str, Array]]:
  """GSPO, Group Sequence Policy Optimization (Zheng et al., Qwen 2025, arXiv:2507.18071).

  One importance ratio per sequence, the geometric mean of its token ratios (length-normalised):
      s_i = (pi(y_i) / mu(y_i))^(1/|y_i|) = exp( (1/|y_i|) sum_{t valid} log(pi_t / mu_t) )
  clipped per sequence PPO-style. We use the paper's GSPO-token form (its eq. for per-token
  advantages), s_{i,t} = sg(s_i) * pi_t / sg(pi_t) (equal to s_i in value):
      l_t = -min(s_{i,t} A_t, clip(s_{i,t}, 1 - eps_low, 1 + eps_high) A_t)
  so every token of sequence i has the gradient -s_i A_t grad log pi_t (times the aggregation
  weight), or 0 when sequence i is clipped (A > 0 and s_i > 1 + eps_high, or A < 0 and
  s_i < 1 - eps_low). With advantages constant over a sequence (per-sequence [B] advantages) this
  is exactly the gradient of the sequence-level GSPO objective. The paper's setting:
  eps_low = 3e-4, eps_high = 4e-4 (the defaults: the ratio is a per-token geometric mean, so the
  range is tiny), aggregation="seq_mean_token_mean" (1/G sum_i over sequences; the default
  "token_mean" weights each sequence by its length). mu is the behaviour policy (with one
  optimizer step per batch, the paper's pi_old).

  KL/entropy terms, shapes and aggregation: see `aipo_loss` and the module docstring. Metrics:
  policy/ratio_* describe s_i (token-weighted mean; max and min over sequences), policy/frac_clipped*
  the fraction of tokens whose sequence is clipped.
  """
  inputs = policy_inputs("gspo_loss", logprobs, behaviour_logprobs, advantages, mask,
                         ref_logprobs=ref_logprobs, kl_coef=kl_coef, kl_estimator=kl_estimator, entropy=entropy,
                         entropy_coef=entropy_coef, aggregation=aggregation,
                         loss_norm_constant=loss_norm_constant)
  token_log_ratio = clipped_log_ratio(inputs.logprobs, inputs.behaviour_logprobs)
  log_s = sequence_log_ratio(token_log_ratio, inputs.valid, geometric=True)  # [B, 1]
  log_s_token = (jax.lax.stop_gradient(log_s)
                 + inputs.logprobs - jax.lax.stop_gradient(inputs.logprobs))  # value log s_i
  pg, clip_stats = clipped_surrogate(log_s_token, inputs.advantages, eps_low, eps_high)
  stats = {**ratio_stats(jnp.broadcast_to(log_s, token_log_ratio.shape)), **clip_stats}
  return finish_policy_loss(pg, inputs, stats)


def cispo_loss(logprobs: Array, behaviour_logprobs: Array, advantages: Array, mask: Array, *,
               eps_low: float = 1.0,
               eps_high: float = 1.0,
               ref_logprobs: Array | None = None,
               kl_coef: float = 0.0,
               kl_estimator: str = "k3",
               entropy: Array | None = None,
               entropy_coef: float = 0.0,
               aggregation: str = "token_mean",
               loss_norm_constant: float | None = None) -> tuple[Array, dict[str, Array]]:
  """CISPO, Clipped IS-weight Policy Optimization (MiniMax-M1, 2025, arXiv:2506.13585, eq. 4).

  Clip the importance-sampling weight itself, stop its gradient, and keep every token's gradient:
      w_t = clip(pi_t / mu_t, 1 - eps_low, 1 + eps_high)
      l_t = -stop_gradient(w_t) * A_t * log pi_t
  Unlike PPO / GSPO no token ever loses its gradient (-w_t A_t grad log pi_t always).
  The paper normalises by the total token count of the group, 1 / sum_i |o_i| (our "token_mean",
  the default), "did not impose a lower bound on the IS weight" (eps_low large: eps_low = 1 puts
  the bound at 0, i.e. none; the default) and tuned only eps_high.

  How it differs from `aipo_loss(form="detached")` (LlamaRL's AIPO, w_t = min(pi/mu, rho_max)):
  the per-token update has the same shape; CISPO bounds the weight on both sides: the upper bound
  1 + eps_high plays rho_max's role, and eps_low < 1 adds a lower bound 1 - eps_low > 0 that raises
  the weight of tokens the current policy now finds much less likely than the sampler did (AIPO
  lets such weights go to 0). The papers also normalise differently: CISPO by the token count of
  the whole group (token_mean), AIPO's paper states the per-token update and leaves the
  normaliser open (here both use `aggregation`). So cispo_loss(eps_low=1, eps_high=rho_max - 1)
  equals aipo_loss(form="detached", rho_max=rho_max) (the defaults: rho_max = 2).
  eps_low in (0, 1]; eps_high > 0 (float("inf") disables the upper bound).

  KL/entropy terms, shapes, aggregation and metrics: see `aipo_loss` and the module docstring;
  policy/frac_truncated and policy/frac_truncated_low are the fractions of tokens whose weight hit
  1 + eps_high and 1 - eps_low.
  """
  check_positive("eps_low", eps_low)
  check_positive("eps_high", eps_high)
  if isinstance(eps_low, (int, float)) and eps_low > 1:
    raise ValueError(f"eps_low must be in (0, 1] (the weight's lower bound 1 - eps_low >= 0; 1 means "
                     f"no lower bound), got {eps_low}")
  inputs = policy_inputs("cispo_loss", logprobs, behaviour_logprobs, advantages, mask,
                         ref_logprobs=ref_logprobs, kl_coef=kl_coef, kl_estimator=kl_estimator, entropy=entropy,
                         entropy_coef=entropy_coef, aggregation=aggregation,
                         loss_norm_constant=loss_norm_constant)
  log_ratio = clipped_log_ratio(inputs.logprobs, inputs.behaviour_logprobs)
  ratio = jnp.exp(log_ratio)
  low, high = 1.0 - jnp.asarray(eps_low, ratio.dtype), 1.0 + jnp.asarray(eps_high, ratio.dtype)
  weight = jnp.clip(ratio, low, high)
  pg = detached_pg(weight, inputs)
  stats = {**ratio_stats(log_ratio), "policy/frac_truncated": ("mean", ratio > high),
           "policy/frac_truncated_low": ("mean", ratio < low)}
  return finish_policy_loss(pg, inputs, stats)


def seq_tis_loss(logprobs: Array, behaviour_logprobs: Array, advantages: Array, mask: Array, *,
                 is_threshold: float = 2.0,
                 ref_logprobs: Array | None = None,
                 kl_coef: float = 0.0,
                 kl_estimator: str = "k3",
                 entropy: Array | None = None,
                 entropy_coef: float = 0.0,
                 aggregation: str = "token_mean",
                 loss_norm_constant: float | None = None) -> tuple[Array, dict[str, Array]]:
  """Sequence-level truncated importance sampling (verl `rollout_corr`: rollout_is="sequence" with
  the pure policy-gradient loss, its `pure_is` preset; Liu, Li et al. 2025, "When Speed Kills
  Stability").

  One weight per sequence, the truncated product of its token ratios (in log space):
      w_i = min( prod_{t valid} pi_t / mu_t , C ),   C = is_threshold
      l_t = -stop_gradient(w_i) * A_t * log pi_t
  Unbiased up to the truncation for sequence-level rewards (the product is the likelihood ratio of
  the whole response), but its variance grows with length: use it when mu and pi are close (small
  lag, same precision). The token-level version (rollout_is="token", w_t = min(pi_t/mu_t, C)) is
  `aipo_loss(form="detached", rho_max=C)`.

  Metrics (verl's names): rollout_corr/rollout_is_mean (the truncated weight, token-weighted),
  rollout_corr/rollout_is_max|min (the untruncated sequence ratio), rollout_corr/
  rollout_is_ratio_fraction_high|low (fraction of tokens whose sequence ratio is above C / below
  1/C; verl counts sequences); policy/frac_truncated = rollout_is_ratio_fraction_high; the rest as
  in `aipo_loss` (policy/ratio_* describe the token ratios pi/mu).
  """
  check_positive("is_threshold", is_threshold)
  inputs = policy_inputs("seq_tis_loss", logprobs, behaviour_logprobs, advantages, mask,
                         ref_logprobs=ref_logprobs, kl_coef=kl_coef, kl_estimator=kl_estimator, entropy=entropy,
                         entropy_coef=entropy_coef, aggregation=aggregation,
                         loss_norm_constant=loss_norm_constant)
  log_ratio = clipped_log_ratio(inputs.logprobs, inputs.behaviour_logprobs)
  log_seq = jnp.broadcast_to(sequence_log_ratio(log_ratio, inputs.valid, geometric=False),
                             log_ratio.shape)
  log_c = jnp.log(jnp.asarray(is_threshold, log_ratio.dtype))
  weight = jnp.exp(jnp.minimum(log_seq, log_c))
  pg = detached_pg(weight, inputs)
  seq_ratio = jnp.exp(log_seq)
  stats = {**ratio_stats(log_ratio), "policy/frac_truncated": ("mean", log_seq > log_c),
           "rollout_corr/rollout_is_mean": ("mean", weight),
           "rollout_corr/rollout_is_max": ("max", seq_ratio),
           "rollout_corr/rollout_is_min": ("min", seq_ratio),
           "rollout_corr/rollout_is_ratio_fraction_high": ("mean", log_seq > log_c),
           "rollout_corr/rollout_is_ratio_fraction_low": ("mean", log_seq < -log_c)}
  return finish_policy_loss(pg, inputs, stats)


def mis_loss(logprobs: Array, behaviour_logprobs: Array, advantages: Array, mask: Array, *,
             level: str = "sequence",
             rs_threshold: float = 2.0,
             rs_threshold_lower: float | None = None,
             ref_logprobs: Array | None = None,
             kl_coef: float = 0.0,
             kl_estimator: str = "k3",
             entropy: Array | None = None,
             entropy_coef: float = 0.0,
             aggregation: str = "token_mean",
             loss_norm_constant: float | None = None) -> tuple[Array, dict[str, Array]]:
  """Masked importance sampling: reject the samples whose ratio leaves a band, weight the rest.

  verl `rollout_corr` rejection sampling (rollout_rs = "token" | "sequence" | "geometric",
  thresholds rollout_rs_threshold / rollout_rs_threshold_lower, default lower = 1/upper) on the
  pure policy-gradient loss; "MIS" of Liu, Li et al. 2025 ("When Speed Kills Stability"):
  w * 1{lower <= rho <= upper} instead of TIS's min(w, C). With lo, hi the band:
      level="token":     rho_t = pi_t / mu_t;                   weight_t = rho_t * keep_t
      level="sequence":  rho_i = prod_{t valid} pi_t / mu_t;    weight_t = rho_i * keep_i
      level="geometric": rho_i = (prod_t pi_t / mu_t)^(1/|y_i|); weight_t = keep_i (rejection only,
                         no IS weight, as verl's geo_rs; use a tight band, e.g. [0.999, 1.001])
      keep = 1{lo <= rho <= hi};   l_t = -stop_gradient(weight_t) * A_t * log pi_t
  Rejected tokens get weight 0 but stay in the aggregation's normaliser (the MIS estimator
  E_mu[rho 1{..} ...]; verl instead drops them from the response mask, which rescales the kept
  tokens by N / N_kept); this keeps microbatch accumulation exact.

  Metrics (verl's names): rollout_corr/rollout_rs_mean|max|min (rho before masking; mean
  token-weighted), rollout_corr/rollout_rs_ratio_fraction_high|low (fraction of tokens whose rho is
  above hi / below lo; verl counts sequences for the sequence levels),
  rollout_corr/rollout_rs_masked_fraction (tokens rejected) and
  rollout_corr/rollout_rs_seq_masked_fraction (sequences with a rejected token, a per-sequence mean);
  the rest as in `aipo_loss` (policy/ratio_* describe the token ratios pi/mu).
  """
  check_choice("level", level, MIS_LEVELS)
  check_positive("rs_threshold", rs_threshold)
  if rs_threshold_lower is None:
    rs_threshold_lower = 1.0 / rs_threshold
  check_positive("rs_threshold_lower", rs_threshold_lower)
  if (isinstance(rs_threshold, (int, float)) and isinstance(rs_threshold_lower, (int, float))
      and rs_threshold_lower > rs_threshold):
    raise ValueError(f"rs_threshold_lower ({rs_threshold_lower}) must be <= rs_threshold ({rs_threshold})")
  inputs = policy_inputs("mis_loss", logprobs, behaviour_logprobs, advantages, mask,
                         ref_logprobs=ref_logprobs, kl_coef=kl_coef, kl_estimator=kl_estimator, entropy=entropy,
                         entropy_coef=entropy_coef, aggregation=aggregation,
                         loss_norm_constant=loss_norm_constant)
  valid = inputs.valid
  log_ratio = clipped_log_ratio(inputs.logprobs, inputs.behaviour_logprobs)
  log_rho = log_ratio if level == "token" else jnp.broadcast_to(
      sequence_log_ratio(log_ratio, valid, geometric=level == "geometric"), log_ratio.shape)
  log_rho = jax.lax.stop_gradient(log_rho)
  log_hi = jnp.log(jnp.asarray(rs_threshold, log_rho.dtype))
  log_lo = jnp.log(jnp.asarray(rs_threshold_lower, log_rho.dtype))
  high, low = log_rho > log_hi, log_rho < log_lo
  keep = ~(high | low)
  rho = jnp.exp(log_rho)
  weight = jnp.where(keep, 1.0 if level == "geometric" else rho, 0.0)
  pg = detached_pg(weight, inputs)
  stats = {**ratio_stats(log_ratio),
           "rollout_corr/rollout_rs_mean": ("mean", rho),
           "rollout_corr/rollout_rs_max": ("max", rho),
           "rollout_corr/rollout_rs_min": ("min", rho),
           "rollout_corr/rollout_rs_ratio_fraction_high": ("mean", high),
           "rollout_corr/rollout_rs_ratio_fraction_low": ("mean", low),
           "rollout_corr/rollout_rs_masked_fraction": ("mean", ~keep)}
  total, metrics = finish_policy_loss(pg, inputs, stats)
  seq_rejected = jnp.any(valid & ~keep, axis=-1)
  metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = sequence_mean(seq_rejected, valid)
  return total, metrics


def value_loss(values: Array, old_values: Array, returns: Array, mask: Array, *,
               clip: float | None = None) -> tuple[Array, dict[str, Array]]:
  """The critic's regression loss (PPO's value loss, clipped as in verl / OpenRLHF): token mean over
  `mask` of 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = old + clip(V - old, -clip, clip).

  values `[B, T]`: the critic's V(s_t) being trained; old_values `[B, T]`: the values the returns were
  computed from (a constant: the critic before this step's updates); returns `[B, T]`: GAE's targets
  R_t = A_t + V_t (a constant); mask: the tokens that count. clip None: no clipping, 0.5 * (V - R)^2.
  Returns (loss, metrics): critic/vf_loss, critic/vf_clipfrac (tokens where the clipped error is the
  larger), critic/vpred_mean, critic/num_tokens."""
  valid = jnp.asarray(mask) != 0
  values = as_float(values)
  old, target = jax.lax.stop_gradient(as_float(old_values)), jax.lax.stop_gradient(as_float(returns))
  unclipped = jnp.square(values - target)
  if clip is None:
    per_token, clipped_more = unclipped, jnp.zeros_like(valid)
  else:
    check_positive("clip", clip)
    clipped = jnp.square(old + jnp.clip(values - old, -clip, clip) - target)
    per_token, clipped_more = jnp.maximum(unclipped, clipped), clipped > unclipped
  loss = 0.5 * masked_mean(per_token, valid)
  metrics = {"critic/vf_loss": loss, "critic/vf_clipfrac": masked_mean(clipped_more, valid),
             "critic/vpred_mean": masked_mean(values, valid), "critic/num_tokens": jnp.sum(valid)}
  return loss, float32_metrics(metrics)


def nll_loss(logprobs: Array, behaviour_logprobs: Array, advantages: Array, mask: Array, *,
             aggregation: str = "token_mean", loss_norm_constant: float | None = None, ref_logprobs=None,
             entropy=None) -> tuple[Array, dict[str, Array]]:
  """Negative log-likelihood of the valid tokens (supervised fine-tuning: the trainer's step with this
  loss is the SFT step). logprobs, mask `[B, T]`; behaviour_logprobs, advantages, ref_logprobs and
  entropy are not used (the signature is the policy losses', so one step function serves both).
  Returns (loss, metrics)."""
  del behaviour_logprobs, advantages, ref_logprobs, entropy
  valid = jnp.asarray(mask) != 0
  loss = aggregate(-as_float(logprobs), valid, aggregation, loss_norm_constant)
  metrics = {"loss/total": loss, **count_metrics(valid)}
  return loss, float32_metrics(metrics)


def bradley_terry_loss(chosen_scores: Array, rejected_scores: Array, mask: Array | None = None, *,
                       margin: float = 0.0) -> tuple[Array, dict[str, Array]]:
  """Bradley-Terry loss of a reward model on preference pairs: the mean over valid pairs of
  -log sigmoid(r_chosen - r_rejected - margin) (= softplus(-(d - margin)), d = r_chosen - r_rejected).

  chosen_scores, rejected_scores `[P]`: the model's scalar scores of each pair's preferred and
  rejected response; mask `[P]` (nonzero = a real pair; None: all). Masked pairs contribute exactly 0
  (even if their scores are inf or NaN); no valid pair gives loss 0. Metrics (over valid pairs):
  loss/total; rm/accuracy (the fraction with d > 0, a tie counting one half: a constant model scores
  0.5); rm/margin_mean (mean d); rm/chosen_mean, rm/rejected_mean; rm/num_pairs.
  """
  chosen, rejected = as_float(chosen_scores), as_float(rejected_scores)
  valid = jnp.ones(chosen.shape, bool) if mask is None else jnp.asarray(mask) != 0
  count = jnp.sum(valid).astype(jnp.float32)
  mean = lambda x: jnp.sum(jnp.where(valid, x, 0.0)) / jnp.maximum(count, 1.0)
  d = jnp.where(valid, chosen - rejected, 0.0)
  loss = mean(jax.nn.softplus(margin - d))
  metrics = {"loss/total": loss, "rm/accuracy": mean(jnp.where(d > 0, 1.0, jnp.where(d == 0, 0.5, 0.0))),
             "rm/margin_mean": mean(d), "rm/chosen_mean": mean(jnp.where(valid, chosen, 0.0)),
             "rm/rejected_mean": mean(jnp.where(valid, rejected, 0.0)), "rm/num_pairs": count}
  return loss, float32_metrics(metrics)


# Read-only name -> loss table (for configs: Controller(loss="aipo", loss_kwargs={...})).
LOSSES = types.MappingProxyType({"aipo": aipo_loss, "ppo_clip": ppo_clip_loss,
                                 "decoupled_ppo": decoupled_ppo_loss, "gspo": gspo_loss,
                                 "cispo": cispo_loss, "seq_tis": seq_tis_loss, "mis": mis_loss})


# The losses the trainer (`TrainConfig.loss`) offers. decoupled_ppo is left out on purpose: with one
# optimizer step per batch its proximal policy is the current policy, and then its gradient is exactly
# AIPO's (the function stays in the library for trainers that take several steps per batch).
TRAINER_LOSSES = ("aipo", "ppo_clip", "gspo", "cispo", "seq_tis", "mis")


def get_loss(name: str, *, trainer: bool = False) -> Callable[..., tuple[Array, dict[str, Array]]]:
  """The loss function registered under `name`: "aipo", "ppo_clip", "decoupled_ppo", "gspo",
  "cispo", "seq_tis" (sequence-level truncated IS) or "mis" (masked IS / rejection sampling).
  trainer=True: only the names in `TRAINER_LOSSES`."""
  names = TRAINER_LOSSES if trainer else tuple(LOSSES)
  if name not in names:
    raise ValueError(f"unknown loss {name!r}{' for the trainer' if trainer else ''}; expected one of {names}")
  return LOSSES[name]
