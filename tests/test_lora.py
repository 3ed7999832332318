"""LoRA policies: the unmerged forward, adapter-only training, sharding, the adapter push and merge,
checkpoints, and PEFT's adapter format.

Tolerances: fp32 throughout. A LoRA policy whose `b` is zero computes `y + 0` for every adapted
projection: its log-probs are the base's bit for bit. The unmerged forward `x @ w + s (x @ a) @ b`
and the merged `x @ (w + s a @ b)` differ by fp32 summation order only (~1e-6 relative on log-probs
of a few units). Against transformers + PEFT (torch, fp32), logits agree to 1e-4 as the HF export
tests' do.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import mesh_at_most
from llamarl_jax import parallel
from llamarl_jax.config import LoraConfig, OptimizerConfig, TrainLayout
from llamarl_jax.executors.trainer import TrainerExecutor
from llamarl_jax.executors.weight_sync import WeightSync, tree_bytes
from llamarl_jax.batch import RolloutBatch, ScoredBatch
from llamarl_jax.model import lora as lora_lib
from llamarl_jax.model.config import ModelConfig
from llamarl_jax.model.forward import prepare_params
from llamarl_jax.model.llama import Llama, split_params
from llamarl_jax.model.logprobs import policy_logprobs

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, max_position_embeddings=64, rope_theta=10000.0)
LORA = LoraConfig(rank=4, alpha=8.0)  # every projection
B, P, R = 8, 6, 8
OPT = OptimizerConfig(lr=1e-2, eps=1e-6)


@pytest.fixture(scope="module")
def base_params():
  """Host params, numpy-filled (jit-compiling `init_model` costs seconds on CPU)."""
  _, shapes = split_params(nnx.eval_shape(lambda: Llama(CONFIG, rngs=nnx.Rngs(0))))
  rng = np.random.RandomState(0)
  init = lambda s: (np.ones(s.shape) if len(s.shape) == 1 else
                    rng.normal(0, 1 / np.sqrt(s.shape[0]), s.shape)).astype(np.float32)
  return jax.tree.map(init, shapes)


def random_adapters(seed, scale_b=0.1):
  """Adapters with a nonzero `b` (a trained adapter's stand-in)."""
  rng = np.random.RandomState(seed)
  init = lora_lib.init_adapters(CONFIG, LORA, seed)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: (rng.normal(0, scale_b, x.shape).astype(np.float32) if path[-1].key == "b" else x), init)


