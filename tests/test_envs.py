"""Episodes: the Environment protocol, the calculator and tool environment, the one rollout
path (`run_episodes`), observation masking through the trainer, exact behaviour log-probs after a tool
turn, demonstrations for the warm start, and the config's refusals."""

import dataclasses
import functools
import time

import jax
import numpy as np
import pytest
from flax import nnx

from llamarl_jax import parallel
from llamarl_jax.config import MAX_TOOL_TIMEOUT_S, STEP_MARGIN_S, ConfigError, EnvConfig, OverlongShaping, RunConfig, run_config
from llamarl_jax.envs import SingleTurn, ToolEnvironment, Transition, calc, make_environment, run_episodes, turn_seed
from llamarl_jax.envs.base import ToolCall
from llamarl_jax.envs.episodes import EnvironmentFailed, ToolSteps, _bucket
from llamarl_jax.executors.trainer import OptimizerConfig, TrainerExecutor
from llamarl_jax.batch import FINISH_LENGTH, FINISH_STOP, RolloutBatch, ScoredBatch
from llamarl_jax.generation.sampler import Sampler, SamplingParams
from llamarl_jax.model.config import ModelConfig
from llamarl_jax.model.llama import Llama, split_params
from llamarl_jax.model.logprobs import token_logprobs
from llamarl_jax.tokenizer import make_char_tokenizer

TOK = make_char_tokenizer()
EOS = TOK.eos_token_id


