"""The rules of the configuration's fields: small functions from a value to what was expected.

A rule takes a value and returns None if it is fine, else a phrase saying what was expected
(`at_least(1)(0) == ">= 1"`). A frozen dataclass that mixes in `Validated` lists its fields' rules in
`RULES` ({field: rule}); its `__post_init__` applies them and raises one `ConfigError` naming every
bad field. `field_problems` applies a class's rules to any values (`config_check` runs it on gin
bindings before anything is built). The configuration's classes are in `llamarl_jax.config`, which
re-exports these names.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

Rule = Callable[[Any], "str | None"]  # a value -> None if fine, else what was expected


class ConfigError(ValueError):
  """A configuration value is invalid; the message names each bad field, what was expected and found."""


def at_least(lo) -> Rule:
  return lambda v: None if v >= lo else f">= {lo}"


def int_at_least(lo) -> Rule:
  return lambda v: None if isinstance(v, int) and not isinstance(v, bool) and v >= lo else f"an int >= {lo}"


def above(lo) -> Rule:
  return lambda v: None if v > lo else f"> {lo}"


def between(lo, hi, *, lo_open=False) -> Rule:
  def rule(v):
    ok = (lo < v if lo_open else lo <= v) and v <= hi
    return None if ok else f"in {'(' if lo_open else '['}{lo}, {hi}]"
  return rule


def one_of(*choices) -> Rule:
  return lambda v: None if v in choices else f"one of {list(choices)}"


class Validated:
  """Mixin: `__post_init__` applies the class's `RULES` ({field: rule}) and raises one `ConfigError`."""

  RULES: ClassVar[dict[str, Rule]] = {}

  def __post_init__(self):
    problems = field_problems(type(self), {f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
    if problems:
      raise ConfigError(f"invalid {type(self).__name__}: " + "; ".join(problems))

  def replace(self, **changes):
    return dataclasses.replace(self, **changes)


def field_problems(cls, values: dict[str, Any]) -> list[str]:
  """'Class.field: expected ..., got ...' for every value of `values` that breaks `cls.RULES`."""
  out = []
  for name, value in values.items():
    rule = cls.RULES.get(name)
    if rule is None:
      continue
    try:
      why = rule(value)
    except TypeError:
      why = "a value of the annotated type"
    if why is not None:
      out.append(f"{cls.__name__}.{name}: expected {why}, got {value!r}")
  return out
