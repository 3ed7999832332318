"""Mixture-of-experts math (Qwen3-MoE): top-k routing, capacity-free grouped expert matmuls, and the
load-balancing auxiliary loss. Pure functions; `model.llama.MoE` holds the parameters.

Routing (as transformers' `Qwen3MoeTopKRouter`): router logits `x @ router` in the compute dtype,
softmax in fp32, the top-k probabilities (renormalised to sum to 1 when `norm_topk_prob`) weight the
chosen experts' outputs. Each token's k choices are one row each of a `[tokens * k, embed]` array
sorted by expert, and every expert's SwiGLU runs over its contiguous rows with `jax.lax.ragged_dot`
(a grouped matmul over group sizes: no capacity, no dropped tokens, no padding per expert).
Compiled for an H100 by jax 0.10's XLA (CUDA lowering on the CPU, Qwen3-30B-A3B layer shapes:
4096 tokens, 128 experts, top-8, bf16), each ragged_dot becomes one dense Triton GEMM over all
experts' weights with a masked `[rows, experts * embed]` operand (32768 x 262144 for gate/up): the
FLOPs and that operand grow with the expert count, so a GPU run at that scale needs a grouped-GEMM
kernel in its place; on CPU and at small expert counts this form is exact and cheap.

Routing replay: given `replay` indices `[..., k]` (the experts another forward chose), those experts
are used instead of this forward's top-k, weighted by this forward's router probabilities of them
(so the router's weights still get gradients for the replayed choices); a token whose replay row
holds -1 keeps its own top-k.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

Array = jax.Array


@flax.struct.dataclass
class RouterStats:
  """One MoE layer's routing, for the auxiliary loss and for replay / disagreement metrics.

  topk `[B, T, k]` int32: the experts each token was sent to; counts `[experts]` fp32: how many of
  the (masked) tokens' top-k choices went to each expert (this forward's own top-k, replay or not);
  prob_sum `[experts]` fp32: the sum over (masked) tokens of the router's probabilities."""

  topk: Array
  counts: Array
  prob_sum: Array


def route(x: Array, router: Array, k: int, norm_topk_prob: bool, replay: Array | None = None):
  """x `[N, E]`, router `[E, X]` -> (weights `[N, k]` in x's dtype, experts `[N, k]` int32, probs
  `[N, X]` fp32, own top-k `[N, k]` int32). With `replay` `[N, k]` the experts are those, weighted
  by their probabilities under this router."""
  logits = x @ router.astype(x.dtype)
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  top_p, top_i = jax.lax.top_k(probs, k)
  if replay is not None:  # a row of -1 (nothing recorded there): this router's own choice
    replay = replay.astype(jnp.int32)
    top_i = jnp.where(jnp.any(replay < 0, axis=-1, keepdims=True), top_i, replay)
    top_p = jnp.take_along_axis(probs, top_i, axis=-1)
  if norm_topk_prob:
    top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
  own = top_i if replay is None else jax.lax.top_k(probs, k)[1]
  return top_p.astype(x.dtype), top_i.astype(jnp.int32), probs, own.astype(jnp.int32)


def grouped_swiglu(x: Array, experts: Array, weights: Array, gate_up, w_down: Array, mesh=None) -> Array:
  """Sum over each token's k experts of weight * SwiGLU_expert(x), by grouped matmuls.

  x `[N, E]`; experts, weights `[N, k]`; gate_up: (w_gate, w_up) `[X, E, F]` each, or the serving
  layout's fused w_gate_up `[X, E, 2, F]` (one grouped matmul of 2F columns); w_down `[X, F, E]` ->
  `[N, E]`. The N * k (token, choice) rows are sorted by expert (stable), each expert's rows multiply
  its own weights (`jax.lax.ragged_dot` with the experts' row counts as group sizes), and the rows
  return to token order to be weighted and summed over the k choices.

  mesh: with an `expert` axis of size > 1 (expert parallelism) each device of that axis holds
  X / expert experts and computes them for its tokens (rows routed elsewhere fall outside every group:
  no work, zero output); the partial sums add up over the axis (`psum`). The batch axes (`data`,
  `fsdp`) are manual too, also without expert parallelism, so sorting and grouping are per device,
  never across the batch: each device routes its own rows through every expert (FSDP gathers the
  experts' weights, as any layer's), where XLA's own partitioning of the sort would gather every
  device's rows and compute all of them on each device."""
  rows = None if mesh is None else tuple(a for a in ("data", "fsdp") if mesh.shape.get(a, 1) > 1) or None
  if mesh is None or (mesh.shape.get("expert", 1) == 1 and rows is None):
    return _local_swiglu(x, experts, weights, gate_up, w_down, 0)
  from jax.sharding import PartitionSpec as P

  ep = ("expert",) if mesh.shape.get("expert", 1) > 1 else ()
  tok, exp = P(rows), P(*ep)

  def body(x, experts, weights, gate_up, w_down):
    if not ep:
      return _local_swiglu(x, experts, weights, gate_up, w_down, 0)
    first = jax.lax.axis_index("expert") * w_down.shape[0]
    return jax.lax.psum(_local_swiglu(x, experts, weights, gate_up, w_down, first), "expert")

  gate_spec = (exp, exp) if isinstance(gate_up, (tuple, list)) else exp
  return jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, gate_spec, exp), out_specs=tok,
                       axis_names={*ep, *(rows or ())}, check_vma=False)(
                           x, experts, weights, tuple(gate_up) if isinstance(gate_up, list) else gate_up, w_down)


