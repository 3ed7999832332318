"""A reward model as a reward source of a run: the combination with rule rewards, the rewards the
trainer receives equal to the reward model's own scores of the same rows, its metrics, and a crash
that stops the run with a clear error and keeps every trained step.

The policy is test_controller's tiny Llama on the arithmetic task (trainer FSDP 2, generator DP 2);
the reward model is a random tiny LlamaForSequenceClassification over the policy's vocabulary, saved
without a tokenizer, so it reads the policy's own token rows (prompt + response).
"""

import dataclasses

import jax
import numpy as np
import pytest

from llamarl_jax import build
from llamarl_jax.config import ConfigError, DynamicSampling, OptimizerConfig, RunConfig, run_config
from llamarl_jax.controller import Controller, ExecutorFailed, overlap_seconds
from llamarl_jax.data import PromptSource
from llamarl_jax.executors.reward import RewardExecutor
from llamarl_jax.executors.scoring import combine_rewards
from llamarl_jax.model.config import ModelConfig
from llamarl_jax.model.llama import Llama, split_params
from llamarl_jax.rewards import get_reward_fn
from llamarl_jax.rewards.reward_model import RewardModel
from llamarl_jax.tokenizer import make_char_tokenizer


def test_combine_rewards_hand_values():
  rule = np.array([1.0, 0.0, 1.0, 0.0])
  model = np.array([2.0, 4.0, -1.0, 3.0])
  groups = np.array([0, 0, 1, 1])
  # weights only: .5 * rule + 2 * model
  np.testing.assert_allclose(combine_rewards(rule, model, groups, 2, rule_weight=0.5, model_weight=2.0),
                             [4.5, 8.0, -1.5, 6.0], rtol=1e-6)
  # verifier gate at 1: the model term only where the rule accepted (rows 0 and 2)
  np.testing.assert_allclose(combine_rewards(rule, model, groups, 2, gate=1.0), [3.0, 0.0, 0.0, 0.0], rtol=1e-6)
  # batch: mean 2, population std sqrt((0 + 4 + 9 + 1) / 4) = sqrt(3.5) = 1.870829
  z = (model - 2.0) / np.sqrt(3.5)
  np.testing.assert_allclose(combine_rewards(rule, model, groups, 2, rule_weight=0.0, normalize="batch"), z,
                             rtol=1e-5)
  # group: group 0 (2, 4) -> -1, 1; group 1 (-1, 3) -> -1, 1 (mean +- std in each); eps 1e-6 -> 1e-6 off
  np.testing.assert_allclose(combine_rewards(rule, model, groups, 2, rule_weight=0.0, normalize="group"),
                             [-1.0, 1.0, -1.0, 1.0], rtol=1e-5)
  # a group whose scores are equal gets 0, not NaN
  assert combine_rewards(rule, np.array([5.0, 5.0, 1.0, 2.0]), groups, 2, rule_weight=0.0,
                         normalize="group")[:2].tolist() == [0.0, 0.0]


def test_reward_model_settings_are_flat_keys_and_checked():
  run = run_config(reward_model_path="/rm", reward_model_weight=2.0, reward_rule_weight=0.0,
                   reward_model_gate=1.0, reward_model_normalize="group", reward_model_dtype="bfloat16")
  r = run.reward
  assert (r.model_path, r.model_weight, r.rule_weight, r.model_gate, r.model_normalize, r.model_dtype) == (
      "/rm", 2.0, 0.0, 1.0, "group", "bfloat16")
  assert run.record()["reward_model"]["model_path"] == "/rm"
  assert "reward_model" not in RunConfig().record()  # runs without one record what they did before
  with pytest.raises(ConfigError, match=r"RewardConfig.model_normalize: expected one of \['none', 'batch', 'group'\]"):
    run_config(reward_model_normalize="zscore")
  with pytest.raises(ConfigError, match="RewardConfig.model_path=.* with RolloutConfig.dynamic_sampling"):
    run_config(reward_model_path="/rm", dynamic_sampling=DynamicSampling())
  with pytest.raises(ConfigError, match="RewardConfig.model_path='/rm' with MeshConfig.reward_dp = 0 .* across "
                                        "processes: there the reward model runs in processes of its own"):
    run_config(reward_model_path="/rm").check_layout(1, num_processes=2)
  run_config(reward_model_path="/rm", reward_dp=1).check_layout(1, num_processes=3)  # its own processes
  with pytest.raises(ConfigError, match="MeshConfig.reward_dp=2 gives devices to a reward model"):
    run_config(reward_dp=2)


