"""The `Environment` protocol: what an episode is, turn by turn.

An episode starts from a prompt (`PromptExample`). The model writes a turn (sampled up to its stop
token); the environment reads the turn's text and answers with a `Transition`: the text to append
(an observation: a tool's output, a user message; None when nothing is appended), a reward
contribution, and whether the episode is over. The episode also ends at `max_turns` model turns or
when its response reaches the token budget. At the end the run's reward function (the verifier, in
its time-limited worker pool) scores `answer(turns)`, and the episode's reward is that score plus
the transitions' rewards.

Implementations are plain Python (no JAX): `step` runs on a worker thread of the rollout's tool
pool, never on the generator's or the trainer's thread, and must be thread-safe for distinct
episodes. A tool's failure is an observation the step returns; an exception out of `step` is a bug in
the environment and stops the run (`envs.episodes.EnvironmentFailed`). `SingleTurn` is the one-turn
case: the rollout path is the same for both (`envs.episodes.run_episodes`), and for `SingleTurn` it is
exactly one `Sampler.generate` call.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """What a turn's tool call did, for the metrics: tool name, status ('ok', 'error', 'timeout',
  'memory', 'output_limit', 'forbidden', 'unknown_tool') and wall seconds."""
  tool: str
  status: str
  seconds: float

  @property
  def ok(self) -> bool:
    return self.status == "ok"


@dataclasses.dataclass(frozen=True)
class Transition:
  """The environment's answer to one model turn.

  observation: text appended after the turn (through the environment's observation format) before
    the model's next turn; None = nothing appended (the episode must then be `done`).
  reward: this turn's reward contribution (added to the verifier's score of the final answer).
  done: the episode is over (no further model turn).
  call: the tool call this turn made, if any (metrics).
  """
  observation: str | None = None
  reward: float = 0.0
  done: bool = True
  call: ToolCall | None = None

  def __post_init__(self):
    if self.observation is None and not self.done:
      raise ValueError("a Transition that is not done needs an observation for the model's next turn")


@runtime_checkable
class Environment(Protocol):
  """An episode's rules. `max_turns`: model turns at most (the rollout also stops at the token budget)."""

  max_turns: int

  def step(self, example: Any, turns: list[str], text: str) -> Transition:
    """The answer to the model's latest turn `text`; `turns` are the episode's earlier model turns
    (oldest first, without `text`), `example` its PromptExample."""

  def answer(self, turns: list[str]) -> str:
    """The text the reward function scores, from the episode's model turns."""

  def demonstration(self, example: Any, completion: str) -> list[tuple[str, bool]]:
    """A demonstration episode for supervised warm starts, from the task's reference `completion` (its
    first model turn): segments (text, written by the model). Each model segment is followed by the
    stop token; observation segments are not trained on."""


class SingleTurn:
  """One model turn, scored by the reward function: the default episode."""

  max_turns = 1

  def step(self, example: Any, turns: list[str], text: str) -> Transition:
    return Transition(done=True)

  def answer(self, turns: list[str]) -> str:
    return turns[-1]

  def demonstration(self, example: Any, completion: str) -> list[tuple[str, bool]]:
    return [(completion, True)]
