"""Hostile model text: code-injection strings score 0 and execute nothing; pathological sizes, huge numbers,
pathological LaTeX, hedged and sprayed answers score 0 in under 50 ms a call.

"Execute nothing" is shown two ways: a sentinel file the payloads try to create never appears, and,
in a fresh interpreter, a Python audit hook sees no exec/compile/import/os.system/subprocess/open
event while the verifiers run over every payload (with a positive control that the hook works).
"""

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llamarl_jax.executors.reward import RewardExecutor
from llamarl_jax.rewards import math as M
from llamarl_jax.rewards import synthetic

VERIFIERS = [(M.verify, "42"), (synthetic.score_arithmetic, "42"), (synthetic.score_countdown, "46:3 7 25")]


def payloads(sentinel: str) -> list[str]:
  touch = f"touch {sentinel}"
  return [
      f"__import__('os').system('{touch}')",
      f"\\boxed{{__import__('os').system('{touch}')}}",
      f"#### __import__('os').system('{touch}')",
      f"The answer is __import__('os').system('{touch}')",
      "().__class__.__bases__[0].__subclasses__()",
      f"[c for c in ().__class__.__bases__[0].__subclasses__() if c.__name__ == 'Popen'][0]('{touch}', shell=True)",
      f"(lambda: __import__('subprocess').run(['touch', '{sentinel}']))()",
      f"(lambda f: f(f))(lambda f: __import__('os').system('{touch}'))",
      f"eval(\"__import__('os').system('{touch}')\")",
      f"exec(\"open('{sentinel}', 'w').write('x')\")",
      f"open('{sentinel}', 'w').write('pwned')",
      f"\\boxed{{open('{sentinel}','w')}}",
      f"getattr(__builtins__, '__import__')('os').system('{touch}')",
      f"f\"{{__import__('os').system('{touch}')}}\"",
      "sympify(\"__import__('os').system('ls')\")",
      "Symbol('x').__class__.__init__.__globals__",
      f"\\immediate\\write18{{{touch}}}",
      "\\input{/etc/passwd}",
      "__import__('sys').exit(1)",
      "__import__('os').kill(__import__('os').getpid(), 9)",
      "globals()['__builtins__']['exec']('1')",
      "x.__class__.__mro__[-1].__subclasses__()",
      "1; import os; os.system('true')",
      "$(touch /tmp/llamarl_pwned)`touch /tmp/llamarl_pwned`",
  ]


@pytest.fixture
def sentinel():
  """A path the payloads try to create. Letters only: the payloads embed it, and a digit in it (pytest's
  tmp_path is .../pytest-42/...) would be read as the payload's numeric answer."""
  import random
  import shutil
  import string
  import tempfile

  name = "".join(random.choices(string.ascii_lowercase, k=16))
  directory = Path(tempfile.gettempdir()) / f"llamarl_sentinel_{name}"
  assert not any(ch.isdigit() for ch in str(directory)), f"{directory}: the temp dir path holds a digit"
  directory.mkdir()
  path = directory / "SENTINEL"
  yield path
  created = path.exists()
  shutil.rmtree(directory, ignore_errors=True)
  assert not created, "a payload created the sentinel file: model text was executed"


@pytest.mark.parametrize("verifier,truth", VERIFIERS)
def test_code_payloads_score_zero(verifier, truth, sentinel):
  for payload in payloads(str(sentinel)):
    assert verifier(payload, truth) == 0.0, payload


def test_code_payloads_as_ground_truth_score_zero(sentinel):
  for payload in payloads(str(sentinel)):
    assert M.verify("42", payload) == 0.0, payload
  # A text answer compares as text: matching the label is fine, running it is not.
  same = f"\\boxed{{__import__('os').system('touch {sentinel}')}}"
  assert M.verify(same, same) == 1.0


