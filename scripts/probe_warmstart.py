#!/usr/bin/env python
"""How far a configuration's SFT warm start has learnt the task, as it trains: held-out greedy accuracy
with the teacher's answer prefix forgiven, every `--every` steps, per warm-start seed.

  python scripts/probe_warmstart.py --gin_file=configs/tiny_cpu.gin --seeds 0 1 2 --every 250
  python -m llamarl_jax.compat --cpu_devices 4 -- python scripts/probe_warmstart.py ...  # make run's devices
  python -m llamarl_jax.compat --cpu_devices 4 --fusion_emitters on -- python scripts/probe_warmstart.py ...

`make run`'s RL learns the answer format from the reward and keeps the sums the warm start learnt (README,
"What the gain is"), so this is where a run's final accuracy is decided. Each seed is `make run`'s SFT
(`build_policy.seed`, `PromptSource.seed` = s; the SFT stream is the RL source forked as the run forks
it, the held-out problems are the run's) on the config's trainer mesh (`--one_device`: one device), the
gin file's `supervised_warmstart.*` settings; the evaluation decodes greedily with the `Sampler` and scores a completion right when it is
the answer, or the demonstrations' prefix (`PromptSource.task_kwargs['demo_prefix']`) then the answer.
Prints a table (seed x step) and writes OUT/probe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def forgiven_accuracy(texts, truths, prefix: str) -> tuple[float, float]:
  """(exact accuracy, accuracy with `prefix` forgiven) of completions `texts` against integer answers."""
  from llamarl_jax.rewards.synthetic import score_arithmetic

  exact = [score_arithmetic(t, g) for t, g in zip(texts, truths)]
  forgiven = [max(e, score_arithmetic(t.strip().removeprefix(prefix), g) if prefix else e)
              for e, t, g in zip(exact, texts, truths)]
  return sum(exact) / len(texts), sum(forgiven) / len(texts)


def direct_accuracy(graphdef, params, tokenizer, prompts, truths, prefix: str) -> float:
  """Greedy accuracy when the completion starts with the answer, not the prefix: the argmax at the
  first response position over every token but the prefix's first, then the plain argmax, must spell
  the answer and the end token (teacher-forced on it, which is the greedy path exactly when it is
  right). This is the format RL rewards, so it is the arithmetic a run keeps once RL has dropped the
  prefix; the prefixed path (`forgiven_accuracy`) can be better learnt (the teacher's usual format)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from llamarl_jax.model.llama import merge_params

  rows = [p + tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
          for p, t in zip(prompts, truths)]
  width = max(len(r) for r in rows)
  tokens = np.full((len(rows), width), tokenizer.pad_token_id or 0, np.int32)
  for i, r in enumerate(rows):
    tokens[i, :len(r)] = r  # right-padded: causal attention never reads the padding
  logits = np.asarray(jax.jit(lambda p, t: merge_params(graphdef, p)(t))(params, jnp.asarray(tokens)))
  banned = tokenizer(prefix[:1], add_special_tokens=False)["input_ids"] if prefix else []
  right = 0
  for i, (p, r) in enumerate(zip(prompts, rows)):
    ok = True
    for t in range(len(p) - 1, len(r) - 1):  # logits at t predict token t + 1
      row = logits[i, t].copy()
      if t == len(p) - 1:
        row[banned] = -np.inf
      ok &= int(row.argmax()) == r[t + 1]
    right += ok
  return right / len(rows)


def by_class(examples, texts, prefix: str) -> dict[str, float]:
  """Accuracy (prefix forgiven) of two-operand sums by kind: no carry, a carry from the units, a
  three-digit answer."""
  groups: dict[str, list[float]] = {"no carry": [], "carry": [], "sum>=100": []}
  for ex, text in zip(examples, texts):
    try:
      a, b = (int(x) for x in ex.prompt.rstrip("=").split("+"))
    except ValueError:  # not a two-operand sum
      return {}
    kind = "sum>=100" if a + b >= 100 else ("carry" if a % 10 + b % 10 >= 10 else "no carry")
    groups[kind].append(forgiven_accuracy([text], [ex.ground_truth], prefix)[1])
  return {k: sum(v) / len(v) for k, v in groups.items() if v}


def probe_seed(gin_files, bindings, seed: int, every: int, eval_size: int, trainer_mesh: bool) -> list[dict]:
  import gin
  import jax

  from llamarl_jax import experiment, parallel
  from llamarl_jax.executors.scoring import decode_responses
  from llamarl_jax.generation import Sampler, SamplingParams

  gin.clear_config()
  experiment.parse_gin(gin_files, [*bindings, f"build_policy.seed={seed}", f"PromptSource.seed={seed}"])
  config, params, tokenizer = experiment.build_policy()
  if trainer_mesh:  # the SFT on the run's trainer mesh and shardings, as `make run` computes it
    from llamarl_jax.model.llama import abstract_model
    from llamarl_jax.train.placement import place

    mesh = parallel.make_meshes(**experiment.mesh_layout())[0]
    params = place(params, jax.numpy.float32,
                   parallel.param_shardings(params, parallel.logical_axes(abstract_model(config)), mesh))
  source = experiment.configured_prompt_source().with_tokenizer(tokenizer)
  prefix = (source.fingerprint().get("task_kwargs") or {}).get("demo_prefix", "")
  examples = source.heldout().next_batch(eval_size)
  prompts = [ex.encode(tokenizer) for ex in examples]
  truths = [ex.ground_truth for ex in examples]
  sft_source = source.fork(seed_offset=1)  # as `run_experiment` forks the RL source for its SFT
  seen = sft_source.fork(seed_offset=0).next_batch(eval_size)  # the first problems the SFT trains on
  seen_prompts, seen_truths = [ex.encode(tokenizer) for ex in seen], [ex.ground_truth for ex in seen]
  sampler = Sampler(config, pad_id=tokenizer.pad_token_id or 0)
  from llamarl_jax.model.llama import abstract_model, split_params
  graphdef = split_params(abstract_model(config))[0]  # the trainer's (Hugging Face's) layout
  greedy = SamplingParams(temperature=0.0, max_new_tokens=gin.query_parameter("RolloutConfig.max_new_tokens"),
                          stop_token_ids=(tokenizer.eos_token_id,))
  rows, t0 = [], time.perf_counter()

  def evaluate(step, p):
    texts = decode_responses(tokenizer, sampler.generate(p, prompts, greedy))
    exact, forgiven = forgiven_accuracy(texts, truths, prefix)
    _, trained = forgiven_accuracy(decode_responses(tokenizer, sampler.generate(p, seen_prompts, greedy)),
                                   seen_truths, prefix)
    classes = by_class(examples, texts, prefix)
    direct = direct_accuracy(graphdef, p, tokenizer, prompts, truths, prefix)
    rows.append({"seed": seed, "step": step, "exact": exact, "forgiven": forgiven, "direct": direct,
                 "trained_forgiven": trained, "classes": classes, "seconds": time.perf_counter() - t0})
    print(f"seed {seed} step {step}: held-out {100 * exact:.1f}% exact, {100 * forgiven:.1f}% with "
          f"{prefix!r} forgiven, {100 * direct:.1f}% answering directly (trained-on problems {100 * trained:.1f}%; "
          + ", ".join(f"{k} {100 * v:.0f}%" for k, v in classes.items()) + f") ({rows[-1]['seconds']:.0f} s)",
          flush=True)

  class NllLog:  # supervised_warmstart's training NLL (every 50 steps), beside the evaluations
    def log(self, step, values):
      nll.append(values["sft/nll"])
      if len(nll) <= 2:
        print(f"seed {seed}: SFT nll {values['sft/nll']:.6f} at step {50 * len(nll)}", flush=True)

  nll: list[float] = []
  experiment.supervised_warmstart(config, params, tokenizer, sft_source, progress=False, on_params=evaluate,
                                  on_params_every=every, logger=NllLog())
  return rows


def main(argv=None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--gin_file", action="append", default=[])
  p.add_argument("--gin_param", action="append", default=[])
  p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  p.add_argument("--every", type=int, default=250, help="evaluate every this many SFT steps")
  p.add_argument("--eval_size", type=int, default=512)
  p.add_argument("--one_device", action="store_true",
                 help="the SFT on one device (default: on the config's trainer mesh, as the run; needs its devices)")
  p.add_argument("--out", default="runs/probe_warmstart")
  args = p.parse_args(argv)
  files = args.gin_file or [str(ROOT / "configs" / "tiny_cpu.gin")]
  rows = []
  for seed in args.seeds:
    rows += probe_seed(files, args.gin_param, seed, args.every, args.eval_size, not args.one_device)
  steps = sorted({r["step"] for r in rows})
  print("\n| seed | " + " | ".join(f"step {s}" for s in steps) + " |")
  print("|---|" + "---|" * len(steps))
  for seed in args.seeds:
    mine = {r["step"]: r for r in rows if r["seed"] == seed}
    print(f"| {seed} | " + " | ".join(f"{100 * mine[s]['forgiven']:.1f}" if s in mine else "-" for s in steps) + " |")
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "probe.json").write_text(json.dumps(rows, indent=2))
  return rows


if __name__ == "__main__":
  main()
