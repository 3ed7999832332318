"""Preference pairs for reward-model training: pairwise JSONL in, synthetic pairs out.

A pairs file is JSONL, one object per line with three strings (other keys are ignored):

    {"prompt": "23+58=", "chosen": "81", "rejected": "ans 81"}

and optionally "kind" (a string naming the kind of rejected response: held-out accuracy is also
reported per kind).

`read_pairs(path)` reads one, refusing (with `PairsError`, naming file:line) a missing or empty file,
a line that is not a JSON object, a missing or non-string key, and a pair whose chosen and rejected
responses are the same text (no preference to learn).

`arithmetic_pairs(task, seed, count, split)`: pairs of the synthetic arithmetic task
(`rewards.synthetic.ArithmeticTask`) preferring the verifier's answer in the verifier's format (the
bare integer) over a rejected response drawn from `REJECTIONS`: the right answer in the teacher's
wrong format (`prefix + answer`, "ans 81"), a wrong number (off by a small amount, or a digit
dropped, repeated or swapped), a wrong number in the wrong format, or junk (a short random string,
possibly empty). Prompts come from one `split` of the task's stream ("train" / "heldout": disjoint
prompts, `synthetic.split_of`), so a held-out pairs file never shares a prompt with a training one.
Pure Python, deterministic in its arguments.
"""

from __future__ import annotations

import json
import os
import random
import string
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

from llamarl_jax.rewards import synthetic

KEYS = ("prompt", "chosen", "rejected")
# The kinds of rejected response `arithmetic_pairs` draws, with their probabilities.
# Mostly wrong numbers: the format is one visible feature, learnt from few pairs; the sum is not.
REJECTIONS = (("format", 0.2), ("wrong", 0.35), ("format_wrong", 0.1), ("digits", 0.25), ("junk", 0.1))


class PairsError(ValueError):
  """A pairs file that cannot be read as preference pairs."""


@dataclass(frozen=True)
class PreferencePair:
  prompt: str
  chosen: str
  rejected: str
  kind: str | None = None  # what kind of rejected response (`REJECTIONS`), when known


def read_pairs(path: str | os.PathLike, *, max_problems: int = 5) -> list[PreferencePair]:
  """The pairs of a JSONL file (see the module docstring); `PairsError` listing up to `max_problems`
  bad lines (file:line and what is wrong) when any line is bad."""
  path = Path(path)
  if not path.is_file():
    raise PairsError(f"pairs file {path} does not exist (expected JSONL with one "
                     '{"prompt", "chosen", "rejected"} object per line)')
  pairs, problems = [], []
  with path.open() as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path}:{lineno}"
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        problems.append(f"{where}: not valid JSON ({e.msg})")
        continue
      if not isinstance(row, dict):
        problems.append(f"{where}: expected a JSON object with keys {list(KEYS)}, found a JSON {type(row).__name__}")
        continue
      missing = [k for k in KEYS if k not in row]
      if missing:
        problems.append(f"{where}: missing key(s) {missing}; found {sorted(row)[:8]}")
        continue
      wrong = [f"{k} is {type(row[k]).__name__}" for k in KEYS if not isinstance(row[k], str)]
      if wrong:
        problems.append(f"{where}: prompt, chosen and rejected must be strings ({', '.join(wrong)})")
        continue
      if row["chosen"] == row["rejected"]:
        problems.append(f"{where}: chosen and rejected are the same text ({row['chosen'][:40]!r}): no preference")
        continue
      kind = row.get("kind")
      pairs.append(PreferencePair(row["prompt"], row["chosen"], row["rejected"], kind if isinstance(kind, str) else None))
  if problems:
    more = f"\n  ... and {len(problems) - max_problems} more" if len(problems) > max_problems else ""
    raise PairsError(f"{path}: {len(problems)} bad line(s) of preference pairs:\n  "
                     + "\n  ".join(problems[:max_problems]) + more)
  if not pairs:
    raise PairsError(f"{path} holds no preference pairs (an empty file); expected JSONL lines like "
                     '{"prompt": "2+2=", "chosen": "4", "rejected": "5"}')
  return pairs


