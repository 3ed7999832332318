"""Start-up check of every gin binding: type (from the configurable's annotations) and range.

A wrong value in a config (a string for `TrainConfig.checkpoint_every`, a negative lag, top_p = 2)
would otherwise surface minutes later, deep in the run, as a raw `TypeError` or a silent misbehaviour.
`check_bindings()` runs before anything is built or compiled and raises one `ConfigError` listing every
bad binding by its gin name, with what was expected and what was found. `check_inputs()` does the same
for the files and directories the bindings name (prompt files, model, reference and adapter directories,
the model's tokenizer): a placeholder path ends the run in one message naming the binding to set.

Types come from the annotations of the bound function / class (`int`, `float | None`, `OptimizerConfig`,
...); ranges and choices from `RANGES`, keyed by gin name (the run's configuration classes bring
their own `RULES`, config.py). A configurable or parameter that neither
knows is accepted as is (gin has already rejected unknown names at parse time).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import types
import typing
from collections.abc import Callable as AbcCallable
from pathlib import Path
from typing import Any, Callable

import gin


from llamarl_jax import compat
from llamarl_jax import config as run_config
from llamarl_jax.config import ConfigError, above, at_least, between, one_of  # noqa: F401  (ConfigError re-exported)


def _loss_kwargs_rule(kwargs):
  """TrainConfig.loss_kwargs must be keywords of the bound TrainConfig.loss (checked with the loss known)."""
  loss = gin.query_parameter("TrainConfig.loss") if _bound("TrainConfig", "loss") else "aipo"
  return run_config.loss_kwargs_problems(loss, kwargs)


# Range and choice rules by gin name. The run's configuration classes carry their own (config.py:
# each field is checked in one place, here for gin bindings before anything is built and again when
# the dataclass is constructed from Python); the rest are the job's functions and other configurables.
RANGES: dict[str, dict[str, Callable[[Any], str | None]]] = {
    **{cls.__name__: dict(cls.RULES) for cls in (*run_config.SECTIONS.values(), run_config.OptimizerConfig,
                                                 run_config.OverlongShaping, run_config.DynamicSampling,
                                                 run_config.LoraConfig, run_config.CriticConfig)},
    "run_experiment": {"rl_steps": at_least(0), "eval_size": at_least(0),  # eval_size 0 skips the evaluations
                       "eval_every": at_least(0), "eval_samples": at_least(0), "eval_window": at_least(1)},
    "supervised_warmstart": {"steps": at_least(0), "batch_size": at_least(1), "learning_rate": above(0.0),
                             "prompt_len": at_least(1), "resp_len": at_least(1), "log_every": at_least(1),
                             "weight_decay": at_least(0.0), "final_lr_ratio": between(0.0, 1.0)},
    "PromptSource": {"heldout_fraction": between(0.0, 1.0), "num_epochs": at_least(1),
                     "bad_rows": one_of("skip", "error"), "overlong_prompts": one_of("error", "truncate"),
                     "split": one_of("train", "heldout"), "max_prompt_tokens": at_least(1)},
    "ModelConfig": {k: at_least(1) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                                             "num_heads", "num_kv_heads", "max_position_embeddings")},
    "RewardExecutor": {"worker_max_tasks": at_least(1), "worker_max_rss_mb": above(0.0),
                       "worker_memory_limit_mb": above(0.0), "max_chunk": at_least(1),
                       "startup_timeout_s": above(0.0)},
}
RANGES["TrainConfig"]["loss_kwargs"] = _loss_kwargs_rule


# --------------------------------------------------------------------------------------------------
# types


def _describe(hint) -> str:
  if hint is type(None):
    return "None"
  origin = typing.get_origin(hint)
  if origin in (typing.Union, types.UnionType):
    return " | ".join(_describe(a) for a in typing.get_args(hint))
  return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _matches(value, hint) -> bool:
  """Does `value` (a parsed gin value, or a gin reference) fit the annotation `hint`? Unknown hint
  forms are accepted."""
  if hint is Any or hint is inspect.Parameter.empty:
    return True
  if hint is None or hint is type(None):
    return value is None
  origin = typing.get_origin(hint)
  if origin in (typing.Union, types.UnionType):
    return any(_matches(value, a) for a in typing.get_args(hint))
  if isinstance(value, gin.config.ConfigurableReference):
    wrapped = value.configurable.wrapped
    if not value.evaluate:  # `@fn`: the callable itself
      return hint in (Callable, AbcCallable) or typing.get_origin(hint) is AbcCallable
    if inspect.isclass(wrapped) and inspect.isclass(hint):  # `@Cls()`: an instance of Cls
      return issubclass(wrapped, hint)
    return True  # `@fn()`: whatever fn returns
  if hint is bool:
    return isinstance(value, bool)
  if hint is int:
    return isinstance(value, int) and not isinstance(value, bool)
  if hint is float:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  if hint in (Callable, AbcCallable) or origin is AbcCallable:
    return callable(value)
  if origin is not None:  # list[int], dict[str, Any], Sequence[str], Mapping[...]
    if not isinstance(value, origin) or (isinstance(value, str) and origin is not str):
      return False
    args = typing.get_args(hint)
    if origin in (list, tuple, set, frozenset) or (args and len(args) == 1):
      return all(_matches(v, args[0]) for v in value) if args and args[-1] is not Ellipsis else True
    return True
  if inspect.isclass(hint):
    return isinstance(value, hint) or (hint is os.PathLike and isinstance(value, str))
  return True


def _signature_hints(fn) -> dict[str, Any]:
  target = fn.__init__ if inspect.isclass(fn) and not dataclasses.is_dataclass(fn) else fn
  try:
    return typing.get_type_hints(target)
  except Exception:  # noqa: BLE001 - an annotation that does not evaluate: skip type checks for it
    return {}


def _bound(name: str, param: str) -> bool:
  try:
    gin.query_parameter(f"{name}.{param}")
    return True
  except ValueError:
    return False


def _resolve_macro(value):
  if isinstance(value, gin.config.ConfigurableReference) and value.configurable.name == "macro":
    return gin.query_parameter("%" + value.scoped_selector.split("/")[0]), True
  return value, False


def _bindings() -> list[tuple[str, str, Any, dict[str, Any]]]:
  """(scope, configurable name, wrapped fn/class, {param: value}) of every parsed binding."""
  out = []
  for scope, selector, params, configurable in compat.gin_parsed_bindings():
    if selector == "gin.macro" or configurable is None:
      continue
    out.append((scope, configurable.name, configurable.wrapped, dict(params)))
  return out


def binding_problems() -> list[str]:
  """Every bad binding as "Scope/Name.param = value: expected ..., found ..."."""
  problems = []
  for scope, name, wrapped, params in _bindings():
    hints = _signature_hints(wrapped)
    rules = RANGES.get(name, {})
    for param, value in sorted(params.items()):
      value, _ = _resolve_macro(value)
      label = f"{scope + '/' if scope else ''}{name}.{param} = {value!r}"
      hint = hints.get(param, Any)
      if not _matches(value, hint):
        found = ("a reference" if isinstance(value, gin.config.ConfigurableReference)
                 else type(value).__name__)
        problems.append(f"{label}: expected {_describe(hint)}, found {found}")
        continue
      rule = rules.get(param)
      if rule is not None and not isinstance(value, gin.config.ConfigurableReference):
        try:
          expected = rule(value)
        except TypeError:
          expected = None
        if expected:
          problems.append(f"{label}: expected {expected}")
  return problems


# Bindings that name what a run reads from disk: (configurable, parameter) -> (what it is, files one of which
# each directory must hold). A missing one ends the run before anything is built, naming the binding.
INPUTS: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {
    ("PromptSource", "files"): ("prompt files (.jsonl / .json / .parquet, or globs)", ()),
    ("build_policy", "model_path"): ("a Hugging Face model directory", ("config.json",)),
    ("TrainConfig", "reference_path"): ("the KL reference's Hugging Face model directory", ("config.json",)),
    ("LoraConfig", "adapter_path"): ("a PEFT adapter directory", ("adapter_config.json",)),
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _input_problem(name: str, param: str, value) -> str | None:
  """Why the input bound at `name.param` cannot be read, or None."""
  from llamarl_jax import data

  what, required = INPUTS[(name, param)]
  if name == "PromptSource":
    try:
      data.expand_files(value)
    except FileNotFoundError as e:
      return str(e)
    return None
  path = Path(os.path.expanduser(str(value)))
  if not path.is_dir():
    return f"{path} is not a directory (expected {what})"
  if required and not any((path / f).exists() for f in required):
    return f"{path} has no {' / '.join(required)} (expected {what})"
  if name == "build_policy" and not any((path / f).exists() for f in _TOKENIZER_FILES):
    return f"{path} has no tokenizer ({' / '.join(_TOKENIZER_FILES)})"
  return None


def input_problems(inputs=tuple(INPUTS)) -> list[str]:
  """Every bound input of `inputs` ((configurable, parameter) keys of INPUTS; default all) that is missing,
  as "scope/Name.param = value: why"."""
  problems = []
  for scope, name, _, params in _bindings():
    for param, value in sorted(params.items()):
      value, _ = _resolve_macro(value)
      if (name, param) not in inputs or value is None or isinstance(value, gin.config.ConfigurableReference):
        continue
      why = _input_problem(name, param, value)
      if why:
        problems.append(f"{scope + '/' if scope else ''}{name}.{param} = {value!r}: {why}")
  return problems


def check_inputs(inputs=tuple(INPUTS)) -> None:
  """Raise one `ConfigError` naming every bound data file, model directory, tokenizer or adapter of `inputs`
  (default all) that is missing."""
  problems = input_problems(inputs)
  if problems:
    raise ConfigError(f"{len(problems)} input(s) the config names cannot be read (nothing was built or run):\n  "
                      + "\n  ".join(problems) + "\nSet each binding to a real path, in the gin file or with "
                      f"--gin_param (e.g. --gin_param=\"{problems[0].split(' = ')[0]}='...'\").")


def check_bindings() -> None:
  """Raise `ConfigError` naming every gin binding with a wrong type or an out-of-range value."""
  problems = binding_problems()
  if problems:
    raise ConfigError(f"{len(problems)} gin binding(s) are invalid (nothing was built or run):\n  "
                      + "\n  ".join(problems) + "\nFix them in the gin file or the --gin_param flags.")