def _local_swiglu(x, experts, weights, gate_up, w_down, first):
  """`grouped_swiglu` over the experts `first .. first + X - 1` held here (X = w_down.shape[0]); the
  other experts' choices contribute 0."""
  N, k = experts.shape
  X = w_down.shape[0]
  local = (experts >= first) & (experts < first + X)
  flat = jnp.where(local, experts - first, X).reshape(-1)  # X: routed to another device, sorted last
  order = jnp.argsort(flat, stable=True)
  rows = jnp.take(x, order // k, axis=0)  # [N * k, E], sorted by expert
  sizes = jnp.bincount(flat, length=X + 1)[:X].astype(jnp.int32)
  dt = x.dtype
  if isinstance(gate_up, (tuple, list)):
    gate = jax.lax.ragged_dot(rows, gate_up[0].astype(dt), sizes)
    up = jax.lax.ragged_dot(rows, gate_up[1].astype(dt), sizes)
  else:
    _, E, _, F = gate_up.shape
    both = jax.lax.ragged_dot(rows, gate_up.reshape(X, E, 2 * F).astype(dt), sizes)
    gate, up = both[:, :F], both[:, F:]
  out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down.astype(dt), sizes)  # [N * k, E]
  out = jnp.zeros_like(out).at[order].set(out)  # back to (token, choice) order
  weights = jnp.where(local, weights, jnp.zeros((), weights.dtype))
  return jnp.sum(out.reshape(N, k, -1) * weights[..., None], axis=1)


def router_stats(topk: Array, probs: Array, num_experts: int, token_mask: Array | None) -> tuple[Array, Array]:
  """(counts `[X]`, prob_sum `[X]`) over tokens with token_mask `[N]` (all when None): `RouterStats`."""
  w = jnp.ones(topk.shape[0], jnp.float32) if token_mask is None else token_mask.astype(jnp.float32)
  counts = jnp.zeros(num_experts, jnp.float32).at[topk.reshape(-1)].add(jnp.repeat(w, topk.shape[1]))
  return counts, jnp.sum(probs * w[:, None], axis=0)


def load_balancing_loss(counts: Array, prob_sum: Array, num_tokens: Array) -> Array:
  """Switch-Transformer load-balancing loss over MoE layers, transformers' `load_balancing_loss_func`:
  num_experts * sum_e f_e * P_e, where f_e is the share of (layer, token) top-k choices sent to expert
  e and P_e its mean router probability, both averaged over all MoE layers' tokens together.

  counts, prob_sum `[layers, X]` (`RouterStats` of each MoE layer); num_tokens: tokens per layer."""
  total = counts.shape[0] * num_tokens
  f = jnp.sum(counts, axis=0) / total
  p = jnp.sum(prob_sum, axis=0) / total
  return counts.shape[1] * jnp.sum(f * p)


def routing_disagreement(a: Array, b: Array, mask: Array) -> Array:
  """The fraction of (token, MoE layer) pairs whose top-k expert sets differ between two routings
  a, b `[B, T, layers, k]` over tokens with mask `[B, T]` > 0 (order within the k ignored)."""
  differ = jnp.any(jnp.sort(a, axis=-1) != jnp.sort(b, axis=-1), axis=-1)  # [B, T, layers]
  w = (mask > 0)[..., None].astype(jnp.float32)
  return jnp.sum(differ * w) / jnp.maximum(jnp.sum(w) * 1.0, 1.0)
