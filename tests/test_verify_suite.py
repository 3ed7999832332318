"""The labelled verifier suite (tests/verify_suite.py): rewards.math rewards no wrong answer and accepts
>= 97% of right ones; the optional Math-Verify backend resolves, runs in the reward pool, or explains
how to install it."""

import collections
import sys

import pytest

import verify_suite as S
from llamarl_jax.executors.reward import RewardExecutor
from llamarl_jax.rewards import get_reward_fn
from llamarl_jax.rewards import math as M


def test_the_suite_is_large_labelled_and_balanced():
  assert len(S.CASES) >= 300
  assert sum(c.label == 0 for c in S.CASES) >= len(S.CASES) / 4  # wrong answers: at least a quarter
  assert {c.label for c in S.CASES} == {0, 1}
  assert set(S.CATEGORIES) == {c.category for c in S.CASES} and len(S.CATEGORIES) >= 20
  labels = collections.defaultdict(set)
  for c in S.CASES:
    labels[(c.response, c.truth)].add(c.label)
  assert all(len(v) == 1 for v in labels.values()), "a (response, truth) pair labelled both ways"


def test_no_wrong_answer_rewarded_and_right_answers_accepted():
  predictions = [int(M.verify(c.response, c.truth)) for c in S.CASES]
  false_positives = [c for c, p in zip(S.CASES, predictions) if p == 1 and c.label == 0]
  missed = [c for c, p in zip(S.CASES, predictions) if p == 0 and c.label == 1]
  right = sum(c.label for c in S.CASES)
  report = S.category_report({"ours": predictions})
  print("\n" + report)
  assert not false_positives, f"wrong answers rewarded: {false_positives}\n{report}"
  # The bar of issue 16: >= 97% of right answers accepted (one known miss when this was written).
  assert len(missed) <= 0.03 * right, f"right answers rejected: {missed}\n{report}"


def test_math_verify_backend_explains_how_to_install_it_when_missing(monkeypatch):
  monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify now raises ImportError
  monkeypatch.delitem(sys.modules, "llamarl_jax.rewards.math_verify_backend", raising=False)
  with pytest.raises(ImportError, match=r"pip install 'llamarl_jax\[math\]'"):
    get_reward_fn("math_verify")


def test_math_verify_backend_scores_in_the_reward_pool():
  pytest.importorskip("math_verify")
  fn = get_reward_fn("math_verify")
  assert fn(r"so $x = \boxed{\frac{1}{2}}$", "0.5") == 1.0
  assert fn("#### 7", "He has <<3+5=8>>8.\n#### 8") == 0.0
  assert fn(None, "1") == 0.0
  # The same worker processes and per-sample timeout as every reward function ("math_verify" by name).
  responses = [r"\boxed{(1, 2)}", "The answer is 41.", "Final Answer: The final answer is $24$. I hope it is correct."]
  with RewardExecutor("math_verify", num_workers=1, timeout_s=20.0) as executor:
    rewards, metrics = executor.score(responses, ["(1,2)", "42", "24"])
  assert rewards.tolist() == [1.0, 0.0, 1.0]
  assert metrics["reward/errors"] == 0 and metrics["reward/timeouts"] == 0
