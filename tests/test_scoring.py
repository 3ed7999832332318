"""The data path's DAPO options: overlong reward shaping, masking truncated responses, and dynamic
sampling's pure parts (which groups are informative, which are kept, how a batch is assembled).

Pure host numpy; no model. Rewards and advantages are float32; "exactly" means ==.
"""

import numpy as np
import pytest

from llamarl_jax.advantages import compute_advantages
from llamarl_jax.executors.generator import (DynamicSampling, Generated, batch_seed, draw_seed,
                                             informative_groups, pick_groups, take_groups)
from llamarl_jax.executors.scoring import OverlongShaping, overlong_penalty, scored_from_rewards
from llamarl_jax.batch import FINISH_LENGTH, FINISH_STOP, RolloutBatch


def dapo_penalty(length, l_max, l_cache):
  """DAPO eq. 13, case by case, as the paper writes it."""
  if length <= l_max - l_cache:
    return 0.0
  if length <= l_max:
    return ((l_max - l_cache) - length) / l_cache
  return -1.0


def test_overlong_penalty_hand_values():
  # L_max = 16, L_cache = 4: free up to 12 tokens, then -1/4 per token, -1 at the limit.
  np.testing.assert_allclose(overlong_penalty([0, 12, 13, 15, 16], 16, 4), [0, 0, -0.25, -0.75, -1.0])
  np.testing.assert_allclose(overlong_penalty([14, 16], 16, 4, penalty_factor=0.5), [-0.25, -0.5])