def make_batch(seed) -> ScoredBatch:
  """B rows of random prompts (left-padded) and responses (right-padded) of varied lengths;
  advantages alternate +1, -1; behaviour log-probs random in [-5, -1]."""
  rng = np.random.RandomState(seed)
  pt, pm = np.zeros((B, P), np.int32), np.zeros((B, P), np.int32)
  rt, rm = np.zeros((B, R), np.int32), np.zeros((B, R), np.int32)
  for i in range(B):
    p, r = rng.randint(1, P + 1), (R if i == 0 else rng.randint(1, R + 1))
    pt[i, P - p:], pm[i, P - p:] = rng.randint(1, CONFIG.vocab_size, p), 1
    rt[i, :r], rm[i, :r] = rng.randint(1, CONFIG.vocab_size, r), 1
  blp = np.where(rm > 0, rng.uniform(-5, -1, (B, R)), 0).astype(np.float32)
  adv = np.tile([1.0, -1.0], B // 2).astype(np.float32)
  rollout = RolloutBatch(prompt_tokens=pt, prompt_mask=pm, response_tokens=rt, response_mask=rm,
                         behaviour_logprobs=blp, lengths=rm.sum(-1).astype(np.int32),
                         finish_reason=np.zeros(B, np.int32), group_ids=np.arange(B, dtype=np.int32) // 2,
                         policy_version=np.zeros(B, np.int32), token_versions=np.zeros((B, R), np.int32))
  return ScoredBatch(rollout=rollout, rewards=(adv > 0).astype(np.float32), advantages=adv)


@functools.partial(jax.jit, static_argnames=("lora_scale",))
def logprobs(params, adapters, batch_arrays, lora_scale=1.0):
  """Response log-probs `[B, R]` of the trainer's forward; adapters None: the base alone."""
  lora = None if adapters is None else prepare_params(adapters, jnp.float32)
  return policy_logprobs(CONFIG, prepare_params(params, jnp.float32), *batch_arrays, lora=lora,
                         lora_scale=lora_scale)


def arrays(batch: ScoredBatch):
  r = batch.rollout
  return r.prompt_tokens, r.prompt_mask, r.response_tokens, r.response_mask


def host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


# --------------------------------------------------------------------------------------------------
# the forward


def test_initial_adapters_give_the_base_policy(base_params):
  """b = 0 adds exact zeros; the adapted forward is another compiled program, whose fusion may round
  a log-prob differently by an ulp (1e-6 relative), never more."""
  batch = arrays(make_batch(0))
  base = np.asarray(logprobs(base_params, None, batch))
  initial = np.asarray(logprobs(base_params, lora_lib.init_adapters(CONFIG, LORA, 0), batch,
                                lora_scale=lora_lib.scale(LORA)))
  np.testing.assert_allclose(initial, base, rtol=1e-6, atol=0)


def test_unmerged_forward_equals_merged_weights(base_params):
  """x @ w + s (x @ a) @ b on every projection == the merged weights' forward (fp32 order only)."""
  batch = arrays(make_batch(0))
  adapters = random_adapters(1)
  s = lora_lib.scale(LORA)
  unmerged = np.asarray(logprobs(base_params, adapters, batch, lora_scale=s))
  merged = np.asarray(logprobs(lora_lib.merge_adapters(base_params, adapters, s), None, batch))
  base = np.asarray(logprobs(base_params, None, batch))
  np.testing.assert_allclose(unmerged, merged, atol=2e-5, rtol=0)
  assert np.abs(unmerged - base).max() > 1e-2  # the adapters change the policy


def test_lora_dropout_is_unbiased_and_drawn_from_its_key(base_params):
  """Dropout on the adapters' input (inverted: kept entries scaled by 1 / (1 - p)): over 400 keys the
  mean low-rank update of one projection is the undropped one (within 5 standard errors: the
  update is linear in the input); through the trainer's forward a key gives the same log-probs twice,
  another key other ones."""
  from llamarl_jax.model.layers import LoraLayer, with_lora

  rng = np.random.RandomState(0)
  x = jnp.asarray(rng.normal(size=(2, 3, 8)), jnp.float32)
  weights = {"wq": {"a": jnp.asarray(rng.normal(size=(8, 2)), jnp.float32),
                    "b": jnp.asarray(rng.normal(size=(2, 4, 5)), jnp.float32)}}
  y = jnp.zeros((2, 3, 4, 5))
  undropped = np.asarray(with_lora(y, x, "wq", LoraLayer(weights, 2.0)))
  draws = np.asarray(jax.vmap(lambda k: with_lora(y, x, "wq", LoraLayer(weights, 2.0, k, 0.5)))(
      jax.random.split(jax.random.key(0), 400)))
  se = draws.std(0) / np.sqrt(len(draws))
  assert np.all(np.abs(draws.mean(0) - undropped) <= 5 * se + 1e-6)
  assert np.abs(draws[0] - undropped).max() > 0.1

  batch = arrays(make_batch(0))
  adapters = prepare_params(random_adapters(1), jnp.float32)
  forward = jax.jit(lambda key: policy_logprobs(CONFIG, prepare_params(base_params, jnp.float32), *batch,
                                                lora=adapters, lora_scale=2.0, lora_dropout=0.5, dropout_key=key))
  first, again, other = (np.asarray(forward(jax.random.key(k))) for k in (0, 0, 1))
  np.testing.assert_array_equal(first, again)
  assert np.abs(first - other).max() > 1e-3


# --------------------------------------------------------------------------------------------------
# training


@pytest.fixture(scope="module")
def lora_run(base_params):
  """One device, 3 LoRA steps on one batch: the trainer, its metrics and the sequence log-liks before/after."""
  batch = make_batch(1)
  trainer = TrainerExecutor(CONFIG, parallel.make_mesh(jax.devices()[:1]), base_params, optimizer=OPT,
                            loss_kwargs={"rho_max": 2.0}, lora=LORA)
  before = np.asarray(logprobs(base_params, None, arrays(batch))).sum(-1)
  metrics = [trainer.step(batch) for _ in range(3)]
  after = np.asarray(logprobs(base_params, host(trainer.params), arrays(batch),
                              lora_scale=lora_lib.scale(LORA))).sum(-1)
  return {"trainer": trainer, "batch": batch, "metrics": metrics, "before": before, "after": after}


def test_only_adapters_train(lora_run, base_params):
  trainer = lora_run["trainer"]
  # the frozen base: bit for bit the params it started from
  jax.tree.map(np.testing.assert_array_equal, host(trainer.base_params), base_params)
  # the optimizer's state is the adapters' (Adam's first moment has the adapters' structure)
  assert jax.tree.structure(trainer.opt_state[1][0].mu) == jax.tree.structure(trainer.params)
  assert tree_bytes(trainer.opt_state) < 3 * tree_bytes(trainer.params) + 1024
  assert all(m["train/update_applied"] == 1.0 for m in lora_run["metrics"])
  # the adapters learnt: the +1-advantage rows' log-likelihood rose, the -1 rows' fell
  delta = lora_run["after"] - lora_run["before"]
  adv = lora_run["batch"].advantages
  assert np.all(delta[adv > 0] > 0) and np.all(delta[adv < 0] < 0), delta


def test_policy_params_merge_the_adapters(lora_run, base_params):
  trainer = lora_run["trainer"]
  merged = host(trainer.policy_params())
  want = lora_lib.merge_adapters(base_params, host(trainer.params), lora_lib.scale(LORA))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=0), merged, host(want))


