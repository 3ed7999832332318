"""The slot engine's program set: which device programs `slot_programs.SlotPrograms` compiles, the paged
attention they run, and the XLA options they compile with.

The set is fixed by the configuration and small (`SlotPrograms.program_keys`; at most 8 at 64 slots,
prompts of 1024 and responses of 4096): insert per prompt bucket (the largest `prompt_bucket_count`
of the sampler's buckets up to Pm) with a fixed group count each (`prefill_tokens` / bucket, at most
`max_insert`: `insert_plan`); decode per width (`decode_widths`: the lanes, then quarterings) with one
entry size, the most that width can read - the Pallas kernel walks each row's own blocks, so the size
costs it nothing - and, for the XLA forms, whose gathers read every listed entry, a quarter size beside
the full one at the full width (`entry_plan`); recompute when swaps recompute the KV cache.
"""

from __future__ import annotations

import sys
from typing import Sequence

from llamarl_jax import compat, gpu_paths
from llamarl_jax.generation.paged import PageLayout
from llamarl_jax.model import paged_attention as paged_attention_module

# XLA options a decode program compiles with. A decode GEMM has one row per slot (M <= a few hundred)
# and a long contraction; XLA's GPU compiler splits such a GEMM's contraction over thread blocks
# (split-K) and writes each block's fp32 partial sums to memory for a second pass to add: at 1B
# shapes, 64 slots, compiled for an H100, 0.53 GB per step, more than half the fp8 layers' weights
# (BENCHMARKS.md, "Kernels and bytes of a decode step"). Without split-K the GEMM writes its result
# once and the residual add fuses with the next norm. A GPU option (the CPU compiler ignores it;
# an XLA that lacks it compiles with its defaults, `compile_lowered`); on a GPU the autotuner then
# picks tiles without split-K (its speed there is not measured yet).
DECODE_COMPILER_OPTIONS = {"xla_gpu_experimental_force_split_k": 1}

# The kernel forms 'auto' may take on one GPU, most preferred first (the fused step moves fewer bytes
# and launches fewer kernels: BENCHMARKS.md); `gpu_paths` says which have passed on a GPU.
GPU_KERNEL_PREFERENCE = ("pallas_fused", "pallas")


def compile_lowered(lowered, options: dict | None = None):
  """`lowered.compile(compiler_options=options)`; where this XLA does not know one of the options
  (they are experimental flags that may move between versions), compiled with its defaults."""
  if not options:
    return lowered.compile()
  try:
    return lowered.compile(compiler_options=options)
  except Exception as e:  # jax raises XlaRuntimeError / JaxRuntimeError: "No such compile option: ..."
    if "No such compile option" not in str(e):
      raise
    return lowered.compile()


