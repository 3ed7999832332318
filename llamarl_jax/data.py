"""Prompt data for RL: `PromptSource` over JSONL/Parquet files or the synthetic tasks, resumable.

File rows (all loaded into memory):
  GSM8K   {"question", "answer"}    ground truth: the text after the last "####" in answer
  MATH    {"problem", "solution"}   ground truth: the last \\boxed{...} in solution
  others  prompt_field / answer_field named by the user; answer_format "raw" | "gsm8k" | "boxed"
The full `answer` / `solution` text is kept as the example's `reference` (an SFT target).

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

import glob
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from llamarl_jax.rewards import math as math_reward
from llamarl_jax.rewards import synthetic

_STATE_VERSION = 1


@dataclass(frozen=True)
class PromptExample:
  prompt: str                   # the templated text the model is conditioned on
  ground_truth: str             # what the reward function compares against
  task: str                     # the reward function's registered name ("math", "arithmetic", ...)
  index: int                    # row index in the dataset, or the synthetic stream index
  question: str = ""            # the raw problem text, before templating
  reference: str | None = None  # a correct completion (SFT target), when known
  chat: bool = False            # `prompt` was built with the tokenizer's chat template

  def encode(self, tokenizer) -> list[int]:
    """Prompt token ids [prompt_len]."""
    return list(tokenizer(self.prompt, add_special_tokens=not self.chat)["input_ids"])


def _expand(files: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
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


def read_rows(path: str | os.PathLike) -> list[dict]:
  """Rows of a .jsonl / .json (list) / .parquet file as dicts."""
  path = Path(path)
  suffix = path.suffix.lower()
  if suffix == ".parquet":
    import pyarrow.parquet as pq
    return pq.read_table(path).to_pylist()
  if suffix == ".json":
    rows = json.loads(path.read_text())
    if not isinstance(rows, list):
      raise ValueError(f"{path}: a .json prompt file must hold a list of objects")
    return rows
  if suffix in (".jsonl", ".ndjson"):
    rows = []
    with path.open() as f:
      for lineno, line in enumerate(f, 1):
        if line.strip():
          try:
            rows.append(json.loads(line))
          except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
    return rows
  raise ValueError(f"{path}: unsupported prompt file type {suffix!r}; use .jsonl, .json or .parquet")


def _detect_fields(keys) -> tuple[str, str, str]:
  keys = set(keys)
  for prompt_field, answer_field, answer_format in (("question", "answer", "gsm8k"), ("problem", "solution", "boxed"),
                                                    ("problem", "answer", "raw"), ("prompt", "answer", "raw")):
    if {prompt_field, answer_field} <= keys:
      return prompt_field, answer_field, answer_format
  raise ValueError(f"cannot tell the prompt/answer fields from the columns {sorted(keys)}; expected GSM8K "
                   "(question, answer) or MATH (problem, solution); pass prompt_field= and answer_field=")


def extract_label(answer: str, answer_format: str) -> str | None:
  """The ground truth inside a dataset answer field: "gsm8k" (after ####), "boxed" (last \\boxed), "raw"."""
  if answer_format == "raw":
    return answer.strip() or None
  if answer_format == "gsm8k":
    i = answer.rfind("####")
    return answer[i + 4:].strip().replace(",", "") if i >= 0 else None
  if answer_format == "boxed":
    return math_reward.last_boxed(answer)
  raise ValueError(f"answer_format must be 'raw', 'gsm8k' or 'boxed', got {answer_format!r}")


class PromptSource:
  """Batches of `PromptExample` from files or a synthetic task; seeded, shuffled, resumable.

  files: path(s) or glob(s) of .jsonl/.json/.parquet; None means the synthetic `task` ("arithmetic"
    or "countdown", knobs in `task_kwargs`).
  reward: the reward name put on each example (default "math" for files, the task's name otherwise).
  num_epochs: None repeats forever; otherwise `next_batch` returns short (then empty) lists at the end.
  split / heldout_fraction: files rows whose prompt hash falls in the first `heldout_fraction` are the
    "heldout" split and never appear in "train"; synthetic tasks always split (1 in 16 problems).
  """

  def __init__(self, files: str | os.PathLike | Sequence[str | os.PathLike] | None = None, *,
               task: str = "arithmetic", task_kwargs: dict | None = None, reward: str | None = None,
               prompt_field: str | None = None, answer_field: str | None = None, answer_format: str | None = None,
               template: str = "{prompt}", system_prompt: str | None = None, tokenizer: Any = None,
               use_chat_template: bool = True, seed: int = 0, shuffle: bool = True, num_epochs: int | None = None,
               split: str = "train", heldout_fraction: float = 0.0):
    if split not in ("train", "heldout"):
      raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if "{prompt}" not in template:
      raise ValueError(f"template must contain '{{prompt}}', got {template!r}")
    self._init_args = dict(files=files, task=task, task_kwargs=task_kwargs, reward=reward, prompt_field=prompt_field,
                           answer_field=answer_field, answer_format=answer_format, template=template,
                           system_prompt=system_prompt, tokenizer=tokenizer, use_chat_template=use_chat_template,
                           seed=seed, shuffle=shuffle, num_epochs=num_epochs, split=split,
                           heldout_fraction=heldout_fraction)
    self.seed, self.shuffle, self.num_epochs, self.split = seed, shuffle, num_epochs, split
    self.template, self.system_prompt, self.tokenizer = template, system_prompt, tokenizer
    self.chat = bool(use_chat_template and tokenizer is not None and getattr(tokenizer, "chat_template", None))
    self._epoch = self._offset = self._next_index = 0
    self._order: np.ndarray | None = None
    if files is None:
      self.task = synthetic.make_task(task, **(task_kwargs or {}))
      self.reward = reward or self.task.name
      self._rows = None
      self.skipped_rows = 0
      return
    self.task = None
    self.reward = reward or "math"
    if answer_field is not None and prompt_field is None or prompt_field is not None and answer_field is None:
      raise ValueError("pass both prompt_field and answer_field, or neither (to detect GSM8K/MATH columns)")
    rows: list[tuple[int, str, str, str]] = []  # (row index, question, ground truth, reference)
    skipped = 0
    for path in _expand(files):
      file_rows = read_rows(path)
      if not file_rows:
        continue
      p_field, a_field, a_format = ((prompt_field, answer_field, "raw") if prompt_field
                                    else _detect_fields(file_rows[0].keys()))  # one layout per file
      a_format = answer_format or a_format
      for row in file_rows:
        question, answer = row.get(p_field), row.get(a_field)
        label = extract_label(str(answer), a_format) if question is not None and answer is not None else None
        index = len(rows) + skipped
        if label is None or not str(question).strip():
          skipped += 1
          continue
        in_heldout = zlib.crc32(str(question).encode()) / 2**32 < heldout_fraction
        if in_heldout == (split == "heldout"):
          rows.append((index, str(question), label, str(answer)))
        else:
          skipped += 1
    if not rows:
      raise ValueError(f"no usable {split!r} rows in {files!r} ({skipped} skipped: no answer, no ground truth "
                       "or in the other split)")
    self._rows = rows
    self.skipped_rows = skipped  # rows without a usable prompt/ground truth, or in the other split

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
    return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

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
      return PromptExample(prompt=self.format_prompt(inst.prompt), ground_truth=inst.ground_truth,
                           task=self.reward, index=index, question=inst.prompt, reference=inst.completion,
                           chat=self.chat)
    if self.num_epochs is not None and self._epoch >= self.num_epochs:
      return None
    row_index, question, label, reference = self._rows[int(self._epoch_order()[self._offset])]
    self._offset += 1
    if self._offset == len(self._rows):
      self._epoch, self._offset, self._order = self._epoch + 1, 0, None
    return PromptExample(prompt=self.format_prompt(question), ground_truth=label, task=self.reward,
                         index=row_index, question=question, reference=reference, chat=self.chat)

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
              "split": self.split, "next_index": self._next_index}
    return {"version": _STATE_VERSION, "kind": "files", "seed": self.seed, "split": self.split,
            "num_rows": len(self._rows), "epoch": self._epoch, "offset": self._offset}

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

