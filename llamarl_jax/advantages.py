"""Advantages: critic-free ones from the rewards of the n samples of each prompt (a "group"), and
token-level GAE from a critic's values (`gae`, at the end of this module).

Every estimator takes rewards in one of two layouts and returns advantages in the same layout:
  rewards [n_prompts, n_samples]                         group_ids=None: row p is prompt p's group
  rewards [batch] + group_ids int [batch] + num_groups   group_ids[i] in [0, num_groups) names the
                                                         prompt of row i; rows need not be contiguous.
num_groups must be a static Python int (it sizes the segment sums). The estimators are jitted
(num_groups static), so host callers get one compiled program per shape, not op-by-op dispatch. Rows whose group id is outside [0, num_groups) (e.g. -1 for batch padding) get
advantage 0 and do not count in any group's statistics.

For a group G with rewards r_j, n = |G| and mean m = sum_j r_j / n:
  group_mean  A_i = r_i - m                                  LlamaRL's default (no std division)
  grpo        A_i = (r_i - m) / (std + eps), std = sqrt(sum_j (r_j - m)^2 / (n - 1))  (unbiased,
              as in TRL / verl)
  rloo        A_i = r_i - (sum_{j != i} r_j) / (n - 1) = n / (n - 1) * (r_i - m)   (leave-one-out)
A group whose rewards are all equal (including a group of one sample) carries no learning signal:
its advantages are exactly 0 for every estimator (never NaN, never float round-off noise).
Rewards are upcast to at least float32; advantages have that dtype.
"""

from __future__ import annotations

import functools
import operator
from typing import Callable

import chex
import jax
import jax.numpy as jnp

Array = jax.Array

ADVANTAGE_ESTIMATORS = ("group_mean", "grpo", "rloo")


def _group_sum(values: Array, ids: Array, valid: Array, num_groups: int) -> Array:
  """Per row: the sum of `values` over the row's group (invalid rows neither add nor receive)."""
  sums = jax.ops.segment_sum(jnp.where(valid, values, 0), ids, num_groups)
  return sums[ids]


def _estimate(rewards, group_ids, num_groups, fn_name: str, advantage_fn) -> Array:
  """Shared driver: layout, group statistics, `advantage_fn(r, group_sum, count, mean)`, zeroing."""
  r, ids, g, shape = _layout(rewards, group_ids, num_groups, fn_name)
  valid = (ids >= 0) & (ids < g)
  ids = jnp.where(valid, ids, 0)

  def group_sum(values):
    return _group_sum(values, ids, valid, g)

  count = group_sum(jnp.ones_like(r))
  mean = group_sum(r) / jnp.maximum(count, 1)
  top = jax.ops.segment_max(jnp.where(valid, r, -jnp.inf), ids, g)
  low = jax.ops.segment_min(jnp.where(valid, r, jnp.inf), ids, g)
  # Only groups with spread teach anything; the exact comparison avoids round-off "signal".
  informative = valid & (top > low)[ids]
  advantages = advantage_fn(r, group_sum, count, mean)
  return jnp.where(informative, advantages, 0.0).reshape(shape)


def _layout(rewards, group_ids, num_groups, fn_name: str):
  """(flat float rewards [N], int ids [N], num_groups, output shape) for either input layout."""
  rewards = jnp.asarray(rewards)
  rewards = rewards.astype(jnp.promote_types(rewards.dtype, jnp.float32))
  if group_ids is None:
    chex.assert_rank(rewards, 2, custom_message=(
        f"{fn_name}: without group_ids, rewards must be [n_prompts, n_samples]; for flat rewards "
        "[batch] pass group_ids [batch] and num_groups"))
    n_prompts, n_samples = rewards.shape
    if num_groups is not None and operator.index(num_groups) != n_prompts:
      raise ValueError(f"{fn_name}: num_groups={num_groups} but rewards has {n_prompts} rows "
                       "(prompts); leave num_groups out with the [n_prompts, n_samples] layout")
    ids = jnp.repeat(jnp.arange(n_prompts, dtype=jnp.int32), n_samples)
    return rewards.reshape(-1), ids, n_prompts, rewards.shape
  chex.assert_rank(rewards, 1, custom_message=(
      f"{fn_name}: with group_ids, rewards must be flat [batch]; or pass [n_prompts, n_samples] "
      "rewards with group_ids=None"))
  chex.assert_shape(group_ids, rewards.shape, custom_message=(
      f"{fn_name}: group_ids must have the shape of rewards {rewards.shape}, got {jnp.shape(group_ids)}"))
  chex.assert_type(group_ids, int, custom_message=f"{fn_name}: group_ids must be integers")
  if num_groups is None:
    raise ValueError(f"{fn_name}: num_groups (a static int, e.g. the number of prompts) is required "
                     "with group_ids")
  try:
    num_groups = operator.index(num_groups)
  except TypeError:
    raise TypeError(f"{fn_name}: num_groups must be a static Python int (mark it static under "
                    f"jax.jit), got {type(num_groups).__name__}") from None
  if num_groups < 1:
    raise ValueError(f"{fn_name}: num_groups must be >= 1, got {num_groups}")
  return rewards, jnp.asarray(group_ids), num_groups, rewards.shape


