"""The record of GPU-only paths (`gpu_paths`): BENCHMARKS.md shows it, its names are real settings,
GPU defaults come from it, and the start-up line names what runs."""

from pathlib import Path

import jax.numpy as jnp
import pytest

from llamarl_jax import gpu_paths
from llamarl_jax.generation.program_set import GPU_KERNEL_PREFERENCE, decode_attention_choice
from llamarl_jax.model.forward import ATTENTION_IMPLEMENTATIONS, resolve_attention
from llamarl_jax.model.moe import GROUPED_GEMM_IMPLEMENTATIONS
from llamarl_jax.model.paged_attention import PAGED_IMPLEMENTATIONS

ROOT = Path(__file__).resolve().parents[1]
VALUES = {"paged_attention": PAGED_IMPLEMENTATIONS, "trainer_attention": ATTENTION_IMPLEMENTATIONS,
          "packed_attention": ATTENTION_IMPLEMENTATIONS, "quantize": ("fp8",),
          "moe_grouped_gemm": GROUPED_GEMM_IMPLEMENTATIONS}


def test_benchmarks_md_shows_the_record():
  """BENCHMARKS.md's "GPU paths" table is `gpu_paths.table()` verbatim (a promotion changes both)."""
  assert gpu_paths.table() in (ROOT / "BENCHMARKS.md").read_text()


def test_every_path_names_a_setting_and_one_of_its_values():
  for p in gpu_paths.PATHS:
    assert p.value in VALUES[p.setting], (p.setting, p.value)
    if p.passed is not None:
      assert p.passed.device.startswith("NVIDIA") and p.passed.check and p.passed.date.startswith("20")
  assert len({(p.setting, p.value) for p in gpu_paths.PATHS}) == len(gpu_paths.PATHS)
  assert set(GPU_KERNEL_PREFERENCE) <= {p.value for p in gpu_paths.PATHS if p.setting == "paged_attention"}


def test_gpu_defaults_are_paths_that_passed_and_newer_ones_run_when_named(capsys, monkeypatch):
  """On one GPU the engine's 'auto' is the most preferred kernel form that passed; promoting a form
  (its record gains a pass) makes it the default; a form chosen by name runs either way."""
  from llamarl_jax import compat
  compat.pallas_triton_missing.cache_clear()
  assert compat.pallas_triton_missing() is None  # Triton imports here (interpret mode)
  chosen = decode_attention_choice("auto", "gpu", 1)
  assert gpu_paths.passed("paged_attention", chosen)
  assert chosen == next(f for f in GPU_KERNEL_PREFERENCE if gpu_paths.passed("paged_attention", f))
  assert decode_attention_choice("pallas_fused", "gpu", 1) == "pallas_fused"
  assert decode_attention_choice("auto", "gpu", 2) == "auto"  # sharded: XLA's form

  promoted = tuple(gpu_paths.GpuPath(p.setting, p.value, p.what, p.passed or gpu_paths.GpuPass(
      "NVIDIA H100", "0.11.2", "2026-12-02", "abc1234", "a test's promotion")) for p in gpu_paths.PATHS)
  monkeypatch.setattr(gpu_paths, "PATHS", promoted)
  assert decode_attention_choice("auto", "gpu", 1) == GPU_KERNEL_PREFERENCE[0]
  assert resolve_attention("auto", "gpu", jnp.bfloat16, packed=True) == "cudnn"
  monkeypatch.setattr(gpu_paths, "PATHS", tuple(p for p in promoted if p.setting != "paged_attention"))
  assert decode_attention_choice("auto", "gpu", 1) == "auto"  # no kernel form passed: XLA's
  assert capsys.readouterr().err == ""


def test_the_start_up_line_names_each_path_and_whether_it_passed(capsys):
  assert gpu_paths.announce("slot engine", "cpu", {"paged_attention": "dot"}) is None
  assert capsys.readouterr().err == ""
  line = gpu_paths.announce("slot engine", "gpu", {"paged_attention": "pallas_fused", "quantize": "fp8"})
  assert capsys.readouterr().err.strip() == line
  fused, fp8 = (gpu_paths.path("paged_attention", "pallas_fused"), gpu_paths.path("quantize", "fp8"))
  for p in (fused, fp8):
    expect = "opt-in: not yet passed on a GPU" if p.passed is None else f"passed on a GPU: {p.passed.device}"
    assert f"{p.setting}={p.value!r} ({expect}" in line
  ro = gpu_paths.path("paged_attention", "pallas")
  assert ro.passed is not None and f"jax {ro.passed.jax}" in gpu_paths.describe("paged_attention", "pallas")
  assert gpu_paths.describe("paged_attention", "dot") == "paged_attention='dot'"  # not a GPU-only path


@pytest.mark.parametrize("setting", ["trainer_attention", "packed_attention"])
def test_the_trainers_auto_attention_follows_the_record(setting):
  expect = "cudnn" if gpu_paths.passed(setting, "cudnn") else "xla"
  assert resolve_attention("auto", "gpu", jnp.bfloat16, packed=setting == "packed_attention") == expect
  assert resolve_attention("auto", "cpu", jnp.bfloat16, packed=setting == "packed_attention") == "xla"
