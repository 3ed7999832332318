"""Qwen3-MoE against transformers' `Qwen3MoeForCausalLM` on the same weights.

Tolerance: fp32 on both sides, as `test_model.py` (1e-4 absolute on logits of magnitude ~1: only
summation order differs). Routing is discrete: the tiny models' routers are N(0, 1/hidden)
(`conftest.tiny_hf_model`), so top-k margins are far above fp32 rounding and both sides choose the
same experts; a wrong expert, weight or normalisation moves logits by ~0.1.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from llamarl_jax.model import load_hf_checkpoint, save_hf_checkpoint
from llamarl_jax.model.llama import prepare_params, scan_hidden_states, split_params

# name: overrides of conftest's tiny Qwen3-MoE (2 layers, 4 experts, top-2, all layers sparse)
CONFIGS = {
    "all_sparse": {},
    "norm_topk": {"norm_topk_prob": True, "num_experts_per_tok": 3},
    "mlp_only_layers": {"num_hidden_layers": 3, "mlp_only_layers": [1]},  # sparse, dense, sparse
    "sparse_step": {"num_hidden_layers": 4, "decoder_sparse_step": 2, "tie_word_embeddings": True},  # dense, sparse x2
}


@nnx.jit
def run(model, tokens, positions, attention_mask):
  return model(tokens, positions=positions, attention_mask=attention_mask)


def right_padded(lengths, vocab, seed):
  rng = np.random.RandomState(seed)
  T = max(lengths)
  tokens = np.zeros((len(lengths), T), np.int64)
  mask = np.zeros((len(lengths), T), np.int64)
  for i, n in enumerate(lengths):
    tokens[i, :n] = rng.randint(1, vocab, n)
    mask[i, :n] = 1
  return tokens, mask


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(make_hf_model, name):
  """The model's forward (layers unrolled) and the trainer's (`scan_hidden_states`: layers under scan,
  one scan per run of dense or sparse layers) both equal transformers' logits at every real position."""
  ref, path = make_hf_model(family="qwen3_moe", **CONFIGS[name])
  config, model = load_hf_checkpoint(path)
  assert config.model_type == "qwen3_moe" and config.num_experts == 4
  assert config.moe_layers == tuple(i for i, layer in enumerate(ref.model.layers) if hasattr(layer.mlp, "experts"))
  tokens, mask = right_padded([20, 13, 6], config.vocab_size, seed=1)
  with torch.no_grad():
    want = ref(torch.tensor(tokens), attention_mask=torch.tensor(mask)).logits.numpy()
  positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
  ours = np.asarray(run(model, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask)))
  valid = mask.astype(bool)
  np.testing.assert_allclose(ours[valid], want[valid], atol=1e-4, rtol=0)

  prepared = prepare_params(split_params(model)[1], config.dtype)
  hidden = jax.jit(lambda p, t, n: scan_hidden_states(config, p, t, n))(prepared, jnp.asarray(tokens),
                                                                       jnp.asarray(mask.sum(1)))
  scanned = np.asarray(model.logits(hidden))
  np.testing.assert_allclose(scanned[valid], want[valid], atol=1e-4, rtol=0)


