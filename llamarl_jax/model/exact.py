"""Batch-invariant forms of the model's ops: the `exact_logprobs` switch's building blocks.

Each function here computes a row's result (a token's projection, norm, attention, log-prob) with
the same operations in the same order whatever the other rows are: how many (1, 7, 64, thousands),
their order, the padding, and whether the caller is the generator (prefill, then one token at a
time over a KV cache) or the trainer (the whole sequence at once, padded or packed rows). So the
generator's behaviour log-probs and the trainer's log-probs of the same tokens under the same
weights are equal bit for bit on XLA's CPU backend (jax 0.10.2 and 0.12, every compat flag set:
`tests/test_exact_ops.py`; the plain ops' differences and the costs: `scripts/probe_exact.py`).

What XLA:CPU does with the plain ops, and the form here that avoids it:
  - `x @ w` picks its kernel from the row count (a GEMV for one row, YNNPACK's small-M and large-M
    kernels, Eigen without YNNPACK), each summing K in its own order (fp32: up to 3e-6 apart at
    K = 1024). No XLA flag makes them agree (without YNNPACK, Eigen's K blocking differs from the
    GEMV's single pass for K > ~300). `dense` runs every row through one dot of a fixed shape, [ROW_TILE, K] @ [K, N],
    in a loop over tiles of rows. A column's result also depends on N and on its place among the
    columns (fp32: fused gate_up [E, 2F] != w_gate, w_up [E, F]), so both sides must hold the same
    weight layout.
  - a sum over the last axis (`jnp.sum`, `mean`, `logsumexp`, `softmax`) is vectorised differently
    for 1, 7 or 64 rows. `tree_sum` adds in a fixed pairwise order with elementwise adds, which XLA
    computes per element whatever the shape. A max is exact in any order and stays `jnp.max`.
  - bf16 arithmetic carries excess precision into the ops fused with it (`xla_allow_excess_precision`,
    on by default): a bf16 sum is rounded where it is stored and not where a fused consumer reads
    it. Here all arithmetic is fp32, rounded to the compute dtype by an explicit `astype`, which XLA
    always honours.
  - a multiply feeding an add in one fusion becomes an FMA (one rounding, not two), and what is fused
    differs between programs; a transpose feeding a dot is folded into the dot's dimensions (another
    kernel) where a loop of one trip is inlined. `opaque` (an integer xor with a zero no compiler
    can prove is zero) stores a value as computed: every product that an add reads (`product`), every
    exp that a sum reads, the dot's operands and result. (`optimization_barrier` does not do it: XLA
    removes it before fusion on 0.10.2; `--xla_cpu_max_isa=AVX` removes FMAs process-wide, not the rest.)
  - a mixture of experts' grouped matmul (`jax.lax.ragged_dot`) is one matmul over all rows whose
    kernel depends on the row count, like a dense one. `grouped_dot` pads each expert's rows to whole
    tiles (the tile plan of `grouped_gemm`) and runs one `[ROW_TILE, K] @ [K, N]` dot per tile against
    its expert's matrix; the router's `softmax` is a `tree_sum`'s.
Elementwise ops (exp, log, rsqrt, sin, cos, silu, division) give the same bits per element for any
shape or offset (measured).

Costs (`scripts/probe_exact.py` on a shared 2-core CPU, exact / plain, runs vary by ~2x): `dense`
1.0-2.6x at 64 to 2048 rows, fp32 or bf16 (often below 1 in bf16 on jax 0.10.2), 2-8x at one row
(a tile of 64 rows computed for one); `rms_norm`, `rope`, the log-probs 0.4-3x (microsecond ops);
decode attention 1-3x; full-sequence attention 5-16x XLA's (elementwise, no dot kernel). The
backward passes of `dense` and `attention` are the plain ops' (`jax.custom_vjp`); the elementwise
forms differentiate as they are.
"""

from __future__ import annotations

import contextvars
import functools
import math

import jax
import jax.numpy as jnp

