"""Specification of llamarl_jax.losses: AIPO / PPO-family losses, KL estimators, entropy, aggregation.

Gradients are checked against hand-derived values. Tolerances: float32 arithmetic over a handful
of operations, so rtol=1e-6 (a few ulps) unless a comment says otherwise; "exactly" means ==.
Runtime note: on CPU, XLA compilation dominates; tests go through one jitted helper keyed on the
static (string) options and reuse a few shapes, so most cases share compilations.
"""

import functools
import math

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llamarl_jax import losses
from llamarl_jax.losses import (aggregate, aipo_loss, cispo_loss, decoupled_ppo_loss,
                                entropy_from_logits, get_loss, gspo_loss, kl_estimate, mis_loss,
                                ppo_clip_loss, seq_tis_loss)

RTOL = 1e-6
ATOL = 1e-7

REQUIRED_METRICS = {"loss/total", "loss/pg", "policy/ratio_mean", "policy/ratio_max",
                    "policy/ratio_min", "policy/kl_behaviour", "policy/num_tokens", "policy/num_seqs"}


@functools.lru_cache(maxsize=None)
def _compiled(fn, static_items):
  static = dict(static_items)

  def value_and_grad(logprobs, behaviour, advantages, mask, numeric):
    return jax.value_and_grad(
        lambda lp: fn(lp, behaviour, advantages, mask, **static, **numeric), has_aux=True)(logprobs)

  return jax.jit(value_and_grad)


def run(fn, logprobs, behaviour, advantages, mask, **kwargs):
  """(loss, metrics, d loss / d logprobs) of `fn` under jit.

  String options are static; numbers and arrays are traced, so cases that differ only in values
  share one compilation.
  """
  static = tuple(sorted((k, v) for k, v in kwargs.items() if isinstance(v, str)))
  numeric = {k: v for k, v in kwargs.items() if not isinstance(v, str)}
  f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
  (loss, metrics), grad = _compiled(fn, static)(f32(logprobs), f32(behaviour), f32(advantages),
                                                np.asarray(mask, np.int32), numeric)
  return jax.device_get((loss, metrics, grad))  # numpy: checks below compile nothing


def random_batch(rng, batch, seq, mask_p=0.7):
  """Plausible inputs: log-probs in [-5, 0), pi within a factor ~e of mu, a random mask."""
  behaviour = -rng.uniform(0.01, 5.0, (batch, seq)).astype(np.float32)
  logprobs = (behaviour + rng.normal(0, 0.5, (batch, seq))).astype(np.float32)
  advantages = rng.normal(0, 1, (batch,)).astype(np.float32)
  mask = (rng.uniform(size=(batch, seq)) < mask_p).astype(np.int32)
  return logprobs, behaviour, advantages, mask


def with_ratio(behaviour, ratio):
  """log pi such that pi / mu = ratio."""
  return (np.asarray(behaviour, np.float32) + np.log(np.asarray(ratio, np.float32))).astype(np.float32)


# Every loss with its options; decoupled_ppo also gets proximal_logprobs (see `case_kwargs`).
LOSS_CASES = {
    "aipo_detached": (aipo_loss, dict(rho_max=2.0)),
    "aipo_clamped": (aipo_loss, dict(rho_max=2.0, form="clamped")),
    "ppo_clip": (ppo_clip_loss, dict(eps_low=0.2, eps_high=0.28)),
    "decoupled_ppo": (decoupled_ppo_loss, dict(eps_low=0.2, eps_high=0.28, rho_max=2.0)),
    "gspo": (gspo_loss, dict(eps_low=0.2, eps_high=0.28)),
    "cispo": (cispo_loss, dict(eps_low=0.5, eps_high=1.0)),
    "seq_tis": (seq_tis_loss, dict(is_threshold=2.0)),
    "mis_token": (mis_loss, dict(level="token", rs_threshold=2.0)),
    "mis_sequence": (mis_loss, dict(level="sequence", rs_threshold=4.0)),
    "mis_geometric": (mis_loss, dict(level="geometric", rs_threshold=1.2)),
}


def case_kwargs(case, proximal):
  fn, kw = LOSS_CASES[case]
  return fn, dict(kw, proximal_logprobs=proximal) if fn is decoupled_ppo_loss else dict(kw)


def random_problem(rng, batch, seq, mask_p=0.7):
  """Every input of every loss: (logprobs, behaviour, advantages, mask, ref, proximal)."""
  lp, blp, adv, mask = random_batch(rng, batch, seq, mask_p)
  ref = (blp + rng.normal(0, 0.3, blp.shape)).astype(np.float32)
  prox = (blp + rng.normal(0, 0.2, blp.shape)).astype(np.float32)
  return lp, blp, adv, mask, ref, prox


# The (loss, aggregation) pairs the shared-program tests cover: every loss with the per-sequence
# aggregation, and every aggregation with the default loss (aggregation is shared plumbing).
COMBINATIONS = tuple([(case, "seq_mean_token_mean") for case in LOSS_CASES]
                     + [("aipo_detached", "token_mean"), ("aipo_detached", "seq_sum_norm")])


@jax.jit
def all_losses(lp, blp, adv, mask, ref, prox):
  """{(case, aggregation): (loss, metrics, d loss / d logprobs)} with the KL and entropy terms on.

  One compilation per input shape covers every loss and aggregation (XLA shares the common
  per-token work), which keeps the property tests cheap.
  """
  out = {}
  for case, aggregation in COMBINATIONS:
    fn, kw = case_kwargs(case, prox)
    loss_fn = lambda l: fn(l, blp, adv, mask, ref_logprobs=ref, kl_coef=0.05,  # noqa: E731,B023
                           entropy=-l, entropy_coef=0.01, aggregation=aggregation,
                           loss_norm_constant=10.0, **kw)
    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(lp)
    out[case, aggregation] = (loss, metrics, grad)
  return out


# The standard small problem of the hand-derived tests: B = 2, T = 3, 3 valid tokens.
MASK = np.array([[1, 1, 0], [1, 0, 0]], np.int32)
BEHAVIOUR = np.log(np.array([[0.5, 0.2, 0.3], [0.1, 0.9, 0.4]], np.float32))


# ----------------------------------------------------------------------------- AIPO gradients