# --------------------------------------------------------------------------------------------------
# sharding


@pytest.mark.devices(4)
@pytest.mark.slow
def test_adapters_shard_like_the_matrices_they_adapt_and_train_the_same(lora_run, base_params):
  """fsdp=2 x tp=2, 2 microbatches grouped by length, full remat, log-probs in chunks of 3 positions:
  `a` keeps the adapted matrix's input sharding, `b` its output sharding, and 3 steps land where the
  one-device run's do (summation order only: 1e-5 on adapters after lr-1e-2 Adam steps)."""
  trainer = TrainerExecutor(CONFIG, parallel.make_mesh(jax.devices()[:4], fsdp=2, tp=2), base_params,
                            optimizer=OPT, loss_kwargs={"rho_max": 2.0}, lora=LORA, microbatches=2,
                            layout=TrainLayout("grouped"), remat="full", logprob_chunk=3)
  P_ = jax.sharding.PartitionSpec
  spec = lambda x: x.sharding.spec
  layer = trainer.params["layers"][0]
  assert spec(trainer.base_params["layers"][0]["attn"]["wq"]) == P_("fsdp", "tp", None)
  assert spec(layer["attn"]["wq"]["a"]) == P_("fsdp", None)
  assert spec(layer["attn"]["wq"]["b"]) == P_(None, "tp", None)
  assert spec(layer["attn"]["wo"]["a"]) == P_("tp", None, None)
  assert spec(layer["attn"]["wo"]["b"]) == P_(None, "fsdp")
  assert spec(layer["mlp"]["w_down"]["a"]) == P_("tp", None)
  assert spec(layer["mlp"]["w_down"]["b"]) == P_(None, "fsdp")
  for _ in range(3):
    trainer.step(lora_run["batch"])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=0), host(trainer.params),
               host(lora_run["trainer"].params))
  jax.tree.map(np.testing.assert_array_equal, host(trainer.base_params), base_params)


# --------------------------------------------------------------------------------------------------
# the push


@pytest.mark.devices(4)
def test_push_moves_only_the_adapters_and_the_generator_merges(lora_run, base_params):
  trainer = lora_run["trainer"]
  mesh = parallel.make_mesh(jax.devices()[2:4], data=2)
  abstract = nnx.eval_shape(lambda: Llama(CONFIG, rngs=nnx.Rngs(0)))
  axes = parallel.logical_axes(abstract)
  gen_shardings = parallel.param_shardings(split_params(abstract)[1], axes, mesh)
  adapter_shardings = parallel.param_shardings(lora_lib.adapter_shapes(CONFIG, LORA),
                                               lora_lib.adapter_axes(axes, LORA), mesh)
  sync = WeightSync(gen_shardings, dtype=jnp.float32, adapter_shardings=adapter_shardings,
                    lora_scale=lora_lib.scale(LORA), base=lambda: trainer.base_params)
  first = sync.push(trainer.params, 3)
  second = sync.push(trainer.params, 4)
  adapter_bytes = tree_bytes(trainer.params)
  assert first["sync/bytes"] == second["sync/bytes"] == adapter_bytes
  assert first["sync/base_bytes"] == tree_bytes(base_params) and "sync/base_bytes" not in second  # once
  assert adapter_bytes < 0.3 * tree_bytes(base_params)
  gen, version = sync.latest()
  assert version == 4
  assert all(x.sharding.mesh == mesh for x in jax.tree.leaves(gen))
  want = lora_lib.merge_adapters(base_params, host(trainer.params), lora_lib.scale(LORA))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=0), host(gen), host(want))


