"""What depends on the JAX release: the XLA flags a process sets, and JAX's private entry points
(and the one private reach into gin-config, `gin_parsed_bindings`).

Supported: jax 0.10.2 (Python 3.10-3.11), 0.11.2 (the GPU machines', CUDA 13) and 0.12 (Python
3.12+); `pyproject.toml` pins the range. Everything here is a function a test calls on the running
version (`tests/test_compat.py`), so a JAX release that moves one of these breaks this file, loudly,
and nothing else.

XLA flags. An unknown flag in `XLA_FLAGS` aborts the process when XLA starts (jax 0.10.2 has
`--xla_cpu_use_fusion_emitters`, 0.11.2 and 0.12 do not), so the flags a run sets are chosen here from
what the running XLA defines: its flag table is the set of NUL-terminated flag names compiled into
jaxlib's XLA library (a removed flag's name survives there only inside the options proto's reserved
names, which are not NUL-terminated). `xla_env` builds a process environment,
`python -m llamarl_jax.compat [options] -- command ...` runs a command in one (the Makefile's form):

    python -m llamarl_jax.compat --cpu_devices 8 --compile fast -- python -m pytest
    python -m llamarl_jax.compat --print --cpu_devices 4      # the XLA_FLAGS it would set

Nothing here imports jax at module level: the launcher runs before any backend exists.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import mmap
import os
import shlex
import sys
from pathlib import Path

DEVICE_COUNT = "xla_force_host_platform_device_count"
FUSION_EMITTERS = "xla_cpu_use_fusion_emitters"
LLVM_OPT = "xla_backend_optimization_level"
COMPILE_MODES = ("default", "fast")
PALLAS_TRITON = "jax.experimental.pallas.triton"


# ----------------------------------------------------------------------------------------------------
# XLA flags


def _jaxlib_dir() -> Path:
  import importlib.util

  spec = importlib.util.find_spec("jaxlib")
  if spec is None or not spec.submodule_search_locations:
    raise RuntimeError("jaxlib is not installed: `pip install -e .` (or `make install`) installs it")
  return Path(list(spec.submodule_search_locations)[0])


def _xla_libraries() -> list[Path]:
  """The shared libraries that hold an XLA parsing XLA_FLAGS: jaxlib's (0.10-0.12: `libjax_common.so`;
  older wheels: `xla_extension.so`) and an installed PJRT plugin's (e.g. the CUDA plugin's), the large
  ones, whichever their names."""
  import importlib.util

  dirs = [_jaxlib_dir()]
  plugins = importlib.util.find_spec("jax_plugins")
  if plugins is not None and plugins.submodule_search_locations:
    dirs += [p for d in plugins.submodule_search_locations for p in Path(d).iterdir() if p.is_dir()]
  libs = [p for d in dirs for p in d.glob("*.so") if p.stat().st_size > 50 * 2**20]
  if not libs:
    raise RuntimeError(f"no XLA library (a *.so over 50 MB) in {_jaxlib_dir()}: an unsupported jaxlib layout; "
                       "llamarl_jax.compat needs a look for this jaxlib version")
  return libs


@functools.cache
def xla_accepts(flag: str) -> bool:
  """Whether the running jaxlib's XLA defines `--<flag>` (e.g. 'xla_cpu_use_fusion_emitters')."""
  name = b"\0" + flag.lstrip("-").split("=")[0].encode() + b"\0"
  for lib in _xla_libraries():
    with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
      if m.find(name) >= 0:
        return True
  return False


def cpu_flags(*, cpu_devices: int | None = None, compile: str = "default", fusion_emitters: str = "auto",
              llvm_opt: int | None = None) -> list[str]:
  """XLA flags for the CPU backend, each one the running XLA defines.

  cpu_devices: fake host devices (mesh tests, `make run`'s 4-device layout). compile: 'default', or
  'fast' for programs compiled far more often than they run (the test suite): LLVM at -O1 (XLA's
  default: -O3). fusion_emitters: 'auto' (off where this XLA has the switch: the legacy emitters
  compile about twice as fast; from jax 0.11 there are only the fusion emitters), 'on', or 'off' (an error where
  this XLA cannot turn them off). llvm_opt: an explicit LLVM level (0-3), overriding `compile`.
  """
  if compile not in COMPILE_MODES:
    raise ValueError(f"compile must be one of {COMPILE_MODES}, got {compile!r}")
  if fusion_emitters not in ("auto", "on", "off"):
    raise ValueError(f"fusion_emitters must be 'auto', 'on' or 'off', got {fusion_emitters!r}")
  flags = []
  if cpu_devices is not None:
    if int(cpu_devices) < 1:
      raise ValueError(f"cpu_devices must be >= 1, got {cpu_devices}")
    flags.append(f"--{DEVICE_COUNT}={int(cpu_devices)}")
  has_switch = xla_accepts(FUSION_EMITTERS)
  if fusion_emitters == "off" and not has_switch:
    raise ValueError(f"this XLA (jaxlib {jaxlib_version()}) has no --{FUSION_EMITTERS}: its CPU backend always "
                     "uses the fusion emitters; use fusion_emitters='auto' or 'on'")
  if has_switch:
    flags.append(f"--{FUSION_EMITTERS}={'true' if fusion_emitters == 'on' else 'false'}")
  level = llvm_opt if llvm_opt is not None else (1 if compile == "fast" else None)
  if level is not None:
    if not 0 <= int(level) <= 3:
      raise ValueError(f"llvm_opt must be in 0..3, got {level}")
    flags.append(f"--{LLVM_OPT}={int(level)}")
  return flags


