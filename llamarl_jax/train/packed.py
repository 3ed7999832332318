"""The train step over packed rows: `packed_train_step(spec, state, batch, plan)`.

The batch's rows (`trainer_layout`: real prompt + response from position 0) are laid end to end into
bins of `spec.layout.tokens` positions by a host plan (`layout.pack_rows`: each row's bin,
its index in the bin and its first position). On the device, one program:

  pack:       tokens, per-segment positions (0 at each row's first token) and `Segments` (segment
              ids, lengths, offsets) of every bin, `[bins/D, D, T]` (D data-parallel shards; the
              bin count is at most B, the case of one row a bin);
  accumulate: a `lax.scan` over the bins' microbatches (D bins each), each under a `lax.cond`: the
              microbatches past the plan's count run nothing. A microbatch's forward is one packed
              forward (`packed_logprobs`: attention within segments), its log-probs gathered back to
              the batch's `[B, R]` layout, masked to its own rows; the loss (`step.policy_loss`) then
              sees exactly the rows' tokens as the padded step does, weighted by its share of the
              batch's normaliser: token means, sequence means and GSPO's sequence ratios reduce per
              original row (a row never straddles bins);
  apply:      `step.apply_update`, as every step.

The shapes depend only on (B, P, R, T): one compiled program per configuration, whatever the lengths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from llamarl_jax import parallel
from llamarl_jax.batch import trainer_layout
from llamarl_jax.model.attention import Segments
from llamarl_jax.model.logprobs import packed_logprobs
from llamarl_jax.train.metrics import valid_counts
from llamarl_jax.train.state import TrainState
from llamarl_jax.train.step import StepSpec, apply_update, constrain, dropout_key, policy_loss, prepare

Array = jax.Array

PLAN_FIELDS = ("row_bin", "row_slot", "row_offset")  # `[B]` int32 each (`layout.PackPlan`)


def pack(spec: StepSpec, batch, plan):
  """The batch's rows laid out in bins per `plan`: a dict of `[bins/D, D, T]` arrays `tokens`,
  `positions`, `targets` (the next token of the same row, what each position predicts), `ids`
  (segment ids: row + 1, 0 for a bin's unused end), `seqlens` / `offsets` `[bins/D, D, S(+1)]` (each
  bin's segments, -1 past its last; S = B), and `index` `[B, R]`: the flat position in its
  microbatch's `[D * T]` whose state predicts each response token."""
  T, D = spec.layout.tokens, spec.shards
  tokens, lengths, predict = trainer_layout(batch["prompt_tokens"], batch["prompt_mask"],
                                            batch["response_tokens"], batch["response_mask"])
  B, W = tokens.shape
  bins = -(-B // D) * D
  row_bin, row_slot, row_offset = (plan[k] for k in PLAN_FIELDS)
  i = jnp.arange(W, dtype=jnp.int32)[None]
  inside = i < lengths[:, None]
  flat = jnp.where(inside, row_bin[:, None] * T + row_offset[:, None] + i, bins * T)  # out of range: dropped
  scatter = lambda values, fill: jnp.full((bins * T,), fill, jnp.int32).at[flat].set(values, mode="drop")
  rows = jnp.broadcast_to(jnp.arange(1, B + 1, dtype=jnp.int32)[:, None], (B, W))
  targets = jnp.concatenate([tokens[:, 1:], jnp.zeros((B, 1), tokens.dtype)], axis=1)
  out = {"tokens": scatter(tokens, 0), "positions": scatter(jnp.broadcast_to(i, (B, W)), 0),
         "targets": scatter(targets, 0), "ids": scatter(rows, 0)}
  out = {k: v.reshape(bins // D, D, T) for k, v in out.items()}
  segs = lambda v, S: jnp.full((bins, S), -1, jnp.int32).at[row_bin, row_slot].set(v).reshape(bins // D, D, S)
  out["seqlens"], out["offsets"] = segs(lengths, B), segs(row_offset, B + 1)
  if spec.mesh is not None:
    sh = NamedSharding(spec.mesh, P(None, parallel.BATCH_AXES, None))
    out = {k: jax.lax.with_sharding_constraint(v, sh) for k, v in out.items()}
  out["index"] = jnp.minimum((row_bin % D)[:, None] * T + row_offset[:, None] + predict, D * T - 1)
  return out


def _packed_loss(compute, spec, frozen, ref_compute, batch, index, row_bin, mb_packed, m, totals, key):
  """`policy_loss` of packed microbatch `m`: its bins' forward, log-probs gathered to `[B, R]` (`index`)
  and masked to its rows (those whose bin, `row_bin` `[B]`, is one of its D)."""
  mask = batch["response_mask"] * (row_bin // spec.shards == m)[:, None].astype(batch["response_mask"].dtype)
  valid = mask > 0
  segments = Segments(mb_packed["ids"], mb_packed["seqlens"], mb_packed["offsets"])

  def logprobs_of(params, **kw):
    out = packed_logprobs(spec.model, params, mb_packed["tokens"], mb_packed["positions"], segments,
                          mb_packed["targets"], temperature=spec.temperature, attention=spec.attention,
                          logprob_chunk=spec.logprob_chunk, scan_layers=spec.scan_layers, mesh=spec.mesh, **kw)
    out, trace = out if kw.get("with_routing") else (out, None)
    gather = lambda x: jnp.where(valid, jnp.take(x.reshape(-1), index), 0.0)
    out = tuple(gather(x) for x in out) if isinstance(out, tuple) else gather(out)
    return (out, trace) if kw.get("with_routing") else out

  return policy_loss(spec, logprobs_of, compute, frozen, ref_compute, batch, mask, totals,
                     batch["response_tokens"].shape[1], key)


def check_token_budget(prompt_len: int, resp_len: int, tokens: int) -> None:
  """A packed row must hold any row of the batch: tokens_per_microbatch >= P + R."""
  if prompt_len + resp_len > tokens:
    raise ValueError(f"tokens_per_microbatch {tokens} is less than the batch's row width P + R = "
                     f"{prompt_len} + {resp_len}: a row could not fit a packed row; set tokens_per_microbatch to "
                     "at least P + R")


def packed_train_step(spec: StepSpec, state: TrainState, batch, plan) -> tuple[TrainState, dict]:
  """One optimizer step on `batch` packed per `plan` (`PLAN_FIELDS` arrays, and `microbatches`: the
  plan's count, an int32 scalar). Pure: the next state and the step's scalar metrics (with
  `train/padding_fraction`: the packed rows' unused positions per real token)."""
  if not spec.layout.packed:
    raise ValueError(f"a packed step needs a packed StepSpec.layout, got {spec.layout}")
  B, R = batch["response_tokens"].shape
  check_token_budget(batch["prompt_tokens"].shape[1], R, spec.layout.tokens)
  totals = valid_counts(batch["response_mask"])
  packed = pack(spec, batch, plan)
  compute, frozen, ref_compute = prepare(spec, state)
  zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), compute)
  per_mb = {k: packed[k] for k in ("tokens", "positions", "targets", "ids", "seqlens", "offsets")}
  grad_fn = jax.value_and_grad(_packed_loss, has_aux=True)

  def run(carry, mb_packed, m):
    grads, logprobs = carry
    (part, (share, metrics, lp)), g = grad_fn(compute, spec, frozen, ref_compute, batch, packed["index"],
                                              plan["row_bin"], mb_packed, m, totals, dropout_key(spec, state.step, m))
    grads = constrain(jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g), spec.compute_shardings)
    return (grads, logprobs + lp), (part, share, metrics)

  def body(carry, xs):
    mb_packed, m = xs
    skip_shape = jax.eval_shape(run, carry, mb_packed, m)[1]
    skip = lambda carry, *_: (carry, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), skip_shape))
    return jax.lax.cond(m < plan["microbatches"], run, skip, carry, mb_packed, m)

  slots = per_mb["tokens"].shape[0]
  (grads, logprobs), (parts, shares, micro_metrics) = jax.lax.scan(
      body, (zeros, jnp.zeros((B, R), jnp.float32)), (per_mb, jnp.arange(slots, dtype=jnp.int32)))
  state, metrics = apply_update(spec, state, grads, parts, shares, micro_metrics,
                                (logprobs, batch["behaviour_logprobs"], batch["response_mask"],
                                 batch["token_versions"]))
  real = jnp.sum(trainer_layout(batch["prompt_tokens"], batch["prompt_mask"], batch["response_tokens"],
                                batch["response_mask"])[1]).astype(jnp.float32)
  computed = (plan["microbatches"] * spec.shards * spec.layout.tokens).astype(jnp.float32)
  metrics["train/padding_fraction"] = (computed - real) / real
  return state, metrics
