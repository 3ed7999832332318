"""Normalisers and metric reductions of a step's microbatches (pure functions)."""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from llamarl_jax import losses

Array = jax.Array


def valid_counts(mask: Array) -> dict[str, Array]:
  """Valid tokens and non-empty sequences of `mask` `[B, R]` (the loss aggregations' normalisers)."""
  valid = mask > 0
  return {"tokens": jnp.sum(valid).astype(jnp.float32),
          "seqs": jnp.sum(jnp.any(valid, axis=-1)).astype(jnp.float32)}


def loss_share(mask: Array, totals: Mapping[str, Array], aggregation: str) -> Array:
  """A microbatch's share of the full batch's normaliser: sum_m share_m * loss_m = loss(full batch).

  token_mean normalises by valid tokens; seq_mean_token_mean and seq_sum_norm by non-empty
  sequences (see `llamarl_jax.losses`). An empty microbatch has share 0 (its loss is 0 anyway).
  """
  key = "tokens" if aggregation == "token_mean" else "seqs"
  return valid_counts(mask)[key] / jnp.maximum(totals[key], 1.0)


def combine_metrics(micro: Mapping[str, Array], shares: Array) -> dict[str, Array]:
  """Per-microbatch metrics `[M]` -> the full batch's.

  loss/*: share-weighted sums (like the loss); policy/num_*: sums; *_max / *_min: max / min over
  microbatches with valid tokens; `losses.SEQUENCE_METRICS` are per-sequence means: weighted by
  sequences; every other metric is a per-token mean: token-weighted. A microbatch with no valid
  token (all zeros) counts for nothing.
  """
  tokens = micro["policy/num_tokens"]
  seqs = micro["policy/num_seqs"]
  has = tokens > 0
  out = {}
  for k, v in micro.items():
    if k.startswith("loss/"):
      out[k] = jnp.sum(shares * v)
    elif k.startswith("policy/num_"):
      out[k] = jnp.sum(v)
    elif k.endswith("_max"):
      out[k] = jnp.where(jnp.any(has), jnp.max(jnp.where(has, v, -jnp.inf)), 0.0)
    elif k.endswith("_min"):
      out[k] = jnp.where(jnp.any(has), jnp.min(jnp.where(has, v, jnp.inf)), 0.0)
    elif k in losses.SEQUENCE_METRICS:
      out[k] = jnp.sum(seqs * v) / jnp.maximum(jnp.sum(seqs), 1.0)
    else:
      out[k] = jnp.sum(tokens * v) / jnp.maximum(jnp.sum(tokens), 1.0)
  return out
