"""Math answer verification for GSM8K- and MATH-style problems, safe on untrusted model text.

`verify(response_text, ground_truth) -> 1.0 | 0.0`.

Model text is never evaluated as code: expressions go through the restricted grammar of
`rewards.math_expr` (hand-written tokenizer and parser, bounded exact arithmetic); every stage is
bounded up front, so any input returns within milliseconds; `RewardExecutor` adds a hard
per-sample timeout on top.

The stages, each with its rules in its module's docstring:
  1. `rewards.math_extract`: the final answer of a response (a box, `####`, "the answer is", the last
     number), or none when the response withdraws it, hedges or states several;
  2. `rewards.math_parse`: the answer text normalised and read as a value (`Answer`: an expression,
     equation, tuple, set, intervals, clock time, ratio, matrix or text);
  3. `rewards.math_compare`: whether two values are the same (exact rationals, expressions at
     rational points, equations up to a factor, intervals after merging, ...).
The ground truth is read by `extract_ground_truth` (a bare answer, GSM8K's `#### 42`, a MATH box).
"""

from __future__ import annotations

from llamarl_jax.rewards.math_expr import ParseError
from llamarl_jax.rewards.math_extract import box_run, extract_answer
from llamarl_jax.rewards.math_parse import answers_equal


def extract_ground_truth(ground_truth: str) -> str:
  """A dataset label as stored: a bare answer, a GSM8K `... #### 42`, or a MATH solution with \\boxed."""
  run = box_run(ground_truth)
  if run is not None:
    return " or ".join(run[0])
  i = ground_truth.rfind("####")
  return ground_truth[i + 4:].strip() if i >= 0 else ground_truth.strip()


def verify(response_text: str, ground_truth: str) -> float:
  """1.0 if the response's final answer equals the ground truth, else 0.0. Never raises on model text.

  ground_truth may be a bare answer ("42", "\\frac{1}{2}"), a GSM8K answer field ("... #### 42") or a
  MATH solution containing \\boxed{...}.
  """
  try:
    if not isinstance(response_text, str) or not isinstance(ground_truth, str):
      return 0.0
    answer = extract_answer(response_text)
    if answer is None:
      return 0.0
    return 1.0 if answers_equal(answer, extract_ground_truth(ground_truth)) else 0.0
  except (ParseError, RecursionError, ValueError, ZeroDivisionError, OverflowError, MemoryError):
    return 0.0