_AUDIT_SCRIPT = """
import json, sys
from llamarl_jax.rewards import math as M, synthetic
payloads, sentinel = json.loads(sys.stdin.read())
WATCHED = ("exec", "compile", "import", "os.system", "subprocess.Popen", "os.exec", "os.posix_spawn",
           "os.fork", "open", "os.remove", "shutil.rmtree", "ctypes.dlopen")
events, recording = [], [False]
def hook(event, args):
  if recording[0] and event.startswith(WATCHED):
    events.append(event)
sys.addaudithook(hook)
recording[0] = True
eval("1")  # positive control: the hook sees code execution
control = sorted(set(events))
events.clear()
for p in payloads:
  M.verify(p, "42"); M.verify("42", p); M.verify(p, p)
  synthetic.score_arithmetic(p, "42"); synthetic.score_countdown(p, "46:3 7 25")
recording[0] = False
print(json.dumps({"control": control, "events": events}))
"""


def test_verifiers_trigger_no_code_execution_events(sentinel):
  texts = payloads(str(sentinel)) + list(pathological(20_000).values()) + [r for r, _ in hedged_and_sprayed().values()]
  stdin = json.dumps([texts, str(sentinel)])
  out = subprocess.run([sys.executable, "-c", _AUDIT_SCRIPT], input=stdin, capture_output=True, text=True,
                       timeout=60, check=True)
  report = json.loads(out.stdout.strip().splitlines()[-1])
  assert "exec" in report["control"] or "compile" in report["control"]
  assert report["events"] == []


def pathological(n: int = 1_000_000) -> dict[str, str]:
  box = lambda s: "\\boxed{" + s + "}"  # noqa: E731
  return {
      "python power tower": "9**9**9**9",
      "latex power tower": box("9^{9^{9^{9}}}"),
      "2-tower": box("2^{2^{2^{2^{2^{2^{2}}}}}}"),
      "huge power": box("9" * 100 + "^" + "9" * 100),
      "megabyte of digits": "1" * n,
      "megabyte boxed": box("9" * n),
      "100k digits": "9" * 99_999,
      "deep parentheses": "(" * 50_000 + "1" + ")" * 50_000,
      "deep boxed parentheses": box("(" * 400 + "1" + ")" * 400),
      "deep sqrt": box("\\sqrt{" * 300 + "2" + "}" * 300),
      "deep frac": box("\\frac{1}{" * 300 + "2" + "}" * 300),
      "unbalanced boxes": "\\boxed{" * 100_000,
      "unary chain": box("-" * 900 + "1"),
      "long product": box("*".join(["9" * 100] * 120)),
      "polynomial": box("(x+1)" * 150),
      "huge negative power": box("x^{-9999}"),
      "roots of huge powers": box("+".join(["(2^{8000})^{1/3}"] * 20)),
      "long list": box("1," * 5000 + "1"),
      "answer-is spam": "answer is " * 50_000,
      "exponent float": "1e999999",
      "tiny decimal": "0." + "0" * 99_990 + "1",
      # huge numbers
      "10-tower": box("10^{10^{10}}"),
      "999-digit literal": box("9" * 999),
      "scaled huge literal": box("9" * 99 + " trillion"),
      "990-place decimal": box("0." + "3" * 990),
      "exp overflow": box("\\exp(\\exp(\\exp(100)))"),
      "log of zero": box("\\ln 0"),
      # pathological LaTeX
      "deep sin": box("\\sin " * 400 + "x"),
      "sin power tower": box("\\sin^{" * 100 + "2" + "}" * 100 + " x"),
      "deep log bases": box("\\log_{" * 100 + "2" + "}" * 100 + " 8"),
      "deep left": box("\\left(" * 300 + "1" + "\\right)" * 300),
      "32x32 polynomial matrix": box("\\begin{pmatrix}" + "\\\\".join(["&".join(["x^2+1"] * 32)] * 32) +
                                     "\\end{pmatrix}"),
      "long union": box("\\cup".join(["[1,2]"] * 200)),
      "nested set builders": box("\\{x : " * 200 + "x>1" + "\\}" * 200),
      "long ratio": box(":".join(["7"] * 300)),
      "long and chain": box(" and ".join(["x>1"] * 30)),
      "pm chain": box("\\pm 1" * 200),
      "doubled backslashes": "\\\\" * 50_000,
      "dollars": "$" * 99_000,
      "think tags": "<think>" * 10_000 + "</think>" * 10_000,
      "decimal commas": "1,5 " * 20_000,
  }


