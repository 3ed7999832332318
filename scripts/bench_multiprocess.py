#!/usr/bin/env python
"""Asynchronous vs synchronous RL across processes: trainer and generator on their own cores.

Two processes of one jax.distributed job (scripts/launch_local.py): process 0 is the trainer, pinned
to core 0, process 1 the generator (with its reward workers), pinned to core 1 (`taskset`). Nothing
is emulated: generation and training really run at the same time on disjoint hardware, and weights
and batches cross processes (`llamarl_jax/transfer.py`). The same workload runs at max_policy_lag 0
(the synchronous baseline: generate, score, train, push, in sequence) and at lag 1; the table gives
the mean step time over the timed steps (after warm-up), the speed-up over lag 0, and the stage
times from the metrics (time/generate_busy and time/reward_busy measured in the generator process, time/train,
time/sync and time/trainer_wait in the trainer process).

  python scripts/bench_multiprocess.py                    # needs >= 2 cores and `taskset`
  python scripts/bench_multiprocess.py --hidden 256 --steps 12
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _launcher():
  spec = importlib.util.spec_from_file_location("launch_local", ROOT / "scripts" / "launch_local.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def run_one(args, lag: int, run_dir: Path) -> dict:
  bindings = [
      f"ModelConfig.hidden_size = {args.hidden}", f"ModelConfig.intermediate_size = {3 * args.hidden}",
      f"ModelConfig.num_layers = {args.layers}", f"ModelConfig.num_heads = {max(args.hidden // 32, 1)}",
      f"ModelConfig.num_kv_heads = {max(args.hidden // 64, 1)}", "ModelConfig.max_position_embeddings = 128",
      "run_experiment.sft = False", "run_experiment.eval_size = 0", "run_experiment.export = False",
      "run_experiment.tensorboard = False", "run_experiment.progress = False",
      f"run_experiment.rl_steps = {args.warmup + args.steps}",
      f"ScheduleConfig.max_policy_lag = {lag}", f"RolloutConfig.prompts_per_step = {args.prompts}",
      f"RolloutConfig.samples_per_prompt = {args.samples}", f"RolloutConfig.max_new_tokens = {args.max_new_tokens}",
      "MeshConfig.trainer_fsdp = 1", "MeshConfig.generator_dp = 1", "RewardConfig.workers = 1",
      "TrainConfig.checkpoint_every = 0", "OptimizerConfig.lr = 1e-4",
  ]
  train_args = ["--gin_file=configs/tiny_cpu.gin", f"--run_dir={run_dir}"] + [f"--gin_param={b}" for b in bindings]
  out = io.StringIO()
  pin = None if args.no_pin else [[args.trainer_core], [args.generator_core]]
  status = _launcher().launch(2, train_args, cpu_devices=1, timeout_s=args.timeout_s, out=out, cpu_affinity=pin)
  if status != 0:
    sys.stdout.write(out.getvalue())
    raise SystemExit(f"the lag-{lag} job failed with status {status}")
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  timed = [r for r in rows if "reward/mean" in r][args.warmup:]
  mean = lambda k: float(np.mean([r[k] for r in timed]))
  return {"lag": lag, "step_s": mean("time/step"), "generate_s": mean("time/generate_busy"),
          "reward_s": mean("time/reward_busy"), "train_s": mean("time/train"), "sync_s": mean("time/sync"),
          "trainer_wait_s": mean("time/trainer_wait"), "generator_wait_s": mean("time/generator_wait"),
          "lag_max": max(r["policy/lag_max"] for r in timed)}


def main(argv=None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--lags", default="0,1")
  p.add_argument("--hidden", type=int, default=128)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--prompts", type=int, default=16)
  p.add_argument("--samples", type=int, default=8)
  p.add_argument("--max_new_tokens", type=int, default=16)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--trainer_core", type=int, default=0)
  p.add_argument("--generator_core", type=int, default=1)
  p.add_argument("--no_pin", action="store_true", help="do not pin the processes to cores")
  p.add_argument("--timeout_s", type=float, default=900)
  args = p.parse_args(argv)
  if not args.no_pin and (shutil.which("taskset") is None or os.cpu_count() < 2):
    raise SystemExit("pinning needs `taskset` and >= 2 cores; pass --no_pin to run unpinned")

  load_before = os.getloadavg()
  with tempfile.TemporaryDirectory() as tmp:
    rows = [run_one(args, lag, Path(tmp) / f"lag{lag}") for lag in map(int, args.lags.split(","))]
  load_after = os.getloadavg()
  pin = "unpinned" if args.no_pin else f"trainer on core {args.trainer_core}, generator on core {args.generator_core}"
  print(f"\nbench_multiprocess: 2 processes ({pin}), {os.cpu_count()} cores, model hidden {args.hidden} x "
        f"{args.layers} layers, {args.prompts} prompts x {args.samples} samples, {args.max_new_tokens} new tokens, "
        f"{args.steps} timed steps after {args.warmup} warm-up; load average {load_before[0]:.1f} before, "
        f"{load_after[0]:.1f} after\n")
  print("| max_policy_lag | step s | speed-up vs lag 0 | generate s | reward s | train s | sync s "
        "| trainer wait s | generator wait s | max lag seen |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  base = next((r for r in rows if r["lag"] == 0), rows[0])
  for r in rows:
    print(f"| {r['lag']} | {r['step_s']:.3f} | {base['step_s'] / r['step_s']:.2f}x | {r['generate_s']:.3f} | "
          f"{r['reward_s']:.3f} | {r['train_s']:.3f} | {r['sync_s']:.3f} | {r['trainer_wait_s']:.3f} | "
          f"{r['generator_wait_s']:.3f} | {r['lag_max']:.0f} |")
  return rows


if __name__ == "__main__":
  main()
