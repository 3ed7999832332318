#!/usr/bin/env python
"""Asynchronous vs synchronous RL step time (LlamaRL's headline measurement), one invocation.

The same RL workload (tiny Llama, arithmetic task, same seed and batch) runs at max_policy_lag 0 (the
synchronous baseline: generate, score, train, sync in sequence) and at lag 1 and 2. For each it reports
the mean step time after warm-up, the speed-up over lag 0, and from the controller's timeline the
fraction of wall time each executor was busy and how long generation and training overlapped.

On CPU the meshes are fake devices sharing the machine's cores, so generator and trainer compete for
the same cores; `--generator_delay_s` adds a per-batch sleep that holds the generator like a
latency-bound remote inference engine (the regime the paper's speed-up comes from: generation
dominates). Both rows are printed by default. On a GPU machine, meshes are real disjoint devices.

  python scripts/bench_async.py                      # CPU: 8 fake devices via XLA_FLAGS (make bench)
  python scripts/bench_async.py --hidden 512 --layers 8 --steps 20   # bigger model
  python scripts/bench_async.py --engines static,slots --lags 1 --delays 0   # the generator engines

`--engines`: the generator engine(s) (`GeneratorConfig.engine`: 'slots' continuous batching, the
default, or 'static' batches); with both, each row also reports its step time against the static
engine's row of the same lag and delay.
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np


def run_one(args, lag: int, delay: float, engine: str = "slots") -> dict:
  from flax import nnx

  from llamarl_jax.controller import Controller, overlap_seconds
  from llamarl_jax.data import PromptSource
  from llamarl_jax.executors.reward import RewardExecutor
  from llamarl_jax.config import OptimizerConfig, run_config
  from llamarl_jax.model.config import ModelConfig
  from llamarl_jax.model.llama import Llama, split_params
  from llamarl_jax.tokenizer import make_char_tokenizer

  tokenizer = make_char_tokenizer()
  config = ModelConfig(vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                       num_layers=args.layers, num_heads=max(args.hidden // 32, 1),
                       num_kv_heads=max(args.hidden // 64, 1), max_position_embeddings=128,
                       tie_word_embeddings=True)
  _, params = split_params(Llama(config, rngs=nnx.Rngs(params=0)))
  with tempfile.TemporaryDirectory() as run_dir, RewardExecutor("arithmetic", num_workers=1) as reward:
    run = run_config(reward_fn=reward.name, max_policy_lag=lag, prompts_per_step=args.prompts,
                     samples_per_prompt=args.samples, max_new_tokens=args.max_new_tokens,
                     trainer_fsdp=args.trainer_fsdp, generator_dp=args.generator_dp, generator_tp=args.generator_tp,
                     optimizer=OptimizerConfig(lr=1e-4), generator_delay_s=delay, buffer_capacity=max(lag, 1) + 1,
                     generator_engine=engine, engine_max_prompt_len=16, seed=0,
                     colocated=getattr(args, "colocated", False))
    c = Controller(config, params, tokenizer, PromptSource(task="arithmetic", seed=0), run_dir=run_dir, config=run,
                   reward=reward, progress=False)
    try:
      steps = c.run(args.warmup + args.steps)
      timed = steps[args.warmup:]
    finally:
      c.close()
  # Timeline over the timed window: from the end of the last warm-up train interval to the last one.
  train_spans = [(s, e) for name, s, e in c.timeline if name == "train"]
  start = train_spans[args.warmup - 1][1] if args.warmup else train_spans[0][0]
  end = train_spans[-1][1]
  window = [(n, max(s, start), min(e, end)) for n, s, e in c.timeline if e > start and s < end]
  wall = end - start
  busy = {n: sum(e - s for m, s, e in window if m == n) / wall for n in ("generate", "reward", "train")}
  return {
      "engine": engine, "lag": lag, "delay": delay, "step_s": float(np.mean([m["time/step"] for m in timed])),
      "wall_per_step": wall / len(timed), "busy": busy,
      "overlap_s": overlap_seconds(window, "generate", "train") / len(timed),
      "trainer_wait_s": float(np.mean([m["time/trainer_wait"] for m in timed])),
      "sync_s": float(np.mean([m["time/sync"] for m in timed])),
      "lag_max": max(m["policy/lag_max"] for m in timed),
      "slot_util": float(np.mean([m.get("generate/slot_utilization", np.nan) for m in timed])),
  }


def main(argv=None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--lags", default="0,1,2")
  p.add_argument("--delays", default="0,0.3", help="per-batch generator sleep(s) in seconds, one table row set each")
  p.add_argument("--hidden", type=int, default=128)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--prompts", type=int, default=16)
  p.add_argument("--samples", type=int, default=8)
  p.add_argument("--max_new_tokens", type=int, default=16)
  p.add_argument("--trainer_fsdp", type=int, default=2)
  p.add_argument("--generator_dp", type=int, default=2)
  p.add_argument("--generator_tp", type=int, default=1)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--engines", default="slots", help="generator engines to run: slots, static or both")
  args = p.parse_args(argv)

  import jax

  engines = args.engines.split(",")
  for e in engines:
    if e not in ("slots", "static"):
      p.error(f"unknown engine {e!r}; expected slots or static")
  rows = [run_one(args, lag, delay, engine) for delay in map(float, args.delays.split(","))
          for lag in map(int, args.lags.split(",")) for engine in engines]
  print(f"\nbench_async: {jax.device_count()} x {jax.devices()[0].device_kind}, model hidden {args.hidden} x "
        f"{args.layers} layers, {args.prompts} prompts x {args.samples} samples, {args.max_new_tokens} new "
        f"tokens, trainer fsdp {args.trainer_fsdp} | generator dp {args.generator_dp} tp {args.generator_tp}, "
        f"{args.steps} timed steps after {args.warmup} warm-up\n")
  both = len(engines) > 1
  print("| gen delay s | max_policy_lag | engine | step s | speed-up vs lag 0 |" + (" vs static |" if both else "")
        + " gen busy | train busy | reward busy | gen/train overlap s per step | trainer wait s | sync s "
        "| max lag seen | slot util |")
  print("|---|---|---|---|---|" + ("---|" if both else "") + "---|---|---|---|---|---|---|---|")
  for r in rows:
    # speed-up against the lag-0 row of the same delay and engine (against itself when --lags omits 0)
    same = lambda b, **kw: all(b[k] == r[k] for k in ("delay", "lag", "engine") if k not in kw) and all(
        b[k] == v for k, v in kw.items())
    base = next((b for b in rows if same(b, lag=0)), r)
    static = next((b for b in rows if same(b, engine="static")), r)
    print(f"| {r['delay']:.2f} | {r['lag']} | {r['engine']} | {r['wall_per_step']:.3f} | "
          f"{base['wall_per_step'] / r['wall_per_step']:.2f}x |"
          + (f" {static['wall_per_step'] / r['wall_per_step']:.2f}x |" if both else "")
          + f" {r['busy']['generate']:.0%} | {r['busy']['train']:.0%} | {r['busy']['reward']:.0%} | "
          f"{r['overlap_s']:.3f} | {r['trainer_wait_s']:.3f} | {r['sync_s']:.4f} | {r['lag_max']:.0f} | "
          + (" - |" if np.isnan(r["slot_util"]) else f"{r['slot_util']:.0%} |"))
  return rows


if __name__ == "__main__":
  main()