def _flag_name(flag: str) -> str:
  return flag.lstrip("-").split("=")[0]


def merge_flags(existing: str, ours: list[str], *, warn: bool = True) -> str:
  """`existing` XLA_FLAGS with `ours` added (ours replace a flag of the same name); flags this XLA
  does not define are dropped, with one warning naming them (XLA would abort on them)."""
  names = {_flag_name(f) for f in ours}
  kept, unknown = [], []
  for flag in shlex.split(existing or ""):
    if _flag_name(flag) in names:
      continue
    (kept if xla_accepts(flag) else unknown).append(flag)
  if unknown and warn:
    print(f"[llamarl] XLA_FLAGS: dropped {' '.join(unknown)}: not a flag of this XLA (jaxlib {jaxlib_version()}), "
          "which would abort on it", file=sys.stderr, flush=True)
  return " ".join(kept + list(ours))


def xla_env(env: dict | None = None, **options) -> dict:
  """A copy of `env` (default `os.environ`) with XLA_FLAGS from `cpu_flags(**options)` merged in
  (`merge_flags`): the environment of a process (or a test's child interpreter) to start."""
  out = dict(os.environ if env is None else env)
  flags = merge_flags(out.get("XLA_FLAGS", ""), cpu_flags(**options))
  if flags:
    out["XLA_FLAGS"] = flags
  else:
    out.pop("XLA_FLAGS", None)
  return out


def ensure_cpu_devices(n: int) -> None:
  """Fake `n` host devices in this process unless XLA_FLAGS already sets a count; call before JAX
  starts its backends (a script's first lines)."""
  if DEVICE_COUNT not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = merge_flags(os.environ.get("XLA_FLAGS", ""), cpu_flags(cpu_devices=n))


def without_cpu_devices(flags: str) -> str:
  """XLA_FLAGS with the host device count removed (a process whose count comes from elsewhere)."""
  return " ".join(f for f in shlex.split(flags or "") if _flag_name(f) != DEVICE_COUNT)


def jaxlib_version() -> str:
  from importlib.metadata import version

  return version("jaxlib")


# ----------------------------------------------------------------------------------------------------
# JAX's private entry points (each the one place the package reaches it)


def jit_cache_size(fn) -> int:
  """Entries in a `jax.jit` function's compilation cache: programs traced and compiled so far."""
  return fn._cache_size()


def cudnn_dot_product_attention():
  """(dot_product_attention, MaskType) of JAX's cuDNN fused attention: the entry point taking per-row
  sequence lengths and offsets (packed segments), which `jax.nn.dot_product_attention` does not expose."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn

  return cudnn.dot_product_attention, cudnn.MaskType


@contextlib.contextmanager
def cudnn_target_compute_capability(capability: str = "9.0"):
  """While inside, JAX's cuDNN attention checks the target's compute capability as `capability`
  instead of the local GPU's: programs lowered for an H100 on a machine without one."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn

  target = tuple(map(int, capability.split(".")))
  saved = cudnn.check_compute_capability, cudnn.is_cuda_compute_capability_equal
  cudnn.check_compute_capability = lambda c: tuple(map(int, c.split("."))) <= target
  cudnn.is_cuda_compute_capability_equal = lambda c: c == capability
  try:
    yield
  finally:
    cudnn.check_compute_capability, cudnn.is_cuda_compute_capability_equal = saved


def coordination_client():
  """The `jax.distributed` coordination-service client of this process (its key-value store and
  barriers); RuntimeError when `jax.distributed` is not initialised."""
  from jax._src import distributed as jax_distributed

  client = jax_distributed.global_state.client
  if client is None:
    raise RuntimeError("jax.distributed is not initialized: call llamarl_jax.distributed.initialize first")
  return client


