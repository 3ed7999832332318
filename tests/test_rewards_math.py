"""rewards.math.verify: a table of GSM8K- and MATH-style responses, correct and incorrect."""

import math
from fractions import Fraction

import pytest

from llamarl_jax.rewards import get_reward_fn
from llamarl_jax.rewards import math as M
from llamarl_jax.rewards import math_expr, math_extract

# (response, ground truth, expected reward)
GSM8K_CASES = [
    # the #### convention
    ("Natalia sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72 clips.\n#### 72", "72", 1.0),
    ("#### 72", "72", 1.0),
    ("#### 72 clips", "72", 1.0),
    ("#### $1,080", "1080", 1.0),
    ("#### 1,234,567", "1234567", 1.0),
    ("#### -15", "-15", 1.0),
    ("#### 18.00", "18", 1.0),
    ("#### 73", "72", 0.0),
    ("#### 7.2", "72", 0.0),
    ("First 5, then 10. #### 10\nsome trailing chatter with 3", "10", 1.0),
    # the ground truth given as the raw GSM8K answer field
    ("#### 72", "She sold 48+24 = <<48+24=72>>72 clips.\n#### 72", 1.0),
    ("The answer is 71.", "She sold 48+24 = <<48+24=72>>72 clips.\n#### 72", 0.0),
    # "the answer is"
    ("So the answer is 42.", "42", 1.0),
    ("The final answer is: 42", "42", 1.0),
    ("Answer: 42 apples", "42", 1.0),
    ("The answer is $42.50.", "42.5", 1.0),
    ("The answer is 41.", "42", 0.0),
    ("The answer is forty-two.", "42", 0.0),
    ("The answer is 48 + 24 = 72 clips", "72", 1.0),
    # the last number
    ("He has 3 + 4 = 7 apples left.", "7", 1.0),
    ("It takes 3 hours, so 180 minutes", "180", 1.0),
    ("It costs $18.00 dollars", "18", 1.0),
    ("Total: 1,000 people", "1000", 1.0),
    ("The temperature drops to -5 degrees", "-5", 1.0),
    ("10-3 is 7", "7", 1.0),
    ("He ends with 7 apples. Earlier he had 3.", "7", 0.0),
    ("There are 4 groups of 25", "100", 0.0),
    ("no numbers here", "5", 0.0),
    ("", "5", 0.0),
    ("The share is 3/4", "0.75", 1.0),
    ("The share is 0.75", "3/4", 1.0),
    ("That is 50% of the class", "50", 1.0),
    ("That is 50% of the class", "0.5", 0.0),
]

