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

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from llamarl_jax.model.config import ModelConfig

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


def kv_bytes_per_position(config: ModelConfig, dtype=None) -> int:
  """Bytes of one position's keys and values over all layers."""
  return config.num_layers * 2 * config.num_kv_heads * config.head_dim * jnp.dtype(dtype or config.dtype).itemsize
