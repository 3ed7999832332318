"""RewardModelExecutor: a reward model (`rewards.RewardModel`) scoring each generated batch whole.

The rule rewards (`RewardExecutor`: verifiers, per row, in worker processes) and the reward model's
scores (one batched forward on devices) are combined per `RewardConfig` (`scoring.combine_rewards`)
into the reward the advantages see. What the model reads for row b:
  the policy's own tokens, prompt + response (observations included), when the reward model has no
    tokenizer of its own or one with the policy's vocabulary: nothing is decoded or re-tokenised;
  otherwise the text, re-tokenised by the reward model's tokenizer: the example's question and the
    decoded response as a user/assistant conversation through its chat template (or, without a
    template, the policy's prompt text followed by the response).
Metrics of a batch: reward_model/latency_s (wall seconds of the model's scoring of its rows),
reward_model/rows_per_s, reward_model/score_mean, reward_model/score_std. A failure of the reward
model raises `RewardModelError` naming the model and the batch: the run stops before that batch
reaches the trainer (every trained step is kept; with `TrainConfig.checkpoint_every` > 0 the run's
end writes a checkpoint of the last one).

Across processes the work splits at the rows: a generator process builds them (`batch_rows`, with a
model of shapes only: `build.reward_model(weights=False)`), the reward processes score them (`score_rows`,
`runners/reward_process.py`), and the generator processes combine the scores with the rule rewards
(`combine`): the same functions as `score_and_combine` in one process.
"""

from __future__ import annotations

import contextlib
import time
from typing import Sequence

import numpy as np

from llamarl_jax.config import RewardConfig
from llamarl_jax.executors.scoring import combine_rewards


class RewardModelError(RuntimeError):
  """The reward model failed to score a batch."""


def same_vocabulary(a, b) -> bool:
  """Whether two tokenizers map the same strings to the same ids (token rows transfer unchanged)."""
  return a is b or a.get_vocab() == b.get_vocab()


class RewardModelExecutor:
  """Scores `Generated` batches with `model` and combines the scores with the rule rewards.

  model: a `rewards.RewardModel`; policy_tokenizer: the policy's (rows are built from its tokens, or
  its texts re-tokenised). reward: the combination (`RewardConfig.rule_weight`, `model_weight`,
  `model_gate`, `model_normalize`). device_turn: a lock held while the model computes, when it shares
  its devices with executors that take turns on them (colocated mode); None: none.
  """

  def __init__(self, model, policy_tokenizer, reward: RewardConfig = RewardConfig(), *, name: str = "reward model",
               device_turn=None):
    self.model, self.policy_tokenizer, self.reward, self.name = model, policy_tokenizer, reward, name
    self.device_turn = device_turn if device_turn is not None else contextlib.nullcontext()
    self.retokenize = model.tokenizer is not None and not same_vocabulary(model.tokenizer, policy_tokenizer)
    if not self.retokenize and len(policy_tokenizer) > model.config.vocab_size:
      raise ValueError(f"{name}: the policy's tokenizer has {len(policy_tokenizer)} tokens but the reward model's "
                       f"vocabulary {model.config.vocab_size}, and the reward model has no tokenizer to re-tokenise "
                       "the text with: save the reward model with its tokenizer")

  def rows(self, item, texts: Sequence[str] | None = None) -> list[list[int]]:
    """The reward model's token row of each row of the batch (see the module docstring)."""
    rollout = item.rollout
    n = len(rollout.lengths)
    per_prompt = n // len(item.examples)
    examples = [item.examples[b // per_prompt] for b in range(n)]
    if self.retokenize:
      if texts is None:
        raise ValueError("re-tokenising for the reward model needs the decoded responses")
      template = getattr(self.model.tokenizer, "chat_template", None)
      prompts = [(ex.question or ex.prompt) if template else ex.prompt for ex in examples]
      return self.model.encode(list(texts), prompts)
    prompt_tokens, prompt_mask = np.asarray(rollout.prompt_tokens), np.asarray(rollout.prompt_mask)
    response_tokens, lengths = np.asarray(rollout.response_tokens), np.asarray(rollout.lengths)
    return [np.concatenate([prompt_tokens[b][prompt_mask[b] > 0], response_tokens[b, :lengths[b]]]).tolist()
            for b in range(n)]

  def score(self, item, texts: Sequence[str] | None = None) -> tuple[np.ndarray, dict]:
    """(scores `[B]` float32, metrics) of a `Generated` batch; `RewardModelError` if the model fails."""
    return self.score_rows(self.batch_rows(item, texts), item.index)

  def batch_rows(self, item, texts: Sequence[str] | None = None) -> list[list[int]]:
    """`rows`, with a failure raised as `RewardModelError` naming the model and the batch."""
    try:
      return self.rows(item, texts)
    except Exception as e:  # noqa: BLE001 - re-raised with the model and the batch named
      raise RewardModelError(f"{self.name} failed scoring batch {item.index}: {type(e).__name__}: {e}") from e

  def score_rows(self, rows: Sequence[Sequence[int]], index: int) -> tuple[np.ndarray, dict]:
    """(scores `[len(rows)]` float32, metrics) of batch `index`'s token rows (`rows`): the model's part of
    `score`, which a reward process runs on rows a generator process built."""
    t0 = time.perf_counter()
    try:
      with self.device_turn:
        scores = self.model.score_tokens(rows)
    except Exception as e:  # noqa: BLE001 - re-raised with the model and the batch named
      raise RewardModelError(f"{self.name} failed scoring batch {index}: {type(e).__name__}: {e}") from e
    seconds = time.perf_counter() - t0
    if not np.all(np.isfinite(scores)):
      raise RewardModelError(f"{self.name} gave non-finite scores for batch {index} "
                             f"({int(np.sum(~np.isfinite(scores)))} of {len(scores)} rows)")
    return scores, {"reward_model/latency_s": seconds, "reward_model/rows_per_s": len(rows) / max(seconds, 1e-9),
                    "reward_model/score_mean": float(scores.mean()), "reward_model/score_std": float(scores.std())}

  def combine(self, item, rule_rewards, scores) -> np.ndarray:
    """The combined rewards `[B]` of a `Generated` batch: its rule rewards with the model's `scores`
    (`RewardConfig`'s weights, gate and normalisation: `scoring.combine_rewards`)."""
    r = self.reward
    return combine_rewards(rule_rewards, scores, np.asarray(item.rollout.group_ids), len(item.examples),
                           rule_weight=r.rule_weight, model_weight=r.model_weight, gate=r.model_gate,
                           normalize=r.model_normalize)

  def score_and_combine(self, item, rule_rewards, texts: Sequence[str] | None = None) -> tuple[np.ndarray, dict]:
    """(combined rewards `[B]`, metrics): the model's scores of the batch combined with `rule_rewards`."""
    scores, metrics = self.score(item, texts)
    return self.combine(item, rule_rewards, scores), metrics
