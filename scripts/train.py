#!/usr/bin/env python
"""Run an RL post-training job: `python scripts/train.py --gin_file=configs/tiny_cpu.gin [--gin_param=...]`.

Gin bindings are parsed and validated before anything is built or compiled, so a misspelt
configurable or parameter fails immediately with gin's error.

Many processes (one jax.distributed job; README "Many hosts"): pass --coordinator_address,
--num_processes and --process_id (what `scripts/launch_local.py` does on one machine), or run under
SLURM / Open MPI, where they are read from the environment. Without either, one process as always.
"""

import argparse
import json
import os
import signal
import sys


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--gin_file", action="append", default=[], help="gin config file (repeatable)")
  parser.add_argument("--gin_param", action="append", default=[], help="gin binding, e.g. ScheduleConfig.max_policy_lag=2")
  parser.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
  parser.add_argument("--run_dir", default=None, help="overrides run_experiment.run_dir")
  parser.add_argument("--debug", action="store_true",
                      help="on a configuration or input error, raise it with its traceback instead of one message")
  many = parser.add_argument_group("many processes (jax.distributed)")
  many.add_argument("--coordinator_address", default=None, help="host:port of process 0's coordination service")
  many.add_argument("--num_processes", type=int, default=None)
  many.add_argument("--process_id", type=int, default=None)
  many.add_argument("--local_device_ids", default=None, help="comma-separated accelerator ids this process uses")
  many.add_argument("--cpu_devices", type=int, default=None,
                    help="CPU devices of this process (default: the config's devices / num_processes)")
  many.add_argument("--transfer_address", default=None, help="host:port of this process's transfer socket (CPU)")
  many.add_argument("--heartbeat_timeout_s", type=int, default=10,
                    help="a process silent this long counts as dead; the others exit naming it")
  args = parser.parse_args(argv)
  if not args.gin_file:
    parser.error("at least one --gin_file is required (e.g. configs/tiny_cpu.gin)")

  from llamarl_jax import config_check, experiment  # registers the configurables
  from llamarl_jax.model.hf import CheckpointError

  try:
    return _run(args, experiment, config_check)
  except (config_check.ConfigError, CheckpointError) as e:  # the user's to fix: one message, no traceback
    if args.debug:
      raise
    message = "\n".join(line for line in str(e).splitlines() if not line.startswith("  In call to configurable"))
    sys.exit(f"error: {message}\n(--debug shows the traceback)")


def _run(args, experiment, config_check) -> dict:
  bindings = list(args.gin_param)
  if args.run_dir:
    bindings.append(f"run_experiment.run_dir = '{args.run_dir}'")
  if args.resume:
    bindings.append("run_experiment.resume = True")
  try:
    experiment.parse_gin(args.gin_file, bindings)  # refuses flat Controller.* keys, naming the typed ones
  except (OSError, ValueError, TypeError) as e:  # a missing file (gin's resource lookup may fail with a
    # TypeError), an unknown configurable or parameter, a syntax error
    if isinstance(e, config_check.ConfigError):
      raise
    raise config_check.ConfigError(f"the gin config cannot be parsed: {type(e).__name__}: {e}\n(gin reads files and "
                                   f"their includes relative to the working directory, here {os.getcwd()})") from e
  config_check.check_bindings()  # every binding's type and range, then every file and directory they name
  config_check.check_inputs()
  if _join_job(args):
    return _run_one_of_many(experiment)

  def on_sigterm(signum, frame):  # stop like Ctrl-C: the controller checkpoints the last finished step
    raise KeyboardInterrupt(f"signal {signum}")

  signal.signal(signal.SIGTERM, on_sigterm)
  try:
    summary = experiment.run_experiment()
  except KeyboardInterrupt as e:  # experiment.RunInterrupted says what was saved
    print(f"\n{e}" if isinstance(e, experiment.RunInterrupted) else "\ninterrupted during set-up: nothing was saved",
          file=sys.stderr)
    sys.exit(130)
  print("\n=== summary ===")
  print(json.dumps({k: v for k, v in summary.items() if k != "samples_after"}, indent=2, default=str))
  print("sample completions after RL:")
  for prompt, completion in summary.get("samples_after", []):
    print(f"  {prompt!r} -> {completion!r}")
  return summary


def _config_devices() -> int:
  """Devices the config's meshes use (trainer + generator, colocated: shared; + the reward model's own)."""
  from llamarl_jax import parallel
  from llamarl_jax.experiment import mesh_layout

  return parallel.device_counts(**mesh_layout())[3]


def _join_job(args) -> bool:
  """jax.distributed.initialize from the flags or a SLURM / Open MPI job; False for one process."""
  from llamarl_jax import distributed

  cpu_devices = args.cpu_devices
  if cpu_devices is None and args.num_processes and args.num_processes > 1 and distributed.on_cpu():
    needed = _config_devices()
    if needed % args.num_processes:
      raise SystemExit(f"the config's meshes use {needed} devices, which {args.num_processes} processes cannot "
                       "share evenly; pass --cpu_devices (devices per process) or change --num_processes")
    cpu_devices = needed // args.num_processes
  ids = [int(i) for i in args.local_device_ids.split(",")] if args.local_device_ids else None
  return distributed.initialize(args.coordinator_address, args.num_processes, args.process_id, ids,
                                cpu_devices=cpu_devices, transfer_address=args.transfer_address,
                                heartbeat_timeout_s=args.heartbeat_timeout_s)


def _run_one_of_many(experiment) -> dict:
  """This process's part of a multi-process job (`distributed.run_process`: a failure here ends
  every other process within seconds, naming this one; a failure elsewhere ends this one)."""
  import jax

  from llamarl_jax import distributed

  roles = experiment.process_roles()
  signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(128 + signum))  # stopped by the launcher
  summary = distributed.run_process(experiment.run_experiment, roles)
  if jax.process_index() == 0:
    print("\n=== summary ===")
    print(json.dumps({k: v for k, v in summary.items() if k != "samples_after"}, indent=2, default=str))
  return summary


if __name__ == "__main__":
  main()
