"""The batch contract: the rollout data the generator produces and the trainer consumes (pytrees, fixed
shapes), the fields a trainer batch carries, and the trainer's row layout (`trainer_layout`). Below
`model/`, `generation/` and `train/`, which all read it; it imports nothing of the package."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

FINISH_STOP = 0    # a stop token was generated (it is part of the response and of the mask)
FINISH_LENGTH = 1  # max_new_tokens reached


@flax.struct.dataclass
class RolloutBatch:
  """A batch of sampled responses. B = n_prompts * n (the n samples of a prompt are contiguous).

  prompt_tokens       int32 [B, P]  left-padded with the pad id
  prompt_mask         int32 [B, P]  1 = real prompt token
  response_tokens     int32 [B, R]  right-padded with the pad id after the finish
  response_mask       int32 [B, R]  1 = generated token (the stop token included)
  behaviour_logprobs  f32   [B, R]  log mu(token) under the distribution actually sampled from
                                    (after temperature/top-k/top-p); 0 where response_mask is 0
  lengths             int32 [B]     number of generated tokens (= response_mask.sum(-1))
  finish_reason       int32 [B]     FINISH_STOP or FINISH_LENGTH
  group_ids           int32 [B]     index of the prompt within the batch (the GRPO group)
  policy_version      int32 [B]     version of the weights that sampled the row's oldest (first)
                                    token: the one the lag bound applies to
  token_versions      int32 [B, R]  version of the weights that sampled each response token (they
                                    differ within a row when the slot engine swapped weights
                                    mid-sequence); = policy_version where response_mask is 0, so
                                    token_versions.min(-1) == policy_version
  routing             int32 [B, P + R, moe layers, k]  or None: a MoE generator's experts at each
                                    position of [prompt | response] (the static sampler and the slot
                                    engine record them; response position t: token t as the input that predicts t + 1,
                                    -1 where no forward ran); the trainer can replay them
                                    (`routing_in_trainer_layout`, `model.moe`)
  """

  prompt_tokens: jax.Array
  prompt_mask: jax.Array
  response_tokens: jax.Array
  response_mask: jax.Array
  behaviour_logprobs: jax.Array
  lengths: jax.Array
  finish_reason: jax.Array
  group_ids: jax.Array
  policy_version: jax.Array
  token_versions: jax.Array
  routing: jax.Array | None = None

  @property
  def batch_size(self) -> int:
    return self.prompt_tokens.shape[0]

  def to_host(self) -> "RolloutBatch":
    """Numpy copy (for the reward executor, the replay buffer and the trainer's re-sharding). On a
    mesh spread over processes, every process of that mesh calls it and gets the whole batch."""
    from llamarl_jax.parallel import to_host

    return to_host(self)


@flax.struct.dataclass
class ScoredBatch:
  """A RolloutBatch with its rewards `[B]` (f32) and advantages `[B]` (f32, per sequence)."""

  rollout: RolloutBatch
  rewards: jax.Array
  advantages: jax.Array

  @property
  def batch_size(self) -> int:
    return self.rollout.batch_size

  def train_arrays(self) -> dict[str, np.ndarray]:
    """The fields the trainer reads (`TRAIN_FIELDS`, and `ROUTING_FIELD` when the generator recorded
    routing), as host arrays in its dtypes: what a batch transfer between processes moves."""
    r = self.rollout
    versions = (np.full(np.shape(r.response_tokens), -1, np.int32) if r.token_versions is None  # -1: unknown
                else r.token_versions)
    arrays = {"prompt_tokens": r.prompt_tokens, "prompt_mask": r.prompt_mask, "response_tokens": r.response_tokens,
              "response_mask": r.response_mask, "behaviour_logprobs": r.behaviour_logprobs,
              "advantages": self.advantages, "token_versions": versions}
    out = {k: np.asarray(arrays[k], dtype) for k, dtype in TRAIN_FIELDS.items()}
    if r.routing is not None:
      out["routing"] = np.asarray(r.routing, ROUTING_FIELD["routing"])
    return out

  @classmethod
  def from_train_arrays(cls, arrays: dict) -> "ScoredBatch":
    """A batch holding only the `TRAIN_FIELDS` and routing when sent (others None): what a trainer
    process receives."""
    rollout = RolloutBatch(**{k: arrays[k] for k in TRAIN_FIELDS if k != "advantages"}, lengths=None,
                           finish_reason=None, group_ids=None, policy_version=None, routing=arrays.get("routing"))
    return cls(rollout=rollout, rewards=None, advantages=arrays["advantages"])


# The one batch schema of training: the fields (and dtypes) the trainer's step reads. ScoredBatch's
# `train_arrays` / `from_train_arrays`, the trainer's batch shardings and the cross-process batch
# transfer (multiprocess/protocol.py) all use it.
TRAIN_FIELDS = {"prompt_tokens": np.int32, "prompt_mask": np.int32, "response_tokens": np.int32,
                "response_mask": np.int32, "behaviour_logprobs": np.float32, "advantages": np.float32,
                "token_versions": np.int32}  # the mismatch metrics' split by policy lag (-1: unknown)
# A MoE generator's recorded experts `[B, P + R, moe layers, k]` (`RolloutBatch.routing`): in a batch when
# the generator recorded them; the trainer's step reads them (routing replay, disagreement).
ROUTING_FIELD = {"routing": np.int32}


def trainer_layout(prompt_tokens, prompt_mask, response_tokens, response_mask):
  """The trainer's rows: each row's real prompt tokens from position 0, then its response, right-padded.

  prompt_tokens/prompt_mask `[B, P]` (padded on either side), response_tokens/response_mask `[B, R]`
  (right-padded). Returns tokens `[B, P+R]` (0 past each row's end), lengths `[B]` int32 (real prompt
  tokens + the response up to its last valid token; at least 1) and predict `[B, R]` int32: the index
  whose hidden state predicts response token t (prompt length - 1 + t). Token i of a row sits at
  position i, as the sampler assigned positions (0 at the first real prompt token), so log-probs line
  up token for token with the generator's; this is the layout cuDNN's fused attention takes (causal,
  per-row lengths, right padding).
  """
  B, P = prompt_tokens.shape
  R = response_tokens.shape[1]
  real = prompt_mask > 0
  order = jnp.argsort(~real, axis=1, stable=True)  # real prompt tokens first, in their order
  prompt = jnp.take_along_axis(prompt_tokens, order, axis=1)
  p_len = jnp.sum(real, axis=1).astype(jnp.int32)[:, None]  # [B, 1]
  i = jnp.arange(P + R, dtype=jnp.int32)[None]
  src = jnp.clip(jnp.where(i < p_len, i, P + i - p_len), 0, P + R - 1)
  tokens = jnp.take_along_axis(jnp.concatenate([prompt, response_tokens], axis=1), src, axis=1)
  t = jnp.arange(R, dtype=jnp.int32)[None]
  r_len = jnp.max(jnp.where(response_mask > 0, t + 1, 0), axis=1)
  lengths = jnp.maximum(p_len[:, 0] + r_len, 1).astype(jnp.int32)
  tokens = jnp.where(i < lengths[:, None], tokens, 0)
  predict = jnp.maximum(p_len - 1 + t, 0).astype(jnp.int32)
  return tokens, lengths, predict


def routing_in_trainer_layout(prompt_mask, routing):
  """A `RolloutBatch.routing` `[B, P + R, moe layers, k]` (the sampler's [prompt | response] layout)
  moved to `trainer_layout`'s rows: real prompt positions first, then the response; -1 (no replay:
  the trainer's own top-k) past each row's prompt + response."""
  B, P = prompt_mask.shape
  W = routing.shape[1]
  real = prompt_mask > 0
  order = jnp.argsort(~real, axis=1, stable=True)
  prompt_first = jnp.concatenate([order, jnp.broadcast_to(jnp.arange(P, W), (B, W - P))], axis=1)  # [B, W]
  p_len = jnp.sum(real, axis=1).astype(jnp.int32)[:, None]
  i = jnp.arange(W, dtype=jnp.int32)[None]
  src = jnp.take_along_axis(prompt_first, jnp.clip(jnp.where(i < p_len, i, P + i - p_len), 0, W - 1), axis=1)
  out = jnp.take_along_axis(routing, src[:, :, None, None], axis=1)
  return jnp.where((i < p_len + W - P)[:, :, None, None], out, -1)