# --------------------------------------------------------------------------------------------------
# PEFT


def test_peft_adapter_round_trips_and_starts_a_trainer(tmp_path, base_params):
  adapters = random_adapters(2)
  path = lora_lib.save_peft_adapter(adapters, CONFIG, LORA, tmp_path / "adapter", base_model_name_or_path="base")
  loaded = lora_lib.load_peft_adapter(path, CONFIG, LORA)
  jax.tree.map(np.testing.assert_array_equal, loaded, adapters)
  trainer = TrainerExecutor(CONFIG, parallel.make_mesh(jax.devices()[:1]), base_params, optimizer=OPT,
                            lora=LORA, adapters=loaded)
  jax.tree.map(np.testing.assert_array_equal, host(trainer.params), adapters)
  with pytest.raises(ValueError, match="r: adapter 4, this run 8"):
    lora_lib.load_peft_adapter(path, CONFIG, LoraConfig(rank=8, alpha=8.0))


def test_peft_loads_our_adapter_onto_the_base_as_the_merged_export(tmp_path, base_params):
  """transformers + PEFT: PeftModel(base, our adapter directory) gives the logits of our merged HF
  export (fp32, 1e-4), which differ from the base's."""
  torch = pytest.importorskip("torch")
  peft = pytest.importorskip("peft")
  import transformers

  from llamarl_jax.model import hf
  from llamarl_jax.model.llama import merge_params

  graphdef = split_params(nnx.eval_shape(lambda: Llama(CONFIG, rngs=nnx.Rngs(0))))[0]
  adapters = random_adapters(3)
  s = lora_lib.scale(LORA)
  hf.save_hf_checkpoint(merge_params(graphdef, jax.tree.map(jnp.asarray, base_params)), CONFIG, tmp_path / "base")
  merged = lora_lib.merge_adapters(base_params, adapters, s)
  hf.save_hf_checkpoint(merge_params(graphdef, merged), CONFIG, tmp_path / "merged")
  lora_lib.save_peft_adapter(adapters, CONFIG, LORA, tmp_path / "adapter",
                             base_model_name_or_path=str(tmp_path / "base"))

  load = lambda p: transformers.AutoModelForCausalLM.from_pretrained(p, torch_dtype=torch.float32).eval()
  tokens = torch.tensor(np.random.RandomState(4).randint(0, CONFIG.vocab_size, (2, 12)))
  with torch.no_grad():
    base_logits = load(tmp_path / "base")(tokens).logits.numpy()
    peft_logits = peft.PeftModel.from_pretrained(load(tmp_path / "base"), tmp_path / "adapter")(tokens).logits.numpy()
    merged_logits = load(tmp_path / "merged")(tokens).logits.numpy()
  np.testing.assert_allclose(peft_logits, merged_logits, atol=1e-4, rtol=0)
  assert np.abs(peft_logits - base_logits).max() > 1e-2


@pytest.mark.slow
def test_another_loss_trains_adapters_with_a_kl_reference(base_params):
  """PPO-clip (the losses differ only in the pure function of the log-probs, `losses.py`; AIPO is
  `lora_run`) with a KL term to the initial policy and an entropy bonus: the KL is exactly 0 at the
  first step (b = 0: the policy is the base), the adapters move it away by the second, and the base
  stays bit for bit."""
  trainer = TrainerExecutor(CONFIG, parallel.make_mesh(jax.devices()[:1]), base_params, optimizer=OPT, loss="ppo_clip",
                            loss_kwargs={"entropy_coef": 0.01}, kl_coef=0.1, ref_params=base_params, lora=LORA,
                            lora_seed=1)
  batch = make_batch(2)
  first, second = trainer.step(batch), trainer.step(batch)
  assert first["policy/kl_ref"] == 0.0 and second["policy/kl_ref"] > 0.0
  assert np.isfinite(second["loss/total"]) and second["train/update_applied"] == 1.0
  jax.tree.map(np.testing.assert_array_equal, host(trainer.base_params), base_params)


