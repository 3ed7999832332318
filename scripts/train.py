#!/usr/bin/env python
"""Run an RL post-training job: `python scripts/train.py --gin_file=configs/tiny_cpu.gin [--gin_param=...]`.

Gin bindings are parsed and validated before anything is built or compiled, so a misspelt
configurable or parameter fails immediately with gin's error.
"""

import argparse
import json
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--gin_file", action="append", default=[], help="gin config file (repeatable)")
  parser.add_argument("--gin_param", action="append", default=[], help="gin binding, e.g. Controller.max_policy_lag=2")
  parser.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
  parser.add_argument("--run_dir", default=None, help="overrides run_experiment.run_dir")
  args = parser.parse_args(argv)
  if not args.gin_file:
    parser.error("at least one --gin_file is required (e.g. configs/tiny_cpu.gin)")

  import gin

  from llamarl_jax import experiment  # registers the configurables

  bindings = list(args.gin_param)
  if args.run_dir:
    bindings.append(f"run_experiment.run_dir = '{args.run_dir}'")
  if args.resume:
    bindings.append("run_experiment.resume = True")
  gin.parse_config_files_and_bindings(args.gin_file, bindings)

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


if __name__ == "__main__":
  main()