def test_overlong_penalty_matches_the_papers_piecewise_formula():
  lengths = np.arange(0, 40)  # beyond L_max too (a generator that overran would get -1)
  for l_max, l_cache in [(32, 8), (32, 32), (20, 1)]:
    want = [dapo_penalty(n, l_max, l_cache) for n in lengths]
    np.testing.assert_allclose(overlong_penalty(lengths, l_max, l_cache), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("buffer_len", [0, 17])
def test_overlong_penalty_rejects_a_buffer_outside_the_limit(buffer_len):
  with pytest.raises(ValueError, match=r"buffer_len must be in \[1, max_new_tokens=16\]"):
    overlong_penalty([3], 16, buffer_len)


@pytest.mark.parametrize("kwargs,message", [(dict(buffer_len=-1), "buffer_len: expected an int >= 0"),
                                            (dict(buffer_len=2.5), "buffer_len: expected an int >= 0"),
                                            (dict(penalty_factor=-1.0), "penalty_factor: expected >= 0")])
def test_overlong_shaping_validates(kwargs, message):
  with pytest.raises(ValueError, match=message):
    OverlongShaping(**kwargs)


def generated(lengths, finish, rewards_groups=2, R=8):
  """A `Generated` of len(lengths) rows in `rewards_groups` groups (contiguous), host numpy."""
  B = len(lengths)
  lengths = np.asarray(lengths, np.int32)
  mask = (np.arange(R)[None] < lengths[:, None]).astype(np.int32)
  rollout = RolloutBatch(
      prompt_tokens=np.ones((B, 2), np.int32), prompt_mask=np.ones((B, 2), np.int32),
      response_tokens=mask * 5, response_mask=mask, behaviour_logprobs=-mask.astype(np.float32),
      lengths=lengths, finish_reason=np.asarray(finish, np.int32),
      group_ids=np.repeat(np.arange(rewards_groups), B // rewards_groups).astype(np.int32),
      policy_version=np.zeros(B, np.int32), token_versions=np.zeros((B, R), np.int32))
  return Generated(index=0, rollout=rollout, examples=[None] * rewards_groups, data_state={},
                   metrics={"generate/frac_truncated": float(np.mean(np.asarray(finish) == FINISH_LENGTH))})


S, L = FINISH_STOP, FINISH_LENGTH
LENGTHS, FINISH = [3, 8, 7, 5], [S, L, S, S]
REWARDS = np.array([1.0, 1.0, 0.0, 1.0], np.float32)


def test_off_by_default_changes_nothing():
  item = generated(LENGTHS, FINISH)
  plain, plain_metrics = scored_from_rewards(item, REWARDS, {}, advantage_estimator="group_mean")
  off, off_metrics = scored_from_rewards(item, REWARDS, {}, advantage_estimator="group_mean",
                                         overlong=OverlongShaping(), max_new_tokens=8)
  assert plain_metrics == off_metrics and set(off_metrics) == {
      "generate/frac_truncated", "reward/mean", "reward/std", "reward/accuracy", "advantage/abs_mean"}
  assert off.rollout is item.rollout and np.array_equal(off.rewards, REWARDS)
  np.testing.assert_array_equal(off.advantages, plain.advantages)


def test_length_penalty_shapes_the_rewards_before_the_advantages():
  # L_max = 8, L_cache = 4: lengths 3, 8, 7, 5 -> penalties 0, -1, -0.75, -0.25.
  item = generated(LENGTHS, FINISH)
  scored, metrics = scored_from_rewards(item, REWARDS, {}, advantage_estimator="group_mean",
                                        overlong=OverlongShaping(buffer_len=4), max_new_tokens=8)
  shaped = np.array([1.0, 0.0, -0.75, 0.75], np.float32)
  np.testing.assert_allclose(scored.rewards, shaped, rtol=1e-7)
  # group_mean per group of 2: (1, 0) -> +-0.5; (-0.75, 0.75) -> -+0.75.
  np.testing.assert_allclose(scored.advantages, [0.5, -0.5, -0.75, 0.75], rtol=1e-7)
  np.testing.assert_allclose(scored.advantages,
                             compute_advantages(shaped, item.rollout.group_ids, 2, "group_mean"), rtol=1e-7)
  assert metrics["reward/mean"] == 0.75 and metrics["reward/accuracy"] == 0.75  # the verifier's rewards
  np.testing.assert_allclose(metrics["reward/overlong_penalty_mean"], -0.5, rtol=1e-7)
  np.testing.assert_allclose(metrics["reward/shaped_mean"], 0.25, rtol=1e-7)
  assert metrics["reward/frac_overlong"] == 0.75
  np.testing.assert_array_equal(scored.rollout.response_mask, item.rollout.response_mask)  # mask untouched


def test_mask_truncated_zeroes_only_the_truncated_rows():
  item = generated(LENGTHS, FINISH)
  scored, metrics = scored_from_rewards(item, REWARDS, {}, advantage_estimator="group_mean",
                                        overlong=OverlongShaping(mask_truncated=True), max_new_tokens=8)
  mask = np.asarray(item.rollout.response_mask)
  want = mask.copy()
  want[1] = 0
  np.testing.assert_array_equal(scored.rollout.response_mask, want)
  assert scored.rollout.response_mask.dtype == mask.dtype
  # The truncated row still counts in its group's statistics: rewards (1, 1) -> advantages 0.
  np.testing.assert_array_equal(scored.advantages, [0.0, 0.0, -0.5, 0.5])
  assert metrics["reward/frac_truncated_masked"] == 0.25 == metrics["generate/frac_truncated"]
  np.testing.assert_allclose(metrics["reward/frac_tokens_masked"], 8 / 23, rtol=1e-7)
  assert "reward/overlong_penalty_mean" not in metrics
  np.testing.assert_array_equal(item.rollout.response_mask, mask)  # the input is not modified


def test_length_penalty_needs_the_sampling_limit():
  with pytest.raises(ValueError, match="needs max_new_tokens"):
    scored_from_rewards(generated(LENGTHS, FINISH), REWARDS, {}, advantage_estimator="group_mean",
                        overlong=OverlongShaping(buffer_len=2))


# ----------------------------------------------------------------------------- dynamic sampling


def test_informative_groups_are_those_whose_rewards_differ():
  rewards = [1, 1, 0, 1, 0.5, 0.5, 0, 0]  # 4 groups of 2
  np.testing.assert_array_equal(informative_groups(rewards, 4, 2), [False, True, False, False])


def test_pick_groups_takes_informative_groups_in_draw_order_then_fills():
  draws = [np.array([False, True, False]), np.array([True, True, False])]
  assert pick_groups(draws, 2) == [(0, 1), (1, 0)]
  # Not enough informative groups after the last draw: the uninformative ones complete the batch.
  assert pick_groups(draws, 5) == [(0, 1), (1, 0), (1, 1), (0, 0), (0, 2)]


def test_take_groups_assembles_rows_renumbers_groups_and_left_pads_prompts():
  a = generated([3, 8, 7, 5], [S, L, S, S]).rollout                # 2 groups, prompt width 2
  b = generated([1, 2, 3, 4, 5, 6], [S] * 6, rewards_groups=3).rollout
  b = b.replace(prompt_tokens=np.full((6, 4), 9, np.int32), prompt_mask=np.ones((6, 4), np.int32))
  out = take_groups([a, b], [(1, 2), (0, 0)], samples_per_prompt=2, pad_id=0)
  np.testing.assert_array_equal(out.lengths, [5, 6, 3, 8])
  np.testing.assert_array_equal(out.group_ids, [0, 0, 1, 1])
  np.testing.assert_array_equal(out.prompt_tokens[2:], [[0, 0, 1, 1]] * 2)  # width 2 -> 4, left-padded
  np.testing.assert_array_equal(out.prompt_mask[2:], [[0, 0, 1, 1]] * 2)
  np.testing.assert_array_equal(out.response_mask[:2], b.response_mask[4:])
  np.testing.assert_array_equal(out.finish_reason, [S, S, S, L])


def test_draw_seeds_are_the_batch_seed_then_distinct():
  assert draw_seed(3, 7, 0) == batch_seed(3, 7)  # draw 0 samples what a run without dynamic sampling does
  seeds = {draw_seed(3, k, d) for k in range(50) for d in range(4)}
  assert len(seeds) == 200 and max(seeds) < 2**31


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_dynamic_sampling_validates(value):
  with pytest.raises(ValueError, match="max_draws: expected an int >= 1"):
    DynamicSampling(max_draws=value)