def ids(text):
  return TOK(text, add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------------------------------------
# the calculator and the tool environment


@pytest.mark.parametrize("expr, out, status", [
    ("347*829", "287663", "ok"), ("12+30/4", "39/2", "ok"), ("(2+3)*(4-9)", "-25", "ok"), ("1.5*4", "6", "ok"),
    ("1/0", "error: division by zero", "error"), ("2**3", None, "error"), ("", None, "error"),
    ("__import__('os').system('id')", None, "error"), ("x+1", None, "error"), ("9" * 201, None, "error")])
def test_calc_is_exact_and_never_evaluates_code(expr, out, status):
  got, got_status = calc(expr)
  assert got_status == status, (expr, got)
  if out is not None:
    assert got == out
  else:
    assert got.startswith("error:")


def test_tool_environment_turns():
  env = ToolEnvironment({"calc": calc}, max_turns=3)
  call = env.step(None, [], "calc(347*829)")
  assert (call.observation, call.done, call.call.tool, call.call.status) == ("[287663]", False, "calc", "ok")
  assert env.step(None, ["calc(347*829)"], "287663") == Transition(done=True)  # an answer ends the episode
  bad = env.step(None, [], "calc(12+)")
  assert not bad.done and bad.call.status == "error" and bad.observation.startswith("[error:")
  unknown = env.step(None, [], "search(cats)")
  assert unknown.call.status == "unknown_tool" and "calc" in unknown.observation
  assert env.answer(["calc(1+1)", "2"]) == "2"
  # the no-tool baseline: a call is just an answer (a wrong one)
  assert ToolEnvironment({}, max_turns=3).step(None, [], "calc(1+1)") == Transition(done=True)
  with pytest.raises(ValueError, match="needs an observation"):
    Transition(done=False)


def test_tool_failures_are_observations_not_crashes():
  def broken(args):
    raise RuntimeError("tool bug")

  env = ToolEnvironment({"t": broken, "big": lambda a: ("x" * 10_000, "ok")}, max_output_chars=64)
  out = env.step(None, [], "t(1)")
  assert out.call.status == "error" and "RuntimeError" in out.observation and not out.done
  big = env.step(None, [], "big(1)")
  assert len(big.observation) == 64 + 3 + 2  # cut output, "...", the two markers


def test_demonstrations():
  env = ToolEnvironment({"calc": calc})
  assert env.demonstration(None, "calc(12*12)") == [("calc(12*12)", True), ("[144]", False), ("144", True)]
  assert env.demonstration(None, "144") == [("144", True)]
  assert SingleTurn().demonstration(None, "81") == [("81", True)]
  with pytest.raises(ValueError, match="fails"):
    env.demonstration(None, "calc(1/0)")


def test_sft_batch_masks_observations():
  from llamarl_jax.data import PromptExample
  from llamarl_jax.experiment import _sft_batch

  ex = PromptExample(prompt="12*12=", ground_truth="144", task="arithmetic", index=0)
  env = ToolEnvironment({"calc": calc})
  pt, pm, rt, rm = _sft_batch(TOK, [ex, ex], ["calc(12*12)", "144"], 8, 24, env=env)
  want = ids("calc(12*12)") + [EOS] + ids("[144]") + ids("144") + [EOS]
  assert rt[0, :len(want)].tolist() == want
  assert rm[0, :len(want)].tolist() == [1] * 12 + [0] * 5 + [1] * 4 and rm[0, len(want):].sum() == 0
  assert rt[1, :4].tolist() == ids("144") + [EOS] and rm[1].tolist() == [1] * 4 + [0] * 20
  # single-turn (env None) is unchanged: completion + eos, all trained
  single = _sft_batch(TOK, [ex], ["144"], 8, 24)
  assert single[2][0, :4].tolist() == ids("144") + [EOS] and single[3][0].sum() == 4


def test_env_config_refusals():
  with pytest.raises(ConfigError, match="max_turns"):
    EnvConfig(max_turns=2)
  with pytest.raises(ConfigError, match="tools"):
    EnvConfig(name="tools", tools=("calc", "shell"))
  cfg = RunConfig(env=EnvConfig(name="tools", max_turns=2, tools=["calc"]), generator=run_config(
      generator_engine="static").generator)
  assert cfg.env.tools == ("calc",) and cfg.env.response_width(16) == 16 * 2 + 32
  assert "env" in cfg.record() and "env" not in RunConfig().record()  # old checkpoints compare as before
  assert isinstance(make_environment(EnvConfig()), SingleTurn)
  # the overlong penalty measures one turn against max_new_tokens: refused for episodes, masking is not
  tools = EnvConfig(name="tools", max_turns=2)
  with pytest.raises(ConfigError, match=r"OverlongShaping.buffer_len=4 with EnvConfig.name='tools'.*buffer_len = 0"):
    RunConfig(env=tools, rollout=run_config(overlong=OverlongShaping(buffer_len=4)).rollout)
  assert RunConfig(env=tools, rollout=run_config(overlong=OverlongShaping(mask_truncated=True)).rollout).env == tools


# ------------------------------------------------------------------------------------------------
# run_episodes with a scripted generator: the batch's layout, exactly


def scripted_generate(script):
  """A `generate(prompts, sampling)` that answers each prompt (by its text) from `script` {context text:
  turn text}; behaviour log-probs -0.1 * (t + 1) so the test can see where they land."""
  calls = []

  def generate(prompts, sampling):
    calls.append((len(prompts), sampling.n, sampling.seed))
    rows = [p for p in prompts for _ in range(sampling.n)]
    R = sampling.max_new_tokens
    toks = np.zeros((len(rows), R), np.int32)
    lengths = np.zeros(len(rows), np.int32)
    finish = np.full(len(rows), FINISH_STOP, np.int32)
    for r, p in enumerate(rows):
      out = ids(script[TOK.decode(p[1:], skip_special_tokens=True)]) + [EOS]
      if len(out) > R:
        out, finish[r] = out[:R], FINISH_LENGTH
      toks[r, :len(out)], lengths[r] = out, len(out)
    t = np.arange(R)[None]
    mask = (t < lengths[:, None]).astype(np.int32)
    P = max(len(p) for p in rows)
    pt = np.array([[0] * (P - len(p)) + list(p) for p in rows], np.int32)
    return RolloutBatch(prompt_tokens=pt, prompt_mask=(pt > 0).astype(np.int32), response_tokens=toks,
                        response_mask=mask, behaviour_logprobs=np.where(mask, -0.1 * (t + 1), 0).astype(np.float32),
                        lengths=lengths, finish_reason=finish,
                        group_ids=np.repeat(np.arange(len(prompts)), sampling.n).astype(np.int32),
                        policy_version=np.full(len(rows), 7, np.int32), token_versions=np.full((len(rows), R), 7))

  return generate, calls


def test_run_episodes_layout_masks_and_metrics():
  script = {"1*2=": "calc(1*2)", "1*2=calc(1*2)[2]": "2", "3*4=": "12", "8*9=": "72",  # (contexts decoded
            "5*6=": "calc(5*6)", "5*6=calc(5*6)[30]": "calc(30*1)", "5*6=calc(5*6)[30]calc(30*1)[30]": "3"}  # w/o eos)
  generate, calls = scripted_generate(script)
  examples = ["a", "b", "c", "d"]
  prompts = [[1] + ids("1*2="), [1] + ids("3*4="), [1] + ids("5*6="), [1] + ids("8*9=")]
  env = ToolEnvironment({"calc": calc}, max_turns=3)
  sampling = SamplingParams(max_new_tokens=12, n=1, stop_token_ids=(EOS,), seed=5)
  out = run_episodes(generate, env, examples, prompts, sampling, tokenizer=TOK, response_width=40,
                     max_observation_tokens=8, batch_multiple=1)
  r = out.rollout
  assert out.answers == ["2", "12", "3", "72"]
  assert np.all(out.env_rewards == 0)
  # row 0: turn "calc(1*2)"+eos (mask 1), observation "[2]" (mask 0), turn "2"+eos (mask 1)
  want = ids("calc(1*2)") + [EOS] + ids("[2]") + ids("2") + [EOS]
  assert r.response_tokens[0, :len(want)].tolist() == want and r.lengths[0] == len(want)
  assert r.response_mask[0].tolist() == [1] * 10 + [0] * 3 + [1] * 2 + [0] * 25
  # the behaviour log-probs of each turn start again at -0.1 (its first token); 0 on the observation
  np.testing.assert_allclose(r.behaviour_logprobs[0, 9:15], [-1.0, 0, 0, 0, -0.1, -0.2], rtol=1e-6)
  assert r.response_mask[1].tolist() == [1] * 3 + [0] * 37  # a one-turn episode
  assert r.finish_reason.tolist() == [FINISH_STOP] * 4
  assert r.token_versions.shape == (4, 40) and np.all(r.token_versions == 7)
  # turn 2 sampled the 2 rows that went on (the bucket 4 / 2), turn 3 one row (4 / 4)
  assert [c[0] for c in calls] == [4, 2, 1] and calls[1][2] == turn_seed(5, 1) and calls[2][2] == turn_seed(5, 2)
  m = out.metrics
  assert m["episode/turns_mean"] == pytest.approx((2 + 1 + 3 + 1) / 4) and m["tool/calls"] == 3
  assert m["episode/masked_token_fraction"] == pytest.approx((3 + 4 + 4) / r.lengths.sum())
  assert m["tool/errors"] == 0


def test_run_episodes_budget_cuts_and_single_turn_is_the_sampler_batch():
  generate, _ = scripted_generate({"1*2=": "calc(1*2)", "1*2=calc(1*2)[2]": "22222222"})
  sampling = SamplingParams(max_new_tokens=12, n=2, stop_token_ids=(EOS,), seed=0)
  env = ToolEnvironment({"calc": calc}, max_turns=3)
  out = run_episodes(generate, env, ["a"], [[1] + ids("1*2=")], sampling, tokenizer=TOK, response_width=16)
  r = out.rollout
  assert r.lengths.tolist() == [16, 16] and r.finish_reason.tolist() == [FINISH_LENGTH] * 2
  assert r.response_mask[0].tolist() == [1] * 10 + [0] * 3 + [1] * 3  # the answer cut at the budget
  first = generate([[1] + ids("1*2=")], sampling)
  single = run_episodes(lambda p, s: first, SingleTurn(), ["a"], [[1] + ids("1*2=")], sampling, tokenizer=TOK,
                        response_width=12)
  assert single.rollout is first and single.answers is None and single.env_rewards is None


class _Broken:
  """An environment whose step has a bug (a TypeError), or takes `sleep_s` before answering."""
  max_turns = 3

  def __init__(self, sleep_s=0.0, bug=True):
    self.sleep_s, self.bug = sleep_s, bug

  def step(self, example, turns, text):
    time.sleep(self.sleep_s)
    if self.bug:
      return len(None)  # TypeError
    return Transition(observation="[ok]", done=False, call=ToolCall("calc", "ok", self.sleep_s))

  def answer(self, turns):
    return turns[-1]


@pytest.mark.parametrize("threads", [False, True])
def test_an_environment_bug_stops_the_rollout_with_its_traceback(threads):
  """A TypeError inside env.step is not turned into an observation that is trained on: the rollout
  raises EnvironmentFailed, chained to the TypeError (its traceback points into the step)."""
  generate, _ = scripted_generate({"1*2=": "calc(1*2)"})
  sampling = SamplingParams(max_new_tokens=12, n=2, stop_token_ids=(EOS,), seed=0)
  env = _Broken()
  steps = ToolSteps(env, 2, limit_s=10.0) if threads else None
  try:
    with pytest.raises(EnvironmentFailed, match=r"raised TypeError.*'calc\(1\*2\)'.*fix the environment") as info:
      run_episodes(generate, env, ["a"], [[1] + ids("1*2=")], sampling, tokenizer=TOK, response_width=32,
                   tool_steps=steps)
  finally:
    if steps is not None:
      steps.close()
  assert isinstance(info.value.__cause__, TypeError)
  assert info.value.__cause__.__traceback__.tb_next is not None  # the step's own frames


def test_a_step_past_its_limit_stops_the_rollout_and_the_threads_still_end():
  """A step still running limit_s after it started is the environment's bug (its tools bound their own
  time); the run stops and `close` does not wait for the stuck thread (a daemon)."""
  steps = ToolSteps(_Broken(sleep_s=1.0, bug=False), 1, limit_s=0.2)
  t0 = time.monotonic()
  with pytest.raises(EnvironmentFailed, match=r"still running 0.2 s after it started.*tool_timeout_s"):
    steps.run_all({0: ("a", [], "calc(1)")})
  steps.close()
  assert time.monotonic() - t0 < 0.9 and steps.overran
  assert all(t.daemon for t in steps._threads)


def test_the_step_limit_counts_from_the_start_and_no_thread_outlives_close():
  """Four 0.15 s steps on one thread, limit 0.25 s: the last waits 0.45 s in the queue and still
  answers (queueing is not running); after `close` every tool thread has ended."""
  steps = ToolSteps(_Broken(sleep_s=0.15, bug=False), 1, limit_s=0.25)
  out = steps.run_all({i: ("a", [], "calc(1)") for i in range(4)})
  assert [tr.observation for tr in out.values()] == ["[ok]"] * 4
  steps.close()
  assert not any(t.is_alive() for t in steps._threads) and not steps.overran


def test_tool_limits_in_the_config():
  assert EnvConfig(name="tools", max_turns=2, tool_timeout_s=7.0).step_limit_s == 7.0 + STEP_MARGIN_S
  for bad in (0.0, MAX_TOOL_TIMEOUT_S + 1):
    with pytest.raises(ConfigError, match=r"EnvConfig.tool_timeout_s: expected in \(0.0, 300.0\]"):
      EnvConfig(name="tools", max_turns=2, tool_timeout_s=bad)


def test_episode_metrics_count_every_tool_status():
  """tool/memory, tool/output_limit and tool/forbidden (the sandbox's statuses) are counted per batch
  beside tool/timeouts, each also in tool/errors."""
  from llamarl_jax.envs.episodes import EpisodeRows

  ep = EpisodeRows(_Broken(), ["a"], [[1]], 5, tokenizer=TOK, response_width=40, max_observation_tokens=8,
                   stop_token_ids=(EOS,))
  for i, status in enumerate(["ok", "timeout", "memory", "output_limit", "forbidden"]):
    ep.add_turn(i, np.array(ids("x") + [EOS]), np.zeros(2), np.zeros(2, np.int32), 2, FINISH_STOP)
    ep.add_transition(i, Transition(observation="[e]", done=False, call=ToolCall("python", status, 0.5)))
  m = ep.metrics(1.0)
  assert (m["tool/calls"], m["tool/errors"]) == (5, 4)
  assert [m[k] for k in ("tool/timeouts", "tool/memory", "tool/output_limit", "tool/forbidden")] == [1, 1, 1, 1]


def test_bucket():
  assert [_bucket(c, 64, 2) for c in (1, 2, 3, 17, 33, 64)] == [2, 2, 4, 32, 64, 64]
  assert _bucket(5, 48, 1) == 6 and _bucket(1, 7, 1) == 7


# ------------------------------------------------------------------------------------------------
# a real model: behaviour log-probs after a tool turn, and observations through the trainer

CONFIG = ModelConfig(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, max_position_embeddings=128, rope_theta=10000.0)


class EchoTool:
  """Every turn but the last gets an observation (the environment of a tool that always answers)."""
  max_turns = 3

  def step(self, example, turns, text):
    return Transition(observation=f"[{len(turns)}:{text[:3]}]", done=False)

  def answer(self, turns):
    return turns[-1]


@pytest.fixture(scope="module")
def random_model_episodes():
  _, params = split_params(Llama(CONFIG, rngs=nnx.Rngs(params=3)))
  sampler = Sampler(CONFIG, pad_id=0)
  # 40 stop tokens: the random model ends most turns within a few tokens (it never picks EOS alone)
  sampling = SamplingParams(temperature=1.0, max_new_tokens=6, n=4, stop_token_ids=tuple(range(2, 42)), seed=11)
  prompts = [[1] + ids("12*3="), [1] + ids("7*8=")]
  out = run_episodes(lambda p, s: sampler.generate(params, p, s, policy_version=0).to_host(), EchoTool(),
                     ["a", "b"], prompts, sampling, tokenizer=TOK, response_width=40, max_observation_tokens=8)
  return params, out


def test_behaviour_logprobs_after_tool_turns_equal_teacher_forced(random_model_episodes):
  """Every model token, in every turn (after 0, 1 or 2 observations), was sampled with the log-prob a
  single teacher-forced forward over the whole episode gives it (the trainer's, lag 0): the re-prefilled
  context is the same computation as one uninterrupted forward. fp32 on CPU: the two paths sum the
  same products in different orders (cache vs full attention), ~1e-6 apart; 1e-4 leaves margin."""
  params, out = random_model_episodes
  r = out.rollout
  graphdef, _ = split_params(Llama(CONFIG, rngs=nnx.Rngs(params=0)))
  teacher = np.asarray(jax.jit(functools.partial(token_logprobs, graphdef))(
      params, r.prompt_tokens, r.prompt_mask, r.response_tokens, r.response_mask))
  mask = r.response_mask > 0
  assert out.metrics["episode/turns_max"] == 3 and out.metrics["episode/turns_mean"] > 2
  np.testing.assert_allclose(teacher[mask], r.behaviour_logprobs[mask], atol=1e-4)
  assert np.all(r.behaviour_logprobs[~mask] == 0)


@pytest.mark.slow  # trainer / engine compilations
def test_observation_tokens_carry_no_loss_and_no_ratio(random_model_episodes):
  """A trainer step on the episodes is unchanged when the observation positions' behaviour log-probs
  hold garbage (+50, -inf, NaN): the loss, its metrics (ratio max, clipped fraction, KL) and the new
  params depend only on the model's tokens. With the mask widened to cover the observations the same
  garbage changes everything (the check can fail)."""
  params, out = random_model_episodes
  r = out.rollout
  adv = np.where(np.arange(r.batch_size) % 2, 1.0, -1.0).astype(np.float32)
  obs = (r.response_mask == 0) & (np.arange(r.response_mask.shape[1])[None] < r.lengths[:, None])
  garbage = r.behaviour_logprobs.copy()
  garbage[obs] = np.resize(np.array([50.0, -np.inf, np.nan], np.float32), obs.sum())

  def step(rollout):
    trainer = TrainerExecutor(CONFIG, parallel.make_mesh(jax.devices()[:1]), params,
                              optimizer=OptimizerConfig(lr=1e-3), loss_kwargs={"rho_max": 2.0})
    metrics = trainer.step(ScoredBatch(rollout=rollout, rewards=adv, advantages=adv))
    return metrics, jax.tree.map(np.asarray, trainer.params)

  m0, p0 = step(r)
  m1, p1 = step(r.replace(behaviour_logprobs=garbage))
  for k in ("loss/total", "train/grad_norm", "policy/ratio_max", "policy/kl_behaviour", "policy/frac_truncated"):
    assert m0[k] == m1[k], k
  jax.tree.map(np.testing.assert_array_equal, p0, p1)
  widened = (np.arange(r.response_mask.shape[1])[None] < r.lengths[:, None]).astype(np.int32)
  m2, _ = step(r.replace(behaviour_logprobs=np.where(obs, -50.0, r.behaviour_logprobs).astype(np.float32),
                         response_mask=widened))
  assert m2["policy/ratio_max"] > 1e6 * m0["policy/ratio_max"] and m2["policy/kl_behaviour"] > 1.0


# ------------------------------------------------------------------------------------------------
# the slot engine: rows leave for their tool step and come back into a free slot


class _Weights:
  """A weight source holding version 0 only (the generator's `take` / `wait_for_version` / `latest`)."""

  def __init__(self, params):
    self.params, self.version = params, 0

  def take(self, version, timeout):
    return (self.params, 0) if version <= 0 else None

  def wait_for_version(self, version, timeout):
    return version <= 0

  def latest(self):
    return self.params, 0


def _generate_batches(params, sampling, *, engine, num_batches=2, env=None, max_prompt_len=64):
  import threading

  from llamarl_jax.data import PromptSource
  from llamarl_jax.executors.generator import GeneratorExecutor
  from llamarl_jax.generation.engine import SlotEngine

  sampler = Sampler(CONFIG, pad_id=0)
  eng = (SlotEngine(CONFIG, lanes=4, sampling=sampling, max_prompt_len=max_prompt_len, chunk_steps=2,
                    kv_block_size=4) if engine else None)
  env_config = EnvConfig(name="tools", max_turns=3, max_total_tokens=40, max_observation_tokens=8)
  gen = GeneratorExecutor(sampler, TOK, PromptSource(task="arithmetic", seed=0), sampling, prompts_per_step=3,
                          max_policy_lag=10, seed=4, engine=eng, env=env or EchoTool(), env_config=env_config)
  out = []

  def emit(item):
    out.append(item)
    return len(out) < num_batches

  try:
    gen.run(_Weights(params), emit, threading.Event(), start_index=0, first_version=0)
  finally:
    gen.close()
  return out, eng


@pytest.mark.slow  # trainer / engine compilations
def test_slot_engine_episodes_equal_static_episodes_greedy(random_model_episodes):
  """Greedy, the two engines' episodes are the same tokens: on the slot engine a row's later turns are
  re-prefilled into whichever slot is free (4 slots for 3 prompts x 2 samples: rows wait for slots and
  turns of different batches interleave), on the static one all rows of a turn go together."""
  params, _ = random_model_episodes
  greedy = SamplingParams(temperature=0.0, max_new_tokens=6, n=2, stop_token_ids=tuple(range(2, 80)))
  static, _ = _generate_batches(params, greedy, engine=False)
  slots, _ = _generate_batches(params, greedy, engine=True)  # later turns exist only through re-inserts
  for a, b in zip(static, slots):
    assert a.metrics["episode/turns_max"] >= 2 and b.metrics["episode/turns_mean"] == a.metrics["episode/turns_mean"]
    np.testing.assert_array_equal(a.rollout.response_tokens, b.rollout.response_tokens)
    np.testing.assert_array_equal(a.rollout.response_mask, b.rollout.response_mask)
    np.testing.assert_array_equal(a.rollout.prompt_tokens[:, -5:], b.rollout.prompt_tokens[:, -5:])
    np.testing.assert_allclose(a.rollout.behaviour_logprobs, b.rollout.behaviour_logprobs, atol=1e-4)
    assert a.answers == b.answers


@pytest.mark.slow  # engine compilations
def test_an_episode_that_outgrows_the_slot_engine_ends_cut(random_model_episodes):
  """An engine whose longest prompt is 16 tokens: a row whose context (prompt + turn + observation) is
  longer after a tool step cannot start its next turn there; it ends cut (finish LENGTH, counted in
  episode/frac_cut) and the run goes on. Greedy, each row is a prefix of the same row on the static
  engine (no such limit): whole where its contexts fit, cut right after the observation that
  outgrew the engine otherwise."""
  params, _ = random_model_episodes
  greedy = SamplingParams(temperature=0.0, max_new_tokens=6, n=2, stop_token_ids=tuple(range(2, 80)))
  static, _ = _generate_batches(params, greedy, engine=False)
  slots, eng = _generate_batches(params, greedy, engine=True, max_prompt_len=16)
  assert eng.max_prompt_len == 16
  cut_here = 0
  for a, b in zip(static, slots):
    ra, rb = a.rollout, b.rollout
    prompt_len = rb.prompt_mask.sum(axis=1)
    for i in range(rb.batch_size):
      L = rb.lengths[i]
      np.testing.assert_array_equal(rb.response_tokens[i, :L], ra.response_tokens[i, :L])
      np.testing.assert_array_equal(rb.response_mask[i, :L], ra.response_mask[i, :L])
      if L < ra.lengths[i]:  # cut: the episode so far was longer than the engine's prompts
        assert rb.finish_reason[i] == FINISH_LENGTH and prompt_len[i] + L > 16 and rb.response_mask[i, L - 1] == 0
        cut_here += 1
      else:
        assert rb.finish_reason[i] == ra.finish_reason[i]
    assert b.metrics["episode/frac_cut"] == np.mean(rb.finish_reason == FINISH_LENGTH)
    assert b.metrics["episode/frac_cut"] >= a.metrics["episode/frac_cut"]
  assert cut_here > 0


@pytest.mark.slow  # engine compilations
@pytest.mark.parametrize("engine", [False, True])
def test_an_environment_bug_stops_the_generator_on_either_engine(random_model_episodes, engine):
  """Through the GeneratorExecutor's loop (static batches, or rows leaving and re-entering slots): the
  first turn that reaches the buggy step raises EnvironmentFailed out of `run`."""
  params, _ = random_model_episodes
  greedy = SamplingParams(temperature=0.0, max_new_tokens=6, n=2, stop_token_ids=tuple(range(2, 80)))
  with pytest.raises(EnvironmentFailed, match="raised TypeError") as info:
    _generate_batches(params, greedy, engine=engine, env=_Broken())
  assert isinstance(info.value.__cause__, TypeError)


@pytest.mark.slow  # trainer / engine compilations
def test_slot_engine_episodes_logprobs_equal_teacher_forced(random_model_episodes):
  """Sampled on the slot engine (temperature 1): every model token's behaviour log-prob, after 0, 1 or
  2 observations, equals the trainer's teacher-forced log-prob of the whole episode (lag 0)."""
  params, _ = random_model_episodes
  sampling = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, stop_token_ids=tuple(range(2, 42)))
  batches, _ = _generate_batches(params, sampling, engine=True)
  graphdef, _ = split_params(Llama(CONFIG, rngs=nnx.Rngs(params=0)))
  for item in batches:
    r = item.rollout
    teacher = np.asarray(jax.jit(functools.partial(token_logprobs, graphdef))(
        params, r.prompt_tokens, r.prompt_mask, r.response_tokens, r.response_mask))
    mask = r.response_mask > 0
    np.testing.assert_allclose(teacher[mask], r.behaviour_logprobs[mask], atol=1e-4)
  assert max(item.metrics["episode/turns_max"] for item in batches) == 3


