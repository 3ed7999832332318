"""The reward step of the pipeline: a generated batch -> decoded texts -> rewards -> advantages.

Runs wherever the rewards are scored (the controller's reward thread in one process; the generator
processes in a multi-process run), so it is one function both call.
"""

from __future__ import annotations


import numpy as np

from llamarl_jax.advantages import compute_advantages
from llamarl_jax.config import OverlongShaping
from llamarl_jax.batch import FINISH_LENGTH, ScoredBatch


def overlong_penalty(lengths, max_len: int, buffer_len: int, penalty_factor: float = 1.0) -> np.ndarray:
  """DAPO's soft overlong punishment (eq. 13) per response `[B]` -> `[B]` float32, in [-factor, 0].

  With L_max = max_len, L_cache = buffer_len and |y| = lengths:
      0                               if |y| <= L_max - L_cache
      ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
      -1                              if |y| > L_max
  times penalty_factor. buffer_len must be in [1, max_len].
  """
  if not 1 <= buffer_len <= max_len:
    raise ValueError(f"overlong buffer_len must be in [1, max_new_tokens={max_len}], got {buffer_len}")
  lengths = np.asarray(lengths, np.float64)
  expected = max_len - buffer_len
  penalty = np.clip((expected - lengths) / buffer_len, -1.0, 0.0)
  return (penalty_factor * penalty).astype(np.float32)


def combine_rewards(rule, model, group_ids, num_groups: int, *, rule_weight: float = 1.0, model_weight: float = 1.0,
                    gate: float | None = None, normalize: str = "none", eps: float = 1e-6) -> np.ndarray:
  """Rule and reward-model rewards of one batch `[B]` -> the combined reward `[B]` float32:

      rule_weight * rule + model_weight * gate * normalize(model)

  gate: None (every row) or a threshold: the model term counts only where rule >= gate (a verifier
  gate). normalize: 'none'; 'batch': (s - mean) / (std + eps) over the batch; 'group': the same over
  each group (`group_ids` `[B]` in [0, num_groups): the samples of one prompt; a group whose scores are
  all equal gets 0). std is the population std (ddof 0).
  """
  rule, model = np.asarray(rule, np.float64), np.asarray(model, np.float64)
  if rule.shape != model.shape:
    raise ValueError(f"rule rewards {rule.shape} and reward-model scores {model.shape} differ in shape")
  if normalize == "batch":
    model = (model - model.mean()) / (model.std() + eps)
  elif normalize == "group":
    ids = np.asarray(group_ids)
    count = np.maximum(np.bincount(ids, minlength=num_groups), 1)
    mean = np.bincount(ids, model, minlength=num_groups) / count
    centered = model - mean[ids]
    std = np.sqrt(np.bincount(ids, centered ** 2, minlength=num_groups) / count)
    model = centered / (std[ids] + eps)
  elif normalize != "none":
    raise ValueError(f"normalize must be 'none', 'batch' or 'group', got {normalize!r}")
  if gate is not None:
    model = np.where(rule >= gate, model, 0.0)
  return (rule_weight * rule + model_weight * model).astype(np.float32)


def decode_responses(tokenizer, rollout) -> list[str]:
  toks = np.asarray(rollout.response_tokens)
  lengths = np.asarray(rollout.lengths)
  return [tokenizer.decode(toks[i, :lengths[i]].tolist(), skip_special_tokens=True) for i in range(len(lengths))]


def score_generated(item, reward, tokenizer, *, samples_per_prompt: int, advantage_estimator: str,
                    overlong: OverlongShaping | None = None, max_new_tokens: int | None = None,
                    reward_model=None) -> tuple[ScoredBatch, dict, list[str]]:
  """Score a `Generated` batch with a RewardExecutor: (ScoredBatch, reward metrics, decoded texts: whole
  episodes, observations included). The reward function scores `item.answers` when the episodes
  have them (multi-turn: the final answer), else the decoded responses. With a `reward_model`
  (`executors.reward_model.RewardModelExecutor`) it scores every row too, and its combination with
  the rule rewards is what the advantages see."""
  texts = decode_responses(tokenizer, item.rollout)
  if item.rewards is not None:  # scored in the generator loop (dynamic sampling)
    rewards, reward_metrics = item.rewards, item.reward_metrics
  else:
    truths = [ex.ground_truth for ex in item.examples for _ in range(samples_per_prompt)]
    rewards, reward_metrics = reward.score(item.answers if item.answers is not None else texts, truths)
  combined = None
  if reward_model is not None:
    combined, model_metrics = reward_model.score_and_combine(item, rewards, texts)
    reward_metrics = {**reward_metrics, **model_metrics}
  scored, metrics = scored_from_rewards(item, rewards, reward_metrics, advantage_estimator=advantage_estimator,
                                        overlong=overlong, max_new_tokens=max_new_tokens, combined=combined)
  return scored, metrics, texts


