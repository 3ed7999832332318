#!/usr/bin/env python
"""Our math verifier (`rewards.math.verify`) against Math-Verify on two labelled corpora, one invocation.

The corpora of `llamarl_jax.rewards.corpus`: `suite` (hand-labelled GSM8K / MATH / Minerva / lm-eval / chat-model
answers) and `peers` (cases written in the spirit of Math-Verify's, hendrycks MATH's, Qwen2.5-Math's, verl's
and lm-eval's test suites, plus the hard kinds: self-correction, spraying, labelled references, number
forms, sets, identities). For both verifiers on each: right answers accepted and wrong answers rewarded
(false positives) per category; agreement between the two, overall and where Math-Verify agrees with the
label (the cases the peers settle alike); every case where one is wrong against the label; and calls/s
of each in this process (Math-Verify as reward_fn='math_verify' calls it: `math_verify.parse` +
`math_verify.verify`, label as `$label$`). `--executor` also times both through `RewardExecutor` (worker
processes, per-sample timeout).

  python scripts/bench_verify.py                  # needs `pip install 'llamarl_jax[math]'` for the peer
  python scripts/bench_verify.py --executor 2     # and through a 2-worker reward pool
"""

from __future__ import annotations

import argparse
import logging
import time


def _timed(fn, cases, repeats: int) -> tuple[list[int], float]:
  """(0/1 per case, calls per second over `repeats` passes of the suite)."""
  t0 = time.perf_counter()
  for _ in range(repeats):
    predictions = [int(fn(c.response, c.truth) >= 1.0) for c in cases]
  return predictions, repeats * len(cases) / (time.perf_counter() - t0)


def _executor_rate(name: str, cases, workers: int) -> float:
  from llamarl_jax.executors.reward import RewardExecutor

  with RewardExecutor(name, num_workers=workers, timeout_s=10.0) as executor:
    executor.score([c.response for c in cases[:4]], [c.truth for c in cases[:4]])  # workers warm
    t0 = time.perf_counter()
    executor.score([c.response for c in cases], [c.truth for c in cases])
    return len(cases) / (time.perf_counter() - t0)


def _short(text: str, n: int = 70) -> str:
  text = text.replace("\n", "⏎").replace("|", "\\|")
  return text if len(text) <= n else text[:n - 3] + "..."


def _report(title: str, cases, predictions: dict[str, list[int]], rates: dict, pool_rates: dict, executor: int,
            category_report) -> dict:
  """Print one corpus's tables; return its summary numbers."""
  right = sum(c.label for c in cases)
  print(f"## {title}: {len(cases)} cases, {right} right answers, {len(cases) - right} wrong answers\n")
  print(category_report(predictions, cases) + "\n")
  print("| verifier | accuracy | right accepted | false positives | calls/s (in process)"
        + (f" | calls/s ({executor}-worker RewardExecutor)" if executor else "") + " |")
  print("|---|---|---|---|---|" + ("---|" if executor else ""))
  summary = {"cases": len(cases), "right": right}
  for name, p in predictions.items():
    correct = sum(int(x == c.label) for x, c in zip(p, cases))
    accepted = sum(x for x, c in zip(p, cases) if c.label == 1)
    fp = sum(x for x, c in zip(p, cases) if c.label == 0)
    summary[name] = {"correct": correct, "accepted": accepted, "false_positives": fp}
    rate = f"{rates[name]:.0f}" if name in rates else "-"
    pool = (f" | {pool_rates[name]:.0f}" if name in pool_rates else " | -") if executor else ""
    print(f"| {name} | {correct}/{len(cases)} ({100 * correct / len(cases):.1f}%) | {accepted}/{right} "
          f"({100 * accepted / max(right, 1):.1f}%) | {fp}/{len(cases) - right} | {rate}{pool} |")

  if "math_verify" in predictions:
    ours, peer = predictions["ours"], predictions["math_verify"]
    agree = sum(int(a == b) for a, b in zip(ours, peer))
    settled = [i for i, c in enumerate(cases) if peer[i] == c.label]
    agree_settled = sum(int(ours[i] == peer[i]) for i in settled)
    summary["agreement"] = agree
    summary["settled"] = len(settled)
    summary["agreement_settled"] = agree_settled
    print(f"\nAgreement with Math-Verify: {agree}/{len(cases)} ({100 * agree / len(cases):.1f}%); where Math-Verify "
          f"agrees with the label: {agree_settled}/{len(settled)} ({100 * agree_settled / max(len(settled), 1):.1f}%)"
          + (f"; speed ratio ours / Math-Verify: {rates['ours'] / rates['math_verify']:.0f}x" if rates else "") + "\n")
  for name, p in predictions.items():
    wrong = [i for i, (c, x) in enumerate(zip(cases, p)) if x != c.label]
    print(f"### {name}: {len(wrong)} cases wrong against the label\n")
    if wrong:
      print("| category | label | " + " | ".join(predictions) + " | response | truth |")
      print("|---|---|" + "---|" * len(predictions) + "---|---|")
      for i in wrong:
        c = cases[i]
        others = " | ".join(str(predictions[n][i]) for n in predictions)
        print(f"| {c.category} | {c.label} | {others} | `{_short(c.response)}` | `{_short(c.truth, 40)}` |")
      print()
  return summary


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--repeats", type=int, default=5, help="passes over the suite when timing ours")
  parser.add_argument("--peer_repeats", type=int, default=1, help="passes over the suite when timing Math-Verify")
  parser.add_argument("--limit", type=int, default=0, help="use only the first N cases of each corpus (smoke tests)")
  parser.add_argument("--corpus", choices=["suite", "peers", "heldout", "all"], default="all",
                      help="which corpora to run")
  parser.add_argument("--no_peer", action="store_true", help="skip Math-Verify even if installed")
  parser.add_argument("--executor", type=int, default=0, help="also time both through a RewardExecutor of N workers")
  args = parser.parse_args(argv)

  from llamarl_jax.rewards import corpus as verifier_corpus, get_reward_fn

  corpora = {name: verifier_corpus.load(name) for name in verifier_corpus.CORPORA}
  if args.corpus != "all":
    corpora = {args.corpus: corpora[args.corpus]}
  if args.limit:
    corpora = {k: v[:args.limit] for k, v in corpora.items()}
  verifiers = {"ours": "math"}
  if not args.no_peer:
    try:
      get_reward_fn("math_verify")
      verifiers["math_verify"] = "math_verify"
      logging.getLogger("math_verify").setLevel(logging.ERROR)  # its per-sample parse warnings
    except ImportError as e:
      print(f"Math-Verify not compared: {e}\n")

  summary = {}
  for corpus, cases in corpora.items():
    predictions, rates, pool_rates = {}, {}, {}
    for name, reward in verifiers.items():
      repeats = args.repeats if name == "ours" else args.peer_repeats
      predictions[name], rates[name] = _timed(get_reward_fn(reward), cases, repeats)
      if args.executor:
        pool_rates[name] = _executor_rate(reward, cases, args.executor)
    summary[corpus] = _report(corpus, cases, predictions, rates, pool_rates, args.executor,
                              verifier_corpus.category_report)
    for name in verifiers:
      summary[corpus][name]["calls_per_s"] = rates[name]
  return summary


if __name__ == "__main__":
  main()