def test_aux_loss_matches_transformers(make_hf_model):
  """The load-balancing loss of the trainer's forward over right-padded rows (padding excluded) equals
  transformers' `aux_loss` (output_router_logits, the same attention mask), and the routing trace
  records transformers' top-k experts of every real token in every sparse layer."""
  ref, path = make_hf_model(family="qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1])
  config, model = load_hf_checkpoint(path)
  tokens, mask = right_padded([20, 13, 6], config.vocab_size, seed=2)
  with torch.no_grad():
    out = ref(torch.tensor(tokens), attention_mask=torch.tensor(mask), output_router_logits=True)
  prepared = prepare_params(split_params(model)[1], config.dtype)
  _, trace = jax.jit(lambda p, t, n: scan_hidden_states(config, p, t, n, with_routing=True))(
      prepared, jnp.asarray(tokens), jnp.asarray(mask.sum(1)))
  assert trace.topk.shape == (3, 20, 2, 2) and trace.counts.shape == (2, 4)
  np.testing.assert_allclose(float(trace.aux_loss()), float(out.aux_loss), rtol=1e-5)
  valid = mask.reshape(-1).astype(bool)
  for j, logits in enumerate(out.router_logits):  # [B * T, experts] per sparse layer
    want = torch.topk(logits, 2, dim=-1).indices.numpy()[valid]
    got = np.asarray(trace.topk[:, :, j]).reshape(-1, 2)[valid]
    np.testing.assert_array_equal(np.sort(got, -1), np.sort(want, -1))


@pytest.mark.parametrize("name", ["mlp_only_layers", "sparse_step"])
def test_round_trip_through_transformers(make_hf_model, tmp_path, name):
  """Export -> transformers loads Qwen3MoeForCausalLM with the same config and logits -> we load it
  back bit-equal."""
  import transformers

  ref, path = make_hf_model(family="qwen3_moe", **CONFIGS[name])
  config, model = load_hf_checkpoint(path)
  out = save_hf_checkpoint(model, config, tmp_path / "export")
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert type(reloaded).__name__ == "Qwen3MoeForCausalLM"
  for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
                "mlp_only_layers", "norm_topk_prob"):
    assert getattr(reloaded.config, field) == getattr(ref.config, field), field
  tokens = np.random.RandomState(3).randint(0, config.vocab_size, (2, 11))
  with torch.no_grad():
    np.testing.assert_array_equal(reloaded(torch.tensor(tokens)).logits.numpy(),
                                  ref(torch.tensor(tokens)).logits.numpy())
  config2, model2 = load_hf_checkpoint(out)
  assert config2 == config
  for a, b in zip(jax.tree.leaves(split_params(model)[1]), jax.tree.leaves(split_params(model2)[1])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_train_step_adds_the_load_balancing_loss(make_hf_model):
  """A MoE trainer step reports `loss/moe_aux` equal to transformers' aux_loss over the step's rows
  (prompt then response from position 0, padding excluded) and its total loss is the NLL plus
  router_aux_loss_coef times it (fp32: 1e-5 relative)."""
  import functools

  from llamarl_jax import losses
  from llamarl_jax.config import OptimizerConfig
  from llamarl_jax.generation.rollout import trainer_layout
  from llamarl_jax.model.logprobs import token_logprobs
  from llamarl_jax.train import StepSpec, init_state, train_step

  ref, path = make_hf_model(family="qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1], router_aux_loss_coef=0.5)
  config, model = load_hf_checkpoint(path)
  assert config.router_aux_loss_coef == 0.5
  rng = np.random.RandomState(4)
  B, P, R = 3, 5, 6
  pm = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]], np.int32)
  rm = np.array([[1] * 6, [1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]], np.int32)
  batch = {"prompt_tokens": rng.randint(1, config.vocab_size, (B, P)).astype(np.int32) * pm, "prompt_mask": pm,
           "response_tokens": rng.randint(1, config.vocab_size, (B, R)).astype(np.int32) * rm, "response_mask": rm,
           "behaviour_logprobs": np.zeros((B, R), np.float32), "advantages": np.zeros(B, np.float32),
           "token_versions": np.full((B, R), -1, np.int32)}
  graphdef, params = split_params(model)
  spec = StepSpec(model=config, loss=losses.nll_loss, optimizer=OptimizerConfig(lr=1e-3), logprob_chunk=None,
                  mismatch=False)
  _, metrics = jax.jit(functools.partial(train_step, spec))(init_state(params, spec.tx), batch)

  tokens, lengths, _ = trainer_layout(*(jnp.asarray(batch[k]) for k in ("prompt_tokens", "prompt_mask",
                                                                        "response_tokens", "response_mask")))
  mask = (np.arange(tokens.shape[1])[None] < np.asarray(lengths)[:, None]).astype(np.int64)
  with torch.no_grad():
    want_aux = float(ref(torch.tensor(np.asarray(tokens), dtype=torch.long), attention_mask=torch.tensor(mask),
                         output_router_logits=True).aux_loss)
  lp = token_logprobs(graphdef, params, *(batch[k] for k in ("prompt_tokens", "prompt_mask", "response_tokens",
                                                             "response_mask")))
  nll = -float(jnp.sum(lp)) / rm.sum()
  assert float(metrics["loss/moe_aux"]) == pytest.approx(want_aux, rel=1e-5)
  assert float(metrics["loss/total"]) == pytest.approx(nll + 0.5 * want_aux, rel=1e-5)


# -- decoding ------------------------------------------------------------------------------------