Array = jax.Array

ROW_TILE = 64    # rows per dot in `dense`: every row of every call goes through a [ROW_TILE, K] @ [K, N] dot
# XLA options for the programs that run these ops: on a GPU, a GEMM sums K in one pass (no split-K,
# whose parts and reduce XLA picks per program); ignored on the CPU
COMPILER_OPTIONS = {"xla_gpu_experimental_force_split_k": 1}
KEY_BLOCK = 16   # keys per block in `attention`: blocks start at position 0 of each query's sequence
F32 = jnp.float32


# ----------------------------------------------------------------------------------------------------
# reductions


def row_zero(x: Array) -> Array:
  """int32 0 for each row of x `[..., D]` (shape `[..., 1]`) that XLA and LLVM cannot prove is 0: 1
  where the row's first element is NaN (a row whose result is NaN whatever is done with it)."""
  return jnp.isnan(x[..., :1]).astype(jnp.int32)


@jax.custom_jvp
def opaque(x: Array, zero: Array) -> Array:
  """x (a float array), computed where it stands: its bits xor `zero` (`row_zero`: 0, but not a
  constant), which no compiler sees through. So no consumer is fused into the op that made x in a
  way that changes its rounding (a multiply into an add's FMA, an add into a dot as its addend), and
  no transpose that made x is folded into a dot that reads it. Differentiated as the identity (the
  integer bitcast alone would give a zero gradient)."""
  bits = {2: jnp.int16, 4: jnp.int32}[x.dtype.itemsize]
  return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, bits) ^ zero.astype(bits), x.dtype)


@opaque.defjvp
def _opaque_jvp(primals, tangents):  # the identity's derivative (a bitcast through an integer has none)
  x, zero = primals
  return opaque(x, zero), tangents[0]


@jax.custom_jvp
def product(a: Array, b: Array, zero: Array) -> Array:
  """fp32 a * b rounded by itself, whatever reads it. XLA:CPU turns a multiply that feeds an add
  in the same fusion into an FMA (one rounding instead of two), and which multiplies share a
  fusion with their adds differs between programs (a decode step, a full sequence): the product's
  bits pass through an integer xor with `zero` (`row_zero`: 0, but not a constant), which no
  compiler folds into an FMA. zero: broadcastable to the product (the row it belongs to)."""
  return opaque((a * b).astype(F32), zero)


@product.defjvp
def _product_jvp(primals, tangents):  # the derivative of a * b (the xor is the identity)
  a, b, zero = primals
  da, db, _ = tangents
  return product(a, b, zero), (da * b + a * db).astype(F32)


def tree_sum(x: Array, axis: int = -1) -> Array:
  """Sum over `axis` in a fixed pairwise order: zero-pad the axis to a power of two n, add its first
  half to its second half elementwise until one element is left (element i pairs with i + n/2). The
  result for one row depends only on that row's values, whatever the shape of `x` or how XLA fuses
  it. x's dtype (use fp32); the axis is removed."""
  axis = axis % x.ndim
  n = x.shape[axis]
  size = 1 << max(0, (n - 1).bit_length())
  if size != n:
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - n)
    x = jnp.pad(x, pad)
  while size > 1:
    size //= 2
    x = jax.lax.slice_in_dim(x, 0, size, axis=axis) + jax.lax.slice_in_dim(x, size, 2 * size, axis=axis)
  return jnp.squeeze(x, axis)


def exp_sum(z: Array) -> Array:
  """sum(exp(z)) over the last axis in fp32, a `tree_sum` of the exps each stored first (`opaque`:
  the exp's last multiply is never fused into the sum's first add), `[..., V]` -> `[...]`."""
  e = jnp.exp(z)
  return tree_sum(opaque(e, row_zero(z)))


