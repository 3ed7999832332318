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

Exact mode (`ModelConfig.exact`, the `exact_logprobs` run switch): `route(exact=True)` and
`grouped_swiglu(grouped_gemm='exact')` compute every op in its batch-invariant form (`model.exact`), so a
token's routing and output are the same bits whatever the other rows (one device's experts, no LoRA).

Expert parallelism (`grouped_swiglu` over a mesh whose `expert` axis is EP > 1; routing, replay and
`router_stats` happen before and are the same either way): the tokens reach the experts' devices by
replicate-and-sum (a psum of the `[tokens, embed]` output) or by token dispatch (each token's k rows
exchanged with the experts' owners by a ragged all-to-all, the output all-gathered). Dispatch sends
(2 k / EP + 1) / 2 of replicate's bytes (`expert_parallel_bytes`), so it is the default only where
EP > 2 k (`choose_expert_parallel`): at Qwen3-30B-A3B's top-8 on 8 devices, replicate.
"""

from __future__ import annotations

import functools
import math

import flax.struct
import jax
import jax.numpy as jnp

from llamarl_jax.model import exact as exact_lib
from llamarl_jax.model.config import GROUPED_GEMMS

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


def route(x: Array, router: Array, k: int, norm_topk_prob: bool, replay: Array | None = None, exact: bool = False):
  """x `[N, E]`, router `[E, X]` -> (weights `[N, k]` in x's dtype, experts `[N, k]` int32, probs
  `[N, X]` fp32, own top-k `[N, k]` int32). With `replay` `[N, k]` the experts are those, weighted
  by their probabilities under this router. exact: the logits, softmax and renormalisation in their
  batch-invariant forms (`model.exact`), so a token's routing is the same whatever the other rows."""
  if exact:
    probs = exact_lib.softmax(exact_lib.dense(x, router.astype(x.dtype)))
  else:
    probs = jax.nn.softmax((x @ router.astype(x.dtype)).astype(jnp.float32), axis=-1)
  top_p, top_i = jax.lax.top_k(probs, k)
  if replay is not None:  # a row of -1 (nothing recorded there): this router's own choice
    replay = replay.astype(jnp.int32)
    top_i = jnp.where(jnp.any(replay < 0, axis=-1, keepdims=True), top_i, replay)
    top_p = jnp.take_along_axis(probs, top_i, axis=-1)
  if norm_topk_prob:
    top_p = top_p / (exact_lib.tree_sum(top_p)[..., None] if exact else jnp.sum(top_p, axis=-1, keepdims=True))
  own = top_i if replay is None else jax.lax.top_k(probs, k)[1]
  return top_p.astype(x.dtype), top_i.astype(jnp.int32), probs, own.astype(jnp.int32)


EXPERT_PARALLEL = ("replicate", "dispatch", "dispatch_dense")


def grouped_swiglu(x: Array, experts: Array, weights: Array, gate_up, w_down: Array, mesh=None,
                   expert_parallel: str | None = None, lora=None, grouped_gemm: str = "ragged_dot") -> Array:
  """Sum over each token's k experts of weight * SwiGLU_expert(x), by grouped matmuls.

  x `[N, E]`; experts, weights `[N, k]`; gate_up: (w_gate, w_up) `[X, E, F]` each, or the serving
  layout's fused w_gate_up `[X, E, 2, F]` (one grouped matmul of 2F columns); w_down `[X, F, E]` ->
  `[N, E]`. The N * k (token, choice) rows are sorted by expert (stable), each expert's rows multiply
  its own weights (`jax.lax.ragged_dot` with the experts' row counts as group sizes), and the rows
  return to token order to be weighted and summed over the k choices.

  mesh: the batch axes (`data`, `fsdp`) are manual, so sorting and grouping are per device, never
  across the batch: each device routes its own rows (FSDP gathers the experts' weights, as any
  layer's), where XLA's own partitioning of the sort would gather every device's rows and compute all
  of them on each device (N not a multiple of the batch axes' size: those axes are left to XLA). An `expert` axis of size EP > 1 (expert parallelism) holds X / EP experts on
  each of its devices, and the rows, replicated over that axis, reach their experts by replicate or by
  dispatch (`expert_parallel`; None: `choose_expert_parallel`'s pick for these sizes):
    'replicate'  every device computes its own experts' rows of all its group's tokens (rows routed
                 elsewhere fall outside every group: no work, zero output) and the partial sums add
                 up over the axis (`psum` of `[N, E]`);
    'dispatch'   each device takes 1/EP of the tokens, sends each of their k rows to the device that
                 owns its expert (`ragged_all_to_all`: only the rows routed there), that device runs its
                 experts over the rows it received, the results return the same way to be weighted and
                 summed, and the `[N, E]` output is all-gathered over the axis. Dropless: the receive
                 buffer holds the most rows a device can be sent. XLA:CPU has no ragged all-to-all,
                 so on a CPU mesh it is 'dispatch_dense';
    'dispatch_dense'  the same exchange as a dense `all_to_all` of a fixed per-destination capacity,
                 the most rows one device can send another (dropless, so it moves the worst case).
  Each way computes every (token, choice) row once; `expert_parallel_bytes` gives what each moves.

  grouped_gemm: the experts' grouped matmuls, one of GROUPED_GEMM_IMPLEMENTATIONS or 'auto'
  (`resolve_grouped_gemm`: ragged_dot until the Pallas kernels pass on a GPU), or 'exact': every op in
  its batch-invariant form (`model.exact`: the grouped matmuls in fixed row tiles, SwiGLU rounded once,
  the k choices' weighted sum in a fixed order), so a token's output is the same whatever the other
  rows (`ModelConfig.exact`; no expert axis, no LoRA). Rows that do not split over the batch axes are
  then computed whole on every device (the same dots, so the same bits) rather than left to XLA.

  lora: LoRA of the experts (`model.lora`; unfused gate_up only), an object with `weights`
  {"w_gate" | "w_up" | "w_down": {"a" `[X, in, r]`, "b" `[X, r, out]`}} and `scale`: each row's
  projection gains `scale * (row @ a_x) @ b_x` of its expert x, two grouped matmuls over the same
  groups (the adapters shard over `expert` like the weights), or None."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  batch_axes = () if mesh is None else tuple(a for a in ("data", "fsdp") if mesh.shape.get(a, 1) > 1)
  rows = batch_axes or None
  if rows and x.shape[0] % math.prod(mesh.shape[a] for a in rows):
    rows = None  # rows that do not split over the batch axes (a prefill of fewer prompts): left to XLA there
  EP = 1 if mesh is None else mesh.shape.get("expert", 1)
  if grouped_gemm == "exact" and (EP > 1 or lora is not None):
    raise ValueError(f"grouped_gemm='exact' computes unsharded experts without adapters; got expert={EP}, "
                     f"lora={'set' if lora is not None else None}")
  if grouped_gemm == "exact" and rows is None and batch_axes:
    return _on_every_device(mesh, batch_axes, x, experts, weights, gate_up, w_down)
  if mesh is None or (EP == 1 and rows is None):
    return _local_swiglu(x, experts, weights, gate_up, w_down, 0, grouped_gemm, lora=lora)

  groups = math.prod(mesh.shape.get(a, 1) for a in rows or ())
  mode = expert_parallel or choose_expert_parallel(dict(mesh.shape), x.shape[0], experts.shape[1], x.shape[1],
                                                   w_down.shape[0])
  if mode not in EXPERT_PARALLEL:
    raise ValueError(f"expert_parallel={mode!r}: expected one of {EXPERT_PARALLEL} or None (chosen by bytes moved)")
  if EP == 1:
    mode = "replicate"
  if mode != "replicate" and x.shape[0] % (groups * EP):
    raise ValueError(f"expert_parallel={mode!r} splits each device group's {x.shape[0] // groups} tokens over "
                     f"expert={EP} devices: the token count must be a multiple of {groups * EP}; "
                     "use 'replicate' (or None) for these shapes")
  if mode == "dispatch" and mesh.devices.flat[0].platform == "cpu":
    mode = "dispatch_dense"
  ep = ("expert",) if EP > 1 else ()
  gate_up = tuple(gate_up) if isinstance(gate_up, list) else gate_up
  if mode == "replicate":
    return _replicate_swiglu(mesh, rows, ep, x, experts, weights, gate_up, w_down, lora, grouped_gemm)
  exp = P(*ep)
  gate_spec = (exp, exp) if isinstance(gate_up, tuple) else exp
  # the experts' weights (replicated over the batch axes): fp32 on a CPU mesh (the shard_map is unchecked)
  (_, gate_up, w_down, lora), narrow = _wide_on_cpu(mesh, (), None, gate_up, w_down, lora)

  def body(x, experts, weights, gate_up, w_down, lora):
    _, gate_up, w_down, lora = narrow(None, gate_up, w_down, lora)
    return _dispatch_swiglu(x, experts, weights, gate_up, w_down, lora, ep=EP, ragged=mode == "dispatch",
                            grouped_gemm=grouped_gemm)

  tok = P((*(rows or ()), "expert"))  # each device of the expert axis takes 1/EP of its group's tokens
  out = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, gate_spec, exp, exp), out_specs=tok,
                      axis_names=_manual_axes(mesh, {*ep, *(rows or ())}, grouped_gemm), check_vma=False)(
                          x, experts, weights, gate_up, w_down, lora)
  # replicated over `expert` again (an all-gather; its transpose, the gradient's, is a slice)
  return jax.lax.with_sharding_constraint(out, NamedSharding(mesh, P(rows)))


def _replicate_swiglu(mesh, rows, ep, x, experts, weights, gate_up, w_down, lora, grouped_gemm):
  """`grouped_swiglu`'s 'replicate' way over `mesh`, manual over the batch axes `rows` (or None) and `ep`
  (("expert",) or ()): each device's experts over all its group's rows, summed over `expert`."""
  from jax.sharding import PartitionSpec as P

  exp = P(*ep)
  gate_spec = (exp, exp) if isinstance(gate_up, tuple) else exp
  manual = {*ep, *(rows or ())}
  # the experts' weights (replicated over the batch axes) and with `expert`, x and the routing weights
  # (replicated over it): fp32 on a CPU mesh
  operands, narrow = _wide_on_cpu(mesh, manual, (x, weights) if ep else None, gate_up, w_down, lora)
  tokens, gate_up, w_down, lora = operands
  x, weights = tokens or (x, weights)

  def body(x, experts, weights, gate_up, w_down, lora):
    if ep:
      x = jax.lax.pcast(x, "expert", to="varying")  # so that x's gradient is summed as `[N, E]`
    tokens, gate_up, w_down, lora = narrow((x, weights) if ep else None, gate_up, w_down, lora)
    if not ep:
      return _local_swiglu(x, experts, weights, gate_up, w_down, 0, grouped_gemm, lora=lora)
    first = jax.lax.axis_index("expert") * w_down.shape[0]
    y = _local_swiglu(tokens[0], experts, tokens[1], gate_up, w_down, first, grouped_gemm, lora=lora)
    cpu = mesh.devices.flat[0].platform == "cpu"  # a 16-bit psum: XLA:CPU aborts (`_wide_on_cpu`)
    return jax.lax.psum(y.astype(jnp.float32) if cpu else y, "expert").astype(y.dtype)

  tok = P(rows)
  return jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, gate_spec, exp, exp), out_specs=tok,
                       axis_names=_manual_axes(mesh, manual, grouped_gemm))(x, experts, weights, gate_up, w_down, lora)


def _on_every_device(mesh, axes, x, experts, weights, gate_up, w_down):
  """The exact layer (`grouped_gemm='exact'`) of rows that do not split over the batch `axes`: every
  device computes every row with the whole weights (the same dots, so the same bits), where XLA's own
  partition could split a tile's dot."""
  from jax.sharding import PartitionSpec as P

  operands, narrow = _wide_on_cpu(mesh, (), x, experts, weights, gate_up, w_down)
  body = lambda *a: _local_swiglu(*narrow(*a), first=0, grouped_gemm="exact")
  return jax.shard_map(body, mesh=mesh, in_specs=(P(),) * 5, out_specs=P(), axis_names=set(axes),
                       check_vma=False)(*operands)


def _wide_on_cpu(mesh, axes, *trees):
  """(trees, narrow): on a CPU mesh the 16-bit float leaves of `trees` in fp32 (exact), and `narrow`
  (trees of the same structure -> the same, made to vary over the manual `axes` - a checked
  shard_map's, else () - and rounded back to their dtypes: exact) for the shard_map's body.
  XLA:CPU (jaxlib 0.10.2 and 0.12) aborts compiling a 16-bit all-reduce that a shard_map's transpose
  makes (AllReducePromotion: "Invalid binary instruction opcode copy"); the gradient of an input
  replicated over a manual axis is such a sum (at the boundary, or where the body first makes it vary),
  so it is summed in fp32 here. Elsewhere the trees as they are and `narrow` the identity."""
  half = lambda a: jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize == 2
  if mesh.devices.flat[0].platform != "cpu" or not any(map(half, jax.tree.leaves(trees))):
    return trees, lambda *t: t
  from llamarl_jax import compat

  def one(a, dtype):
    missing = tuple(sorted(set(axes) - compat.varying_axes(a)))
    return (jax.lax.pcast(a, missing, to="varying") if missing else a).astype(dtype)

  dtypes = jax.tree.map(lambda a: a.dtype, trees)
  wide = jax.tree.map(lambda a: a.astype(jnp.float32) if half(a) else a, trees)
  return wide, lambda *t: jax.tree.map(one, t, dtypes)


def _manual_axes(mesh, axes: set, grouped_gemm: str) -> set:
  """The axes `grouped_swiglu`'s shard_map is manual over: `axes`, or every mesh axis when the Pallas
  kernels run interpreted (on the CPU: the interpreter's callbacks need a fully manual computation;
  inputs are replicated over the added axes, so each of their devices computes the same)."""
  from llamarl_jax.model.paged_attention import interpret_kernels

  if grouped_gemm != "exact" and resolve_grouped_gemm(grouped_gemm, mesh.devices.flat[0].platform) == "pallas" \
      and interpret_kernels():
    return set(mesh.axis_names)
  return axes


def expert_parallel_bytes(mesh_shape, tokens: int, k: int, embed: int, num_experts: int,
                          itemsize: int = 2) -> dict[str, dict[str, float]]:
  """Bytes one device sends over the `expert` axis in one MoE layer's forward and in its backward,
  for each of `grouped_swiglu`'s `expert_parallel` ways: {way: {'forward', 'backward'}}.

  mesh_shape {axis: size}; tokens: the rows of x `[tokens, embed]` (all device groups together, so
  N = tokens / (data * fsdp) per group, replicated over the EP devices of `expert`); itemsize: the
  rows' dtype. Ring collectives: an all-reduce of S bytes sends 2 (EP-1)/EP S, an all-gather of S
  (EP-1)/EP S, an all-to-all of S (EP-1)/EP S. The ragged exchanges are counted at uniform routing
  (each of a device's n k rows, n = N / EP, stays on the device with probability 1/EP; the
  load-balancing loss drives routing there); they send at most n k rows whatever the routing. The
  backward sends the forward's collectives transposed, on the gradients of x and of the routing
  weights `[N, k]`:
    replicate       forward: psum of `[N, E]`                          2 (EP-1)/EP N E
                    backward: psum of `[N, E + k]`
    dispatch        forward: two exchanges of n k rows, all-gather of `[N, E]`
                                                                       (2 k / EP + 1) (EP-1)/EP N E
                    backward: two exchanges, all-gather of `[N, E + k]`
    dispatch_dense  as dispatch, the exchanges all-to-alls at capacity n min(k, X/EP) per pair
  (+ the counts: an all-to-all of `[EP, X/EP]` int32, and of offsets `[EP]`). So dispatch sends
  fewer bytes than replicate exactly when EP > 2 k, whatever N and E."""
  EP = mesh_shape.get("expert", 1)
  if EP == 1:
    return {way: {"forward": 0.0, "backward": 0.0} for way in EXPERT_PARALLEL}
  N = tokens / (mesh_shape.get("data", 1) * mesh_shape.get("fsdp", 1))
  remote = (EP - 1) / EP
  n = N / EP
  rows = {"dispatch": remote * n * k, "dispatch_dense": (EP - 1) * n * min(k, num_experts // EP)}  # per exchange
  counts = remote * (num_experts + 2 * EP) * 4  # int32 counts and two offset exchanges
  out = {"replicate": {"forward": 2 * remote * N * embed * itemsize,
                       "backward": 2 * remote * N * (embed + k) * itemsize}}
  for way, r in rows.items():
    out[way] = {"forward": (2 * r * embed + remote * N * embed) * itemsize + counts,
                "backward": (2 * r * embed + remote * N * (embed + k)) * itemsize + counts}
  return out


def choose_expert_parallel(mesh_shape, tokens: int, k: int, embed: int, num_experts: int) -> str:
  """`grouped_swiglu`'s default way over a mesh of `mesh_shape` ({axis: size}) for x `[tokens, embed]`
  routed top-`k` over `num_experts`: the one of 'replicate' and 'dispatch' that sends fewer bytes
  (`expert_parallel_bytes`: dispatch where the expert axis EP > 2 k), 'replicate' when EP is 1 or does
  not divide each device group's tokens."""
  EP = mesh_shape.get("expert", 1)
  groups = mesh_shape.get("data", 1) * mesh_shape.get("fsdp", 1)
  if EP == 1 or tokens % (groups * EP):
    return "replicate"
  sent = expert_parallel_bytes(mesh_shape, tokens, k, embed, num_experts)
  return min(("replicate", "dispatch"), key=lambda way: sent[way]["forward"])


@flax.struct.dataclass
class ScaledExperts:
  """fp8 expert weights (`model.fp8`): values float8_e4m3fn `[X, K, *out]` and fp32 scales `[X, *out]`,
  one per (expert, output channel), standing for values * scale[:, None]. Accepted wherever
  `grouped_swiglu` takes an expert weight; a pytree, so a `shard_map` spec of the weight shards both
  over `expert`."""

  values: Array
  scale: Array

  @property
  def shape(self):
    return self.values.shape


def grouped_dot(rows: Array, w, sizes: Array, matmul=jax.lax.ragged_dot, reads_fp8: bool = False) -> Array:
  """rows `[R, K]` sorted by expert times each expert's w `[X, K, *out]`, `sizes` `[X]` rows per
  expert, by `matmul` (`(lhs [R, K], rhs [X, K, N], sizes) -> [R, N]`, `jax.lax.ragged_dot`'s
  contract; rows past their sum: zero) -> `[R, prod(out)]` in rows' dtype. An fp8 w (`ScaledExperts`) is
  weight-only fp8: its values cast to rows' dtype (exact) into the same matmul - or given as fp8 to a
  `matmul` that `reads_fp8` (the Pallas kernels widen each tile) -, the product times each row's
  expert's scales in fp32 (the expert of a sorted row read from `sizes`), then rounded."""
  dt, R = rows.dtype, rows.shape[0]
  X, K = w.shape[:2]
  if not isinstance(w, ScaledExperts):
    return matmul(rows, w.reshape(X, K, -1).astype(dt), sizes)
  values = w.values.reshape(X, K, -1)
  y = matmul(rows, values if reads_fp8 else values.astype(dt), sizes).astype(jnp.float32)
  expert = jnp.repeat(jnp.arange(X), sizes, total_repeat_length=R)  # [R]; rows past the groups: any expert
  return (y * jnp.take(w.scale.reshape(X, -1), expert, axis=0)).astype(dt)


GROUPED_GEMM_IMPLEMENTATIONS = GROUPED_GEMMS


def resolve_grouped_gemm(implementation: str = "auto", platform: str | None = None) -> str:
  """The experts' grouped matmul: 'ragged_dot' (`jax.lax.ragged_dot`) or 'pallas' (`grouped_gemm`: the
  tile kernels, Triton on a GPU, interpret mode on the CPU). 'auto' is 'pallas' on a GPU once
  `gpu_paths` records it as passed there (`moe_grouped_gemm`), else 'ragged_dot'; chosen by name either
  runs anywhere (opt-in). platform: a device platform, else the default backend's."""
  if implementation != "auto" and implementation not in GROUPED_GEMM_IMPLEMENTATIONS:
    raise ValueError(f"grouped_gemm must be 'auto' or one of {GROUPED_GEMM_IMPLEMENTATIONS}, got {implementation!r}")
  if implementation != "auto":
    return implementation
  from llamarl_jax import gpu_paths

  if (platform or jax.default_backend()) in ("gpu", "cuda"):
    return gpu_paths.gpu_default("moe_grouped_gemm", ("pallas",), "ragged_dot")
  return "ragged_dot"


def _grouped_matmul(implementation: str):
  """`(lhs [M, K], rhs [G, K, N], sizes [G]) -> [M, N]` of `implementation` (GROUPED_GEMM_IMPLEMENTATIONS)."""
  if implementation == "ragged_dot":
    return jax.lax.ragged_dot
  from llamarl_jax.model import grouped_gemm
  from llamarl_jax.model.paged_attention import interpret_kernels

  return functools.partial(grouped_gemm.grouped_gemm, interpret=interpret_kernels())


def _low_rank(y, rows, sizes, lora, name, matmul):
  """y plus LoRA's `scale * (rows @ a_x) @ b_x` of each row's expert x when `lora` adapts `name`
  (`grouped_swiglu`): two grouped matmuls (`matmul`, the experts' own) through `[R, r]`; else y."""
  if lora is None or name not in lora.weights:
    return y
  a, b = lora.weights[name]["a"], lora.weights[name]["b"]
  h = matmul(rows, a.astype(rows.dtype), sizes)  # [R, r]
  out = matmul(h, b.astype(rows.dtype), sizes) * jnp.asarray(lora.scale, rows.dtype)
  return y + out.astype(y.dtype)


def _expert_rows(rows, sizes, gate_up, w_down, grouped_gemm: str = "ragged_dot", lora=None):
  """SwiGLU of rows `[R, E]` sorted by expert, `sizes` `[X]` rows per expert (rows past their sum fall
  outside every group: zero output) -> `[R, E]`, by `grouped_gemm` (GROUPED_GEMM_IMPLEMENTATIONS, or
  'exact': `exact.grouped_dot` and `exact.swiglu`); lora: the experts' adapters (`grouped_swiglu`;
  unfused gate_up only)."""
  if grouped_gemm == "exact":
    if not isinstance(gate_up, (tuple, list)) or any(isinstance(w, ScaledExperts) for w in (*gate_up, w_down)):
      raise ValueError("grouped_gemm='exact' computes the unfused bf16/fp32 w_gate, w_up (a fused or fp8 matrix "
                       "is another computation)")
    h = exact_lib.swiglu(exact_lib.grouped_dot(rows, gate_up[0], sizes), exact_lib.grouped_dot(rows, gate_up[1], sizes))
    return exact_lib.grouped_dot(h, w_down, sizes)
  impl = resolve_grouped_gemm(grouped_gemm)
  matmul = functools.partial(grouped_dot, matmul=_grouped_matmul(impl), reads_fp8=impl == "pallas")
  if isinstance(gate_up, (tuple, list)):
    gate = _low_rank(matmul(rows, gate_up[0], sizes), rows, sizes, lora, "w_gate", matmul)
    up = _low_rank(matmul(rows, gate_up[1], sizes), rows, sizes, lora, "w_up", matmul)
  elif lora is not None:
    raise ValueError("LoRA of the experts needs the unfused w_gate, w_up; the serving layout's w_gate_up takes "
                     "merged weights (lora.merge_adapters)")
  else:
    F = gate_up.shape[-1]
    both = matmul(rows, gate_up, sizes)  # [R, 2F]: gate's F columns, then up's
    gate, up = both[:, :F], both[:, F:]
  h = jax.nn.silu(gate) * up
  return _low_rank(matmul(h, w_down, sizes), h, sizes, lora, "w_down", matmul)


def _local_swiglu(x, experts, weights, gate_up, w_down, first, grouped_gemm: str = "ragged_dot", lora=None):
  """`grouped_swiglu` over the experts `first .. first + X - 1` held here (X = w_down.shape[0]); the
  other experts' choices contribute 0."""
  N, k = experts.shape
  X = w_down.shape[0]
  local = (experts >= first) & (experts < first + X)
  flat = jnp.where(local, experts - first, X).reshape(-1)  # X: routed to another device, sorted last
  order = jnp.argsort(flat, stable=True)
  rows = jnp.take(x, order // k, axis=0)  # [N * k, E], sorted by expert
  sizes = jnp.bincount(flat, length=X + 1)[:X].astype(jnp.int32)
  out = _expert_rows(rows, sizes, gate_up, w_down, grouped_gemm, lora=lora)  # [N * k, E]
  out = jnp.zeros_like(out).at[order].set(out)  # back to (token, choice) order
  weights = jnp.where(local, weights, jnp.zeros((), weights.dtype))
  if grouped_gemm == "exact":  # each product rounded by itself, the k of a token summed in a fixed order
    out = out.reshape(N, k, -1).astype(jnp.float32)
    terms = exact_lib.product(out, weights[..., None].astype(jnp.float32), exact_lib.row_zero(out))
    return exact_lib.tree_sum(terms, axis=1).astype(x.dtype)
  return jnp.sum(out.reshape(N, k, -1) * weights[..., None], axis=1)


def _exclusive_cumsum(a):
  return jnp.cumsum(a) - a


def _dispatch_swiglu(x, experts, weights, gate_up, w_down, lora=None, *, ep: int, ragged: bool,
                     grouped_gemm: str = "ragged_dot"):
  """`grouped_swiglu` of this device's share of the tokens, x `[n, E]`, experts, weights `[n, k]`, by
  token dispatch over the `expert` axis (`ep` devices, this one holding the Xl = w_down.shape[0]
  experts `index * Xl ..`): the n * k rows sorted by expert (so by owner, then the owner's expert)
  go to their owners, each owner regroups what it received from all devices by its own experts, runs
  them, and sends every row back where it came from. ragged: `jax.lax.ragged_all_to_all` (each slice
  as long as its rows), else a dense `all_to_all` of the worst-case capacity (`_dense_all_to_all`)."""
  n, k = experts.shape
  Xl, E = w_down.shape[0], x.shape[1]
  cap = n * min(k, Xl)  # the most rows one device can send another: a token picks k distinct experts
  a2a = lambda a: jax.lax.all_to_all(a, "expert", 0, 0, tiled=True)
  exchange = jax.lax.ragged_all_to_all if ragged else functools.partial(_dense_all_to_all, capacity=cap)

  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)  # by owner, then by the owner's expert
  rows = jnp.take(x, order // k, axis=0)  # [n * k, E]
  counts = jnp.bincount(flat, length=ep * Xl).astype(jnp.int32).reshape(ep, Xl)  # sent, per (owner, its expert)
  send = jnp.sum(counts, axis=1)
  send_at = _exclusive_cumsum(send)
  got_counts = a2a(counts)  # [source, my expert]: the rows each device sends here
  recv = jnp.sum(got_counts, axis=1)
  recv_at = _exclusive_cumsum(recv)  # where each source's rows land here (source-major)
  got = exchange(rows, jnp.zeros((ep * cap, E), x.dtype), send_at, send, a2a(recv_at), recv, axis_name="expert")

  # received (source, my expert)-major -> (my expert, source)-major, the unused rows last
  seg = jnp.searchsorted(jnp.cumsum(got_counts.reshape(-1)), jnp.arange(ep * cap), side="right")
  src, mine = seg // Xl, seg % Xl
  regroup = jnp.argsort(jnp.where(seg < ep * Xl, mine * ep + src, ep * Xl), stable=True)
  out = _expert_rows(jnp.take(got, regroup, axis=0), jnp.sum(got_counts, axis=0), gate_up, w_down, grouped_gemm,
                     lora=lora)
  out = jnp.zeros_like(out).at[regroup].set(out)  # back to the received layout

  back = exchange(out, jnp.zeros((n * k, E), x.dtype), recv_at, recv, a2a(send_at), send, axis_name="expert")
  back = jnp.zeros_like(back).at[order].set(back)  # (token, choice) order
  return jnp.sum(back.reshape(n, k, E) * weights[..., None], axis=1)


def _dense_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name,
                      capacity: int):
  """`jax.lax.ragged_all_to_all`'s result (one slice per device of `axis_name`) by a dense `all_to_all`
  of `[devices, capacity, ...]`: every slice padded to `capacity` rows (at least the longest slice),
  so it moves `capacity` rows per pair of devices whatever the slices hold."""
  r = jnp.arange(capacity)
  take = jnp.clip(input_offsets[:, None] + r, 0, operand.shape[0] - 1)  # [devices, capacity]
  keep = (r < send_sizes[:, None]).reshape(*take.shape, *(1,) * (operand.ndim - 1))
  packed = jnp.where(keep, jnp.take(operand, take, axis=0), 0)
  packed = jax.lax.all_to_all(packed, axis_name, 0, 0, tiled=True)  # [source, capacity, ...]
  at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)[:, None] + r
  at = jnp.where(r < recv_sizes[:, None], at, output.shape[0])  # past the end: dropped
  return output.at[at.reshape(-1)].set(packed.reshape(-1, *operand.shape[1:]), mode="drop")


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