MATH_CASES = [
    # \boxed answers
    (r"Thus $x = \boxed{5}$.", "5", 1.0),
    (r"\boxed{5}", "6", 0.0),
    (r"\boxed{\frac{1}{2}}", r"\frac12", 1.0),
    (r"\boxed{\dfrac{1}{2}}", "0.5", 1.0),
    (r"\boxed{\tfrac{3}{6}}", "1/2", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac{2}{3}}", r"\frac{3}{2}", 0.0),
    (r"\boxed{0.67}", r"\frac{2}{3}", 0.0),
    (r"\boxed{-\frac{3}{4}}", r"\frac{-3}{4}", 1.0),
    (r"\boxed{\frac{-3}{4}}", r"-0.75", 1.0),
    (r"\boxed{\frac{3}{4}}", r"-\frac{3}{4}", 0.0),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{12}", 1.0),
    (r"\boxed{\sqrt{2}/2}", r"\frac{\sqrt{2}}{2}", 1.0),
    (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{\sqrt2}{2}", 1.0),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{2}}{2}", 0.0),
    (r"\boxed{\sqrt{16}}", "4", 1.0),
    (r"\boxed{\sqrt[3]{27}}", "3", 1.0),
    (r"\boxed{2^{10}}", "1024", 1.0),
    (r"\boxed{2^10}", "1024", 1.0),
    (r"\boxed{10\pi}", r"10\pi", 1.0),
    (r"\boxed{\pi \cdot 10}", r"10\pi", 1.0),
    (r"\boxed{31.4}", r"10\pi", 0.0),
    (r"\boxed{25\%}", "25", 1.0),
    (r"\boxed{25}", r"25\%", 1.0),
    (r"\boxed{30^\circ}", "30", 1.0),
    (r"\boxed{30^{\circ}}", r"30", 1.0),
    (r"\boxed{12 \text{ cm}}", "12", 1.0),
    (r"\boxed{12\text{ square units}}", "12", 1.0),
    (r"\boxed{\$ 3.50}", "3.5", 1.0),
    (r"\boxed{1{,}000}", "1000", 1.0),
    (r"\boxed{x = 7}", "7", 1.0),
    (r"\boxed{7}", "x=7", 1.0),
    (r"\boxed{f(x) = 2x+1}", "1+2x", 1.0),
    (r"\boxed{x^2 + y^2 = 1}", "x^2+y^2=1", 1.0),
    (r"\boxed{\text{Area} = 12}", "12", 1.0),  # a word names the answer
    (r"\boxed{xy = 6}", "6", 0.0),  # two letters: an equation (a hyperbola), not 6
    (r"\boxed{1}", "x^2+y^2=1", 0.0),  # an equation is not its right-hand side
    (r"\boxed{1.5e3}", "1500", 1.0),
    (r"\boxed{2x+2}", "2(x+1)", 1.0),
    (r"\boxed{x^2-1}", "(x-1)(x+1)", 1.0),
    (r"\boxed{x^2+1}", "(x+1)^2", 0.0),
    (r"\boxed{\frac{x}{2}}", "0.5x", 1.0),
    (r"\boxed{2y}", "2x", 0.0),
    (r"\boxed{(1, 2)}", "(1,2)", 1.0),
    (r"\boxed{(2, 1)}", "(1,2)", 0.0),
    (r"\boxed{\left( 3, \frac{1}{2} \right)}", "(3, 0.5)", 1.0),
    (r"\boxed{[0, 1)}", "[0,1)", 1.0),
    (r"\boxed{[0, 1)}", "[0,1]", 0.0),
    (r"\boxed{2, 1}", "1, 2", 1.0),
    (r"\boxed{1, 2, 3}", "1, 2", 0.0),
    (r"\boxed{\text{(C)}}", "C", 1.0),
    (r"\boxed{(C)}", r"\text{(C)}", 1.0),
    (r"\boxed{B}", "C", 0.0),
    (r"\boxed{\text{Monday}}", "Monday", 1.0),
    (r"\boxed{Tuesday}", "Monday", 0.0),
    (r"\boxed{\infty}", r"\infty", 1.0),
    (r"The area is \boxed{\frac{9}{4}} and that is final.", r"2.25", 1.0),
    (r"\boxed{3} is wrong, so \boxed{4}", "4", 1.0),  # the last box counts
    (r"\boxed{4}, no wait: \boxed{3}", "4", 0.0),
    (r"\fbox{8}", "8", 1.0),
    (r"\boxed{-7}", "7", 0.0),
    (r"$\boxed{\frac{7}{2}}$", r"3\frac{1}{2}", 1.0),  # a mixed number, not the product 3/2
    (r"$\boxed{\frac{3}{2}}$", r"3\frac{1}{2}", 0.0),
    # the ground truth given as a MATH solution
    (r"\boxed{\frac{1}{4}}", r"The probability is $\frac{2}{8} = \boxed{\frac{1}{4}}$.", 1.0),
    (r"\boxed{\frac{1}{3}}", r"The probability is $\frac{2}{8} = \boxed{\frac{1}{4}}$.", 0.0),
    (r"\boxed{\frac{1}{2", "0.5", 0.0),  # unbalanced box
]


@pytest.mark.parametrize("response,truth,expected", GSM8K_CASES + MATH_CASES)
def test_verify(response, truth, expected):
  assert M.verify(response, truth) == expected


def test_the_table_is_large_and_balanced():
  cases = GSM8K_CASES + MATH_CASES
  assert len(cases) >= 60
  assert sum(e == 1.0 for *_, e in cases) >= 25 and sum(e == 0.0 for *_, e in cases) >= 25


def test_registered_as_math():
  assert get_reward_fn("math") is M.verify


@pytest.mark.parametrize("text,value", [
    ("1+2*3", Fraction(7)), ("(1+2)*3", Fraction(9)), ("2^3^2", Fraction(512)), ("-2^2", Fraction(-4)),
    ("2^-1", Fraction(1, 2)), (r"\frac{1}{3}+\frac{1}{6}", Fraction(1, 2)), (r"\frac12", Fraction(1, 2)),
    ("0.1+0.2", Fraction(3, 10)), (r"4\sqrt{9}", Fraction(12)), ("8^{2/3}", Fraction(4)), ("2(3)(4)", Fraction(24)),
])
def test_evaluate_exact(text, value):
  assert math_expr.evaluate(math_expr.parse(text)) == value


