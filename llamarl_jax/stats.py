"""Statistics for comparing training runs over seeds (used by `scripts/study.py`): pure numpy functions.

Per run, a training curve is summarised by a few scalars (`curve_area`, `steps_to_threshold`,
`window_mean`); per cell of a study, the scalars of its S seeds by their mean and a Student-t
confidence interval (`t_interval`). Two cells run with the same seeds share each seed's prompt stream
and sampling noise, so their difference is best measured per seed (`paired_t_interval`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Interval:
  """mean and the two-sided `confidence` interval [low, high] = mean -+ half_width of n values.

  sd is the sample standard deviation (ddof=1). With n < 2 the half-width is inf (no spread to
  estimate); with n = 0 the mean is nan.
  """
  mean: float
  half_width: float
  n: int
  sd: float
  confidence: float = 0.95

  @property
  def low(self) -> float:
    return self.mean - self.half_width

  @property
  def high(self) -> float:
    return self.mean + self.half_width

  def overlaps(self, other: "Interval") -> bool:
    return self.low <= other.high and other.low <= self.high

  def as_dict(self) -> dict:
    return {"mean": self.mean, "low": self.low, "high": self.high, "half_width": self.half_width,
            "n": self.n, "sd": self.sd, "confidence": self.confidence}


def t_quantile(p: float, df: int) -> float:
  """The p-quantile of Student's t distribution with `df` degrees of freedom (scipy)."""
  from scipy import stats

  return float(stats.t.ppf(p, df))


def t_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
  """Mean of `values` [n] with the Student-t interval mean -+ t_{(1+c)/2, n-1} * sd / sqrt(n).

  The t interval assumes the per-seed values are independent draws of a roughly normal quantity;
  with n = 5 its 95% multiplier is 2.776 (vs 1.96 for a normal), so the half-width is 1.24 sd.
  NaN values (e.g. a seed that never reached a threshold) must be removed or replaced by the caller.
  """
  if not 0 < confidence < 1:
    raise ValueError(f"confidence must be in (0, 1), got {confidence}")
  x = np.asarray(values, np.float64).reshape(-1)
  if np.isnan(x).any():
    raise ValueError(f"t_interval got NaN among {x.tolist()}: drop or replace the missing values first")
  n = int(x.size)
  if n == 0:
    return Interval(math.nan, math.inf, 0, math.nan, confidence)
  mean = float(x.mean())
  if n < 2:
    return Interval(mean, math.inf, 1, math.nan, confidence)
  sd = float(x.std(ddof=1))
  half = t_quantile(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n)
  return Interval(mean, half, n, sd, confidence)


def paired_t_interval(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> Interval:
  """The t interval of the per-seed differences a[i] - b[i] (a and b matched by seed)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if a.shape != b.shape:
    raise ValueError(f"paired values need the same seeds on both sides, got shapes {a.shape} and {b.shape}")
  return t_interval(a - b, confidence)


def curve_area(values: Sequence[float]) -> float:
  """Normalised area under a per-step curve [T] (steps 1..T, unit spacing): sum / T, the mean value.

  For a reward in [0, 1] it is in [0, 1]; it rewards both learning fast and ending high.
  """
  x = np.asarray(values, np.float64)
  if x.size == 0:
    raise ValueError("curve_area of an empty curve")
  return float(x.mean())


def moving_average(values: Sequence[float], window: int) -> np.ndarray:
  """Trailing mean over the last `window` values [T] -> [T] (the first ones over what exists)."""
  if window < 1:
    raise ValueError(f"window must be >= 1, got {window}")
  x = np.asarray(values, np.float64)
  c = np.concatenate([[0.0], np.cumsum(x)])
  idx = np.arange(1, x.size + 1)
  lo = np.maximum(idx - window, 0)
  return (c[idx] - c[lo]) / (idx - lo)


def steps_to_threshold(values: Sequence[float], threshold: float, window: int = 1) -> int | None:
  """First step (1-based) at which the trailing `window`-step mean of `values` [T] reaches `threshold`.

  Only steps with a full window count (so one lucky batch early on does not). None if never.
  """
  avg = moving_average(values, window)
  hits = np.nonzero(avg[window - 1:] >= threshold)[0]
  return int(hits[0]) + window if hits.size else None


def window_mean(values: Sequence[float], last: int) -> float:
  """Mean of the last `last` values (e.g. the last few held-out evaluations)."""
  x = np.asarray(values, np.float64)
  if x.size == 0 or last < 1:
    raise ValueError(f"window_mean needs values and last >= 1, got {x.size} values and last={last}")
  return float(x[-last:].mean())
