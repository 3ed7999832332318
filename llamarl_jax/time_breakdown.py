"""Where a run's wall time goes: seconds and shares per part, from the trainer thread's point of view.

Each RL step's time (`time/step`, from the end of the previous step's weight push - or, after a
checkpoint, an evaluation or the metrics' logging, which are parts of their own, from asking for the
batch - to the end of this step's weight push) is the sum of
`STEP_PARTS`: the trainer's wait for the batch, split by what was running meanwhile (the generator
on the device, a weight swap into the engine, the reward executor, or nothing of those: the other
threads' host work, queues), then training and the weight push. Checkpoints and evaluations run
between steps. Generation that
overlaps training (asynchronous runs) costs no wall time and is not in the parts; the executors' own
busy seconds (`time/generate_busy`, `time/reward_busy`) count it, and the breakdown reports their
totals beside the parts ("busy_seconds").

A run's breakdown (`TimeBreakdown`, `summary.json`'s "time_breakdown") adds the parts outside the
steps: start-up (building the policy and the controller: the slot engine's programs compile there) and
the first RL step (the trainer's and the weight push's programs compile there) as "warm-up", the
supervised warm start, held-out evaluations, checkpoints and the HF export, the metrics' logging
(JSONL, TensorBoard, W&B: `metrics.MetricsLogger(breakdown=)`), the RL loop's start and stop. A part
timed inside another (the SFT's logging) counts once, in the inner part. Whatever no part measured is
"unaccounted" (the controller's glue, summaries): a few percent at most.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterable, Mapping, Sequence

PARTS = ("warmup", "sft", "generation", "rewards", "training", "weight_sync", "evaluation", "checkpointing",
         "logging", "waits_other")
LABELS = {"warmup": "compile / warm-up", "sft": "SFT warm start", "generation": "generation",
          "rewards": "rewards", "training": "training", "weight_sync": "weight push / swap",
          "evaluation": "evaluation", "checkpointing": "checkpoints / export", "logging": "metrics logging",
          "waits_other": "waits / other"}

# The per-step metrics whose sum is `time/step`, and the part of the run's breakdown each goes to.
STEP_PARTS = {"time/wait_generate": "generation", "time/wait_swap": "weight_sync", "time/wait_reward": "rewards",
              "time/wait_other": "waits_other", "time/train": "training", "time/sync": "weight_sync"}
# The executors' own busy seconds per step (`runners.common.StepRecorder`), totalled beside the parts.
BUSY = {"generation": "time/generate_busy", "rewards": "time/reward_busy"}
# What the trainer's wait is split by (timeline interval kinds), first match wins where they overlap.
WAIT_KINDS = (("generate", "time/wait_generate"), ("swap", "time/wait_swap"), ("reward", "time/wait_reward"))


def split_wait(t0: float, t1: float, intervals: Iterable[tuple[str, float, float]]) -> dict[str, float]:
  """Seconds of [t0, t1] covered by each of `WAIT_KINDS`' intervals (an instant covered by several
  kinds counts for the first in `WAIT_KINDS`), and "time/wait_other" for the rest; they sum to t1 - t0.

  intervals: (kind, start, end) perf_counter spans; other kinds are ignored.
  """
  rank = {kind: i for i, (kind, _) in enumerate(WAIT_KINDS)}
  spans = [(max(s, t0), min(e, t1), rank[k]) for k, s, e in intervals if k in rank and e > t0 and s < t1]
  out = {key: 0.0 for _, key in WAIT_KINDS}
  cuts = sorted({t0, t1, *(s for s, _, _ in spans), *(e for _, e, _ in spans)})
  for a, b in zip(cuts, cuts[1:]):
    covering = [r for s, e, r in spans if s <= a and e >= b]
    if covering:
      out[WAIT_KINDS[min(covering)][1]] += b - a
  out["time/wait_other"] = max(0.0, (t1 - t0) - sum(out.values()))
  return out


def recent(timeline: list[tuple[str, float, float]], since: float, slack: float = 1.0) -> list:
  """The intervals of `timeline` that end after `since`. Intervals are appended within moments of their
  end, so the scan from the newest stops at the first one that ended `slack` seconds before `since`."""
  out = []
  for item in reversed(timeline):
    if item[2] < since - slack:
      break
    if item[2] > since:
      out.append(item)
  return out


class TimeBreakdown:
  """Seconds per part of `PARTS`, added as a run goes (thread-safe enough: one writer at a time, the
  controller thread). `add_step` takes a step's metrics: the run's first step goes to "warmup" whole."""

  def __init__(self):
    self.seconds = dict.fromkeys(PARTS, 0.0)
    self.busy = dict.fromkeys(BUSY, 0.0)  # the executors' own seconds, overlapping the parts
    self.steps = 0
    self.blocks = 0  # parts added outside the steps (checkpoints, evaluations, ...): a runner's step clock reads it
    self._open: list[float] = []  # per `timed` block being run: the seconds of the blocks timed inside it

  def add(self, part: str, seconds: float) -> None:
    self._add(part, seconds)
    self.blocks += 1

  def _add(self, part: str, seconds: float) -> None:
    if part not in self.seconds:
      raise KeyError(f"unknown part {part!r}; parts: {PARTS}")
    self.seconds[part] += float(seconds)

  @contextlib.contextmanager
  def timed(self, part: str):
    """The block's seconds to `part`, less those of blocks timed inside it (they go to their own)."""
    t0 = time.perf_counter()
    self._open.append(0.0)
    try:
      yield
    finally:
      inner = self._open.pop()
      seconds = time.perf_counter() - t0
      if self._open:
        self._open[-1] += seconds
      self.add(part, seconds - inner)

  def add_step(self, metrics: Mapping[str, float]) -> None:
    if self.steps == 0:
      self._add("warmup", metrics["time/step"])
    else:
      for key, part in STEP_PARTS.items():
        self._add(part, metrics.get(key, 0.0))
    for part, key in BUSY.items():
      self.busy[part] += float(metrics.get(key, 0.0))
    self.steps += 1

  def report(self, wall_seconds: float, timeline: Sequence[tuple[str, float, float]] = ()) -> dict:
    """{"wall_seconds", "parts": {part: {"seconds", "share"}}, "unaccounted_seconds", "unaccounted_share",
    "busy_seconds": {"generation", "rewards"}} (busy: the executors' own, overlapping the parts), and
    with the run's `timeline` (the Controller's intervals of real work) "overlap_seconds": the seconds
    two executors worked at once, {"rewards with generation", "generation with training", "rewards with
    training"}: what the asynchronous pipeline hid (over the intervals the timeline keeps)."""
    wall = max(float(wall_seconds), 1e-9)
    parts = {p: {"seconds": s, "share": s / wall} for p, s in self.seconds.items()}
    rest = wall - sum(self.seconds.values())
    out = {"wall_seconds": wall, "parts": parts, "unaccounted_seconds": rest, "unaccounted_share": rest / wall,
           "busy_seconds": dict(self.busy)}
    if timeline:
      out["overlap_seconds"] = {f"{OVERLAP_NAMES[a]} with {OVERLAP_NAMES[b]}": overlap_seconds(timeline, a, b)
                                for a, b in (("reward", "generate"), ("generate", "train"), ("reward", "train"))}
    return out