@functools.partial(jax.jit, static_argnames=("num_groups",))
def group_mean_advantages(rewards: Array, group_ids: Array | None = None,
                          num_groups: int | None = None) -> Array:
  """LlamaRL's default: A_i = r_i - mean of r over i's group (no std normalisation).

  rewards [n_prompts, n_samples] (group_ids=None) or [batch] with group_ids [batch] and static
  num_groups; returns advantages shaped like rewards. See the module docstring.
  """
  return _estimate(rewards, group_ids, num_groups, "group_mean_advantages",
                   lambda r, group_sum, count, mean: r - mean)


@functools.partial(jax.jit, static_argnames=("num_groups",))
def grpo_advantages(rewards: Array, group_ids: Array | None = None, num_groups: int | None = None,
                    *, eps: float = 1e-6) -> Array:
  """GRPO: A_i = (r_i - mean) / (std + eps) over i's group, std unbiased (n - 1).

  Layouts and shapes as `group_mean_advantages`; groups with equal rewards (or one sample) give 0.
  """
  def normalised(r, group_sum, count, mean):
    centered = r - mean
    std = jnp.sqrt(group_sum(jnp.square(centered)) / jnp.maximum(count - 1, 1))
    return centered / (std + eps)

  return _estimate(rewards, group_ids, num_groups, "grpo_advantages", normalised)


@functools.partial(jax.jit, static_argnames=("num_groups",))
def rloo_advantages(rewards: Array, group_ids: Array | None = None,
                    num_groups: int | None = None) -> Array:
  """RLOO: A_i = r_i - mean of the other samples of i's group (leave-one-out baseline).

  Layouts and shapes as `group_mean_advantages`; groups of one sample give 0.
  """
  return _estimate(rewards, group_ids, num_groups, "rloo_advantages",
                   lambda r, group_sum, count, mean: r - (group_sum(r) - r) / jnp.maximum(count - 1, 1))


_ESTIMATORS: dict[str, Callable[..., Array]] = {
    "group_mean": group_mean_advantages, "grpo": grpo_advantages, "rloo": rloo_advantages}


def compute_advantages(rewards: Array, group_ids: Array | None = None,
                       num_groups: int | None = None, estimator: str = "group_mean",
                       **kwargs) -> Array:
  """Advantages by estimator name: "group_mean" (default), "grpo" or "rloo".

  Same layouts as the estimators; extra keyword arguments go to the estimator (e.g. eps for grpo).
  Under jax.jit, mark num_groups and estimator static.
  """
  if estimator not in _ESTIMATORS:
    raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of "
                     f"{ADVANTAGE_ESTIMATORS}")
  return _ESTIMATORS[estimator](rewards, group_ids, num_groups, **kwargs)


# --------------------------------------------------------------------------------------------------
# Token-level advantages with a critic: generalised advantage estimation (Schulman et al. 2016,
# arXiv:1506.02438).


@jax.jit
def gae(rewards: Array, values: Array, mask: Array, gamma: float | Array = 1.0,
        lam: float | Array = 1.0) -> tuple[Array, Array]:
  """GAE over token-level rows: (advantages, returns), both fp32 `[B, T]`.

  rewards `[B, T]`: the reward of each token's step (an outcome reward sits at the row's last valid
    token; per-token shaping, e.g. a KL penalty, anywhere). values `[B, T]`: the critic's V(s_t).
    mask `[B, T]` (bool or 0/1): 1 = a token the policy wrote (an action).
  With t' the next valid position after t (none after the row's last valid token):
      delta_t = r_t + gamma * V_t' - V_t          (V after the last valid token is 0: terminal)
      A_t     = delta_t + gamma * lam * A_t'      (A after the last valid token is 0)
      R_t     = A_t + V_t                         (the critic's regression target)
  Masked positions are not steps of the policy: right padding, and mask gaps such as tool outputs or
  observations the model did not write, are skipped, so the valid token before a gap bootstraps from
  the value at the first valid token after it and the discount counts policy tokens only (the row
  behaves exactly as if its masked positions were removed). A masked position's reward and value are
  ignored (put an observation's reward on a policy token), and its advantage and return are 0.
  gamma, lam: Python floats or traced scalars (one compiled program for every value).
  """
  chex.assert_rank(rewards, 2, custom_message="gae: rewards must be [batch, tokens]")
  chex.assert_equal_shape([rewards, values, mask], custom_message=(
      f"gae: rewards, values and mask must have one shape [batch, tokens]; got {jnp.shape(rewards)}, "
      f"{jnp.shape(values)}, {jnp.shape(mask)}"))
  rewards, values = jnp.asarray(rewards, jnp.float32), jnp.asarray(values, jnp.float32)
  valid = jnp.asarray(mask).astype(bool)
  gamma, lam = jnp.asarray(gamma, jnp.float32), jnp.asarray(lam, jnp.float32)

  def step(carry, xs):  # backwards over time; carry = (V, A) at each row's next valid position
    next_value, next_adv = carry
    r, v, m = xs
    adv = r + gamma * next_value - v + gamma * lam * next_adv
    carry = (jnp.where(m, v, next_value), jnp.where(m, adv, next_adv))
    return carry, jnp.where(m, adv, 0.0)

  zeros = jnp.zeros(rewards.shape[:1], jnp.float32)
  _, adv_t = jax.lax.scan(step, (zeros, zeros), (rewards.T, values.T, valid.T), reverse=True)
  advantages = adv_t.T
  return advantages, jnp.where(valid, advantages + values, 0.0)