# --------------------------------------------------------------------------------------------------
# a run: checkpoints and exact resume


@pytest.mark.devices(4)
@pytest.mark.slow
def test_lora_run_resumes_exactly_from_a_checkpoint(tmp_path):
  """Lag 1 ('fixed'), trainer fsdp=2 beside a static generator dp=2 (the slot engine's swap to LoRA
  weights: test_engine.py), LoRA dropout on, a base that is no file's
  weights (as after a warm start): a 4-step run checkpoints at step 2; a new controller built from
  other weights restores that checkpoint and runs 2 more; its metrics and adapters equal the
  uninterrupted run's, bit for bit."""
  import shutil

  from llamarl_jax.config import run_config
  from llamarl_jax.controller import Controller
  from llamarl_jax.data import PromptSource
  from llamarl_jax.executors.reward import RewardExecutor
  from llamarl_jax.tokenizer import make_char_tokenizer

  tokenizer = make_char_tokenizer()
  config = CONFIG.replace(vocab_size=len(tokenizer), tie_word_embeddings=True)
  _, params = split_params(Llama(config, rngs=nnx.Rngs(params=0)))
  warm = jax.tree.map(lambda x: x * 1.5, params)  # the base RL starts from

  def controller(run_dir, **kw):
    run = run_config(reward_fn="arithmetic", prompts_per_step=4, samples_per_prompt=2,
                     max_new_tokens=6, trainer_fsdp=2, generator_dp=2, optimizer=OPT, max_policy_lag=1, seed=3,
                     lora=LORA.replace(dropout=0.1), generator_engine="static", **kw)
    return Controller(config, params, tokenizer, PromptSource(task="arithmetic", seed=0), run_dir=run_dir,
                      config=run, reward=RewardExecutor("arithmetic", inline=True), progress=False)

  keys = ("loss/total", "reward/mean", "train/grad_norm", "policy/ratio_mean", "generate/response_length_mean")
  full = controller(tmp_path / "full", checkpoint_every=2)
  try:
    full.trainer.load_params(warm)
    whole = full.run(4)
    final = host(full.trainer.params)
  finally:
    full.close()
  assert whole[0]["sync/bytes"] == tree_bytes(final)  # every push: the adapters' bytes
  shutil.copytree(tmp_path / "full" / "checkpoints" / "2", tmp_path / "resumed" / "checkpoints" / "2")
  resumed = controller(tmp_path / "resumed", checkpoint_every=2)
  try:
    assert resumed.restore_checkpoint() == 2
    rest = resumed.run(2)
    jax.tree.map(np.testing.assert_array_equal, host(resumed.trainer.params), final)
    jax.tree.map(np.testing.assert_array_equal, host(resumed.trainer.base_params), host(warm))
  finally:
    resumed.close()
  for a, b in zip(whole[2:], rest):
    assert {k: a[k] for k in keys} == {k: b[k] for k in keys}


def test_tiny_lora_config_binds_lora_over_make_runs_configuration(monkeypatch):
  """configs/tiny_lora.gin: tiny_cpu.gin's run with a checked LoraConfig and 10x its learning rate."""
  import pathlib

  import gin

  from llamarl_jax import experiment
  from llamarl_jax.config_check import check_bindings

  root = pathlib.Path(__file__).resolve().parents[1]
  monkeypatch.chdir(root)
  try:
    gin.clear_config()
    experiment.parse_gin([str(root / "configs" / "tiny_cpu.gin")])
    full = experiment.configured_run_config()
    gin.clear_config()
    experiment.parse_gin([str(root / "configs" / "tiny_lora.gin")], ["LoraConfig.rank = 32"])
    check_bindings()
    run = experiment.configured_run_config()
  finally:
    gin.clear_config()
  assert run.train.lora == LoraConfig(rank=32, alpha=16.0)
  assert run.train.optimizer.lr == pytest.approx(10 * full.train.optimizer.lr)
  assert run.replace(train=run.train.replace(lora=None, optimizer=full.train.optimizer)) == full
