"""PPO with a critic: the clipped value loss against hand-derived numbers, the advantages the policy's
loss receives against GAE computed independently on the critic's values, and a short run on a tiny
model (trainer fsdp=2 beside a static generator dp=2, lag 1, PPO-clip) whose value loss falls and that resumes from a
checkpoint bit for bit, critic included."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llamarl_jax import losses, parallel
from llamarl_jax.config import ConfigError, CriticConfig, OptimizerConfig, run_config
from llamarl_jax.executors.trainer import TrainerExecutor
from llamarl_jax.batch import RolloutBatch, ScoredBatch
from llamarl_jax.model.config import ModelConfig
from llamarl_jax.model.llama import Llama, split_params
from llamarl_jax.train.placement import put_batch


# --------------------------------------------------------------------------------------------------
# the value loss


def test_clipped_value_loss_and_gradient_equal_hand_values():
  """clip 0.2; token 3 masked. Token 0: V=1 moved 0.5 above old=0.5, clipped to 0.7: (0.7-2)^2 = 1.69
  beats (1-2)^2 = 1 (the clipped error is larger; its gradient is 0: V_clip is saturated). Token 1:
  V_clip = 0.3, (0.3-1)^2 = 0.49 < (0-1)^2 = 1. Token 2: V_clip = 0.7, 0.49 < (2-0)^2 = 4.
  loss = 0.5 * (1.69 + 1 + 4) / 3 = 1.115; dloss/dV = (0, -1/3, 2/3, 0); unclipped 0.5 * 6 / 3 = 1."""
  values = jnp.array([[1.0, 0.0, 2.0, 5.0]])
  old = jnp.array([[0.5, 0.5, 0.5, 0.0]])
  returns = jnp.array([[2.0, 1.0, 0.0, 9.9]])
  mask = jnp.array([[1, 1, 1, 0]])
  (loss, metrics), grad = jax.value_and_grad(
      lambda v: losses.value_loss(v, old, returns, mask, clip=0.2), has_aux=True)(values)
  np.testing.assert_allclose(loss, 1.115, rtol=1e-6)  # fp32 round-off of a few terms
  np.testing.assert_allclose(grad, [[0.0, -1 / 3, 2 / 3, 0.0]], rtol=1e-6, atol=1e-7)
  assert metrics["critic/vf_clipfrac"] == pytest.approx(1 / 3) and metrics["critic/num_tokens"] == 3
  unclipped, _ = losses.value_loss(values, old, returns, mask, clip=None)
  np.testing.assert_allclose(unclipped, 1.0, rtol=1e-6)


def test_critic_settings_are_checked():
  with pytest.raises(ConfigError, match="CriticConfig.lam"):
    CriticConfig(lam=1.5)
  with pytest.raises(ConfigError, match="CriticConfig.value_clip"):
    CriticConfig(value_clip=0.0)
  with pytest.raises(ConfigError, match="pack"):
    run_config(critic=CriticConfig(), pack=True, tokens_per_microbatch=64)


# --------------------------------------------------------------------------------------------------
# the advantages the loss receives

CONFIG = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, max_position_embeddings=32, rope_theta=10000.0)
B, P, R = 4, 5, 6


def random_batch(seed) -> ScoredBatch:
  """B rows: prompts left-padded to P, responses right-padded to R, rewards in [0, 2)."""
  rng = np.random.RandomState(seed)
  pt, pm = np.zeros((B, P), np.int32), np.zeros((B, P), np.int32)
  rt, rm = np.zeros((B, R), np.int32), np.zeros((B, R), np.int32)
  for i, (p, r) in enumerate(zip([5, 2, 3, 1], [6, 3, 1, 4])):
    pt[i, P - p:], pm[i, P - p:] = rng.randint(1, CONFIG.vocab_size, p), 1
    rt[i, :r], rm[i, :r] = rng.randint(1, CONFIG.vocab_size, r), 1
  rollout = RolloutBatch(prompt_tokens=pt, prompt_mask=pm, response_tokens=rt, response_mask=rm,
                         behaviour_logprobs=np.where(rm > 0, -2.0, 0.0).astype(np.float32), lengths=rm.sum(1),
                         finish_reason=np.zeros(B, np.int32), group_ids=np.arange(B) // 2,
                         policy_version=np.zeros(B, np.int32), token_versions=np.zeros((B, R), np.int32))
  return ScoredBatch(rollout=rollout, rewards=rng.uniform(0, 2, B).astype(np.float32),
                     advantages=np.zeros(B, np.float32))


def reference_advantages(model, batch, gamma, lam):
  """Each row alone, unpadded, through the critic's own nnx forward (scores at every position); GAE by
  its backward recursion over the row's response tokens; whitened over all valid tokens (unbiased var)."""
  r = batch.rollout
  adv, ret = np.zeros((B, R)), np.zeros((B, R))
  for i in range(B):
    prompt = r.prompt_tokens[i][r.prompt_mask[i] > 0]
    n = int(r.response_mask[i].sum())
    row = np.concatenate([prompt, r.response_tokens[i, :n]])
    scores = np.asarray(model(jnp.asarray(row[None])))[0, :, 0]
    v = scores[len(prompt) - 1:len(prompt) - 1 + n]  # V(s_t): after the prompt and the response before t
    a, next_v = 0.0, 0.0
    for t in reversed(range(n)):
      reward = batch.rewards[i] if t == n - 1 else 0.0
      a = reward + gamma * next_v - v[t] + gamma * lam * a
      adv[i, t], ret[i, t], next_v = a, a + v[t], v[t]
  valid = r.response_mask > 0
  mean, std = adv[valid].mean(), adv[valid].std(ddof=1)
  return np.where(valid, (adv - mean) / np.sqrt(std ** 2 + 1e-8), 0.0), ret


