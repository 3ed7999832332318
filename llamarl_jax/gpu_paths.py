"""GPU-only code paths: which have run on a GPU and matched a reference there, and so are GPU defaults.

Some implementations run for real only on a GPU: Pallas kernels compile through Triton there (on the
CPU they run in Pallas' interpret mode, as XLA ops), cuDNN's fused attention exists only there. A CPU
test shows their math, not the compiled kernel. So on a GPU a setting's 'auto' takes the first of
its candidates that `PATHS` records as passed on a GPU (the device, JAX version, date, commit and the
check that passed); a newer path is used only when chosen by name (opt-in), and prints one line
saying it has not passed on a GPU. `make gpu-check` (scripts/gpu_check.py) checks each path against
a reference on one GPU; the change that records its pass here promotes it.

BENCHMARKS.md ("GPU paths") shows `table()`; tests/test_gpu_paths.py checks the two agree.
"""

from __future__ import annotations

import dataclasses
import sys


@dataclasses.dataclass(frozen=True)
class GpuPass:
  """Where and how a path passed: `check` is what was compared with what, and the result."""
  device: str
  jax: str
  date: str
  commit: str
  check: str


@dataclasses.dataclass(frozen=True)
class GpuPath:
  """`setting`=`value`: a configuration choice (`GeneratorConfig.paged_attention`, the trainer's
  attention, ...) and one of its values; `what` it runs; `passed` None until it has passed on a GPU."""
  setting: str
  value: str
  what: str
  passed: GpuPass | None = None


_H200_1126 = dict(device="NVIDIA H200", jax="0.11.2", date="2026-11-26")

PATHS: tuple[GpuPath, ...] = (
    GpuPath("paged_attention", "pallas_fused",
            "the fused paged decode step: one Pallas kernel rotates the new key, writes key and value into "
            "the pool in place, reads q from the fused Q/K/V projection and attends; with fp8 weights each "
            "fp8 GEMM's input is made by one Pallas kernel (model/fp8_kernels.py)"),
    GpuPath("paged_attention", "pallas",
            "the paged decode kernel, read-only: XLA rotates and scatters the new key and value, the Pallas "
            "kernel reads each live block once",
            GpuPass(**_H200_1126, commit="11b7b11, b98a3e2",
                    check="tests/gpu: Triton kernel vs XLA 'reduce' over the same bf16 cache, within 2 bf16 "
                          "ulps of max|v|; slot engine decode at 64 slots, 1B, bf16: 2.13 ms/step vs 4.32 ms")),
    GpuPath("paged_attention", "reduce", "XLA's paged attention (multiply-reduce over the gathered blocks)",
            GpuPass(**_H200_1126, commit="11b7b11, b98a3e2",
                    check="the reference of the kernel's test; the slot engine's decode at 64 slots, 1B, "
                          "bf16: 4.32 ms/step")),
    GpuPath("trainer_attention", "cudnn", "cuDNN fused attention over right-padded rows with per-row lengths",
            GpuPass(**_H200_1126, commit="11b7b11",
                    check="tests/gpu: cuDNN vs XLA attention on the trainer layout (forward); trainer step "
                          "1B 16 x 2048: 41.2% MFU, plain JAX 40.7%")),
    GpuPath("packed_attention", "cudnn",
            "cuDNN fused attention over packed segments (JAX's private entry point with segment offsets)"),
    GpuPath("moe_grouped_gemm", "pallas",
            "the MoE experts' grouped matmuls as Pallas (Triton) tile kernels over each expert's rows padded to "
            "64-row tiles, forward and both gradients (model/grouped_gemm.py), in place of ragged_dot's dense "
            "GEMM over all experts"),
    GpuPath("quantize", "fp8",
            "fp8 weights in the generator: XLA's fp8 GEMMs with per-channel scales (cuBLASLt where the "
            "scales are scalars), the activations quantised by XLA ops"),
)


def path(setting: str, value: str) -> GpuPath | None:
  """The record of `setting`=`value`, or None where the value is not a GPU-only path."""
  for p in PATHS:
    if (p.setting, p.value) == (setting, value):
      return p
  return None


def passed(setting: str, value: str) -> bool:
  p = path(setting, value)
  return p is not None and p.passed is not None


def gpu_default(setting: str, candidates: tuple[str, ...], fallback: str) -> str:
  """The first of `candidates` (most preferred first) recorded as passed on a GPU, else `fallback`."""
  for value in candidates:
    if passed(setting, value):
      return value
  return fallback


def describe(setting: str, value: str) -> str:
  """One phrase for a log line: where the path passed, or that it is opt-in and has not."""
  p = path(setting, value)
  if p is None:
    return f"{setting}={value!r}"
  if p.passed is None:
    return f"{setting}={value!r} (opt-in: not yet passed on a GPU)"
  return f"{setting}={value!r} (passed on a GPU: {p.passed.device}, jax {p.passed.jax}, {p.passed.date})"


def announce(component: str, platform: str, choices: dict[str, str]) -> str | None:
  """On a GPU, print (stderr) and return the one line naming the paths `component` runs, e.g. the
  slot engine's paged attention and precision; elsewhere None (the CPU runs none of them)."""
  if platform not in ("gpu", "cuda"):
    return None
  line = f"[llamarl] {component} on the GPU runs " + ", ".join(describe(s, v) for s, v in choices.items())
  print(line, file=sys.stderr, flush=True)
  return line


def table() -> str:
  """The markdown table of `PATHS` (BENCHMARKS.md "GPU paths")."""
  lines = ["| setting | value | what it runs | passed on | JAX | date | commit | check |",
           "|---|---|---|---|---|---|---|---|"]
  for p in PATHS:
    r = p.passed
    cells = ([r.device, r.jax, r.date, r.commit, r.check] if r else ["not yet (opt-in)", "-", "-", "-", "-"])
    lines.append(f"| {p.setting} | `{p.value}` | {p.what} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


if __name__ == "__main__":
  print(table())
