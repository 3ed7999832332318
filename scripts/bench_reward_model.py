#!/usr/bin/env python
"""Reward-model scoring throughput: `RewardModel.score_tokens` on batches of rows of random lengths.

For each model size and batch (rows, lengths uniform in [min_len, max_len]) it reports the first call
(compilation included), then the median of `--repeats` calls on fresh rows of the same distribution:
rows/s, real tokens/s, the padded share of the computed positions (rows sorted by length into chunks
of `--batch_rows`, each at a power-of-two width), and the programs compiled in all. Weights are random (a fresh score-head decoder; no checkpoint needed).

  python scripts/bench_reward_model.py                       # ~1M and ~12M params, < 1 min on 2 cores
  python scripts/bench_reward_model.py --sizes 256x4 --rows 64,256 --max_len 512
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from llamarl_jax import compat  # (no jax import: before JAX starts)

compat.ensure_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from llamarl_jax.model.config import ModelConfig  # noqa: E402
from llamarl_jax.model.llama import init_model, split_params  # noqa: E402
from llamarl_jax.rewards.reward_model import RewardModel  # noqa: E402


def build(hidden: int, layers: int, vocab: int, context: int, batch_rows: int) -> RewardModel:
  config = ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_layers=layers,
                       num_heads=max(hidden // 64, 2), num_kv_heads=max(hidden // 128, 1),
                       max_position_embeddings=context, rope_theta=10000.0, num_labels=1)
  return RewardModel(config, split_params(init_model(config))[1], pad_id=0, batch_rows=batch_rows)


def main(argv=None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--sizes", default="64x2,256x4", help="hidden x layers, comma-separated")
  p.add_argument("--rows", default="32,128", help="rows per batch, comma-separated")
  p.add_argument("--min_len", type=int, default=16)
  p.add_argument("--max_len", type=int, default=160)
  p.add_argument("--vocab", type=int, default=512)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--batch_rows", type=int, default=32, help="rows per device program (chunks sorted by length)")
  args = p.parse_args(argv)
  rng = np.random.default_rng(0)
  out = []
  print(f"reward-model scoring, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"jax {jax.__version__} ({jax.default_backend()}); lengths uniform in [{args.min_len}, {args.max_len}]")
  print(f"{'model':>12} {'params':>8} {'rows':>5} {'first call s':>12} {'rows/s':>9} {'tokens/s':>10} "
        f"{'padded':>7} {'programs':>8}")
  for size in args.sizes.split(","):
    hidden, layers = map(int, size.split("x"))
    rm = build(hidden, layers, args.vocab, 2 * args.max_len, args.batch_rows)
    for n in map(int, args.rows.split(",")):

      def batch():
        lengths = rng.integers(args.min_len, args.max_len + 1, size=n)
        return [rng.integers(1, args.vocab, size=k).tolist() for k in lengths]

      t0 = time.perf_counter()
      rm.score_tokens(batch())
      first = time.perf_counter() - t0
      times, tokens, computed = [], [], []
      for _ in range(args.repeats):
        rows = batch()
        t0 = time.perf_counter()
        rm.score_tokens(rows)
        times.append(time.perf_counter() - t0)
        tokens.append(sum(map(len, rows)))
        ordered = sorted(rows, key=len)
        computed.append(sum(int(np.prod(rm.chunk_shape(len(chunk), max(map(len, chunk)))))
                            for chunk in (ordered[i:i + rm.batch_rows] for i in range(0, n, rm.batch_rows))))
      med = statistics.median(times)
      row = {"model": size, "params": rm.config.num_params(), "rows": n, "first_s": first, "rows_per_s": n / med,
             "tokens_per_s": float(np.mean(tokens)) / med, "padded": 1 - sum(tokens) / sum(computed),
             "programs": rm.num_programs}
      out.append(row)
      print(f"{size:>12} {row['params'] / 1e6:7.1f}M {n:5d} {first:12.2f} {row['rows_per_s']:9.1f} "
            f"{row['tokens_per_s']:10.0f} {row['padded']:7.1%} {row['programs']:8d}")
  return out


if __name__ == "__main__":
  main()
