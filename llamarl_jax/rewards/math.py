"""Math answer verification for GSM8K- and MATH-style problems, safe on untrusted model text.

`verify(response_text, ground_truth) -> 1.0 | 0.0`.

Model text is never evaluated as code: no `eval`, `exec`, `sympify` or `parse_expr`. Answers go
through a small hand-written tokenizer and recursive-descent parser over numbers, single-letter
variables, `+ - * / ^`, parentheses/braces, `\\frac`, `\\sqrt`, `\\pi`, which evaluates to exact
`fractions.Fraction` (or `float` once an irrational appears). Every stage is bounded up front
(response length, answer length, token count, nesting depth, digits per number, bits per
intermediate value, exponent size), so any input returns in well under a millisecond to a few
milliseconds; `RewardExecutor` adds a hard per-sample timeout on top.

Answer extraction from a response, first match wins:
  1. the last `\\boxed{...}` (or `\\fbox{...}`); a response with a malformed or over-long box has no answer,
  2. the text after the last `####` (GSM8K convention), up to the end of that line,
  3. the text after the last "answer is" / "answer:", up to the end of that line,
  4. the last number in the text (`-3`, `1,234.5`, `3/4`).
Only one candidate is compared (listing many answers earns nothing).

Equivalence: exact rational equality (0.5 == 1/2 == \\frac{1}{2} == 50/100), float closeness
(relative 1e-6) once irrationals are involved (\\frac{\\sqrt{2}}{2} == \\frac{1}{\\sqrt2}),
expressions in variables compared by exact evaluation at several rational points (2x+2 == 2(x+1)),
tuples/intervals element-wise with matching brackets, bare comma lists order-insensitively,
anything else (text answers such as `\\text{(C)}` or `Monday`) by normalised string.
Normalisation drops `$`, `\\%`/`%`, degrees, `\\left`/`\\right`, spacing commands, thousands
separators (`1,000` and `1{,}000`), `\\text{...}` wrappers, a left-hand side that is a name (`x =`,
`f(x) =`) or plain arithmetic (`48+24 =`), and trailing unit words ("5 apples", "12 \\text{ cm}").
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Union

# ---------------------------------------------------------------------------------------------
# Bounds (checked before any work is done; see the module docstring).

MAX_RESPONSE_CHARS = 100_000   # longer responses score 0
MAX_ANSWER_CHARS = 1_000       # the extracted answer candidate
MAX_TOKENS = 256               # tokens in one answer expression
MAX_DEPTH = 48                 # nesting of parentheses / \frac / \sqrt / unary signs
MAX_NUMBER_DIGITS = 100        # digits in one numeric literal
MAX_BITS = 8_192               # numerator/denominator bits of any intermediate exact value
MAX_EXPONENT = 10_000          # |integer exponent| for exact powers
MAX_ROOT_DEGREE = 64           # n in \sqrt[n]{.}
MAX_DECIMAL_EXPONENT = 2_000   # |e| in a literal such as 1.5e3
REL_TOL = 1e-6                 # float comparison once irrationals are involved
ABS_TOL = 1e-9
MAX_LIST_ITEMS = 32            # elements of a tuple / comma list

Number = Union[Fraction, float]


class ParseError(ValueError):
  """The text is not an expression of the restricted grammar, or it exceeds a bound."""


# ---------------------------------------------------------------------------------------------
# Tokenizer

_TOKEN_RE = re.compile(r"""
    (?P<ws>\s+)
  | (?P<num>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)
  | (?P<cmd>\\[A-Za-z]+)
  | (?P<var>[A-Za-z])
  | (?P<pow>\*\*)
  | (?P<op>[-+*/^(){}\[\],])
