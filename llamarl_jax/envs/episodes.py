"""The one rollout path: prompts -> episodes -> one `RolloutBatch` for the trainer.

`run_episodes(generate, env, examples, prompts, sampling, ...)`:

  turn 1   `generate(prompts, sampling)`: the n samples of every prompt (one `Sampler.generate` call).
           With `SingleTurn` that is the whole rollout: the batch is returned as it came (a single-turn
           run is exactly one sampler call per batch).
  then     each finished turn goes to `env.step` on the tool threads (`ToolSteps`; never on the
           generator's thread); an observation is tokenized (at most `max_observation_tokens`) and
           appended to the row's response with mask 0; rows that go on are re-prefilled with their
           whole context (prompt + turns + observations) and sample their next turn, all together in
           one `generate` call (n = 1, the batch padded to a power-of-two fraction of the rows so
           that few shapes compile; seed `turn_seed(seed, t)`). Until every episode is over, at
           `env.max_turns` turns or when a response reaches `response_width` tokens.

The batch: response_tokens `[B, response_width]` hold each episode's turns and observations in order;
response_mask is 1 on the model's tokens (stop tokens included) and 0 on observations and padding,
so observations carry no loss, no advantage and no importance ratio (every loss reads the mask), and
the trainer still sees them as context (its layout keeps every token up to a row's last model token).
behaviour_logprobs are the sampler's, of each model token under the distribution it was sampled
from given the whole context so far (0 on observations); token_versions the version that sampled each
model token (an observation: its turn's; policy_version is the row's first token's, what the lag bound
limits); lengths the tokens used (model + observation); finish_reason LENGTH when the budget cut an
episode or its last turn hit max_new_tokens (both counted in `episode/frac_cut`). The slot engine
builds the same batch (`EpisodeRows`), each row's later turns re-prefilled into a free slot by the
generator executor; an episode whose context (its next turn's prompt) outgrows the longest prompt the
engine takes (`max_context`) ends there, cut, like one that filled its budget.

Failures. A tool's failure (the model's malformed call, an unknown tool, the tool's own error or
timeout, hostile code) is the environment's business: it comes back as an observation with its
`ToolCall` status, the episode goes on, and the metrics count it. An exception out of `env.step`, or a
step still running `EnvConfig.step_limit_s` after it started, is a bug in the environment: it raises
`EnvironmentFailed` (chained to the step's own exception and traceback) and the run stops, so no
episode is trained on a turn its environment failed to answer. Tools enforce their own time limits
(the sandbox kills a call at `tool_timeout_s`; the calculator's input is bounded), so a correct
environment's step always returns within the limit and never leaves a tool thread busy after it.

Re-prefill versus extending the row's KV cache: re-prefill recomputes the context's keys and values
(a prompt's worth of compute per turn, no cache kept across the tool call) and so needs no memory
while a row waits, and its log-probs are exactly a single forward's over the whole episode.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from llamarl_jax.envs.base import SingleTurn, ToolCall, Transition
from llamarl_jax.batch import FINISH_LENGTH, FINISH_STOP, RolloutBatch


# The per-status counts of a batch's tool calls (`ToolCall.status`; each is also in tool/errors).
TOOL_STATUS_METRICS = {"tool/timeouts": "timeout", "tool/memory": "memory", "tool/output_limit": "output_limit",
                       "tool/forbidden": "forbidden"}


class EnvironmentFailed(RuntimeError):
  """`env.step` raised, or ran past its time limit: a bug in the environment (module docstring)."""


def turn_seed(seed: int, turn: int, row: int | None = None) -> int:
  """The sampling seed of turn `turn` (>= 1) of a batch sampled with `seed` (turn 0 uses `seed`); with
  `row`, of that row alone (the slot engine submits each row's next turn on its own)."""
  words = [int(seed), int(turn)] + ([] if row is None else [int(row)])
  return int(np.random.SeedSequence(words).generate_state(1, np.uint32)[0])


@dataclasses.dataclass
class Episodes:
  """What `run_episodes` returns: the batch (host arrays), the texts the reward function scores (None:
  the decoded responses, single-turn), the environments' reward contributions `[B]` (None: zero) and
  the episode metrics."""
  rollout: RolloutBatch
  answers: list[str] | None = None
  env_rewards: np.ndarray | None = None
  metrics: dict = dataclasses.field(default_factory=dict)


def _bucket(count: int, rows: int, multiple: int) -> int:
  """The padded batch of a turn with `count` active rows: the smallest rows / 2^k >= count (a multiple
  of `multiple`), so at most log2(rows) batch shapes compile."""
  size = rows
  while size % 2 == 0 and size // 2 >= count and (size // 2) % multiple == 0:
    size //= 2
  return size


def observation_ids(tokenizer, text: str, *, role: str = "tool") -> list[int]:
  """The token ids appended after a model turn (which ended with its stop token) to show `text`.

  Plain tokenizers (the embedded char tokenizer): the text itself (the environment's markers, e.g.
  `[287663]`). Tokenizers with a chat template: what the template puts between the end of an
  assistant turn and the start of the next one when a `role` message (a tool result) comes between
  them: the template rendered with and without that message (the generation prompt included) and
  the difference taken from just after the assistant turn's end-of-turn token (the model's own stop
  token, already in the response), so e.g. Qwen's `\n<|im_start|>user\n<tool_response>\n...
  \n</tool_response><|im_end|>\n<|im_start|>assistant\n`."""
  template = getattr(tokenizer, "chat_template", None)
  if not template:
    return tokenizer(text, add_special_tokens=False)["input_ids"]
  head = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
  before = tokenizer.apply_chat_template(head, tokenize=False)
  after = tokenizer.apply_chat_template(head + [{"role": role, "content": text}], tokenize=False,
                                        add_generation_prompt=True)
  end = before.rfind("A") + 1  # the assistant content ends here; its end-of-turn token follows
  eot = tokenizer.eos_token or ""
  if eot and before.startswith(eot, end):
    end += len(eot)
  if not after.startswith(before[:end]):
    raise ValueError("the tokenizer's chat template renders an earlier turn differently once a "
                     f"{role!r} message follows it; observations cannot be appended as a suffix")
  return tokenizer(after[end:], add_special_tokens=False)["input_ids"]


class EpisodeRows:
  """The episodes of one batch as they grow, row by row (both engines build their batches with it).

  rows: B = prompts x n; prompts[i // n] is row i's prompt (token ids), examples[i // n] its example.
  A row takes turns (`add_turn`: the model's tokens, log-probs and versions) and transitions
  (`add_transition`: the environment's answer, its observation appended with mask 0) until it is done.
  max_context: the longest context a later turn may start from (the slot engine's longest prompt;
  None: no limit besides the response width); a row whose context outgrows it is done, cut.
  """

  def __init__(self, env, examples: Sequence, prompts: Sequence[Sequence[int]], n: int, *, tokenizer,
               response_width: int, max_observation_tokens: int, stop_token_ids: Sequence[int],
               max_context: int | None = None):
    self.env, self.n, self.tokenizer, self.max_context = env, n, tokenizer, max_context
    self.rows = len(prompts) * n
    self.width, self.max_obs = response_width, max_observation_tokens
    self.stop = set(int(t) for t in stop_token_ids)
    self.examples = [examples[i // n] for i in range(self.rows)]
    self.prompts = [list(prompts[i // n]) for i in range(self.rows)]
    self.tokens: list[list[int]] = [[] for _ in range(self.rows)]
    self.mask: list[list[int]] = [[] for _ in range(self.rows)]
    self.logprobs: list[list[float]] = [[] for _ in range(self.rows)]
    self.versions: list[list[int]] = [[] for _ in range(self.rows)]
    self.turns: list[list[str]] = [[] for _ in range(self.rows)]
    self.reward = np.zeros(self.rows, np.float32)
    self.finish = np.full(self.rows, FINISH_STOP, np.int32)
    self.done = np.zeros(self.rows, bool)
    self.calls: list[ToolCall] = []
    self.tool_wait = 0.0

  def add_turn(self, i: int, tokens, logprobs, versions, length: int, finish: int) -> str | None:
    """Append row i's model turn (its first `length` tokens); returns the turn's text when the
    environment must answer it, None when the row is done (the budget or the turn limit cut it, or
    this was its last allowed turn)."""
    length = int(length)
    take = min(length, self.width - len(self.tokens[i]))
    self.tokens[i] += np.asarray(tokens[:take]).tolist()
    self.mask[i] += [1] * take
    self.logprobs[i] += np.asarray(logprobs[:take], np.float32).tolist()
    self.versions[i] += np.asarray(versions[:take]).tolist()
    text = self.tokenizer.decode([t for t in self.tokens[i][len(self.tokens[i]) - take:] if t not in self.stop],
                                 skip_special_tokens=True)
    self.turns[i].append(text)
    if take < length or finish == FINISH_LENGTH:  # cut by the episode budget or the turn's token limit
      self.finish[i] = FINISH_LENGTH
    elif len(self.turns[i]) < self.env.max_turns and len(self.tokens[i]) < self.width:
      return text
    self.done[i] = True
    return None

  def request(self, i: int, text: str) -> tuple:
    """The `env.step` arguments of row i's latest turn."""
    return (self.examples[i], self.turns[i][:-1], text)

  def add_transition(self, i: int, tr: Transition) -> bool:
    """The environment's answer to row i's latest turn; True when the row goes on (`context(i)` is its
    next prompt), False when it is done: the environment ended it, or it is cut (no room in the response
    width for the model to answer after the observation, or a context longer than `max_context`).
    Observation tokens carry the version of the turn before them."""
    version = self.versions[i][-1]
    self.reward[i] += tr.reward
    if tr.call is not None:
      self.calls.append(tr.call)
    if tr.done:
      self.done[i] = True
      return False
    obs = observation_ids(self.tokenizer, tr.observation)[:self.max_obs]
    room = self.width - len(self.tokens[i])
    keep = obs[:room]
    self.tokens[i] += keep
    self.mask[i] += [0] * len(keep)
    self.logprobs[i] += [0.0] * len(keep)
    self.versions[i] += [version] * len(keep)
    outgrown = self.max_context is not None and len(self.prompts[i]) + len(self.tokens[i]) > self.max_context
    if len(obs) >= room or outgrown:  # no room for the model's answer, or a next prompt the engine cannot take
      self.finish[i] = FINISH_LENGTH
      self.done[i] = True
      return False
    return True

  def context(self, i: int) -> list[int]:
    """Row i's whole episode so far: its next turn's prompt."""
    return self.prompts[i] + self.tokens[i]

  def batch(self, prompt_tokens, prompt_mask, group_ids, pad_id: int = 0) -> RolloutBatch:
    """The trainer's batch (see the module docstring); prompts as the first turn's batch laid them out."""
    R = self.width
    out_tokens = np.full((self.rows, R), pad_id, np.int32)
    out_mask = np.zeros((self.rows, R), np.int32)
    out_lp = np.zeros((self.rows, R), np.float32)
    first = np.array([v[0] if v else 0 for v in self.versions], np.int32)
    out_versions = np.repeat(first[:, None], R, axis=1)
    for i in range(self.rows):
      L = len(self.tokens[i])
      out_tokens[i, :L], out_mask[i, :L], out_lp[i, :L] = self.tokens[i], self.mask[i], self.logprobs[i]
      out_versions[i, :L] = self.versions[i]
    # observations carry the version of the turn before them; the row's oldest version is its first token's
    return RolloutBatch(
        prompt_tokens=np.asarray(prompt_tokens), prompt_mask=np.asarray(prompt_mask), response_tokens=out_tokens,
        response_mask=out_mask, behaviour_logprobs=out_lp, lengths=np.array([len(t) for t in self.tokens], np.int32),
        finish_reason=self.finish.copy(), group_ids=np.asarray(group_ids), policy_version=first,
        token_versions=out_versions)

  def answers(self) -> list[str]:
    return [self.env.answer(t) for t in self.turns]

  def metrics(self, elapsed: float) -> dict:
    lengths = np.array([len(t) for t in self.tokens])
    num_turns = np.array([len(t) for t in self.turns], np.float32)
    model_tokens = sum(sum(m) for m in self.mask)
    failed = [c for c in self.calls if not c.ok]
    out = {
        "episode/turns_mean": float(num_turns.mean()), "episode/turns_max": float(num_turns.max()),
        "episode/tool_calls_mean": len(self.calls) / self.rows,
        "episode/masked_token_fraction": float(1 - model_tokens / max(lengths.sum(), 1)),
        "episode/tool_wait_fraction": self.tool_wait / max(elapsed, 1e-9),
        "episode/frac_cut": float(np.mean(self.finish == FINISH_LENGTH)),
        "tool/calls": float(len(self.calls)), "tool/errors": float(len(failed)),
        **{key: float(sum(c.status == status for c in self.calls)) for key, status in TOOL_STATUS_METRICS.items()},
    }
    seconds = [c.seconds for c in self.calls] or [0.0]  # no call: 0 (every batch logs the same keys)
    out["tool/latency_mean_s"], out["tool/latency_max_s"] = float(np.mean(seconds)), float(np.max(seconds))
    return out


def run_episodes(generate: Callable[[Sequence[Sequence[int]], Any], RolloutBatch], env, examples: Sequence,
                 prompts: Sequence[Sequence[int]], sampling, *, tokenizer, response_width: int,
                 max_observation_tokens: int = 32, tool_steps: ToolSteps | None = None,
                 batch_multiple: int = 1, pad_id: int = 0) -> Episodes:
  """Roll out one episode per (prompt, sample) on a static sampler; see the module docstring.

  generate(prompts, sampling) -> host RolloutBatch: the caller's sampler call (its params, version and
  device turn bound). sampling: the batch's SamplingParams (n samples per prompt, its seed).
  tool_steps: where `env.step` runs (its threads and time limit); None: on this thread, unlimited.
  """
  t_start = time.perf_counter()  # tool_wait_fraction: of the whole episode time, generation included
  first = generate(prompts, sampling)
  if isinstance(env, SingleTurn):
    return Episodes(first)
  ep = EpisodeRows(env, examples, prompts, sampling.n, tokenizer=tokenizer, response_width=response_width,
                   max_observation_tokens=max_observation_tokens, stop_token_ids=sampling.stop_token_ids)
  batch, batch_rows = first, list(range(ep.rows))  # batch row j is episode row batch_rows[j]
  for turn in range(env.max_turns):
    toks, lp, versions = (np.asarray(batch.response_tokens), np.asarray(batch.behaviour_logprobs),
                          np.asarray(batch.token_versions))
    lengths, fin = np.asarray(batch.lengths), np.asarray(batch.finish_reason)
    pending = {}
    for j, i in enumerate(batch_rows):
      text = ep.add_turn(i, toks[j], lp[j], versions[j], lengths[j], fin[j])
      if text is not None:
        pending[i] = ep.request(i, text)
    t0 = time.perf_counter()
    answers = (tool_steps.run_all(pending) if tool_steps is not None  # every finished turn at once
               else {i: call_step(env, *args) for i, args in pending.items()})
    ep.tool_wait += time.perf_counter() - t0
    active = [i for i in sorted(pending) if ep.add_transition(i, answers[i])]
    if not active:
      break
    size = _bucket(len(active), ep.rows, batch_multiple)
    contexts = [ep.context(i) for i in active]
    contexts += [contexts[0]] * (size - len(active))  # padding rows, discarded
    batch = _take_rows(generate(contexts, dataclasses.replace(sampling, n=1, seed=turn_seed(sampling.seed, turn + 1))),
                       len(active))
    batch_rows = active
  rollout = ep.batch(first.prompt_tokens, first.prompt_mask, first.group_ids, pad_id)
  return Episodes(rollout, answers=ep.answers(), env_rewards=ep.reward.copy(),
                  metrics=ep.metrics(time.perf_counter() - t_start))


def _take_rows(batch: RolloutBatch, count: int) -> RolloutBatch:
  return RolloutBatch(**{f.name: (None if getattr(batch, f.name) is None else np.asarray(getattr(batch, f.name))[:count])
                         for f in dataclasses.fields(batch)})


@dataclasses.dataclass(eq=False)
class PendingStep:
  """One `env.step` call on the tool threads: its arguments, when a thread started it (monotonic;
  None while queued), and its outcome once `finished` is set."""
  args: tuple
  started: float | None = None
  transition: Transition | None = None
  error: BaseException | None = None
  finished: threading.Event = dataclasses.field(default_factory=threading.Event)

  def done(self) -> bool:
    return self.finished.is_set()


def _failure(args: tuple, what: str) -> str:
  text = args[2]
  return (f"the environment's step {what} on the model turn {text[:80]!r}: a bug in the environment, not a "
          "tool failure (a tool's error, timeout or bad call must come back as an observation, as "
          "ToolEnvironment.run_tool returns them); fix the environment's step")


def call_step(env, example, turns, text) -> Transition:
  """`env.step` on this thread; an exception out of it is `EnvironmentFailed`, chained to it."""
  try:
    return env.step(example, turns, text)
  except Exception as e:
    raise EnvironmentFailed(_failure((example, turns, text), f"raised {type(e).__name__}: {e}")) from e


class ToolSteps:
  """`env.step` calls on `workers` tool threads (off the generator's and the trainer's threads).

  `submit` queues a step; `result` waits for it and returns its Transition, or raises
  `EnvironmentFailed` when the step raised or has run `limit_s` seconds (counted from when a thread
  started it: queueing behind other steps does not count). The threads are daemons, so a step that
  overran its limit (the run stops on it) cannot hold the process at exit.
  """

  def __init__(self, env, workers: int, limit_s: float):
    if workers < 1 or limit_s <= 0:
      raise ValueError(f"ToolSteps needs workers >= 1 and limit_s > 0, got {workers} and {limit_s}")
    self.env, self.limit_s = env, float(limit_s)
    self.overran = False  # a step ran past its limit: its thread is still busy with it
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._threads = [threading.Thread(target=self._work, name=f"tools-{i}", daemon=True) for i in range(workers)]
    for t in self._threads:
      t.start()

  def _work(self) -> None:
    while True:
      step = self._queue.get()
      if step is None:
        return
      step.started = time.monotonic()
      try:
        step.transition = self.env.step(*step.args)
      except BaseException as e:  # noqa: BLE001 - handed to the waiting thread by `result`
        step.error = e
      step.finished.set()

  def submit(self, example, turns, text) -> PendingStep:
    step = PendingStep((example, turns, text))
    self._queue.put(step)
    return step

  def overdue(self, step: PendingStep) -> bool:
    started = step.started
    return not step.done() and started is not None and time.monotonic() - started >= self.limit_s

  def result(self, step: PendingStep) -> Transition:
    """The step's Transition, waiting for it; `EnvironmentFailed` if it raised or overran its limit."""
    while not step.finished.wait(self._left(step)):
      if self.overdue(step):
        self.overran = True
        raise EnvironmentFailed(_failure(step.args, f"was still running {self.limit_s:g} s after it started "
                                                    "(EnvConfig.step_limit_s: tool_timeout_s plus a margin)"))
    if step.error is not None:
      e = step.error
      raise EnvironmentFailed(_failure(step.args, f"raised {type(e).__name__}: {e}")) from e
    return step.transition

  def _left(self, step: PendingStep) -> float:
    started = step.started
    return self.limit_s if started is None else max(0.0, started + self.limit_s - time.monotonic()) + 1e-3

  def run_all(self, requests: dict[int, tuple]) -> dict[int, Transition]:
    """Every request's step at once on the threads; their Transitions by key."""
    steps = {i: self.submit(*args) for i, args in requests.items()}
    return {i: self.result(step) for i, step in steps.items()}

  def close(self) -> None:
    """Stop the threads once the queued steps are done (idempotent). After an overrun the threads are
    not waited for: one of them is still inside the step that overran."""
    for _ in self._threads:
      self._queue.put(None)
    if not self.overran:
      for t in self._threads:
        t.join()
