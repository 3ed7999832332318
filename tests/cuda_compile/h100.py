"""A gin configuration's device programs compiled for an H100 on a machine without one (the CUDA compile
tier, `make test-cuda-compile`), and each program's figures checked against `bounds.json`.

The run is read from its config as `scripts/train.py` reads it (`experiment.parse_gin`, `build_policy`
without weights, `RunShapes`), its meshes are laid over the devices of an H100 node that is not there
(`scripts/bench_generate.target_devices`: XLA's GPU compiler, `scripts/gpu_targets/h100_sxm.pbtxt`),
and every input is a `jax.ShapeDtypeStruct`: nothing is allocated and nothing runs. No autotuning
runs without the device, so the GEMM configurations are the compiler's defaults.

A compiled program's figures (`Figures`): XLA's compile seconds on this machine, the kernels one run
launches (`measure.hlo.kernel_counts`, a `lax.scan` counted per iteration), the bytes its kernels move
(XLA's generic cost analysis of the GPU's fusions, fused gathers and scatters charged what they touch,
cuBLAS calls their operands; a Pallas kernel counts nothing), and XLA's memory analysis (arguments,
outputs, temporaries per device).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import jax

from llamarl_jax import compat, experiment, parallel
from llamarl_jax.config import RunConfig
from llamarl_jax.measure import hlo
from llamarl_jax.model.config import ModelConfig
from llamarl_jax.shapes import RunShapes
from scripts import bench_generate

ROOT = Path(__file__).resolve().parents[2]
BOUNDS = Path(__file__).with_name("bounds.json")
TIER_ENV = "LLAMARL_CUDA_COMPILE"  # set by `make test-cuda-compile`: the tier runs (else it is skipped)
RECORD_ENV = "LLAMARL_RECORD_BOUNDS"  # =1: write the measured figures into bounds.json instead of checking
TARGET = "h100"
TARGET_CAPABILITY = "9.0"  # an H100's CUDA compute capability (cuDNN's lowering checks it)

RUN_GPU = "configs/llama3_1b_1gpu.gin"  # `make run-gpu`'s configuration
# configs/tiny_cpu_fp8.gin's settings (the generator in fp8, the token-level masked importance-sampling
# loss) on `make run-gpu`'s shapes: that config's own model is a CPU one (fp32, 128 wide)
FP8 = ("GeneratorConfig.quantize = 'fp8'", "TrainConfig.loss = 'mis'",
       "TrainConfig.loss_kwargs = {'level': 'token', 'rs_threshold': 2.0, 'rs_threshold_lower': 0.5}")


@dataclasses.dataclass(frozen=True)
class Run:
  """A configuration as `scripts/train.py` reads it: the policy's `ModelConfig`, the typed `RunConfig`,
  the run's `RunShapes` and its tokenizer."""
  model: ModelConfig
  config: RunConfig
  shapes: RunShapes
  tokenizer: Any


def load_run(gin_file: str, *bindings: str) -> Run:
  """The run of `gin_file` (a path under the repository) with `bindings` on top."""
  import gin

  gin.clear_config()
  gin.add_config_file_search_path(str(ROOT))
  experiment.parse_gin([str(ROOT / gin_file)], list(bindings))
  model, _, tokenizer = experiment.build_policy(weights=False)
  config = experiment.configured_run_config()
  return Run(model, config, RunShapes.of(model, config), tokenizer)


def target_devices(n: int) -> list:
  """`n` devices of one H100 node compiled for without a GPU (`bench_generate.target_devices`)."""
  return bench_generate.target_devices(TARGET, n)


def meshes(run: Run) -> tuple:
  """(trainer, generator, reward model or None) meshes of the run's `MeshConfig` over H100 devices."""
  layout = dataclasses.asdict(run.config.mesh)
  devices = target_devices(parallel.device_counts(**layout)[3])
  trainer, generator = parallel.make_meshes(**layout, devices=devices)
  return trainer, generator, parallel.make_reward_mesh(**layout, devices=devices)


def slot_programs(run: Run, mesh, *, paged_attention: str | None = None):
  """The slot engine's `SlotPrograms` as a run builds them (`build.generator` ->
  `SlotEngine`: the generator's dtype and quantisation, the run's lanes, slots, prompt width, KV
  blocks, chunk and sampling), without compiling or allocating; paged_attention: the config's unless given."""
  from llamarl_jax import build
  from llamarl_jax.generation.slot_programs import SlotPrograms

  g, s = run.config.generator, run.shapes
  sampler = build.sampler(run.model, run.config, mesh, run.tokenizer)
  return SlotPrograms(sampler.config, sampler, num_slots=s.slots,
                      sampling=build.rollout_sampling(run.config.rollout, run.tokenizer),
                      max_prompt_len=sampler.prompt_bucket(s.engine_prompt_len), chunk_steps=g.chunk_steps,
                      pad_id=sampler.pad_id, kv_block_size=s.kv_block_size,
                      paged_attention=paged_attention or g.paged_attention, min_decode_width=g.min_decode_width,
                      num_lanes=s.lanes, recompute=g.recompute_kv)


