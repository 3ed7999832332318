"""`ToolEnvironment`: episodes in which the model may call tools before it answers.

A model turn whose whole text is a call `name(args)` of an offered tool runs the tool; its output
comes back as the observation `[output]` (the plain marker format of the embedded char tokenizer:
`format_observation` renders it through the tokenizer's chat template where one exists) and the
model writes its next turn. Any other turn is the episode's answer. With no tools offered (the
no-tool baseline) every turn is an answer, calls included.

  prompt      "347*829="
  turn 1      "calc(347*829)" <eos>        the model's tokens: trained on, behaviour log-probs exact
  observation "[287663]"                   appended by the environment: masked out of the loss
  turn 2      "287663" <eos>               the answer the verifier scores

Tools (`TOOLS`): 'calc' evaluates + - * / and parentheses exactly with the restricted parser of the
math verifier (never `eval`; bounded length), in process; 'python' runs the code in the sandbox of
`llamarl_jax.tools` (a confined child process per call, CPU/wall/memory/output limits) and returns
what it printed. A tool's failure (a parse error, a timeout, hostile code) is an error observation
and counted in the metrics; it never raises into the rollout.
"""

from __future__ import annotations

import re
import time
from fractions import Fraction
from typing import Any, Callable

from llamarl_jax.envs.base import ToolCall, Transition

# The tools' JSON schemas (the `tools=` of transformers' chat templates; `PromptSource(tools=...)`).
TOOL_SCHEMAS = {
    "calc": {"type": "function", "function": {
        "name": "calc", "description": "Exact arithmetic: + - * / and parentheses on integers and decimals.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
    "python": {"type": "function", "function": {
        "name": "python", "description": "Run Python code in a sandbox; returns what it prints.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}},
}

CALL_RE = re.compile(r"\s*([A-Za-z_]\w{0,31})\((.*)\)\s*", re.DOTALL)
MAX_CALC_CHARS = 200


def calc(expression: str) -> tuple[str, str]:
  """(output, status) of the calculator on `expression`: exact arithmetic on + - * / and parentheses
  (integers and decimals; results as integers or reduced fractions). Never evaluates code."""
  from llamarl_jax.rewards import math_expr

  if len(expression) > MAX_CALC_CHARS:
    return f"error: expression longer than {MAX_CALC_CHARS} characters", "error"
  try:
    value = math_expr.evaluate(math_expr.parse(expression, allow_vars=False, implicit_mul=False, allow_pow=False,
                                               allow_latex=False))
  except (math_expr.ParseError, ZeroDivisionError, OverflowError) as e:
    return f"error: {str(e)[:80] or type(e).__name__}", "error"
  if isinstance(value, Fraction):
    return (str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"), "ok"
  return repr(value), "ok"


class PythonTool:
  """The sandboxed interpreter as a tool: `(output, status)` of running the call's argument as code."""

  def __init__(self, timeout_s: float = 5.0, max_workers: int = 2):
    from llamarl_jax.tools import SandboxLimits, SandboxPool

    self.pool = SandboxPool(SandboxLimits(cpu_s=timeout_s, wall_s=timeout_s), max_workers=max_workers)

  def __call__(self, code: str) -> tuple[str, str]:
    result = self.pool.run(code)
    return result.observation(), result.status

  def close(self) -> None:
    self.pool.close()


class ToolEnvironment:
  """Turns that call a tool get its output back; any other turn is the answer (module docstring).

  tools: name -> callable(args) -> (output, status); empty = the no-tool baseline.
  max_turns: model turns at most. error_reward: the reward contribution of a failed tool call
    (default 0: a failed call costs only the turn it used).
  obs_open / obs_close: the markers around an observation.
  """

  def __init__(self, tools: dict[str, Callable[[str], tuple[str, str]]], *, max_turns: int = 3,
               error_reward: float = 0.0, obs_open: str = "[", obs_close: str = "]", max_output_chars: int = 256):
    if max_turns < 1:
      raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    self.tools, self.max_turns, self.error_reward = dict(tools), max_turns, error_reward
    self.obs_open, self.obs_close, self.max_output_chars = obs_open, obs_close, max_output_chars

  def parse_call(self, text: str) -> tuple[str, str] | None:
    """(tool name, argument) if the turn is a call of an offered tool's shape, else None."""
    if not self.tools:
      return None
    m = CALL_RE.fullmatch(text)
    return (m.group(1), m.group(2)) if m else None

  def run_tool(self, name: str, args: str) -> tuple[str, ToolCall]:
    t0 = time.monotonic()
    if name not in self.tools:
      output, status = f"error: no tool {name!r}; tools: {', '.join(sorted(self.tools))}", "unknown_tool"
    else:
      try:
        output, status = self.tools[name](args)
      except Exception as e:  # noqa: BLE001 - a tool's own failure is an observation, not a crash
        output, status = f"error: {type(e).__name__}: {str(e)[:80]}", "error"
    if len(output) > self.max_output_chars:
      output = output[:self.max_output_chars] + "..."
    return output, ToolCall(name, status, time.monotonic() - t0)

  def step(self, example: Any, turns: list[str], text: str) -> Transition:
    parsed = self.parse_call(text)
    if parsed is None:
      return Transition(done=True)
    output, call = self.run_tool(*parsed)
    return Transition(observation=self.obs_open + output + self.obs_close,
                      reward=0.0 if call.ok else self.error_reward, done=False, call=call)

  def answer(self, turns: list[str]) -> str:
    return turns[-1]

  def demonstration(self, example: Any, completion: str) -> list[tuple[str, bool]]:
    """A call in the reference completion is run, and the demonstrated answer is the tool's output
    (the teacher copies it); any other completion is a one-turn answer."""
    parsed = self.parse_call(completion)
    if parsed is None:
      return [(completion, True)]
    output, call = self.run_tool(*parsed)
    if not call.ok:
      raise ValueError(f"the demonstration {completion!r} calls {parsed[0]} and fails: {output}")
    return [(completion, True), (self.obs_open + output + self.obs_close, False), (output, True)]

  def close(self) -> None:
    for tool in self.tools.values():
      if hasattr(tool, "close"):
        tool.close()


def make_environment(env_config) -> Any:
  """The `Environment` of an `EnvConfig`: SingleTurn, or a ToolEnvironment with the configured tools."""
  from llamarl_jax.envs.base import SingleTurn

  if not env_config.multi_turn:
    return SingleTurn()
  tools: dict[str, Callable] = {}
  for name in env_config.tools:
    if name == "calc":
      tools[name] = calc
    elif name == "python":
      tools[name] = PythonTool(env_config.tool_timeout_s, env_config.tool_workers)
    else:
      raise ValueError(f"unknown tool {name!r}")
  return ToolEnvironment(tools, max_turns=env_config.max_turns)
