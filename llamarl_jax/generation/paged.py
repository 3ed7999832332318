"""The slot engine's paged KV layout: which pool block holds what, and each decode step's live blocks.

Pool (per layer, `KVPages`): k, v `[NB, bs, KV, D]`, blocks of bs = `block_size` positions:

  blocks [0, S * pb)            prompt regions: region g = blocks [g * pb, (g + 1) * pb), pb = ceil(Pm / bs).
                                A group (the n samples of one prompt) owns one region: its prompt is
                                prefilled once and its n slots read the same blocks (prefix sharing).
  blocks [S * pb, S * (pb + rb))  response blocks: slot s owns [S * pb + s * rb, S * pb + (s + 1) * rb),
                                rb = ceil((R - 1) / bs): response token j (j < R - 1; the last
                                token is never attended) is at block j // bs, offset j % bs.
  block NB - 1                  trash: idle slots write there and padding entries point there.

S = num_slots regions always suffice: a region is freed when the last sample of its group is
harvested, so live groups <= busy slots <= S. Keys are stored after RoPE, so a response starts at
its own block boundary whatever the prompt length (no copy of a partial prompt block).

A decode step of slot s (running, n_gen = m: response tokens 0..m-1 sampled, token m-1 not yet in
the cache) writes token m-1 at response entry m-1 and attends to its prompt's L positions and
response entries 0..m-1: ceil(L / bs) + ceil(m / bs) blocks. `live_entries` lists those blocks of
every running slot as a flat `[TB]` list (`paged_attention.paged_decode_attention`'s input); TB is a
static size of the engine's program set (`SlotPrograms.entry_plan`) the host picks per decode chunk
from an upper bound it computes without reading the device (`live_blocks_bound`).
"""

from __future__ import annotations

import dataclasses
import re

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from llamarl_jax import compat
from llamarl_jax.model.llama import ModelConfig

Array = jax.Array


@flax.struct.dataclass
class KVPages:
  """The slot engine's KV pool: per layer k, v `[NB, bs, KV, D]` (see the module docstring)."""

  k: tuple[Array, ...]
  v: tuple[Array, ...]