def scored_from_rewards(item, rewards, reward_metrics: dict, *, advantage_estimator: str,
                        overlong: OverlongShaping | None = None, max_new_tokens: int | None = None,
                        combined=None) -> tuple[ScoredBatch, dict]:
  """Rewards `[B]` of a `Generated` batch -> (ScoredBatch with advantages, the batch's metrics).

  Shared by one process (all rewards scored here) and many (each generator process scores a share
  of the prompts; the shares' rewards are concatenated and their counts summed first).
  `overlong` (with `max_new_tokens`, the sampling limit): DAPO's length penalty is added to the
  rewards before the advantages, and truncated responses may be masked out of the loss (see
  `OverlongShaping`). reward/mean, std and accuracy stay those of the verifier's rewards. Multi-turn
  episodes' environment rewards (`item.env_rewards`) are added before the advantages (reward/env_mean).
  `combined` `[B]`: the rule rewards combined with a reward model's scores (`combine_rewards`), shaped
  and used for the advantages in their place (reward/combined_mean).
  """
  rewards = np.asarray(rewards, np.float32)
  rollout = item.rollout
  shaped, shaping_metrics = rewards, {}
  if combined is not None:
    shaped = np.asarray(combined, np.float32)
    shaping_metrics["reward/combined_mean"] = float(shaped.mean())
  if getattr(item, "env_rewards", None) is not None:
    env_rewards = np.asarray(item.env_rewards, np.float32)
    shaped = (shaped + env_rewards).astype(np.float32)
    shaping_metrics["reward/env_mean"] = float(env_rewards.mean())
  if overlong is not None and overlong.enabled:
    shaped, rollout, overlong_metrics = _apply_overlong(shaped, rollout, overlong, max_new_tokens)
    shaping_metrics.update(overlong_metrics)
  adv = np.asarray(compute_advantages(shaped, rollout.group_ids, len(item.examples),
                                      advantage_estimator), np.float32)
  metrics = dict(item.metrics)
  metrics.update({k: v for k, v in reward_metrics.items() if not k.startswith("time/")})
  metrics.update({"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
                  "reward/accuracy": float(np.mean(rewards >= 1.0)),
                  "advantage/abs_mean": float(np.abs(adv).mean()), **shaping_metrics})
  return ScoredBatch(rollout=rollout, rewards=shaped, advantages=adv), metrics


def _apply_overlong(rewards: np.ndarray, rollout, overlong: OverlongShaping, max_new_tokens: int | None):
  """(shaped rewards, rollout with truncated rows masked if asked, metrics) of `OverlongShaping`."""
  metrics = {}
  if overlong.buffer_len:
    if max_new_tokens is None:
      raise ValueError("overlong reward shaping needs max_new_tokens (the sampling limit L_max)")
    penalty = overlong_penalty(rollout.lengths, max_new_tokens, overlong.buffer_len, overlong.penalty_factor)
    rewards = (rewards + penalty).astype(np.float32)
    metrics.update({"reward/overlong_penalty_mean": float(penalty.mean()),
                    "reward/frac_overlong": float(np.mean(penalty < 0)),
                    "reward/shaped_mean": float(rewards.mean())})
  if overlong.mask_truncated:
    truncated = np.asarray(rollout.finish_reason) == FINISH_LENGTH
    mask = np.asarray(rollout.response_mask)
    rollout = rollout.replace(response_mask=np.where(truncated[:, None], 0, mask).astype(mask.dtype))
    metrics.update({"reward/frac_truncated_masked": float(truncated.mean()),
                    "reward/frac_tokens_masked": float(np.sum(mask * truncated[:, None]) / max(np.sum(mask), 1))})
  return rewards, rollout, metrics


def score_evaluation(tokenizer, reward, examples, episodes, sampled, samples: int) -> dict:
  """A held-out evaluation's metrics: the greedy `episodes`' accuracy (reward >= 1) and mean reward,
  three sample completions, the episodes' turn and tool counts; with `sampled` (`samples` draws per
  problem) the sampled pass@1. Answers are `Episodes.answers` (single-turn: the decoded responses)."""
  truths = [ex.ground_truth for ex in examples]
  texts = decode_responses(tokenizer, episodes.rollout)
  answers = episodes.answers if episodes.answers is not None else texts
  rewards = np.asarray(reward.score(answers, truths)[0])
  out = {"eval/accuracy": float(np.mean(rewards >= 1.0)), "eval/reward_mean": float(rewards.mean()),
         "eval/samples": [(ex.prompt, t) for ex, t in zip(examples[:3], texts[:3])]}
  out.update({f"eval/{k.replace('/', '_')}": v for k, v in episodes.metrics.items()
              if k in ("episode/turns_mean", "episode/tool_calls_mean", "tool/errors")})
  if sampled is not None:
    sampled_answers = sampled.answers if sampled.answers is not None else decode_responses(tokenizer, sampled.rollout)
    sampled_rewards = np.asarray(reward.score(sampled_answers, np.repeat(truths, samples).tolist())[0])
    out["eval/pass1_sampled"] = float(np.mean(sampled_rewards >= 1.0))
  return out