def _max_shift(x: Array) -> tuple[Array, Array]:
  """(m, x - m) for x `[..., V]`: m `[..., 1]` the last axis' max, 0 where that is not finite (a row
  of -inf stays -inf rather than NaN)."""
  m = jnp.max(x, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  return m, x - m


def logsumexp(x: Array) -> Array:
  """log(sum(exp(x))) over the last axis in fp32 (`exp_sum`), `[..., V]` -> `[...]`."""
  m, z = _max_shift(x.astype(F32))
  return m[..., 0] + jnp.log(exp_sum(z))


def temper(logits: Array, temperature: float | Array = 1.0) -> Array:
  """fp32 logits / temperature as logits * (1 / temperature), the reciprocal an fp32 division and the
  product stored (`opaque`: not fused into the max subtraction as an FMA): the same bits whether
  temperature is a Python float (folded when compiling) or a traced scalar."""
  inv = jnp.asarray(1.0, F32) / jnp.asarray(temperature, F32)
  x = logits.astype(F32) * inv
  return opaque(x, row_zero(x))


def token_logprob(logits: Array, tokens: Array, temperature: float | Array = 1.0) -> Array:
  """log_softmax(logits / temperature)[..., tokens] in fp32: logits `[..., V]`, tokens `[...]` int ->
  `[...]`. The one form of a token's log-prob that the sampler (logits of one step) and the trainer
  (logits of every position) both compute: with x = `temper(logits, temperature)`, (x[token] - max)
  - log(sum(exp(x - max))), the sum `exp_sum`'s."""
  _, z = _max_shift(temper(logits, temperature))
  picked = jnp.take_along_axis(z, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return picked - jnp.log(exp_sum(z))


def log_softmax(logits: Array) -> Array:
  """log_softmax over the last axis in fp32 (`token_logprob`'s arithmetic for every token)."""
  _, z = _max_shift(logits.astype(F32))
  return z - jnp.log(exp_sum(z))[..., None]


def softmax(logits: Array) -> Array:
  """softmax over the last axis in fp32: exp(x - max) / their `exp_sum` (a MoE router's probabilities)."""
  _, z = _max_shift(logits.astype(F32))
  e = opaque(jnp.exp(z), row_zero(z))
  return e / tree_sum(e)[..., None]


# ----------------------------------------------------------------------------------------------------
# elementwise ops with one rounding


def rms_norm(x: Array, scale: Array, eps: float) -> Array:
  """`layers.rms_norm` with the mean of squares a `tree_sum`: x `[..., D]`, scale `[D]`, the result in
  x's dtype. The normalised x is rounded to x's dtype before the scale, as the plain form does, and the
  product is computed in fp32 and rounded once (for bf16: the correctly rounded bf16 product)."""
  dt = x.dtype
  xf = x.astype(F32)
  ms = tree_sum(product(xf, xf, row_zero(xf))) / x.shape[-1]
  y = (xf * jax.lax.rsqrt(ms + eps)[..., None]).astype(dt).astype(F32)
  return (scale.astype(dt).astype(F32) * y).astype(dt)


def rope_cos_sin(positions: Array, inv_freq: Array, scale: float = 1.0) -> tuple[Array, Array]:
  """`attention.rope_cos_sin` with the angles rounded on their own (`opaque`): a multiply feeding
  cos / sin, whose range reduction subtracts a multiple of pi, would otherwise be fused into it as an
  FMA in some programs and not others. fp32 cos, sin `[*positions.shape, D]`, times `scale`."""
  angles = positions[..., None].astype(F32) * inv_freq
  angles = opaque(angles, row_zero(angles))
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def rope(x: Array, cos: Array, sin: Array) -> Array:
  """`paged_attention.rope_rotate` (rotate-half RoPE) in fp32 with one rounding to x's dtype: x `[..., D]`,
  cos, sin broadcastable to it (rounded to x's dtype first, as the plain form does)."""
  dt = x.dtype
  xf = x.astype(F32)
  x1, x2 = jnp.split(xf, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  c, s = cos.astype(dt).astype(F32), sin.astype(dt).astype(F32)
  zero = row_zero(xf)
  return (product(xf, c, zero) + product(rotated, s, zero)).astype(dt)


def swiglu(gate: Array, up: Array) -> Array:
  """silu(gate) * up in fp32, rounded once to gate's dtype."""
  g = gate.astype(F32)
  return (jax.nn.silu(g) * up.astype(F32)).astype(gate.dtype)


def add(x: Array, y: Array) -> Array:
  """x + y in fp32, rounded once to x's dtype (the residual stream): a bf16 add whose rounding no
  fused consumer skips."""
  return (x.astype(F32) + y.astype(F32)).astype(x.dtype)


# ----------------------------------------------------------------------------------------------------
# dense


# The mesh a program is traced for (`traced_on`): `dense` splits its rows over the mesh's batch axes
# itself, so that each device's dots keep their `[tile, K]` shape.
_MESH = contextvars.ContextVar("exact_mesh", default=None)


def traced_on(fn, mesh):
  """fn, whose traces see `mesh` as the mesh they run on (None: as fn is). Each program that runs the
  model on a mesh (the sampler's and the slot engine's, the trainer's steps) is jitted from this
  wrapper, so that `dense` knows the mesh when it is traced, however late that is.

  Why: left to XLA's SPMD partitioner, a dense over rows sharded on `data` or `fsdp` is split where
  the partitioner likes, e.g. a tile of 64 rows into two dots of 32, a kernel of another row count
  that sums K in another order (fp32: 1e-6 apart on the CPU). Under `traced_on` the dense is a
  `shard_map` over the batch axes: each device runs `[tile, K] @ [K, N]` dots over its own rows with
  the whole weight (gathered from its `fsdp` shards)."""
  if mesh is None:
    return fn

  @functools.wraps(fn)
  def traced(*args, **kwargs):
    token = _MESH.set(mesh)
    try:
      return fn(*args, **kwargs)
    finally:
      _MESH.reset(token)

  return traced


def tiled_dot(x2: Array, w2: Array, tile: int) -> Array:
  """x2 `[M, K]` @ w2 `[K, N]` -> fp32 `[M, N]` (`local_tiled_dot`), on the traced mesh
  (`traced_on`) a `shard_map` whose devices each run `local_tiled_dot` on their rows with the whole
  weight; where M does not split over the batch axes, every device computes every row (the same
  dots, so the same bits)."""
  mesh = _MESH.get()
  rows = () if mesh is None else tuple(a for a in ("data", "fsdp") if mesh.shape.get(a, 1) > 1)
  if not rows:
    return local_tiled_dot(x2, w2, tile)
  from jax.sharding import PartitionSpec as P

  spec = P(rows) if x2.shape[0] % math.prod(mesh.shape[a] for a in rows) == 0 else P()
  return jax.shard_map(functools.partial(local_tiled_dot, tile=tile), mesh=mesh, in_specs=(spec, P()),
                       out_specs=spec, axis_names=set(rows), check_vma=False)(x2, w2)


def local_tiled_dot(x2: Array, w2: Array, tile: int) -> Array:
  """x2 `[M, K]` @ w2 `[K, N]` -> fp32 `[M, N]`, one `[tile, K] @ [K, N]` dot per tile of rows
  (rows zero-padded to a multiple of `tile`): a loop over the tiles, so every row of every call
  runs through the same dot kernel whatever M is. Both operands and the product pass through
  `opaque`: the dot reads row-major arrays it cannot fold a transpose into (a tied lm_head's
  `embed.T`: XLA folds it into the dot's dimensions where the loop has one trip, and the kernel
  for a transposed operand sums in another order), and no consumer fuses into it."""
  M, K = x2.shape
  n = -(-M // tile)
  w_zero = jnp.isnan(w2[:1, :1]).astype(jnp.int32)
  w2 = opaque(w2, w_zero)
  xp = jnp.pad(x2, ((0, n * tile - M), (0, 0)))
  # the tile's zero also reads the weight: the tiles that two projections of the same x read are two
  # values, so XLA's GPU dot merger does not join their GEMMs into one of another N (wq|wk|wv)
  xp = opaque(xp, row_zero(xp) | w_zero).reshape(n, tile, K)

  def one(t):
    return opaque(jnp.matmul(t, w2, preferred_element_type=F32), row_zero(t))

  return jax.lax.map(one, xp).reshape(n * tile, -1)[:M]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dense2d(x2: Array, w2: Array, tile: int, out_dtype) -> Array:
  return tiled_dot(x2, w2, tile).astype(out_dtype)


def _dense2d_fwd(x2, w2, tile, out_dtype):
  return _dense2d(x2, w2, tile, out_dtype), (x2, w2)


def _dense2d_bwd(tile, out_dtype, res, g):
  x2, w2 = res
  g = g.astype(x2.dtype)
  return (jnp.matmul(g, w2.T, preferred_element_type=F32).astype(x2.dtype),
          jnp.matmul(x2.T, g, preferred_element_type=F32).astype(w2.dtype))


_dense2d.defvjp(_dense2d_fwd, _dense2d_bwd)


def dense(x: Array, w: Array, *, n_in: int = 1, out_dtype=None, tile: int = ROW_TILE) -> Array:
  """x `[..., *in]` @ w `[*in, *out]` -> `[..., *out]` (n_in: how many of w's leading axes x
  contracts), each row through the same `[tile, K] @ [K, N]` dot (K = prod(in), N = prod(out)),
  accumulated in fp32 and rounded to `out_dtype` (default x's). w is cast to x's dtype first, as
  `layers.dense` does. Covers every projection's einsum: 'bte,ehd->bthd' (wq, wk, wv),
  'bte,ekgd->btkgd' (wqkv), 'bte,egf->btgf' (w_gate_up), `o @ wo.reshape(H * D, E)` (n_in=2 on
  wo `[H, D, E]`), the lm_head (`out_dtype=float32`). The backward is the plain matmuls'."""
  in_shape, out_shape = w.shape[:n_in], w.shape[n_in:]
  if tuple(x.shape[x.ndim - n_in:]) != tuple(in_shape):
    raise ValueError(f"dense: x's last {n_in} axes {x.shape[x.ndim - n_in:]} must match w's leading "
                     f"axes {in_shape} (w {w.shape}, n_in={n_in})")
  batch = x.shape[:x.ndim - n_in]
  K, N = math.prod(in_shape), math.prod(out_shape)
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  x2 = x.reshape(math.prod(batch), K)
  y = _dense2d(x2, w.reshape(K, N).astype(x.dtype), tile, out_dtype)
  return y.reshape(*batch, *out_shape)


def traced_mesh():
  """The mesh the program being traced runs on (`traced_on`), or None."""
  return _MESH.get()


# ----------------------------------------------------------------------------------------------------
# grouped matmuls (a mixture of experts' experts)


def local_grouped_dot(rows: Array, w: Array, sizes: Array, tile: int = ROW_TILE) -> Array:
  """rows `[R, K]` sorted by group times each group's w `[G, K, N]` (`sizes` `[G]` rows per group;
  rows past their sum: zero) -> fp32 `[R, N]`, batch-invariant: each group's rows padded to a multiple
  of `tile` (`grouped_gemm.tile_plan`, so every tile belongs to one group), one `[tile, K] @ [K, N]` dot
  per tile against its group's matrix in a loop, as `local_tiled_dot` does for one matrix. A row's
  result depends on its values and its group's matrix only: not on the other rows, their groups' sizes
  or the row count. Computes each row once (plus each group's last partial tile)."""
  from llamarl_jax.model.grouped_gemm import tile_plan

  R, K = rows.shape
  G = w.shape[0]
  tile_group, _, _, dst, src = tile_plan(sizes, R, tile)
  w_zero = jnp.isnan(w[:1, :1, :1]).astype(jnp.int32)  # [1, 1, 1]
  w = opaque(w, w_zero)
  padded = jnp.take(rows, src, axis=0, mode="fill", fill_value=0)  # [T * tile, K], padding rows zero
  padded = opaque(padded, row_zero(padded) | w_zero[0]).reshape(-1, tile, K)

  def one(args):
    t, g = args
    wg = jax.lax.dynamic_index_in_dim(w, jnp.minimum(g, G - 1), keepdims=False)  # an unused tile's rows are 0
    return opaque(jnp.matmul(t, wg, preferred_element_type=F32), row_zero(t))

  out = jax.lax.map(one, (padded, tile_group)).reshape(padded.shape[0] * tile, -1)
  return jnp.take(out, dst, axis=0, mode="fill", fill_value=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped(rows: Array, w: Array, sizes: Array, tile: int, out_dtype) -> Array:
  return local_grouped_dot(rows, w, sizes, tile).astype(out_dtype)


def _grouped_fwd(rows, w, sizes, tile, out_dtype):
  return _grouped(rows, w, sizes, tile, out_dtype), (rows, w, sizes)


def _grouped_bwd(tile, out_dtype, res, g):
  rows, w, sizes = res
  _, vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, sizes, preferred_element_type=F32), rows, w)
  d_rows, d_w = vjp(g.astype(F32))
  return d_rows.astype(rows.dtype), d_w.astype(w.dtype), None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_dot(rows: Array, w: Array, sizes: Array, *, out_dtype=None, tile: int = ROW_TILE) -> Array:
  """`jax.lax.ragged_dot(rows, w, sizes)` (rows `[R, K]` sorted by group, w `[G, K, N]`, sizes `[G]`)
  in its batch-invariant form (`local_grouped_dot`), accumulated in fp32 and rounded to `out_dtype`
  (default rows'); w is cast to rows' dtype. Per device: a caller on a mesh runs it on each device's
  own rows (`moe.grouped_swiglu`'s shard_map). The backward is `ragged_dot`'s."""
  if rows.ndim != 2 or w.ndim != 3 or rows.shape[1] != w.shape[1] or sizes.shape != w.shape[:1]:
    raise ValueError(f"grouped_dot: expected rows [R, K], w [G, K, N], sizes [G]; got rows {rows.shape}, "
                     f"w {w.shape}, sizes {sizes.shape}")
  return _grouped(rows, w.astype(rows.dtype), sizes, tile, jnp.dtype(out_dtype or rows.dtype))


def lm_head_logprobs(hidden: Array, w: Array, tokens: Array, temperature: float | Array = 1.0) -> Array:
  """Log-probs of `tokens` under softmax(hidden @ w / temperature): hidden `[..., E]`, w `[E, V]`,
  tokens `[...]` -> fp32 `[...]`; the sampler's and the trainer's one computation (`dense` to fp32
  logits, then `token_logprob`)."""
  return token_logprob(dense(hidden, w, out_dtype=F32), tokens, temperature)


# ----------------------------------------------------------------------------------------------------
# attention


def _attend(q, k, v, lengths, starts, block, index=None):
  """The forward of `attention` (see there); with `index` `[B, L]` (`paged_attention`), k and v are
  pools `[N, KV, D]` and position p of row b's sequence is k[index[b, p]]."""
  B, T, H, D = q.shape
  L, KV = (k.shape[1], k.shape[2]) if index is None else (index.shape[1], k.shape[1])
  G = H // KV
  nb = -(-L // block)
  if nb * block != L and index is None:
    pad = ((0, 0), (0, nb * block - L), (0, 0), (0, 0))
    k, v = jnp.pad(k, pad), jnp.pad(v, pad)
  elif nb * block != L:
    index = jnp.pad(index, ((0, 0), (0, nb * block - L)))
  lengths = lengths.astype(jnp.int32)
  qg = q.astype(F32).reshape(B, T, KV, G, 1, D) * (1.0 / math.sqrt(D))
  zero = row_zero(qg)  # [B, T, KV, G, 1, 1]
  offsets = jnp.arange(block, dtype=jnp.int32)

  def keys(j):  # block j of each query's sequence: [B, T or 1, KV, 1, block, D] fp32
    if index is not None:
      at = jax.lax.dynamic_slice_in_dim(index, j * block, block, axis=1)  # [B, block]
      kb = jnp.take(k, at, axis=0, mode="clip")[:, None]  # [B, 1, block, KV, D]
      vb = jnp.take(v, at, axis=0, mode="clip")[:, None]
    elif starts is None:
      kb = jax.lax.dynamic_slice_in_dim(k, j * block, block, axis=1)[:, None]  # [B, 1, block, KV, D]
      vb = jax.lax.dynamic_slice_in_dim(v, j * block, block, axis=1)[:, None]
    else:
      idx = starts[..., None].astype(jnp.int32) + j * block + offsets  # [B, T, block]
      gather = jax.vmap(lambda a, i: jnp.take(a, i, axis=0, mode="clip"))
      kb, vb = gather(k, idx), gather(v, idx)  # [B, T, block, KV, D]
    to = lambda a: jnp.swapaxes(a, 2, 3)[:, :, :, None].astype(F32)  # [B, T', KV, 1, block, D]
    return to(kb), to(vb)

  def step(j, carry):
    m, l, o = carry  # [B, T, KV, G], [B, T, KV, G], [B, T, KV, G, D]
    kb, vb = keys(j)
    valid = (j * block + offsets < lengths[..., None])[:, :, None, None, :]  # [B, T, 1, 1, block]
    s = jnp.where(valid, tree_sum(product(qg, kb, zero)), -jnp.inf)  # [B, T, KV, G, block]
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_use = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    alpha = jnp.exp(m - m_use)  # 1 exactly where the block adds nothing; 0 before the first key
    p = jnp.where(valid, opaque(jnp.exp(s - m_use[..., None]), zero[..., 0]), 0.0)
    l = product(l, alpha, zero[..., 0, 0]) + tree_sum(p)
    o = product(o, alpha[..., None], zero[..., 0, :]) + tree_sum(product(p[..., None], vb, zero), axis=-2)
    return m_new, l, o

  live = (jnp.max(lengths) + block - 1) // block  # blocks past every query's length change nothing: skipped
  init = (jnp.full((B, T, KV, G), -jnp.inf, F32), jnp.zeros((B, T, KV, G), F32), jnp.zeros((B, T, KV, G, D), F32))
  _, l, o = jax.lax.fori_loop(0, jnp.minimum(live, nb), step, init)
  out = jnp.where(l[..., None] > 0, o / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
  return out.reshape(B, T, H, D).astype(q.dtype)


def attention_reference(q: Array, k: Array, v: Array, lengths: Array, starts: Array | None = None) -> Array:
  """`attention`'s math the plain way (one masked softmax in fp32; tests, and `attention`'s backward)."""
  B, T, H, D = q.shape
  L, KV = k.shape[1], k.shape[2]
  G = H // KV
  qg = q.astype(F32).reshape(B, T, KV, G, D) / math.sqrt(D)
  scores = jnp.einsum("btkgd,bskd->btkgs", qg, k.astype(F32))
  first = jnp.zeros((B, T), jnp.int32) if starts is None else starts.astype(jnp.int32)
  pos = jnp.arange(L)[None, None, :]
  valid = (pos >= first[..., None]) & (pos < first[..., None] + lengths[..., None])  # [B, T, L]
  scores = jnp.where(valid[:, :, None, None, :], scores, -jnp.inf)
  probs = jnp.where(valid[:, :, None, None, :], jax.nn.softmax(scores, axis=-1), 0.0)
  out = jnp.einsum("btkgs,bskd->btkgd", probs, v.astype(F32))
  return out.reshape(B, T, H, D).astype(q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, lengths, starts, block):
  return _attend(q, k, v, lengths, starts, block)


def _attention_fwd(q, k, v, lengths, starts, block):
  return _attend(q, k, v, lengths, starts, block), (q, k, v, lengths, starts)


def _attention_bwd(block, res, g):
  q, k, v, lengths, starts = res
  _, vjp = jax.vjp(lambda q, k, v: attention_reference(q, k, v, lengths, starts), q, k, v)
  return (*vjp(g), None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q: Array, k: Array, v: Array, lengths: Array, starts: Array | None = None, *,
              block: int = KEY_BLOCK) -> Array:
  """Attention of each query over its own sequence's first `lengths` keys, batch-invariant.

  q `[B, T, H, D]`; k, v `[B, L, KV, D]` (row b's keys and values); lengths `[B, T]` int: query (b, t)
  attends the keys at positions 0 .. lengths[b, t] - 1 of its sequence; starts `[B, T]` int or None:
  where that sequence begins in row b of k, v (None: at 0). Returns `[B, T, H, D]` in q's dtype.

    trainer, padded rows       lengths = t + 1, starts None
    trainer, packed rows       lengths = positions + 1, starts = t - positions (`llama.Segments`)
    prefill from position 0    lengths = t + 1 over the prompt's own keys
    decode over a KV cache     T = 1, lengths = the row's cache length (the new token included);
                               a left-padded cache: starts = the row's first real slot

  The keys are visited in blocks of `block` positions of the sequence (block j: positions j * block ..
  (j + 1) * block - 1), in order, with an fp32 online softmax: per block the scores are `tree_sum`s of
  q * k over D, the running max is updated, the block's exp(s - max) and their weighted values are
  `tree_sum`s over the block's positions (positions past the query's length add exact zeros), and the
  running sum and output are rescaled by exp(old max - new max), which is exactly 1 when a block adds
  nothing. So a query's result depends on its q and its own keys only: not on the other queries, nor
  on keys past its length, nor on how far the cache or the row extends. Blocks past every query's
  length are not visited. A query with no keys gets zeros. The backward is `attention_reference`'s.
  """
  B, T = q.shape[:2]
  if lengths.shape != (B, T):
    raise ValueError(f"attention: lengths must be [batch, queries] = {(B, T)}, got {lengths.shape}")
  if starts is not None and starts.shape != (B, T):
    raise ValueError(f"attention: starts must be [batch, queries] = {(B, T)} or None, got {starts.shape}")
  if q.shape[2] % k.shape[2]:
    raise ValueError(f"attention: query heads {q.shape[2]} must be a multiple of key heads {k.shape[2]}")
  return _attention(q, k, v, lengths, starts, block)


def paged_attention(q: Array, k_pool: Array, v_pool: Array, index: Array, lengths: Array, *,
                    block: int = KEY_BLOCK) -> Array:
  """`attention` of one query per row over a paged cache, reading each row's positions where they lie:
  q `[B, 1, H, D]`; k_pool, v_pool `[NB, bs, KV, D]`; index `[B, L]` int: the pool slot (block * bs +
  offset) of position p of row b's sequence (any layout: the slot engine's prompt region, then its
  response blocks; entries past the length are never read and may point anywhere); lengths `[B]`:
  the row's cache length, the new token included. The attention blocks are `block` positions of the
  sequence, as in `attention` (the pool's block size does not matter): the same result, bit for bit,
  as `attention` over the row's positions gathered into one array, and as the trainer's full
  sequence. Forward only (the generator)."""
  B = q.shape[0]
  NB, bs, KV, D = k_pool.shape
  if q.shape[1] != 1 or lengths.shape != (B,) or index.shape[0] != B:
    raise ValueError(f"paged_attention: q [B, 1, H, D], index [B, L], lengths [B]; got q {q.shape}, "
                     f"index {index.shape}, lengths {lengths.shape}")
  return _attend(q, k_pool.reshape(NB * bs, KV, D), v_pool.reshape(NB * bs, KV, D), lengths.reshape(B, 1), None,
                 block, index.astype(jnp.int32))
