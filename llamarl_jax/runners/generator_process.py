"""The run loop of a generator process in a multi-process run (the protocol: `multiprocess/protocol.py`).

  generator thread: GeneratorExecutor.run on `RemoteWeights`: batch k waits for exactly version
                    v(k), draws the k-th prompts (the same on every generator process: a pure function
                    of the seed and k; the process feeds the rows its devices hold), samples, gathers
                    the rollout to host (inside the generator mesh) -> reward thread
  reward thread:    scores this process's share of the prompts (`schedule.share_rows`, by its rank among
                    the generator processes) in its reward pool, publishes the share, reads the others'
                    -> the whole ScoredBatch and its metrics (the same function as in one process).
                    With a reward model (`RewardConfig.model_path`, in the reward processes:
                    `reward_process.py`) the generator leader first publishes the batch's token rows;
                    the reward leader's scores come back through the store and combine with the
                    whole batch's rule rewards (`RewardModelExecutor.combine`)
  transfer thread:  walks `schedule.transfer_schedule`: W(v) waits until the trainer marked v staged,
                    then receives it (LoRA: the base first when the mark says it comes); R(k) publishes batch k's facts (generator leader) and sends its arrays
"""

from __future__ import annotations

import dataclasses
import json
import queue
import threading
import time

import jax
import numpy as np

from llamarl_jax.config import RunConfig
from llamarl_jax.executors.generator import Generated, Timer
from llamarl_jax.executors.scoring import decode_responses, scored_from_rewards
from llamarl_jax.multiprocess.protocol import run_key
from llamarl_jax.multiprocess.runtime import RemoteWeights, Slots, Stopped, Worker, join_all, wait_key
from llamarl_jax.runners.common import Executors, RunState
from llamarl_jax.schedule import lag_metrics, share_rows, transfer_schedule


def run(ex: Executors, state: RunState, config: RunConfig, num_steps: int) -> RunState:
  """Generate and score batches state.step .. state.step + num_steps - 1; returns the state after them."""
  mp = ex.mp
  state = state.started()
  start, run_id, first = state.step, mp.new_run(), state.first_version
  ops = transfer_schedule(start, num_steps, config.schedule.max_policy_lag, first)
  if state.data_state is not None:  # as in one process: the prompts after the last trained batch
    ex.prompt_source.load_state_dict(state.data_state)
  last_state = {}
  last = start + num_steps - 1
  leader = mp.me == mp.roles.generator_leader
  stop = threading.Event()
  weights = RemoteWeights(mp.weights)
  scoring: queue.Queue = queue.Queue(maxsize=1)
  outbox = Slots()
  timeout = config.schedule.step_timeout_s
  reward_timer = Timer()

  def emit(item: Generated) -> bool:
    while not stop.is_set():
      try:
        scoring.put(item, timeout=0.2)
        return item.index < last
      except queue.Full:
        continue
    return False

  def generate() -> None:
    if num_steps > 0:
      ex.generator.run(weights, emit, stop, start_index=start, first_version=first)

  def score() -> None:
    for _ in range(num_steps):
      t0 = time.perf_counter()
      item = _get(scoring, stop)
      t1 = time.perf_counter()
      scored, metrics, texts = _score_share(ex, config, run_id, item, stop)
      t2 = time.perf_counter()
      reward_timer.add(busy=t2 - t1, wait=t1 - t0)
      ex.mark("reward", t1, t2)
      lag = lag_metrics(scored.rollout.token_versions, scored.rollout.response_mask, item.index)
      last_state["data"] = item.data_state
      meta = {"metrics": metrics, "data_state": item.data_state, "lag": lag,
              "tokens": float(np.sum(scored.rollout.response_mask)), "texts": texts[:2],
              "generator_times": list(ex.generator.timer.take()), "reward_times": list(reward_timer.take())}
      arrays = scored.train_arrays()
      meta["shapes"] = {k: list(a.shape) for k, a in arrays.items()}
      outbox.put(item.index, (arrays, meta))
      if leader and item.index - 2 >= start:  # every generator process has read these shares by now
        for g in range(len(mp.roles.generator)):
          mp.kv.delete(run_key(run_id, "score", item.index - 2, g))
        if ex.reward_model is not None:
          mp.kv.delete(run_key(run_id, "rm_scores", item.index - 2))

  def transfer() -> None:
    for op, i in ops:
      if op == "W":
        mark = wait_key(mp.kv, run_key(run_id, "staged", i), stop, timeout)
        t = time.perf_counter()
        landed = jax.block_until_ready(mp.receive_weights(mark))
        seconds = time.perf_counter() - t
        moved = mp.weights.last_bytes if mp.lora else mp.weights.nbytes  # LoRA: the base too, when it came
        weights.put(i, landed, {"seconds": seconds, "gbps": moved / max(seconds, 1e-9) / 1e9})
      else:
        arrays, meta = outbox.pop(i, stop, timeout, "scored batch")
        meta["sync"] = weights.last_metrics
        if leader:
          mp.kv.set_json(run_key(run_id, "batch", i), meta)
        mp.rows(meta["shapes"]).send(arrays)

  threads = [Worker(generate, "generator", stop), Worker(score, "reward", stop), Worker(transfer, "transfer", stop)]
  for t in threads:
    t.start()
  try:
    join_all(threads, stop)
  finally:
    stop.set()
    weights.close()
  return dataclasses.replace(state, step=start + num_steps, data_state=last_state.get("data", state.data_state))


