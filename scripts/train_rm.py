#!/usr/bin/env python
"""Train a reward model with the Bradley-Terry loss on pairwise JSONL; export it for transformers.

    python scripts/train_rm.py --pairs pairs.jsonl --heldout_pairs heldout.jsonl \\
        --init runs/sft/hf_export --run_dir runs/rm

Pairs: one {"prompt", "chosen", "rejected"} object per line (`rewards.preferences.read_pairs`; a bad
line or an empty file is an error naming file:line). Held-out pairs: `--heldout_pairs`, or
`--heldout_fraction` of the pairs split off by a hash of their prompt (a prompt's pairs all land on
one side). The model: `--init` an HF directory (a causal LM, e.g. the SFT policy: its decoder with a
new score head; or a one-label `*ForSequenceClassification`) with its tokenizer, or `--tiny` a
random tiny Llama with the character tokenizer. Each response is scored as a run scores it
(`train.reward_model.response_row`: prompt tokens, response tokens, EOS), read at its last token.

Training: `train.reward_model.bt_step` (the trainer's prepare + clip + AdamW around
`losses.bradley_terry_loss`), random batches of `--batch_pairs`, a cosine learning rate, fp32 on one
device (JAX's default). Held-out
pairwise accuracy (a tie counts one half) before training, every `--eval_every` steps and at the end.
Writes run_dir/metrics.jsonl (`rm/*` train rows, `eval/rm_*` held-out rows; `eval/rm_accuracy/<kind>`
when the pairs name their kind), run_dir/summary.json and
the reward model, run_dir/hf_export: a `*ForSequenceClassification` directory with its tokenizer
(`RewardConfig.model_path` of a run, or transformers' `AutoModelForSequenceClassification`).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
import zlib
from pathlib import Path

import numpy as np

TINY = dict(hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2,
            max_position_embeddings=64, rope_theta=10000.0, tie_word_embeddings=True)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--pairs", required=True, help="training pairs (JSONL: prompt, chosen, rejected)")
  held = p.add_mutually_exclusive_group()
  held.add_argument("--heldout_pairs", default=None, help="held-out pairs (JSONL), scored for pairwise accuracy")
  held.add_argument("--heldout_fraction", type=float, default=0.1,
                    help="without --heldout_pairs: this fraction of the pairs' prompts (by hash) held out")
  model = p.add_mutually_exclusive_group(required=True)
  model.add_argument("--init", default=None, help="HF directory to start from (causal LM or one-label classifier)")
  model.add_argument("--tiny", action="store_true", help="a random tiny Llama with the character tokenizer")
  p.add_argument("--tiny_layers", type=int, default=TINY["num_layers"])
  p.add_argument("--tiny_hidden", type=int, default=TINY["hidden_size"])
  p.add_argument("--run_dir", default=None, help="logs, summary and hf_export (default runs/train_rm_<time>)")
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--batch_pairs", type=int, default=32)
  p.add_argument("--lr", type=float, default=1e-4)
  p.add_argument("--warmup_steps", type=int, default=10)
  p.add_argument("--weight_decay", type=float, default=0.0)
  p.add_argument("--margin", type=float, default=0.0, help="Bradley-Terry margin: -log sigmoid(d - margin)")
  p.add_argument("--eval_every", type=int, default=100, help="held-out accuracy every N steps (0: start and end)")
  p.add_argument("--log_every", type=int, default=10)
  p.add_argument("--seed", type=int, default=0, help="the score head's init, the batches' order")
  p.add_argument("--no_progress", action="store_true")
  args = p.parse_args(argv)
  problems = [f"--{k} must be >= 1, got {getattr(args, k)}" for k in ("steps", "batch_pairs", "log_every")
              if getattr(args, k) < 1]
  if args.heldout_pairs is None and not 0.0 < args.heldout_fraction < 1.0:
    problems.append(f"--heldout_fraction must be in (0, 1), got {args.heldout_fraction}")
  if args.lr <= 0 or args.eval_every < 0:
    problems.append(f"--lr must be > 0 and --eval_every >= 0, got {args.lr}, {args.eval_every}")
  if problems:
    p.error("; ".join(problems))
  return args


def split_by_prompt(pairs, fraction: float):
  """(train, heldout): the pairs whose prompt's crc32 falls in the first `fraction` are held out."""
  held = lambda pr: zlib.crc32(pr.prompt.encode()) % 10_000 < fraction * 10_000
  return [pr for pr in pairs if not held(pr)], [pr for pr in pairs if held(pr)]


