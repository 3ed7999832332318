"""How a step's rows are laid out into microbatches (host side, from the rows' lengths only).

Two layouts besides the plain split (every microbatch B/M rows at the batch's full width P + R):

- `group_by_length`: rows sorted by length into the same M microbatches of B/M rows, each run at the
  width of its longest row (`width_bucket`: a ladder of 4 widths an octave, one program per width).
- `pack_rows`: rows packed end to end into rows of a fixed token budget (first-fit decreasing), each
  packed row holding several sequences (segment ids and per-segment positions); a microbatch is one
  packed row per data-parallel shard. One program whatever the lengths; computed tokens are the
  real tokens plus the unfilled ends of the packed rows.

Both are deterministic functions of the lengths (every process computes the same layout).
"""

from __future__ import annotations

import dataclasses

import numpy as np

MIN_WIDTH = 16  # the narrowest microbatch width: below it a narrower program saves nothing worth a compile


def width_bucket(length: int, max_width: int) -> int:
  """The sequence width of a microbatch whose longest row has `length` tokens: the smallest rung of
  16, 20, 24, 28, 32, 40, 48, 56, 64, 80, ... (m * 2^e, m in 4..7: 4 rungs an octave) that holds it,
  capped at `max_width` (P + R, the ungrouped width). A rung wastes under 25% of a row (about 10% on
  average), and a run compiles at most one microbatch program per rung: at most 4 log2(max_width / 16) + 2."""
  length = max(int(length), MIN_WIDTH)
  step = 1 << (length.bit_length() - 3)  # 2^e with 4 <= length / 2^e < 8
  return min(-(-length // step) * step, int(max_width))


@dataclasses.dataclass(frozen=True)
class LengthGroups:
  """A step's microbatches grouped by length (`group_by_length`).

  order: `[B]` int32, the batch row at each position of the grouped batch (microbatch m holds the
  positions j * M + m, as the trainer's microbatch split takes them). widths: each microbatch's
  sequence width, M ints. padding_fraction: padded positions of the grouped microbatches per real
  token, (B / M * sum(widths) - sum(lengths)) / sum(lengths)."""
  order: np.ndarray
  widths: tuple[int, ...]
  padding_fraction: float


def group_by_length(lengths: np.ndarray, microbatches: int, max_width: int) -> LengthGroups:
  """Sort rows by length and cut them into `microbatches` groups of B/M rows, each as wide as its
  longest row (`width_bucket`).

  lengths: `[B]` ints, each trainer row's prompt + response length (`trainer_layout`). Rows are
  ordered longest first, ties by row index: a deterministic function of the lengths (every process
  computes the same grouping). Consecutive groups of the sorted rows minimise the padded positions
  among all splits into groups of B/M rows; microbatch m holds sorted rows m*B/M .. (m+1)*B/M - 1 at
  positions j*M + m, so that each data-parallel device keeps B/M / (data*fsdp) rows of every
  microbatch, as in the ungrouped split.
  """
  lengths = np.asarray(lengths, np.int64)
  B, M = len(lengths), microbatches
  if B % M:
    raise ValueError(f"{B} rows do not split into {M} microbatches of equal size")
  groups = np.argsort(-lengths, kind="stable").reshape(M, B // M)  # [M, B/M] row indices
  widths = tuple(width_bucket(lengths[g].max(), max_width) for g in groups)
  real = int(lengths.sum())
  return LengthGroups(order=groups.T.reshape(B).astype(np.int32), widths=widths,
                      padding_fraction=(B // M * sum(widths) - real) / max(real, 1))


@dataclasses.dataclass(frozen=True)
class PackPlan:
  """Rows packed into bins of `tokens` positions (`pack_rows`).

  row_bin, row_slot, row_offset: `[B]` int32, each row's bin, its index among its bin's rows (in
  order) and its first position in the bin. bins: bins used, rounded up to a multiple of the
  data-parallel shards (`microbatches` = bins / shards: microbatch m is bins m*shards .. +shards-1).
  padding_fraction: computed positions per real token minus 1, (bins * tokens - sum(lengths)) / sum."""
  row_bin: np.ndarray
  row_slot: np.ndarray
  row_offset: np.ndarray
  bins: int
  microbatches: int
  padding_fraction: float


def pack_rows(lengths: np.ndarray, tokens: int, shards: int = 1) -> PackPlan:
  """First-fit decreasing: rows longest first (ties by index) each into the first bin with room.

  lengths: `[B]` ints, each row's tokens (`trainer_layout`); tokens: a bin's capacity; shards: the
  bins are rounded up to a multiple of this (one bin per data-parallel shard in each microbatch).
  First-fit decreasing uses at most 11/9 of the optimal number of bins (+ 6/9); with bins several
  rows long, the waste is the unfilled end of the last few bins.
  """
  lengths = np.asarray(lengths, np.int64)
  if lengths.size and lengths.max() > tokens:
    raise ValueError(f"a row of {int(lengths.max())} tokens does not fit a packed row of {tokens} "
                     f"(tokens_per_microbatch): set tokens_per_microbatch to at least the batch's prompt + "
                     f"response width")
  B = len(lengths)
  row_bin, row_slot, row_offset = (np.zeros(B, np.int32) for _ in range(3))
  fill: list[int] = []
  count: list[int] = []
  for row in np.argsort(-lengths, kind="stable"):
    n = int(lengths[row])
    b = next((i for i, used in enumerate(fill) if used + n <= tokens), len(fill))
    if b == len(fill):
      fill.append(0)
      count.append(0)
    row_bin[row], row_slot[row], row_offset[row] = b, count[b], fill[b]
    fill[b] += n
    count[b] += 1
  bins = max(-(-len(fill) // shards) * shards, shards)
  real = int(lengths.sum())
  return PackPlan(row_bin=row_bin, row_slot=row_slot, row_offset=row_offset, bins=bins,
                  microbatches=bins // shards, padding_fraction=(bins * tokens - real) / max(real, 1))