def write_pairs(pairs: Iterable[PreferencePair], path: str | os.PathLike) -> Path:
  """Write pairs as JSONL (the format `read_pairs` reads); returns the path."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  with path.open("w") as f:
    for p in pairs:
      f.write(json.dumps({k: v for k, v in asdict(p).items() if v is not None}) + "\n")
  return path


def _wrong_number(rng: random.Random, answer: int) -> str:
  """A wrong integer near `answer`: off by 1, 2, 9, 10 or 11 either way (not below 0 unless `answer` is)."""
  candidates = [answer + s * d for d in (1, 2, 9, 10, 11) for s in (1, -1) if answer < 0 or answer + s * d >= 0]
  return str(rng.choice(candidates))


def _digit_error(rng: random.Random, answer: str) -> str:
  """`answer` with a digit dropped, repeated or two adjacent digits swapped (never `answer` itself)."""
  sign, answer = ("-", answer[1:]) if answer.startswith("-") else ("", answer)
  options = []
  for i in range(len(answer)):
    options.append(answer[:i] + answer[i + 1:])          # dropped
    options.append(answer[:i + 1] + answer[i:])          # repeated
    if i + 1 < len(answer) and answer[i] != answer[i + 1]:
      options.append(answer[:i] + answer[i + 1] + answer[i] + answer[i + 2:])  # swapped
  options = [o for o in options if o and int(o) != int(answer)]  # "00" is still 0
  return sign + (rng.choice(options) if options else str(int(answer) + 1))


def reject(rng: random.Random, answer: str, kind: str, *, prefix: str = "ans ") -> str:
  """A rejected response of `kind` (`REJECTIONS`) to a problem whose answer is `answer`."""
  if kind == "format":
    return prefix + answer
  if kind == "wrong":
    return _wrong_number(rng, int(answer))
  if kind == "format_wrong":
    return prefix + _wrong_number(rng, int(answer))
  if kind == "digits":
    return _digit_error(rng, answer)
  if kind == "junk":
    text = "".join(rng.choice(string.digits + string.ascii_lowercase + " +=") for _ in range(rng.randint(0, 4)))
    return text if text.strip() != answer else text + "x"
  raise ValueError(f"unknown rejection kind {kind!r}; known: {[k for k, _ in REJECTIONS]}")


def arithmetic_pairs(task: synthetic.ArithmeticTask, *, seed: int, count: int, split: str = "train",
                     prefix: str = "ans ") -> list[PreferencePair]:
  """`count` pairs from problems of `split` of the task stream `seed` (one pair per problem, the
  problems `synthetic.generate(task, seed, i, split)` for i < count): chosen the answer, rejected a
  response drawn from `REJECTIONS` (`prefix` is the wrong format's prefix)."""
  if not isinstance(task, synthetic.ArithmeticTask):
    raise ValueError(f"arithmetic_pairs needs an ArithmeticTask, got {type(task).__name__}")
  if count < 1:
    raise ValueError(f"count must be >= 1, got {count}")
  kinds, weights = zip(*REJECTIONS)
  pairs = []
  for i in range(count):
    inst = synthetic.generate(task, seed, i, split)
    rng = random.Random(f"pairs:{seed}:{split}:{i}")
    kind = rng.choices(kinds, weights)[0]
    rejected = reject(rng, inst.ground_truth, kind, prefix=prefix)
    if synthetic.score_arithmetic(rejected, inst.ground_truth) != 0.0:  # the verifier rejects every rejected
      raise RuntimeError(f"rejected {rejected!r} passes the verifier for {inst.prompt!r}")
    pairs.append(PreferencePair(inst.prompt, inst.ground_truth, rejected, kind))
  return pairs
