"""Parsed answers (`Answer`) and when two are the same value: the math verifier's equivalence rules.
`rewards.math_parse` builds the values; `equal(a, b)` compares them.

Equivalence: exact rational equality (0.5 == 1/2 == \\frac{1}{2}; mixed numbers `4\\frac{4}{9}` == 40/9),
float closeness (relative 1e-9) once irrationals appear, expressions in variables by exact evaluation
at several rational points (2x+2 == 2(x+1), `\\sec^2 y` == `\\tan^2 y + 1`), equations up to a nonzero
constant factor (planes: x + y - z = 4 == -2x - 2y + 2z + 8 = 0), ratios up to a common factor (3:4 ==
6:8 == 3/4), intervals after merging, text by normalised string. A decimal of LONG_DECIMAL_PLACES or more
places is a printout: it equals a value within one unit of its last place (0.3333333333333333 == 1/3);
shorter decimals must be exact (0.333333 != 1/3, 3.14159 != pi). A decimal comma is read only where
unambiguous: "3,5" (not a thousands group) against a single-number reference is 3.5.
Times: equal only to a time (never a number or a ratio: `6:30` is not `3:15`, `1:30` is not 90 or 1.5); a
12-hour time equals a 24-hour one by its 24-hour reading (`3:45 pm` == `15:45`), a bare hour of 1-12 by
the clock face (`3:45` == `3:45 pm`); `H:MM` with two-digit minutes is always a time, so a ratio written
that way (`10:15`) equals only itself.
Contested cases, decided: an ordered tuple never equals a set; `(1, 2)` equals the open interval; a
percentage equals its number (`50\\%` == 50), never its fraction (0.5); `\\log` is natural.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from llamarl_jax.rewards.math_expr import Number, ParseError, evaluate, variables

LONG_DECIMAL_PLACES = 10       # a decimal with this many places is a printout of a value, not a rounding
REL_TOL = 1e-9                 # float comparison once irrationals are involved
ABS_TOL = 1e-9


@dataclass(frozen=True)
class Answer:
  """A parsed answer. kind and value:
    "expr": AST (lhs: the variable AST of a stripped `y = ...`, to compare with an equation)
    "eq": (lhs AST, rhs AST)               "tuple": (open bracket, [AST], close bracket)
    "set": [Answer] (alt: the number a decimal comma makes of "3,5")
    "intervals": [(lo, lo_closed, hi, hi_closed)] sorted and merged; lo/hi numbers, +-inf
    "matrix": [[AST]]                      "ratio": [AST] (`3:4`, `1:2:3`)
    "time": (hour, minute, second, meridiem "a" / "p" or None)
    "text": normalised string
  """
  kind: str
  value: Any
  lhs: Any = None
  alt: Any = None


def intervals(spans: list[tuple[Number, bool, Number, bool]]) -> Answer | None:
  """A union of intervals, sorted and merged; None if an interval is empty or reversed."""
  for lo, _, hi, _ in spans:
    if not lo < hi:
      return None
  spans = sorted(spans, key=lambda t: (t[0], not t[1]))
  merged = [list(spans[0])]
  for lo, lo_c, hi, hi_c in spans[1:]:
    cur = merged[-1]
    if lo < cur[2] or (lo == cur[2] and (cur[3] or lo_c)):
      if hi > cur[2] or (hi == cur[2] and hi_c):
        cur[2], cur[3] = hi, hi_c
    else:
      merged.append([lo, lo_c, hi, hi_c])
  return Answer("intervals", [(lo, lo_c and math.isfinite(lo), hi, hi_c and math.isfinite(hi))
                              for lo, lo_c, hi, hi_c in merged])


# ---------------------------------------------------------------------------------------------
# Comparison

def _time_equal(a: tuple, b: tuple) -> bool:
  """Clock times equal: the same hour (a 12-hour time against a 24-hour one by its 24-hour reading; a bare
  hour of 1-12 against a 12-hour time by the clock face: `3:45` == `3:45 pm` == `15:45`), minute and second."""
  (ha, ma, sa, pa), (hb, mb, sb, pb) = a, b
  if (ma, sa) != (mb, sb):
    return False
  if pa and pb:
    return (pa, ha % 12) == (pb, hb % 12)
  if not pa and not pb:
    return ha == hb
  (h12, meridiem), bare = ((ha, pa), hb) if pa else ((hb, pb), ha)
  h24 = h12 % 12 + (12 if meridiem == "p" else 0)
  return bare == h24 or (1 <= bare <= 12 and bare % 12 == h12 % 12)


def _close(a: Number, b: Number) -> bool:
  if isinstance(a, Fraction) and isinstance(b, Fraction):
    return a == b
  try:
    return math.isclose(float(a), float(b), rel_tol=REL_TOL, abs_tol=ABS_TOL)
  except OverflowError:
    return False


# Rational points at which expressions in variables are compared (exactly, while rational).
_POINTS = (Fraction(7, 3), Fraction(-5, 11), Fraction(13, 4), Fraction(29, 17), Fraction(-8, 5))


def _env(k: int, names: list[str]) -> dict[str, Fraction]:
  """The k-th comparison point: a distinct rational per variable."""
  return {name: _POINTS[(k + i) % len(_POINTS)] + i for i, name in enumerate(names)}


def _values(nodes, names: list[str]):
  """Per point, the values of `nodes` (None where one fails, e.g. a division by zero there)."""
  out = []
  for k in range(len(_POINTS)):
    env = _env(k, names)
    try:
      out.append([evaluate(n, env) for n in nodes])
    except ParseError:
      out.append(None)
  return out


def _decimal_places(node) -> int:
  """Places after the point of a decimal literal (`0.3333`, `-2.50`), else 0."""
  node = node[1] if node[0] == "neg" else node
  if node[0] != "num" or "." not in node[2] or "e" in node[2].lower():
    return 0
  return len(node[2].split(".", 1)[1])


def _long_decimal_equal(a, b) -> bool | None:
  """A long decimal (LONG_DECIMAL_PLACES+ places, a printout such as 0.3333333333333333) against a value that
  is not a decimal literal: equal within one unit of its last place. None when the rule does not apply."""
  pa, pb = _decimal_places(a), _decimal_places(b)
  if (pa >= LONG_DECIMAL_PLACES) == (pb >= LONG_DECIMAL_PLACES) or min(pa, pb) > 0:
    return None
  places = max(pa, pb)
  x, y = evaluate(a), evaluate(b)
  if isinstance(x, Fraction) and isinstance(y, Fraction):
    return abs(x - y) <= Fraction(1, 10 ** places)
  x, y = float(x), float(y)
  return abs(x - y) <= 10.0 ** -places + 4e-16 * max(1.0, abs(x))


def _expr_equal(a, b) -> bool:
  names = sorted(variables(a) | variables(b))
  if not names:
    try:
      long = _long_decimal_equal(a, b)
      return long if long is not None else _close(evaluate(a), evaluate(b))
    except (ParseError, OverflowError):
      return False
  compared = 0
  for k in range(len(_POINTS)):  # point by point: a difference ends the comparison early
    env = _env(k, names)
    try:
      x, y = evaluate(a, env), evaluate(b, env)
    except ParseError:
      continue  # undefined at this point (a division by zero there)
    if not _close(x, y):
      return False
    compared += 1
  return compared >= 2


def _eq_equal(e1, e2) -> bool:
  """Equations equal up to a nonzero constant factor: lhs1 - rhs1 == c * (lhs2 - rhs2)."""
  f, g = ("sub", *e1), ("sub", *e2)
  names = sorted(variables(f) | variables(g))
  points = [v for v in _values([f, g], names) if v is not None]
  ratio = next((x / y for x, y in points if y != 0), None)
  if len(points) < 2 or ratio is None or ratio == 0:
    return False
  return all(_close(x, ratio * y) for x, y in points)


def _as_intervals(a: Answer) -> Answer | None:
  """`(1, 2)` read as an open interval (MATH writes points and open intervals alike)."""
  if a.kind == "intervals":
    return a
  if a.kind == "tuple" and a.value[0] + a.value[2] == "()" and len(a.value[1]) == 2:
    try:
      lo, hi = evaluate(a.value[1][0]), evaluate(a.value[1][1])
    except ParseError:
      return None
    return intervals([(lo, False, hi, False)])
  return None


def _ratio_equal(r, q) -> bool:
  """Ratios equal up to a common factor: 3:4 == 6:8 (terms evaluated exactly, or as floats)."""
  if len(r) != len(q):
    return False
  try:
    x, y = [evaluate(t) for t in r], [evaluate(t) for t in q]
  except ParseError:
    return False
  if x[0] == 0 or y[0] == 0:
    return False
  return all(_close(xi * y[0], yi * x[0]) for xi, yi in zip(x, y))


def equal(a: Answer, b: Answer) -> bool:
  """Whether two parsed answers are the same value (see the module docstring)."""
  kinds = {a.kind, b.kind}
  if "time" in kinds:  # a time equals only a time: never a number or a ratio (6:30 is not 3:15)
    return kinds == {"time"} and _time_equal(a.value, b.value)
  if "text" in kinds:
    return a.kind == b.kind and a.value == b.value
  if kinds == {"expr"}:
    return _expr_equal(a.value, b.value)
  if kinds == {"eq"}:
    return _eq_equal(a.value, b.value)
  if kinds == {"expr", "eq"}:
    e, q = (a, b) if a.kind == "expr" else (b, a)
    return e.lhs is not None and _eq_equal((e.lhs, e.value), q.value)
  if kinds == {"set"}:
    right = list(b.value)
    if len(a.value) != len(right):
      return False
    for x in a.value:
      j = next((j for j, y in enumerate(right) if equal(x, y)), None)
      if j is None:
        return False
      del right[j]
    return True
  if "set" in kinds:
    s, o = (a, b) if a.kind == "set" else (b, a)
    return s.alt is not None and o.kind == "expr" and _expr_equal(("num", s.alt, ""), o.value)
  if "intervals" in kinds:
    x, y = _as_intervals(a), _as_intervals(b)
    return x is not None and y is not None and len(x.value) == len(y.value) and all(
        p[1] == q[1] and p[3] == q[3] and _close(p[0], q[0]) and _close(p[2], q[2]) for p, q in zip(x.value, y.value))
  if kinds == {"tuple"}:
    (ao, ax, ac), (bo, bx, bc) = a.value, b.value
    return (ao, ac) == (bo, bc) and len(ax) == len(bx) and all(_expr_equal(x, y) for x, y in zip(ax, bx))
  if kinds == {"ratio"}:
    return _ratio_equal(a.value, b.value)
  if kinds == {"ratio", "expr"}:
    r, e = (a, b) if a.kind == "ratio" else (b, a)
    return len(r.value) == 2 and _expr_equal(("div", *r.value), e.value)
  if kinds == {"matrix"}:
    return len(a.value) == len(b.value) and all(
        len(r) == len(s) and all(_expr_equal(x, y) for x, y in zip(r, s)) for r, s in zip(a.value, b.value))
  return False
