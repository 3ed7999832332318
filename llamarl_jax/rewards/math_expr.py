"""The restricted expression grammar of the math verifier: tokenizer, parser, bounded exact evaluation.

Model text is never evaluated as code (no `eval`, `exec`, `sympify`, `parse_expr`): an expression is
tokenized by one regular expression, parsed by a small recursive-descent parser into an AST of
tuples, and evaluated to exact `fractions.Fraction` (or `float` once an irrational appears). Every
stage is bounded up front (length, tokens, nesting depth, digits per literal, bits per intermediate
value, exponent size), so any input costs well under a few milliseconds.

Grammar: numbers, single-letter variables, `+ - * / ^` (and `**`, `\\cdot`, `\\times`, `\\div`),
parentheses/braces, `\\frac` (`\\dfrac`, `\\tfrac`, `\\cfrac`), `\\sqrt`, `\\sqrt[n]`, `\\pi`, and the
functions `\\sin \\cos \\tan \\sec \\csc \\cot \\arcsin \\arccos \\arctan \\ln \\log \\exp` (with or
without the backslash). A function's argument is a bracketed group or, as TeX reads `\\sin 2x`, the
factors up to the next operator; `\\sin^2 x` is (sin x)^2, `\\sin^{-1} x` is arcsin x, `\\log` is natural
and `\\log_b x` has base b. Implicit multiplication is read only where
it is unambiguous algebra (`2x`, `3\\sqrt{2}`, `2(x+1)`, `xy`), never when the right factor starts with
a number: `2 3` is an error, not 6. An integer followed by a proper fraction of integers is a mixed
number: `4\\frac{4}{9}` and `3 1/2` are 40/9 and 7/2, not products.

AST nodes: ("num", Fraction, literal) ("const", float) ("var", name) ("neg", a) ("root", a, n)
("fn", name, a) ("add"|"sub"|"mul"|"div"|"pow", a, b).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Union

MAX_ANSWER_CHARS = 1_000       # one expression
MAX_TOKENS = 256               # tokens in one expression
MAX_DEPTH = 48                 # nesting of parentheses / \frac / \sqrt / unary signs
MAX_NUMBER_DIGITS = 100        # digits in one numeric literal
MAX_BITS = 8_192               # numerator/denominator bits of any intermediate exact value
MAX_EXPONENT = 10_000          # |integer exponent| for exact powers
MAX_ROOT_DEGREE = 64           # n in \sqrt[n]{.}
MAX_DECIMAL_EXPONENT = 2_000   # |e| in a literal such as 1.5e3

Number = Union[Fraction, float]


class ParseError(ValueError):
  """The text is not an expression of the restricted grammar, or it exceeds a bound."""


# ---------------------------------------------------------------------------------------------
# Tokenizer

_TOKEN_RE = re.compile(r"""
    (?P<ws>\s+)
  | (?P<num>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)
  | (?P<cmd>\\[A-Za-z]+)
  | (?P<fn>(?:arc)?(?:sin|cos|tan|sec|csc|cot)|ln|log|exp)(?![A-Za-z])
  | (?P<var>[A-Za-z])
  | (?P<pow>\*\*)
  | (?P<op>[-+*/^(){}\[\],_])
