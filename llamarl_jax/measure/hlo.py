"""Bytes and kernels of compiled programs: what a decode step must move at least (`ideal_step_bytes`),
what XLA's cost analysis charges a compiled program and how to correct it (`compiled_bytes_accessed`,
`fused_index_overcount`, `library_call_bytes`, `pallas_call_bytes`), the kernels it launches
(`kernel_counts`) and what its collectives send (`collectives`), read from the optimised HLO text. Measurement only: benchmarks, tests and
`scripts/gpu_check.py` use it, no runtime module imports it.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from llamarl_jax import compat
from llamarl_jax.model.config import ModelConfig


def ideal_step_bytes(config: ModelConfig, live_lengths, dtype=None, params=None) -> dict[str, float]:
  """Bytes one decode step must move at least: every weight read once (all matmul weights and the
  lm_head; the embedding table is only gathered: one row per token, not counted) plus each row's
  live keys and values (live positions x layers x 2 x KV x D). params: the step's parameter tree
  (arrays or avals; e.g. fp8 projections with their scales, an fp8 lm_head: with tied embeddings the
  table is then not read as the lm_head), its bytes counted as they are; default the config's
  parameter count in `dtype`. Returns {'weights', 'kv', 'total'}."""
  itemsize = jnp.dtype(dtype or config.dtype).itemsize
  c = config
  weights = (c.num_params() - c.vocab_size * c.hidden_size) * itemsize
  if params is not None:
    weights = sum(x.size * jnp.dtype(x.dtype).itemsize for k, v in params.items() if k != "embed"
                  for x in jax.tree.leaves(v))
  if c.tie_word_embeddings and (params is None or "lm_head" not in params):  # the tied table read as the lm_head
    weights += c.vocab_size * c.hidden_size * (itemsize if params is None else jnp.dtype(params["embed"].dtype).itemsize)
  live = float(np.sum(np.asarray(live_lengths, np.int64)))
  kv = live * c.num_layers * 2 * c.num_kv_heads * c.head_dim * itemsize
  return {"weights": float(weights), "kv": kv, "total": float(weights + kv)}


# -- what XLA's cost analysis charges a fused gather ---------------------------------------------------

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"^([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%([^\s=]+) = (\([^=]*?\)|\S+) ([a-z][a-z0-9-]*)\(([^)]*)\)(.*)$")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%([^\s(]+) ")


def _array_bytes(shape: str) -> int:
  m = _SHAPE.match(shape)
  if not m or m.group(1) not in _DTYPE_BYTES:
    return 0
  return _DTYPE_BYTES[m.group(1)] * int(np.prod([int(d) for d in m.group(2).split(",") if d] or [1]))


def generic_cost_analysis(compiled) -> dict[str, float] | None:
  """XLA's generic `HloCostAnalysis` (the CPU backend's: "flops", "bytes accessed", ...) over the optimized
  module of a compiled program (`jax.stages.Compiled`), whichever the target it was compiled for: the CPU,
  a GPU, or a GPU compiled for without one (`jax.experimental.topologies`, whose executable has no cost
  analysis of its own). None where the CPU backend is not available (JAX_PLATFORMS=cuda). JAX has no
  public entry to the generic analysis: `compat.hlo_cost_analysis` reaches it."""
  return compat.hlo_cost_analysis(compiled)


def compiled_bytes_accessed(compiled) -> tuple[float, bool]:
  """XLA's 'bytes accessed' of a compiled program (`jax.stages.Compiled`), and whether it is the
  generic analysis's (`generic_cost_analysis`: the target's fusions, i.e. its kernels, each charged what
  it reads and writes; `fused_index_overcount` corrects it). Where that is not available, the program's
  own backend's analysis, uncorrected.
  """
  generic = generic_cost_analysis(compiled)
  if generic is not None:
    return float(generic["bytes accessed"]), True
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
  return float(cost["bytes accessed"]), False


def fused_index_overcount(hlo_text: str) -> int:
  """Bytes XLA's generic `HloCostAnalysis` charges fused gathers and scatters beyond what they touch,
  in a compiled module's text (`compiled.as_text()`, any backend's optimized HLO).

  A gather reads its output's worth of its operand and an in-place scatter reads and writes its
  updates' worth (`HloCostAnalysis::HandleGather` / `HandleScatter` count exactly that for unfused
  ones, and the GPU's own analysis scales a fused operand by its utilization), but the generic
  analysis, which the CPU uses, charges a fusion parameter consumed only by gathers or as a
  scatter's target its whole size (`FusionParameterReadBytes` special-cases slices and dynamic
  slices, not these), and a fusion whose root is a scatter its whole output as written. For the
  paged decode step that is the whole KV pool per layer for k and v, twice for the token's write:
  the cache maximum the pages exist to avoid reading. Returns the sum over fusions of: for each
  parameter consumed only by gathers (as their operand), its bytes minus the gathered bytes; for
  each parameter consumed only as the target of scatters, its bytes minus the updates' bytes; for a
  root scatter (or a tuple of them), its output bytes minus its updates' bytes.
  """
  comps = _parse_hlo(hlo_text)
  fused = [m.group(1) for body in comps.values() for _, op, _, _, rest in body.values() if op == "fusion"
           for m in [re.search(r"calls=%([^\s,]+)", rest)] if m]  # computations called by fusions
  over = 0
  for called in fused:
    body = comps.get(called, {})
    size = lambda name: _array_bytes(body[name][0]) if name in body else 0
    for pname, (pshape, opcode, _, _, _) in body.items():
      if opcode != "parameter":
        continue
      users = [(shape, op, ops) for shape, op, ops, _, _ in body.values() if op != "parameter" and pname in ops]
      if not users:
        continue
      if all(op == "gather" and ops[0] == pname and pname not in ops[1:] for _, op, ops in users):
        over += _array_bytes(pshape) - sum(_array_bytes(shape) for shape, _, _ in users)
      elif all(op == "scatter" and ops[0] == pname and pname not in ops[1:] for _, op, ops in users):
        over += _array_bytes(pshape) - sum(size(ops[-1]) for _, _, ops in users)
    for shape, op, ops, root, _ in body.values():
      if not root:
        continue
      roots = [body[o] for o in ops if o in body] if op == "tuple" else [(shape, op, ops, root, "")]
      for rshape, rop, rops, _, _ in roots:
        if rop == "scatter" and rops and body.get(rops[0], ("", ""))[1] == "parameter":
          over += _array_bytes(rshape) - size(rops[-1])
  return max(over, 0)


LIBRARY_CALLS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")


def library_call_bytes(hlo_text: str, targets: tuple[str, ...] = LIBRARY_CALLS) -> int:
  """Bytes of the library calls in a compiled module's text that XLA's generic `HloCostAnalysis`
  charges nothing (a custom call is opaque to it): each call's operands plus its result (of a tuple
  result, the first element; the rest is the library's scratch workspace). For cuBLAS GEMMs (a GPU
  compiled with XLA's Triton GEMMs turned off, or where the autotuner picks cuBLAS) that is
  the weight matrix, the activations and the output: what the GEMM must move at least."""
  total = 0
  for body in _parse_hlo(hlo_text).values():
    for shape, op, ops, _, rest in body.values():
      if op != "custom-call" or not any(f'custom_call_target="{t}"' in rest for t in targets):
        continue
      total += _array_bytes(shape.lstrip("(")) + sum(_array_bytes(body[o][0]) for o in ops if o in body)
  return total


def pallas_call_bytes(hlo_text: str, names: tuple[str, ...]) -> int:
  """Bytes of the Pallas (Triton) calls in a compiled module's text whose kernel is named one of
  `names` (`pallas_call(name=...)`), which XLA's generic `HloCostAnalysis` charges nothing: each
  call's operands plus its results, what a kernel that reads each input once and writes each output
  once moves (the fp8 activation kernels, `fp8_kernels`; not the paged attention kernel, which reads
  only the live blocks of its pools: `paged_kernel.kernel_bytes`)."""
  total = 0
  for body in _parse_hlo(hlo_text).values():
    for shape, op, ops, _, rest in body.values():
      if op != "custom-call" or 'custom_call_target="__gpu$xla.gpu.triton"' not in rest:
        continue
      name = re.search(r'name = "([^"]+)"', rest)
      if not name or name.group(1) not in names:
        continue
      results = sum(_array_bytes(f"{d}[{dims}]") for d, dims in re.findall(r"([a-z][a-z0-9]*)\[([0-9,]*)\]", shape))
      total += results + sum(_array_bytes(body[o][0]) for o in ops if o in body)
  return total


# entry-computation instructions that launch no kernel on a GPU (bookkeeping, views, constants)
NO_KERNEL = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "opt-barrier",
                       "partition-id", "replica-id", "add-dependency"})


def kernel_counts(hlo_text: str) -> dict[str, int]:
  """The kernels one run of a compiled module launches (`compiled.as_text()`, a GPU's optimized HLO):
  every instruction of the entry computation but `NO_KERNEL`'s, a `while` loop's body and condition
  counted once per iteration where XLA knows the trip count (a `lax.scan`; else once), a
  `conditional`'s largest branch. Returns {'total', 'gemm' (cuBLAS calls and Triton GEMM fusions),
  'fusion' (the other fusions), 'custom' (other custom calls, e.g. a Pallas kernel), 'other'
  (unfused ops: copies, scatters, collectives)}."""
  hlo_text = re.sub(r"/\*index=\d+\*/", "", hlo_text)  # in a large tuple's shape (a while loop's state)
  comps, entry = _parse_hlo(hlo_text), None
  for line in hlo_text.splitlines():
    if line.startswith("ENTRY "):
      entry = _HEADER.match(line).group(1)
      break
  kinds = ("gemm", "fusion", "custom", "other")

  def count(name: str) -> dict[str, int]:
    out = dict.fromkeys(kinds, 0)
    for _, op, _, _, rest in comps.get(name, {}).values():
      if op in NO_KERNEL:
        continue
      if op == "while":
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
        n = int(trips.group(1)) if trips else 1
        for part in ("body", "condition"):
          called = re.search(part + r"=%([^\s,]+)", rest)
          sub = count(called.group(1)) if called else {}
          for k in kinds:
            out[k] += n * sub.get(k, 0)
        continue
      if op == "conditional":
        branches = [count(b) for b in re.findall(r"%([^\s,}]+)", rest.split("branch_computations=")[-1])]
        if branches:
          top = max(branches, key=lambda c: sum(c.values()))
          for k in kinds:
            out[k] += top[k]
        continue
      if (op == "custom-call" and any(f'custom_call_target="{t}"' in rest for t in LIBRARY_CALLS)) or (
          op == "fusion" and "_gemm" in rest and "__triton" in rest):
        out["gemm"] += 1
      else:
        out[{"fusion": "fusion", "custom-call": "custom"}.get(op, "other")] += 1
    return out

  counts = count(entry) if entry else dict.fromkeys(kinds, 0)
  return {"total": sum(counts.values()), **counts}


def _parse_hlo(hlo_text: str) -> dict[str, dict[str, tuple[str, str, list[str], bool, str]]]:
  """A module's text as {computation: {instruction: (shape, opcode, operand names, is root, rest of
  the line)}}."""
  comps: dict[str, dict[str, tuple[str, str, list[str], bool, str]]] = {}
  current = None
  for line in hlo_text.splitlines():
    if current is None:
      m = _HEADER.match(line)
      if m and line.rstrip().endswith("{"):
        current = comps.setdefault(m.group(1), {})
      continue
    if line.startswith("}"):
      current = None
      continue
    m = _INSTR.match(line)
    if not m:
      continue
    root, name, shape, opcode, operands, rest = m.groups()
    ops = [o.strip().lstrip("%") for o in operands.split(",") if o.strip().startswith("%")]
    current[name] = (shape, opcode, ops, bool(root), rest)
  return comps


# -- collectives ----------------------------------------------------------------------------------

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[0-9,]*\}(?:,\{[0-9,]*\})*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


def _replica_groups(rest: str) -> tuple[tuple[int, ...], ...]:
  """An instruction's replica groups (device ids, as listed, in XLA's iota form `[2,4]<=[8]`,
  `[4,2]<=[2,4]T(1,0)`, or its mesh form `mesh['axis_0'=4,'axis_1'=2] {'axis_0'}`); () when it has
  none (one group of every device)."""
  m = _GROUPS_LIST.search(rest)
  if m:
    return tuple(tuple(int(d) for d in g.split(",") if d) for g in re.findall(r"\{([0-9,]*)\}", m.group(1)))
  m = _GROUPS_MESH.search(rest)
  if m:  # mesh['axis_0'=4,'axis_1'=2] {'axis_0'}: one group along the named axes per other index
    axes = [(a, int(n)) for a, n in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
    names = [a for a, _ in axes]
    along = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(2))]
    ids = np.arange(int(np.prod([n for _, n in axes]))).reshape([n for _, n in axes])
    ids = np.moveaxis(ids, along, list(range(len(axes) - len(along), len(axes))))
    return tuple(tuple(int(d) for d in g) for g in ids.reshape(-1, int(np.prod([axes[i][1] for i in along]))))
  m = _GROUPS_IOTA.search(rest)
  if not m:
    return ()
  dims, reshape = [int(d) for d in m.group(1).split(",")], [int(d) for d in m.group(2).split(",")]
  ids = np.arange(int(np.prod(reshape))).reshape(reshape)
  if m.group(3):
    ids = ids.transpose([int(d) for d in m.group(3).split(",")])
  return tuple(tuple(int(d) for d in g) for g in ids.reshape(dims))


def collectives(hlo_text: str) -> list[dict]:
  """The collectives of a compiled module (`compiled.as_text()`; a GPU's async `*-start` forms or
  the CPU's plain ones), each {'op', 'groups' (device ids per replica group), 'operand_bytes' (the
  data operand: for a ragged all-to-all its send buffer), 'result_bytes', 'sent_bytes'}: what one
  device sends under ring algorithms over a group of g: all-reduce 2 (g-1)/g of its operand,
  all-gather (g-1)/g of its result, reduce-scatter and all-to-all (g-1)/g of the operand,
  collective-permute the operand; a ragged all-to-all at most its send buffer (every row to another
  device: what it really sends depends on the slice sizes at run time). Counted once each (no loop
  trip counts: for a module without loops around its collectives)."""
  hlo_text = re.sub(r"/\*index=\d+\*/", "", hlo_text)
  out = []
  for body in _parse_hlo(hlo_text).values():
    for shape, op, ops, _, rest in body.values():
      base = op[:-len("-start")] if op.endswith("-start") else op
      if base not in COLLECTIVES or not ops:
        continue
      arrays = [_array_bytes(f"{d}[{dims}]") for d, dims in re.findall(r"([a-z][a-z0-9]*)\[([0-9,]*)\]", shape)]
      data = ops[:1] if base == "ragged-all-to-all" else ops  # the rest: its buffer, offsets and sizes
      operand = sum(_array_bytes(body[o][0]) for o in data if o in body)
      if op.endswith("-start") and base == "ragged-all-to-all":
        result = arrays[-1]  # ((operands), result)
      elif op.endswith("-start") and base != "all-reduce":
        result = sum(arrays[len(arrays) // 2:])  # ((operands), (results))
      else:
        result = sum(arrays)
      groups = _replica_groups(rest)
      g = len(groups[0]) if groups else 0
      frac = (g - 1) / g if g else 1.0
      sent = {"all-reduce": 2 * frac * result, "all-gather": frac * result, "reduce-scatter": frac * operand,
              "all-to-all": frac * operand, "ragged-all-to-all": operand, "collective-permute": operand}[base]
      out.append({"op": base, "groups": groups, "operand_bytes": operand, "result_bytes": result, "sent_bytes": sent})
  return out
