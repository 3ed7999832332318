"""Reward-model training as pure functions: a Bradley-Terry step over a `TrainState`.

  reward_model_params(config, params)  a policy's (causal LM) params -> a scalar-head model's: the
                                       decoder kept, the lm_head dropped, a `score` head [embed, 1]
                                       added (transformers' init: N(0, 0.02)); a scalar-head model's
                                       params pass through
  bt_step(spec, state, batch)          one optimizer step of `losses.bradley_terry_loss`: the policy
                                       trainer's `prepare` (fp32 masters cast, layers stacked) and
                                       `apply_update` (clip + AdamW, a non-finite step skipped)
  pair_scores(spec, params, batch)     (chosen, rejected) scores `[P]` of a batch (evaluation)

A batch of P pairs (`PairBatch` fields, host or device arrays): tokens `[2P, T]` right-padded, rows
0..P-1 the pairs' chosen rows and P..2P-1 their rejected rows; lengths `[2P]`; positions `[2P]` (where
each row is scored: `rewards.reward_model.score_positions`, transformers' last non-pad token);
pair_mask `[P]` (0: a padding pair). The forward is `rewards.reward_model.scores_at`, the one the
reward model scores with in a run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from llamarl_jax import losses
from llamarl_jax.model.config import ModelConfig
from llamarl_jax.model.forward import prepare_params
from llamarl_jax.rewards.reward_model import scores_at
from llamarl_jax.train.state import TrainState
from llamarl_jax.train.step import StepSpec, apply_update, prepare

Array = jax.Array

SCORE_INIT_STD = 0.02  # transformers' initializer_range for a new score head


def reward_model_params(config: ModelConfig, params: dict, *, seed: int = 0) -> tuple[ModelConfig, dict]:
  """(config, params) of a scalar-head model (num_labels = 1) that starts from `params`.

  A causal LM (num_labels = 0): its decoder (embedding, layers, final norm) with a new `score` head
  `[embed, 1]` drawn from N(0, SCORE_INIT_STD) by `seed`, the lm_head (if untied) dropped. A model
  with one label: unchanged. More labels: an error (a reward model has one score)."""
  if config.num_labels == 1:
    return config, params
  if config.num_labels:
    raise ValueError(f"{config.architecture} has {config.num_labels} labels; a reward model has one score "
                     "(num_labels = 1): start from the policy (a causal LM) or a one-label classifier")
  head = SCORE_INIT_STD * jax.random.normal(jax.random.key(seed), (config.hidden_size, 1), jnp.float32)
  out = {k: v for k, v in params.items() if k != "lm_head"}
  out["score"] = head.astype(jnp.asarray(params["embed"]).dtype)
  return config.replace(num_labels=1), out


def _scores(spec: StepSpec, compute, batch) -> tuple[Array, Array]:
  s = scores_at(spec.model, compute, batch["tokens"], batch["lengths"], batch["positions"], attention=spec.attention,
                scan_layers=spec.scan_layers, remat=spec.remat)
  P = batch["pair_mask"].shape[0]
  return s[:P], s[P:]


def bt_loss(compute, spec: StepSpec, batch) -> tuple[Array, dict]:
  """The batch's Bradley-Terry loss (spec.loss, with `spec.loss_kwargs`) under prepared params."""
  chosen, rejected = _scores(spec, compute, batch)
  return spec.loss(chosen, rejected, batch["pair_mask"], **spec.loss_kwargs)


def bt_step(spec: StepSpec, state: TrainState, batch) -> tuple[TrainState, dict]:
  """One optimizer step on a batch of pairs: (next state, scalar metrics: the loss's `rm/*` and the
  trainer's `train/*`). Pure; `spec.loss` is `losses.bradley_terry_loss` (spec.mismatch must be off:
  there are no sampled tokens)."""
  compute, _, _ = prepare(spec, state)
  (loss, metrics), grads = jax.value_and_grad(bt_loss, has_aux=True)(compute, spec, batch)
  grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
  pairs = metrics["rm/num_pairs"]
  token_mask = jnp.arange(batch["tokens"].shape[1])[None, :] < batch["lengths"][:, None]
  token_mask = token_mask & (jnp.concatenate([batch["pair_mask"], batch["pair_mask"]]) != 0)[:, None]
  one = lambda x: jnp.asarray(x)[None]  # a single microbatch, `[1]`
  state, step_metrics = apply_update(spec, state, grads, one(loss), jnp.ones(1),
                                     {"loss/total": one(loss), "policy/num_tokens": one(pairs),
                                      "policy/num_seqs": one(pairs)},
                                     (None, None, token_mask, None))
  step_metrics.pop("policy/num_tokens")
  step_metrics.pop("policy/num_seqs")
  return state, {**metrics, **step_metrics}


def pair_scores(spec: StepSpec, params, batch) -> tuple[Array, Array]:
  """(chosen, rejected) fp32 scores `[P]` of a batch under fp32 master `params` (no gradient)."""
  return _scores(spec, prepare_params(params, jnp.dtype(spec.model.dtype)), batch)


def bt_spec(config: ModelConfig, optimizer, *, attention: str = "xla", scan_layers: bool = True,
            remat: str = "none", margin: float = 0.0) -> StepSpec:
  """The `StepSpec` of reward-model training: the Bradley-Terry loss, no mismatch metrics."""
  kwargs = {"margin": margin} if margin else {}
  return StepSpec(model=config, loss=losses.bradley_terry_loss, optimizer=optimizer, loss_kwargs=kwargs,
                  attention=attention, scan_layers=scan_layers, remat=remat, mismatch=False)


def pair_batch(chosen_rows, rejected_rows, *, width: int, pairs: int, pad_id: int | None) -> dict[str, np.ndarray]:
  """Host arrays of a batch of `pairs` pairs (`len(chosen_rows)` real ones, the rest padding) at
  `width` positions: the fields above. Rows are token-id lists of at most `width` ids."""
  from llamarl_jax.rewards.reward_model import score_positions

  n = len(chosen_rows)
  if n != len(rejected_rows) or n > pairs:
    raise ValueError(f"{n} chosen and {len(rejected_rows)} rejected rows for a batch of {pairs} pairs")
  rows = list(chosen_rows) + [[0]] * (pairs - n) + list(rejected_rows) + [[0]] * (pairs - n)
  tokens = np.full((2 * pairs, width), 0 if pad_id is None else pad_id, np.int32)
  lengths = np.ones(2 * pairs, np.int32)
  for i, r in enumerate(rows):
    if len(r) > width:
      raise ValueError(f"a row of {len(r)} tokens does not fit the batch width {width}")
    tokens[i, :len(r)] = r
    lengths[i] = len(r)
  positions = score_positions(rows, pad_id).astype(np.int32)
  mask = np.zeros(pairs, np.int32)
  mask[:n] = 1
  return {"tokens": tokens, "lengths": lengths, "positions": positions, "pair_mask": mask}


def response_row(tokenizer, prompt: str, response: str) -> list[int]:
  """The token row a run's reward model reads for `response` to `prompt` when it shares the policy's
  vocabulary: the prompt as `data.PromptSource` encodes it (a plain prompt with the tokenizer's special
  tokens, e.g. <bos>; with a chat template, the user turn with the generation prompt), then the
  response's tokens and EOS (a response the policy ended)."""
  if getattr(tokenizer, "chat_template", None):
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
  else:
    ids = list(tokenizer(prompt)["input_ids"])
  ids += tokenizer(response, add_special_tokens=False)["input_ids"]
  if tokenizer.eos_token_id is not None:
    ids.append(tokenizer.eos_token_id)
  return ids
