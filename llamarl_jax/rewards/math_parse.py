"""An answer text as a value (`Answer`, compared by `rewards.math_compare`): normalised, then read
by kind. Expressions go through the restricted grammar of `rewards.math_expr`.

Answers are normalised, then read as one of: an expression (numbers, variables, `\\frac`/`\\dfrac`/
`\\cfrac`, roots, powers, `\\pi`, `e`, `\\sin`...`\\arctan`, `\\ln`, `\\log_b`); an equation; an ordered
tuple; a set (`\\{...\\}`, a bare comma list, "x = 2 or x = 3", `\\pm`, several boxes, `\\{1\\} \\cup \\{2\\}`;
order-insensitive); a union of intervals (`[a, b)`, `\\cup`, `\\infty`, `\\mathbb{R}`, "all real numbers",
`\\{x : ...\\}`, one-variable inequalities `-2 \\le x < 5`, `x > 3 or x < 1` (a union), `x > -2 and x < 5`
(an intersection)); a clock time (`3:45`, `15:45:10`, `3:45 pm`, `3 p.m.`: hours 0-23, two-digit
minutes); a ratio (`3:4`, `1:2:3`); a matrix (`pmatrix` / `bmatrix`); or text (`\\text{(C)}`,
`Monday`, `\\text{No}`).
Normalisation drops `$`, `\\%`, degrees, `\\left`/`\\right`, spacing, `\\text{}` wrappers, thousands
separators (`1,000`, `32,\\!349`, `1{,}000`, `1\\,000`, `10 000`; a group never starts at 0: `0,111` is a
decimal), trailing unit words ("5 apples", `12\\text{ cm}^2`), scale words (`2 million` is 2000000), and a
left-hand side that is a name (`x =`, `f(x) =`, `(p, q) =`, `AB =`, `\\angle ABC =`, `AB:BC =`) or
arithmetic. An answer with a qualifier or hedge in it ("at least 5", "maybe 5") is text, never its number.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from llamarl_jax.rewards.math_compare import Answer, equal, intervals
from llamarl_jax.rewards.math_expr import MAX_ANSWER_CHARS, Number, ParseError, evaluate, parse

MAX_LIST_ITEMS = 32            # elements of a tuple / set / matrix row


# A clock time: `3:45`, `15:45:10`, `3:45 pm`, `3:45 p.m.`, `3 pm` (hours 0-23, minutes and seconds 00-59).
_MERIDIEM = r"(?:\s*([AaPp])\.?\s?[Mm]\b\.?)"
CLOCK_RE = re.compile(rf"(?<![\d:.,])(\d{{1,2}}):([0-5]\d)(?::([0-5]\d))?(?![\d:]){_MERIDIEM}?"
                      rf"|(?<![\d:.,])(\d{{1,2}}){_MERIDIEM}")
# A number qualified by these is a bound, not the number: "at least 5", "12 or more", "over 50".
QUALIFIER_RE = re.compile(
    r"\b(?:at\s+(?:least|most)|or\s+(?:more|less|fewer|greater|higher|lower|above|below|under|over)|"
    r"(?:more|less|fewer|greater|smaller|larger|higher|lower)\s+than|no\s+(?:more|less|fewer)|up\s+to|"
    r"over|under|above|below|nearly|almost|minimum|maximum|exceed\w*|not|never|cannot|isn't|"
    r"maybe|perhaps|probably|possibly|likely|might|guess|unsure|could\s+be)\b", re.IGNORECASE)


# ---------------------------------------------------------------------------------------------
# Normalisation

_REMOVE = ("\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\bigl", "\\bigr", "\\Bigl",
           "\\Bigr", "\\big", "\\Big", "^\\circ", "^{\\circ}", "\\circ", "\\degree", "°", "\\%", "%", "\\$", "$",
           "\\(", "\\)", "\\[", "\\]", "**")
_SPACES = ("\\ ", "\\quad", "\\qquad", "~")
_UNICODE = {"−": "-", "–": "-", "×": "*", "÷": "/", "·": "*", "≤": "\\le ", "≥": "\\ge ", "∞": "\\infty ",
            "∪": "\\cup ", "π": "\\pi ", "√": "\\sqrt", "±": "\\pm ", "ℝ": "\\mathbb{R}", "∶": ":"}
_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|textit|textrm|textnormal|textsf|mbox|mathrm|mathbf|mathit|mathsf|"
                          r"boldsymbol|bm|operatorname)\s*\{([^{}]*)\}")
_RELATION_CMDS = [(re.compile(r"\\(?:leqslant|leq|le)(?![A-Za-z])"), "<="),
                  (re.compile(r"\\(?:geqslant|geq|ge)(?![A-Za-z])"), ">="),
                  (re.compile(r"\\lt(?![A-Za-z])"), "<"), (re.compile(r"\\gt(?![A-Za-z])"), ">"),
                  (re.compile(r"\\(?:neq|ne)(?![A-Za-z])"), "!=")]
_LATEX_THOUSANDS_RE = re.compile(r"(\d),\\!\s*(?=\d{3}(?!\d))")
_THOUSANDS_RE = re.compile(r"(?<![\d.,])[1-9]\d{0,2}(?:,\d{3})+(?!\d|,\d)")  # 0,111 is a decimal comma
_SPACE_THOUSANDS_RE = re.compile(r"(?<![\d.,])\d{1,3}(?: \d{3})+(?![\d.,])")
_REPEATING_RE = re.compile(r"(?<!\d)(\d*)\.(\d*)\\overline\{?(\d{1,12})\}?")
_SCALES = {"thousand": 3, "million": 6, "billion": 9, "trillion": 12}
_SCALE_RE = re.compile(r"(?<![\d.])(\d+(?:\.\d+)?)\s*(thousand|million|billion|trillion)s?\b", re.IGNORECASE)
# Unit words after a number: 3+ letters, or a 2-letter unit (never `xy`, which is algebra).
_UNIT_WORD = r"(?:[A-Za-z]{3,}|cm|mm|km|nm|ft|in|yd|mi|kg|mg|lb|oz|ml|hr|ha|sq|cu|st|nd|rd|th|m|s|g|h)"
_TRAILING_WORDS_RE = re.compile(rf"(?:\s+{_UNIT_WORD}(?:\s*\^\s*\{{?\d\}}?)?(?:/[A-Za-z]+)?\.?)+\s*$")
_WORD_RE = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{3,}")
_NAME_RE = re.compile(r"[A-Za-z](?:_\{?\w+\}?)?(?:\([A-Za-z]\))?")  # x, x_1, a_{n}, f(x)
_OR_AND_RE = re.compile(r"\s(?:or|and)\s|\\(?:lor|vee|land|wedge)(?![A-Za-z])|;")


def _repeating(m: re.Match) -> str:
  """`0.1\\overline{6}` -> `(1/6)`: a repeating decimal as the exact fraction it is."""
  whole, fixed, period = m.group(1) or "0", m.group(2), m.group(3)
  value = int(whole) + (Fraction(int(fixed or "0")) + Fraction(int(period), 10 ** len(period) - 1)) / 10 ** len(fixed)
  return f"({value.numerator}/{value.denominator})"


def _clean(text: str) -> str:
  """Strip formatting that never changes an answer's value (see the module docstring)."""
  s = text.strip().replace("\\\\", "\n")  # a matrix row break, kept apart from the `\ ` space
  for k, v in _UNICODE.items():
    if k in s:
      s = s.replace(k, v)
  for _ in range(3):  # nested \text{\textbf{...}}; bounded
    s = _TEXT_CMD_RE.sub(lambda m: " " + m.group(1) + " ", s)
  s = _LATEX_THOUSANDS_RE.sub(r"\1", s)
  if "\\overline" in s:
    s = _REPEATING_RE.sub(_repeating, s)
  for token in _REMOVE:
    if token in s:
      s = s.replace(token, "")
  for token in _SPACES:
    if token in s:
      s = s.replace(token, " ")
  s = s.replace("{,}", ",").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\cfrac", "\\frac")
  s = s.replace("\\colon", ":")
  for pattern, repl in _RELATION_CMDS:
    s = pattern.sub(repl, s)
  if not any(c in s for c in "([") and "\\{" not in s:
    s = _THOUSANDS_RE.sub(lambda m: m.group().replace(",", ""), s)
  s = _SPACE_THOUSANDS_RE.sub(lambda m: m.group().replace(" ", ""), s)
  if "\\approx" in s:
    s = s.rsplit("\\approx", 1)[1]
  s = _SCALE_RE.sub(lambda m: f"({m.group(1)}*10^{_SCALES[m.group(2).lower()]})", s)  # 2 million
  s = s.strip().rstrip(".;:").strip()
  return s


