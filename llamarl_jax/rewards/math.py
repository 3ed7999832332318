"""Math answer verification for GSM8K- and MATH-style problems, safe on untrusted model text.

`verify(response_text, ground_truth) -> 1.0 | 0.0`.

Model text is never evaluated as code: expressions go through the restricted grammar of
`rewards.math_expr` (hand-written tokenizer and parser, bounded exact arithmetic); every stage is
bounded up front, so any input returns within milliseconds; `RewardExecutor` adds a hard
per-sample timeout on top.

Final answer of a response (one answer, or none), read after the last `</think>` when there is one:
  1. the last `\\boxed{...}` / `\\fbox{...}` / `\\boxed 5`, together with the boxes just before it when
     only connectors separate them (`$\\boxed{2}$ and $\\boxed{3}$` is the set {2, 3}); a malformed or
     empty last box means no answer;
  2. else the text after the last `####` (GSM8K), to the end of the line;
  3. else the sentence after the last "answer is" / "answer:" / "Final Answer:" / "**Answer:**" (the
     next line when that line is empty), cut at the sentence end (Minerva's "$24$. I hope it is
     correct." gives 24); a sentence of words around exactly one number gives that number;
  4. else the last number of the text (or the `$...$` that contains it, or a `$...$` that ends the text
     after it, or the clock time `3:45 pm` or ratio `3:4` it ends), unless a qualifier or hedge surrounds
     it ("at least 5", "12 or more", "maybe 5", "5?").
Self-correction and spraying. Every box, `####` line and answer sentence is a stated answer; the last
stated answer counts. A withdrawal after the final answer ("wait", "no:", "wrong", "made a mistake",
"actually", "recheck", "just kidding", "on second thought", "never mind", ...) takes it back: the answer
is then the one stated after the withdrawal (a box, `####`, "the answer is", or a number or `$...$` ending
the response after a restating cue: "it's 9.", ", 9.", "= 15 apples"), and with none there is no answer
("\\boxed{7} Wait, I made an error."; "an error in step 2" restates nothing). Otherwise the final answer
counts only if (a) no different answer is stated after it, (b) every different earlier answer is withdrawn
before the final one ("\\boxed{3} is wrong, so \\boxed{4}" gives 4; "\\boxed{3}. Alternatively \\boxed{4}"
gives none), (c) a final answer withdrawn for a new one was not withdrawn before and stated again
(flip-flopping), and (d) at most
MAX_DISTINCT_ANSWERS different answers are stated in all (one answer and one correction: a third means
spraying, and none counts). Hedged answers ("5 or 6", "probably 6", "7, but it might be 8", `\\pm 3`
against 3) never equal a single answer. Sentences of words are not answers; a choice letter is.

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
decimal), trailing unit words ("5 apples", `12\\text{ cm}^2`), scale words (`2 million` is 2000000), JSON
doubling of backslashes (`\\\\frac` when no command has a single one), and a left-hand side that is a name
(`x =`, `f(x) =`, `(p, q) =`, `AB =`, `\\angle ABC =`, `AB:BC =`) or arithmetic.
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

import collections
import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from llamarl_jax.rewards.math_expr import (MAX_ANSWER_CHARS, MAX_BITS, MAX_DEPTH, MAX_TOKENS, Number, ParseError,
                                           evaluate, literals, parse, tokenize, variables)

MAX_RESPONSE_CHARS = 100_000   # longer responses score 0
MAX_LIST_ITEMS = 32            # elements of a tuple / set / matrix row
MAX_RUN_BOXES = 8              # boxes joined into one answer
MAX_STATEMENTS = 8             # answer statements of each kind (boxes, `####`, "answer is") checked for hedging
MAX_DISTINCT_ANSWERS = 2       # different answers a response may state: one answer and one self-correction
LONG_DECIMAL_PLACES = 10       # a decimal with this many places is a printout of a value, not a rounding
REL_TOL = 1e-9                 # float comparison once irrationals are involved
ABS_TOL = 1e-9

__all__ = ["Answer", "MAX_ANSWER_CHARS", "MAX_BITS", "MAX_DEPTH", "MAX_TOKENS", "Number", "ParseError",
           "answers_equal", "evaluate", "extract_answer", "extract_ground_truth", "last_boxed", "last_number",
           "literals", "parse", "parse_answer", "tokenize", "variables", "verify"]


# ---------------------------------------------------------------------------------------------
# Boxes

_BOX_CMD_RE = re.compile(r"\\(?:boxed|fbox)(\s*)")
# What may separate boxes that form one answer: `$\boxed{2}$ and $x = \boxed{3}$`, `\boxed{1}, \boxed{2}`.
_CONNECTOR_TAIL_RE = re.compile(
    r"(?:\s|\$|,|;|&|\\[()\[\]]|\\quad|\\text\{\s*(?:and|or)\s*\}|\b(?:and|or)\b|[A-Za-z]\s*=)*\Z")


def _last_box_start(text: str, end: int | None = None) -> int:
  end = len(text) if end is None else end
  return max(text.rfind("\\boxed", 0, end), text.rfind("\\fbox", 0, end))


def _box_at(text: str, start: int) -> tuple[str, int] | None:
  """(content, end) of the box command at `start`: brace-matched `\\boxed{...}` or `\\boxed 5`; None if malformed."""
  m = _BOX_CMD_RE.match(text, start)
  if m is None:
    return None
  i = m.end()
  if i < len(text) and text[i] == "{":
    depth = 0
    for j in range(i, min(len(text), i + MAX_ANSWER_CHARS + 2)):
      c = text[j]
      if c == "{":
        depth += 1
      elif c == "}":
        depth -= 1
        if depth == 0:
          return text[i + 1:j], j + 1
    return None
  if m.group(1):  # `\boxed 5`: the next token
    t = re.match(r"[^\s$}\\]{1,100}", text[i:i + 101])
    return (t.group(), i + t.end()) if t else None
  return None


def last_boxed(text: str) -> str | None:
  """Content of the last `\\boxed{...}` / `\\fbox{...}` / `\\boxed 5`, or None. Linear time."""
  start = _last_box_start(text)
  got = _box_at(text, start) if start >= 0 else None
  return got[0] if got else None


def _box_run(text: str) -> tuple[list[str], int, int] | None:
  """The last box and the boxes joined to it by connectors only: (contents, start, end), or None."""
  start = _last_box_start(text)
  got = _box_at(text, start) if start >= 0 else None
  if got is None:
    return None
  contents, end = [got[0]], got[1]
  while len(contents) < MAX_RUN_BOXES:
    tail = text[max(0, start - 64):start]
    prev_end = start - len(_CONNECTOR_TAIL_RE.search(tail).group())
    if prev_end <= 0 or text[prev_end - 1] != "}":
      break
    prev = _last_box_start(text, prev_end)
    got = _box_at(text, prev) if prev >= 0 else None
    if got is None or got[1] != prev_end:
      break
    contents.insert(0, got[0])
    start = prev
  return contents, start, end


# ---------------------------------------------------------------------------------------------
# Answer statements and the last number

_NUMBER_RE = re.compile(
    r"(?<![\w.])(?:(?<![\w)\]}])-)?"
    r"(?:(?<![,\d(\[{])(?:\d+,\d{1,2}|0,\d+|\d{4,},\d+)(?![\d,])"  # decimal commas: 2,5  0,111  1000,99
    r"|[1-9]\d{0,2}(?:,\d{3})+|\d{1,3}(?: \d{3})+(?![\d.,])|\d+|(?=\.\d))"  # 1,000  10 000  12  .5
    r"(?:\.\d+)?(?:[eE][-+]?\d+\b)?(?:\s*/\s*\d+(?:\.\d+)?)?")
# A clock time: `3:45`, `15:45:10`, `3:45 pm`, `3:45 p.m.`, `3 pm` (hours 0-23, minutes and seconds 00-59).
_MERIDIEM = r"(?:\s*([AaPp])\.?\s?[Mm]\b\.?)"
_CLOCK_RE = re.compile(rf"(?<![\d:.,])(\d{{1,2}}):([0-5]\d)(?::([0-5]\d))?(?![\d:]){_MERIDIEM}?"
                       rf"|(?<![\d:.,])(\d{{1,2}}){_MERIDIEM}")
_COLON_RUN_RE = re.compile(r"(?<![\w:.,])\d+(?::\d+)+(?![\d:])")  # 3:4, 1:2:3: a ratio written in the text


def _around(pattern: re.Pattern, text: str, start: int, stop: int) -> re.Match | None:
  """A match of `pattern` that covers text[start:stop] (e.g. the clock time `3:45 pm` around the number 45)."""
  for m in pattern.finditer(text, max(0, start - 8), min(len(text), stop + 8)):
    if m.start() <= start and m.end() >= stop:
      return m
  return None


_ANSWER_RE = re.compile(r"\b(?:final\s+answer|answer)(?:\s*\*\*)?\s*(?:is\b|[:：])", re.IGNORECASE)
_SENTENCE_END_RE = re.compile(r"\.(?=\s|$)|[!?](?=\s|$)|\bI hope\b|,\s+(?!(?:and|or)\b)(?=[A-Za-z]{2,})"
                              r"|\s(?:because|since|which|where|as|so|given|when)\b")
_MATH_SEGMENT_RE = re.compile(r"\$\$([^$]{1,1000})\$\$|\$([^$]{1,1000})\$|\\\((.{1,1000}?)\\\)|\\\[(.{1,1000}?)\\\]",
                              re.DOTALL)
# A number qualified by these is a bound, not the number: "at least 5", "12 or more", "over 50".
_QUALIFIER_RE = re.compile(
    r"\b(?:at\s+(?:least|most)|or\s+(?:more|less|fewer|greater|higher|lower|above|below|under|over)|"
    r"(?:more|less|fewer|greater|smaller|larger|higher|lower)\s+than|no\s+(?:more|less|fewer)|up\s+to|"
    r"over|under|above|below|nearly|almost|minimum|maximum|exceed\w*|not|never|cannot|isn't|"
    r"maybe|perhaps|probably|possibly|likely|might|guess|unsure|could\s+be)\b", re.IGNORECASE)
_HEDGE_RE = re.compile(r"\b(?:maybe|perhaps|probably|possibly|might|could\s+be|not\s+sure|unsure)\b", re.IGNORECASE)
_QUALIFIER_BEFORE_RE = re.compile(
    r"(?:\b(?:at\s+(?:least|most)|(?:more|less|fewer|greater|smaller|larger|higher|lower)\s+than|no\s+(?:more|less|"
    r"fewer)|up\s+to|over|under|above|below|nearly|almost|not|never|or|either|maybe|perhaps|probably|possibly|"
    r"(?:might|could)\s+be)|[<>≤≥]=?|\\[lg]e(?:q)?)\s*\$?\s*\Z",
    re.IGNORECASE)
_QUALIFIER_AFTER_RE = re.compile(r"\s*(?:\+|\?|or\b|I\s+(?:guess|think)|maybe|perhaps|probably)", re.IGNORECASE)


def last_number(text: str) -> str | None:
  """The last number in `text` (`-3`, `1,234.5`, `3/4`, `1.5e3`), or None. Reads only the text near the
  last digit (numbers longer than that window fail to parse anyway), so its cost is the length of a scan."""
  end = max(text.rfind(d) for d in "0123456789")
  if end < 0:
    return None
  last = None
  for last in _NUMBER_RE.finditer(text, max(0, end - 2 * MAX_ANSWER_CHARS), end + 2):
    pass
  return last.group() if last is not None else None


def _sentence(text: str) -> tuple[str, str]:
  """(answer sentence, its whole line) of the text after an answer marker (the next line if this one is empty)."""
  text = text[:2 * MAX_ANSWER_CHARS].lstrip(" \t*:：")
  line, _, rest = text.partition("\n")
  if not line.strip(" *$"):
    line = next((ln for ln in rest.split("\n")[:4] if ln.strip()), "")
  line = line.strip().strip("*").strip()
  m = _SENTENCE_END_RE.search(line)
  return (line[:m.start()] if m else line).strip().strip("*").strip(), line


def _single_number(line: str) -> str | None:
  """The one number of a line of words ("Janet makes $18 every day."), unless qualified or hedged."""
  clocks = list(_CLOCK_RE.finditer(line))
  if len(clocks) == 1 and len(_NUMBER_RE.findall(line)) == len(_NUMBER_RE.findall(clocks[0].group())) and \
     not _QUALIFIER_RE.search(line) and not re.search(r"\b(?:or|and|but|wait)\b", line):
    return clocks[0].group().strip()  # "The meeting starts at 3:45 pm."
  numbers = _NUMBER_RE.findall(line)
  if len(numbers) != 1 or _QUALIFIER_RE.search(line) or re.search(r"\b(?:or|and|but|wait)\b", line):
    return None
  return numbers[0]


_SCALE_AFTER_RE = re.compile(r"\s*(?:thousand|million|billion|trillion)s?\b", re.IGNORECASE)
_END_RE = re.compile(r"[\s.!]*\Z")


def _fallback(response: str) -> str | None:
  """No marked answer: the last number (or the last `$...$` that contains it, or a `$...$` that ends the
  text after it), unless qualified or hedged."""
  tail_start = max(0, len(response) - 4 * MAX_ANSWER_CHARS)
  tail = response[tail_start:]
  last = None
  for last in _NUMBER_RE.finditer(tail):
    pass
  segment = None
  for segment in _MATH_SEGMENT_RE.finditer(tail):
    pass
  if segment is not None and (last is None or segment.start() <= last.start() < segment.end() or
                              (segment.start() >= last.end() and _END_RE.match(tail, segment.end()))):
    return next(g for g in segment.groups() if g is not None)
  if last is None:
    return last_number(response[:tail_start]) if tail_start else None
  run = _around(_CLOCK_RE, tail, last.start(), last.end()) or _around(_COLON_RUN_RE, tail, last.start(), last.end())
  if run is not None:  # "at 3:45 pm", "a ratio of 3:4": the time or ratio, not its last number
    if _QUALIFIER_BEFORE_RE.search(tail[max(0, run.start() - 24):run.start()]) or \
       _QUALIFIER_AFTER_RE.match(tail, run.end()):
      return None
    return run.group().strip()
  if _QUALIFIER_BEFORE_RE.search(tail[max(0, last.start() - 24):last.start()]) or \
     _QUALIFIER_AFTER_RE.match(tail, last.end()):
    return None
  scale = _SCALE_AFTER_RE.match(tail, last.end())
  return last.group() + scale.group() if scale else last.group()


@dataclass(frozen=True)
class _Statement:
  start: int
  end: int
  text: str


# Words that withdraw an earlier answer: "no wait", "that is wrong", "let me recheck", "just kidding".
_RETRACTION_RE = re.compile(
    r"\b(?:wait|wrong|incorrect|mistaken|oops|actually|correction|corrected|re-?check\w*|double[- ]check\w*|"
    r"reconsider\w*|recalculat\w*|recomput\w*|re-?evaluat\w*|scratch\s+that|redo|just\s+kidding|j/?k|"
    r"on\s+second\s+thought|second\s+thoughts|never\s*mind|take\s+(?:that|it)\s+back|hold\s+on|"
    r"not\s+(?:right|correct)|(?:made|make|found|there\s+(?:is|was))\s+an?\s+"
    r"(?:\w+\s+)?(?:error|mistake)|my\s+(?:\w+\s+)?(?:error|mistake))\b|\bno\s*[,:;.!]", re.IGNORECASE)
# What introduces a number restated after a withdrawal: "Just kidding, it's 9", "On second thought, 9",
# "the total is 15", "= 15". A number after anything else ("an error in step 2") is not an answer.
_RESTATE_CUE_RE = re.compile(
    r"(?:\bit['’]?s|\bit\s+(?:is|was|should\s+be|must\s+be|would\s+be)|\bis|\bbe|\bequals?|\bget|\bgives?|"
    r"\bmakes?|\bthat['’]?s|\bso|\btherefore|\bthus|\bhence|=|:|,|;|\.|!|\A)(?:\s|\*\*|\$|\\\(|\\\[)*\Z",
    re.IGNORECASE)
# What may follow it to the end of the response: closing math, up to three words (units), punctuation, and
# a confirmation ("Yes.", "That's correct.", "✓").
_RESTATE_TAIL_RE = re.compile(
    r"(?:\s|\*\*|\$|\\\)|\\\])*(?:[A-Za-z%°]+[\s.,!]*){0,3}[\s.!]*"
    r"(?:(?:yes|yep|right|correct|confirmed|(?:so\s+)?(?:that|this|it)['’]?s?\s+(?:is\s+)?(?:right|correct))"
    r"(?:[\s,]+(?:that|this|it)['’]?s?\s+(?:is\s+)?(?:right|correct))?[\s.!]*|[✓✔]\s*)?\Z", re.IGNORECASE)
MAX_RESTATEMENT_DEPTH = 4  # withdrawals followed through, each reading the text after the previous one
_CHOICE_RE = re.compile(r"[a-e]")  # a multiple-choice letter, the one text answer that counts as stated
_DOUBLED_RE = re.compile(r"\\\\(?=[A-Za-z])")
_SINGLE_CMD_RE = re.compile(r"(?<!\\)\\[A-Za-z]")


def _undouble(text: str) -> str:
  """JSON-escaped LaTeX (`\\\\boxed{\\\\frac{1}{2}}`) as written: every `\\\\` halved, when no command has one backslash."""
  if "\\\\" in text and _DOUBLED_RE.search(text) and not _SINGLE_CMD_RE.search(text):
    return text.replace("\\\\", "\\")
  return text


def _earlier_boxes(text: str, end: int) -> list[_Statement]:
  """The last MAX_STATEMENTS well-formed boxes that end before `end`, one statement each."""
  out: list[_Statement] = []
  while len(out) < MAX_STATEMENTS:
    start = _last_box_start(text, end)
    got = _box_at(text, start) if start >= 0 else None
    if got is None:
      break
    out.append(_Statement(start, got[1], got[0]))
    end = start
  return out


def _statements(response: str) -> tuple[_Statement | None, list[_Statement], list[_Statement], list[_Statement]]:
  """The last box run, the boxes before it, the `####` lines and the answer-is sentences (the last
  MAX_STATEMENTS of each kind)."""
  run, boxes = None, []
  if "\\boxed" in response or "\\fbox" in response:
    got = _box_run(response)
    if got is None:
      run = _Statement(-1, -1, "")  # a malformed last box: no answer
    else:
      contents, start, end = got
      run = _Statement(start, end, " or ".join(contents)) if all(c.strip() for c in contents) else \
          _Statement(-1, -1, "")  # an empty box: no answer
      boxes = _earlier_boxes(response, start)
  hashes = collections.deque(maxlen=MAX_STATEMENTS)
  i = response.find("####")
  while i >= 0:
    line_end = response.find("\n", i)
    line_end = len(response) if line_end < 0 else line_end
    hashes.append(_Statement(i, line_end, response[i + 4:line_end].strip()))
    i = response.find("####", line_end)
  said = collections.deque(maxlen=MAX_STATEMENTS)
  for m in _ANSWER_RE.finditer(response):
    said.append(m)
  answers = []
  said = list(said)
  for k, m in enumerate(said):
    if k + 1 < len(said) and said[k + 1].start() - m.end() < 40 and \
       not re.search(r"\d|\n|[.!?]\s", response[m.end():said[k + 1].start()]):
      continue  # "Final Answer: The final answer is $24$": the inner marker states it
    sentence, line = _sentence(response[m.end():])
    if "\\boxed" in sentence or "\\fbox" in sentence:
      continue  # "The final answer is $\\boxed{5}$": the box is the statement
    if _HEDGE_RE.search(line):
      sentence = line  # "7, but it might be 8": the answer line hedges
    parsed = parse_answer(sentence)
    if parsed is not None and parsed.kind == "text":
      sentence = _single_number(line) or sentence
    answers.append(_Statement(m.start(), m.end(), sentence))
  return run, boxes, list(hashes), answers


def _restated(tail: str, depth: int) -> str | None:
  """The answer stated in `tail`, the text after a withdrawal: its own stated answer (a box, `####`, "the
  answer is"; withdrawals in it followed in turn), else a number (or `$...$`) that ends it and follows a
  restating cue ("it's 9.", ", 9.", "= 15 apples."), unless qualified or hedged; None if neither."""
  if depth >= MAX_RESTATEMENT_DEPTH:
    return None
  run, _, hashes, said = _statements(tail)
  if run is not None or hashes or said:
    return extract_answer(tail, _depth=depth + 1)
  end = len(tail.rstrip())
  last = None
  for last in _NUMBER_RE.finditer(tail, max(0, end - 4 * MAX_ANSWER_CHARS)):
    pass
  if last is None:
    return None
  start, stop, text = last.start(), last.end(), last.group()
  clock = _around(_CLOCK_RE, tail, start, stop) or _around(_COLON_RUN_RE, tail, start, stop)
  for segment in _MATH_SEGMENT_RE.finditer(tail, max(0, start - MAX_ANSWER_CHARS)):
    if segment.start() <= start < segment.end():
      start, stop, text = segment.start(), segment.end(), next(g for g in segment.groups() if g is not None)
  if clock is not None and clock.end() >= stop:
    start, stop, text = clock.start(), clock.end(), clock.group().strip()
  if not _RESTATE_CUE_RE.search(tail, max(0, start - 40), start) or not _RESTATE_TAIL_RE.match(tail, stop) or \
     _QUALIFIER_BEFORE_RE.search(tail[max(0, start - 24):start]) or _QUALIFIER_AFTER_RE.match(tail, stop) or \
     _HEDGE_RE.search(tail[max(0, start - 80):]):
    return None
  return text


def extract_answer(response: str, *, _depth: int = 0) -> str | None:
  """The final-answer text of a response (see the module docstring), or None (none, malformed, hedged)."""
  if not isinstance(response, str) or len(response) > MAX_RESPONSE_CHARS:
    return None
  depth = _depth
  response = _undouble(response)
  think = response.rfind("</think>")
  if think >= 0:
    response = response[think + len("</think>"):]
  run, boxes, hashes, said = _statements(response)
  if run is not None:
    if run.start < 0:
      return None
    final = run
  elif hashes:
    final = hashes[-1]
  elif said:
    final = said[-1]
  else:
    return _fallback(response)
  withdrawn = _RETRACTION_RE.search(response, final.end)
  if withdrawn is not None:  # "The answer is 7. Just kidding, it's 9.": the answer restated after it counts
    restated = _restated(response[withdrawn.end():], depth)
    if restated is None:
      return None  # "\\boxed{7} Wait, I made an error.": withdrawn, and no new answer
    if not answers_equal(restated, final.text):
      mine = parse_answer(final.text)
      earlier = sorted((s for s in boxes + hashes + said if s.end <= final.start), key=lambda s: -s.start)
      again = next((s for s in earlier if mine is not None and (o := parse_answer(s.text)) is not None
                    and _equal(mine, o)), None)
      if again is not None and _RETRACTION_RE.search(response, again.end, final.start):
        return None  # "7. Wait, no: 8. The answer is 7. Wait, no: 8.": answers flip-flopped
      stated = [parse_answer(restated)]
      for s in boxes + hashes + said + [final]:
        other = parse_answer(s.text)
        if other is not None and (other.kind != "text" or _CHOICE_RE.fullmatch(other.value)) and \
           not any(x is not None and _equal(other, x) for x in stated):
          stated.append(other)
      return restated if len(stated) <= MAX_DISTINCT_ANSWERS else None
  others = [s for s in boxes + hashes + said
            if s is not final and not (s.start < final.end and s.end > final.start) and "\\boxed" not in s.text
            and "\\fbox" not in s.text]
  if not others:
    return final.text
  mine = parse_answer(final.text)
  stated = [mine] if mine is not None else []
  last_withdrawn = -1
  for s in others:
    other = parse_answer(s.text)
    if other is None or (other.kind == "text" and not _CHOICE_RE.fullmatch(other.value)) or \
       (mine is not None and _equal(mine, other)):
      continue  # not an answer (a sentence of words), or the final answer again
    if s.start >= final.end:
      return None  # a different answer stated after the final one: hedged
    if not any(_equal(other, x) for x in stated):
      stated.append(other)
      if len(stated) > MAX_DISTINCT_ANSWERS:
        return None  # answers sprayed: several different ones stated
    last_withdrawn = max(last_withdrawn, s.end)
  if last_withdrawn >= 0 and not _RETRACTION_RE.search(response, last_withdrawn, final.start):
    return None  # a different earlier answer never withdrawn: two answers
  return final.text


def extract_ground_truth(ground_truth: str) -> str:
  """A dataset label as stored: a bare answer, a GSM8K `... #### 42`, or a MATH solution with \\boxed."""
  run = _box_run(ground_truth)
  if run is not None:
    return " or ".join(run[0])
  i = ground_truth.rfind("####")
  return ground_truth[i + 4:].strip() if i >= 0 else ground_truth.strip()


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
      if not any(_equal(c, u) for u in unique):
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


def _intervals(spans: list[tuple[Number, bool, Number, bool]]) -> Answer | None:
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
  return _intervals([(lo, s[0] == "[", hi, s[-1] == "]")])


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
  return _intervals([(lo, lo_c, hi, hi_c)])


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
    return _intervals(common) if common else _text(s)
  union = _intervals(spans)
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
  with hours 0-23. Text where the hour is out of range (`13:00 pm`, `25:30` never matches _CLOCK_RE)."""
  if m.group(5) is not None:
    hour, minute, second, meridiem = int(m.group(5)), 0, 0, m.group(6).lower()
  else:
    hour, minute, second = int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
    meridiem = m.group(4).lower() if m.group(4) else None
  if hour > (12 if meridiem else 23) or (meridiem and hour == 0):
    return _text(m.group())
  return Answer("time", (hour, minute, second, meridiem))


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
  if depth > 3 or _QUALIFIER_RE.search(s):
    return _text(s)
  matrix = _matrix(s)
  if matrix is not None:
    return matrix
  builder = _SET_BUILDER_RE.fullmatch(s)
  if builder is not None:  # \{x : -1 \le x \le 1\}: the condition's solution set
    inner = _parse(builder.group(1), depth + 1)
    return inner if inner is not None and inner.kind == "intervals" else _text(s)
  s = _strip_units(s)
  clock = _CLOCK_RE.fullmatch(s)
  if clock is not None:
    return _clock(clock)
  if "\\pm" in s:  # x = \pm 2, 1 \pm \sqrt{2}: two answers
    items = [_parse(s.replace("\\pm", sign), depth + 1) for sign in ("+", "-")] if s.count("\\pm") == 1 else [None]
    return _set(items) if all(i is not None and i.kind != "text" for i in items) else _text(s)
  if _REALS_RE.fullmatch(s):
    return _intervals([(-math.inf, False, math.inf, False)])
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
    return _intervals([(-math.inf, False, math.inf, False)])
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
    return _intervals(spans)
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


# ---------------------------------------------------------------------------------------------
# Comparison

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
    return _intervals([(lo, False, hi, False)])
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


def _equal(a: Answer, b: Answer) -> bool:
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
      j = next((j for j, y in enumerate(right) if _equal(x, y)), None)
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


def answers_equal(response_answer: str, ground_truth: str) -> bool:
  """Whether two extracted answers are mathematically the same (see the module docstring)."""
  a, b = parse_answer(response_answer), parse_answer(ground_truth)
  return a is not None and b is not None and _equal(a, b)


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