""", re.VERBOSE)

_CONSTANTS = {"pi": math.pi}
_GREEK = {"alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "theta", "vartheta", "lambda", "mu", "nu",
          "rho", "sigma", "tau", "phi", "varphi", "psi", "omega"}  # variables, like single letters
_COMMAND_OPS = {"cdot": "*", "times": "*", "div": "/", "ast": "*"}
_LATEX_DIGIT_ARGS = {"frac": 2, "sqrt": 1}  # \frac12 == \frac{1}{2}, \sqrt2 == \sqrt{2}
_FUNCTIONS = {"sin": math.sin, "cos": math.cos, "tan": math.tan, "sec": lambda x: 1 / math.cos(x),
              "csc": lambda x: 1 / math.sin(x), "cot": lambda x: 1 / math.tan(x), "arcsin": math.asin,
              "arccos": math.acos, "arctan": math.atan, "ln": math.log, "log": math.log, "exp": math.exp}
_INVERSE = {"sin": "arcsin", "cos": "arccos", "tan": "arctan"}  # \sin^{-1} x


def tokenize(text: str) -> list[tuple[str, str]]:
  """[(kind, value)] with kind in num/cmd/var/op; raises ParseError on anything else or too long.

  A run of digits right after `\\frac` / `\\sqrt` is split into one-digit arguments, as TeX reads it.
  """
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
      if tokens and tokens[-1][0] == "cmd" and tokens[-1][1] in _LATEX_DIGIT_ARGS and value.isdigit():
        n = _LATEX_DIGIT_ARGS[tokens[-1][1]]
        tokens += [("num", d) for d in value[:n]]
        value = value[n:]
        if not value:
          continue
    elif kind == "fn":
      kind = "cmd"
    elif kind == "cmd":
      value = value[1:]
      if value in _COMMAND_OPS:
        kind, value = "op", _COMMAND_OPS[value]
      elif value in _GREEK:
        kind = "var"
      elif value in ("dfrac", "tfrac", "cfrac"):
        value = "frac"
    elif kind == "pow":
      kind, value = "op", "^"
    tokens.append((kind, value))
    if len(tokens) > MAX_TOKENS:
      raise ParseError(f"more than {MAX_TOKENS} tokens")
  return tokens


# ---------------------------------------------------------------------------------------------
# Parser: tokens -> AST

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
    self.implicit_mul = implicit_mul  # also enables mixed numbers: both read juxtaposition
    self.allow_pow = allow_pow
    self.allow_unary = allow_unary
    self.allow_latex = allow_latex

  def peek(self, ahead: int = 0):
    i = self.pos + ahead
    return self.tokens[i] if i < len(self.tokens) else (None, None)

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

  def _starts_implicit_factor(self) -> bool:
    """Whether the next token can be the right factor of an implicit product: never a number."""
    kind, v = self.peek()
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
      elif self.implicit_mul and self._starts_implicit_factor():
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
    """A LaTeX argument: `{expr}`, one digit (the tokenizer splits `\\frac12`), a variable or a command atom."""
    return self.atom()

  def _integer_arg(self) -> int | None:
    """A `\\frac` argument that is a plain integer (`{4}` or `4`); consumes it, or returns None untouched."""
    start = self.pos
    braced = self.peek() == ("op", "{")
    if braced:
      self.pos += 1
    kind, v = self.peek()
    if kind == "num" and v.isdigit():
      self.pos += 1
      if not braced or self.peek() == ("op", "}"):
        self.pos += braced
        return int(v)
    self.pos = start
    return None

  def _mixed_fraction(self) -> Fraction | None:
    """After an integer: a proper fraction of integers (`\\frac{4}{9}`, ` 1/2`), consumed, or None untouched."""
    start = self.pos
    if self.peek() == ("cmd", "frac") and self.allow_latex:
      self.pos += 1
      p = self._integer_arg()
      q = self._integer_arg() if p is not None else None
    elif self.peek()[0] == "num" and self.peek()[1].isdigit() and self.peek(1) == ("op", "/"):
      p, q = int(self.take()[1]), None
      self.take()
      kind, v = self.peek()
      if kind == "num" and v.isdigit() and self.peek(1) not in (("op", "^"), ("cmd", "frac")):
        q = int(self.take()[1])
    else:
      return None
    if p is not None and q is not None and 0 < p < q:
      return Fraction(p, q)
    self.pos = start
    return None

  def function(self, name: str):
    """`\\sin x`, `\\sin(2x)`, `\\sin^2 x`, `\\sin^{-1} x`, `\\log_2 8`: after the function's name."""
    self.enter()
    base = None
    if name == "log" and self.peek() == ("op", "_"):
      self.take()
      base = self.atom()
    power = None
    if self.peek() == ("op", "^"):
      self.take()
      power = self.unary()
      if power == ("neg", ("num", Fraction(1), "1")) and name in _INVERSE:
        name, power = _INVERSE[name], None
    if self.peek() in (("op", "("), ("op", "{")):
      arg = self.atom()
    else:  # TeX's reading: \sin 2x is sin(2x), \sin x \cos x is a product of two functions
      arg = self.power()
      while self.peek()[0] == "var" and self.allow_vars:
        arg = ("mul", arg, self.power())
    node = ("fn", name, arg)
    if base is not None:
      node = ("div", node, ("fn", "log", base))
    if power is not None:
      node = ("pow", node, power)
    self.depth -= 1
    return node

  def atom(self):
    kind, v = self.take()
    if kind == "num":
      value = _literal(v)
      if self.implicit_mul and v.isdigit():
        fraction = self._mixed_fraction()
        if fraction is not None:
          return ("num", value + fraction, f"{v} {fraction}")
      return ("num", value, v)
    if kind == "var":
      if not self.allow_vars:
        raise ParseError(f"variable {v!r} not allowed")
      return ("const", math.e) if v == "e" else ("var", v)
    if kind == "op" and v in ("(", "{"):
      self.enter()
      node = self.expr()
      self.expect(")" if v == "(" else "}")
      self.depth -= 1
      return node
    if kind == "cmd" and self.allow_latex:
      if v in _CONSTANTS:
        return ("const", _CONSTANTS[v])
      if v in _FUNCTIONS:
        return self.function(v)
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

  Never evaluates anything; `evaluate` does, with bounded exact arithmetic. `implicit_mul=False` also
  turns off mixed numbers (strict grammars such as Countdown's read no juxtaposition at all).
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
  if kind == "fn":
    x = _to_float(evaluate(node[2], env))
    try:
      return _check(float(_FUNCTIONS[node[1]](x)))
    except (ValueError, OverflowError, ZeroDivisionError) as err:
      raise ParseError(f"{node[1]}({x}) is undefined: {err}") from err
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