""", re.VERBOSE)

_CONSTANTS = {"pi": math.pi}
_COMMAND_OPS = {"cdot": "*", "times": "*", "div": "/", "ast": "*"}


def tokenize(text: str) -> list[tuple[str, str]]:
  """[(kind, value)] with kind in num/cmd/var/op; raises ParseError on anything else or too long."""
  if len(text) > MAX_ANSWER_CHARS:
    raise ParseError(f"expression of {len(text)} chars exceeds {MAX_ANSWER_CHARS}")
  tokens: list[tuple[str, str]] = []
  pos = 0
  while pos < len(text):
    m = _TOKEN_RE.match(text, pos)
    if m is None:
      raise ParseError(f"unexpected character {text[pos]!r} at {pos}")
    pos = m.end()
    kind = m.lastgroup
    value = m.group()
    if kind == "ws":
      continue
    if kind == "num":
      if sum(c.isdigit() for c in value) > MAX_NUMBER_DIGITS:
        raise ParseError(f"numeric literal longer than {MAX_NUMBER_DIGITS} digits")
    elif kind == "cmd":
      value = value[1:]
      if value in _COMMAND_OPS:
        kind, value = "op", _COMMAND_OPS[value]
      elif value in ("dfrac", "tfrac"):
        value = "frac"
    elif kind == "pow":
      kind, value = "op", "^"
    tokens.append((kind, value))
    if len(tokens) > MAX_TOKENS:
      raise ParseError(f"more than {MAX_TOKENS} tokens")
  return tokens


# ---------------------------------------------------------------------------------------------
# Parser: tokens -> AST of tuples
#   ("num", Fraction, literal) ("const", float) ("var", name) ("neg", a) ("add"|"sub"|"mul"|"div"|"pow", a, b)
#   ("root", a, n)

def _literal(text: str) -> Fraction:
  """Exact value of a numeric literal ("12", "0.5", ".5", "1.5e3"), with a bounded decimal exponent."""
  mantissa, _, exponent = text.lower().partition("e")
  if exponent and abs(int(exponent)) > MAX_DECIMAL_EXPONENT:
    raise ParseError(f"decimal exponent {exponent} exceeds {MAX_DECIMAL_EXPONENT}")
  value = Fraction(mantissa)
  return value * Fraction(10) ** int(exponent) if exponent else value


class _Parser:

  def __init__(self, tokens, *, allow_vars: bool, implicit_mul: bool, allow_pow: bool, allow_unary: bool,
               allow_latex: bool):
    self.tokens = tokens
    self.pos = 0
    self.depth = 0
    self.allow_vars = allow_vars
    self.implicit_mul = implicit_mul
    self.allow_pow = allow_pow
    self.allow_unary = allow_unary
    self.allow_latex = allow_latex

  def peek(self):
    return self.tokens[self.pos] if self.pos < len(self.tokens) else (None, None)

  def take(self):
    tok = self.peek()
    if tok[0] is None:
      raise ParseError("unexpected end of expression")
    self.pos += 1
    return tok

  def expect(self, value: str) -> None:
    kind, v = self.take()
    if kind != "op" or v != value:
      raise ParseError(f"expected {value!r}, found {v!r}")

  def enter(self) -> None:
    self.depth += 1
    if self.depth > MAX_DEPTH:
      raise ParseError(f"nesting deeper than {MAX_DEPTH}")

  def parse(self):
    node = self.expr()
    if self.pos != len(self.tokens):
      raise ParseError(f"unexpected token {self.peek()[1]!r}")
    return node

  def expr(self):
    node = self.term()
    while self.peek() in (("op", "+"), ("op", "-")):
      _, op = self.take()
      node = ("add" if op == "+" else "sub", node, self.term())
    return node

  def _starts_atom(self) -> bool:
    kind, v = self.peek()
    if kind == "num":
      return True
    if kind == "var":
      return self.allow_vars
    if kind == "cmd":
      return self.allow_latex
    return kind == "op" and v in ("(", "{")

  def term(self):
    node = self.unary()
    while True:
      kind, v = self.peek()
      if kind == "op" and v in ("*", "/"):
        self.take()
        node = ("mul" if v == "*" else "div", node, self.unary())
      elif self.implicit_mul and self._starts_atom():
        node = ("mul", node, self.power())
      else:
        return node

  def unary(self):
    kind, v = self.peek()
    if kind == "op" and v in ("+", "-"):
      if not self.allow_unary:
        raise ParseError("unary sign not allowed")
      self.take()
      self.enter()
      node = self.unary()
      self.depth -= 1
      return ("neg", node) if v == "-" else node
    return self.power()

  def power(self):
    base = self.atom()
    if self.peek() == ("op", "^"):
      if not self.allow_pow:
        raise ParseError("'^' not allowed")
      self.take()
      self.enter()
      exponent = self.unary()  # 2^10 == 1024 (as written in text), 2^{10}, 2^-1, 2^3^2 == 2^9
      self.depth -= 1
      return ("pow", base, exponent)
    return base

  def latex_arg(self):
    """A LaTeX argument: `{expr}`, one digit of a number (`\\frac12`), a variable or a command atom."""
    kind, v = self.peek()
    if kind == "op" and v == "{":
      return self.atom()
    if kind == "num" and len(v) > 1 and v[0].isdigit():
      self.tokens[self.pos] = ("num", v[1:])  # consume one digit: \frac12 == \frac{1}{2}
      return ("num", _literal(v[0]), v[0])
    return self.atom()

  def atom(self):
    kind, v = self.take()
    if kind == "num":
      return ("num", _literal(v), v)
    if kind == "var":
      if not self.allow_vars:
        raise ParseError(f"variable {v!r} not allowed")
      return ("var", v)
    if kind == "op" and v in ("(", "{"):
      self.enter()
      node = self.expr()
      self.expect(")" if v == "(" else "}")
      self.depth -= 1
      return node
    if kind == "cmd" and self.allow_latex:
      if v in _CONSTANTS:
        return ("const", _CONSTANTS[v])
      if v == "frac":
        self.enter()
        num, den = self.latex_arg(), self.latex_arg()
        self.depth -= 1
        return ("div", num, den)
      if v == "sqrt":
        self.enter()
        degree = 2
        if self.peek() == ("op", "["):
          self.take()
          k, d = self.take()
          if k != "num" or not d.isdigit() or not 2 <= int(d) <= MAX_ROOT_DEGREE:
            raise ParseError(f"root degree must be an integer in [2, {MAX_ROOT_DEGREE}], found {d!r}")
          degree = int(d)
          self.expect("]")
        node = ("root", self.latex_arg(), degree)
        self.depth -= 1
        return node
    raise ParseError(f"unexpected token {v!r}")


def parse(text: str, *, allow_vars: bool = True, implicit_mul: bool = True, allow_pow: bool = True,
          allow_unary: bool = True, allow_latex: bool = True):
  """Parse `text` into an AST (nested tuples) of the restricted grammar; raises ParseError.

  Never evaluates anything; `evaluate` does, with bounded exact arithmetic.
  """
  tokens = tokenize(text)
  if not tokens:
    raise ParseError("empty expression")
  return _Parser(tokens, allow_vars=allow_vars, implicit_mul=implicit_mul, allow_pow=allow_pow,
                 allow_unary=allow_unary, allow_latex=allow_latex).parse()


# ---------------------------------------------------------------------------------------------
# Bounded evaluation

def _check(x: Number) -> Number:
  if isinstance(x, Fraction):
    if x.numerator.bit_length() > MAX_BITS or x.denominator.bit_length() > MAX_BITS:
      raise ParseError(f"intermediate value exceeds {MAX_BITS} bits")
    return x
  if not math.isfinite(x):
    raise ParseError("non-finite value")
  return x


def _to_float(x: Number) -> float:
  try:
    return float(x)
  except OverflowError as e:
    raise ParseError("value too large for a float") from e


def _int_root(n: int, k: int) -> int | None:
  """Exact integer k-th root of n >= 0, or None (integer Newton iteration: O(log bits) steps)."""
  if n < 2:
    return n
  if k == 2:
    r = math.isqrt(n)
    return r if r * r == n else None
  x = 1 << (n.bit_length() // k + 1)  # >= the root
  while True:
    y = ((k - 1) * x + n // x ** (k - 1)) // k
    if y >= x:
      break
    x = y
  return x if x ** k == n else None


def _root(x: Number, k: int) -> Number:
  if x < 0:
    if k % 2 == 0:
      raise ParseError("even root of a negative number")
    return -_root(-x, k)
  if isinstance(x, Fraction):
    p, q = _int_root(x.numerator, k), _int_root(x.denominator, k)
    if p is not None and q is not None:
      return Fraction(p, q)
  return _check(_to_float(x) ** (1.0 / k))


def _pow(base: Number, exponent: Number) -> Number:
  if isinstance(exponent, Fraction) and exponent.denominator == 1:
    e = exponent.numerator
    if abs(e) > MAX_EXPONENT:
      raise ParseError(f"exponent {e} exceeds {MAX_EXPONENT}")
    if isinstance(base, Fraction):
      if base == 0 and e < 0:
        raise ParseError("zero to a negative power")
      bits = max(base.numerator.bit_length(), base.denominator.bit_length())
      if bits * abs(e) > MAX_BITS:
        raise ParseError(f"power exceeds {MAX_BITS} bits")
      return base ** e
  if isinstance(exponent, Fraction) and isinstance(base, Fraction) and exponent.denominator <= MAX_ROOT_DEGREE:
    if base < 0 and exponent.denominator % 2 == 0:
      raise ParseError("even root of a negative number")
    return _pow(_root(base, exponent.denominator), Fraction(exponent.numerator))
  b, e = _to_float(base), _to_float(exponent)
  if b < 0 and e != int(e):
    raise ParseError("non-integer power of a negative number")
  if b == 0 and e < 0:
    raise ParseError("zero to a negative power")
  try:
    return _check(math.pow(b, e))
  except (OverflowError, ValueError) as err:
    raise ParseError(f"power out of range: {err}") from err


def evaluate(node, env: dict[str, Number] | None = None) -> Number:
  """Value of an AST: exact Fraction while possible, float after irrationals; raises ParseError."""
  kind = node[0]
  if kind == "num":
    return node[1]
  if kind == "const":
    return node[1]
  if kind == "var":
    if env is None or node[1] not in env:
      raise ParseError(f"free variable {node[1]!r}")
    return env[node[1]]
  if kind == "neg":
    return -evaluate(node[1], env)
  if kind == "root":
    return _root(evaluate(node[1], env), node[2])
  a, b = evaluate(node[1], env), evaluate(node[2], env)
  if isinstance(a, float) or isinstance(b, float):
    a, b = _to_float(a), _to_float(b)
  if kind == "add":
    return _check(a + b)
  if kind == "sub":
    return _check(a - b)
  if kind == "mul":
    return _check(a * b)
  if kind == "div":
    if b == 0:
      raise ParseError("division by zero")
    return _check(a / b)
  if kind == "pow":
    return _pow(a, b)
  raise ParseError(f"unknown node {kind!r}")


def variables(node) -> set[str]:
  if node[0] == "var":
    return {node[1]}
  out: set[str] = set()
  for child in node[1:]:
    if isinstance(child, tuple):
      out |= variables(child)
  return out


def literals(node) -> list[str]:
  """The numeric literals of an AST as written, left to right (Countdown checks number usage)."""
  if node[0] == "num":
    return [node[2]]
  out: list[str] = []
  for child in node[1:]:
    if isinstance(child, tuple):
      out += literals(child)
  return out


# ---------------------------------------------------------------------------------------------
# Answer extraction

def last_boxed(text: str) -> str | None:
  """Content of the last `\\boxed{...}` / `\\fbox{...}` (brace-matched), or None. Linear time."""
  start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
  if start < 0:
    return None
  i = text.find("{", start)
  if i < 0:
    return None
  gap = text[start:i]
  if gap not in ("\\boxed", "\\fbox", "\\boxed ", "\\fbox "):
    # `\boxed 5` form: the rest of the token
    m = re.match(r"\\(?:boxed|fbox)\s+([^\s$]+)", text[start:start + MAX_ANSWER_CHARS])
    return m.group(1) if m else None
  depth = 0
  end = min(len(text), i + MAX_ANSWER_CHARS + 2)
  for j in range(i, end):
    c = text[j]
    if c == "{":
      depth += 1
    elif c == "}":
      depth -= 1
      if depth == 0:
        return text[i + 1:j]
  return None


_NUMBER_RE = re.compile(r"(?<![\w.])(?:(?<![\w)\]}])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+\b)?"
                        r"(?:\s*/\s*\d+(?:\.\d+)?)?")
_ANSWER_IS_RE = re.compile(r"answer(?:\s+is)?\s*[:：]|answer\s+is", re.IGNORECASE)


def last_number(text: str) -> str | None:
  """The last number in `text` (`-3`, `1,234.5`, `3/4`, `1.5e3`), or None."""
  last = None
  for last in _NUMBER_RE.finditer(text):
    pass
  return last.group() if last is not None else None


def extract_answer(response: str) -> str | None:
  """The final-answer candidate of a response (see the module docstring for the order), or None."""
  if not isinstance(response, str) or len(response) > MAX_RESPONSE_CHARS:
    return None
  if "\\boxed" in response or "\\fbox" in response:
    return last_boxed(response)  # None when malformed or too long: no fallback to other numbers
  i = response.rfind("####")
  if i >= 0:
    return response[i + 4:].strip().split("\n", 1)[0]
  last = None
  for last in _ANSWER_IS_RE.finditer(response):
    pass
  if last is not None:
    line = response[last.end():].strip().split("\n", 1)[0]
    parsed = _parse_answer(line)
    if parsed is not None and parsed[0] != "text":
      return line
    return last_number(line) or last_number(response)
  return last_number(response)


def extract_ground_truth(ground_truth: str) -> str:
  """A dataset label as stored: a bare answer, a GSM8K `... #### 42`, or a MATH solution with \\boxed."""
  boxed = last_boxed(ground_truth)
  if boxed is not None:
    return boxed
  i = ground_truth.rfind("####")
  return ground_truth[i + 4:].strip() if i >= 0 else ground_truth.strip()


# ---------------------------------------------------------------------------------------------
# Normalisation and comparison

_REMOVE = ("\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\ ", "\\quad", "\\qquad",
           "^\\circ", "^{\\circ}", "\\circ", "\\degree", "°", "\\%", "%", "\\$", "$", "{,}",
           "\\bigl", "\\bigr", "\\Bigl", "\\Bigr")
_TEXT_CMD_RE = re.compile(
    r"\\(?:text|textbf|textit|textrm|textnormal|mbox|mathrm|mathbf|mathit|operatorname)\s*\{([^{}]*)\}")
_THOUSANDS_RE = re.compile(r"\b\d{1,3}(?:,\d{3})+\b")
_TRAILING_WORDS_RE = re.compile(r"(?:\s+[A-Za-z]{2,}\.?)+\s*$")
_WORD_RE = re.compile(r"(?<!\\)\b[A-Za-z]{3,}")
_NAME_RE = re.compile(r"[A-Za-z](?:_\{?\w+\}?)?(?:\([A-Za-z]\))?")  # x, x_1, a_{n}, f(x)


def normalize(text: str) -> str:
  """Strip formatting that never changes an answer's value (see the module docstring)."""
  s = text.strip().replace("−", "-").replace("×", "*").replace("÷", "/").replace("·", "*")
  for _ in range(3):  # nested \text{\textbf{...}}; bounded
    s = _TEXT_CMD_RE.sub(lambda m: " " + m.group(1) + " ", s)
  for token in _REMOVE:
    s = s.replace(token, "" if token not in ("\\ ", "\\quad", "\\qquad") else " ")
  s = _THOUSANDS_RE.sub(lambda m: m.group().replace(",", ""), s)
  if "=" in s:
    *lhs, rhs = s.split("=")
    if all(_NAME_RE.fullmatch(part.strip()) or not re.search(r"[A-Za-z]", re.sub(r"\\[A-Za-z]+", "", part))
           for part in lhs):
      s = rhs  # "x = 5", "f(x) = 2x", "48+24 = 72" -> the right-hand side; "x^2+y^2=1" stays whole
  if "\\approx" in s:
    s = s.rsplit("\\approx", 1)[1]
  s = s.strip().rstrip(".;:").strip()
  if s and s[0].isdigit() or s[:1] in ("-", "\\", "(", "."):
    s = _TRAILING_WORDS_RE.sub("", s)
  return s.strip().rstrip(".").strip()