@pytest.mark.slow
def test_the_loss_receives_gae_of_the_critics_values():
  """The trainer's advantages `[B, R]` for its policy step equal an independent computation: the
  critic's values by the nnx model's own forward row by row (no padding, no trainer layout), GAE by
  the textbook recursion, whitening in numpy (fp32 vs fp64 reference: 1e-5)."""
  _, policy = split_params(Llama(CONFIG, rngs=nnx.Rngs(params=0)))
  critic_model = Llama(CONFIG.replace(num_labels=1), rngs=nnx.Rngs(params=1))  # a random critic, head included
  critic = CriticConfig(gamma=0.9, lam=0.8, whiten=True)
  trainer = TrainerExecutor(CONFIG, parallel.make_mesh(jax.devices()[:1]), policy, critic=critic,
                            optimizer=OptimizerConfig(lr=1e-3))
  trainer.critic.state = trainer.critic.place(split_params(critic_model)[1])
  batch = random_batch(0)
  fed, _ = trainer.critic.step(put_batch(trainer.placement, batch, trainer.microbatches), batch.rewards)
  want_adv, want_ret = reference_advantages(critic_model, batch, 0.9, 0.8)
  np.testing.assert_allclose(np.asarray(fed["advantages"]), want_adv, rtol=1e-5, atol=1e-5)
  # the returns the critic regresses on: GAE's, from the values before this step's critic update
  _, returns, _, _ = trainer.critic.advantages(split_params(critic_model)[1], put_batch(trainer.placement, batch, trainer.microbatches),
                                               jnp.asarray(batch.rewards))
  np.testing.assert_allclose(np.asarray(returns), want_ret, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# a run: the value loss falls; exact resume


def one_plus_digit_one(response_text: str, ground_truth: str) -> float:
  """1, plus 1 when the response holds a '1': a reward the critic can learn from the tokens it reads."""
  return 1.0 + float("1" in response_text)


CRITIC = CriticConfig(optimizer=OptimizerConfig(lr=3e-3), value_clip=0.2, updates_per_step=2, warmup_steps=1)
KEYS = ("loss/total", "reward/mean", "train/grad_norm", "critic/vf_loss", "critic/vf_loss_last",
        "critic/values_mean", "policy/ratio_mean")


def controller(run_dir):
  from llamarl_jax.controller import Controller
  from llamarl_jax.data import PromptSource
  from llamarl_jax.executors.reward import RewardExecutor
  from llamarl_jax.tokenizer import make_char_tokenizer

  tokenizer = make_char_tokenizer()
  config = CONFIG.replace(vocab_size=len(tokenizer), tie_word_embeddings=True)
  _, params = split_params(Llama(config, rngs=nnx.Rngs(params=0)))
  reward = RewardExecutor(one_plus_digit_one, inline=True)
  run = run_config(reward_fn=reward.name, prompts_per_step=4, samples_per_prompt=2, max_new_tokens=6,
                   trainer_fsdp=2, generator_dp=2, optimizer=OptimizerConfig(lr=1e-3), max_policy_lag=1, seed=3,
                   generator_engine="static", critic=CRITIC, checkpoint_every=2, loss="ppo_clip")
  return Controller(config, params, tokenizer, PromptSource(task="arithmetic", seed=0), run_dir=run_dir, config=run,
                    reward=reward, progress=False)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
  run_dir = tmp_path_factory.mktemp("critic_full")
  c = controller(run_dir)
  try:
    steps = c.run(4)
    final = jax.tree.map(np.asarray, c.trainer.critic.state.params)
  finally:
    c.close()
  return run_dir, steps, final


@pytest.mark.devices(4)
@pytest.mark.slow
def test_ppo_critic_run_warms_up_the_critic_and_its_value_loss_falls(full_run):
  """Step 1 trains the critic only (warm-up); from step 2 the policy trains on the critic's advantages.
  The critic starts at V = 0; its targets are then the lambda-returns 0.95^k * r of rewards r in {1, 2}
  (k <= 5 tokens before a response's end: >= 0.77): its loss falls to well under half in 4 steps."""
  _, steps, _ = full_run
  assert [m["train/policy_updated"] for m in steps] == [0.0] + [1.0] * 3
  assert "loss/total" not in steps[0] and all(np.isfinite(m["loss/total"]) for m in steps[1:])
  vf = [m["critic/vf_loss"] for m in steps]
  assert vf[0] > 0.29, vf
  print("critic/vf_loss per step:", vf)  # 0.5 * E[R^2] with R >= 0.77
  assert vf[-1] < 0.5 * vf[0], vf
  assert all(m["critic/vf_loss_last"] < m["critic/vf_loss"] for m in steps)  # each batch's 2nd update fits better


@pytest.mark.devices(4)
@pytest.mark.slow
def test_ppo_critic_run_resumes_exactly(full_run, tmp_path):
  """Checkpoint 2 of the 4-step run, restored into a new controller that runs 2 more: its metrics and
  its critic's final params equal the uninterrupted run's, bit for bit."""
  run_dir, steps, final = full_run
  shutil.copytree(run_dir / "checkpoints" / "2", tmp_path / "checkpoints" / "2")
  resumed = controller(tmp_path)
  try:
    assert resumed.restore_checkpoint() == 2
    rest = resumed.run(2)
    got = jax.tree.map(np.asarray, resumed.trainer.critic.state.params)
  finally:
    resumed.close()
  for a, b in zip(steps[2:], rest):
    assert {k: a[k] for k in KEYS} == {k: b[k] for k in KEYS}
  jax.tree.map(np.testing.assert_array_equal, got, final)
