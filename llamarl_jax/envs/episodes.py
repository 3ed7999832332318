"""The one rollout path: prompts -> episodes -> one `RolloutBatch` for the trainer (issue 28).

`run_episodes(generate, env, examples, prompts, sampling, ...)`:

  turn 1   `generate(prompts, sampling)`: the n samples of every prompt (one `Sampler.generate` call).
           With `SingleTurn` that is the whole rollout: the batch is returned as it came, so single-turn
           runs are exactly what they were before episodes existed.
  then     each finished turn goes to `env.step` on the tool threads (`tool_pool`; never on the
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
from given the whole context so far (0 on observations); token_versions the batch's version; lengths
the tokens used (model + observation); finish_reason LENGTH when the budget cut an episode or its
last turn hit max_new_tokens.

Re-prefill versus extending the row's KV cache: re-prefill recomputes the context's keys and values
(a prompt's worth of compute per turn, no cache kept across the tool call) and so needs no memory
while a row waits, and its log-probs are exactly a single forward's over the whole episode.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any, Callable, Sequence

import numpy as np

from llamarl_jax.envs.base import SingleTurn, ToolCall, Transition
from llamarl_jax.generation.rollout import FINISH_LENGTH, FINISH_STOP, RolloutBatch

STEP_GRACE_S = 30.0  # an env.step still running this long after its turn is an error observation


def turn_seed(seed: int, turn: int) -> int:
  """The sampling seed of turn `turn` (>= 1) of a batch sampled with `seed` (turn 0 uses `seed`)."""
  return int(np.random.SeedSequence([int(seed), int(turn)]).generate_state(1, np.uint32)[0])


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


def run_episodes(generate: Callable[[Sequence[Sequence[int]], Any], RolloutBatch], env, examples: Sequence,
                 prompts: Sequence[Sequence[int]], sampling, *, tokenizer, response_width: int,
                 max_observation_tokens: int = 32, tool_pool: concurrent.futures.Executor | None = None,
                 batch_multiple: int = 1, pad_id: int = 0) -> Episodes:
  """Roll out one episode per (prompt, sample); see the module docstring.

  generate(prompts, sampling) -> host RolloutBatch: the caller's sampler call (its params, version and
  device turn bound). sampling: the batch's SamplingParams (n samples per prompt, its seed).
  """
  first = generate(prompts, sampling)
  if isinstance(env, SingleTurn):
    return Episodes(first)
  t_start = time.perf_counter()
  n, rows = sampling.n, len(prompts) * sampling.n
  version = int(np.asarray(first.policy_version)[0])
  eos = set(sampling.stop_token_ids)
  row_example = [examples[i // n] for i in range(rows)]
  context0 = [list(prompts[i // n]) for i in range(rows)]
  resp: list[list[int]] = [[] for _ in range(rows)]
  mask: list[list[int]] = [[] for _ in range(rows)]
  lps: list[list[float]] = [[] for _ in range(rows)]
  turns: list[list[str]] = [[] for _ in range(rows)]
  reward = np.zeros(rows, np.float32)
  finish = np.full(rows, FINISH_STOP, np.int32)
  calls: list[ToolCall] = []
  tool_wait = 0.0
  active = list(range(rows))
  batch, batch_rows = first, list(range(rows))  # batch row j is episode batch_rows[j]
  for turn in range(env.max_turns):
    toks, lp = np.asarray(batch.response_tokens), np.asarray(batch.behaviour_logprobs)
    lengths, fin = np.asarray(batch.lengths), np.asarray(batch.finish_reason)
    pending: dict[int, str] = {}
    for j, i in enumerate(batch_rows):
      L = int(lengths[j])
      room = response_width - len(resp[i])
      take = min(L, room)
      resp[i] += toks[j, :take].tolist()
      mask[i] += [1] * take
      lps[i] += lp[j, :take].tolist()
      text = tokenizer.decode([t for t in toks[j, :take].tolist() if t not in eos], skip_special_tokens=True)
      turns[i].append(text)
      if take < L or fin[j] == FINISH_LENGTH:  # cut by the episode budget or the turn's token limit
        finish[i] = FINISH_LENGTH
      elif turn + 1 < env.max_turns and len(resp[i]) < response_width:
        pending[i] = text
    # The environment answers every finished turn at once, on the tool threads.
    t0 = time.perf_counter()
    answers = _step_all(env, tool_pool, {i: (row_example[i], turns[i][:-1], text) for i, text in pending.items()})
    tool_wait += time.perf_counter() - t0
    active = []
    for i in sorted(pending):
      tr = answers[i]
      reward[i] += tr.reward
      if tr.call is not None:
        calls.append(tr.call)
      if tr.done:
        continue
      obs = tokenizer(tr.observation, add_special_tokens=False)["input_ids"][:max_observation_tokens]
      room = response_width - len(resp[i])
      if len(obs) >= room:  # no room left for the model to answer after it
        resp[i] += obs[:room]
        mask[i] += [0] * min(len(obs), room)
        lps[i] += [0.0] * min(len(obs), room)
        finish[i] = FINISH_LENGTH
        continue
      resp[i] += obs
      mask[i] += [0] * len(obs)
      lps[i] += [0.0] * len(obs)
      active.append(i)
    if not active:
      break
    size = _bucket(len(active), rows, batch_multiple)
    contexts = [context0[i] + resp[i] for i in active]
    contexts += [contexts[0]] * (size - len(active))  # padding rows, discarded
    batch = generate(contexts, dataclasses.replace(sampling, n=1, seed=turn_seed(sampling.seed, turn + 1)))
    batch_rows = active
    batch = _take_rows(batch, len(active))

  R = response_width
  out_tokens = np.full((rows, R), pad_id, np.int32)
  out_mask = np.zeros((rows, R), np.int32)
  out_lp = np.zeros((rows, R), np.float32)
  for i in range(rows):
    L = len(resp[i])
    out_tokens[i, :L], out_mask[i, :L], out_lp[i, :L] = resp[i], mask[i], lps[i]
  lengths = np.array([len(r) for r in resp], np.int32)
  rollout = RolloutBatch(
      prompt_tokens=np.asarray(first.prompt_tokens), prompt_mask=np.asarray(first.prompt_mask),
      response_tokens=out_tokens, response_mask=out_mask, behaviour_logprobs=out_lp, lengths=lengths,
      finish_reason=finish, group_ids=np.asarray(first.group_ids), policy_version=np.asarray(first.policy_version),
      token_versions=np.full((rows, R), version, np.int32))
  elapsed = time.perf_counter() - t_start
  num_turns = np.array([len(t) for t in turns], np.float32)
  failed = [c for c in calls if not c.ok]
  metrics = {
      "episode/turns_mean": float(num_turns.mean()), "episode/turns_max": float(num_turns.max()),
      "episode/tool_calls_mean": len(calls) / rows,
      "episode/masked_token_fraction": float(1 - out_mask.sum() / max(lengths.sum(), 1)),
      "episode/tool_wait_fraction": tool_wait / max(elapsed, 1e-9),
      "episode/frac_cut": float(np.mean(finish == FINISH_LENGTH)),
      "tool/calls": float(len(calls)), "tool/errors": float(len(failed)),
      "tool/timeouts": float(sum(c.status == "timeout" for c in calls)),
  }
  if calls:
    metrics["tool/latency_mean_s"] = float(np.mean([c.seconds for c in calls]))
    metrics["tool/latency_max_s"] = float(np.max([c.seconds for c in calls]))
  return Episodes(rollout, answers=[env.answer(t) for t in turns], env_rewards=reward, metrics=metrics)


def _take_rows(batch: RolloutBatch, count: int) -> RolloutBatch:
  return RolloutBatch(**{f.name: (None if getattr(batch, f.name) is None else np.asarray(getattr(batch, f.name))[:count])
                         for f in dataclasses.fields(batch)})


def _step_all(env, pool, requests: dict[int, tuple]) -> dict[int, Transition]:
  """env.step for every request, on `pool`'s threads (inline without one); a step that raises or runs
  past STEP_GRACE_S becomes an error observation (the episode goes on, the failure is counted)."""
  if pool is None:
    return {i: _safe_step(env, *args) for i, args in requests.items()}
  futures = {i: pool.submit(_safe_step, env, *args) for i, args in requests.items()}
  out = {}
  deadline = time.monotonic() + STEP_GRACE_S
  for i, f in futures.items():
    try:
      out[i] = f.result(timeout=max(0.0, deadline - time.monotonic()))
    except concurrent.futures.TimeoutError:
      out[i] = Transition(observation="[the tool did not answer in time]", done=False,
                          call=ToolCall("?", "timeout", STEP_GRACE_S))
  return out


def _safe_step(env, example, turns, text) -> Transition:
  t0 = time.monotonic()
  try:
    return env.step(example, turns, text)
  except Exception as e:  # noqa: BLE001 - an environment bug scores that episode, it does not stop the run
    return Transition(observation=f"[environment error: {type(e).__name__}]", done=False,
                      call=ToolCall("?", "error", time.monotonic() - t0))