def _split_top_level(s: str) -> list[str] | None:
  """Split on commas outside any brackets; None if there are too many parts."""
  parts, depth, start = [], 0, 0
  for i, c in enumerate(s):
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
    elif c == "," and depth == 0:
      parts.append(s[start:i])
      start = i + 1
      if len(parts) > MAX_LIST_ITEMS:
        return None
  parts.append(s[start:])
  return parts


def _parse_answer(text: str):
  """("expr", ast) | ("tuple", open, [ast], close) | ("list", [ast]) | ("text", str) | None."""
  if not isinstance(text, str) or len(text) > MAX_ANSWER_CHARS:
    return None
  s = normalize(text)
  if not s:
    return None
  if _WORD_RE.search(s) is None:
    try:
      if s[0] in "([" and s[-1] in ")]":
        inner = _split_top_level(s[1:-1])
        if inner is not None and len(inner) > 1:
          return ("tuple", s[0], [parse(p) for p in inner], s[-1])
      parts = _split_top_level(s)
      if parts is not None and len(parts) > 1:
        return ("list", [parse(p) for p in parts])
      return ("expr", parse(s))
    except ParseError:
      pass
  text_norm = re.sub(r"\s+", "", s).lower()
  if re.fullmatch(r"\(?[a-z]\)?", text_norm):  # multiple choice: (C) == C
    text_norm = text_norm.strip("()")
  return ("text", text_norm)