@dataclasses.dataclass(frozen=True)
class PageLayout:
  """Block arithmetic of the pool for `num_slots` slots, prompts up to `max_prompt_len` (Pm) and
  `max_new_tokens` (R) response tokens, `block_size` (bs) positions per block."""

  num_slots: int
  max_prompt_len: int
  max_new_tokens: int
  block_size: int = 16

  def __post_init__(self):
    if self.block_size < 1:
      raise ValueError(f"kv_block_size must be >= 1, got {self.block_size}")

  @property
  def prompt_blocks(self) -> int:
    """pb: blocks of one prompt region."""
    return -(-self.max_prompt_len // self.block_size)

  @property
  def response_blocks(self) -> int:
    """rb: blocks of one slot's response (tokens 0..R-2 are ever written; at least one block)."""
    return max(1, -(-(self.max_new_tokens - 1) // self.block_size))

  @property
  def response_base(self) -> int:
    return self.num_slots * self.prompt_blocks

  @property
  def trash(self) -> int:
    return self.response_base + self.num_slots * self.response_blocks

  @property
  def num_blocks(self) -> int:
    """NB: prompt regions + response blocks + the trash block."""
    return self.trash + 1

  def empty_pages(self, config: ModelConfig, dtype=None) -> KVPages:
    dtype = jnp.dtype(dtype or config.dtype)
    shape = (self.num_blocks, self.block_size, config.num_kv_heads, config.head_dim)
    zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
    return KVPages(k=zeros(), v=zeros())

  def region_blocks(self, region: Array, count: int) -> Array:
    """Physical blocks `[..., count]` of the first `count` blocks of prompt regions `region [...]`;
    regions out of range (>= num_slots: padding) map to NB (dropped by a scatter with mode='drop')."""
    j = jnp.arange(count, dtype=jnp.int32)
    blocks = region[..., None] * self.prompt_blocks + j
    return jnp.where(region[..., None] < self.num_slots, blocks, self.num_blocks)

  def response_block_ids(self, slot: Array) -> Array:
    """Physical blocks `[..., rb]` of slots `slot [...]` (out of range -> NB, dropped by scatters)."""
    j = jnp.arange(self.response_blocks, dtype=jnp.int32)
    blocks = self.response_base + slot[..., None] * self.response_blocks + j
    return jnp.where((slot[..., None] >= 0) & (slot[..., None] < self.num_slots), blocks, self.num_blocks)

  def write_location(self, n_gen: Array, running: Array, slot: Array | None = None) -> tuple[Array, Array]:
    """(block, offset) `[W]` where each row's decode step writes its current token (response entry
    n_gen - 1) in its slot's response blocks; rows not running write to the trash block. slot `[W]`:
    the slot of each row (default: row i is slot i, W = S)."""
    W = n_gen.shape[0]
    slot = jnp.arange(W, dtype=jnp.int32) if slot is None else slot
    j = jnp.maximum(n_gen - 1, 0)
    block = self.response_base + slot * self.response_blocks + j // self.block_size
    return (jnp.where(running, block, self.trash).astype(jnp.int32),
            jnp.where(running, j % self.block_size, 0).astype(jnp.int32))


def live_entries(layout: PageLayout, region: Array, prompt_len: Array, n_gen: Array, running: Array,
                 num_entries: int, slot: Array | None = None) -> tuple[Array, Array, Array]:
  """The flat list of blocks a decode step reads: (entry_row, entry_block, entry_len), int32 `[TB]`.

  region, prompt_len, n_gen `[W]` int32, running `[W]` bool: the rows of the step; slot `[W]` the
  slot each row decodes (default: row i is slot i, W = S: every slot). TB = `num_entries` (static)
  must be >= the live blocks (the host's `live_blocks_bound` guarantees it; blocks past TB would be
  silently unread). Row r contributes ceil(L_r / bs) prompt blocks (its group's region, shared with
  the group's other slots) then ceil(n_gen_r / bs) blocks of its slot's response, in row order;
  entries past the total are padding: row W (out of range), the trash block, length 0.
  """
  bs, S = layout.block_size, region.shape[0]
  slot = jnp.arange(S, dtype=jnp.int32) if slot is None else slot
  prompt_blocks = jnp.where(running, -(-prompt_len // bs), 0)
  resp_blocks = jnp.where(running, -(-n_gen // bs), 0)
  ends = jnp.cumsum(prompt_blocks + resp_blocks)  # [S] inclusive
  e = jnp.arange(num_entries, dtype=jnp.int32)
  row = jnp.sum(ends[None, :] <= e[:, None], axis=1, dtype=jnp.int32)  # the slot of entry e; S past the end
  r = jnp.minimum(row, S - 1)
  j = e - (ends[r] - prompt_blocks[r] - resp_blocks[r])  # block index within the slot's list
  in_prompt = j < prompt_blocks[r]
  jr = j - prompt_blocks[r]
  block = jnp.where(in_prompt, region[r] * layout.prompt_blocks + j,
                    layout.response_base + slot[r] * layout.response_blocks + jr)
  length = jnp.where(in_prompt, prompt_len[r] - j * bs, n_gen[r] - jr * bs)
  live = row < S
  return (row, jnp.where(live, block, layout.trash).astype(jnp.int32),
          jnp.where(live, jnp.clip(length, 0, bs), 0).astype(jnp.int32))


def live_blocks_bound(layout: PageLayout, prompt_lens: np.ndarray, steps_dispatched: np.ndarray,
                      chunk_steps: int, lanes: int | None = None) -> int:
  """An upper bound (host numpy, no device read) on the blocks any step of the next decode chunk reads.

  prompt_lens, steps_dispatched `[busy]`: each busy slot's prompt length and the decode steps
  dispatched since its insert (chunks x chunk_steps, whether or not they ran them all). A slot
  inserted with n_gen = 1 has n_gen <= 1 + steps_dispatched when the chunk starts, and its steps in
  the chunk read at most min(R - 1, steps_dispatched + chunk_steps) response entries. lanes: a step
  computes at most this many of the slots (`SlotPrograms.num_lanes`): the sum of the largest bounds.
  """
  bs, R = layout.block_size, layout.max_new_tokens
  resp = np.minimum(R - 1, np.asarray(steps_dispatched, np.int64) + chunk_steps)
  per_slot = -(-np.asarray(prompt_lens, np.int64) // bs) + -(-resp // bs)
  if lanes is not None and lanes < per_slot.size:
    per_slot = np.sort(per_slot)[per_slot.size - lanes:]
  return int(np.sum(per_slot))


def entry_bucket(needed: int, buckets: tuple[int, ...]) -> int:
  """The smallest of `buckets` (ascending) >= needed; the largest when none is (it holds every lane at
  its full length: `SlotPrograms.entry_plan`)."""
  for b in buckets:
    if b >= needed:
      return b
  return buckets[-1]


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


def kv_bytes_per_position(config: ModelConfig, dtype=None) -> int:
  """Bytes of one position's keys and values over all layers."""
  return config.num_layers * 2 * config.num_kv_heads * config.head_dim * jnp.dtype(dtype or config.dtype).itemsize




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
