"""Labelled corpora for math answer verifiers: (category, response, ground truth, label) per case.

label 1: the response's final answer is the ground truth (in any notation a careful human grader accepts);
label 0: it is not, or there is no single final answer (hedged, qualified, withdrawn, truncated). Labels are
the truth, written by hand, not what any verifier says. Each corpus is a JSON-lines file in
`llamarl_jax/rewards/data/` (`category`, `response`, `truth`, `label`; `heldout` adds `style`):

  suite    612 cases after the documented answer formats of GSM8K reference solutions (`#### 72`),
           lm-evaluation-harness chain-of-thought answers ("The answer is 6."), Minerva (`Final Answer: The
           final answer is $24$. I hope it is correct.`), MATH solutions (`\\boxed{}` with `\\frac`, `\\sqrt`,
           intervals, matrices, `\\text{(C)}`) and chat models (`**Answer:** 42`, `<think>`). The verifier's
           rules were written against it: its rates are in-sample.
  peers    472 cases in the spirit of other verifiers' public test suites (Math-Verify, hendrycks MATH,
           Qwen2.5-Math, verl, lm-eval; none copied) and the hard kinds (self-correction, spraying, several
           boxes, labelled references, number forms, sets and intervals, identities and planes). In-sample.
  heldout  responses in real models' styles, labelled and committed before the verifier first ran on them:
           its first-run rates are the verifier's honest out-of-sample numbers (BENCHMARKS.md).

`scripts/bench_verify.py` reports each corpus per category; tests/test_verify_suite.py holds the verifier to
them.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import NamedTuple

CORPORA = ("suite", "peers", "heldout")


class Case(NamedTuple):
  category: str
  response: str
  truth: str
  label: int


def load(name: str) -> list[Case]:
  """The cases of corpus `name` (one of CORPORA), in file order."""
  if name not in CORPORA:
    raise ValueError(f"unknown verifier corpus {name!r}: expected one of {CORPORA}")
  text = resources.files("llamarl_jax.rewards").joinpath("data", f"{name}.jsonl").read_text(encoding="utf-8")
  cases = []
  for number, line in enumerate(text.splitlines(), 1):
    if line.strip():
      row = json.loads(line)
      if row.get("label") not in (0, 1):
        raise ValueError(f"{name}.jsonl line {number}: label must be 0 or 1, got {row.get('label')!r}")
      cases.append(Case(row["category"], row["response"], row["truth"], row["label"]))
  return cases


def categories(cases: list[Case]) -> list[str]:
  """The categories of `cases`, in order of first appearance."""
  return list(dict.fromkeys(c.category for c in cases))


def category_report(predictions: dict[str, list[int]], cases: list[Case]) -> str:
  """A markdown table per category: for each verifier (name -> 0/1 per case), right answers accepted
  (`accepted`) and wrong answers rewarded (false positives, `FP`)."""
  names = list(predictions)
  head = "| category | right | wrong | " + " | ".join(f"{n} accepted | {n} FP" for n in names) + " |"
  lines = [head, "|" + "---|" * (3 + 2 * len(names))]
  for category in [*categories(cases), None]:
    idx = [i for i, c in enumerate(cases) if category is None or c.category == category]
    right = [i for i in idx if cases[i].label == 1]
    wrong = [i for i in idx if cases[i].label == 0]
    cells = []
    for n in names:
      accepted = sum(predictions[n][i] for i in right)
      fp = sum(predictions[n][i] for i in wrong)
      cells += [f"{accepted}/{len(right)}", f"{fp}/{len(wrong)}"]
    label = f"**all ({len(idx)})**" if category is None else category
    lines.append(f"| {label} | {len(right)} | {len(wrong)} | " + " | ".join(cells) + " |")
  return "\n".join(lines)
