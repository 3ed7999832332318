#!/usr/bin/env python
"""Print a gin config's memory plan (`llamarl_jax/memory_plan.py`) without running it: the parts per
device (trainer weights, optimizer state, gradients, the train step's activations from XLA's memory
analysis of the step compiled at the configured microbatches, generator weights, the slot engine's KV
pool, an evaluation's cache) against the device's memory. Exit status 1 when it does not fit.

--target default compiles for this machine's first devices (the run's trainer mesh); --target h100
compiles for a node of H100s that is not there (XLA's GPU compiler, `scripts/gpu_targets/`; needs JAX's
CUDA plugin, see `bench_generate.CUDA_PLUGIN_HELP`), as many as the config's meshes take:

  JAX_PLATFORMS=cpu,cuda JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 PYTHONPATH=/tmp/cudasite \\
    PATH=/tmp/cudasite/nvidia/cuda_nvcc/bin:$PATH \\
    python -m scripts.memory_plan --gin_file=configs/llama3_1b_1gpu.gin --target h100
"""

import argparse
import inspect
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bound(name: str, fn):
  """The gin binding `fn.name`, else `fn`'s default."""
  import gin

  try:
    return gin.query_parameter(f"{fn.__name__}.{name}")
  except ValueError:
    return inspect.signature(fn).parameters[name].default


def target_capacity(target: str) -> float:
  """Device memory bytes of a GPU target description (`device_memory_size`)."""
  from scripts import bench_generate
  text = (ROOT / "scripts" / "gpu_targets" / bench_generate.GPU_TARGETS[target]).read_text()
  return float(re.search(r"device_memory_size:\s*(\d+)", text).group(1))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--gin_file", action="append", default=[], help="gin config file (repeatable)")
  parser.add_argument("--gin_param", action="append", default=[], help="gin binding (repeatable)")
  parser.add_argument("--target", default="default", choices=["default", "h100"],
                      help="compile the train step for this machine's devices, or for an H100 it does not have")
  args = parser.parse_args(argv)
  if not args.gin_file:
    parser.error("at least one --gin_file is required (e.g. configs/llama3_1b_1gpu.gin)")

  from llamarl_jax import config_check, experiment, memory_plan

  experiment.parse_gin(args.gin_file, args.gin_param)
  try:
    config_check.check_inputs([("build_policy", "model_path")])  # the plan reads the model's config, no data
  except config_check.ConfigError as e:
    raise SystemExit(f"error: {e}") from None
  model_config = experiment.build_policy(weights=False)[0]
  run = experiment.configured_run_config()
  eval_size = _bound("eval_size", experiment.run_experiment)
  eval_rows = eval_size * max(1, _bound("eval_samples", experiment.run_experiment))
  kw = {}
  if args.target != "default":
    import dataclasses

    from llamarl_jax import parallel
    from scripts import bench_generate

    m = run.mesh
    devices = bench_generate.target_devices(args.target, parallel.device_counts(**dataclasses.asdict(m))[3])
    meshes = parallel.make_meshes(**dataclasses.asdict(m), devices=devices)
    capacity = target_capacity(args.target)
    kw = dict(mesh=meshes[0], generator_mesh=meshes[1], capacity=capacity, limit=memory_plan.target_limit(capacity),
              reward_mesh=parallel.make_reward_mesh(**dataclasses.asdict(m), devices=devices) or meshes[1])
  plan = memory_plan.plan_run(model_config, run, eval_rows=eval_rows, compile=True, **kw)
  print(f"{', '.join(args.gin_file)} {' '.join(args.gin_param)}: {model_config.num_params() / 1e9:.2f}B parameters")
  print(plan.table())
  if not plan.fits:
    raise SystemExit(1)
  return plan


if __name__ == "__main__":
  main()
