"""The labelled verifier corpora (rewards.corpus: the suite and the peer corpus): rewards.math rewards
no wrong answer and accepts >= 97% of right ones on each; the optional Math-Verify backend resolves, runs in
the reward pool, or explains how to install it."""

import collections
import sys

import pytest

from llamarl_jax.executors.reward import RewardExecutor
from llamarl_jax.rewards import get_reward_fn
from llamarl_jax.rewards import corpus
from llamarl_jax.rewards import math as M

SUITE = corpus.load("suite")
PEERS = corpus.load("peers")
HELDOUT = corpus.load("heldout")


def test_the_suite_is_large_labelled_and_balanced():
  assert len(SUITE) >= 300
  assert sum(c.label == 0 for c in SUITE) >= len(SUITE) / 4  # wrong answers: at least a quarter
  assert {c.label for c in SUITE} == {0, 1}
  assert len(corpus.categories(SUITE)) >= 20
  labels = collections.defaultdict(set)
  for c in SUITE:
    labels[(c.response, c.truth)].add(c.label)
  assert all(len(v) == 1 for v in labels.values()), "a (response, truth) pair labelled both ways"


def test_the_peer_corpus_is_large_labelled_and_covers_every_source_and_kind():
  assert len(PEERS) >= 300
  assert sum(c.label == 0 for c in PEERS) >= len(PEERS) / 4
  sources = {c.category.split("/")[0] for c in PEERS}
  assert sources == {"mv", "hendrycks", "qwen", "verl", "lm_eval", "kinds", "probes"}
  kinds = {c.category for c in PEERS if c.category.startswith("kinds/")}
  assert kinds == {"kinds/self_correction", "kinds/several_boxes", "kinds/labels", "kinds/number_forms",
                   "kinds/sets_intervals", "kinds/identities_planes"}
  for kind in kinds:  # each kind has right answers to accept and wrong ones to refuse
    assert {c.label for c in PEERS if c.category == kind} == {0, 1}, kind
  labels = collections.defaultdict(set)
  for c in PEERS:
    labels[(c.response, c.truth)].add(c.label)
  assert all(len(v) == 1 for v in labels.values()), "a (response, truth) pair labelled both ways"


@pytest.mark.parametrize("name", ["suite", "peers"])
def test_no_wrong_answer_rewarded_and_right_answers_accepted(name):
  cases = SUITE if name == "suite" else PEERS
  predictions = [int(M.verify(c.response, c.truth)) for c in cases]
  false_positives = [c for c, p in zip(cases, predictions) if p == 1 and c.label == 0]
  missed = [c for c, p in zip(cases, predictions) if p == 0 and c.label == 1]
  right = sum(c.label for c in cases)
  report = corpus.category_report({"ours": predictions}, cases)
  print("\n" + report)
  assert not false_positives, f"wrong answers rewarded: {false_positives}\n{report}"
  # >= 97% of right answers accepted.
  assert len(missed) <= 0.03 * right, f"right answers rejected: {missed}\n{report}"


def test_the_held_out_corpus_is_large_labelled_and_covers_real_styles():
  assert len(HELDOUT) >= 150
  assert min(sum(c.label == k for c in HELDOUT) for k in (0, 1)) >= len(HELDOUT) / 3
  assert {"times", "withdrawn", "multiple", "percent", "fractions", "units", "think", "markdown", "gsm8k_hash",
          "cot_boxed", "base_fewshot"} <= set(corpus.categories(HELDOUT))
  for category in corpus.categories(HELDOUT):  # each category has right answers to accept and wrong ones to refuse
    assert {c.label for c in HELDOUT if c.category == category} == {0, 1}, category
  assert len({(c.response, c.truth) for c in HELDOUT}) == len(HELDOUT)


def test_the_held_out_corpus_keeps_its_first_run_rates():
  """BENCHMARKS.md reports the first run on the held-out corpus (0/101 wrong answers rewarded, 94/107 right
  answers accepted) and 96/107 after the one fix it prompted. A change to the verifier may only keep or
  improve both."""
  predictions = [int(M.verify(c.response, c.truth)) for c in HELDOUT]
  false_positives = [c for c, p in zip(HELDOUT, predictions) if p == 1 and c.label == 0]
  accepted = sum(p for c, p in zip(HELDOUT, predictions) if c.label == 1)
  assert not false_positives, f"wrong answers rewarded: {false_positives}"
  assert accepted >= 96, corpus.category_report({"ours": predictions}, HELDOUT)


def test_an_unknown_corpus_is_named_with_the_choices():
  with pytest.raises(ValueError, match=r"unknown verifier corpus 'held_out': expected one of"):
    corpus.load("held_out")


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


def _render(value, style: int) -> str:
  """A rational number written one of the ways models and datasets write it (LaTeX or plain)."""
  sign = "-" if value < 0 else ""
  p, q = abs(value.numerator), value.denominator
  if q == 1:
    return [f"{sign}{p}", f"{sign}{p:,}", f"\\frac{{{sign}{p}}}{{1}}", f"{sign}{p}.0"][style % 4]
  forms = [f"{sign}\\frac{{{p}}}{{{q}}}", f"\\frac{{{sign}{p}}}{{{q}}}", f"{sign}{p}/{q}",
           f"{sign}\\dfrac{{{2 * p}}}{{{2 * q}}}"]
  if p > q:
    forms.append(f"{sign}{p // q}\\frac{{{p % q}}}{{{q}}}")  # a mixed number
  if 10 ** 6 % q == 0:  # a terminating decimal, written exactly
    micro = p * 10 ** 6 // q
    forms.append(f"{sign}{micro // 10 ** 6}.{micro % 10 ** 6:06d}".rstrip("0"))
  return forms[style % len(forms)]


_RESPONSES = ["\\boxed{{{}}}", "#### {}", "The answer is ${}$.", "**Answer:** ${}$", "So the total is ${}$",
              "Final Answer: The final answer is ${}$. I hope it is correct."]
_TRUTHS = ["{}", "\\text{{so}} = \\boxed{{{}}}", "x = {}"]


@pytest.fixture(scope="module")
def hypothesis_api():
  return pytest.importorskip("hypothesis")


def test_equal_values_in_any_format_match_and_different_values_never_do(hypothesis_api):
  from fractions import Fraction
  from hypothesis import given, settings, strategies as st

  values = st.builds(Fraction, st.integers(-3000, 3000), st.sampled_from([1, 1, 2, 3, 4, 5, 7, 8, 12, 25]))

  @settings(max_examples=250, deadline=None, derandomize=True)
  @given(a=values, b=values, same=st.booleans(), styles=st.tuples(*[st.integers(0, 11)] * 4))
  def check(a, b, same, styles):
    if same:
      b = a
    response = _RESPONSES[styles[0] % len(_RESPONSES)].format(_render(a, styles[1]))
    truth = _TRUTHS[styles[2] % len(_TRUTHS)].format(_render(b, styles[3]))
    assert M.verify(response, truth) == float(a == b), (response, truth)

  check()
