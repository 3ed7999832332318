"""Specification of llamarl_jax.advantages: group-mean (LlamaRL), GRPO and RLOO advantages.

Tolerances: float32 sums over a handful of rewards, rtol=1e-6 unless a comment says otherwise;
GRPO's eps=1e-6 in the denominator shifts values by ~eps/std, hence rtol=1e-5 there.
"""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llamarl_jax import compat
from llamarl_jax.advantages import (ADVANTAGE_ESTIMATORS, compute_advantages, gae, group_mean_advantages,
                                    grpo_advantages, rloo_advantages)

RTOL = 1e-6

REWARDS = np.array([[1.0, 0.0, 0.0, 1.0],    # two right, two wrong
                    [1.0, 0.0, 0.0, 0.0],    # one right
                    [1.0, 1.0, 1.0, 1.0],    # all right: no signal
                    [0.1, 0.1, 0.1, 0.1]],   # equal, and 0.1 is not exact in binary
                   np.float32)


def test_group_mean_hand_values():
  np.testing.assert_allclose(group_mean_advantages(REWARDS), [[0.5, -0.5, -0.5, 0.5],
                                                              [0.75, -0.25, -0.25, -0.25],
                                                              [0.0] * 4, [0.0] * 4], rtol=RTOL)


def test_grpo_hand_values():
  # Row 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.5 / 0.57735 = +-0.866025.
  # Row 1: mean 0.25, unbiased std sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5 -> 1.5, -0.5.
  want = [[0.866025, -0.866025, -0.866025, 0.866025], [1.5, -0.5, -0.5, -0.5], [0.0] * 4, [0.0] * 4]
  np.testing.assert_allclose(grpo_advantages(REWARDS), want, rtol=1e-5)


def test_rloo_hand_values():
  # Row 0: r_i - mean of the 3 others: 1 - 1/3, 0 - 2/3. Row 1: 1 - 0, 0 - 1/3.
  want = [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [1.0, -1 / 3, -1 / 3, -1 / 3], [0.0] * 4, [0.0] * 4]
  np.testing.assert_allclose(rloo_advantages(REWARDS), want, rtol=RTOL)


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
def test_equal_rewards_give_exactly_zero(estimator):
  # Rows 2 and 3 above, groups of one sample, and a group id with no rows at all: 0, never NaN.
  adv = compute_advantages(REWARDS, estimator=estimator)
  assert np.all(np.asarray(adv)[2:] == 0.0)
  single = compute_advantages(np.array([3.0, 5.0]), np.array([0, 2]), 4, estimator)
  assert np.all(np.asarray(single) == 0.0)


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
def test_flat_layout_with_shuffled_group_ids_matches_the_grid_layout(estimator):
  grid = compute_advantages(REWARDS, estimator=estimator)
  order = np.random.default_rng(0).permutation(REWARDS.size)
  ids = np.repeat(np.arange(4, dtype=np.int32), 4)
  flat = compute_advantages(REWARDS.reshape(-1)[order], ids[order], 4, estimator)
  np.testing.assert_allclose(flat, np.asarray(grid).reshape(-1)[order], rtol=RTOL)


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
def test_out_of_range_group_ids_are_padding(estimator):
  # -1 (the sampler's batch padding) and ids >= num_groups get 0 and do not touch any group.
  rewards = np.array([1.0, 0.0, 100.0, 0.0, 1.0, -50.0], np.float32)
  ids = np.array([0, 0, -1, 1, 1, 2], np.int32)
  adv = np.asarray(compute_advantages(rewards, ids, 2, estimator))
  unpadded = compute_advantages(rewards[[0, 1, 3, 4]], ids[[0, 1, 3, 4]], 2, estimator)
  assert adv[2] == 0.0 and adv[5] == 0.0
  np.testing.assert_allclose(adv[[0, 1, 3, 4]], unpadded, rtol=RTOL)