def test_aipo_on_policy_gradient_is_reinforce_through_a_softmax_policy():
  # A tiny tabular policy: logits theta [B, T, V], sampled tokens y [B, T]. With mu == pi (the
  # behaviour log-probs are the same numbers, held constant), AIPO's gradient w.r.t. theta is
  # REINFORCE's for both forms: grad of -sum_t m A log pi(y_t) / sum m.
  rng = np.random.default_rng(0)
  theta = np.asarray(rng.normal(size=(2, 3, 5)), np.float32)
  tokens = np.asarray(rng.integers(0, 5, (2, 3)))
  adv = np.array([0.7, -1.3])

  def logprobs_of(theta):
    return jnp.take_along_axis(jax.nn.log_softmax(theta), tokens[..., None], -1)[..., 0]

  @jax.jit
  def grads(theta):
    behaviour = jax.lax.stop_gradient(logprobs_of(theta))
    aipo = lambda form: jax.grad(  # noqa: E731
        lambda t: aipo_loss(logprobs_of(t), behaviour, adv, MASK, form=form)[0])(theta)
    reinforce = jax.grad(lambda t: -jnp.sum(MASK * adv[:, None] * logprobs_of(t)) / jnp.sum(MASK))
    return aipo("detached"), aipo("clamped"), reinforce(theta)

  detached, clamped, reinforce = grads(theta)
  np.testing.assert_allclose(detached, reinforce, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(clamped, reinforce, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("form", ["detached", "clamped"])
def test_aipo_on_policy_gradient_wrt_logprobs_is_minus_advantage_over_token_count(form):
  adv = np.array([2.0, -1.0])
  _, _, grad = run(aipo_loss, BEHAVIOUR, BEHAVIOUR, adv, MASK, form=form, rho_max=2.0)
  # 3 valid tokens: d/dlp of -(1/3) sum m A lp.
  expected = np.array([[-2 / 3, -2 / 3, 0.0], [1 / 3, 0.0, 0.0]])
  np.testing.assert_allclose(grad, expected, rtol=RTOL)


def test_aipo_detached_keeps_rho_max_times_advantage_gradient_above_rho_max():
  # pi/mu = 5 > rho_max = 2: the weight is truncated to 2 but the gradient survives: -2 A / 3.
  lp = with_ratio(BEHAVIOUR, 5.0)
  adv = np.array([1.5, -2.0])
  loss, metrics, grad = run(aipo_loss, lp, BEHAVIOUR, adv, MASK, form="detached", rho_max=2.0)
  np.testing.assert_allclose(grad, -2.0 * np.array([[1.5, 1.5, 0], [-2.0, 0, 0]]) / 3, rtol=RTOL)
  np.testing.assert_allclose(loss, -np.sum(MASK * 2.0 * adv[:, None] * lp) / 3, rtol=RTOL)
  assert metrics["policy/frac_truncated"] == 1.0
  np.testing.assert_allclose(metrics["policy/ratio_max"], 5.0, rtol=RTOL)


def test_aipo_clamped_form_has_zero_gradient_above_rho_max():
  lp = with_ratio(BEHAVIOUR, 5.0)
  adv = np.array([1.5, -2.0])
  loss, _, grad = run(aipo_loss, lp, BEHAVIOUR, adv, MASK, form="clamped", rho_max=2.0)
  assert np.all(grad == 0.0)
  np.testing.assert_allclose(loss, -2.0 * (1.5 + 1.5 - 2.0) / 3, rtol=RTOL)  # -min(r, rho) A


@pytest.mark.parametrize("form", ["detached", "clamped"])
def test_aipo_forms_share_the_gradient_below_rho_max(form):
  # Gradient -r A / N for both forms when r < rho_max = 2 (r = 0.5, 1.5, 1.9 on the valid tokens).
  ratio = np.array([[0.5, 1.5, 7.0], [1.9, 7.0, 7.0]])
  adv = np.array([3.0, -1.0])
  _, metrics, grad = run(aipo_loss, with_ratio(BEHAVIOUR, ratio), BEHAVIOUR, adv, MASK, form=form,
                         rho_max=2.0)
  np.testing.assert_allclose(grad, [[-0.5, -1.5, 0.0], [1.9 / 3, 0.0, 0.0]], rtol=RTOL)
  assert metrics["policy/frac_truncated"] == 0.0  # the 7s are masked


def test_aipo_infinite_rho_max_is_plain_importance_sampling():
  _, _, grad = run(aipo_loss, with_ratio(BEHAVIOUR, 8.0), BEHAVIOUR, np.array([3.0, -3.0]), MASK,
                   form="detached", rho_max=float("inf"))
  np.testing.assert_allclose(grad, [[-8.0, -8.0, 0.0], [8.0, 0.0, 0.0]], rtol=RTOL)


# ----------------------------------------------------------------------------- masking


def test_masked_tokens_contribute_exactly_zero_to_loss_and_gradient():
  rng = np.random.default_rng(1)
  problem = random_problem(rng, 4, 8)
  mask = problem[3]
  clean = jax.device_get(all_losses(*problem))
  # Garbage (NaN, inf, huge) at every masked position of every float input.
  garbage = rng.choice(np.array([np.nan, np.inf, -np.inf, 1e30, -1e30], np.float32), mask.shape)
  lp, blp, adv, _, ref, prox = problem
  dirty = [np.where(mask == 0, garbage, x).astype(np.float32) for x in (lp, blp, ref, prox)]
  dirty = dirty[:2] + [adv, mask] + dirty[2:]  # per-sequence advantages and the mask unchanged
  for key, (loss, metrics, grad) in jax.device_get(all_losses(*dirty)).items():
    clean_loss, clean_metrics, clean_grad = clean[key]
    assert loss == clean_loss, key
    assert all(metrics[k] == clean_metrics[k] for k in clean_metrics), key
    assert np.all(grad[mask == 0] == 0.0), key
    assert np.all(grad == clean_grad), key


def test_all_masked_batch_gives_zero_loss_zero_gradient_finite_metrics():
  lp, blp, adv, mask, ref, prox = random_problem(np.random.default_rng(7), 4, 8)
  results = jax.device_get(all_losses(lp, blp, adv, np.zeros_like(mask), ref, prox))
  for key, (loss, metrics, grad) in results.items():
    assert loss == 0.0, key
    assert np.all(grad == 0.0), key
    assert all(np.isfinite(v) for v in metrics.values()), key
    assert metrics["policy/num_tokens"] == 0 and metrics["policy/ratio_max"] == 0.0, key


def test_per_sequence_advantages_broadcast_over_tokens():
  lp, blp, adv, mask = random_batch(np.random.default_rng(2), 2, 3)
  per_seq = run(aipo_loss, lp, blp, adv, mask, form="detached", rho_max=2.0)
  per_token = run(aipo_loss, lp, blp, np.repeat(adv[:, None], 3, axis=1), mask, form="detached",
                  rho_max=2.0)
  chex.assert_trees_all_equal(per_seq, per_token)


# ----------------------------------------------------------------------------- aggregation


_aggregate_jit = jax.jit(aggregate, static_argnames=("mode",))


def aggregate_jit(values, mask, mode, loss_norm_constant=None):
  return np.asarray(_aggregate_jit(values, mask, mode=mode, loss_norm_constant=loss_norm_constant))


def test_aggregation_modes_hand_values():
  values = np.array([[1.0, 2.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0], [99.0] * 4])
  mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # the last row is batch padding
  agg = functools.partial(aggregate_jit, values, mask)
  # token mean: (1 + 2 + 3 + 4) / 4 tokens.
  np.testing.assert_allclose(agg(mode="token_mean"), 2.5, rtol=RTOL)
  # seq means 2 and 4 over the 2 non-empty sequences.
  np.testing.assert_allclose(agg(mode="seq_mean_token_mean"), 3.0, rtol=RTOL)
  # Dr. GRPO: (6 / 8 + 4 / 8) / 2 non-empty sequences.
  np.testing.assert_allclose(agg(mode="seq_sum_norm", loss_norm_constant=8.0), 0.625, rtol=RTOL)
  # Default constant: the padded length T = 4.
  np.testing.assert_allclose(agg(mode="seq_sum_norm"), 1.25, rtol=RTOL)


def test_loss_terms_use_the_aggregation_and_add_up():
  # At pi == mu the detached AIPO per-token term is -A_t log pi_t, the entropy term is
  # -0.01 * (-log pi_t) and the k3 KL term 0.05 * k3(log pi, ref), each aggregated the same way.
  lp, _, adv, mask, ref, prox = random_problem(np.random.default_rng(8), 4, 8)
  results = jax.device_get(all_losses(lp, lp, adv, mask, ref, prox))
  for aggregation in losses.AGGREGATIONS:
    loss, metrics, _ = results["aipo_detached", aggregation]
    agg = functools.partial(aggregate_jit, mask=mask, mode=aggregation, loss_norm_constant=10.0)
    np.testing.assert_allclose(metrics["loss/pg"], agg(-adv[:, None] * lp), rtol=1e-5)
    np.testing.assert_allclose(metrics["loss/entropy"], -0.01 * agg(-lp), rtol=1e-5)
    np.testing.assert_allclose(metrics["loss/kl"], 0.05 * agg(all_kl(lp, ref)["k3"]), rtol=1e-5)
    parts = metrics["loss/pg"] + metrics["loss/entropy"] + metrics["loss/kl"]
    np.testing.assert_allclose(loss, parts, rtol=1e-6)
    assert metrics["loss/total"] == loss


# ----------------------------------------------------------------------------- PPO clip


# (ratio pi/mu, advantage, eps_low, eps_high, per-token loss, d loss / d logprob, clipped)
PPO_TABLE = [
    (1.5, 1.0, 0.2, 0.2, -1.2, 0.0, True),        # A > 0, above 1 + eps_high: clipped, no gradient
    (1.5, -1.0, 0.2, 0.2, 1.5, 1.5, False),       # A < 0, above: unclipped (pessimistic branch)
    (0.5, -1.0, 0.2, 0.2, 0.8, 0.0, True),        # A < 0, below 1 - eps_low: clipped
    (0.5, 1.0, 0.2, 0.2, -0.5, -0.5, False),      # A > 0, below: unclipped
    (1.25, 1.0, 0.2, 0.28, -1.25, -1.25, False),  # DAPO clip-higher lets 1.25 through
    (1.3, 1.0, 0.2, 0.28, -1.28, 0.0, True),      # ... but not 1.3
    (0.75, -1.0, 0.2, 0.28, 0.8, 0.0, True),      # the low side keeps eps_low = 0.2
    (1.0, 2.0, 0.2, 0.2, -2.0, -2.0, False),      # on-policy: REINFORCE gradient -A
]


@pytest.mark.parametrize("ratio,adv,eps_low,eps_high,want_loss,want_grad,clipped", PPO_TABLE)
def test_ppo_clip_hand_values(ratio, adv, eps_low, eps_high, want_loss, want_grad, clipped):
  blp = np.log(np.array([[0.3]]))
  loss, metrics, grad = run(ppo_clip_loss, with_ratio(blp, ratio), blp, np.array([adv]),
                            np.ones((1, 1)), eps_low=eps_low, eps_high=eps_high)
  np.testing.assert_allclose(loss, want_loss, rtol=RTOL)
  np.testing.assert_allclose(grad, [[want_grad]], rtol=RTOL, atol=ATOL)
  assert metrics["policy/frac_clipped"] == float(clipped)


def test_ppo_clip_fractions_split_low_and_high():
  # Tokens: clipped high, clipped low, inside the range; the 4th (pessimistic branch) is masked.
  ratio = np.array([[1.5, 0.5, 1.0], [1.5, 1.0, 1.0]])
  adv = np.array([[1.0, -1.0, 1.0], [-1.0, 1.0, 1.0]])
  mask = np.array([[1, 1, 1], [1, 0, 0]])
  _, metrics, _ = run(ppo_clip_loss, with_ratio(BEHAVIOUR, ratio), BEHAVIOUR, adv, mask,
                      eps_low=0.2, eps_high=0.2)
  assert metrics["policy/frac_clipped"] == 0.5
  assert metrics["policy/frac_clipped_low"] == 0.25
  assert metrics["policy/frac_clipped_high"] == 0.25


def test_decoupled_ppo_with_proximal_equal_to_behaviour_is_ppo_clip():
  lp, blp, adv, mask, ref, _ = random_problem(np.random.default_rng(4), 4, 8)
  results = jax.device_get(all_losses(lp, blp, adv, mask, ref, blp))
  a_loss, a_metrics, a_grad = results["ppo_clip", "seq_mean_token_mean"]
  b_loss, b_metrics, b_grad = results["decoupled_ppo", "seq_mean_token_mean"]
  np.testing.assert_allclose(b_loss, a_loss, rtol=RTOL)
  np.testing.assert_allclose(b_grad, a_grad, rtol=RTOL, atol=ATOL)
  for k in a_metrics:
    np.testing.assert_allclose(b_metrics[k], a_metrics[k], rtol=RTOL, atol=ATOL, err_msg=k)
  assert b_metrics["policy/frac_truncated"] == 0.0


def test_decoupled_ppo_truncates_the_behaviour_weight():
  # pi == pi_prox (r = 1, inside the clip); pi_prox / mu = 3 and 1.5 with rho_max = 2 -> w = 2, 1.5.
  prox = with_ratio(BEHAVIOUR, [[3.0, 1.5, 1.0], [1.5, 1.0, 1.0]])
  adv = np.array([[1.0, -2.0, 0.0], [4.0, 0.0, 0.0]])
  loss, metrics, grad = run(decoupled_ppo_loss, prox, BEHAVIOUR, adv, MASK, proximal_logprobs=prox,
                            rho_max=2.0)
  np.testing.assert_allclose(loss, -(2.0 * 1.0 + 1.5 * -2.0 + 1.5 * 4.0) / 3, rtol=RTOL)
  np.testing.assert_allclose(grad, [[-2.0 / 3, 3.0 / 3, 0.0], [-6.0 / 3, 0.0, 0.0]], rtol=RTOL)
  np.testing.assert_allclose(metrics["policy/frac_truncated"], 1 / 3, rtol=RTOL)
  np.testing.assert_allclose(metrics["policy/behaviour_ratio_max"], 3.0, rtol=RTOL)
  np.testing.assert_allclose(metrics["policy/ratio_mean"], 1.0, rtol=RTOL)


# ----------------------------------------------------------------------------- GSPO


def test_gspo_hand_values():
  # Row 0: token ratios 1.21 and 1 -> s_0 = sqrt(1.21) = 1.1 (the masked 7 does not count); A = 1,
  # inside [0.8, 1.2]: per-token loss -1.1, gradient -1.1 per token times the aggregation weight.
  # Row 1: s_1 = 0.5, A = -1, below 0.8: clipped, loss -min(-0.5, -0.8) = 0.8, gradient 0.
  ratio = np.array([[1.21, 1.0, 7.0], [0.5, 7.0, 7.0]])
  lp, adv = with_ratio(BEHAVIOUR, ratio), np.array([1.0, -1.0])
  loss, metrics, grad = run(gspo_loss, lp, BEHAVIOUR, adv, MASK, eps_low=0.2, eps_high=0.2)
  np.testing.assert_allclose(loss, (-1.1 * 2 + 0.8) / 3, rtol=RTOL)
  np.testing.assert_allclose(grad, [[-1.1 / 3, -1.1 / 3, 0], [0, 0, 0]], rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(metrics["policy/frac_clipped"], 1 / 3, rtol=RTOL)
  np.testing.assert_allclose(metrics["policy/frac_clipped_low"], 1 / 3, rtol=RTOL)
  np.testing.assert_allclose(metrics["policy/ratio_max"], 1.1, rtol=RTOL)
  np.testing.assert_allclose(metrics["policy/ratio_min"], 0.5, rtol=RTOL)
  np.testing.assert_allclose(metrics["policy/ratio_mean"], (1.1 * 2 + 0.5) / 3, rtol=RTOL)  # per token
  # The paper's aggregation, 1/G sum over sequences: (-1.1 + 0.8) / 2; each row-0 token -1.1 / 2 / 2.
  loss, _, grad = run(gspo_loss, lp, BEHAVIOUR, adv, MASK, eps_low=0.2, eps_high=0.2,
                      aggregation="seq_mean_token_mean")
  np.testing.assert_allclose(loss, -0.15, rtol=1e-5)
  np.testing.assert_allclose(grad, [[-0.275, -0.275, 0], [0, 0, 0]], rtol=RTOL, atol=ATOL)


def test_gspo_clips_whole_sequences_and_survives_extreme_ratios():
  # Row 0: token log-ratios +30 and -30 (each clipped to +-20) -> s_0 = 1, not clipped: gradient -A.
  # Row 1: log-ratio +30 -> s_1 = e^20 with A > 0: clipped, loss -(1 + eps_high) A, gradient 0.
  log_ratio = np.array([[30.0, -30.0, 0.0], [30.0, 0.0, 0.0]])
  lp = (BEHAVIOUR + log_ratio).astype(np.float32)
  loss, metrics, grad = run(gspo_loss, lp, BEHAVIOUR, np.array([2.0, 1.0]), MASK,
                            eps_low=3e-4, eps_high=4e-4)
  assert np.isfinite(loss) and np.all(np.isfinite(grad))
  np.testing.assert_allclose(grad, [[-2 / 3, -2 / 3, 0], [0, 0, 0]], rtol=RTOL)
  np.testing.assert_allclose(loss, (-2.0 * 2 - 1.0004) / 3, rtol=RTOL)
  np.testing.assert_allclose(metrics["policy/ratio_max"], math.exp(20.0), rtol=1e-5)


def numpy_gspo_objective(lp, blp, adv, mask, eps_low, eps_high):
  """The GSPO paper's sequence-level loss in float64: -(1/G) sum_i min(s_i A_i, clip(s_i) A_i), with
  s_i = exp(mean of log(pi/mu) over sequence i's valid tokens), G = sequences with a valid token."""
  lp, blp, m = (np.asarray(x, np.float64) for x in (lp, blp, mask))
  count = m.sum(-1)
  s = np.exp(np.sum(m * (lp - blp), -1) / np.maximum(count, 1))
  term = np.minimum(s * adv, np.clip(s, 1 - eps_low, 1 + eps_high) * adv)
  return -np.sum(np.where(count > 0, term, 0)) / max(np.sum(count > 0), 1)


def central_differences(f, x, h):
  """d f / d x by central differences, one coordinate at a time (float64)."""
  x = np.asarray(x, np.float64)
  grad = np.zeros_like(x)
  for idx in np.ndindex(x.shape):
    step = np.zeros_like(x)
    step[idx] = h
    grad[idx] = (f(x + step) - f(x - step)) / (2 * h)
  return grad


def test_gspo_matches_the_papers_sequence_objective_and_its_finite_difference_gradient():
  # GSPO-token with per-sequence advantages has GSPO's value and gradient. Reference: the paper's
  # sequence objective in NumPy float64, differentiated by central differences (h = 1e-6: truncation
  # error ~h^2, round-off ~1e-16 / h = 1e-10). Our float32 gradient: a few ulps of exp/log/sums, so
  # rtol 1e-5 with atol 1e-7 (entries are O(0.1)).
  lp, blp, adv, mask = random_batch(np.random.default_rng(11), 4, 6, mask_p=0.8)
  mask[0] = 0  # an empty row counts in no normaliser
  loss, _, grad = run(gspo_loss, lp, blp, adv, mask, eps_low=0.2, eps_high=0.28,
                      aggregation="seq_mean_token_mean")
  f = lambda x: numpy_gspo_objective(x, blp, adv, mask, 0.2, 0.28)  # noqa: E731
  np.testing.assert_allclose(loss, f(lp), rtol=1e-5)
  np.testing.assert_allclose(grad, central_differences(f, lp, 1e-6), rtol=1e-5, atol=1e-7)
  assert np.any(grad != 0) and np.all(grad[mask == 0] == 0)


def test_gspo_gradient_equals_finite_differences_of_itself_in_float64():
  # GSPO has no detached weight in its gradient (the token form's sg terms cancel in value), so the
  # jax gradient must equal central differences of the jax loss. float64: agreement to ~1e-8.
  lp, blp, adv, mask = random_batch(np.random.default_rng(12), 3, 5, mask_p=0.8)
  with jax.enable_x64(True):
    lp64, blp64 = np.asarray(lp, np.float64), np.asarray(blp, np.float64)
    loss_fn = jax.jit(lambda x: gspo_loss(x, blp64, adv, mask, eps_low=0.2, eps_high=0.28,
                                          aggregation="token_mean")[0])
    grad = np.asarray(jax.jit(jax.grad(loss_fn))(lp64))
    numeric = central_differences(lambda x: float(loss_fn(x)), lp64, 1e-6)
  assert grad.dtype == np.float64
  np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-9)
  assert np.any(grad != 0)


# ----------------------------------------------------------------------------- CISPO


def test_cispo_hand_values_bound_the_weight_on_both_sides():
  # Valid ratios 0.3, 1.5, 4.0 with eps_low = 0.5, eps_high = 1.0: weights 0.5, 1.5, 2.0 (detached);
  # gradient -w A / 3 on every valid token: none is dropped.
  ratio = np.array([[0.3, 1.5, 9.0], [4.0, 9.0, 9.0]])
  lp, adv = with_ratio(BEHAVIOUR, ratio), np.array([2.0, -1.0])
  loss, metrics, grad = run(cispo_loss, lp, BEHAVIOUR, adv, MASK, eps_low=0.5, eps_high=1.0)
  np.testing.assert_allclose(grad, [[-1 / 3, -1.0, 0], [2 / 3, 0, 0]], rtol=RTOL)
  want = -(0.5 * 2 * lp[0, 0] + 1.5 * 2 * lp[0, 1] + 2.0 * -1 * lp[1, 0]) / 3
  np.testing.assert_allclose(loss, want, rtol=RTOL)
  np.testing.assert_allclose(metrics["policy/frac_truncated"], 1 / 3, rtol=RTOL)
  np.testing.assert_allclose(metrics["policy/frac_truncated_low"], 1 / 3, rtol=RTOL)


def test_cispo_keeps_the_gradient_where_ppo_clip_drops_it():
  # pi/mu = e^25 (log-ratio clipped to 20) with A > 0: PPO's clip zeroes the gradient, CISPO keeps
  # (1 + eps_high) A per token.
  lp = (BEHAVIOUR + 25.0).astype(np.float32)
  adv = np.array([1.0, 3.0])
  _, _, ppo = run(ppo_clip_loss, lp, BEHAVIOUR, adv, MASK, eps_low=0.2, eps_high=0.28)
  loss, _, cispo = run(cispo_loss, lp, BEHAVIOUR, adv, MASK, eps_low=0.5, eps_high=0.28)
  assert np.all(ppo == 0.0) and np.isfinite(loss)
  np.testing.assert_allclose(cispo, -1.28 * np.array([[1, 1, 0], [3, 0, 0]]) / 3, rtol=RTOL)


def test_cispo_without_lower_bound_is_aipo_detached():
  # eps_low = 1 (the paper's "no lower bound") and 1 + eps_high = rho_max: the same update.
  lp, blp, adv, mask = random_batch(np.random.default_rng(13), 4, 8)
  a = run(aipo_loss, lp, blp, adv, mask, form="detached", rho_max=1.5)
  c = run(cispo_loss, lp, blp, adv, mask, eps_low=1.0, eps_high=0.5)
  np.testing.assert_allclose(c[0], a[0], rtol=1e-6)  # exp(log 1.5) vs 1.5: an ulp
  np.testing.assert_allclose(c[2], a[2], rtol=1e-6, atol=ATOL)
  assert c[1]["policy/frac_truncated"] == a[1]["policy/frac_truncated"]
  assert c[1]["policy/frac_truncated_low"] == 0.0


# ----------------------------------------------------------------------------- rollout corrections


def test_seq_tis_hand_values():
  # Row 0: ratios 2 and 0.5 -> product 1, weight 1. Row 1: ratio 3 -> weight min(3, 2) = 2.
  ratio = np.array([[2.0, 0.5, 9.0], [3.0, 9.0, 9.0]])
  lp, adv = with_ratio(BEHAVIOUR, ratio), np.array([1.0, 1.0])
  loss, metrics, grad = run(seq_tis_loss, lp, BEHAVIOUR, adv, MASK, is_threshold=2.0)
  np.testing.assert_allclose(grad, [[-1 / 3, -1 / 3, 0], [-2 / 3, 0, 0]], rtol=RTOL)
  np.testing.assert_allclose(loss, -(lp[0, 0] + lp[0, 1] + 2 * lp[1, 0]) / 3, rtol=RTOL)
  m = metrics
  np.testing.assert_allclose(m["rollout_corr/rollout_is_mean"], 4 / 3, rtol=RTOL)  # (1 + 1 + 2) / 3
  np.testing.assert_allclose(m["rollout_corr/rollout_is_max"], 3.0, rtol=RTOL)
  np.testing.assert_allclose(m["rollout_corr/rollout_is_min"], 1.0, rtol=RTOL)
  np.testing.assert_allclose(m["rollout_corr/rollout_is_ratio_fraction_high"], 1 / 3, rtol=RTOL)
  assert m["rollout_corr/rollout_is_ratio_fraction_low"] == 0.0
  np.testing.assert_allclose(m["policy/frac_truncated"], 1 / 3, rtol=RTOL)


# (level, per-token weight on the 3 valid tokens of the standard problem, tokens rejected, sequences
# rejected) for token ratios (2, 0.5 | 3) and the band [0.5, 2] (inclusive):
MIS_TABLE = [
    ("token", [2.0, 0.5, 0.0], 1 / 3, 1 / 2),      # 3 is outside: that token only
    ("sequence", [1.0, 1.0, 0.0], 1 / 3, 1 / 2),   # products 1 and 3: row 1 rejected
    ("geometric", [1.0, 1.0, 0.0], 1 / 3, 1 / 2),  # geometric means 1 and 3; kept rows weigh 1
]


@pytest.mark.parametrize("level,weights,token_frac,seq_frac", MIS_TABLE)
def test_mis_hand_values(level, weights, token_frac, seq_frac):
  ratio = np.array([[2.0, 0.5, 9.0], [3.0, 9.0, 9.0]])
  lp, adv = with_ratio(BEHAVIOUR, ratio), np.array([1.0, -2.0])
  loss, metrics, grad = run(mis_loss, lp, BEHAVIOUR, adv, MASK, level=level, rs_threshold=2.0)
  w = np.array([[weights[0], weights[1], 0], [weights[2], 0, 0]])
  np.testing.assert_allclose(grad, -w * np.array([[1.0], [-2.0]]) / 3, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(loss, -np.sum(w * np.array([[1.0], [-2.0]]) * lp) / 3, rtol=RTOL)
  np.testing.assert_allclose(metrics["rollout_corr/rollout_rs_masked_fraction"], token_frac, rtol=RTOL)
  np.testing.assert_allclose(metrics["rollout_corr/rollout_rs_seq_masked_fraction"], seq_frac, rtol=RTOL)
  np.testing.assert_allclose(metrics["rollout_corr/rollout_rs_max"], 3.0, rtol=RTOL)
  np.testing.assert_allclose(metrics["rollout_corr/rollout_rs_ratio_fraction_high"], 1 / 3, rtol=RTOL)
  assert metrics["policy/num_tokens"] == 3  # rejected tokens stay in the normaliser


def test_mis_rejects_extreme_ratios_without_overflow():
  # log-ratios +40 / -40 (clipped to +-20) on the first token of each row, 0 on row 0's second.
  # Sequence level: both products (e^20, e^-20) leave [0.1, 10]: loss 0, gradient 0. Token level:
  # only the ratio-1 token survives, with weight 1.
  lp = (BEHAVIOUR + np.array([[40.0, 0, 0], [-40.0, 0, 0]])).astype(np.float32)
  want = {"sequence": np.zeros((2, 3)), "token": np.array([[0, -1 / 3, 0], [0, 0, 0]])}
  for level, want_grad in want.items():
    loss, metrics, grad = run(mis_loss, lp, BEHAVIOUR, np.array([1.0, 1.0]), MASK, level=level,
                              rs_threshold=10.0)
    np.testing.assert_allclose(grad, want_grad, rtol=RTOL, err_msg=level)
    assert np.isfinite(loss) and all(np.isfinite(v) for v in metrics.values()), level
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == 1.0, level
  np.testing.assert_allclose(metrics["rollout_corr/rollout_rs_max"], math.exp(20.0), rtol=1e-5)


def numpy_corrected_pg(lp, blp, adv, mask, kind, **kw):
  """(loss, gradient) in float64 of -sum_t w_t A_t log pi_t / (valid tokens) with w held fixed, w
  from the public formulas (verl rollout_corr docs; MiniMax-M1 eq. 4), written independently here."""
  lp, blp, m = (np.asarray(x, np.float64) for x in (lp, blp, mask))
  r = np.exp(lp - blp)
  log_seq = np.sum(m * (lp - blp), -1, keepdims=True)
  if kind == "cispo":
    w = np.clip(r, 1 - kw["eps_low"], 1 + kw["eps_high"])
  elif kind == "seq_tis":
    w = np.broadcast_to(np.minimum(np.exp(log_seq), kw["c"]), r.shape)
  else:  # mis, levels token / sequence / geometric with band [lo, hi]
    lo, hi = kw["lo"], kw["hi"]
    rho = {"token": r, "sequence": np.broadcast_to(np.exp(log_seq), r.shape),
           "geometric": np.broadcast_to(np.exp(log_seq / np.maximum(m.sum(-1, keepdims=True), 1)), r.shape)
           }[kw["level"]]
    keep = (rho >= lo) & (rho <= hi)
    w = np.where(keep, 1.0 if kw["level"] == "geometric" else rho, 0.0)
  n = max(m.sum(), 1)
  a = np.broadcast_to(np.asarray(adv, np.float64)[:, None], r.shape)
  loss = lambda x: -np.sum(m * w * a * x) / n  # noqa: E731
  raw = {"cispo": r, "seq_tis": np.broadcast_to(np.exp(log_seq), r.shape)}.get(kind, np.ones_like(r))
  changed = np.sum(m * (~np.isclose(w, raw) if kind != "mis" else w == 0)) / n  # tokens the bounds touch
  return loss(lp), central_differences(loss, lp, 1e-3), changed  # linear in x: differences are exact


NUMPY_CASES = [
    ("cispo", cispo_loss, dict(eps_low=0.3, eps_high=0.2), dict(eps_low=0.3, eps_high=0.2)),
    ("seq_tis", seq_tis_loss, dict(is_threshold=1.5), dict(c=1.5)),
    ("mis_token", mis_loss, dict(level="token", rs_threshold=1.1, rs_threshold_lower=0.8),
     dict(level="token", lo=0.8, hi=1.1)),
    ("mis_sequence", mis_loss, dict(level="sequence", rs_threshold=1.5), dict(level="sequence", lo=1 / 1.5, hi=1.5)),
    ("mis_geometric", mis_loss, dict(level="geometric", rs_threshold=1.1), dict(level="geometric", lo=1 / 1.1, hi=1.1)),
]


@pytest.mark.parametrize("name,fn,kwargs,np_kwargs", NUMPY_CASES, ids=[c[0] for c in NUMPY_CASES])
def test_detached_weight_losses_match_an_independent_numpy_implementation(name, fn, kwargs, np_kwargs):
  # float32 against float64: relative 1e-5 covers the exp / log / sum round-off of float32.
  lp, blp, adv, mask = random_batch(np.random.default_rng(14), 6, 5, mask_p=0.8)
  lp = (blp + 0.3 * (lp - blp)).astype(np.float32)  # products of ratios near 1: some kept, some not
  loss, _, grad = run(fn, lp, blp, adv, mask, **kwargs)
  kind = "mis" if name.startswith("mis") else name
  want_loss, want_grad, changed = numpy_corrected_pg(lp, blp, adv, mask, kind, **np_kwargs)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
  assert 0.1 < changed < 0.9, (name, changed)  # the bounds are active on some tokens, not all


# ----------------------------------------------------------------------------- KL and entropy


@jax.jit
def all_kl(logprobs, ref_logprobs):
  return {kind: kl_estimate(logprobs, ref_logprobs, kind) for kind in losses.KL_ESTIMATORS}


def test_kl_estimators_hand_values():
  # q(x) = 0.5 (the sampler), p(x) = 0.25: log r = log(p/q) = -log 2.
  lq, lp = np.log(np.array([0.5])), np.log(np.array([0.25]))
  log2 = math.log(2.0)
  kl = all_kl(lq, lp)
  np.testing.assert_allclose(kl["k1"], [log2], rtol=RTOL)
  np.testing.assert_allclose(kl["k2"], [0.5 * log2 ** 2], rtol=RTOL)
  np.testing.assert_allclose(kl["k3"], [0.5 - 1.0 + log2], rtol=RTOL)


def test_k1_and_k3_are_unbiased_for_kl():
  # Exact expectation under q over a 4-token vocabulary: sum_x q(x) k(x) == KL(q || p).
  q = np.array([0.1, 0.2, 0.3, 0.4])
  p = np.array([0.25, 0.25, 0.4, 0.1])
  kl = float(np.sum(q * np.log(q / p)))
  estimates = jax.device_get(all_kl(np.log(q), np.log(p)))
  for kind in ("k1", "k3"):
    np.testing.assert_allclose(np.sum(q * estimates[kind]), kl, rtol=1e-5)  # float32 logs
  assert np.all(estimates["k3"] >= 0) and np.all(estimates["k2"] >= 0)


def test_kl_penalty_term_and_gradient():
  # A = 0 isolates the penalty. pi = BEHAVIOUR, ref = pi * [2, 0.5] on the first row's valid tokens
  # and pi on the second's.
  ref = BEHAVIOUR + np.log(np.array([[2.0, 0.5, 1.0], [1.0, 1.0, 1.0]]))
  zero = np.zeros(2)
  # k1 = lp - ref: per-token gradient kl_coef / N.
  loss, metrics, grad = run(aipo_loss, BEHAVIOUR, BEHAVIOUR, zero, MASK, ref_logprobs=ref,
                            kl_coef=0.3, kl_estimator="k1")
  np.testing.assert_allclose(grad, [[0.1, 0.1, 0.0], [0.1, 0.0, 0.0]], rtol=RTOL)
  np.testing.assert_allclose(metrics["policy/kl_ref"], 0.0, atol=ATOL)  # -log 2 + log 2 + 0
  # k3 (default): (p/q - 1) - log(p/q) per token.
  k3 = ((2.0 - 1 - math.log(2.0)) + (0.5 - 1 + math.log(2.0)) + 0.0) / 3
  loss, metrics, _ = run(aipo_loss, BEHAVIOUR, BEHAVIOUR, zero, MASK, ref_logprobs=ref, kl_coef=0.3,
                         form="detached", rho_max=2.0)
  np.testing.assert_allclose(metrics["policy/kl_ref"], k3, rtol=1e-6)
  np.testing.assert_allclose(metrics["loss/kl"], 0.3 * k3, rtol=1e-6)
  np.testing.assert_allclose(loss, 0.3 * k3, rtol=1e-6)


def test_kl_behaviour_and_ratio_metrics():
  lp = with_ratio(BEHAVIOUR, [[0.5, 1.0, 9.0], [3.0, 9.0, 9.0]])
  _, metrics, _ = run(aipo_loss, lp, BEHAVIOUR, np.ones(2), MASK, form="detached", rho_max=2.0)
  # k3 of mu against pi: (r - 1) - log r for r = pi/mu.
  kl = ((0.5 - 1 + math.log(2.0)) + 0.0 + (3.0 - 1 - math.log(3.0))) / 3
  np.testing.assert_allclose(metrics["policy/kl_behaviour"], kl, rtol=1e-6)
  np.testing.assert_allclose(metrics["policy/ratio_mean"], 1.5, rtol=RTOL)
  np.testing.assert_allclose(metrics["policy/ratio_min"], 0.5, rtol=RTOL)
  np.testing.assert_allclose(metrics["policy/ratio_max"], 3.0, rtol=RTOL)
  np.testing.assert_allclose(metrics["policy/frac_truncated"], 1 / 3, rtol=RTOL)
  assert metrics["policy/num_tokens"] == 3 and metrics["policy/num_seqs"] == 2


entropy_jit = jax.jit(entropy_from_logits)


def test_entropy_from_logits_hand_values():
  logits = np.array([[0.0, 0.0, 0.0, 0.0], [np.log(0.5), np.log(0.25), np.log(0.25), -np.inf]])
  np.testing.assert_allclose(entropy_jit(logits), [math.log(4), 1.5 * math.log(2.0)],
                             rtol=RTOL)


def test_entropy_from_logits_is_safe_with_masked_vocabulary_and_bf16():
  logits = np.array([[0.0, -np.inf, 0.0, -np.inf], [1.0, 2.0, 3.0, 4.0]])
  np.testing.assert_allclose(np.asarray(entropy_jit(logits))[0], math.log(2.0), rtol=RTOL)
  grad = jax.jit(jax.grad(lambda x: entropy_from_logits(x).sum()))(logits)
  assert np.all(np.isfinite(grad))
  out = entropy_jit(np.zeros((1, 4), jnp.bfloat16))
  assert out.dtype == jnp.float32 and out.shape == (1,)


def test_entropy_bonus_term_and_gradient():
  entropy = np.array([[2.0, 4.0, 99.0], [3.0, 99.0, 99.0]])

  @jax.jit
  def loss_and_grad(entropy):
    loss_fn = lambda e: aipo_loss(BEHAVIOUR, BEHAVIOUR, np.zeros(2), MASK, entropy=e,  # noqa: E731
                                  entropy_coef=0.01)
    return jax.value_and_grad(loss_fn, has_aux=True)(entropy)

  (loss, metrics), grad = loss_and_grad(entropy)
  np.testing.assert_allclose(loss, -0.01 * 3.0, rtol=RTOL)
  np.testing.assert_allclose(metrics["policy/entropy"], 3.0, rtol=RTOL)
  np.testing.assert_allclose(grad, -0.01 / 3 * MASK, rtol=RTOL)


# ----------------------------------------------------------------------------- metrics, API


def test_metric_names():
  results = jax.device_get(all_losses(*random_problem(np.random.default_rng(5), 4, 8)))
  for (case, _), (_, metrics, _) in results.items():
    clip_or_trunc = {"aipo_detached": {"policy/frac_truncated"}, "aipo_clamped": {"policy/frac_truncated"},
                     "cispo": {"policy/frac_truncated", "policy/frac_truncated_low"},
                     "seq_tis": {"policy/frac_truncated", "rollout_corr/rollout_is_mean"},
                     }.get(case, {"rollout_corr/rollout_rs_masked_fraction",
                                  "rollout_corr/rollout_rs_seq_masked_fraction"}
                           if case.startswith("mis") else {"policy/frac_clipped"})
    optional = {"loss/kl", "policy/kl_ref", "loss/entropy", "policy/entropy"}
    assert REQUIRED_METRICS | clip_or_trunc | optional <= set(metrics), case
    assert all(v.shape == () and v.dtype == jnp.float32 for v in metrics.values())
  # Without ref_logprobs / entropy their terms and metrics are absent (shared by every loss).
  _, metrics, _ = run(aipo_loss, BEHAVIOUR, BEHAVIOUR, np.ones(2), MASK, form="detached", rho_max=2.0)
  assert not {"loss/kl", "policy/kl_ref", "loss/entropy", "policy/entropy"} & set(metrics)


def test_get_loss():
  assert get_loss("aipo") is aipo_loss
  assert get_loss("ppo_clip") is ppo_clip_loss
  assert get_loss("decoupled_ppo") is decoupled_ppo_loss
  assert get_loss("gspo") is gspo_loss
  assert get_loss("cispo") is cispo_loss
  assert get_loss("seq_tis") is seq_tis_loss
  assert get_loss("mis") is mis_loss
  with pytest.raises(ValueError, match="unknown loss 'grpo'"):
    get_loss("grpo")


def test_the_trainer_offers_every_loss_but_decoupled_ppo_and_the_config_agrees():
  """decoupled_ppo with one optimizer step per batch is AIPO: the trainer's names leave it out, and
  TrainConfig refuses it at construction (not later, when the trainer is built)."""
  from llamarl_jax.config import ConfigError, TrainConfig
  from llamarl_jax.losses import LOSSES, TRAINER_LOSSES

  assert set(TRAINER_LOSSES) == set(LOSSES) - {"decoupled_ppo"}
  assert get_loss("cispo", trainer=True) is cispo_loss
  with pytest.raises(ValueError, match="unknown loss 'decoupled_ppo' for the trainer"):
    get_loss("decoupled_ppo", trainer=True)
  with pytest.raises(ConfigError, match="TrainConfig.loss"):
    TrainConfig(loss="decoupled_ppo")


def test_jit_grad_and_vmap_compose():
  # vmap over a stack of 2 microbatches of per-example (loss, metrics, grad), under jit, equals
  # one jitted call per microbatch.
  lp, blp, adv, mask = random_batch(np.random.default_rng(6), 2, 3)
  stack = lambda x: np.stack([x, x[::-1]])  # noqa: E731

  def value_and_grad(lp, blp, adv, mask):
    loss_fn = functools.partial(aipo_loss, rho_max=2.0, ref_logprobs=blp - 0.1, kl_coef=0.1)
    return jax.value_and_grad(loss_fn, has_aux=True)(lp, blp, adv, mask)

  (v_loss, v_metrics), v_grad = jax.device_get(jax.jit(jax.vmap(value_and_grad))(
      stack(lp), stack(blp), stack(adv), stack(mask)))
  for i in range(2):
    args = [stack(x)[i] for x in (lp, blp, adv, mask)]
    loss, metrics, grad = run(aipo_loss, *args, form="detached", rho_max=2.0,
                              ref_logprobs=args[1] - 0.1, kl_coef=0.1)
    # Batched and unbatched programs may fuse float ops differently: allow a few ulps.
    np.testing.assert_allclose(v_loss[i], loss, rtol=1e-5)
    np.testing.assert_allclose(v_grad[i], grad, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(v_metrics["policy/ratio_max"][i], metrics["policy/ratio_max"], rtol=1e-6)


def test_works_eagerly_on_numpy_inputs():
  lp, blp, adv, mask = random_batch(np.random.default_rng(6), 2, 3)
  loss, metrics = aipo_loss(lp, blp, adv, mask)
  jit_loss, jit_metrics, _ = run(aipo_loss, lp, blp, adv, mask, form="detached", rho_max=2.0)
  np.testing.assert_allclose(loss, jit_loss, rtol=1e-5)  # jit may reorder float ops
  assert set(metrics) == set(jit_metrics)


BAD_INPUTS = [
    ("behaviour_logprobs", dict(behaviour_logprobs=np.zeros((2, 4), np.float32)),
     "behaviour_logprobs must have the shape of logprobs"),
    ("mask", dict(mask=np.ones((3, 3))), "mask must have the shape of logprobs"),
    ("advantages_len", dict(advantages=np.zeros((3,), np.float32)), "advantages must be per sequence"),
    ("advantages_tok", dict(advantages=np.zeros((2, 4), np.float32)), "advantages must be per sequence"),
    ("rank", dict(logprobs=np.zeros((2, 3, 1), np.float32)), "logprobs must be \\[batch, seq\\]"),
    ("int_logprobs", dict(logprobs=np.zeros((2, 3), np.int32)), "logprobs must be floating point"),
    ("ref", dict(ref_logprobs=np.zeros((2, 2), np.float32)), "ref_logprobs must have the shape"),
    ("entropy", dict(entropy=np.zeros((3,), np.float32)), "entropy must have the shape"),
]


@pytest.mark.parametrize("name,override,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_shape_and_dtype_errors_name_the_argument(name, override, message):
  args = dict(logprobs=np.zeros((2, 3), np.float32), behaviour_logprobs=np.zeros((2, 3), np.float32),
              advantages=np.zeros((2,), np.float32), mask=np.ones((2, 3)))
  args.update(override)
  with pytest.raises(AssertionError, match="aipo_loss: " + message):
    aipo_loss(**args)
  with pytest.raises(AssertionError, match="ppo_clip_loss: " + message):
    ppo_clip_loss(**args)


def test_decoupled_ppo_checks_the_proximal_shape():
  x = np.zeros((2, 3), np.float32)
  with pytest.raises(AssertionError, match="proximal_logprobs must have the shape of logprobs"):
    decoupled_ppo_loss(x, x, np.zeros(2, np.float32), x, proximal_logprobs=x[:, :2])


@pytest.mark.parametrize("fn,kwargs,message", [
    (cispo_loss, dict(eps_low=1.5), "eps_low must be in \\(0, 1\\]"),
    (cispo_loss, dict(eps_high=0.0), "eps_high must be > 0"),
    (gspo_loss, dict(eps_low=-1e-4), "eps_low must be > 0"),
    (seq_tis_loss, dict(is_threshold=0.0), "is_threshold must be > 0"),
    (mis_loss, dict(level="batch"), "level must be one of"),
    (mis_loss, dict(rs_threshold=2.0, rs_threshold_lower=3.0), "rs_threshold_lower .* must be <="),
])
def test_new_losses_bad_options_raise_value_error(fn, kwargs, message):
  x = np.zeros((2, 3), np.float32)
  with pytest.raises(ValueError, match=message):
    fn(x, x, np.zeros(2, np.float32), x, **kwargs)


@pytest.mark.parametrize("kwargs,message", [
    (dict(aggregation="sum"), "aggregation must be one of"),
    (dict(form="ratio"), "form must be one of"),
    (dict(kl_estimator="k4"), "kl_estimator must be one of"),
    (dict(rho_max=0.0), "rho_max must be > 0"),
    (dict(loss_norm_constant=-1), "loss_norm_constant must be > 0"),
])
def test_bad_options_raise_value_error(kwargs, message):
  x = np.zeros((2, 3), np.float32)
  with pytest.raises(ValueError, match=message):
    aipo_loss(x, x, np.zeros(2, np.float32), x, **kwargs)


# ----------------------------------------------------------------------------- properties


def _pad(x, batch, seq, value):
  pad = ((0, batch - x.shape[0]),) + (((0, seq - x.shape[1]),) if x.ndim == 2 else ())
  return np.pad(x, pad, constant_values=value)


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(batch=st.integers(1, 4), seq=st.integers(1, 8),
                  mask_p=st.sampled_from([0.0, 0.3, 0.8, 1.0]), seed=st.integers(0, 2**16))
def test_property_finite_and_invariant_to_padding_length(batch, seq, mask_p, seed):
  # A random [batch, seq] problem, padded to [4, 8] with NaN and to [6, 11] with finite junk
  # (padding rows get advantage 7): every loss, metric and gradient must be finite and the same.
  problem = random_problem(np.random.default_rng(seed), batch, seq, mask_p)
  small = [_pad(x, 4, 8, np.nan if x.dtype == np.float32 else 0) for x in problem]
  small[2] = _pad(problem[2], 4, 8, 7.0)
  large = [_pad(x, 6, 11, -3.0 if x.dtype == np.float32 else 0) for x in problem]
  large[2] = _pad(problem[2], 6, 11, 7.0)
  a, b = jax.device_get((all_losses(*small), all_losses(*large)))
  for key, (loss, metrics, grad) in a.items():
    b_loss, b_metrics, b_grad = b[key]
    assert np.isfinite(loss) and np.all(np.isfinite(grad)), key
    assert all(np.isfinite(v) for v in metrics.values()), key
    # The same numbers summed in a different order: allow float32 round-off.
    np.testing.assert_allclose(b_loss, loss, rtol=1e-5, atol=1e-6, err_msg=str(key))
    np.testing.assert_allclose(b_grad[:4, :8], grad, rtol=1e-5, atol=1e-7, err_msg=str(key))
    assert np.all(grad[batch:] == 0) and np.all(grad[:, seq:] == 0), key
    for k in metrics:
      np.testing.assert_allclose(b_metrics[k], metrics[k], rtol=1e-5, atol=1e-6, err_msg=f"{key} {k}")
