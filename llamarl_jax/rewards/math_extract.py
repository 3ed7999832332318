"""The final answer of a model response, as text for `rewards.math_parse`: one answer, or none.

Read after the last `</think>` when there is one, with JSON doubling of backslashes undone
(`\\\\frac` when no command has a single one):
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
"""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass

from llamarl_jax.rewards.math_compare import equal
from llamarl_jax.rewards.math_expr import MAX_ANSWER_CHARS
from llamarl_jax.rewards.math_parse import CLOCK_RE, QUALIFIER_RE, answers_equal, parse_answer

MAX_RESPONSE_CHARS = 100_000   # longer responses score 0
MAX_RUN_BOXES = 8              # boxes joined into one answer
MAX_STATEMENTS = 8             # answer statements of each kind (boxes, `####`, "answer is") checked for hedging
MAX_DISTINCT_ANSWERS = 2       # different answers a response may state: one answer and one self-correction


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


def box_run(text: str) -> tuple[list[str], int, int] | None:
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
  clocks = list(CLOCK_RE.finditer(line))
  if len(clocks) == 1 and len(_NUMBER_RE.findall(line)) == len(_NUMBER_RE.findall(clocks[0].group())) and \
     not QUALIFIER_RE.search(line) and not re.search(r"\b(?:or|and|but|wait)\b", line):
    return clocks[0].group().strip()  # "The meeting starts at 3:45 pm."
  numbers = _NUMBER_RE.findall(line)
  if len(numbers) != 1 or QUALIFIER_RE.search(line) or re.search(r"\b(?:or|and|but|wait)\b", line):
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
  run = _around(CLOCK_RE, tail, last.start(), last.end()) or _around(_COLON_RUN_RE, tail, last.start(), last.end())
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
    got = box_run(response)
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
  clock = _around(CLOCK_RE, tail, start, stop) or _around(_COLON_RUN_RE, tail, start, stop)
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
                    and equal(mine, o)), None)
      if again is not None and _RETRACTION_RE.search(response, again.end, final.start):
        return None  # "7. Wait, no: 8. The answer is 7. Wait, no: 8.": answers flip-flopped
      stated = [parse_answer(restated)]
      for s in boxes + hashes + said + [final]:
        other = parse_answer(s.text)
        if other is not None and (other.kind != "text" or _CHOICE_RE.fullmatch(other.value)) and \
           not any(x is not None and equal(other, x) for x in stated):
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
       (mine is not None and equal(mine, other)):
      continue  # not an answer (a sentence of words), or the final answer again
    if s.start >= final.end:
      return None  # a different answer stated after the final one: hedged
    if not any(equal(other, x) for x in stated):
      stated.append(other)
      if len(stated) > MAX_DISTINCT_ANSWERS:
        return None  # answers sprayed: several different ones stated
    last_withdrawn = max(last_withdrawn, s.end)
  if last_withdrawn >= 0 and not _RETRACTION_RE.search(response, last_withdrawn, final.start):
    return None  # a different earlier answer never withdrawn: two answers
  return final.text