def test_compute_advantages_dispatches_by_name_and_forwards_options():
  np.testing.assert_array_equal(compute_advantages(REWARDS), group_mean_advantages(REWARDS))
  np.testing.assert_array_equal(compute_advantages(REWARDS, estimator="rloo"), rloo_advantages(REWARDS))
  np.testing.assert_array_equal(compute_advantages(REWARDS, estimator="grpo", eps=0.5),
                                grpo_advantages(REWARDS, eps=0.5))
  with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
    compute_advantages(REWARDS, estimator="ppo")


def test_jit_vmap_and_grad():
  fn = jax.jit(compute_advantages, static_argnums=(2, 3))
  ids = np.repeat(np.arange(4, dtype=np.int32), 4)
  np.testing.assert_allclose(fn(REWARDS.reshape(-1), ids, 4, "grpo"),
                             np.asarray(grpo_advantages(REWARDS)).reshape(-1), rtol=RTOL)
  # vmap over a stack of [n_prompts, n_samples] batches.
  stacked = np.asarray(jax.vmap(group_mean_advantages)(np.stack([REWARDS, 2 * REWARDS])))
  np.testing.assert_allclose(stacked[1], 2 * np.asarray(group_mean_advantages(REWARDS)), rtol=RTOL)
  # A = r - mean(r) per group is linear: d sum(w * A) / dr = w - group mean of w.
  w = np.array([[1.0, 2.0, 3.0, 6.0]], np.float32)
  grad = jax.jit(jax.grad(lambda r: jnp.sum(w * group_mean_advantages(r))))(
      np.array([[0.0, 1.0, 2.0, 3.0]], np.float32))
  np.testing.assert_allclose(grad, w - 3.0, rtol=RTOL)


BAD_LAYOUTS = [
    (dict(rewards=np.zeros(4, np.float32)), AssertionError, "rewards must be \\[n_prompts, n_samples\\]"),
    (dict(rewards=np.zeros((2, 2), np.float32), group_ids=np.zeros(4, np.int32), num_groups=2),
     AssertionError, "with group_ids, rewards must be flat"),
    (dict(rewards=np.zeros(4, np.float32), group_ids=np.zeros(3, np.int32), num_groups=2),
     AssertionError, "group_ids must have the shape of rewards"),
    (dict(rewards=np.zeros(4, np.float32), group_ids=np.zeros(4, np.float32), num_groups=2),
     AssertionError, "group_ids must be integers"),
    (dict(rewards=np.zeros(4, np.float32), group_ids=np.zeros(4, np.int32)),
     ValueError, "num_groups .* is required"),
    (dict(rewards=np.zeros(4, np.float32), group_ids=np.zeros(4, np.int32), num_groups=2.5),
     TypeError, "num_groups must be a static Python int"),
    (dict(rewards=np.zeros((2, 3), np.float32), num_groups=3), ValueError, "rewards has 2 rows"),
]


@pytest.mark.parametrize("kwargs,error,message", BAD_LAYOUTS)
def test_bad_layouts_say_what_was_expected(kwargs, error, message):
  with pytest.raises(error, match=message):
    grpo_advantages(**kwargs)


# ----------------------------------------------------------------------------- properties

SLOTS, MAX_GROUPS = 24, 6  # fixed shapes (the estimators are jitted): one compilation each


