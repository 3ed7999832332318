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

from llamarl_jax.advantages import (ADVANTAGE_ESTIMATORS, compute_advantages, group_mean_advantages,
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
