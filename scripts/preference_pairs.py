#!/usr/bin/env python
"""Write preference pairs of the synthetic arithmetic task as JSONL, for `scripts/train_rm.py`.

    python scripts/preference_pairs.py --out runs/rm_pairs --train 4000 --heldout 500

Writes out/train.jsonl and out/heldout.jsonl: {"prompt", "chosen", "rejected"} per line, the chosen
response the verifier's answer in the verifier's format, the rejected one the right answer in the
teacher's wrong format, a wrong number, both, or junk (`rewards.preferences.arithmetic_pairs`). The
two files draw their prompts from the task's disjoint "train" and "heldout" splits: the held-out pairs'
prompts are the held-out problems `make run` evaluates on, never seen in training. The task's knobs
default to `make run`'s (configs/tiny_cpu.gin: two 1-2 digit operands, '+').
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True, help="directory for train.jsonl and heldout.jsonl")
  p.add_argument("--train", type=int, default=4000, help="training pairs (one per problem)")
  p.add_argument("--heldout", type=int, default=500, help="held-out pairs")
  p.add_argument("--seed", type=int, default=0, help="the task stream's seed")
  p.add_argument("--task_kwargs", default='{"min_digits": 1, "max_digits": 2, "num_operands": 2, "ops": "+"}',
                 help="ArithmeticTask knobs (JSON)")
  p.add_argument("--prefix", default="ans ", help="the wrong format's prefix (the flawed teacher's)")
  args = p.parse_args(argv)
  from llamarl_jax.rewards import preferences, synthetic

  task = synthetic.make_task("arithmetic", **json.loads(args.task_kwargs))
  out = Path(args.out)
  counts = {}
  for split, count in (("train", args.train), ("heldout", args.heldout)):
    pairs = preferences.arithmetic_pairs(task, seed=args.seed, count=count, split=split, prefix=args.prefix)
    preferences.write_pairs(pairs, out / f"{split}.jsonl")
    counts[split] = len(pairs)
  print(f"wrote {counts['train']} training and {counts['heldout']} held-out pairs to {out}/")
  return counts


if __name__ == "__main__":
  main()
