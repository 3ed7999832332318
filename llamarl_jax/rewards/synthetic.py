"""Seeded, on-the-fly synthetic tasks with exact verifiers: multi-digit arithmetic and Countdown.

These are the embedded default's tasks (a tiny char-level model: SFT warm start, then RL), so prompts
are short and answers trivially parseable:

  arithmetic   prompt "23+58="        ground truth "81"          completion "81"
  countdown    prompt "3 7 25->46:"   ground truth "46:3 7 25"   completion "25+3*7" (one solution)

A model's completion is the answer text followed by EOS. `generate(task, seed, index)` is a pure
function of its arguments, so a stream of tasks is resumable from its index alone; `split` gives a
train/heldout partition of the problem space by a stable hash of the prompt (no heldout problem
ever appears in training).

Verifiers (`score_arithmetic`, `score_countdown`) never evaluate model text as code: Countdown
expressions go through the restricted parser of `llamarl_jax.rewards.math_expr` (numbers, + - * /,
parentheses; no unary signs, powers, variables or implicit multiplication), evaluated exactly.
"""

from __future__ import annotations

import random
import re
import zlib
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar, Union

from llamarl_jax.rewards import math_expr

HELDOUT_MODULUS = 16  # 1 in 16 problems (by prompt hash) is held out for evaluation


@dataclass(frozen=True)
class TaskInstance:
  prompt: str        # what the model is conditioned on, e.g. "23+58="
  ground_truth: str  # what the verifier compares against, e.g. "81"
  completion: str    # the demonstration (SFT target, without EOS), e.g. "81": correct unless the task
                     # models a flawed teacher (ArithmeticTask.demo_sign_error / demo_prefix_rate)


def _operand(rng: random.Random, digits: int) -> int:
  return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


@dataclass(frozen=True)
class ArithmeticTask:
  """`a op b op c ...=` over non-negative integers; answer: the integer value (standard precedence).

  Knobs: operand digits drawn uniformly in [min_digits, max_digits]; num_operands; ops from "+-*".

  demo_sign_error: probability that the *demonstration* of a negative answer drops its minus sign
  ("12-40=" demonstrated as "28"), a systematic error like those of a weaker teacher model whose
  outputs are used for the supervised warm start. The ground truth (and so the RL reward) stays exact:
  RL with the verifier can then surpass the demonstrator, which is the point of RL post-training.
  demo_prefix / demo_prefix_rate: with that probability the demonstration is written `demo_prefix +
  answer` ("ans 81"), a format the exact verifier rejects (a teacher that does not follow the
  answer format; RL learns the format from the reward).
  demo_tool / demo_tool_rate: with that probability the demonstration is the tool call
  `demo_tool(expression)` instead of the answer (a multi-turn `ToolEnvironment` runs the call and
  completes the demonstration with the tool's output as the answer; configs/tiny_tools.gin).
  """
  min_digits: int = 1
  max_digits: int = 2
  num_operands: int = 2
  ops: str = "+-"
  demo_sign_error: float = 0.0
  demo_prefix: str = ""
  demo_prefix_rate: float = 0.0
  demo_tool: str = ""
  demo_tool_rate: float = 0.0
  name: ClassVar[str] = "arithmetic"

  def __post_init__(self):
    if not 1 <= self.min_digits <= self.max_digits <= 12:
      raise ValueError(f"need 1 <= min_digits <= max_digits <= 12, got {self.min_digits}, {self.max_digits}")
    if not 0.0 <= self.demo_sign_error <= 1.0:
      raise ValueError(f"demo_sign_error is a probability, got {self.demo_sign_error}")
    if not 0.0 <= self.demo_prefix_rate <= 1.0:
      raise ValueError(f"demo_prefix_rate is a probability, got {self.demo_prefix_rate}")
    if not 0.0 <= self.demo_tool_rate <= 1.0:
      raise ValueError(f"demo_tool_rate is a probability, got {self.demo_tool_rate}")
    if self.demo_tool_rate and not self.demo_tool:
      raise ValueError("demo_tool_rate > 0 needs demo_tool, the name of the tool the demonstrations call")
    if self.num_operands < 2:
      raise ValueError(f"num_operands must be >= 2, got {self.num_operands}")
    if not self.ops or set(self.ops) - set("+-*"):
      raise ValueError(f"ops must be a non-empty subset of '+-*', got {self.ops!r}")

  def sample(self, rng: random.Random) -> TaskInstance:
    terms = [str(_operand(rng, rng.randint(self.min_digits, self.max_digits))) for _ in range(self.num_operands)]
    expr = terms[0] + "".join(rng.choice(self.ops) + t for t in terms[1:])
    value = math_expr.evaluate(math_expr.parse(expr, allow_vars=False, implicit_mul=False,
                                               allow_pow=False, allow_latex=False))
    answer = str(int(value))
    demo = answer
    if value < 0 and self.demo_sign_error and rng.random() < self.demo_sign_error:
      demo = answer.lstrip("-")
    if self.demo_prefix_rate and rng.random() < self.demo_prefix_rate:
      demo = self.demo_prefix + demo
    if self.demo_tool_rate and rng.random() < self.demo_tool_rate:
      demo = f"{self.demo_tool}({expr})"
    return TaskInstance(prompt=expr + "=", ground_truth=answer, completion=demo)

  @staticmethod
  def score(response_text: str, ground_truth: str) -> float:
    return score_arithmetic(response_text, ground_truth)


