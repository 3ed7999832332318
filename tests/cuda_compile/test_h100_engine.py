"""The slot engine's program set of `make run-gpu` compiled for an H100, with bf16 and with fp8 weights,
and its full-width decode program in each paged attention the engine offers on one GPU.

configs/llama3_1b_1gpu.gin: Llama-3.2-1B shapes, 64 slots, prompts up to 512, 1536 new tokens, KV
blocks of 16, chunks of 16 steps; fp8: `h100.FP8` (the projections float8_e4m3fn with per-channel
scales, fp8 GEMMs). The set is compiled in the engine's own 'auto' attention; the full-width decode
program (`('decode', slots, entries)`, the one most chunks run) once per implementation name of
`paged_attention.PAGED_IMPLEMENTATIONS` ('auto' resolves to one of them).
"""

import pytest

from cuda_compile import h100
from llamarl_jax.model.paged_attention import PAGED_IMPLEMENTATIONS

PRECISIONS = {"bf16": (), "fp8": h100.FP8}
IMPLEMENTATIONS = [name for name in PAGED_IMPLEMENTATIONS if name != "auto"]


def _programs(precision, paged_attention=None):
  run = h100.load_run(h100.RUN_GPU, *PRECISIONS[precision])
  return h100.slot_programs(run, h100.meshes(run)[1], paged_attention=paged_attention)


def _full_width_decode(programs) -> tuple:
  width = programs.widths[0]
  return ("decode", width, programs.entry_plan[width][-1])


def _name(precision, key, form=None):
  return f"engine/{precision}/{'_'.join(map(str, key))}" + (f"/{form}" if form else "")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_program_set(precision, figures):
  """Every program of the set but the full-width decode (compiled per implementation below): the
  set itself is recorded (a change of its programs is a change of warm-up time on the GPU)."""
  programs = _programs(precision)
  keys = programs.program_keys()
  program_set = {"attention": programs.attention_form, "programs": [list(k) for k in keys]}
  recorded = h100.recorded(f"engine/{precision}/set", program_set)
  assert recorded == program_set, f"the program set is {program_set}, bounds.json records {recorded}"
  for key in keys:
    if key != _full_width_decode(programs):
      figures.add(_name(precision, key), h100.compile_slot_program(programs, key))
  figures.verify()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_full_width_decode(precision, implementation, figures):
  programs = _programs(precision, implementation)
  assert programs.attention_form == implementation
  key = _full_width_decode(programs)
  program = figures.add(_name(precision, key, implementation), h100.compile_slot_program(programs, key))
  if implementation in ("pallas", "pallas_fused"):
    assert 'custom_call_target="__gpu$xla.gpu.triton"' in program.text  # the Pallas kernel, by Triton
  figures.verify()