@pytest.mark.parametrize("text", ["1/0", r"\sqrt{-4}", "0^-1", "2^100000", "(-8)^{1/2}"])
def test_evaluate_rejects(text):
  with pytest.raises(math_expr.ParseError):
    math_expr.evaluate(math_expr.parse(text))


@pytest.mark.parametrize("text", ["", "1+", "(1", "1)", "f(x)!", r"\sin{x}", "1 @ 2", "x_1"])
def test_parse_rejects(text):
  with pytest.raises(math_expr.ParseError):
    math_expr.evaluate(math_expr.parse(text, allow_vars=False))


@pytest.mark.parametrize("response,answer", [
    (r"so \boxed{\frac{1}{2}} done", r"\frac{1}{2}"), ("x\n#### 5 apples\nmore", "5 apples"),
    ("The answer is 12.", "12"),  # the answer sentence ends at its full stop (Minerva's "$24$. I hope")
    ("Final Answer: The final answer is $24$. I hope it is correct.", "$24$"),
    (r"$\boxed{2}$ and $\boxed{3}$", "2 or 3"), (r"\boxed{5}" "\n#### 6", None),  # joined boxes; a hedge
    ("a 1,234.5 b", "1,234.5"), ("3 then -4", "-4"), ("nothing", None), ("at least 5", None),
])
def test_extract_answer(response, answer):
  assert math_extract.extract_answer(response) == answer


# The kinds of answers verifiers disagree on, one rule each (see the module docstrings of rewards.math_extract,
# rewards.math_parse and rewards.math_compare).

# Self-correction and spraying: the last stated answer counts when every different earlier one is withdrawn
# ("wait", "wrong", "no:", "mistake", ...) and at most MAX_DISTINCT_ANSWERS are stated; a withdrawal after the
# final answer, a different answer after it, a hedge, or a third different answer scores 0.
@pytest.mark.parametrize("response,truth,expected", [
    ("The answer is 12. Wait, that is wrong: the answer is 15.", "15", 1.0),
    ("The answer is 12. Wait, that is wrong: the answer is 15.", "12", 0.0),
    (r"I first got $\boxed{12}$, but I made a mistake. Redoing it: $\boxed{15}$.", "15", 1.0),
    (r"So \boxed{7}. Checking: 3 + 4 = 7, so \boxed{7}.", "7", 1.0),
    ("The answer is 12. Hmm, no: it is 15.", "12", 0.0),  # withdrawn after the final statement
    ("The answer is 12. Hmm, no: it is 15.", "15", 1.0),  # ... and 15 stated after the withdrawal
    ("#### 12\nActually, I made a mistake; it should be 12.", "12", 1.0),  # withdrawn, then restated
    (r"\boxed{0.05}. The margin of error is 5%.", "0.05", 1.0),  # "error" and "mistake" withdraw only as
    (r"\boxed{5}. A common mistake is to answer 6.", "5", 1.0),  # "made an error", "my mistake", ...
    ("\\boxed{12}\n\nAlternatively, \\boxed{15}.", "15", 0.0),  # two answers, neither withdrawn
    ("The answer is 12. The answer is 15.", "15", 0.0),
    (r"\boxed{12}. Wait, \boxed{13}. Wait, \boxed{14}. No wait, \boxed{15}.", "15", 0.0),  # sprayed
    ("#### 12\n#### 13\n#### 15", "15", 0.0),
    ("I think the answer is 7, but it might be 8.", "7", 0.0),
    ("The answer is probably 15.", "15", 0.0),
    ("It could be 12, 13, 14 or 15", "15", 0.0),
    ("Maybe 15?", "15", 0.0),
    ("<think>\nIs it 12? No, 3 * 5 = 15.\n</think>\nThe answer is $\\boxed{15}$.", "15", 1.0),
    ("<think>\nThe answer is \\boxed{15}.\n</think>\nThe answer is $\\boxed{12}$.", "15", 0.0),
])
def test_self_correction_and_spraying(response, truth, expected):
  assert M.verify(response, truth) == expected