_INT_RE = re.compile(r"-?\d{1,40}")


def score_arithmetic(response_text: str, ground_truth: str) -> float:
  """1.0 iff the response (surrounding whitespace ignored) is exactly the integer answer."""
  if not isinstance(response_text, str) or len(response_text) > 64:
    return 0.0
  text = response_text.strip()
  if not _INT_RE.fullmatch(text) or not _INT_RE.fullmatch(ground_truth.strip()):
    return 0.0
  return 1.0 if int(text) == int(ground_truth) else 0.0


# Countdown --------------------------------------------------------------------------------------

# An expression being built: (text, value, precedence) with precedence 0 for +/-, 1 for * and /, 2 atom.
_Node = tuple[str, Fraction, int]


def _combine(a: _Node, op: str, b: _Node) -> _Node:
  """`a op b` with the fewest parentheses that keep the value (both operands are exact integers)."""
  def wrap(node: _Node, needed: bool) -> str:
    return f"({node[0]})" if needed else node[0]
  if op == "+":
    return (f"{a[0]}+{b[0]}", a[1] + b[1], 0)
  if op == "-":
    return (f"{a[0]}-{wrap(b, b[2] == 0)}", a[1] - b[1], 0)
  if op == "*":
    return (f"{wrap(a, a[2] == 0)}*{wrap(b, b[2] == 0)}", a[1] * b[1], 1)
  return (f"{wrap(a, a[2] == 0)}/{wrap(b, b[2] < 2)}", a[1] / b[1], 1)


@dataclass(frozen=True)
class CountdownTask:
  """Reach `target` from `numbers` with + - * / and parentheses, each number used at most once.

  Knobs: num_numbers, numbers drawn from [1, max_number], the ops the generator may use, max_target.
  Targets are built from all numbers with positive integer intermediate results, so a solution
  always exists (the completion is that solution).
  """
  num_numbers: int = 3
  max_number: int = 20
  ops: str = "+-*/"
  max_target: int = 200
  name: ClassVar[str] = "countdown"

  def __post_init__(self):
    if not 2 <= self.num_numbers <= 8:
      raise ValueError(f"num_numbers must be in [2, 8], got {self.num_numbers}")
    if self.max_number < 2:
      raise ValueError(f"max_number must be >= 2, got {self.max_number}")
    if not self.ops or set(self.ops) - set("+-*/"):
      raise ValueError(f"ops must be a non-empty subset of '+-*/', got {self.ops!r}")

  def sample(self, rng: random.Random) -> TaskInstance:
    numbers = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
    for _ in range(100):
      node = self._random_solution(rng, numbers)
      if node is not None and 1 <= node[1] <= self.max_target:
        break
    else:  # always reachable: the sum (or the largest number when the sum is too big)
      node = _combine((str(numbers[0]), Fraction(numbers[0]), 2), "+", (str(numbers[1]), Fraction(numbers[1]), 2))
      node = node if node[1] <= self.max_target else (str(max(numbers)), Fraction(max(numbers)), 2)
    target = int(node[1])
    shown = " ".join(map(str, numbers))
    return TaskInstance(prompt=f"{shown}->{target}:", ground_truth=f"{target}:{shown}", completion=node[0])

  def _random_solution(self, rng: random.Random, numbers: list[int]) -> _Node | None:
    pool: list[_Node] = [(str(n), Fraction(n), 2) for n in numbers]
    while len(pool) > 1:
      rng.shuffle(pool)
      a, b = pool.pop(), pool.pop()
      op = rng.choice(self.ops)
      if op == "-" and a[1] < b[1]:
        a, b = b, a
      if (op == "-" and a[1] == b[1]) or (op == "/" and (b[1] in (0, 1) or a[1] % b[1] != 0)):
        op = "+" if "+" in self.ops else ("*" if "*" in self.ops else None)
        if op is None:
          return None
      pool.append(_combine(a, op, b))
    return pool[0]

  @staticmethod
  def score(response_text: str, ground_truth: str) -> float:
    return score_countdown(response_text, ground_truth)