def _split_top(s: str, sep: re.Pattern | str) -> list[str] | None:
  """Split on `sep` outside any brackets; None if there are more than MAX_LIST_ITEMS parts."""
  parts, depth, start, i = [], 0, 0, 0
  while i < len(s):
    c = s[i]
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
    elif depth == 0:
      m = sep.match(s, i) if isinstance(sep, re.Pattern) else (sep if s.startswith(sep, i) else None)
      if m:
        end = m.end() if isinstance(sep, re.Pattern) else i + len(sep)
        parts.append(s[start:i])
        start = i = end
        if len(parts) > MAX_LIST_ITEMS:
          return None
        continue
    i += 1
  parts.append(s[start:])
  return parts


def _strip_units(s: str) -> str:
  if s and (s[0].isdigit() or s[0] in "-+\\(."):
    s = _TRAILING_WORDS_RE.sub("", s)
  return s.strip()


# ---------------------------------------------------------------------------------------------
# Structured answers

_TEXT_WORD_RE = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mbox)\s*\{\s*([A-Za-z]{2,})\s*\}|(no|No|NO)")


def _text(s: str) -> Answer:
  t = re.sub(r"\s+", "", s).lower().strip("{}")
  if re.fullmatch(r"\([a-z]\)", t):  # multiple choice: (C) == C
    t = t[1]
  return Answer("text", t)