def _get(q: queue.Queue, stop: threading.Event):
  while True:
    try:
      return q.get(timeout=0.2)
    except queue.Empty:
      if stop.is_set():
        raise Stopped() from None


def _score_share(ex: Executors, config: RunConfig, run_id: int, item: Generated, stop: threading.Event):
  """Score this process's share of `item`'s prompts, exchange shares: (ScoredBatch, metrics, texts).
  With a reward model (in the reward processes): the generator leader publishes the batch's token
  rows first, every generator process combines the reward processes' scores with the whole batch's
  rule rewards (`RewardModelExecutor.combine`, as in one process)."""
  mp = ex.mp
  n, num_prompts = config.rollout.samples_per_prompt, len(item.examples)
  gens = mp.roles.generator
  texts = decode_responses(ex.tokenizer, item.rollout)
  rollout_cfg = config.rollout
  timeout = config.schedule.step_timeout_s
  if item.rewards is not None:  # dynamic sampling: every generator process scored every row already
    scored, metrics = scored_from_rewards(item, item.rewards, item.reward_metrics,
                                          advantage_estimator=rollout_cfg.advantage_estimator,
                                          overlong=rollout_cfg.overlong, max_new_tokens=rollout_cfg.max_new_tokens)
    return scored, metrics, texts
  rm = ex.reward_model
  if rm is not None and mp.me == mp.roles.generator_leader:  # the reward processes score while the rules run
    mp.kv.set_json(run_key(run_id, "rm_rows", item.index), rm.batch_rows(item, texts))
  mine = share_rows(num_prompts, len(gens), mp.generator_rank)
  rows = slice(mine.start * n, mine.stop * n)
  truths = [e.ground_truth for e in item.examples[mine] for _ in range(n)]
  scored_texts = item.answers if item.answers is not None else texts
  rewards, counts = (ex.reward.score(scored_texts[rows], truths) if truths
                     else (np.zeros(0, np.float32), {}))
  counts = {k: float(v) for k, v in counts.items() if not k.startswith("time/")}
  mp.kv.set_json(run_key(run_id, "score", item.index, mp.generator_rank),
                 {"rewards": [float(r) for r in rewards], "counts": counts})
  all_rewards, total = [], {}
  for g in range(len(gens)):
    share = json.loads(wait_key(mp.kv, run_key(run_id, "score", item.index, g), stop, timeout)) \
        if g != mp.generator_rank else {"rewards": [float(r) for r in rewards], "counts": counts}
    all_rewards += share["rewards"]
    for k, v in share["counts"].items():
      total[k] = total.get(k, 0.0) + v
  all_rewards = np.asarray(all_rewards, np.float32)
  combined = None
  if rm is not None:
    try:
      model = json.loads(wait_key(mp.kv, run_key(run_id, "rm_scores", item.index), stop, timeout))
    except TimeoutError:
      raise TimeoutError(f"batch {item.index}: no reward-model scores from the reward process(es) "
                         f"{list(mp.roles.reward)} within ScheduleConfig.step_timeout_s = {timeout:g} s: the reward "
                         "model is stuck, or slower than that (then raise step_timeout_s)") from None
    combined = rm.combine(item, all_rewards, np.asarray(model["scores"], np.float32))
    total.update(model["metrics"])
  scored, metrics = scored_from_rewards(item, all_rewards, total,
                                        advantage_estimator=config.rollout.advantage_estimator,
                                        overlong=config.rollout.overlong, max_new_tokens=config.rollout.max_new_tokens,
                                        combined=combined)
  return scored, metrics, texts