def test_static_sampler_and_slot_engine_greedy_equal_transformers_generate(make_hf_model):
  """Greedy decoding of a tiny Qwen3-MoE (sparse, dense, sparse layers) equals transformers'
  `generate` token for token, in the static sampler (left-padded batch, KV cache; behaviour
  log-probs equal to the full forward's within 1e-4) and in the paged slot engine (prompts in
  different buckets, KV blocks of 4). Both serve the fused gate/up experts (`model.serving`)."""
  from test_engine import hf_greedy
  from test_sampler import R, assert_greedy_matches_transformers

  from llamarl_jax.generation import Sampler, SamplingParams
  from llamarl_jax.generation.engine import SlotEngine

  ref, path = make_hf_model(family="qwen3_moe", vocab_size=68, num_hidden_layers=3, mlp_only_layers=[1])
  config, model = load_hf_checkpoint(path)
  rng = np.random.RandomState(0)
  prompts = [rng.randint(3, 68, n).tolist() for n in (5, 11, 3)]
  assert_greedy_matches_transformers(ref, model, Sampler(config, batch_multiple=8), prompts)

  eng = SlotEngine(config, lanes=3, sampling=SamplingParams(temperature=0, max_new_tokens=R), max_prompt_len=16,
                   chunk_steps=2, prompt_buckets=(8, 16), kv_block_size=4)
  eng.swap(model, 0)
  eng.submit(prompts, tags=[0, 1, 2])
  groups = eng.run()
  expected = hf_greedy(ref, prompts)
  assert sorted(g.tag for g in groups) == [0, 1, 2]
  for g in groups:
    np.testing.assert_array_equal(g.tokens[0], expected[g.tag])


def tiny_moe_config():
  """A tiny Qwen3-MoE of our own (sparse, dense, sparse layers; 4 experts, top-2)."""
  from llamarl_jax.model.llama import ModelConfig

  return ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                     head_dim=8, max_position_embeddings=64, rope_theta=10000.0, model_type="qwen3_moe",
                     num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=(1,))


@pytest.mark.devices(8)
@pytest.mark.parametrize("trainer,generator", [({"trainer_fsdp": 4}, {"generator_tp": 4}),
                                               ({"trainer_fsdp": 2, "trainer_expert": 2},
                                                {"generator_expert": 2, "generator_tp": 2})])
def test_push_between_meshes_is_exact(trainer, generator):
  """The weight push moves MoE weights like any other: trainer fsdp=4 -> generator tp=4 (experts'
  widths over tp), and between expert-sharded meshes (fsdp=2 x expert=2 -> expert=2 x tp=2); fp32
  bit-exact, bf16 the cast of each value; the router and experts arrive on the generator's shardings."""
  from llamarl_jax import parallel
  from llamarl_jax.executors.weight_sync import WeightSync
  from llamarl_jax.model.llama import abstract_model

  config = tiny_moe_config()
  trainer_mesh, gen_mesh = parallel.make_meshes(**trainer, **generator)
  abstract = abstract_model(config)
  _, shapes = split_params(abstract)
  axes = parallel.logical_axes(abstract)
  rng = np.random.default_rng(0)
  host = jax.tree.map(lambda s: rng.standard_normal(s.shape, dtype=np.float32), shapes)
  params = jax.device_put(host, parallel.param_shardings(shapes, axes, trainer_mesh))
  gen_shardings = parallel.param_shardings(shapes, axes, gen_mesh)
  want = ("expert" if "generator_expert" in generator else None, None, "tp")
  assert gen_shardings["layers"][0]["mlp"]["w_gate"].spec == jax.sharding.PartitionSpec(*want)
  for dtype in (jnp.float32, jnp.bfloat16):
    sync = WeightSync(gen_shardings, dtype=dtype)
    sync.push(params, version=1)
    gen, _ = sync.latest()
    for (path, t), g, sh in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(gen),
                                jax.tree.leaves(gen_shardings)):
      assert g.sharding == sh, path
      np.testing.assert_array_equal(np.asarray(g), np.asarray(t).astype(dtype))


# -- expert parallelism --------------------------------------------------------------------------


def moe_params(config, seed=0):
  """Host params of `config`, numpy-filled (N(0, 1/fan_in) matrices, unit norm scales)."""
  from llamarl_jax.model.llama import abstract_model

  _, shapes = split_params(abstract_model(config))
  rng = np.random.RandomState(seed)
  fan_in = lambda s: s.shape[-2] if len(s.shape) == 3 else s.shape[0]
  return jax.tree.map(lambda s: (np.ones(s.shape) if len(s.shape) == 1 else
                                 rng.normal(0, 1 / np.sqrt(fan_in(s)), s.shape)).astype(np.float32), shapes)