def test_observations_through_a_chat_template():
  """With a chat template, an observation is the template's text between the end of the assistant
  turn (the model's stop token, already in the response) and the next assistant turn's start, with
  the tool result inside; without one, the text itself."""
  from llamarl_jax.envs.episodes import observation_ids

  chat = make_char_tokenizer()
  chat.chat_template = ("{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] }}"
                        "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
                        "{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}")
  assert TOK.decode(observation_ids(chat, "42")) == "\n<tool>42\n<assistant>"
  assert observation_ids(TOK, "[42]") == ids("[42]")
  chat.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if messages|length > 2 %}!{% endif %}"
  assert TOK.decode(observation_ids(chat, "7")) == "7!"  # no end-of-turn token: the suffix after the content
  chat.chat_template = ("{% for m in messages %}{% if loop.last %}{{ m['content'] }}{% else %}[{{ m['content'] }}]"
                        "{% endif %}{% endfor %}")  # an earlier turn rendered differently: no suffix exists
  with pytest.raises(ValueError, match="renders an earlier turn differently"):
    observation_ids(chat, "7")


def test_prompts_render_the_tools_through_the_chat_template():
  from llamarl_jax.data import PromptSource
  from llamarl_jax.envs import TOOL_SCHEMAS

  chat = make_char_tokenizer()
  chat.chat_template = ("{% if tools %}{{ 'tools:' }}{% for t in tools %}{{ t['function']['name'] + ';' }}{% endfor %}"
                        "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
  with_tools = PromptSource(task="arithmetic", seed=0, tokenizer=chat, tools=[TOOL_SCHEMAS["calc"]])
  plain = PromptSource(task="arithmetic", seed=0, tokenizer=chat)
  a, b = with_tools.next_batch(1)[0], plain.next_batch(1)[0]
  assert a.prompt == "tools:calc;" + b.prompt and a.chat
  assert "tools" in with_tools.fingerprint() and "tools" not in plain.fingerprint()


def test_tool_study_report_pairs_seeds(tmp_path):
  """scripts/tool_study_report.py: per-arm means over seeds and the paired difference, from summaries."""
  import importlib.util
  import json
  from pathlib import Path

  for name, before, after in (("tiny_tools", 5.0, (80.0, 90.0)), ("tiny_tools_notool", 1.0, (2.0, 4.0))):
    for seed, acc in enumerate(after):
      d = tmp_path / f"{name}_s{seed}"
      d.mkdir()
      (d / "summary.json").write_text(json.dumps({
          "eval_before_rl": before / 100, "eval_accuracy_window": acc / 100, "total_seconds": 600.0,
          "mean_step_seconds": 3.0, "evals": [{"eval/episode_tool_calls_mean": 1.0 if name == "tiny_tools" else 0.0}]}))
  spec = importlib.util.spec_from_file_location("tsr", Path(__file__).resolve().parents[1] / "scripts" / "tool_study_report.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  text = module.main(["--root", str(tmp_path)])
  assert "| calculator (configs/tiny_tools.gin) | 0,1 | 5.0 ± 0.0 | 85.0 ± 63.5 |" in text  # t(0.975,1)=12.71 x 5
  assert "+82.0 points" in text  # (80-2 + 90-4) / 2


class _TwoVersions(_Weights):
  """Version 0, then versions 1.. with other weights (the schedule asks for the versions it needs)."""

  def __init__(self, params0, params1):
    super().__init__(params0)
    self.params1, self.version = params1, 8

  def take(self, version, timeout):
    return (self.params if version == 0 else self.params1), version

  def wait_for_version(self, version, timeout):
    return True

  def latest(self):
    return self.params1, 8


@pytest.mark.slow  # engine compilations
def test_slot_engine_turns_after_a_weight_swap_have_the_new_weights_log_probs(random_model_episodes):
  """Lag 1 on the slot engine: batch k + 1 needs version k, and the swap to it comes while batch k's
  rows are between turns; their later turns are re-prefilled and sampled by the new weights. Every
  model token's behaviour log-prob equals the teacher-forced log-prob of the whole episode under the
  weights of its recorded version (version 0: the first weights, >= 1: the second; the context is
  re-prefilled by the new weights: exact, no mixed KV)."""
  import threading

  from llamarl_jax.data import PromptSource
  from llamarl_jax.executors.generator import GeneratorExecutor
  from llamarl_jax.generation.engine import SlotEngine

  params0, _ = random_model_episodes
  params1 = jax.tree.map(lambda x: x * 1.3, params0)
  sampling = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, stop_token_ids=tuple(range(2, 42)))
  eng = SlotEngine(CONFIG, lanes=4, sampling=sampling, max_prompt_len=64, chunk_steps=2, kv_block_size=4)
  gen = GeneratorExecutor(Sampler(CONFIG, pad_id=0), TOK, PromptSource(task="arithmetic", seed=0), sampling,
                          prompts_per_step=3, max_policy_lag=1, seed=4, engine=eng, env=EchoTool(),
                          env_config=EnvConfig(name="tools", max_turns=3, max_total_tokens=40, max_observation_tokens=8))
  out = []
  try:
    gen.run(_TwoVersions(params0, params1), lambda item: out.append(item) or len(out) < 3, threading.Event(),
            start_index=0, first_version=0)
  finally:
    gen.close()
  graphdef, _ = split_params(Llama(CONFIG, rngs=nnx.Rngs(params=0)))
  forward = jax.jit(functools.partial(token_logprobs, graphdef))
  mixed = 0
  for item in out:
    r = item.rollout
    mask = r.response_mask > 0
    for new, params in ((False, params0), (True, params1)):
      teacher = np.asarray(forward(params, r.prompt_tokens, r.prompt_mask, r.response_tokens, r.response_mask))
      sel = mask & ((r.token_versions > 0) == new)
      np.testing.assert_allclose(teacher[sel], r.behaviour_logprobs[sel], atol=1e-4)
    rows_mixed = [len(set(r.token_versions[i][mask[i]].tolist())) > 1 for i in range(r.batch_size)]
    mixed += sum(rows_mixed)
    assert np.all(r.policy_version == np.array([v[m][0] for v, m in zip(r.token_versions, mask)]))
  assert mixed > 0  # some episodes began under one version and went on under the next