def reference(rewards, ids, estimator, eps=1e-6):
  """Plain per-group numpy loops, float64."""
  out = np.zeros(len(rewards))
  for g in set(ids.tolist()) - {-1}:
    r = rewards[ids == g].astype(np.float64)
    if r.max() == r.min():
      continue
    if estimator == "group_mean":
      a = r - r.mean()
    elif estimator == "grpo":
      a = (r - r.mean()) / (r.std(ddof=1) + eps)
    else:
      a = r - (r.sum() - r) / (len(r) - 1)
    out[ids == g] = a
  return out


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(n_prompts=st.integers(1, MAX_GROUPS), n_samples=st.integers(1, SLOTS // MAX_GROUPS),
                  binary=st.booleans(), seed=st.integers(0, 2**16),
                  estimator=st.sampled_from(ADVANTAGE_ESTIMATORS))
def test_property_matches_per_group_reference_and_is_finite(n_prompts, n_samples, binary, seed,
                                                            estimator):
  # Random groups, rows shuffled (groups interleaved), padded with id -1 rows to a fixed length.
  rng = np.random.default_rng(seed)
  n = n_prompts * n_samples
  rewards = (rng.integers(0, 2, n) if binary else rng.normal(0, 3, n)).astype(np.float32)
  ids = np.repeat(np.arange(n_prompts, dtype=np.int32), n_samples)
  order = rng.permutation(n)
  rewards = np.concatenate([rewards[order], rng.normal(0, 100, SLOTS - n).astype(np.float32)])
  ids = np.concatenate([ids[order], np.full(SLOTS - n, -1, np.int32)])

  adv = np.asarray(compute_advantages(rewards, ids, MAX_GROUPS, estimator))
  assert np.all(np.isfinite(adv))
  # float32 vs the float64 reference; atol for advantages that are ~0 by cancellation.
  np.testing.assert_allclose(adv, reference(rewards, ids, estimator), rtol=1e-4, atol=1e-5)
  # Every group's advantages sum to 0 (all three estimators are centred within the group).
  sums = np.bincount(ids[:n], weights=adv[:n], minlength=n_prompts)
  np.testing.assert_allclose(sums, 0.0, atol=1e-4)


# --------------------------------------------------------------------------------------------------
# gae: token-level advantages and returns from a critic's values.
#
# Row 0: an outcome reward 1 at its last valid token (t=2), then right padding (t=3) whose value 9
#   must be ignored (the value after the last valid token is 0).
# Row 1: a mask gap at t=1 (a tool output the model did not write) carrying reward 5 and value 7,
#   both ignored: t=0 bootstraps from V at t=2, and the discount counts policy tokens only.
GAE_REWARDS = np.array([[0.0, 0.0, 1.0, 0.0], [0.0, 5.0, 0.0, 2.0]], np.float32)
GAE_VALUES = np.array([[0.5, 0.6, 0.8, 9.0], [1.0, 7.0, 0.5, 1.5]], np.float32)
GAE_MASK = np.array([[1, 1, 1, 0], [1, 0, 1, 1]], np.int32)
# Hand derivation, delta_t = r_t + gamma V_t' - V_t, A_t = delta_t + gamma lam A_t' (t' the next valid t).
GAE_HAND = {
    # gamma = lam = 1: A_t = (sum of later rewards) - V_t. Row 0: 1 - V; row 1: 2 - V.
    (1.0, 1.0): [[0.5, 0.4, 0.2, 0.0], [1.0, 0.0, 1.5, 0.5]],
    # gamma 1, lam .95. Row 0: deltas .2, .2, .1 -> A2 = .2, A1 = .2 + .95 * .2 = .39,
    #   A0 = .1 + .95 * .39 = .4705. Row 1: deltas 2 - 1.5 = .5, 1.5 - .5 = 1, .5 - 1 = -.5
    #   -> A3 = .5, A2 = 1 + .475 = 1.475, A0 = -.5 + .95 * 1.475 = .90125.
    (1.0, 0.95): [[0.4705, 0.39, 0.2, 0.0], [0.90125, 0.0, 1.475, 0.5]],
    # gamma .95, lam 1: A_t = gamma^(steps to the reward) * r - V_t. Row 0: .9025 - .5, .95 - .6,
    #   1 - .8. Row 1 (t=0 is 2 policy steps before t=3): .9025 * 2 - 1, .95 * 2 - .5, 2 - 1.5.
    (0.95, 1.0): [[0.4025, 0.35, 0.2, 0.0], [0.805, 0.0, 1.4, 0.5]],
    # gamma = lam = .95 (gamma lam = .9025). Row 0: deltas .2, .95 * .8 - .6 = .16, .95 * .6 - .5 = .07
    #   -> A2 = .2, A1 = .16 + .9025 * .2 = .3405, A0 = .07 + .9025 * .3405 = .37730125.
    #   Row 1: deltas .5, .95 * 1.5 - .5 = .925, .95 * .5 - 1 = -.525 -> A3 = .5,
    #   A2 = .925 + .9025 * .5 = 1.37625, A0 = -.525 + .9025 * 1.37625 = .717065625.
    (0.95, 0.95): [[0.37730125, 0.3405, 0.2, 0.0], [0.717065625, 0.0, 1.37625, 0.5]],
}


@pytest.mark.parametrize("gamma,lam", sorted(GAE_HAND))
def test_gae_hand_values(gamma, lam):
  adv, ret = gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma, lam)
  want = np.array(GAE_HAND[(gamma, lam)], np.float32)
  # float32 arithmetic over 3 steps of values O(1): a few ulps, so 1e-6 absolute.
  np.testing.assert_allclose(adv, want, atol=1e-6)
  # returns = A + V at policy tokens, 0 at masked ones
  np.testing.assert_allclose(ret, np.where(GAE_MASK == 1, want + GAE_VALUES, 0.0), atol=1e-6)