@pytest.mark.devices(8)
def test_expert_sharded_trainer_steps_equal_the_unsharded_ones():
  """3 AIPO steps (+ the load-balancing loss) on fsdp=2 x expert=2 x tp=2 give the one-device run's
  losses, gradient norms (1e-5 relative) and params (1e-5 absolute: fp32, only summation order
  differs); the experts are sharded over `expert`, each device computing its own. Both runs take 2
  microbatches: the load-balancing loss is each forward's own (as transformers'), not linear in rows."""
  from test_trainer import LOSS_KW, OPT, rows_batch

  from llamarl_jax import parallel
  from llamarl_jax.executors.trainer import TrainerExecutor

  config = tiny_moe_config().replace(router_aux_loss_coef=0.01)
  params = moe_params(config)
  rng = np.random.RandomState(1)
  batch = rows_batch(rng, rng.randint(1, 7, 8), np.r_[8, rng.randint(1, 9, 7)], 6, 8)
  runs = {}
  for name, mesh in (("one", parallel.make_mesh(jax.devices()[:1])),
                     ("ep", parallel.make_mesh(jax.devices()[:8], fsdp=2, expert=2, tp=2))):
    trainer = TrainerExecutor(config, mesh, params, optimizer=OPT, loss_kwargs=LOSS_KW, microbatches=2)
    runs[name] = ([trainer.step(batch) for _ in range(3)], jax.device_get(trainer.params))
    if name == "ep":
      spec = trainer.params["layers"][0]["mlp"]["w_gate"].sharding.spec
      assert spec[0] == "expert", spec
  (m1, p1), (m2, p2) = runs["one"], runs["ep"]
  for a, b in zip(m1, m2):
    for key in ("loss/total", "loss/moe_aux", "train/grad_norm"):
      np.testing.assert_allclose(b[key], a[key], rtol=1e-5, err_msg=key)
  assert m1[0]["loss/moe_aux"] > 0
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(p1), jax.tree.leaves(p2)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=0, err_msg=jax.tree_util.keystr(path))


# -- routing replay ------------------------------------------------------------------------------


def _flippy_moe():
  """(config, fp32 host params): the tiny Qwen3-MoE with experts scaled x3 (a different expert changes
  the output) and the router x0.01 (small margins: bf16 and fp32 forwards route some tokens apart)."""
  config = tiny_moe_config()
  params = moe_params(config)
  for i in config.moe_layers:
    params["layers"][i]["mlp"] = {k: v * (0.01 if k == "router" else 3.0) for k, v in params["layers"][i]["mlp"].items()}
  return config, params


@pytest.fixture(scope="module")
def bf16_rollout():
  """(config, fp32 params, batch): 8 rows sampled by a bf16 static sampler of `_flippy_moe`, its
  routing recorded."""
  from llamarl_jax.generation import Sampler, SamplingParams

  config, params = _flippy_moe()
  gen_params = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), params)
  rng = np.random.RandomState(0)
  prompts = [rng.randint(3, 64, n).tolist() for n in (5, 9, 3, 7)]
  batch = Sampler(config.replace(dtype="bfloat16", param_dtype="bfloat16"), batch_multiple=8).generate(
      gen_params, prompts, SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=1))
  return config, params, batch


# the share of recorded (token, MoE layer) pairs an fp32 forward routes differently from the bf16
# generator in `bf16_rollout` (measured; `test_routing_replay_...` asserts it)
DISAGREEMENT = 0.028846154


