#!/usr/bin/env python
"""Soak run: many RL steps of the tiny config, with host memory and live device buffers sampled.

A long run must not grow: a leak of one buffer per step, a Python list that keeps every step's
metrics, a reward worker that bloats, all show up only after thousands of steps. This runs the
`configs/tiny_cpu.gin` model and batch (0.8M-parameter Llama, arithmetic, 16 prompts x 8 samples,
lag 1, trainer FSDP over 2 fake devices, generator data-parallel over 2 others, rewards in a worker
process, a checkpoint every 100 steps) for `--steps` steps, and every `--sample_every` steps records

  host RSS (MB) of this process, the reward workers' largest RSS (MB),
  live device arrays (`jax.live_arrays()`: count and MB).

It prints a table with each quantity after warm-up, at the end, and its growth per 1,000 steps (a
least-squares line through the samples after `--warmup` steps, divided by the value at warm-up end),
and writes every sample to `--out` (JSON).

  python scripts/soak.py --steps 2000   # 4 fake CPU devices unless XLA_FLAGS sets a count
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from llamarl_jax import compat  # noqa: E402  (no jax import: before JAX starts)

compat.ensure_cpu_devices(4)

import numpy as np


class SamplingLogger:
  """A MetricsLogger stand-in that also samples memory every `every` steps (in the controller thread,
  right after the step's weight sync, the same point of the pipeline each time)."""

  def __init__(self, every: int, progress: bool):
    self.every, self.progress = every, progress
    self.samples: list[dict] = []
    self.t0 = time.perf_counter()

  def log(self, step: int, metrics) -> None:
    if step % self.every:
      return
    import jax

    from llamarl_jax.executors.reward import process_rss_mb

    arrays = jax.live_arrays()
    row = {"step": step, "seconds": time.perf_counter() - self.t0, "host_rss_mb": process_rss_mb(os.getpid()),
           "live_arrays": len(arrays), "live_array_mb": sum(a.nbytes for a in arrays) / 2**20,
           "reward_worker_rss_mb": metrics.get("reward/worker_rss_mb"), "reward/mean": metrics.get("reward/mean")}
    self.samples.append(row)
    if self.progress:
      print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)

  def close(self) -> None:
    pass


def growth_table(samples: list[dict], warmup: int) -> list[dict]:
  """Per quantity: value at warm-up end, at the end, fitted slope and growth per 1,000 steps."""
  late = [s for s in samples if s["step"] >= warmup]
  steps = np.array([s["step"] for s in late], float)
  out = []
  for key in ("host_rss_mb", "live_arrays", "live_array_mb", "reward_worker_rss_mb"):
    vals = np.array([np.nan if s[key] is None else s[key] for s in late], float)
    ok = np.isfinite(vals)
    if ok.sum() < 2:
      continue
    slope = np.polyfit(steps[ok], vals[ok], 1)[0] * 1000.0
    base = vals[ok][0]
    out.append({"quantity": key, "at_warmup": base, "at_end": vals[ok][-1], "per_1000_steps": slope,
                "growth_pct_per_1000": 100.0 * slope / base if base else float("nan")})
  return out


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--sample_every", type=int, default=20)
  parser.add_argument("--warmup", type=int, default=200, help="steps excluded from the growth fit")
  parser.add_argument("--checkpoint_every", type=int, default=100)
  parser.add_argument("--out", default="soak.json")
  parser.add_argument("--quiet", action="store_true")
  args = parser.parse_args(argv)

  from flax import nnx

  from llamarl_jax.controller import Controller
  from llamarl_jax.data import PromptSource
  from llamarl_jax.executors.reward import RewardExecutor
  from llamarl_jax.config import OptimizerConfig, run_config
  from llamarl_jax.model.config import ModelConfig
  from llamarl_jax.model.llama import Llama, split_params
  from llamarl_jax.tokenizer import make_char_tokenizer

  tokenizer = make_char_tokenizer()
  config = ModelConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_layers=4,
                       num_heads=4, num_kv_heads=2, max_position_embeddings=64, rope_theta=10000.0,
                       tie_word_embeddings=True)
  _, params = split_params(Llama(config, rngs=nnx.Rngs(params=0)))
  logger = SamplingLogger(args.sample_every, not args.quiet)
  task = {"min_digits": 1, "max_digits": 2, "num_operands": 2, "ops": "+"}
  t0 = time.perf_counter()
  with tempfile.TemporaryDirectory() as run_dir, RewardExecutor("arithmetic", num_workers=1) as reward:
    run = run_config(reward_fn=reward.name, max_policy_lag=1, prompts_per_step=16, samples_per_prompt=8, max_new_tokens=8,
                     trainer_fsdp=2, generator_dp=2, optimizer=OptimizerConfig(lr=3e-4, warmup_steps=10),
                     checkpoint_every=args.checkpoint_every, keep_checkpoints=2, seed=0)
    c = Controller(config, params, tokenizer, PromptSource(task="arithmetic", task_kwargs=task, seed=0),
                   run_dir=run_dir, config=run, reward=reward, logger=logger, progress=False)
    try:
      steps = c.run(args.steps)
    finally:
      c.close()
  wall = time.perf_counter() - t0
  table = growth_table(logger.samples, args.warmup)
  print(f"\n{args.steps} RL steps in {wall:.0f} s ({wall / args.steps:.3f} s/step), samples every "
        f"{args.sample_every} steps, growth fitted over steps >= {args.warmup}")
  print(f"| quantity | at step {args.warmup} | at step {args.steps} | per 1,000 steps | growth / 1,000 steps |")
  print("|---|---|---|---|---|")
  for r in table:
    print(f"| {r['quantity']} | {r['at_warmup']:.1f} | {r['at_end']:.1f} | {r['per_1000_steps']:+.2f} | "
          f"{r['growth_pct_per_1000']:+.2f}% |")
  result = {"args": vars(args), "wall_seconds": wall, "table": table, "samples": logger.samples,
            "final_reward_mean": float(np.mean([m["reward/mean"] for m in steps[-50:]]))}
  Path(args.out).write_text(json.dumps(result, indent=1))
  return result


if __name__ == "__main__":
  main()