def _set(items: list[Answer], alt: Number | None = None) -> Answer:
  unique: list[Answer] = []
  for item in items:
    if item.kind == "set":
      candidates = item.value
    else:
      candidates = [item]
    for c in candidates:
      if not any(equal(c, u) for u in unique):
        unique.append(c)
  if len(unique) == 1 and alt is None:
    return unique[0]  # "x = 2 or x = 2", two boxes with the same answer
  return Answer("set", unique, alt=alt)


_INF = {"\\infty": math.inf, "+\\infty": math.inf, "-\\infty": -math.inf, "infty": math.inf, "inf": math.inf,
        "-inf": -math.inf, "\\inf": math.inf, "-\\inf": -math.inf}


def _number(s: str) -> Number | None:
  """The value of a constant endpoint (`\\frac12`, `-\\infty`), or None."""
  s = s.strip().replace(" ", "")
  if s in _INF:
    return _INF[s]
  try:
    return evaluate(parse(s, allow_vars=False))
  except ParseError:
    return None


def _interval(s: str) -> Answer | None:
  """`[a, b)`, `(-\\infty, 3]`, ... with constant endpoints, or None."""
  if len(s) < 5 or s[0] not in "([" or s[-1] not in ")]":
    return None
  parts = _split_top(s[1:-1], ",")
  if parts is None or len(parts) != 2:
    return None
  lo, hi = _number(parts[0]), _number(parts[1])
  if lo is None or hi is None:
    return None
  return intervals([(lo, s[0] == "[", hi, s[-1] == "]")])


_RELATION_RE = re.compile(r"(<=|>=|<|>)")
_EQUALS_RE = re.compile(r"(?<![<>!])=")


def _inequality(s: str) -> Answer | None:
  """A one-variable inequality (`x < 3`, `3 > x`, `-2 <= x <= 5`) as intervals, or None."""
  parts = _RELATION_RE.split(s)
  if len(parts) not in (3, 5):
    return None
  terms, ops = [p.strip() for p in parts[::2]], parts[1::2]  # op i sits between terms i and i + 1
  names = [i for i, t in enumerate(terms) if re.fullmatch(r"[A-Za-z]", t)]
  if len(names) != 1 or (len(terms) == 3 and names != [1]) or len({op[0] for op in ops}) != 1:
    return None  # no single variable, `x < 1 < 2`, or mixed directions `1 < x > 3`
  k = names[0]
  lo, lo_c, hi, hi_c = -math.inf, False, math.inf, False
  for i, op in enumerate(ops):
    bound = _number(terms[i + 1] if i == k else terms[i])
    if bound is None:
      return None
    if (op[0] == "<") == (i == k):  # x < b, or b > x: an upper bound
      hi, hi_c = bound, op.endswith("=")
    else:
      lo, lo_c = bound, op.endswith("=")
  return intervals([(lo, lo_c, hi, hi_c)])


_REALS_RE = re.compile(r"\\mathbb\s*\{?R\}?|\\R|\\Reals|\(-\\infty,\s*\+?\\infty\)|all\s+real\s+numbers",
                       re.IGNORECASE)
_SET_BUILDER_RE = re.compile(r"\\\{\s*[A-Za-z]\s*(?::|\||\\mid)(.+)\\\}", re.DOTALL)
_CONJUNCTION_RE = re.compile(r"\sand\s|\\(?:land|wedge)(?![A-Za-z])")


