"""The trainer-generator mismatch metrics (`llamarl_jax.mismatch`) against hand-derived values and a
NumPy re-implementation; the trainer and controller tests check them on real runs (lag 0 in fp32 ~0,
an fp8 generator clearly not, the split by lag matching the controller's own lag count)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llamarl_jax.mismatch import MISMATCH_LAGS, drop_empty_lags, mismatch_metrics


def numpy_reference(logprobs, behaviour, mask, lags=None, num_lags=MISMATCH_LAGS):
  """The definitions in the module docstring, in float64 NumPy, token by token."""
  def summary(sel):
    d = np.clip(logprobs[sel].astype(np.float64) - behaviour[sel], -20, 20)
    if d.size == 0:
      return {"kl_k3": 0.0, "ratio_mean": 0.0, "ratio_max": 0.0, "token_mult_prob_error": 0.0, "num_tokens": 0.0}
    return {"kl_k3": np.mean(np.exp(d) - 1 - d), "ratio_mean": np.mean(np.exp(d)), "ratio_max": np.max(np.exp(d)),
            "token_mult_prob_error": np.mean(np.exp(np.abs(d))), "num_tokens": float(d.size)}

  valid = mask > 0
  out = {f"rollout_corr/{k}": v for k, v in summary(valid).items()}
  if lags is not None:
    for k in range(num_lags):
      out.update({f"rollout_corr/lag{k}/{n}": v for n, v in summary(valid & (lags == k)).items()})
  return out


def test_one_token_by_hand():
  """pi = 2 mu: KL term e^d - 1 - d = 1 - ln 2, ratio 2, multiplicative error 2; pi = mu / 2: ratio 1/2,
  k3 = -1/2 + ln 2, multiplicative error still 2 (|d|)."""
  up = mismatch_metrics(jnp.log(jnp.array([[0.5]])), jnp.log(jnp.array([[0.25]])), jnp.ones((1, 1)))
  assert float(up["rollout_corr/kl_k3"]) == pytest.approx(1 - np.log(2), rel=1e-6)
  assert float(up["rollout_corr/ratio_mean"]) == pytest.approx(2.0, rel=1e-6)
  assert float(up["rollout_corr/token_mult_prob_error"]) == pytest.approx(2.0, rel=1e-6)
  down = mismatch_metrics(jnp.log(jnp.array([[0.25]])), jnp.log(jnp.array([[0.5]])), jnp.ones((1, 1)))
  assert float(down["rollout_corr/kl_k3"]) == pytest.approx(np.log(2) - 0.5, rel=1e-6)
  assert float(down["rollout_corr/ratio_max"]) == pytest.approx(0.5, rel=1e-6)
  assert float(down["rollout_corr/token_mult_prob_error"]) == pytest.approx(2.0, rel=1e-6)


def test_matches_numpy_reference_with_lags_and_garbage_under_the_mask():
  """A microbatched layout [M, B/M, R], lags 0..5 and unknown (-1), NaN/inf where the mask is 0.
  fp32 against float64: the per-token terms are O(1), means of ~100 of them agree to ~1e-6 relative."""
  rng = np.random.RandomState(0)
  shape = (2, 4, 16)
  mu = rng.uniform(-6, -0.1, shape).astype(np.float32)
  pi = (mu + rng.normal(0, 0.3, shape)).astype(np.float32)
  mask = (rng.uniform(size=shape) < 0.8).astype(np.int32)
  lags = rng.randint(-1, 6, shape).astype(np.int32)
  pi_garbage = np.where(mask > 0, pi, np.nan).astype(np.float32)
  mu_garbage = np.where(mask > 0, mu, -np.inf).astype(np.float32)
  got = jax.jit(mismatch_metrics)(pi_garbage, mu_garbage, mask, lags)
  want = numpy_reference(pi, mu, mask, lags)
  assert set(got) == set(want)
  for k, v in want.items():
    assert float(got[k]) == pytest.approx(v, rel=1e-5, abs=1e-7), k
  # lags 4 and 5 are beyond the split (MISMATCH_LAGS = 4) and -1 is unknown: all three only in the totals
  split = sum(float(got[f"rollout_corr/lag{k}/num_tokens"]) for k in range(MISMATCH_LAGS))
  assert split == np.sum((mask > 0) & (lags >= 0) & (lags < MISMATCH_LAGS)) < float(got["rollout_corr/num_tokens"])


def test_identical_logprobs_give_exactly_no_mismatch():
  lp = jnp.asarray(np.random.RandomState(1).uniform(-5, 0, (3, 7)), jnp.float32)
  m = mismatch_metrics(lp, lp, jnp.ones((3, 7)), jnp.zeros((3, 7), jnp.int32))
  for prefix in ("rollout_corr/", "rollout_corr/lag0/"):
    assert float(m[prefix + "kl_k3"]) == 0.0
    assert float(m[prefix + "ratio_mean"]) == float(m[prefix + "ratio_max"]) == 1.0
    assert float(m[prefix + "token_mult_prob_error"]) == 1.0


def test_empty_lags_are_left_out_on_the_host():
  lp = jnp.zeros((1, 4))
  m = mismatch_metrics(lp, lp, jnp.ones((1, 4)), jnp.array([[1, 1, 3, -1]]))
  host = drop_empty_lags({k: float(v) for k, v in m.items()})
  assert {k.split("/")[1] for k in host if k.count("/") == 2} == {"lag1", "lag3"}
  assert host["rollout_corr/lag1/num_tokens"] == 2 and host["rollout_corr/num_tokens"] == 4
  assert "rollout_corr/kl_k3" in host and "rollout_corr/lag0/kl_k3" not in host


def test_bad_shapes_are_named():
  with pytest.raises(ValueError, match="must have the same shape"):
    mismatch_metrics(jnp.zeros((2, 3)), jnp.zeros((2, 4)), jnp.ones((2, 3)))
  with pytest.raises(ValueError, match="lags has shape"):
    mismatch_metrics(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.ones((2, 3)), jnp.zeros((2,), jnp.int32))