OVERLAP_NAMES = {"generate": "generation", "reward": "rewards", "train": "training"}  # timeline kind -> part


def overlap_seconds(timeline: Sequence[tuple[str, float, float]], a: str, b: str) -> float:
  """Seconds during which an `a` interval and a `b` interval of `timeline` ran at the same time (each
  kind's intervals taken as their union)."""
  def union(kind):
    spans = []
    for s, e in sorted((s, e) for name, s, e in timeline if name == kind):
      if spans and s <= spans[-1][1]:
        spans[-1][1] = max(spans[-1][1], e)
      else:
        spans.append([s, e])
    return spans

  spans_a, spans_b = union(a), union(b)
  total, i, j = 0.0, 0, 0
  while i < len(spans_a) and j < len(spans_b):
    (s1, e1), (s2, e2) = spans_a[i], spans_b[j]
    total += max(0.0, min(e1, e2) - max(s1, s2))
    if e1 <= e2:
      i += 1
    else:
      j += 1
  return total


def format_breakdown(report: Mapping) -> str:
  """The report as a console table: one line per part, seconds and share of the wall time."""
  lines = [f"where the time went ({report['wall_seconds']:.1f} s wall):"]
  for part, r in report["parts"].items():
    lines.append(f"  {LABELS[part]:<22} {r['seconds']:9.1f} s  {r['share']:6.1%}")
  lines.append(f"  {'unaccounted':<22} {report['unaccounted_seconds']:9.1f} s  {report['unaccounted_share']:6.1%}")
  busy = report.get("busy_seconds", {})
  if busy:  # what the executors did, whether the trainer waited for it or it ran behind training
    lines.append("  busy, overlapping the parts: " + ", ".join(f"{LABELS[p]} {s:.1f} s" for p, s in busy.items()))
  overlap = report.get("overlap_seconds", {})
  if overlap:  # what ran at the same time
    lines.append("  at the same time: " + ", ".join(f"{k} {s:.1f} s" for k, s in overlap.items()))
  return "\n".join(lines)