# A withdrawal after the answer ("just kidding", "on second thought", "wait", "I made an error") takes it
# back: the answer restated after the withdrawal counts ("it's 9", ", 9.", "the answer is 9", "= 9"),
# and with none restated the response has no answer. A number after the withdrawal that is not a
# restatement ("an error in step 2") is not an answer; a hedged or flip-flopping one pays nothing.
@pytest.mark.parametrize("response,truth,expected", [
    ("The answer is 7. Just kidding, it's 9.", "7", 0.0),
    ("The answer is 7. Just kidding, it's 9.", "9", 1.0),
    ("The answer is 7. On second thought, 9.", "7", 0.0),
    ("The answer is 7. On second thought, 9.", "9", 1.0),
    (r"\boxed{7} Wait, I made an error.", "7", 0.0),
    (r"\boxed{7} Wait, I made an error in step 2.", "7", 0.0),
    (r"\boxed{7} Wait, I made an error in step 2.", "2", 0.0),
    ("#### 7\nNever mind, I take that back.", "7", 0.0),
    (r"\boxed{7}. Wait, that's wrong: the answer is \boxed{9}.", "9", 1.0),
    (r"\boxed{7}. Wait, that's wrong: the answer is 9.", "9", 1.0),
    (r"\boxed{7}. Wait, that's wrong: the answer is 9.", "7", 0.0),
    (r"\boxed{7}. Let me double-check: 3 + 4 = 7.", "7", 1.0),
    ("#### 7\nWait, let me double-check: 3 + 4 = 7. Yes, that's correct.", "7", 1.0),  # a confirmation after it
    (r"\boxed{7} Wait, I made an error in step 2. Yes.", "2", 0.0),
    ("The total is $12$. Hold on, I forgot the tax: the total is $13.50$.", "13.5", 1.0),
    ("The answer is 7. Just kidding, it's probably 9.", "9", 0.0),
    ("The answer is 7. Wait, it's 9 or 10.", "9", 0.0),
    ("The answer is 7. Wait, no: 8. The answer is 7. Wait, no: 8.", "8", 0.0),  # flip-flopping
    (r"\boxed{5}. Wait, \boxed{6}. Actually it is 9.", "9", 0.0),  # a third answer: sprayed
])
def test_a_withdrawal_after_the_answer_takes_it_back(response, truth, expected):
  assert M.verify(response, truth) == expected


# Clock times are times: equal only to the same time (12-hour against 24-hour by its 24-hour reading, a
# bare hour of 1-12 by the clock face), never to a number or a ratio that happens to have the same value.
@pytest.mark.parametrize("response,truth,expected", [
    ("The meeting starts at 3:45.", "3:45", 1.0),
    ("The meeting starts at 7:30.", "3:45", 0.0),
    ("The answer is 3:45 pm.", "3:45 PM", 1.0),
    ("The answer is 3:45 p.m.", "15:45", 1.0),
    ("The answer is 3:45 pm.", "3:45", 1.0),
    ("The answer is 3:45 am.", "3:45 PM", 0.0),
    ("The answer is 3:45 am.", "15:45", 0.0),
    ("#### 15:45", "3:45", 0.0),
    (r"\boxed{6:30}", "3:15", 0.0),  # equal as ratios, different times
    (r"\boxed{2:30}", "4:60", 0.0),  # 4:60 is no time; 2:30 is one, never a ratio
    ("The answer is 12:00", "1:00", 0.0),
    ("#### 1:30", "90", 0.0),  # a time is not its minutes
    ("The answer is 1:30", "1/30", 0.0),
    ("The answer is 1:30", "1.5", 0.0),
    ("She arrives at 3 pm.", "3:00 PM", 1.0),
    ("She arrives at 3 pm.", "3:00 AM", 0.0),
    ("The answer is: The train leaves at 10:05 a.m.", "10:05 AM", 1.0),
    ("The finish time is 1:05:30 pm.", "13:05:30", 1.0),
    ("The finish time is 1:05:30 pm.", "13:05", 0.0),
    ("The ratio of boys to girls is 3:4.", "6:8", 1.0),  # a ratio stays a ratio
    (r"\boxed{3:4}", "6:8", 1.0),
])
def test_clock_times_are_compared_as_times(response, truth, expected):
  assert M.verify(response, truth) == expected