def test_reward_mesh_takes_the_devices_after_the_trainer_and_the_generator():
  from llamarl_jax import parallel

  devices = jax.devices()[:8]
  layout = dict(trainer_fsdp=2, generator_dp=2, reward_dp=2, reward_tp=2, devices=devices)
  assert parallel.make_reward_mesh(**layout).devices.flatten().tolist() == devices[4:8]
  assert parallel.make_reward_mesh(**{**layout, "colocated": True, "generator_dp": 2}).devices.flatten().tolist() == \
      devices[2:6]
  assert parallel.make_reward_mesh(**{**layout, "reward_dp": 0}) is None
  counts = {k: v for k, v in layout.items() if k != "devices"}
  assert parallel.device_counts(**counts) == (2, 2, 4, 8)
  assert parallel.device_counts(**counts, colocated=True) == (2, 2, 4, 6)
  assert parallel.device_counts(**counts, trainer_expert=2, generator_expert=2) == (4, 4, 4, 12)
  with pytest.raises(ValueError, match="the reward model's 3x2 devices come after"):
    parallel.make_meshes(**{**layout, "reward_dp": 3})


def test_roles_put_the_reward_mesh_in_processes_of_its_own():
  """derive_roles across processes: the reward mesh's processes are a third role, never shared."""
  from types import SimpleNamespace

  from llamarl_jax.distributed import derive_roles

  def mesh(*processes):  # a mesh's devices as derive_roles reads them: each device's process_index
    return SimpleNamespace(devices=np.array([SimpleNamespace(process_index=p) for p in processes], dtype=object))

  roles = derive_roles(mesh(0, 0), mesh(1, 1), 3, reward_mesh=mesh(2, 2))
  assert (roles.trainer, roles.generator, roles.reward, roles.reward_leader) == ((0,), (1,), (2,), 2)
  assert roles.describe() == "0=trainer, 1=generator, 2=reward"
  assert derive_roles(mesh(0), mesh(1), 2).reward == ()
  with pytest.raises(ValueError, match=r"process\(es\) \[1\] own reward-model devices and trainer or generator"):
    derive_roles(mesh(0, 0), mesh(1, 1), 2, reward_mesh=mesh(1, 1))
  with pytest.raises(ValueError, match=r"process\(es\) \[3\] own no trainer, generator or reward-model device"):
    derive_roles(mesh(0), mesh(1), 4, reward_mesh=mesh(2))


@pytest.fixture(scope="module")
def tokenizer():
  return make_char_tokenizer()


@pytest.fixture(scope="module")
def policy(tokenizer):
  from flax import nnx

  config = ModelConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
  _, params = split_params(Llama(config, rngs=nnx.Rngs(params=0)))
  return config, params


@pytest.fixture(scope="module")
def reward_model_dir(tokenizer, tmp_path_factory):
  """A random LlamaForSequenceClassification over the policy's vocabulary, saved without a tokenizer."""
  from test_reward_model import tiny_hf_classifier

  path = tmp_path_factory.mktemp("rm") / "rm"
  tiny_hf_classifier("llama", seed=7, pad_token_id=tokenizer.pad_token_id, vocab_size=len(tokenizer)).save_pretrained(path)
  return path


pytestmark_devices = pytest.mark.devices(4)


def make_controller(policy, tokenizer, tmp_path, rm_path, **kw):
  config, params = policy
  defaults = dict(prompts_per_step=4, samples_per_prompt=2, max_new_tokens=6, trainer_fsdp=2, generator_dp=2,
                  optimizer=OptimizerConfig(lr=1e-3), step_timeout_s=120, max_policy_lag=0,
                  reward_model_path=str(rm_path))
  defaults.update(kw)
  run = run_config(reward_fn="arithmetic", **defaults)
  return Controller(config, params, tokenizer, PromptSource(task="arithmetic", seed=0), run_dir=tmp_path,
                    config=run, reward=RewardExecutor("arithmetic", inline=True), progress=False)


def _record(obj, name, log):
  real = getattr(obj, name)

  def wrapped(*args):
    out = real(*args)
    log.append((args, out))
    return out
  setattr(obj, name, wrapped)


@pytest.mark.parametrize("placement", [
    pytest.param("generator", marks=pytest.mark.slow),  # on the generator's 2 devices
    pytest.param("own", marks=pytest.mark.devices(6)),  # its own 2 devices beside trainer 2 + generator 2
    # trainer and generator on one 2-device mesh, taking turns; the reward model takes turns too
    pytest.param("colocated", marks=pytest.mark.slow)])