def _close(a: Number, b: Number) -> bool:
  if isinstance(a, Fraction) and isinstance(b, Fraction):
    return a == b
  try:
    return math.isclose(float(a), float(b), rel_tol=REL_TOL, abs_tol=ABS_TOL)
  except OverflowError:
    return False


# Rational points at which expressions in variables are compared (exactly, while rational).
_POINTS = (Fraction(7, 3), Fraction(-5, 11), Fraction(13, 4), Fraction(29, 17))


def _expr_equal(a, b) -> bool:
  names = sorted(variables(a) | variables(b))
  if not names:
    try:
      return _close(evaluate(a), evaluate(b))
    except ParseError:
      return False
  checked = 0
  for k in range(len(_POINTS)):
    env = {name: _POINTS[(k + i) % len(_POINTS)] + i for i, name in enumerate(names)}
    try:
      va, vb = evaluate(a, env), evaluate(b, env)
    except ParseError:
      continue
    if not _close(va, vb):
      return False
    checked += 1
  return checked >= 2


def answers_equal(response_answer: str, ground_truth: str) -> bool:
  """Whether two extracted answers are mathematically the same (see the module docstring)."""
  a, b = _parse_answer(response_answer), _parse_answer(ground_truth)
  if a is None or b is None or a[0] != b[0]:
    return False
  kind = a[0]
  if kind == "text":
    return a[1] == b[1]
  if kind == "expr":
    return _expr_equal(a[1], b[1])
  if kind == "tuple":
    return (a[1], a[3]) == (b[1], b[3]) and len(a[2]) == len(b[2]) and all(
        _expr_equal(x, y) for x, y in zip(a[2], b[2]))
  # bare comma list: order-insensitive multiset match
  left, right = list(a[1]), list(b[1])
  if len(left) != len(right):
    return False
  for x in left:
    for j, y in enumerate(right):
      if _expr_equal(x, y):
        del right[j]
        break
    else:
      return False
  return True


def verify(response_text: str, ground_truth: str) -> float:
  """1.0 if the response's final answer equals the ground truth, else 0.0. Never raises on model text.

  ground_truth may be a bare answer ("42", "\\frac{1}{2}"), a GSM8K answer field ("... #### 42") or a
  MATH solution containing \\boxed{...}.
  """
  try:
    if not isinstance(response_text, str) or not isinstance(ground_truth, str):
      return 0.0
    answer = extract_answer(response_text)
    if answer is None:
      return 0.0
    return 1.0 if answers_equal(answer, extract_ground_truth(ground_truth)) else 0.0
  except (ParseError, RecursionError, ValueError, ZeroDivisionError, OverflowError, MemoryError):
    return 0.0