def compile_slot_program(programs, key: tuple) -> "Program":
  """One program of the slot engine's set compiled as the engine compiles it (`SlotPrograms.compile`:
  decode programs with `DECODE_COMPILER_OPTIONS`)."""
  from llamarl_jax.generation.program_set import DECODE_COMPILER_OPTIONS, compile_lowered

  lowered = programs.lower(key)
  return compile_program(lambda: compile_lowered(lowered, DECODE_COMPILER_OPTIONS if key[0] == "decode" else None))


@dataclasses.dataclass(frozen=True)
class Figures:
  """What a program compiled for the H100 costs (see the module docstring); bytes per device."""
  compile_s: float
  kernels: int
  gemms: int
  bytes: float
  argument_bytes: float
  output_bytes: float
  temp_bytes: float

  def row(self) -> dict:
    return {"compile_s": round(self.compile_s, 1), "kernels": self.kernels, "gemms": self.gemms,
            "bytes": self.bytes, "argument_bytes": self.argument_bytes, "output_bytes": self.output_bytes,
            "temp_bytes": self.temp_bytes}


@dataclasses.dataclass(frozen=True)
class Program:
  """A program compiled for the H100: the `jax.stages.Compiled`, its optimized HLO (the GPU's kernels)
  and its figures."""
  compiled: Any
  text: str
  figures: Figures


def compile_program(compile_fn) -> Program:
  """`compile_fn()` (-> `jax.stages.Compiled`) timed, and the compiled program's figures."""
  t0 = time.perf_counter()
  compiled = compile_fn()
  seconds = time.perf_counter() - t0
  text = compiled.as_text()
  xla_bytes, generic = hlo.compiled_bytes_accessed(compiled)
  moved = xla_bytes - hlo.fused_index_overcount(text) + hlo.library_call_bytes(text) if generic else xla_bytes
  kernels = hlo.kernel_counts(text)
  mem = compiled.memory_analysis()
  return Program(compiled, text, Figures(
      compile_s=seconds, kernels=kernels["total"], gemms=kernels["gemm"], bytes=float(moved),
      argument_bytes=float(mem.argument_size_in_bytes), output_bytes=float(mem.output_size_in_bytes),
      temp_bytes=float(mem.temp_size_in_bytes)))


# ------------------------------------------------------------------------------------------------
# bounds.json: {"_tolerance": {...}, "_why": "...", "<program>": {figure: recorded value, ...}}


def read_bounds() -> dict:
  return json.loads(BOUNDS.read_text()) if BOUNDS.exists() else {}


def out_of_bounds(name: str, got: Figures, bounds: dict) -> list[str]:
  """What of `got` lies outside `bounds[name]`'s band (bounds.json's `_tolerance`: `relative` to the
  recorded value, at least `bytes_floor` for a byte figure; compile seconds have an upper bound only,
  `compile_s_factor` times the recorded value plus `compile_s_slack`)."""
  if name not in bounds:
    return [f"no figures recorded for {name!r} in {BOUNDS.name}: record them with "
            f"{RECORD_ENV}=1 make test-cuda-compile ARGS='-k <test>'"]
  tol, have = bounds["_tolerance"], got.row()
  problems = []
  for figure, recorded in bounds[name].items():
    value = have[figure]
    if figure == "compile_s":
      limit = recorded * tol["compile_s_factor"] + tol["compile_s_slack"]
      if value > limit:
        problems.append(f"compiled in {value:.1f} s, over {limit:.0f} s (recorded: {recorded} s)")
      continue
    band = max(tol["relative"] * abs(recorded), tol["bytes_floor"] if figure.endswith("bytes") else 0)
    if abs(value - recorded) > band:
      problems.append(f"{figure} {value:.6g}, recorded {recorded:.6g} +- {band:.3g}")
  return problems


def record_bounds(name: str, value: Any) -> None:
  """Write `value` as `name`'s entry (read-modify-write under a lock: pytest workers share the file)."""
  with open(Path(tempfile.gettempdir()) / "llamarl_cuda_compile_bounds.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    bounds = read_bounds()
    bounds[name] = value
    BOUNDS.write_text("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(bounds.items()))
                      + "\n}\n")


def recording() -> bool:
  return os.environ.get(RECORD_ENV) == "1"


def recorded(name: str, value: Any) -> Any:
  """bounds.json's entry `name` (None when absent); when recording, `value`, written there first."""
  if recording():
    record_bounds(name, value)
    return value
  return read_bounds().get(name)


def versions() -> str:
  """The jax / jaxlib / CUDA plugin versions the figures come from (printed with the table)."""
  from importlib.metadata import version

  return f"jax {jax.__version__}, jaxlib {compat.jaxlib_version()}, jax-cuda12-plugin {version('jax-cuda12-plugin')}"