def _gae_reference(rewards, values, mask, gamma, lam):
  """An independent float64 loop: compact each row to its policy tokens, run textbook GAE, scatter back."""
  adv = np.zeros(rewards.shape)
  for b in range(rewards.shape[0]):
    idx = np.flatnonzero(mask[b])
    a_next, v_next = 0.0, 0.0
    for t in idx[::-1]:
      a_next = rewards[b, t] + gamma * v_next - values[b, t] + gamma * lam * a_next
      v_next = values[b, t]
      adv[b, t] = a_next
  return adv, np.where(mask == 1, adv + values, 0.0)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_a_loop_on_random_rows(gamma, lam):
  rng = np.random.default_rng(1)
  B, T = 5, 23
  rewards = rng.normal(size=(B, T)).astype(np.float32)
  values = rng.normal(size=(B, T)).astype(np.float32)
  lengths = np.array([23, 17, 1, 9, 0])
  mask = (np.arange(T) < lengths[:, None]).astype(np.int32)
  mask[0, 5:8] = 0  # gaps inside rows
  mask[1, 3] = 0
  adv, ret = gae(rewards, values, mask, gamma, lam)
  want_adv, want_ret = _gae_reference(rewards, values, mask, gamma, lam)
  # float32 recursions over <= 23 steps of O(1) terms vs float64: ~1e-5 absolute.
  np.testing.assert_allclose(adv, want_adv, atol=2e-5)
  np.testing.assert_allclose(ret, want_ret, atol=2e-5)
  assert np.all(np.asarray(adv)[mask == 0] == 0.0) and np.all(np.asarray(adv)[4] == 0.0)


def test_gae_lam_zero_is_the_one_step_td_error():
  adv, _ = gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, 0.95, 0.0)
  # Row 0: deltas .07, .16, .2 (derived above); row 1: -.525, 0 (masked), .925, .5.
  np.testing.assert_allclose(adv, [[0.07, 0.16, 0.2, 0.0], [-0.525, 0.0, 0.925, 0.5]], atol=1e-6)


def test_gae_is_one_program_for_every_gamma_and_lam():
  gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, 1.0, 1.0)
  before = compat.jit_cache_size(gae)
  for gamma, lam in GAE_HAND:
    gae(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma, lam)
  jax.jit(lambda r, v, m: gae(r, v, m, 0.9, 0.9))(GAE_REWARDS, GAE_VALUES, GAE_MASK)  # composes under jit
  assert compat.jit_cache_size(gae) == before


def test_gae_refuses_mismatched_shapes():
  with pytest.raises(AssertionError, match="gae: rewards, values and mask must have one shape"):
    gae(GAE_REWARDS, GAE_VALUES[:, :3], GAE_MASK)
  with pytest.raises(AssertionError, match=r"gae: rewards must be \[batch, tokens\]"):
    gae(GAE_REWARDS[0], GAE_VALUES[0], GAE_MASK[0])