_COUNTDOWN_TRUTH_RE = re.compile(r"\s*(\d{1,12})\s*:\s*(\d{1,12}(?:\s+\d{1,12}){0,15})\s*")


def parse_countdown_truth(ground_truth: str) -> tuple[int, list[int]]:
  """"46:3 7 25" -> (46, [3, 7, 25]); raises ValueError on anything else."""
  m = _COUNTDOWN_TRUTH_RE.fullmatch(ground_truth)
  if m is None:
    raise ValueError(f"countdown ground truth must look like '46:3 7 25', got {ground_truth[:80]!r}")
  return int(m.group(1)), [int(x) for x in m.group(2).split()]


def score_countdown(response_text: str, ground_truth: str) -> float:
  """1.0 iff the response is an expression over the given numbers (each used at most as often as given)
  with + - * / and parentheses that evaluates exactly to the target. An optional "=..." suffix is
  ignored; only the first line counts."""
  target, numbers = parse_countdown_truth(ground_truth)
  if not isinstance(response_text, str) or len(response_text) > 512:
    return 0.0
  expr = response_text.strip().split("\n", 1)[0].split("=", 1)[0].replace("×", "*").replace("÷", "/")
  try:
    ast = math_expr.parse(expr, allow_vars=False, implicit_mul=False, allow_pow=False,
                          allow_unary=False, allow_latex=False)
    used = math_expr.literals(ast)
    if any(not lit.isdigit() for lit in used):
      return 0.0  # decimals are not among the given numbers
    if Counter(int(lit) for lit in used) - Counter(numbers):
      return 0.0  # a number used more often than given (or not given at all)
    return 1.0 if math_expr.evaluate(ast) == target else 0.0
  except math_expr.ParseError:
    return 0.0


# Streams ----------------------------------------------------------------------------------------

Task = Union[ArithmeticTask, CountdownTask]
TASKS: dict[str, type] = {ArithmeticTask.name: ArithmeticTask, CountdownTask.name: CountdownTask}


def make_task(name: str, **knobs) -> Task:
  """A task by name ("arithmetic" or "countdown") with its difficulty knobs."""
  if name not in TASKS:
    raise ValueError(f"unknown synthetic task {name!r}; available: {sorted(TASKS)}")
  return TASKS[name](**knobs)


def split_of(prompt: str) -> str:
  """"heldout" for 1 in HELDOUT_MODULUS prompts (stable crc32 hash), "train" otherwise."""
  return "heldout" if zlib.crc32(prompt.encode()) % HELDOUT_MODULUS == 0 else "train"


def generate(task: Task, seed: int, index: int, split: str | None = "train") -> TaskInstance:
  """The index-th instance of the task stream `seed` restricted to `split` ("train", "heldout" or None
  for no restriction). Deterministic in (task, seed, index, split) across processes and runs."""
  if split not in ("train", "heldout", None):
    raise ValueError(f"split must be 'train', 'heldout' or None, got {split!r}")
  rng = random.Random(f"{task.name}:{seed}:{index}")  # str seeds hash with sha512: stable everywhere
  for _ in range(100 * HELDOUT_MODULUS):
    inst = task.sample(rng)
    if split is None or split_of(inst.prompt) == split:
      return inst
  raise RuntimeError(f"{task} has (almost) no {split!r} problems; widen its knobs")
