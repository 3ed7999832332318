"""Synthetic tasks: deterministic streams, correct references, exact verifiers, difficulty knobs."""

import random
import re

import numpy as np
import pytest

from llamarl_jax.rewards import get_reward_fn
from llamarl_jax.rewards import synthetic as S


@pytest.mark.parametrize("name,knobs", [
    ("arithmetic", {}), ("arithmetic", dict(min_digits=3, max_digits=5, num_operands=3, ops="+-*")),
    ("countdown", {}), ("countdown", dict(num_numbers=5, max_number=99, max_target=999)),
])
def test_references_score_one(name, knobs):
  task = S.make_task(name, **knobs)
  for i in range(300):
    inst = S.generate(task, seed=3, index=i)
    assert task.score(inst.completion, inst.ground_truth) == 1.0, inst


def test_streams_are_deterministic_and_seeded():
  task = S.make_task("arithmetic")
  a = [S.generate(task, 0, i) for i in range(50)]
  assert a == [S.generate(task, 0, i) for i in range(50)]
  assert a != [S.generate(task, 1, i) for i in range(50)]
  assert S.generate(task, 0, 17) == a[17]  # random access: a stream resumes from its index alone


def test_train_and_heldout_splits_are_disjoint():
  task = S.make_task("arithmetic", min_digits=2, max_digits=2)
  train = {S.generate(task, 0, i, "train").prompt for i in range(2000)}
  heldout = {S.generate(task, 0, i, "heldout").prompt for i in range(200)}
  assert train and heldout and not train & heldout
  assert all(S.split_of(p) == "heldout" for p in heldout)


def test_arithmetic_prompt_format_and_knobs():
  task = S.make_task("arithmetic", min_digits=3, max_digits=3, num_operands=2, ops="+")
  for i in range(100):
    inst = S.generate(task, 0, i)
    m = re.fullmatch(r"(\d{3})\+(\d{3})=", inst.prompt)
    assert m and int(inst.ground_truth) == int(m.group(1)) + int(m.group(2)) and inst.completion == inst.ground_truth


def test_arithmetic_uses_operator_precedence():
  task = S.make_task("arithmetic", num_operands=3, ops="+*")
  for i in range(200):
    inst = S.generate(task, 0, i)
    a, op1, b, op2, c = re.fullmatch(r"(\d+)([+*])(\d+)([+*])(\d+)=", inst.prompt).groups()
    expected = {("+", "+"): int(a) + int(b) + int(c), ("+", "*"): int(a) + int(b) * int(c),
                ("*", "+"): int(a) * int(b) + int(c), ("*", "*"): int(a) * int(b) * int(c)}[op1, op2]
    assert int(inst.ground_truth) == expected


@pytest.mark.parametrize("response,expected", [
    ("81", 1.0), (" 81\n", 1.0), ("82", 0.0), ("81 81", 0.0), ("81.0", 0.0), ("0081", 1.0), ("", 0.0),
    ("eighty-one", 0.0), ("8" * 100, 0.0), ("-81", 0.0),
])
def test_score_arithmetic(response, expected):
  assert S.score_arithmetic(response, "81") == expected


@pytest.mark.parametrize("response,expected", [
    ("25+3*7", 1.0), ("3*7+25", 1.0), ("(7*3)+25", 1.0), ("25+3*7=46", 1.0), ("25+3*7\nmore text", 1.0),
    ("25+21", 0.0),            # 21 is not given
    ("25+3*7+3-3", 0.0),       # 3 used three times
    ("25+7*3*1", 0.0),         # 1 is not given
    ("25*7/3", 0.0),           # wrong value (175/3)
    ("46", 0.0), ("", 0.0), ("25 + 3 7", 0.0), ("-3+25+3*7+3", 0.0),  # unary minus is not allowed
    ("25+3^2*7", 0.0), ("25+3.0*7", 0.0), ("x", 0.0), ("(25+3*7", 0.0),
])
def test_score_countdown(response, expected):
  assert S.score_countdown(response, "46:3 7 25") == expected


def test_countdown_respects_multiplicity_and_exact_division():
  assert S.score_countdown("6+6", "12:6 6 4") == 1.0
  assert S.score_countdown("6+6+6-6", "12:6 6 4") == 0.0
  assert S.score_countdown("(6+6)/4*4", "12:6 6 4") == 0.0  # fourth use of a number given once
  assert S.score_countdown("6/4*6+3", "12:6 6 4 3") == 1.0  # exact rationals: 6/4*6 == 9


def test_countdown_prompt_and_knobs():
  task = S.make_task("countdown", num_numbers=4, max_number=30, max_target=500)
  for i in range(100):
    inst = S.generate(task, 0, i)
    target, numbers = S.parse_countdown_truth(inst.ground_truth)
    assert inst.prompt == f"{' '.join(map(str, numbers))}->{target}:"
    assert len(numbers) == 4 and all(1 <= n <= 30 for n in numbers) and 1 <= target <= 500


def test_bad_knobs_and_names_are_rejected():
  with pytest.raises(ValueError, match="ops"):
    S.make_task("arithmetic", ops="/")
  with pytest.raises(ValueError, match="unknown synthetic task"):
    S.make_task("sudoku")
  with pytest.raises(ValueError, match="ground truth"):
    S.score_countdown("1+2", "garbage")


def test_registered_by_name():
  assert get_reward_fn("arithmetic") is S.score_arithmetic
  assert get_reward_fn("countdown") is S.score_countdown


def test_a_flawed_teacher_drops_minus_signs_in_demonstrations_only():
  """demo_sign_error models a systematic teacher error: demonstrations of negative answers lose their
  sign at that rate; ground truths stay exact, so the reward still wants the sign."""
  task = S.make_task("arithmetic", ops="-", demo_sign_error=0.7)
  rng = random.Random(0)
  negatives = [inst for inst in (task.sample(rng) for _ in range(4000)) if inst.ground_truth.startswith("-")]
  dropped = np.mean([inst.completion == inst.ground_truth[1:] for inst in negatives])
  kept = np.mean([inst.completion == inst.ground_truth for inst in negatives])
  assert len(negatives) > 1000 and dropped + kept == 1.0
  assert abs(dropped - 0.7) < 0.05  # binomial sd ~0.014 at n > 1000: 3.5 sd
  clean = S.make_task("arithmetic", ops="-")
  assert all(i.completion == i.ground_truth for i in (clean.sample(rng) for _ in range(500)))
  with pytest.raises(ValueError, match="demo_sign_error is a probability"):
    S.make_task("arithmetic", demo_sign_error=1.5)


def test_a_teacher_that_ignores_the_answer_format_is_rejected_by_the_verifier():
  task = S.make_task("arithmetic", demo_prefix="ans ", demo_prefix_rate=0.7)
  rng = random.Random(1)
  insts = [task.sample(rng) for _ in range(2000)]
  prefixed = [i for i in insts if i.completion.startswith("ans ")]
  assert abs(len(prefixed) / len(insts) - 0.7) < 0.04  # binomial sd ~0.010: 4 sd
  assert all(i.completion == "ans " + i.ground_truth for i in prefixed)
  assert all(S.score_arithmetic(i.completion, i.ground_truth) == 0.0 for i in prefixed)
  assert all(S.score_arithmetic(i.completion, i.ground_truth) == 1.0 for i in insts if i not in prefixed)
  with pytest.raises(ValueError, match="demo_prefix_rate is a probability"):
    S.make_task("arithmetic", demo_prefix_rate=-0.1)
