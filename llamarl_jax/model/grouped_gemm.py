"""Grouped GEMM for MoE experts: rows sorted by group, each group's rows times its own matrix, as one
Pallas kernel (GPU: Triton) per product, with its gradient by two more (`jax.custom_vjp`).

`grouped_gemm(lhs [M, K], rhs [G, K, N], sizes [G])` is `jax.lax.ragged_dot`'s product: rows
`start_g .. start_g + sizes_g - 1` times `rhs[g]` (rows past `sum(sizes)` fall outside every group:
zero output). Compiled for an H100, jax 0.10's `ragged_dot` is one dense GEMM over all groups with a
masked `[M, G * K]` operand (G times the routed FLOPs); this computes each row once per product.

Tile plan (on the device, no host round trip): each group's rows are padded to a multiple of the row
tile `block_m`, so every tile of the padded rows `[P, K]` belongs to one group; `P = T * block_m` with
`T = cdiv(M, block_m) + G - 1` tiles, the most any `sizes` summing to at most M can use (a group adds at
most one partial tile). Tiles past the last used one write zeros and multiply nothing. The kernels:
  forward   grid (T, N / block_n): tile t's `[block_m, K]` rows times its group's `[K, block_n]`;
  d lhs     the same kernel on the cotangent against the transposed matrices (grid (T, K / block_n));
  d rhs     grid (G, K / block_k, N / block_n): `sum over the group's tiles rows^T @ cotangent`.
Each accumulates in fp32 and rounds once to the operands' dtype (as `ragged_dot` on a GPU). The
padding is two gathers of XLA's (rows into the padded layout `[P, K]`, the output back to `[M, N]`);
their transposes carry the gradients. `kernel_flops` counts the kernels' FLOPs from their grids (XLA's
cost analysis does not see inside a Pallas call): at most `T * block_m / M` times the routed FLOPs,
1.25x at Qwen3-30B-A3B's 32768 rows of 128 experts with 64-row tiles.

`interpret=True` runs the kernels in Pallas' TPU interpreter (`compat.pallas_interpreter`: JAX ops on any
backend, also inside a shard_map; the CPU tests compare with ragged_dot). Inside a shard_map every
operand is made to vary over the same mesh axes (`jax.lax.pcast`), so a replicated matrix's gradient
is summed over the devices' rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from llamarl_jax import compat

Array = jax.Array

BLOCK_M, BLOCK_N, BLOCK_K = 64, 128, 64  # row tile, output column tile, contraction step
NAME = "grouped_gemm"  # the kernels' names start with it (`kernel_flops_in_hlo` finds them)


def num_tiles(rows: int, groups: int, block_m: int = BLOCK_M) -> int:
  """T: the row tiles any `sizes` `[groups]` summing to at most `rows` can need (each group's rows padded
  to a multiple of `block_m`)."""
  return pl.cdiv(rows, block_m) + groups - 1


def tile_plan(sizes: Array, rows: int, block_m: int = BLOCK_M):
  """The padded layout of `rows` rows in groups of `sizes` `[G]` ->
  (tile_group `[T]` int32: each tile's group, G past the last used tile; tile_first, tile_count `[G]`
  int32: each group's first tile and tile count; dst `[rows]` int32: each row's padded row, P for rows
  past `sum(sizes)`; src `[P]` int32: each padded row's row, `rows` for padding)."""
  G = sizes.shape[0]
  T = num_tiles(rows, G, block_m)
  P = T * block_m
  sizes = sizes.astype(jnp.int32)
  tile_count = (sizes + block_m - 1) // block_m
  tile_end = jnp.cumsum(tile_count)
  tile_first = tile_end - tile_count
  # searchsorted(side='right') as a count of the ends at or before each index: inside a shard_map whose
  # sizes vary over a mesh axis, jnp.searchsorted's primitive fails to trace (jax 0.10.2)
  after = lambda ends, n: jnp.sum(ends[None, :] <= jnp.arange(n, dtype=jnp.int32)[:, None], axis=1, dtype=jnp.int32)
  tile_group = after(tile_end, T)
  ends = jnp.cumsum(sizes)
  m = jnp.arange(rows, dtype=jnp.int32)
  g = after(ends, rows)
  gc = jnp.minimum(g, G - 1)
  dst = jnp.where(g < G, tile_first[gc] * block_m + m - (ends[gc] - sizes[gc]), P).astype(jnp.int32)
  src = jnp.full((P,), rows, jnp.int32).at[dst].set(m, mode="drop")
  return tile_group, tile_first.astype(jnp.int32), tile_count.astype(jnp.int32), dst, src


def _fit(dim: int, block: int) -> int:
  """The largest power of two <= block dividing dim."""
  while block > 1 and dim % block:
    block //= 2
  return block


def _tiles_kernel(group_ref, lhs_ref, rhs_ref, out_ref, *, groups: int, block_k: int, transpose: bool):
  """One (row tile, column tile): group_ref [] the tile's group (`groups`: unused tile, zeros);
  lhs_ref [block_m, K]; rhs_ref [G, K, block_n] ([G, block_n, K] when `transpose`); out_ref
  [block_m, block_n] = lhs @ rhs[group] (@ rhs[group]^T), accumulated in fp32."""
  g = group_ref[...]
  K = lhs_ref.shape[1]

  @pl.when(g < groups)
  def _():
    def body(i, acc):
      k0 = pl.multiple_of(i * block_k, block_k)
      a = lhs_ref[:, pl.ds(k0, block_k)]
      if transpose:
        w = rhs_ref[g, :, pl.ds(k0, block_k)]  # [block_n, block_k]
        dims = (((1,), (1,)), ((), ()))
      else:
        w = rhs_ref[g, pl.ds(k0, block_k), :]  # [block_k, block_n]
        dims = (((1,), (0,)), ((), ()))
      w = w.astype(a.dtype)  # an fp8 matrix is read as fp8 and widened here, tile by tile (exact)
      return acc + jax.lax.dot_general(a, w, dims, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, K // block_k, body, jnp.zeros(out_ref.shape, jnp.float32))
    out_ref[...] = acc.astype(out_ref.dtype)

  @pl.when(g >= groups)
  def _():
    out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)


def _params(interpret: bool, num_warps: int):
  return None if interpret else compat.pallas_triton_compiler_params(num_warps=num_warps, num_stages=3)


def _tiles_gemm(lhs_p, rhs, tile_group, *, transpose: bool, block_m: int, block_n: int, block_k: int,
                interpret: bool):
  """lhs_p `[P, K]` (padded layout) times each tile's group's matrix: rhs `[G, K, N]` -> `[P, N]`, or
  with `transpose` rhs `[G, N, K]` (its transpose) -> `[P, N]`."""
  P, K = lhs_p.shape
  G = rhs.shape[0]
  N = rhs.shape[1] if transpose else rhs.shape[2]
  bn, bk = _fit(N, block_n), _fit(K, block_k)
  T = P // block_m
  w_spec = (pl.BlockSpec((G, bn, K), lambda t, j: (0, j, 0)) if transpose
            else pl.BlockSpec((G, K, bn), lambda t, j: (0, 0, j)))
  return pl.pallas_call(
      functools.partial(_tiles_kernel, groups=G, block_k=bk, transpose=transpose),
      grid=(T, N // bn),
      in_specs=[pl.BlockSpec((None,), lambda t, j: (t,)), pl.BlockSpec((block_m, K), lambda t, j: (t, 0)), w_spec],
      out_specs=pl.BlockSpec((block_m, bn), lambda t, j: (t, j)),
      out_shape=compat.varying_struct((P, N), lhs_p.dtype, lhs_p),
      interpret=compat.pallas_interpreter() if interpret else False, compiler_params=_params(interpret, 4),
      name=f"{NAME}_{'t' if transpose else 'n'}_{T}x{block_m}x{K}x{N}",
  )(tile_group, lhs_p, rhs)


def _weights_kernel(first_ref, count_ref, lhs_ref, dout_ref, out_ref, *, block_m: int):
  """One (group, K tile, N tile): first_ref, count_ref [] the group's tiles; lhs_ref [P, block_k],
  dout_ref [P, block_n] (padded layout, padding rows zero); out_ref [block_k, block_n] = sum over the
  group's tiles of lhs^T @ dout, accumulated in fp32 (a group with no rows: zeros)."""
  first = first_ref[...]

  def body(t, acc):
    r0 = pl.multiple_of(t * block_m, block_m)
    a = lhs_ref[pl.ds(r0, block_m), :]
    b = dout_ref[pl.ds(r0, block_m), :]
    return acc + jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)

  acc = jax.lax.fori_loop(first, first + count_ref[...], body, jnp.zeros(out_ref.shape, jnp.float32))
  out_ref[...] = acc.astype(out_ref.dtype)


def _weights_gemm(lhs_p, dout_p, tile_first, tile_count, dtype, *, block_m: int, block_n: int, block_k: int,
                  interpret: bool):
  """Each group's `lhs_p^T @ dout_p` over its tiles: lhs_p `[P, K]`, dout_p `[P, N]` -> `[G, K, N]`."""
  P, K = lhs_p.shape
  N = dout_p.shape[1]
  G = tile_first.shape[0]
  bk, bn = _fit(K, block_k), _fit(N, block_n)
  group = pl.BlockSpec((None,), lambda g, i, j: (g,))
  return pl.pallas_call(
      functools.partial(_weights_kernel, block_m=block_m),
      grid=(G, K // bk, N // bn),
      in_specs=[group, group, pl.BlockSpec((P, bk), lambda g, i, j: (0, i)),
                pl.BlockSpec((P, bn), lambda g, i, j: (0, j))],
      out_specs=pl.BlockSpec((None, bk, bn), lambda g, i, j: (g, i, j)),
      out_shape=compat.varying_struct((G, K, N), dtype, lhs_p),
      interpret=compat.pallas_interpreter() if interpret else False, compiler_params=_params(interpret, 4),
      name=f"{NAME}_w_{P // block_m}x{block_m}x{K}x{N}",
  )(tile_first, tile_count, lhs_p, dout_p)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _padded_gemm(lhs_p, rhs, tile_group, tile_first, tile_count, static):
  block_m, block_n, block_k, interpret = static
  return _tiles_gemm(lhs_p, rhs, tile_group, transpose=False, block_m=block_m, block_n=block_n, block_k=block_k,
                     interpret=interpret)


def _padded_fwd(lhs_p, rhs, tile_group, tile_first, tile_count, static):
  out = _padded_gemm(lhs_p, rhs, tile_group, tile_first, tile_count, static)
  return out, (lhs_p, rhs, tile_group, tile_first, tile_count)


def _padded_bwd(static, res, dout_p):
  block_m, block_n, block_k, interpret = static
  lhs_p, rhs, tile_group, tile_first, tile_count = res
  d_lhs = _tiles_gemm(dout_p, rhs, tile_group, transpose=True, block_m=block_m, block_n=block_n,
                      block_k=block_k, interpret=interpret)
  d_rhs = _weights_gemm(lhs_p, dout_p, tile_first, tile_count, rhs.dtype, block_m=block_m, block_n=block_n,
                        block_k=block_k, interpret=interpret)
  return d_lhs.astype(lhs_p.dtype), d_rhs, None, None, None


_padded_gemm.defvjp(_padded_fwd, _padded_bwd)


def grouped_gemm(lhs: Array, rhs: Array, group_sizes: Array, *, block_m: int = BLOCK_M, block_n: int = BLOCK_N,
                 block_k: int = BLOCK_K, interpret: bool = False) -> Array:
  """`jax.lax.ragged_dot(lhs, rhs, group_sizes)` by the tile kernels (module docstring).

  lhs `[M, K]` sorted by group; rhs `[G, K, N]` (lhs's dtype); group_sizes `[G]` int, summing to at
  most M -> `[M, N]` in lhs's dtype. Differentiable in lhs and rhs. An fp8 rhs (float8_e4m3fn: the
  generator's weight-only fp8 experts) is read as fp8 by the kernel, each tile widened to lhs's dtype
  before its product (exact), so the matrices' bytes are fp8's; forward only (nothing trains fp8)."""
  if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1] or group_sizes.shape != rhs.shape[:1]:
    raise ValueError(f"grouped_gemm: expected lhs [M, K], rhs [G, K, N], group_sizes [G]; got lhs {lhs.shape}, "
                     f"rhs {rhs.shape}, group_sizes {group_sizes.shape}")
  fp8 = rhs.dtype == jnp.float8_e4m3fn
  if lhs.dtype != rhs.dtype and not fp8:
    raise ValueError(f"grouped_gemm: lhs is {lhs.dtype}, rhs {rhs.dtype}: cast rhs to lhs's dtype first "
                     "(or give float8_e4m3fn, read as fp8)")
  M = lhs.shape[0]
  tile_group, tile_first, tile_count, dst, src = tile_plan(group_sizes, M, block_m)
  lhs_p = jnp.take(lhs, src, axis=0, mode="fill", fill_value=0)  # [P, K], padding rows zero
  # inside a shard_map: every operand varying over every mesh axis any of them does, so the kernels'
  # operands and outputs agree (rhs's cotangent is then summed over the axes added here: pcast's transpose)
  operands = (lhs_p, rhs, tile_group, tile_first, tile_count)
  axes = frozenset().union(*map(compat.varying_axes, operands))
  operands = [x if axes <= compat.varying_axes(x) else
              jax.lax.pcast(x, tuple(sorted(axes - compat.varying_axes(x))), to="varying") for x in operands]
  static = (block_m, block_n, block_k, interpret)
  if fp8:  # no gradient: the forward kernel alone (a custom_vjp's would need an fp8 cotangent)
    out_p = _tiles_gemm(*operands[:3], transpose=False, block_m=block_m, block_n=block_n, block_k=block_k,
                        interpret=interpret)
  else:
    out_p = _padded_gemm(*operands, static)
  return jnp.take(out_p, dst, axis=0, mode="fill", fill_value=0)  # [M, N]


def kernel_flops(rows: int, groups: int, k: int, n: int, block_m: int = BLOCK_M) -> dict[str, int]:
  """FLOPs of one `grouped_gemm` of lhs `[rows, k]` by rhs `[groups, k, n]`, from the kernels' grids (each
  of the T row tiles a `[block_m, k] @ [k, n]`, used or not): {'forward', 'backward'} (d lhs and d rhs:
  two of the forward's each). `ragged_dot`'s routed FLOPs are `2 rows k n` per product."""
  flops = 2 * num_tiles(rows, groups, block_m) * block_m * k * n
  return {"forward": flops, "backward": 2 * flops}


def kernel_flops_in_hlo(hlo_text: str) -> int:
  """The FLOPs of every grouped-GEMM kernel launched by a compiled program (its optimized HLO text, a
  GPU's: one Triton custom call per launch, named `{NAME}_{n|t|w}_{T}x{block_m}x{K}x{N}` by its grid,
  2 T block_m K N FLOPs each; a `lax.scan`'s body counted once)."""
  import re

  total = 0
  for line in hlo_text.splitlines():
    if " custom-call(" not in line or "xla.gpu.triton" not in line:
      continue
    found = re.search(rf'name = "{NAME}_[ntw]_(\d+)x(\d+)x(\d+)x(\d+)"', line)
    if found:
      t, bm, k, n = map(int, found.groups())
      total += 2 * t * bm * k * n
  return total