def _intersect(a: list, b: list) -> list:
  """The intersection of two unions of intervals (lists of (lo, lo_closed, hi, hi_closed))."""
  out = []
  for lo1, lc1, hi1, hc1 in a:
    for lo2, lc2, hi2, hc2 in b:
      lo, lc = max((lo1, lc1), (lo2, lc2), key=lambda t: (t[0], not t[1]))
      hi, hc = min((hi1, hc1), (hi2, hc2), key=lambda t: (t[0], t[1]))
      if lo < hi:
        out.append((lo, lc, hi, hc))
  return out


def _join_intervals(s: str, sep, items: list[Answer]) -> Answer:
  """Interval answers joined by `or` / `\\cup` (a union), by `and` (an intersection: `x > -2 and x < 5`), or
  by commas (a union only when the parts are disjoint: `x > 1, x < 3` is ambiguous)."""
  spans = [span for i in items for span in i.value]
  if sep is _OR_AND_RE and _CONJUNCTION_RE.search(s):
    if re.search(r"\sor\s|\\(?:lor|vee)(?![A-Za-z])|;", s):
      return _text(s)  # `and` with `or`: no precedence is assumed
    common = items[0].value
    for i in items[1:]:
      common = _intersect(common, i.value)
    return intervals(common) if common else _text(s)
  union = intervals(spans)
  if sep == "," and (union is None or len(union.value) != len(spans)):
    return _text(s)
  return union or _text(s)


def _matrix(s: str) -> Answer | None:
  m = re.fullmatch(r"\\begin\{([pbBvV]?matrix|array)\}(?:\{[^{}]*\})?(.*)\\end\{\1\}", s, re.DOTALL)
  if m is None or m.group(1) in ("vmatrix", "Vmatrix"):
    return None
  rows = [r for r in m.group(2).split("\n") if r.strip()]
  if not rows or len(rows) > MAX_LIST_ITEMS:
    return None
  try:
    cells = [[parse(c) for c in r.split("&")] for r in rows]
  except ParseError:
    return None
  if len({len(r) for r in cells}) != 1 or len(cells[0]) > MAX_LIST_ITEMS:
    return None
  return Answer("matrix", cells)


_GEOMETRY_RE = re.compile(r"\\(?:angle|measuredangle|overline|overrightarrow|triangle)|\bm(?=\\angle)|[{}\[\]|\s]")
_POINTS_RE = re.compile(r"[A-Z]{1,4}'?(?::[A-Z]{1,4}'?)*|[a-z](?::[a-z])+")  # AB, \angle ABC, [ABC], AB:BC, p:q


def _is_name(s: str) -> bool:
  """A left-hand side that only names the answer: `x`, `f(x)`, `a_n`, `(p, q)`, `Area`, `AB`, `\\angle ABC`,
  `AB:BC`, `p:q`, or plain arithmetic.

  Lower-case words need 3+ letters: `xy = 6` is an equation, not a name for 6; capitals name points.
  """
  s = s.strip()
  if _NAME_RE.fullmatch(s) or re.fullmatch(r"[A-Za-z]{3,}(?:\s+[A-Za-z]{3,}){0,3}", s):
    return True
  if _POINTS_RE.fullmatch(_GEOMETRY_RE.sub("", s)):
    return True
  if s[:1] == "(" and s[-1:] == ")":
    parts = _split_top(s[1:-1], ",")
    if parts and all(_NAME_RE.fullmatch(p.strip()) for p in parts):
      return True
  return not re.search(r"[A-Za-z]", re.sub(r"\\[A-Za-z]+", "", s))


def _clock(m: re.Match) -> Answer:
  """A clock time as ("time", (hour, minute, second, meridiem)): meridiem "a" / "p" with hours 1-12, or None
  with hours 0-23. Text where the hour is out of range (`13:00 pm`, `25:30` never matches CLOCK_RE)."""
  if m.group(5) is not None:
    hour, minute, second, meridiem = int(m.group(5)), 0, 0, m.group(6).lower()
  else:
    hour, minute, second = int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
    meridiem = m.group(4).lower() if m.group(4) else None
  if hour > (12 if meridiem else 23) or (meridiem and hour == 0):
    return _text(m.group())
  return Answer("time", (hour, minute, second, meridiem))


def parse_answer(text: str) -> Answer | None:
  """An answer text as an `Answer` (see the module docstring), or None if empty or too long."""
  if not isinstance(text, str) or len(text) > MAX_ANSWER_CHARS:
    return None
  word = _TEXT_WORD_RE.fullmatch(text.strip())
  if word is not None:  # `\\text{No}`, `No`: a word, never the product of its letters
    return _text(word.group(1) or word.group(2))
  s = _clean(text)
  return _parse(s, 0) if s else None