# Boxes separated only by connectors form one answer (a set), compared as a set.
@pytest.mark.parametrize("response,truth,expected", [
    (r"$\boxed{2}, \boxed{3}$", r"\{2, 3\}", 1.0),
    (r"The solutions are $x = \boxed{2}$ and $x = \boxed{3}$.", r"\{3,2\}", 1.0),
    (r"$\boxed{-3}$ and $\boxed{3}$", r"\pm 3", 1.0),
    (r"$\boxed{2}, \boxed{3}$", r"\{2, 3, 4\}", 0.0),
    (r"$\boxed{2}, \boxed{3}$", "2", 0.0),
    (r"\boxed{12} \boxed{13} \boxed{14} \boxed{15}", "15", 0.0),
])
def test_several_boxes_form_one_answer(response, truth, expected):
  assert M.verify(response, truth) == expected


# A reference's label names the answer: points (AB, \angle ABC), one letter, named ratios.
@pytest.mark.parametrize("response,truth,expected", [
    (r"\boxed{4}", "AB = 4", 1.0),
    (r"\boxed{AB = 4}", "4", 1.0),
    (r"\boxed{5}", "AB = 4", 0.0),
    (r"\boxed{1/3}", r"x = \frac{1}{3}", 1.0),
    (r"\boxed{30^\circ}", r"\angle ABC = 30^\circ", 1.0),
    (r"\boxed{3:4}", "AB:BC = 3:4", 1.0),
    (r"\boxed{6:8}", "3:4", 1.0),  # ratios are equal up to a common factor
    (r"\boxed{\frac{3}{4}}", "AB:BC = 3:4", 1.0),  # a two-term ratio is its quotient
    (r"\boxed{4:3}", "AB:BC = 3:4", 0.0),
    (r"\boxed{1:3:2}", "a:b:c = 2:4:6", 0.0),
    (r"\boxed{6}", "xy = 6", 0.0),  # lower-case letters side by side are a product: an equation
])
def test_labels_in_the_reference(response, truth, expected):
  assert M.verify(response, truth) == expected


@pytest.mark.parametrize("response,truth,expected", [
    (r"\boxed{2,5}", "2.5", 1.0),  # a decimal comma, where the reference is one number
    ("La réponse est 2,5 litres.", "2.5", 1.0),
    (r"\boxed{2,5}", "25", 0.0),
    (r"\boxed{1,234}", "1234", 1.0),  # three digits after the comma: a thousands separator
    (r"\boxed{1,234}", "1.234", 0.0),
    (r"\boxed{0,111}", "0.111", 1.0),  # a leading 0 never starts a thousands group
    (r"\boxed{2 \text{ million}}", "2000000", 1.0),
    (r"\boxed{2 \text{ million}}", "2", 0.0),
    ("The population is 2.5 million.", "2500000", 1.0),
    (r"\boxed{0.3333333333333333}", r"\frac{1}{3}", 1.0),  # a float printout: within a unit of its last place
    (r"\boxed{0.6666666666666667}", r"\frac{2}{3}", 1.0),
    (r"\boxed{3.141592653589793}", r"\pi", 1.0),
    (r"\boxed{0.333333}", r"\frac{1}{3}", 0.0),  # fewer than LONG_DECIMAL_PLACES places: a rounding, not 1/3
    (r"\boxed{3.14159}", r"\pi", 0.0),
    (r"\boxed{0.3333333333333}", r"\frac{1}{4}", 0.0),
    (r"\boxed{\cfrac{2}{1+\cfrac{1}{2}}}", r"\frac43", 1.0),
    ("\\\\boxed{\\\\frac{1}{3}}", r"\frac13", 1.0),  # JSON-escaped LaTeX
    ("\\\\boxed{\\\\frac{1}{4}}", r"\frac13", 0.0),
])
def test_number_forms(response, truth, expected):
  assert M.verify(response, truth) == expected