def test_routing_replay_gives_the_trainer_the_bf16_generators_routing(bf16_rollout):
  """A bf16 static sampler records each position's experts; an fp32 trainer forward that replays them
  gives log-probs within bf16 rounding of the behaviour log-probs (max 0.06 measured, bound 0.1),
  while without replay the forward routes some (token, layer) pairs differently (2.9% measured here,
  reported by `routing_disagreement`, not hidden) and those tokens' log-probs move far more (0.76
  measured, > 0.3 asserted)."""
  from llamarl_jax.generation.rollout import routing_in_trainer_layout, trainer_layout
  from llamarl_jax.model import moe
  from llamarl_jax.model.logprobs import policy_logprobs

  config, params, batch = bf16_rollout
  P = batch.prompt_tokens.shape[1]
  assert batch.routing.shape == (8, P + 8, 2, 2)
  routing = np.asarray(batch.routing)
  assert (routing[:, P:P + 7] >= 0).all() and (routing[:, P + 7] == -1).all()  # the last token is never an input

  replay = routing_in_trainer_layout(batch.prompt_mask, batch.routing)
  prepared = prepare_params(jax.tree.map(jnp.asarray, params), "float32")
  forward = jax.jit(lambda p, b, r: policy_logprobs(config, p, b.prompt_tokens, b.prompt_mask, b.response_tokens,
                                                    b.response_mask, replay=r, with_routing=True))
  lp_replay, trace_replay = forward(prepared, batch, replay)
  lp_free, trace_free = forward(prepared, batch, None)
  _, lengths, _ = trainer_layout(batch.prompt_tokens, batch.prompt_mask, batch.response_tokens, batch.response_mask)
  recorded = (np.arange(replay.shape[1])[None] < np.asarray(lengths)[:, None]) & (np.asarray(replay) >= 0).all((2, 3))
  disagreement = float(moe.routing_disagreement(trace_free.topk, replay, recorded))
  assert disagreement == pytest.approx(DISAGREEMENT, rel=1e-5)
  assert float(moe.routing_disagreement(trace_replay.topk, replay, recorded)) == disagreement  # own top-k, logged
  mask = np.asarray(batch.response_mask) > 0
  gap = lambda lp: np.abs(np.asarray(lp) - np.asarray(batch.behaviour_logprobs))[mask]
  assert gap(lp_replay).max() < 0.1
  assert gap(lp_free).max() > 0.3


def test_train_step_replays_routing_and_logs_the_disagreement(bf16_rollout):
  """The trainer's step on the bf16 rollout, with and without `routing_replay`: both log
  `moe/routing_disagreement` (the same 2.9% of recorded pairs: the trainer's own top-k against the
  generator's), and replay cuts the trainer-generator mismatch (`rollout_corr/kl_k3`) by more than
  half (routing flips are most of this tiny model's gap)."""
  import functools

  from llamarl_jax import losses
  from llamarl_jax.config import OptimizerConfig
  from llamarl_jax.train import StepSpec, init_state, train_step

  config, params, batch = bf16_rollout
  arrays = {"prompt_tokens": batch.prompt_tokens, "prompt_mask": batch.prompt_mask,
            "response_tokens": batch.response_tokens, "response_mask": batch.response_mask,
            "behaviour_logprobs": batch.behaviour_logprobs, "advantages": jnp.tile(jnp.array([1.0, -1.0]), 4),
            "token_versions": batch.token_versions, "routing": batch.routing}
  metrics = {}
  for replay_on in (False, True):
    spec = StepSpec(model=config, loss=losses.aipo_loss, optimizer=OptimizerConfig(lr=1e-3), logprob_chunk=None,
                    loss_kwargs={"rho_max": 2.0}, routing_replay=replay_on)
    _, metrics[replay_on] = jax.jit(functools.partial(train_step, spec))(init_state(params, spec.tx), arrays)
  for m in metrics.values():
    assert float(m["moe/routing_disagreement"]) == pytest.approx(DISAGREEMENT, rel=1e-5)
  kl = lambda m: float(m["rollout_corr/kl_k3"])
  assert kl(metrics[True]) < 0.5 * kl(metrics[False])


def _engine_rollout(config, params, prompts, sampling):
  """`SlotEngine.generate` of `prompts` (lanes for every sample, KV blocks of 4, decode chunks of 3
  steps: rows finish in different chunks)."""
  from llamarl_jax.generation.engine import SlotEngine

  eng = SlotEngine(config, lanes=8, sampling=sampling, max_prompt_len=16, chunk_steps=3, prompt_buckets=(8, 16),
                   kv_block_size=4, progress=False)
  return eng.generate(params, prompts, sampling)