@pytestmark_devices
def test_trained_rewards_are_the_reward_models_scores_combined_with_the_rule(policy, tokenizer, tmp_path,
                                                                            reward_model_dir, placement):
  # on devices of its own, at lag 1: the reward model scores batch k while the generator generates k + 1
  c = make_controller(policy, tokenizer, tmp_path, reward_model_dir, reward_rule_weight=0.5, reward_model_weight=2.0,
                      reward_dp=2 if placement == "own" else 0, colocated=placement == "colocated",
                      max_policy_lag=1 if placement == "own" else 0)
  rm_devices = c.ex.reward_model.model.params["embed"].sharding.device_set
  want_devices = set(jax.devices()[4:6]) if placement == "own" else set(c.generator_mesh.devices.flat)
  assert rm_devices == want_devices
  assert (c.ex.reward_model.device_turn is c.ex.device_turn) == (placement == "colocated")
  scored_items, trained = [], []
  _record(c.ex.reward_model, "score", scored_items)
  _record(c.trainer, "step", trained)
  try:
    steps = c.run(3)
  finally:
    c.close()
  assert len(steps) == 3 and len(trained) == 3 and len(scored_items) >= 3
  direct = RewardModel.from_pretrained(reward_model_dir)  # one device, its own instance
  arithmetic = get_reward_fn("arithmetic")
  for ((item, texts), (scores, _)), ((batch,), _), metrics in zip(scored_items, trained, steps):
    # rows built here independently: each example's prompt encoded again, then the response up to its length
    per_prompt = len(item.rollout.lengths) // len(item.examples)
    rows = [item.examples[b // per_prompt].encode(tokenizer)
            + np.asarray(item.rollout.response_tokens)[b, :item.rollout.lengths[b]].tolist()
            for b in range(len(item.rollout.lengths))]
    want_scores = direct.score_tokens(rows)
    # the run's reward model is sharded over the generator's 2 devices: fp32 sums reordered, ~1e-6
    np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-5)
    rule = np.array([arithmetic(t, item.examples[b // per_prompt].ground_truth) for b, t in enumerate(texts)])
    np.testing.assert_allclose(np.asarray(batch.rewards), 0.5 * rule + 2.0 * want_scores, rtol=1e-5, atol=1e-5)
    assert metrics["reward/mean"] == pytest.approx(rule.mean())  # reward/* stays the verifier's
    assert metrics["reward/combined_mean"] == pytest.approx(float(np.mean(batch.rewards)), abs=1e-6)
    assert metrics["reward_model/score_mean"] == pytest.approx(float(want_scores.mean()), abs=1e-5)
    assert metrics["reward_model/latency_s"] > 0 and metrics["reward_model/rows_per_s"] > 0
  assert np.ptp(np.concatenate([s for (_, (s, _)) in scored_items])) > 0.01  # the scores vary: not a constant
  overlap = overlap_seconds(c.timeline, "reward", "generate")
  if placement == "own":  # scoring ran while the generator went on (the run summary's "overlap_seconds")
    assert overlap > 0
  elif placement == "colocated":  # one mesh: the executors take turns
    assert overlap_seconds(c.timeline, "generate", "train") == 0.0


@pytestmark_devices
def test_a_reward_model_crash_stops_the_run_and_keeps_every_trained_step(policy, tokenizer, tmp_path,
                                                                        reward_model_dir):
  c = make_controller(policy, tokenizer, tmp_path, reward_model_dir, checkpoint_every=5)
  real, calls = c.ex.reward_model.model.score_tokens, {"n": 0}

  def crashing(rows):
    calls["n"] += 1
    if calls["n"] == 3:
      raise RuntimeError("device lost")
    return real(rows)

  c.ex.reward_model.model.score_tokens = crashing
  try:
    with pytest.raises(ExecutorFailed, match=r"reward executor failed: RewardModelError: reward model .*rm "
                                             r"failed scoring batch 2: RuntimeError: device lost"):
      c.run(6)
    # lag 0: batch 2 is scored after step 2 trained; the run ended there and checkpointed it
    assert c.step == 2 and c.checkpointer.latest_step() == 2
  finally:
    c.close()


def test_a_reward_model_with_its_own_tokenizer_reads_the_text_through_its_chat_template(tmp_path, tokenizer):
  """Vocabularies differ (policy: characters; reward model: ChatML): the question and the decoded
  response are re-tokenised as a user/assistant conversation by the reward model's tokenizer."""
  from types import SimpleNamespace

  from conftest import chatml_tokenizer
  from test_reward_model import tiny_hf_classifier

  from llamarl_jax.data import PromptExample
  from llamarl_jax.executors.reward_model import RewardModelExecutor

  rm_tok = chatml_tokenizer()
  tiny_hf_classifier("qwen2", seed=3, pad_token_id=rm_tok.pad_token_id, vocab_size=len(rm_tok)).save_pretrained(
      tmp_path / "rm")
  model = RewardModel.from_pretrained(tmp_path / "rm", tokenizer=rm_tok)
  executor = RewardModelExecutor(model, tokenizer)
  assert executor.retokenize
  examples = [PromptExample(prompt="Q: 2+2=? A:", ground_truth="4", task="arithmetic", index=0, question="2+2=?")]
  responses = ["4", "five"]
  item = SimpleNamespace(index=0, examples=examples, rollout=SimpleNamespace(lengths=np.array([1, 4])))
  scores, metrics = executor.score(item, responses)
  want_rows = [rm_tok(rm_tok.apply_chat_template([{"role": "user", "content": "2+2=?"},
                                                  {"role": "assistant", "content": r}], tokenize=False))["input_ids"]
               for r in responses]
  np.testing.assert_array_equal(scores, model.score_tokens(want_rows))
  assert metrics["reward_model/rows_per_s"] > 0


def test_token_rows_need_a_vocabulary_that_holds_the_policys(tmp_path, tokenizer):
  from test_reward_model import tiny_hf_classifier

  from llamarl_jax.executors.reward_model import RewardModelExecutor

  tiny_hf_classifier("llama", vocab_size=len(tokenizer) - 1).save_pretrained(tmp_path / "small")
  with pytest.raises(ValueError, match="has no tokenizer to re-tokenise the text with"):
    RewardModelExecutor(RewardModel.from_pretrained(tmp_path / "small"), tokenizer)


@pytestmark_devices
def test_a_stuck_reward_model_times_out_naming_the_reward_executor_and_keeps_every_trained_step(
    policy, tokenizer, tmp_path, reward_model_dir):
  import time

  c = make_controller(policy, tokenizer, tmp_path, reward_model_dir, checkpoint_every=5)
  try:
    c.run(2)  # compiles everything under the default step timeout
    real, calls = c.ex.reward_model.model.score_tokens, {"n": 0}

    def stuck(rows):
      calls["n"] += 1
      if calls["n"] == 1:  # batch 2 (the next run's first): longer than the step timeout
        time.sleep(6.0)
      return real(rows)

    c.ex.reward_model.model.score_tokens = stuck
    c.config = dataclasses.replace(c.config, schedule=dataclasses.replace(c.config.schedule, step_timeout_s=1.5))
    with pytest.raises(TimeoutError, match=r"step 2: no scored batch within step_timeout_s = 1.5 s\. Stalled: the "
                                           r"reward executor \(.*the reward model is stuck\)"):
      c.run(4)
    assert c.step == 2 and c.checkpointer.latest_step() == 2
  finally:
    c.close()


def test_a_reward_model_without_weights_builds_the_rows_and_combination_of_the_loaded_one(reward_model_dir, tokenizer):
  """What a generator process holds across processes (`build.reward_model(weights=False)`): no device arrays,
  and the same token rows and combined rewards as the loaded model's executor, which scores them."""
  from types import SimpleNamespace

  from llamarl_jax.config import RewardConfig
  from llamarl_jax.data import PromptExample
  from llamarl_jax.executors.reward_model import RewardModelExecutor

  reward = RewardConfig(model_path=str(reward_model_dir), rule_weight=0.5, model_weight=2.0, model_normalize="group")
  loaded = build.reward_model(reward, tokenizer)
  rows_only = build.reward_model(reward, tokenizer, weights=False)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(rows_only.model.params))
  examples = [PromptExample(prompt=f"Q: {a}+1=? A:", ground_truth=str(a + 1), task="arithmetic", index=a) for a in (3, 7)]
  prompts = [ex.encode(tokenizer) for ex in examples]
  width = max(map(len, prompts))
  prompt_tokens = np.array([[0] * (width - len(p)) + p for p in prompts for _ in range(2)], np.int32)  # left-padded
  prompt_mask = (np.arange(width)[None] >= width - np.array([len(p) for p in prompts for _ in range(2)])[:, None])
  responses = np.array([[5, 6, 7, 0], [8, 9, 0, 0], [10, 11, 12, 13], [14, 0, 0, 0]], np.int32)
  rollout = SimpleNamespace(prompt_tokens=prompt_tokens, prompt_mask=prompt_mask.astype(np.int32),
                            response_tokens=responses, lengths=np.array([3, 2, 4, 1]), group_ids=np.array([0, 0, 1, 1]))
  item = SimpleNamespace(index=0, examples=examples, rollout=rollout)
  rows = rows_only.batch_rows(item)
  assert rows == loaded.batch_rows(item) and rows[1] == prompts[0] + [8, 9]
  scores, _ = loaded.score_rows(rows, 0)
  rule = np.array([1.0, 0.0, 0.0, 1.0], np.float32)
  np.testing.assert_array_equal(rows_only.combine(item, rule, scores), loaded.score_and_combine(item, rule)[0])