def hlo_cost_analysis(compiled) -> dict[str, float] | None:
  """XLA's generic `HloCostAnalysis` ("flops", "bytes accessed", ...) of a compiled program's
  optimised module, by the CPU backend, whatever the target it was compiled for (a GPU compiled for
  without one has no cost analysis of its own). None where the CPU backend is absent."""
  from jax._src import xla_bridge
  from jax._src.lib import xla_client

  try:
    cpu = xla_bridge.get_backend("cpu")
  except Exception:  # e.g. "Unknown backend cpu" when JAX_PLATFORMS excludes it
    return None
  module = compiled.runtime_executable().hlo_modules()[0]
  return dict(xla_client._xla.hlo_module_cost_analysis(cpu, module))


@functools.cache
def pallas_triton_missing() -> str | None:
  """Why Pallas' Triton backend cannot be used by this JAX (the import's error), or None when it can.
  Deprecated since jax 0.11 (Mosaic GPU replaces it); the GPU kernels that need it
  (`model.paged_kernel`, `model.fp8_kernels`) give way to their XLA forms where it is missing."""
  try:
    importlib.import_module(PALLAS_TRITON).CompilerParams  # noqa: B018  (the one name the kernels use)
  except Exception as e:  # ImportError, AttributeError: moved or removed
    return f"{type(e).__name__}: {e}"
  return None


def pallas_triton_compiler_params(**kwargs):
  """`jax.experimental.pallas.triton.CompilerParams(**kwargs)` (num_warps, num_stages)."""
  reason = pallas_triton_missing()
  if reason is not None:
    raise RuntimeError(f"Pallas' Triton backend is not available in this JAX ({reason}); "
                       "use the XLA forms (paged_attention='auto')")
  return importlib.import_module(PALLAS_TRITON).CompilerParams(**kwargs)


def pallas_interpreter():
  """The `interpret=` of a Pallas kernel run on the CPU that also runs inside a `shard_map` whose
  operands vary over mesh axes: Pallas' TPU interpreter (`InterpretParams`; its plain `interpret=True`
  evaluates the kernel without those axes and fails there); generic kernels only (no Triton or
  Mosaic-specific ops)."""
  from jax.experimental.pallas import tpu as pltpu

  return pltpu.InterpretParams()


def varying_axes(x) -> frozenset:
  """The mesh axes a value varies over inside a `shard_map` (empty outside one): its type's
  `manual_axis_type` (jax 0.10.2 and 0.12; earlier JAX called it `vma`)."""
  import jax

  return frozenset(jax.typeof(x).manual_axis_type.varying)


def varying_struct(shape, dtype, like):
  """A `pallas_call` out_shape that varies over the mesh axes `like` varies over: inside a `shard_map`
  that checks them (`check_vma`) an output's must be given."""
  import jax

  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).manual_axis_type)


def gin_parsed_bindings():
  """Every binding gin has parsed, as (scope, selector, {param: value}, the configurable or None where
  the selector matches none): gin has no public iterator over scoped bindings, so this reads its
  registry (gin-config 0.5)."""
  import gin

  out = []
  for (scope, selector), params in gin.config._CONFIG.items():
    try:
      configurable = gin.config._REGISTRY.get_match(selector)
    except (KeyError, ValueError):
      configurable = None
    out.append((scope, selector, params, configurable))
  return out


# ----------------------------------------------------------------------------------------------------
# python -m llamarl_jax.compat


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  command = []
  if "--" in argv:
    i = argv.index("--")
    argv, command = argv[:i], argv[i + 1:]
  parser = argparse.ArgumentParser(prog="python -m llamarl_jax.compat", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--cpu_devices", type=int, default=None, help="fake host CPU devices")
  parser.add_argument("--compile", choices=COMPILE_MODES, default="default",
                      help="'fast': LLVM -O1 (programs compiled more often than run: the tests)")
  parser.add_argument("--fusion_emitters", choices=("auto", "on", "off"), default="auto",
                      help="XLA's CPU fusion emitters ('auto': off where this XLA can turn them off)")
  parser.add_argument("--llvm_opt", type=int, default=None, help="LLVM optimisation level 0-3 (overrides --compile)")
  parser.add_argument("--print", action="store_true", help="print the XLA_FLAGS and exit")
  args = parser.parse_args(argv)
  env = xla_env(cpu_devices=args.cpu_devices, compile=args.compile, fusion_emitters=args.fusion_emitters,
                llvm_opt=args.llvm_opt)
  if args.print or not command:
    print(env.get("XLA_FLAGS", ""))
    return 0
  os.execvpe(command[0], command, env)
  return 127  # not reached


if __name__ == "__main__":
  sys.exit(main())