def _parse(s: str, depth: int) -> Answer | None:
  s = s.strip()
  if not s:
    return None
  if depth > 3 or QUALIFIER_RE.search(s):
    return _text(s)
  matrix = _matrix(s)
  if matrix is not None:
    return matrix
  builder = _SET_BUILDER_RE.fullmatch(s)
  if builder is not None:  # \{x : -1 \le x \le 1\}: the condition's solution set
    inner = _parse(builder.group(1), depth + 1)
    return inner if inner is not None and inner.kind == "intervals" else _text(s)
  s = _strip_units(s)
  clock = CLOCK_RE.fullmatch(s)
  if clock is not None:
    return _clock(clock)
  if "\\pm" in s:  # x = \pm 2, 1 \pm \sqrt{2}: two answers
    items = [_parse(s.replace("\\pm", sign), depth + 1) for sign in ("+", "-")] if s.count("\\pm") == 1 else [None]
    return _set(items) if all(i is not None and i.kind != "text" for i in items) else _text(s)
  if _REALS_RE.fullmatch(s):
    return intervals([(-math.inf, False, math.inf, False)])
  for sep in (_OR_AND_RE, ","):
    parts = _split_top(s, sep)
    if parts is None:
      return _text(s)
    if len(parts) > 1:
      items = [_parse(p, depth + 1) for p in parts]
      if any(i is None or i.kind == "text" for i in items):
        return _text(s)
      if all(i.kind == "intervals" for i in items):
        return _join_intervals(s, sep, items)
      alt = None
      if sep == "," and re.fullmatch(r"-?\d+,\d+", s):
        alt = Fraction(s.replace(",", "."))  # "3,5": a decimal comma where a single number is expected
      return _set(items, alt)
  s = re.sub(r"^[A-Za-z]\s*\\in\s*", "", s)
  if _REALS_RE.fullmatch(s):
    return intervals([(-math.inf, False, math.inf, False)])
  if "\\cup" in s:
    parts = s.split("\\cup")
    if len(parts) > MAX_LIST_ITEMS:
      return _text(s)
    if all(p.strip().startswith("\\{") for p in parts):  # \{1\} \cup \{2, 3\}: a set
      items = [_parse(p, depth + 1) for p in parts]
      return _set(items) if all(i is not None and i.kind in ("set", "expr") for i in items) else _text(s)
    spans = []
    for part in parts:
      got = _interval(part.strip())
      if got is None:
        return _text(s)
      spans += got.value
    return intervals(spans)
  sides = _split_top(s, _EQUALS_RE)
  lhs = None
  if sides is not None and len(sides) > 1:
    if all(_is_name(p) for p in sides[:-1]) and sides[-1].strip():
      if re.fullmatch(r"\s*[A-Za-z]\s*", sides[-2]):
        lhs = ("var", sides[-2].strip())
      s = _strip_units(sides[-1])
    elif len(sides) == 2:
      try:
        return Answer("eq", (parse(_strip_units(sides[0])), parse(_strip_units(sides[1]))))
      except ParseError:
        return _text(s)
    else:
      return _text(s)
  if _RELATION_RE.search(s):
    return _inequality(s) or _text(s)
  ratio = _split_top(s, ":")
  if ratio is not None and len(ratio) > 1:
    try:
      return Answer("ratio", [parse(_strip_units(p)) for p in ratio])
    except ParseError:
      return _text(s)
  if s.startswith("\\{") and s.endswith("\\}"):
    parts = _split_top(s[2:-2], ",")
    items = [_parse(p, depth + 1) for p in parts] if parts else [None]
    if any(i is None or i.kind == "text" for i in items):
      return _text(s)
    return _set(items)
  if s[:1] in "([" and s[-1:] in ")]":
    parts = _split_top(s[1:-1], ",")
    if parts is not None and len(parts) > 1:
      if len(parts) == 2 and (s[0] + s[-1] != "()" or "infty" in s):
        return _interval(s) or _text(s)
      try:
        return Answer("tuple", (s[0], [parse(_strip_units(p)) for p in parts], s[-1]))
      except ParseError:
        return _text(s)
  if _WORD_RE.search(s) is None:
    try:
      return Answer("expr", parse(s), lhs=lhs)
    except ParseError:
      pass
  return _text(s)


def answers_equal(response_answer: str, ground_truth: str) -> bool:
  """Whether two extracted answers are mathematically the same (the rules: `rewards.math_compare`)."""
  a, b = parse_answer(response_answer), parse_answer(ground_truth)
  return a is not None and b is not None and equal(a, b)