def load_model(args):
  """(config, fp32 params, tokenizer) of the reward model to train (score head included)."""
  from flax import nnx

  from llamarl_jax.model import hf
  from llamarl_jax.model.config import ModelConfig
  from llamarl_jax.model.llama import Llama, split_params
  from llamarl_jax.train.reward_model import reward_model_params

  if args.init:
    config, model = hf.load_hf_checkpoint(args.init)
    tokenizer = hf.load_tokenizer(args.init)
    hf.check_tokenizer_matches(tokenizer, config)
    params = split_params(model)[1]
  else:
    from llamarl_jax.tokenizer import make_char_tokenizer

    tokenizer = make_char_tokenizer()
    heads = max(1, args.tiny_hidden // 32)
    config = ModelConfig(**{**TINY, "hidden_size": args.tiny_hidden, "intermediate_size": 3 * args.tiny_hidden,
                            "num_layers": args.tiny_layers, "num_heads": heads, "num_kv_heads": heads},
                         vocab_size=len(tokenizer))
    params = split_params(Llama(config, rngs=nnx.Rngs(params=args.seed)))[1]
  config, params = reward_model_params(config, params, seed=args.seed)
  return config.replace(dtype="float32", param_dtype="float32"), params, tokenizer


def encode(tokenizer, pairs, context: int, name: str):
  """(chosen rows, rejected rows) of `pairs`; an error naming the first pair past the model's context."""
  from llamarl_jax.train.reward_model import response_row

  chosen = [response_row(tokenizer, p.prompt, p.chosen) for p in pairs]
  rejected = [response_row(tokenizer, p.prompt, p.rejected) for p in pairs]
  for i, (c, r) in enumerate(zip(chosen, rejected)):
    if max(len(c), len(r)) > context:
      raise SystemExit(f"error: {name} pair {i} is {max(len(c), len(r))} tokens long, more than the model's context "
                       f"({context}); drop or shorten such pairs")
  return chosen, rejected


def main(argv=None) -> dict:
  args = parse_args(argv)
  from llamarl_jax.rewards.preferences import PairsError, read_pairs

  try:
    pairs = read_pairs(args.pairs)
    if args.heldout_pairs:
      train, heldout = pairs, read_pairs(args.heldout_pairs)
    else:
      train, heldout = split_by_prompt(pairs, args.heldout_fraction)
  except PairsError as e:
    sys.exit(f"error: {e}")
  if not train or not heldout:
    sys.exit(f"error: --heldout_fraction {args.heldout_fraction} left {len(train)} training and {len(heldout)} "
             f"held-out pairs of {len(pairs)}; both need at least one (pass --heldout_pairs or change the fraction)")
  return train_rm(args, train, heldout)


def train_rm(args, train, heldout) -> dict:
  import jax

  from llamarl_jax.config import OptimizerConfig
  from llamarl_jax.metrics import MetricsLogger
  from llamarl_jax.model import hf
  from llamarl_jax.model.llama import abstract_model, merge_params, split_params
  from llamarl_jax.train.reward_model import bt_spec, bt_step, pair_batch, pair_scores
  from llamarl_jax.train.state import init_state

  t0 = time.perf_counter()
  run_dir = Path(args.run_dir or time.strftime("runs/train_rm_%Y%m%d_%H%M%S"))
  if (run_dir / "metrics.jsonl").exists():
    sys.exit(f"error: {run_dir} already holds a reward-model run (metrics.jsonl); choose a new --run_dir")
  config, params, tokenizer = load_model(args)
  context = config.max_position_embeddings
  train_rows = encode(tokenizer, train, context, "training")
  held_rows = encode(tokenizer, heldout, context, "held-out")
  longest = max(len(r) for rows in (*train_rows, *held_rows) for r in rows)
  width = min(1 << (longest - 1).bit_length(), context)  # one width: one training and one scoring program
  pad_id = tokenizer.pad_token_id
  B = args.batch_pairs

  optimizer = OptimizerConfig(lr=args.lr, warmup_steps=args.warmup_steps, schedule="cosine", total_steps=args.steps,
                              final_lr_ratio=0.1, weight_decay=args.weight_decay, b2=0.999, max_grad_norm=1.0)
  # a few layers unrolled (a small model on a CPU steps faster so, as TrainConfig.scan_layers = False in
  # configs/tiny_cpu.gin), deeper models under the scan (compile time flat in depth)
  spec = bt_spec(config, optimizer, scan_layers=config.num_layers > 4, margin=args.margin)
  state = init_state(params, spec.tx)
  step_fn = jax.jit(functools.partial(bt_step, spec))
  score_fn = jax.jit(functools.partial(pair_scores, spec))

  def accuracy(params) -> dict:
    """Held-out pairwise accuracy (ties: one half), mean margin and scores, over every held-out pair."""
    chosen, rejected = [], []
    for start in range(0, len(heldout), B):
      c_rows, r_rows = held_rows[0][start:start + B], held_rows[1][start:start + B]
      c, r = score_fn(params, pair_batch(c_rows, r_rows, width=width, pairs=B, pad_id=pad_id))
      chosen.append(np.asarray(c)[:len(c_rows)])
      rejected.append(np.asarray(r)[:len(r_rows)])
    d = np.concatenate(chosen) - np.concatenate(rejected)
    won = (d > 0) + 0.5 * (d == 0)
    row = {"eval/rm_accuracy": float(np.mean(won)), "eval/rm_margin_mean": float(d.mean()), "eval/rm_pairs": len(d)}
    for kind in sorted({p.kind for p in heldout if p.kind}):  # pairs files that name their kinds
      row[f"eval/rm_accuracy/{kind}"] = float(np.mean([w for w, p in zip(won, heldout) if p.kind == kind]))
    return row

  logger = MetricsLogger(run_dir, tensorboard=False)
  evals = []

  def evaluate(step: int):
    row = accuracy(state.params)
    logger.log(step, row)
    evals.append({"step": step, **row})
    return row

  before = evaluate(0)
  if not args.no_progress:
    print(f"{len(train)} training pairs, {len(heldout)} held-out; width {width}; {config.num_params():,} params; "
          f"held-out pairwise accuracy before training: {before['eval/rm_accuracy']:.3f}")
  rng = np.random.default_rng(args.seed)
  order, cursor = rng.permutation(len(train)), 0
  it = range(args.steps)
  if not args.no_progress:
    from tqdm.auto import tqdm
    it = tqdm(it, desc="reward model (Bradley-Terry)", dynamic_ncols=True)
  recent = []
  t_train = time.perf_counter()
  for i in it:
    if cursor + B > len(order):
      order, cursor = rng.permutation(len(train)), 0
    idx = order[cursor:cursor + B]
    cursor += len(idx)
    batch = pair_batch([train_rows[0][j] for j in idx], [train_rows[1][j] for j in idx], width=width, pairs=B,
                       pad_id=pad_id)
    state, metrics = step_fn(state, batch)
    recent.append(metrics)
    if (i + 1) % args.log_every == 0 or i + 1 == args.steps:
      rows = jax.device_get(recent)
      row = {k: float(np.mean([m[k] for m in rows])) for k in rows[0]}
      logger.log(i + 1, row)
      recent = []
      if not args.no_progress:
        it.set_postfix(loss=f"{row['loss/total']:.3f}", acc=f"{row['rm/accuracy']:.2f}")
    if args.eval_every and (i + 1) % args.eval_every == 0 and i + 1 < args.steps:
      evaluate(i + 1)
  train_seconds = time.perf_counter() - t_train
  after = evaluate(args.steps)

  model = merge_params(split_params(abstract_model(config))[0], jax.device_get(state.params))
  export = hf.save_hf_checkpoint(model, config, run_dir / "hf_export", tokenizer=tokenizer, pad_token_id=pad_id)
  summary = {"run_dir": str(run_dir), "export_dir": str(export), "train_pairs": len(train), "heldout_pairs": len(heldout),
             "steps": args.steps, "batch_pairs": B, "width": width, "model_params": config.num_params(),
             "init": args.init or "tiny", "heldout_accuracy_before": before["eval/rm_accuracy"],
             "heldout_accuracy_after": after["eval/rm_accuracy"], "heldout_margin_after": after["eval/rm_margin_mean"],
             "heldout_accuracy_by_kind": {k.rsplit("/", 1)[1]: v for k, v in after.items()
                                          if k.startswith("eval/rm_accuracy/")},
             "train_seconds": train_seconds, "total_seconds": time.perf_counter() - t0, "evals": evals,
             "skipped_nonfinite": int(state.skipped)}
  logger.close()
  (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
  if not args.no_progress:
    print(f"held-out pairwise accuracy {before['eval/rm_accuracy']:.3f} -> {after['eval/rm_accuracy']:.3f} "
          f"({len(heldout)} pairs); {args.steps} steps in {train_seconds:.0f} s; reward model: {export}")
    if summary["heldout_accuracy_by_kind"]:
      print("  by kind of rejected response: " + ", ".join(f"{k} {v:.3f}" for k, v in
                                                         summary["heldout_accuracy_by_kind"].items()))
  return summary


if __name__ == "__main__":
  main()