@pytest.mark.parametrize("response,truth,expected", [
    (r"\boxed{\pm 3}", r"\{-3, 3\}", 1.0),
    (r"\boxed{\pm 3}", "3", 0.0),
    (r"\boxed{\mathbb{R}}", r"(-\infty, \infty)", 1.0),
    (r"\boxed{(-\infty, \infty)}", r"\mathbb{R}", 1.0),
    (r"\boxed{\text{all real numbers}}", r"(-\infty,\infty)", 1.0),
    (r"\boxed{\mathbb{R}}", r"(0, \infty)", 0.0),
    (r"\boxed{\{1\} \cup \{2, 3\}}", r"\{1, 2, 3\}", 1.0),
    (r"\boxed{\{1\} \cup \{2\}}", r"\{1, 2, 3\}", 0.0),
    (r"\boxed{5 \geq x > -2}", "(-2, 5]", 1.0),
    (r"\boxed{-2 \le x < 5}", "(-2, 5)", 0.0),
    (r"\boxed{x > -2 \text{ and } x < 5}", "(-2, 5)", 1.0),  # `and`: an intersection
    (r"\boxed{x > 1 \text{ and } x < 3}", r"\mathbb{R}", 0.0),
    (r"\boxed{x > -2 \text{ or } x < 5}", "(-2, 5)", 0.0),  # `or`: a union (all of R here)
    (r"\boxed{[-1, 1]}", r"\{x : -1 \le x \le 1\}", 1.0),
])
def test_sets_and_intervals(response, truth, expected):
  assert M.verify(response, truth) == expected


@pytest.mark.parametrize("response,truth,expected", [
    (r"\boxed{\sec^2 y}", r"\tan^2 y + 1", 1.0),
    (r"\boxed{\sec^2 y}", r"\tan^2 y", 0.0),
    (r"\boxed{2\sin x \cos x}", r"\sin 2x", 1.0),
    (r"\boxed{\sin 2x}", r"2\sin x", 0.0),
    (r"\boxed{\frac{1}{\cos^2\theta}}", r"1 + \tan^2\theta", 1.0),
    (r"\boxed{\log_2 8}", "3", 1.0),
    (r"\boxed{\ln e^2}", "2", 1.0),
    (r"\boxed{2x + 3y - z = 6}", "2x + 3y - z - 6 = 0", 1.0),  # a plane: equal up to a nonzero factor
    (r"\boxed{-2x - 3y + z + 6 = 0}", "2x+3y-z=6", 1.0),
    (r"\boxed{z = 6 - 2x - 3y}", "2x + 3y + z = 6", 1.0),
    (r"\boxed{2x + 3y - z = 6}", "2x + 3y + z = 6", 0.0),
    (r"\boxed{x - 2y + 3z - 4 = 0}", "x-2y+3z=-4", 0.0),
    (r"\boxed{2x + 3y - z}", "2x + 3y - z = 6", 0.0),
])
def test_identities_and_planes(response, truth, expected):
  assert M.verify(response, truth) == expected


@pytest.mark.parametrize("text,env,value", [
    (r"\sin^2 x + \cos^2 x", {"x": 0.7}, 1.0), (r"\sin^{-1} x", {"x": 0.5}, math.pi / 6),
    (r"\log_{10} 1000", {}, 3.0), (r"\tan\theta", {"theta": 0.3}, math.tan(0.3)), ("cos(0)", {}, 1.0),
    (r"e^{2}", {}, math.e ** 2), (r"\sin x \cos x", {"x": 0.4}, math.sin(0.4) * math.cos(0.4)),
])
def test_functions_evaluate(text, env, value):
  assert math_expr.evaluate(math_expr.parse(text), env) == pytest.approx(value, rel=1e-12)


@pytest.mark.parametrize("text", [r"\ln 0", r"\ln(-1)", r"\arcsin 2", r"\exp(\exp(100))", r"\sin"])
def test_functions_reject_outside_their_domain(text):
  with pytest.raises(math_expr.ParseError):
    math_expr.evaluate(math_expr.parse(text))


def test_doubled_backslashes_are_halved_only_when_every_command_is_doubled():
  # A matrix row break `\\` next to single-backslash commands is not doubled escaping.
  matrix = r"\boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}}"
  assert M.verify(matrix, r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}") == 1.0
  doubled = matrix.replace("\\", "\\\\")
  assert M.verify(doubled, r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}") == 1.0


def test_verify_is_a_pure_function_of_response_and_reference():
  pairs = [(r, t) for r, t, _ in GSM8K_CASES + MATH_CASES]
  first = [M.verify(r, t) for r, t in pairs]
  again = [M.verify(r, t) for r, t in reversed(pairs)][::-1]
  assert first == again == [e for *_, e in GSM8K_CASES + MATH_CASES]