def decode_widths(num_slots: int, divisor: int = 1, min_width: int | None = None) -> tuple[int, ...]:
  """The row counts decode chunks are compiled for, largest first: `num_slots`, then its quarterings
  down to `min_width` (default: num_slots / 16, at least 1; so at most three widths), each a
  multiple of `divisor` (the mesh's data x fsdp: rows stay sharded like the slots). A chunk computes
  the smallest width that holds every busy slot, so a batch's last long rows do not drag every slot
  through each step; quarters rather than halves keep the program set small (each width is a
  compilation of the whole decode chunk); `min_width = num_slots`: never shrink."""
  if min_width is None:
    min_width = max(1, -(-num_slots // 16))
  if min_width < 1:
    raise ValueError(f"min_decode_width must be >= 1, got {min_width}")
  out, w = [num_slots], num_slots
  while w % 4 == 0 and w // 4 >= min_width:
    w //= 4
    if w % divisor == 0:
      out.append(w)
  if 1 < w < 4 and min_width == 1 and divisor == 1:  # a width of 2 or 3 left: then one row
    out.append(1)
  return tuple(out)


def entry_plan(widths: Sequence[int], layout: PageLayout, attention_form: str) -> dict[int, tuple[int, ...]]:
  """width -> the entry counts (TB) its decode programs take, ascending. The largest is every
  block W lanes can read (each lane at its longest prompt and response); the XLA forms also take a
  quarter of it at the full width (their gathers read every listed entry: a chunk that needs
  fewer reads fewer)."""
  per_lane = layout.prompt_blocks + layout.response_blocks
  plan = {}
  for w in widths:
    top = w * per_lane
    quarter = -(-top // 4)
    xla_full_width = w == widths[0] and attention_form not in paged_attention_module.KERNEL_FORMS and quarter < top
    plan[w] = (quarter, top) if xla_full_width else (top,)
  return plan


def insert_plan(sampler_buckets: Sequence[int], max_prompt_len: int, *, num_slots: int, samples: int,
                prompt_bucket_count: int, prefill_tokens: int,
                max_insert: int | None) -> tuple[tuple[int, ...], int, dict[int, int]]:
  """(prompt buckets, groups one insert prefills at most, groups per bucket) of the insert programs:
  the buckets are Pm and the largest `prompt_bucket_count - 1` of the sampler's below it; an insert
  of bucket Pb takes max(1, min(max_insert, prefill_tokens // Pb)) groups of `samples` slots, and
  max_insert is at most the groups the slots hold."""
  if prompt_bucket_count < 1:
    raise ValueError(f"prompt_bucket_count must be >= 1, got {prompt_bucket_count}")
  if prefill_tokens < 1:
    raise ValueError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
  fit = [b for b in sampler_buckets if b < max_prompt_len] + [max_prompt_len]
  buckets = tuple(fit[-prompt_bucket_count:])
  top = max(1, num_slots // samples)
  if max_insert is not None and max_insert < 1:
    raise ValueError(f"max_insert must be >= 1, got {max_insert}")
  max_insert = min(int(max_insert or top), top)
  return buckets, max_insert, {b: max(1, min(max_insert, int(prefill_tokens) // b)) for b in buckets}


def decode_attention_choice(requested: str, platform: str, num_devices: int) -> str:
  """The paged decode attention a slot engine runs: `requested` ('auto', 'reduce', 'dot', 'pallas',
  'pallas_fused') on a generator mesh of `num_devices` on `platform`. 'auto' on one GPU is the first
  Pallas kernel form of `GPU_KERNEL_PREFERENCE` that `gpu_paths` records as passed on a GPU (each live
  block read once; its decode step against XLA's: BENCHMARKS.md) where this JAX has Pallas' Triton
  backend, else XLA's form with one warning naming the reason; sharded meshes keep XLA's form (a
  Pallas call is not partitioned). A kernel form on a GPU without the backend is an error."""
  missing = compat.pallas_triton_missing() if platform == "gpu" else None
  if requested in paged_attention_module.KERNEL_FORMS and missing is not None:
    raise ValueError(f"paged_attention={requested!r} needs Pallas' Triton backend, which this JAX lacks ({missing}); "
                     "use paged_attention='auto' (XLA's form)")
  if requested == "auto" and platform == "gpu" and num_devices == 1:
    if missing is None:
      return gpu_paths.gpu_default("paged_attention", GPU_KERNEL_PREFERENCE, "auto")
    print(f"[llamarl] slot engine: XLA's paged attention instead of the Pallas kernel: Pallas' Triton backend "
          f"is missing in this JAX ({missing})", file=sys.stderr, flush=True)
  return requested


def decode_attention(requested: str, mesh) -> tuple[str, str]:
  """(the paged_attention setting the decode programs run under, the form it resolves to) for
  `requested` on `mesh`: `decode_attention_choice`, after refusing a kernel form on a mesh of more than
  one device (a Pallas call is not partitioned: the pools would be gathered whole)."""
  platform = mesh.devices.flat[0].platform  # the paged attention's form follows the mesh's devices
  paged_attention_module.resolve_paged_implementation(requested, platform)  # a clear error early
  if requested in paged_attention_module.KERNEL_FORMS and mesh.devices.size > 1:
    raise ValueError(f"paged_attention={requested!r} runs its kernel unsharded (a Pallas call is not partitioned "
                     f"over the mesh: the pools would be gathered whole); this generator mesh has "
                     f"{dict(mesh.shape)}: use one device per generator, or paged_attention='auto'")
  choice = decode_attention_choice(requested, platform, mesh.devices.size)
  with paged_attention_module.target_platform(platform, choice):
    return choice, paged_attention_module.resolve_paged_implementation("auto", platform)
