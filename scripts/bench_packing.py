"""Token efficiency of the trainer's layouts: real tokens / computed tokens, padded vs grouped by length
vs packed, from the rows' lengths alone (no model runs: the positions a step's forward computes are a
function of the layout).

  padded:   every row at the batch's width P + R: B * (P + R) positions;
  grouped:  `group_by_length` into M microbatches of B/M rows, each at its longest row's rung:
            B/M * sum(widths) (one compiled program per width seen);
  packed:   `pack_rows` into rows of T = tokens_per_microbatch tokens: bins * T (one program).

Workloads: `make run`'s batches (configs/tiny_cpu.gin: 16 arithmetic prompts x 8 samples, the char
tokenizer, P = the prompt bucket, R = 8; responses as the warm-started policy writes them: the
reference answer + EOS) and a long-tail RL batch at 1B shapes (64 rows, prompts of 512 tokens,
responses log-normal with mean 1024 tokens, sigma 1, capped at 8192). Each over `--batches` batches.

    python scripts/bench_packing.py [--batches 50]
"""

from __future__ import annotations

import argparse

import numpy as np

from llamarl_jax.train.layout import group_by_length, pack_rows


def layouts(batches: list[np.ndarray], width: int, microbatches: list[int], tokens: list[int]) -> list[tuple]:
  """(layout, computed / real tokens averaged over the batches (max), programs compiled) per layout."""
  real = np.array([b.sum() for b in batches], np.float64)
  rows = []
  ratio = lambda computed: (float(np.mean(computed / real)), float(np.max(computed / real)))
  rows.append(("padded", *ratio(np.array([len(b) * width for b in batches])), 1))
  for m in microbatches:
    groups = [group_by_length(b, m, width) for b in batches]
    computed = np.array([len(b) // m * sum(g.widths) for b, g in zip(batches, groups)])
    widths = {w for g in groups for w in g.widths}
    rows.append((f"grouped, {m} microbatches of {len(batches[0]) // m} rows", *ratio(computed), len(widths)))
  for t in tokens:
    plans = [pack_rows(b, t) for b in batches]
    rows.append((f"packed, {t} tokens a row", *ratio(np.array([p.bins * t for p in plans])), 1))
  return rows


def make_run_batches(n: int) -> tuple[list[np.ndarray], int]:
  """Row lengths of `make run`'s batches (prompt + reference answer + EOS, capped at R = 8) and P + R."""
  from llamarl_jax.data import PromptSource
  from llamarl_jax.generation.sampler import DEFAULT_PROMPT_BUCKETS
  from llamarl_jax.tokenizer import make_char_tokenizer

  tok = make_char_tokenizer()
  source = PromptSource(task="arithmetic", seed=0, task_kwargs={"min_digits": 1, "max_digits": 2, "num_operands": 2,
                                                                 "ops": "+", "demo_prefix": "ans ",
                                                                 "demo_prefix_rate": 0.7})
  batches, width = [], 0
  for _ in range(n):
    examples = source.next_batch(16)
    prompts = [len(tok(source.format_prompt(ex.question), add_special_tokens=False)["input_ids"]) for ex in examples]
    answers = [min(len(tok(source.reference(ex), add_special_tokens=False)["input_ids"]) + 1, 8) for ex in examples]
    batches.append(np.repeat(np.array(prompts) + np.array(answers), 8))
    bucket = next(b for b in sorted(DEFAULT_PROMPT_BUCKETS) if b >= max(prompts))
    width = max(width, bucket + 8)
  return batches, width


def long_tail_batches(n: int, seed: int = 0) -> tuple[list[np.ndarray], int]:
  """64 rows: 512 prompt tokens + a log-normal response (mean 1024, sigma 1, 1..8192); width 512 + 8192."""
  rng = np.random.default_rng(seed)
  sigma = 1.0
  mu = np.log(1024) - sigma ** 2 / 2
  out = [512 + np.clip(np.round(rng.lognormal(mu, sigma, 64)), 1, 8192).astype(np.int64) for _ in range(n)]
  return out, 512 + 8192


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--batches", type=int, default=50)
  args = ap.parse_args()
  small, small_width = make_run_batches(args.batches)
  tail, tail_width = long_tail_batches(args.batches)
  print(f"make run: 128 rows, P + R = {small_width}, real tokens a row {np.mean([b.mean() for b in small]):.1f}; "
        f"long tail: 64 rows, P + R = {tail_width}, real tokens a row {np.mean([b.mean() for b in tail]):.0f} "
        f"(longest {max(b.max() for b in tail)}); {args.batches} batches each")
  print(f"| workload | layout | computed / real tokens (mean) | worst batch | efficiency | programs |")
  print("|---|---|---|---|---|---|")
  for name, (batches, width, mbs, toks) in {
      "make run": (small, small_width, [1, 8], [small_width, 64, 256]),
      "long tail 1B": (tail, tail_width, [8, 16], [tail_width, 16384, 32768])}.items():
    for layout, mean, worst, programs in layouts(batches, width, mbs, toks):
      print(f"| {name} | {layout} | {mean:.3f}x | {worst:.3f}x | {1 / mean:.1%} | {programs} |")


if __name__ == "__main__":
  main()