def test_slot_engine_records_the_static_samplers_routing():
  """The paged slot engine records each position's experts in the static sampler's format
  (`RolloutBatch.routing` `[B, P + R, moe layers, k]`, left-padded prompt then response, -1 where no
  forward ran: prompt padding, the last token, past a row's end): fp32, same prompts and seed, the
  same tokens and the same experts at every recorded position; and an fp32 trainer forward replaying
  them gives the behaviour log-probs (lag 0: fp32 rounding, 1e-4)."""
  from llamarl_jax.generation import Sampler, SamplingParams
  from llamarl_jax.generation.rollout import routing_in_trainer_layout
  from llamarl_jax.model.logprobs import policy_logprobs

  config = tiny_moe_config()
  params = jax.tree.map(jnp.asarray, moe_params(config))
  rng = np.random.RandomState(0)
  prompts = [rng.randint(3, 64, n).tolist() for n in (5, 9, 3, 7)]
  sampling = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=1, stop_token_ids=(5,))
  static = jax.device_get(Sampler(config, batch_multiple=8).generate(params, prompts, sampling))
  ours = _engine_rollout(config, params, prompts, sampling)
  np.testing.assert_array_equal(ours.response_tokens, static.response_tokens)
  assert ours.routing.shape == static.routing.shape == (8, 16 + 8, 2, 2)
  P = ours.prompt_tokens.shape[1]
  pm, rm = ours.prompt_mask > 0, ours.response_mask > 0
  inputs = np.concatenate([pm, rm & (np.arange(8)[None] < ours.lengths[:, None] - 1)], axis=1)  # [B, P + R]
  assert (ours.routing[inputs] >= 0).all() and (ours.routing[~inputs] == -1).all()
  np.testing.assert_array_equal(ours.routing[inputs], static.routing[inputs])
  np.testing.assert_array_equal(ours.routing[:, P:], static.routing[:, P:])

  forward = jax.jit(lambda p, b, r: policy_logprobs(config, p, b.prompt_tokens, b.prompt_mask, b.response_tokens,
                                                    b.response_mask, replay=r))
  lp = forward(prepare_params(params, "float32"), jax.tree.map(jnp.asarray, ours),
               routing_in_trainer_layout(jnp.asarray(ours.prompt_mask), jnp.asarray(ours.routing)))
  np.testing.assert_allclose(np.asarray(lp)[rm], ours.behaviour_logprobs[rm], atol=1e-4, rtol=0)


def test_trainer_replays_the_slot_engines_bf16_routing():
  """A bf16 slot engine's rollout of `bf16_rollout`'s model (routing flips between bf16 and fp32)
  trained by `TrainerExecutor` with and without `routing_replay`: both log
  `moe/routing_disagreement` (the trainer's own top-k against the recorded: > 0, the same either
  way), and replay cuts the trainer-generator mismatch (`rollout_corr/kl_k3`) by more than half; a
  batch without recorded routing trains too (replay falls back to the trainer's own top-k)."""
  from llamarl_jax import parallel
  from llamarl_jax.executors.trainer import TrainerExecutor
  from llamarl_jax.config import OptimizerConfig
  from llamarl_jax.generation import SamplingParams
  from llamarl_jax.generation.rollout import ScoredBatch

  config, params = _flippy_moe()
  gen_params = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), params)
  rng = np.random.RandomState(0)
  prompts = [rng.randint(3, 64, n).tolist() for n in (5, 9, 3, 7)]
  rollout = _engine_rollout(config.replace(dtype="bfloat16", param_dtype="bfloat16"), gen_params, prompts,
                            SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=1))
  batch = ScoredBatch(rollout=rollout, rewards=np.zeros(8, np.float32),
                      advantages=np.tile(np.float32([1.0, -1.0]), 4))
  mesh = parallel.make_mesh(jax.devices()[:1])
  metrics = {}
  for replay in (False, True):
    trainer = TrainerExecutor(config, mesh, params, optimizer=OptimizerConfig(lr=1e-3), loss_kwargs={"rho_max": 2.0},
                              routing_replay=replay)
    metrics[replay] = trainer.step(batch)
  assert metrics[False]["moe/routing_disagreement"] > 0.01
  assert metrics[True]["moe/routing_disagreement"] == pytest.approx(metrics[False]["moe/routing_disagreement"])
  assert metrics[True]["rollout_corr/kl_k3"] < 0.5 * metrics[False]["rollout_corr/kl_k3"]
  unrecorded = trainer.step(batch.replace(rollout=rollout.replace(routing=None)))
  assert unrecorded["moe/routing_disagreement"] == 0 and np.isfinite(unrecorded["loss/total"])


def test_bad_moe_configs_are_refused_with_the_field_named():
  """A qwen3_moe config.json without its expert fields, and a ModelConfig with more experts per token
  than experts, are refused naming what is wrong."""
  from llamarl_jax.model.hf import CheckpointError, config_from_hf
  from llamarl_jax.model.llama import ModelConfig

  hf = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_experts_per_tok=2)
  with pytest.raises(CheckpointError, match=r"missing field\(s\) \['num_experts', 'moe_intermediate_size'\]"):
    config_from_hf(hf)
  with pytest.raises(ValueError, match=r"num_experts_per_tok \(5\) <= num_experts \(4\)"):
    ModelConfig(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=5, moe_intermediate_size=8)
