"""The reward step of the pipeline: a generated batch -> decoded texts -> rewards -> advantages.

Runs wherever the rewards are scored (the controller's reward thread in one process; the generator
processes in a multi-process run), so it is one function both call.
"""

from __future__ import annotations

import numpy as np

from llamarl_jax.advantages import compute_advantages
from llamarl_jax.generation.rollout import ScoredBatch


def decode_responses(tokenizer, rollout) -> list[str]:
  toks = np.asarray(rollout.response_tokens)
  lengths = np.asarray(rollout.lengths)
  return [tokenizer.decode(toks[i, :lengths[i]].tolist(), skip_special_tokens=True) for i in range(len(lengths))]


def score_generated(item, reward, tokenizer, *, samples_per_prompt: int,
                    advantage_estimator: str) -> tuple[ScoredBatch, dict, list[str]]:
  """Score a `Generated` batch with a RewardExecutor: (ScoredBatch, reward metrics, decoded texts)."""
  texts = decode_responses(tokenizer, item.rollout)
  truths = [ex.ground_truth for ex in item.examples for _ in range(samples_per_prompt)]
  rewards, reward_metrics = reward.score(texts, truths)
  scored, metrics = scored_from_rewards(item, rewards, reward_metrics, advantage_estimator=advantage_estimator)
  return scored, metrics, texts


def scored_from_rewards(item, rewards, reward_metrics: dict, *,
                        advantage_estimator: str) -> tuple[ScoredBatch, dict]:
  """Rewards `[B]` of a `Generated` batch -> (ScoredBatch with advantages, the batch's metrics).

  Shared by one process (all rewards scored here) and many (each generator process scores a share
  of the prompts; the shares' rewards are concatenated and their counts summed first).
  """
  rewards = np.asarray(rewards, np.float32)
  adv = np.asarray(compute_advantages(rewards, item.rollout.group_ids, len(item.examples),
                                      advantage_estimator), np.float32)
  metrics = dict(item.metrics)
  metrics.update({k: v for k, v in reward_metrics.items() if not k.startswith("time/")})
  metrics.update({"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
                  "reward/accuracy": float(np.mean(rewards >= 1.0)),
                  "advantage/abs_mean": float(np.abs(adv).mean())})
  return ScoredBatch(rollout=item.rollout, rewards=rewards, advantages=adv), metrics
