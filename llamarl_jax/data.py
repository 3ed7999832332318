"""Prompt data for RL: `PromptSource` over JSONL/Parquet files or the synthetic tasks, resumable.

File rows (all loaded into memory):
  GSM8K   {"question", "answer"}    ground truth: the text after the last "####" in answer
  MATH    {"problem", "solution"}   ground truth: the last \\boxed{...} in solution
  others  prompt_field / answer_field named by the user; answer_format "raw" | "gsm8k" | "boxed"
The full `answer` / `solution` text is kept as the example's `reference` (an SFT target).
The layout is detected per file from the rows that have both fields (a row without an answer does not
decide it). Bad rows (not JSON, not an object, no prompt, no answer, no ground truth in the answer):
`bad_rows="skip"` (default) skips and counts them (`skipped_rows`, `skip_reasons`) and logs the first
few with file and line; `bad_rows="error"` raises at the first one, naming file and line.

Context limit: with `max_prompt_tokens` (set by the experiment to the model's max_position_embeddings
minus the response width, at most the slot engine's GeneratorConfig.max_prompt_len) a longer prompt
is an error naming its row (`overlong_prompts="error"`, checked over every file row when the limit is
set, and for each drawn example) or is cut to its last `max_prompt_tokens` tokens and counted
(`"truncate"`, `truncated_prompts`).

Order: with `shuffle`, epoch e visits the rows in the permutation drawn from (seed, e); the position
(epoch, offset) is the whole state, so `load_state_dict(state_dict())` continues with exactly the
prompts that would have come next. Synthetic sources are infinite streams indexed by an integer
(`rewards.synthetic.generate(task, seed, index, split)`), so their state is that index.

Prompt text: `template.format(prompt=question)`; when a tokenizer with a chat template is given (and
`use_chat_template`), that text becomes the user message (after an optional system message) of
`tokenizer.apply_chat_template(..., add_generation_prompt=True)`. `PromptExample.encode(tokenizer)`
then gives the token ids: a chat-templated prompt already carries its special tokens as text, a plain
one gets the tokenizer's usual special tokens (e.g. <bos>).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import json
import logging
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence

import numpy as np

from llamarl_jax.rewards import math_extract
from llamarl_jax.rewards import synthetic

log = logging.getLogger(__name__)

_STATE_VERSION = 1
BAD_ROWS = ("skip", "error")
OVERLONG_PROMPTS = ("error", "truncate")


@dataclass(frozen=True)
class PromptExample:
  prompt: str                   # the templated text the model is conditioned on
  ground_truth: str             # what the reward function compares against
  task: str                     # the reward function's registered name ("math", "arithmetic", ...)
  index: int                    # row index in the dataset, or the synthetic stream index
  question: str = ""            # the raw problem text, before templating
  reference: str | None = None  # a correct completion (SFT target), when known
  chat: bool = False            # `prompt` was built with the tokenizer's chat template
  max_tokens: int | None = None  # `encode` keeps the last max_tokens ids (overlong_prompts="truncate")

  def encode(self, tokenizer) -> list[int]:
    """Prompt token ids [prompt_len] (at most `max_tokens`: the end of the prompt is kept)."""
    ids = list(tokenizer(self.prompt, add_special_tokens=not self.chat)["input_ids"])
    return ids[-self.max_tokens:] if self.max_tokens is not None and len(ids) > self.max_tokens else ids


def expand_files(files: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
  """The prompt files that `files` (path(s) or glob(s)) name; FileNotFoundError naming the first that is missing."""
  items = [files] if isinstance(files, (str, os.PathLike)) else list(files)
  paths: list[Path] = []
  for item in items:
    matches = sorted(glob.glob(str(item))) if any(c in str(item) for c in "*?[") else [str(item)]
    if not matches:
      raise FileNotFoundError(f"no files match {item!s}")
    paths += [Path(m) for m in matches]
  for p in paths:
    if not p.exists():
      raise FileNotFoundError(f"prompt file {p} does not exist")
  return paths


def read_located_rows(path: str | os.PathLike) -> list[tuple[str, dict | str]]:
  """(location, row) per row of a .jsonl / .json (list) / .parquet file; location is "file:line" for
  JSONL, "file[row i]" otherwise. A malformed row comes as (location, reason string) instead of a dict."""
  path = Path(path)
  suffix = path.suffix.lower()
  if suffix == ".parquet":
    import pyarrow.parquet as pq
    return [(f"{path}[row {i}]", row) for i, row in enumerate(pq.read_table(path).to_pylist())]
  if suffix == ".json":
    try:
      rows = json.loads(path.read_text())
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from e
    if not isinstance(rows, list):
      raise ValueError(f"{path}: a .json prompt file must hold a list of objects, found a "
                       f"{type(rows).__name__}; for one object per line use .jsonl")
    return [(f"{path}[row {i}]", _as_object(row)) for i, row in enumerate(rows)]
  if suffix in (".jsonl", ".ndjson"):
    out = []
    with path.open() as f:
      for lineno, line in enumerate(f, 1):
        if line.strip():
          try:
            row = _as_object(json.loads(line))
          except json.JSONDecodeError as e:
            row = f"not valid JSON ({e.msg})"
          out.append((f"{path}:{lineno}", row))
    return out
  raise ValueError(f"{path}: unsupported prompt file type {suffix!r}; use .jsonl, .json or .parquet")


def _as_object(row: Any) -> dict | str:
  return row if isinstance(row, dict) else f"expected a JSON object, found a JSON {type(row).__name__}"


_LAYOUTS = (("question", "answer", "gsm8k"), ("problem", "solution", "boxed"), ("problem", "answer", "raw"),
            ("prompt", "answer", "raw"))


def _detect_fields(rows: Sequence[dict], where: Path) -> tuple[str, str, str]:
  """The known layout most rows of a file fill (both fields present and not null); ties: the first."""
  counts = [sum(1 for r in rows if r.get(p) is not None and r.get(a) is not None) for p, a, _ in _LAYOUTS]
  best = max(range(len(_LAYOUTS)), key=lambda i: (counts[i], -i))
  if counts[best]:
    return _LAYOUTS[best]
  keys = sorted(set().union(*(r.keys() for r in rows))) if rows else []
  raise ValueError(f"{where}: cannot tell the prompt/answer fields from the columns {keys}; expected GSM8K "
                   "(question, answer) or MATH (problem, solution); pass prompt_field= and answer_field=")


def _row_problem(row: dict | str, p_field: str, a_field: str, a_format: str) -> str | None:
  """Why a file row cannot be a prompt (None when it can)."""
  if isinstance(row, str):
    return row
  question, answer = row.get(p_field), row.get(a_field)
  if question is None or not str(question).strip():
    return f"no prompt (field {p_field!r} missing or empty)"
  if answer is None:
    return f"no answer (field {a_field!r} missing)"
  if extract_label(str(answer), a_format) is None:
    return f"no ground truth in the answer (format {a_format!r})"
  return None


def extract_label(answer: str, answer_format: str) -> str | None:
  """The ground truth inside a dataset answer field: "gsm8k" (after ####), "boxed" (last \\boxed), "raw"."""
  if answer_format == "raw":
    return answer.strip() or None
  if answer_format == "gsm8k":
    i = answer.rfind("####")
    return answer[i + 4:].strip().replace(",", "") if i >= 0 else None
  if answer_format == "boxed":
    return math_extract.last_boxed(answer)
  raise ValueError(f"answer_format must be 'raw', 'gsm8k' or 'boxed', got {answer_format!r}")


class Prompts(Protocol):
  """What the executors need of a prompt stream (`PromptSource` is the implementation; a custom
  stream implements these five): batches in a reproducible order, a resumable position, counters
  for the step metrics, and a fingerprint a resume compares."""

  def next_batch(self, n: int) -> list["PromptExample"]: ...
  def state_dict(self) -> dict: ...
  def load_state_dict(self, state: dict) -> None: ...
  def counters(self) -> dict[str, float]: ...
  def fingerprint(self) -> dict: ...


class PromptSource:
  """Batches of `PromptExample` from files or a synthetic task; seeded, shuffled, resumable.

  files: path(s) or glob(s) of .jsonl/.json/.parquet; None means the synthetic `task` ("arithmetic"
    or "countdown", knobs in `task_kwargs`).
  reward: the reward name put on each example (default "math" for files, the task's name otherwise).
  num_epochs: None repeats forever; otherwise `next_batch` returns short (then empty) lists at the end.
  split / heldout_fraction: files rows whose prompt hash falls in the first `heldout_fraction` are the
    "heldout" split and never appear in "train"; synthetic tasks always split (1 in 16 problems).
  tools: JSON schemas of the tools a multi-turn episode offers (e.g. `envs.TOOL_SCHEMAS['calc']`),
    rendered into chat-templated prompts by the template (`apply_chat_template(..., tools=...)`).
  """

  def __init__(self, files: str | os.PathLike | Sequence[str | os.PathLike] | None = None, *,
               task: str = "arithmetic", task_kwargs: dict | None = None, reward: str | None = None,
               prompt_field: str | None = None, answer_field: str | None = None, answer_format: str | None = None,
               template: str = "{prompt}", system_prompt: str | None = None, tokenizer: Any = None,
               use_chat_template: bool = True, seed: int = 0, shuffle: bool = True, num_epochs: int | None = None,
               split: str = "train", heldout_fraction: float = 0.0, bad_rows: str = "skip",
               max_prompt_tokens: int | None = None, overlong_prompts: str = "error",
               tools: Sequence[dict] | None = None):
    if bad_rows not in BAD_ROWS:
      raise ValueError(f"bad_rows must be one of {BAD_ROWS}, got {bad_rows!r}")
    if overlong_prompts not in OVERLONG_PROMPTS:
      raise ValueError(f"overlong_prompts must be one of {OVERLONG_PROMPTS}, got {overlong_prompts!r}")
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
      raise ValueError(f"max_prompt_tokens must be >= 1 (or None), got {max_prompt_tokens}: the model's "
                       "context has no room for a prompt; lower max_new_tokens")
    if split not in ("train", "heldout"):
      raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if "{prompt}" not in template:
      raise ValueError(f"template must contain '{{prompt}}', got {template!r}")
    self._init_args = dict(files=files, task=task, task_kwargs=task_kwargs, reward=reward, prompt_field=prompt_field,
                           answer_field=answer_field, answer_format=answer_format, template=template,
                           system_prompt=system_prompt, tokenizer=tokenizer, use_chat_template=use_chat_template,
                           seed=seed, shuffle=shuffle, num_epochs=num_epochs, split=split,
                           heldout_fraction=heldout_fraction, bad_rows=bad_rows,
                           max_prompt_tokens=max_prompt_tokens, overlong_prompts=overlong_prompts)
    if tools is not None:  # recorded only when given: the fingerprints of earlier runs stay as they were
      self._init_args["tools"] = [dict(t) for t in tools]
    self.tools = None if tools is None else [dict(t) for t in tools]
    self.seed, self.shuffle, self.num_epochs, self.split = seed, shuffle, num_epochs, split
    self.template, self.system_prompt, self.tokenizer = template, system_prompt, tokenizer
    self.chat = bool(use_chat_template and tokenizer is not None and getattr(tokenizer, "chat_template", None))
    self._epoch = self._offset = self._next_index = 0
    self._order: np.ndarray | None = None
    self.max_prompt_tokens, self.overlong_prompts = max_prompt_tokens, overlong_prompts
    self.truncated_prompts = 0  # prompts cut to max_prompt_tokens (overlong_prompts="truncate")
    self.skipped_rows = 0       # bad file rows skipped (bad_rows="skip"); reasons in skip_reasons
    self.skip_reasons: collections.Counter = collections.Counter()
    self.other_split_rows = 0   # file rows that belong to the other split
    if files is None:
      self.task = synthetic.make_task(task, **(task_kwargs or {}))
      self.reward = reward or self.task.name
      self._rows = None
      return
    self.task = None
    self.reward = reward or "math"
    self._rows = self._read_rows(files, prompt_field=prompt_field, answer_field=answer_field,
                                 answer_format=answer_format, bad_rows=bad_rows, split=split,
                                 heldout_fraction=heldout_fraction)
    if max_prompt_tokens is not None and tokenizer is not None and overlong_prompts == "error":
      self._check_prompt_lengths()

  def _read_rows(self, files, *, prompt_field: str | None, answer_field: str | None, answer_format: str | None,
                 bad_rows: str, split: str, heldout_fraction: float) -> list[tuple[int, str, str, str, str]]:
    """The usable rows of `split` in `files`: (row index, question, ground truth, reference, "file:line").
    Each file's layout is detected from its rows (or named by the fields); bad rows raise (`bad_rows =
    "error"`) or are skipped and counted (`skipped_rows`, `skip_reasons`, the first few logged), rows of
    the other split counted (`other_split_rows`). No usable row: an error with those counts."""
    if answer_field is not None and prompt_field is None or prompt_field is not None and answer_field is None:
      raise ValueError("pass both prompt_field and answer_field, or neither (to detect GSM8K/MATH columns)")
    rows: list[tuple[int, str, str, str, str]] = []
    first_skips: list[str] = []
    index = 0
    for path in expand_files(files):
      located = read_located_rows(path)
      objects = [r for _, r in located if isinstance(r, dict)]
      if not objects and not prompt_field:  # empty, or no row is an object: each row reports itself
        p_field = a_field = a_format = ""
      else:
        p_field, a_field, a_format = ((prompt_field, answer_field, "raw") if prompt_field
                                      else _detect_fields(objects, path))  # one layout per file
      a_format = answer_format or a_format
      for where, row in located:
        index += 1
        problem = _row_problem(row, p_field, a_field, a_format)
        if problem is not None:
          if bad_rows == "error":
            raise ValueError(f"{where}: {problem}. Fix the row, or skip such rows with "
                             "PromptSource.bad_rows = 'skip' (they are counted and logged)")
          self.skipped_rows += 1
          self.skip_reasons[problem.split(" (")[0]] += 1
          if len(first_skips) < 5:
            first_skips.append(f"{where}: {problem}")
          continue
        question, answer = str(row[p_field]), str(row[a_field])
        in_heldout = zlib.crc32(question.encode()) / 2**32 < heldout_fraction
        if in_heldout == (split == "heldout"):
          rows.append((index - 1, question, extract_label(answer, a_format), answer, where))
        else:
          self.other_split_rows += 1
    if self.skipped_rows:
      log.warning("PromptSource: skipped %d bad rows of %s (%s); first: %s", self.skipped_rows, files,
                  dict(self.skip_reasons), "; ".join(first_skips))
    if not rows:
      raise ValueError(f"no usable {split!r} rows in {files!r} ({self.skipped_rows} bad: "
                       f"{dict(self.skip_reasons)}; {self.other_split_rows} in the other split)"
                       + (f"; first bad rows: {'; '.join(first_skips)}" if first_skips else ""))
    return rows

  # ----------------------------------------------------------------------------------------------
  # context limit

  def _check_prompt_lengths(self) -> None:
    """Raise at start-up if any file row's prompt is longer than `max_prompt_tokens` tokens."""
    over = []
    for row_index, question, label, reference, where in self._rows:
      n = len(self._encode_text(self.format_prompt(question)))
      if n > self.max_prompt_tokens:
        over.append(f"{where} ({n} tokens)")
    if over:
      raise ValueError(self._overlong_message(over))

  def _overlong_message(self, over: list[str]) -> str:
    return (f"{len(over)} prompt(s) are longer than max_prompt_tokens = {self.max_prompt_tokens} (the model's "
            "max_position_embeddings minus the response width; with the slot engine at most "
            f"GeneratorConfig.max_prompt_len): {', '.join(over[:5])}{' ...' if len(over) > 5 else ''}. Drop those "
            "rows, raise GeneratorConfig.max_prompt_len or lower RolloutConfig.max_new_tokens, or cut them to "
            "their last tokens (counted in data/truncated_prompts) with PromptSource.overlong_prompts = 'truncate'")

  def _encode_text(self, prompt: str) -> list[int]:
    return list(self.tokenizer(prompt, add_special_tokens=not self.chat)["input_ids"])

  def limit_prompts(self, max_prompt_tokens: int) -> None:
    """Enforce the model's context on this source from now on (and on its forks): see the module
    docstring. Needs the tokenizer (`with_tokenizer`); checks every file row now when `"error"`."""
    if self.tokenizer is None:
      raise ValueError("limit_prompts needs the tokenizer: call with_tokenizer(tokenizer) first")
    if max_prompt_tokens < 1:
      raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}: the model's context "
                       "(max_position_embeddings) has no room left for a prompt; lower max_new_tokens")
    self.max_prompt_tokens = self._init_args["max_prompt_tokens"] = int(max_prompt_tokens)
    if self._rows is not None and self.overlong_prompts == "error":
      self._check_prompt_lengths()

  def _limited(self, example: PromptExample, where: str) -> PromptExample:
    if self.max_prompt_tokens is None or self.tokenizer is None:
      return example
    n = len(example.encode(self.tokenizer))
    if n <= self.max_prompt_tokens:
      return example
    if self.overlong_prompts == "error":
      raise ValueError(self._overlong_message([f"{where} ({n} tokens)"]))
    self.truncated_prompts += 1
    if self.truncated_prompts in (1, 10, 100, 1000) or self.truncated_prompts % 10000 == 0:
      log.warning("PromptSource: %d prompts cut to their last %d tokens so far (latest: %s, %d tokens)",
                  self.truncated_prompts, self.max_prompt_tokens, where, n)
    return dataclasses.replace(example, max_tokens=self.max_prompt_tokens)

  def counters(self) -> dict[str, float]:
    """Cumulative data counters for the step metrics."""
    return {"data/truncated_prompts": float(self.truncated_prompts), "data/skipped_rows": float(self.skipped_rows)}

  # ----------------------------------------------------------------------------------------------

  def __bool__(self) -> bool:  # a source is truthy even when infinite (no __len__) or empty
    return True

  def __len__(self) -> int:
    """Rows per epoch (files); synthetic sources are infinite and have no length."""
    if self._rows is None:
      raise TypeError("a synthetic PromptSource is an infinite stream")
    return len(self._rows)

  def format_prompt(self, question: str) -> str:
    """The text the model sees for `question` (plain template, then the chat template if any)."""
    text = self.template.format(prompt=question)
    if not self.chat:
      return text
    messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
    messages.append({"role": "user", "content": text})
    return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                              **({"tools": self.tools} if self.tools else {}))

  def _epoch_order(self) -> np.ndarray:
    if self._order is None:
      n = len(self._rows)
      self._order = (np.random.default_rng([self.seed, self._epoch]).permutation(n) if self.shuffle
                     else np.arange(n))
    return self._order

  def _next(self) -> PromptExample | None:
    if self._rows is None:
      inst = synthetic.generate(self.task, self.seed, self._next_index, self.split)
      index = self._next_index
      self._next_index += 1
      return self._limited(PromptExample(prompt=self.format_prompt(inst.prompt), ground_truth=inst.ground_truth,
                                         task=self.reward, index=index, question=inst.prompt,
                                         reference=inst.completion, chat=self.chat),
                           f"{self.task.name} example {index}")
    if self.num_epochs is not None and self._epoch >= self.num_epochs:
      return None
    row_index, question, label, reference, where = self._rows[int(self._epoch_order()[self._offset])]
    self._offset += 1
    if self._offset == len(self._rows):
      self._epoch, self._offset, self._order = self._epoch + 1, 0, None
    return self._limited(PromptExample(prompt=self.format_prompt(question), ground_truth=label, task=self.reward,
                                       index=row_index, question=question, reference=reference, chat=self.chat),
                         where)

  def next_batch(self, n: int) -> list[PromptExample]:
    """The next n examples (fewer, possibly none, only when a finite `num_epochs` runs out)."""
    out = []
    for _ in range(n):
      ex = self._next()
      if ex is None:
        break
      out.append(ex)
    return out

  def __iter__(self) -> Iterator[PromptExample]:
    while (ex := self._next()) is not None:
      yield ex

  def reference(self, example: PromptExample) -> str:
    """A correct completion for `example` (the SFT target, without EOS)."""
    if example.reference is None:
      raise ValueError(f"example {example.index} has no reference completion")
    return example.reference

  # ----------------------------------------------------------------------------------------------
  # Resumption and derived sources

  def state_dict(self) -> dict:
    """JSON-able position; `load_state_dict` of it continues with exactly the next examples."""
    if self._rows is None:
      return {"version": _STATE_VERSION, "kind": "synthetic", "task": self.task.name, "seed": self.seed,
              "split": self.split, "next_index": self._next_index, "truncated_prompts": self.truncated_prompts}
    return {"version": _STATE_VERSION, "kind": "files", "seed": self.seed, "split": self.split,
            "num_rows": len(self._rows), "epoch": self._epoch, "offset": self._offset,
            "truncated_prompts": self.truncated_prompts}

  def load_state_dict(self, state: dict) -> None:
    kind = "synthetic" if self._rows is None else "files"
    expected = {"kind": kind, "seed": self.seed, "split": self.split}
    expected.update({"task": self.task.name} if kind == "synthetic" else {"num_rows": len(self._rows)})
    found = {k: state.get(k) for k in expected}
    if found != expected:
      raise ValueError(f"prompt-source state does not match this source: expected {expected}, found {found}; "
                       "resume with the same data files, task, seed and split")
    if kind == "synthetic":
      self._next_index = int(state["next_index"])
    else:
      self._epoch, self._offset, self._order = int(state["epoch"]), int(state["offset"]), None
    self.truncated_prompts = int(state.get("truncated_prompts", 0))

  def fingerprint(self) -> dict:
    """What defines this stream of prompts (recorded in checkpoints; a resume must not change it)."""
    args = {k: v for k, v in self._init_args.items() if k not in ("tokenizer", "bad_rows")}
    files = args.pop("files")
    if files is not None:
      args["files"] = [str(files)] if isinstance(files, (str, os.PathLike)) else [str(f) for f in files]
      args["num_rows"] = len(self._rows)
    return json.loads(json.dumps(args, default=str))

  def fork(self, seed_offset: int = 1) -> "PromptSource":
    """The same source with seed + seed_offset, from the start (e.g. a separate SFT stream)."""
    return PromptSource(**{**self._init_args, "seed": self.seed + seed_offset})

  def heldout(self) -> "PromptSource":
    """The evaluation split: never overlaps this source's training problems. Files: needs
    heldout_fraction > 0; visited once, in order."""
    if self._rows is not None and not self._init_args["heldout_fraction"]:
      raise ValueError("this file PromptSource has no heldout split: construct it with heldout_fraction > 0 "
                       "(e.g. 0.05), or give an explicit evaluation source (e.g. the test file)")
    kw = {**self._init_args, "split": "heldout"}
    if self._rows is not None:
      kw.update(shuffle=False, num_epochs=1)
    return PromptSource(**kw)

  def with_tokenizer(self, tokenizer: Any) -> "PromptSource":
    """The same source (same position) formatting prompts with `tokenizer`'s chat template, if any."""
    other = PromptSource(**{**self._init_args, "tokenizer": tokenizer})
    other.load_state_dict(self.state_dict())
    return other

  def __repr__(self) -> str:
    what = self._init_args["files"] if self._rows is not None else self.task
    return f"PromptSource({what!r}, split={self.split!r}, seed={self.seed}, state={self.state_dict()})"

