"""reward_fn='math_verify': HuggingFace's Math-Verify library as the verifier, to match what peers use.

    pip install 'llamarl_jax[math]'      # math-verify, latex2sympy2_extended, sympy, antlr4 runtime

`verify(response_text, ground_truth) -> 1.0 | 0.0` with Math-Verify's default extraction and
comparison (`math_verify.parse` on the response, `math_verify.verify(gold, prediction)`). The label
goes through our `extract_ground_truth` (bare answer, GSM8K `#### 42`, MATH solution's \\boxed) and is
given to Math-Verify as `$label$`, the form its README uses for gold answers.

It runs where every reward function runs: in `RewardExecutor`'s worker processes under the same hard
per-sample timeout (`timeout_s`). Math-Verify also guards its own parsing and comparison with
`signal.alarm` timeouts (its defaults, 5 s each); a signal can only be set on a process's main thread,
so they are turned off elsewhere (an `inline=True` executor driven from a thread) and the caller's
limit is the only one there.

Safety, unlike `rewards.math`: Math-Verify hands substrings of the response to sympy (LaTeX through
latex2sympy2's ANTLR parser, and plain expressions made only of digits, `.`, spaces and `+-*/^()×÷`
through `sympy.parse_expr`, which compiles them with Python's `eval`). The regular expression keeps names
out, so no code can be called, but `9**9**9**9` is evaluated: this backend relies on the timeouts above.
"""

from __future__ import annotations

import threading

try:
  import math_verify
  from math_verify.errors import TimeoutException
except ImportError as e:  # an optional dependency: say how to get it
  raise ImportError("reward_fn='math_verify' needs the Math-Verify library, which is not installed: "
                    "pip install 'llamarl_jax[math]' (or pip install math-verify)") from e

from llamarl_jax.rewards.math import extract_ground_truth
from llamarl_jax.rewards.math_extract import MAX_RESPONSE_CHARS

PARSE_TIMEOUT_S = 5    # math_verify.parse's default (seconds, integer: signal.alarm)
VERIFY_TIMEOUT_S = 5   # math_verify.verify's default


def verify(response_text: str, ground_truth: str) -> float:
  """1.0 if Math-Verify finds the response's answer equal to the label, else 0.0 (never raises)."""
  if not isinstance(response_text, str) or not isinstance(ground_truth, str):
    return 0.0
  if len(response_text) > MAX_RESPONSE_CHARS:  # the same bound as rewards.math
    return 0.0
  on_main_thread = threading.current_thread() is threading.main_thread()
  parse_timeout = PARSE_TIMEOUT_S if on_main_thread else None
  verify_timeout = VERIFY_TIMEOUT_S if on_main_thread else None
  try:
    gold = math_verify.parse(f"${extract_ground_truth(ground_truth)}$", parsing_timeout=parse_timeout)
    prediction = math_verify.parse(response_text, parsing_timeout=parse_timeout)
    if not gold or not prediction:
      return 0.0
    return 1.0 if math_verify.verify(gold, prediction, timeout_seconds=verify_timeout) else 0.0
  except (Exception, TimeoutException):  # noqa: BLE001 - an answer that cannot be checked scores 0
    return 0.0
