"""Hostile model text: code-injection strings score 0 and execute nothing; pathological sizes are fast.

"Execute nothing" is shown two ways: a sentinel file the payloads try to create never appears, and,
in a fresh interpreter, a Python audit hook sees no exec/compile/import/os.system/subprocess/open
event while the verifiers run over every payload (with a positive control that the hook works).
"""

import json
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
  stdin = json.dumps([payloads(str(sentinel)), str(sentinel)])
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
  }


@pytest.mark.parametrize("name", list(pathological()))
def test_pathological_inputs_return_quickly_with_zero(name):
  text = pathological()[name]
  for response, truth in ((text, "1"), ("1", text)):
    t0 = time.perf_counter()
    assert M.verify(response, truth) == 0.0
    elapsed = time.perf_counter() - t0
    assert elapsed < 0.5, f"{name}: {elapsed:.3f}s (bounds should keep every input in milliseconds)"


def test_payloads_and_pathological_inputs_through_the_executor(sentinel):
  # The whole path used in training: worker processes with a hard per-sample timeout.
  texts = payloads(str(sentinel)) + list(pathological(200_000).values()) + ["#### 42"]
  with RewardExecutor("math", num_workers=1, timeout_s=2.0) as executor:
    t0 = time.perf_counter()
    rewards, metrics = executor.score(texts, ["42"] * len(texts))
  assert time.perf_counter() - t0 < 10.0
  assert rewards.tolist() == [0.0] * (len(texts) - 1) + [1.0]
  assert metrics["reward/errors"] == 0 and metrics["reward/timeouts"] == 0
