"""Token log-probs of responses under the policy: the trainer's forward (padded rows or packed rows).

Both run the layers under `lax.scan` (`scan_hidden_states`) and the lm_head + log-prob + entropy in
chunks of positions (`chunked_token_logprobs`: no `[rows, positions, vocab]` array).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llamarl_jax.batch import trainer_layout
from llamarl_jax.model.attention import Segments
from llamarl_jax.model.config import ModelConfig
from llamarl_jax.model.forward import chunked_token_logprobs, lm_head_weight, prepare_params, scan_hidden_states
from llamarl_jax.model.llama import merge_params

Array = jax.Array


def token_logprobs(graphdef, params, prompt_tokens, prompt_mask, response_tokens, response_mask, *,
                   temperature: float = 1.0, remat="none", with_entropy: bool = False,
                   attention: str = "xla", logprob_chunk: int | None = None, scan_layers: bool = True):
  """Log-probs `[B, R]` (fp32) of the response tokens under the policy at `temperature`.

  params: the model's `split_params` dict (any dtype; cast to the compute dtype here). See
  `policy_logprobs` for the computation. With `with_entropy=True` also returns the entropy `[B, R]`
  of the tempered next-token distribution (0 where masked).
  """
  config = merge_params(graphdef, params).config
  prepared = prepare_params(params, config.dtype)
  return policy_logprobs(config, prepared, prompt_tokens, prompt_mask, response_tokens, response_mask,
                         temperature=temperature, remat=remat, with_entropy=with_entropy,
                         attention=attention, logprob_chunk=logprob_chunk, scan_layers=scan_layers)


def policy_logprobs(config: ModelConfig, prepared, prompt_tokens, prompt_mask, response_tokens,
                    response_mask, *, temperature: float = 1.0, remat="none", with_entropy: bool = False,
                    attention: str = "xla", logprob_chunk: int | None = None, width: int | None = None,
                    scan_layers: bool = True, lora: dict | None = None, lora_scale: float = 1.0,
                    lora_dropout: float = 0.0, dropout_key: Array | None = None, replay: Array | None = None,
                    with_routing: bool = False, mesh=None):
  """`token_logprobs` on params already prepared (`prepare_params`: cast, layers stacked).

  One forward over the rows of `trainer_layout` (real prompt tokens from position 0, then the
  response, right-padded) with the layers under scan (`scan_hidden_states`); the hidden states that
  predict response tokens (`predict` `[B, R]`) are gathered *before* the vocabulary projection, which
  then runs `logprob_chunk` positions at a time (`chunked_token_logprobs`: no `[B, R, V]` array when
  the chunk is smaller than R). Positions where `response_mask` is 0 are 0.

  width: the forward's sequence length, at most P + R (default: P + R). Every row must fit (prompt +
  response up to its last valid token <= width, as `group_by_length` guarantees): positions past it
  are padding and are cut off. scan_layers, lora (prepared adapters), lora_scale, lora_dropout,
  dropout_key: see `scan_hidden_states`. MoE models: replay `[B, width, moe layers, k]` (experts per
  position of the forward's rows), with_routing (the result is then (result, `llama.MoeTrace`)) and
  mesh (expert parallelism): see `scan_hidden_states`.
  """
  tokens, lengths, predict = trainer_layout(prompt_tokens, prompt_mask, response_tokens, response_mask)
  if width is not None:
    tokens = tokens[:, :width]
    predict = jnp.minimum(predict, width - 1)  # only masked response positions point past the width
  hidden = scan_hidden_states(config, prepared, tokens, lengths, attention=attention, remat=remat,
                              scan_layers=scan_layers, lora=lora, lora_scale=lora_scale,
                              lora_dropout=lora_dropout, dropout_key=dropout_key, replay=replay,
                              with_routing=with_routing, mesh=mesh)
  hidden, trace = hidden if with_routing else (hidden, None)
  hidden = jnp.take_along_axis(hidden, predict[..., None], axis=1)  # [B, R, E]
  logprobs, entropy = chunked_token_logprobs(hidden, lm_head_weight(config, prepared), response_tokens,
                                             temperature=temperature, chunk=logprob_chunk,
                                             with_entropy=with_entropy, exact=config.exact)
  valid = response_mask.astype(bool)
  logprobs = jnp.where(valid, logprobs, 0.0)
  out = (logprobs, jnp.where(valid, entropy, 0.0)) if with_entropy else logprobs
  return (out, trace) if with_routing else out


def packed_logprobs(config: ModelConfig, prepared, tokens: Array, positions: Array, segments: Segments,
                    targets: Array, *, temperature: float = 1.0, remat="none", with_entropy: bool = False,
                    attention: str = "xla", logprob_chunk: int | None = None, scan_layers: bool = True,
                    lora: dict | None = None, lora_scale: float = 1.0, lora_dropout: float = 0.0,
                    dropout_key: Array | None = None, with_routing: bool = False, mesh=None):
  """Log-probs `[N, T]` (fp32) of `targets` `[N, T]` at every position of packed rows.

  tokens, positions `[N, T]` and `segments` (`llama.Segments`): rows each holding several sequences
  end to end, positions restarting at 0 in each; attention never crosses a sequence. targets[n, t]
  is the token the state at t predicts (the next token of its sequence; anything where unused: the
  caller masks). The lm_head runs over all N * T positions, `logprob_chunk` at a time. Returns
  (logprobs, entropy) with `with_entropy`, else logprobs (and a `llama.MoeTrace` after them with
  `with_routing`); the other arguments as `policy_logprobs`.
  """
  hidden = scan_hidden_states(config, prepared, tokens, segments, attention=attention, remat=remat,
                              scan_layers=scan_layers, lora=lora, lora_scale=lora_scale,
                              lora_dropout=lora_dropout, dropout_key=dropout_key, positions=positions,
                              with_routing=with_routing, mesh=mesh)
  hidden, trace = hidden if with_routing else (hidden, None)
  logprobs, entropy = chunked_token_logprobs(hidden, lm_head_weight(config, prepared), targets,
                                             temperature=temperature, chunk=logprob_chunk,
                                             with_entropy=with_entropy, exact=config.exact)
  out = (logprobs, entropy) if with_entropy else logprobs
  return (out, trace) if with_routing else out
