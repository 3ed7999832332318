"""Reward functions: `fn(response_text, ground_truth) -> float`, registered by name.

Built-ins: "math" (`rewards.math.verify`, GSM8K/MATH answers), "math_verify" (the same job done by
HuggingFace's Math-Verify library, the optional extra `pip install 'llamarl_jax[math]'`; imported when
first asked for), "arithmetic" and "countdown" (the synthetic tasks' exact verifiers). Register your
own with

    @register_reward("my_reward")
    def my_reward(response_text: str, ground_truth: str) -> float: ...

`RewardExecutor` runs reward functions in spawned worker processes, which receive the function by
pickled reference (module + name). So a reward function must be defined at the top level of an
importable module (not a lambda, closure or nested function); a function in a script's `__main__`
works too when the script guards its entry point with `if __name__ == "__main__":`.
This package must stay free of JAX imports: the workers import it. `RewardModel` (a Hugging Face
`*ForSequenceClassification` reward model, `rewards.reward_model`) runs JAX and is imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Callable, Union

from llamarl_jax.rewards import math, synthetic

RewardFn = Callable[[str, str], float]

_REGISTRY: dict[str, RewardFn] = {}
_LAZY: dict[str, str] = {}  # name -> "module:function", for reward functions with optional dependencies


def register_reward(name: str, fn: RewardFn | None = None):
  """Register `fn` under `name`; usable as a decorator (`@register_reward("name")`) or a call."""
  def add(f: RewardFn) -> RewardFn:
    if not callable(f):
      raise TypeError(f"reward {name!r} must be callable, got {type(f).__name__}")
    if name in _LAZY or (name in _REGISTRY and _REGISTRY[name] is not f):
      owner = _LAZY.get(name) or _REGISTRY[name]
      raise ValueError(f"reward {name!r} is already registered to {owner!r}; pick another name")
    _REGISTRY[name] = f
    return f
  return add(fn) if fn is not None else add


def get_reward_fn(name_or_fn: Union[str, RewardFn]) -> RewardFn:
  """The reward function registered as `name_or_fn`, or `name_or_fn` itself when it is callable."""
  if callable(name_or_fn):
    return name_or_fn
  if name_or_fn in _LAZY:  # raises ImportError saying what to install when the dependency is missing
    module, _, attr = _LAZY[name_or_fn].partition(":")
    return getattr(importlib.import_module(module), attr)
  if name_or_fn not in _REGISTRY:
    raise KeyError(f"no reward function named {name_or_fn!r}; registered: {registered_rewards()}. "
                   "Register one with llamarl_jax.rewards.register_reward.")
  return _REGISTRY[name_or_fn]


def registered_rewards() -> list[str]:
  return sorted([*_REGISTRY, *_LAZY])


register_reward("math", math.verify)
_LAZY["math_verify"] = "llamarl_jax.rewards.math_verify_backend:verify"
register_reward("arithmetic", synthetic.score_arithmetic)
register_reward("countdown", synthetic.score_countdown)


def __getattr__(name: str):
  if name == "RewardModel":  # JAX: imported only by those who ask for it, never by the reward workers
    from llamarl_jax.rewards.reward_model import RewardModel
    return RewardModel
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["RewardFn", "RewardModel", "get_reward_fn", "math", "register_reward", "registered_rewards", "synthetic"]