def _seconds(response: str, truth: str) -> float:
  """The best of three timings of one call, in this thread's CPU time: the call's own cost, which other
  processes on a busy machine do not stretch (the verifier runs in the calling thread)."""
  best = math.inf
  for _ in range(3):
    t0 = time.thread_time()
    M.verify(response, truth)
    best = min(best, time.thread_time() - t0)
  return best


@pytest.mark.parametrize("name", list(pathological()))
def test_pathological_inputs_return_quickly_with_zero(name):
  text = pathological()[name]
  for response, truth in ((text, "1"), ("1", text), (text, text[:900])):
    if response != truth:
      assert M.verify(response, truth) == 0.0
    elapsed = _seconds(response, truth)
    assert elapsed < 0.05, f"{name}: {elapsed * 1000:.1f} ms a call (bounds should keep every input in milliseconds)"


_POLY = "+".join(f"{k}x^{k}y" for k in range(1, 30))  # within MAX_TOKENS: each one parses


def hedged_and_sprayed() -> dict[str, tuple[str, list[str]]]:
  """name -> (response, the answers it states): none of them may be paid."""
  box = lambda s: "\\boxed{" + s + "}"  # noqa: E731
  return {
      "or": ("The answer is 5 or 6.", ["5", "6"]),
      "boxes or": (box("5") + " or " + box("6"), ["5", "6"]),
      "maybe": ("The answer is maybe 6.", ["6"]),
      "might be": ("I think the answer is 7, but it might be 8.", ["7", "8"]),
      "question marks": ("12? 13? 14? 15?", ["12", "15"]),
      "two boxes apart": (box("12") + "\n\nAlternatively, " + box("15"), ["12", "15"]),
      "withdrawn final": ("The answer is 12. Hmm, no: that is wrong.", ["12"]),
      "withdrawn, then hedged": ("The answer is 12. Wait, it's 15 or 16.", ["12", "15", "16"]),
      "withdrawn, then a step number": (box("12") + " Wait, I made an error in step 2.", ["12", "2"]),
      "later hash": (box("5") + "\n#### 6", ["5", "6"]),
      "boxes sprayed": (" hmm ".join(box(str(k)) for k in range(1, 2000)), ["1", "7", "1999"]),
      "boxes sprayed with retractions": (" Wait, no. ".join(box(str(k)) for k in range(1, 50)), ["48", "49"]),
      "answer-is sprayed": (" ".join(f"The answer is {k}." for k in range(1, 3000)), ["1", "2999"]),
      "hashes sprayed": ("\n".join(f"#### {k}" for k in range(1, 3000)), ["1", "2999"]),
      "one box holding many": (box(", ".join(str(k) for k in range(1, 30))), ["1", "29"]),
      "choices sprayed": ("The answer is (A). The answer is (B). The answer is (C). " + box("D"), ["A", "D"]),
      "retractions sprayed": ("The answer is 7. Wait, no: 8. " * 2000, ["7", "8"]),
      "polynomials sprayed": ("\n".join(f"The answer is ${_POLY.replace('x', v)}$. Wait," for v in "abcdefghijklmnop") +
                              box(_POLY), [_POLY, _POLY.replace("x", "p")]),
  }


@pytest.mark.parametrize("name", list(hedged_and_sprayed()))
def test_hedged_and_sprayed_answers_score_zero_quickly(name):
  response, stated = hedged_and_sprayed()[name]
  for truth in stated:
    assert M.verify(response, truth) == 0.0, (name, truth)
    elapsed = _seconds(response, truth)
    assert elapsed < 0.05, f"{name}: {elapsed * 1000:.1f} ms a call"


def test_payloads_and_pathological_inputs_through_the_executor(sentinel):
  # The whole path used in training: worker processes with a hard per-sample timeout.
  texts = payloads(str(sentinel)) + list(pathological(200_000).values()) + ["#### 42"]
  with RewardExecutor("math", num_workers=1, timeout_s=2.0) as executor:
    t0 = time.perf_counter()
    rewards, metrics = executor.score(texts, ["42"] * len(texts))
  assert time.perf_counter() - t0 < 10.0
  assert rewards.tolist() == [0.0] * (len(texts) - 1) + [1.0]
  assert metrics["reward/errors"] == 0 and metrics["reward/timeouts"] == 0
