"""Qwen3-MoE against transformers' `Qwen3MoeForCausalLM` on the same weights.

Tolerance: fp32 on both sides, as `test_model.py` (1e-4 absolute on logits of magnitude ~1: only
summation order differs). Routing is discrete: the tiny models' routers are N(0, 1/hidden)
(`conftest.tiny_hf_model`), so top-k margins are far above fp32 rounding and both sides choose the
same experts; a wrong expert, weight or normalisation moves logits by ~0.1.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from llamarl_jax.model import load_hf_checkpoint, save_hf_checkpoint
from llamarl_jax.model.forward import prepare_params, scan_hidden_states
from llamarl_jax.model.llama import split_params

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


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("all_sparse", "sparse_step") else n
                                  for n in sorted(CONFIGS)])
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


@pytest.mark.slow
def test_train_step_adds_the_load_balancing_loss(make_hf_model):
  """A MoE trainer step reports `loss/moe_aux` equal to transformers' aux_loss over the step's rows
  (prompt then response from position 0, padding excluded) and its total loss is the NLL plus
  router_aux_loss_coef times it, the NLL from transformers' logits (fp32: 1e-5 relative)."""
  from llamarl_jax import losses
  from llamarl_jax.config import OptimizerConfig
  from llamarl_jax.batch import trainer_layout
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
  _, params = split_params(model)
  spec = StepSpec(model=config, loss=losses.nll_loss, optimizer=OptimizerConfig(lr=1e-3), logprob_chunk=None,
                  mismatch=False)
  _, metrics = jax.jit(functools.partial(train_step, spec))(init_state(params, spec.tx), batch)

  tokens, lengths, predict = trainer_layout(*(jnp.asarray(batch[k]) for k in ("prompt_tokens", "prompt_mask",
                                                                               "response_tokens", "response_mask")))
  mask = (np.arange(tokens.shape[1])[None] < np.asarray(lengths)[:, None]).astype(np.int64)
  with torch.no_grad():
    out = ref(torch.tensor(np.asarray(tokens), dtype=torch.long), attention_mask=torch.tensor(mask),
              output_router_logits=True)
  want_aux = float(out.aux_loss)
  # the NLL of the response tokens under transformers' logits at the positions that predict them
  logp = torch.log_softmax(out.logits.double(), dim=-1).numpy()
  lp = logp[np.arange(B)[:, None], np.asarray(predict), batch["response_tokens"]]
  nll = -float(np.sum(lp * rm)) / rm.sum()
  assert float(metrics["loss/moe_aux"]) == pytest.approx(want_aux, rel=1e-5)
  assert float(metrics["loss/total"]) == pytest.approx(nll + 0.5 * want_aux, rel=1e-5)


# -- decoding ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_static_sampler_and_slot_engine_greedy_equal_transformers_generate(make_hf_model):
  """Greedy decoding of a tiny Qwen3-MoE (sparse, dense, sparse layers) equals transformers'
  `generate` token for token, in the static sampler (left-padded batch, KV cache; behaviour
  log-probs equal to the full forward's within 1e-4) and in the paged slot engine (prompts in
  different buckets, KV blocks of 4; every chunk at its 3 lanes). Both serve the fused gate/up
  experts (`model.serving`)."""
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
                   chunk_steps=2, prompt_buckets=(8, 16), kv_block_size=4, min_decode_width=3, progress=False)
  eng.swap(model, 0)
  eng.submit(prompts, tags=[0, 1, 2])
  groups = eng.run()
  expected = hf_greedy(ref, prompts)
  assert sorted(g.tag for g in groups) == [0, 1, 2]
  for g in groups:
    np.testing.assert_array_equal(g.tokens[0], expected[g.tag])


def tiny_moe_config():
  """A tiny Qwen3-MoE of our own (sparse, dense, sparse layers; 4 experts, top-2)."""
  from llamarl_jax.model.config import ModelConfig

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
@pytest.mark.slow
def test_expert_sharded_trainer_steps_equal_the_unsharded_ones():
  """3 AIPO steps (+ the load-balancing loss) on fsdp=2 x expert=2 x tp=2, and on fsdp=4 alone, give
  the one-device run's losses, gradient norms (1e-5 relative) and params (1e-5 absolute: fp32, only
  summation order differs); the experts are sharded over `expert`, each device computing its own, or
  (fsdp alone) gathered, each device routing its own rows through all of them. The runs take 2
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
                     ("ep", parallel.make_mesh(jax.devices()[:8], fsdp=2, expert=2, tp=2)),
                     ("fsdp", parallel.make_mesh(jax.devices()[:4], fsdp=4))):
    trainer = TrainerExecutor(config, mesh, params, optimizer=OPT, loss_kwargs=LOSS_KW, microbatches=2)
    runs[name] = ([trainer.step(batch) for _ in range(3)], jax.device_get(trainer.params))
    if name == "ep":
      spec = trainer.params["layers"][0]["mlp"]["w_gate"].sharding.spec
      assert spec[0] == "expert", spec
  m1, p1 = runs["one"]
  assert m1[0]["loss/moe_aux"] > 0
  for name in ("ep", "fsdp"):
    m2, p2 = runs[name]
    for a, b in zip(m1, m2):
      for key in ("loss/total", "loss/moe_aux", "train/grad_norm"):
        np.testing.assert_allclose(b[key], a[key], rtol=1e-5, err_msg=f"{name} {key}")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(p1), jax.tree.leaves(p2)):
      np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=0, err_msg=f"{name} {jax.tree_util.keystr(path)}")


@pytest.mark.devices(4)
def test_fsdp_routes_each_devices_own_rows():
  """Under FSDP without expert parallelism (fsdp=4, expert=1) each device sorts and multiplies only its
  own quarter of the rows: the compiled program's only collectives gather the experts' weights (FSDP's
  per-layer gather), no array of rows crosses devices (partitioning the sort and the grouped matmuls
  across the batch instead all-reduces a [rows * k, embed] product), and its temporaries are under a
  third of one device's. The result equals the one-device one (fp32: summation order only)."""
  import re

  from jax.sharding import NamedSharding, PartitionSpec as P

  from llamarl_jax import parallel
  from llamarl_jax.model import moe

  N, E, F, X, k = 256, 32, 48, 8, 2
  rng = np.random.RandomState(0)
  x = jnp.asarray(rng.randn(N, E), jnp.float32)
  experts = jnp.asarray(np.argsort(rng.rand(N, X), axis=1)[:, :k], jnp.int32)
  weights = jnp.asarray(rng.rand(N, k), jnp.float32)
  w = [jnp.asarray(rng.randn(*s) / 8, jnp.float32) for s in ((X, E, F), (X, E, F), (X, F, E))]
  temps, outs = {}, {}
  for name, mesh in (("one", parallel.make_mesh(jax.devices()[:1])), ("fsdp", parallel.make_mesh(jax.devices()[:4], fsdp=4))):
    rows, embed = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P(None, "fsdp"))  # FSDP shards `embed`
    args = (jax.device_put(x, rows), jax.device_put(experts, rows), jax.device_put(weights, rows),
            [jax.device_put(a, embed) for a in w])
    fn = jax.jit(lambda x, e, g, w, mesh=mesh: moe.grouped_swiglu(x, e, g, (w[0], w[1]), w[2], mesh))
    compiled = fn.lower(*args).compile()
    temps[name] = compiled.memory_analysis().temp_size_in_bytes
    outs[name] = np.asarray(fn(*args))
    if name == "fsdp":
      collectives = re.findall(r"= f32\[([0-9,]*)\]\S* (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)",
                               compiled.as_text())
      assert collectives and {(shape, op) for shape, op in collectives} <= {(f"{X},{E},{F}", "all-gather"),
                                                                          (f"{X},{F},{E}", "all-gather")}, collectives
  assert temps["fsdp"] < temps["one"] / 3, temps
  np.testing.assert_allclose(outs["fsdp"], outs["one"], atol=1e-5, rtol=0)


EP_MESH = {"data": 2, "expert": 2, "tp": 2}  # 8 devices, each holding 2 of tiny_moe_config's 4 experts


@pytest.mark.devices(8)
@pytest.mark.slow
def test_an_expert_parallel_generator_samples_what_one_device_samples():
  """A generator mesh of data=2 x expert=2 x tp=2 samples the one-device generator's tokens and experts
  at every position, in the static sampler and in the slot engine (temperature 1, seed 1), with
  log-probs within 1e-5 (fp32: the experts' partial sums add up over `expert` in another order; 1e-6
  measured)."""
  from llamarl_jax import parallel
  from llamarl_jax.generation import Sampler, SamplingParams
  from llamarl_jax.generation.engine import SlotEngine

  config = tiny_moe_config()
  params = moe_params(config)
  sampling = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=1)
  runs = {}
  for name, mesh in (("one", parallel.make_mesh(jax.devices()[:1])),
                     ("ep", parallel.make_mesh(jax.devices()[:8], **EP_MESH))):
    static = jax.device_get(Sampler(config, mesh, batch_multiple=8).generate(params, routing_prompts(), sampling))
    engine = SlotEngine(config, mesh, lanes=8, sampling=sampling, max_prompt_len=16, chunk_steps=3,
                        prompt_buckets=(16,), kv_block_size=4, min_decode_width=8, progress=False)
    runs[name] = {"static": static, "slots": engine.generate(params, routing_prompts(), sampling)}
  for way in ("static", "slots"):
    one, ep = runs["one"][way], runs["ep"][way]
    np.testing.assert_array_equal(ep.response_tokens, one.response_tokens, err_msg=way)
    np.testing.assert_array_equal(ep.routing, one.routing, err_msg=way)
    np.testing.assert_allclose(ep.behaviour_logprobs, one.behaviour_logprobs, atol=1e-5, rtol=0, err_msg=way)


@pytest.mark.devices(8)
def test_an_expert_parallel_generators_decode_exchanges_only_partial_sums():
  """The slot engine's decode step on data=2 x expert=2 x tp=2 runs its MoE layers over the mesh
  (`moe.grouped_swiglu`): each device computes its own experts for its data group's rows and the
  `[lanes / data, embed]` partial outputs are summed over `expert`; no collective moves the
  `[lanes * k, ...]` rows sorted by expert, nor an expert's weights. (XLA partitioning the layer
  itself all-reduces those rows, and at Qwen3-30B-A3B's sizes on H100s all-gathers every expert's
  weights: BENCHMARKS.md.)"""
  import re

  from llamarl_jax import parallel
  from llamarl_jax.generation import Sampler, SamplingParams
  from llamarl_jax.generation.slot_programs import SlotPrograms

  config = tiny_moe_config()
  sampler = Sampler(config, parallel.make_mesh(jax.devices()[:8], **EP_MESH), prompt_buckets=(16,))
  lanes, E, F, X, k = 8, config.hidden_size, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok
  programs = SlotPrograms(config, sampler, num_slots=lanes, sampling=SamplingParams(max_new_tokens=8, n=2),
                          max_prompt_len=16, chunk_steps=2, pad_id=0, kv_block_size=4, min_decode_width=lanes)
  decode = next(key for key in programs.program_keys() if key[0] == "decode")
  text = programs.lower(decode).compile().as_text()
  moved = set(re.findall(r"= f32\[([0-9,]*)\]\S* (all-reduce|all-gather|all-to-all|reduce-scatter)", text))
  assert (f"{lanes // 2},{E}", "all-reduce") in moved, moved
  weights = {s for x in (X, X // 2) for f in (F, F // 2) for s in (f"{x},{E},2,{f}", f"{x},{f},{E}")}
  assert not {(s, op) for s, op in moved if s.startswith(f"{lanes * k},") or s in weights}, moved


# -- routing replay ------------------------------------------------------------------------------

# Every routing test samples these prompts (8 rows: 2 samples each, 8 new tokens); the static sampler
# and the slot engine both pad them to the prompt bucket 16, so the trainer programs below see one
# batch shape and compile once (module-level jits, one trainer per replay setting).
PROMPT_LENGTHS = (5, 9, 3, 7)


def routing_prompts():
  rng = np.random.RandomState(0)
  return [rng.randint(3, 64, n).tolist() for n in PROMPT_LENGTHS]


def _flippy_moe():
  """(config, fp32 host params): the tiny Qwen3-MoE with experts scaled x3 (a different expert changes
  the output) and the router x0.01 (small margins: bf16 and fp32 forwards route some tokens apart)."""
  config = tiny_moe_config()
  params = moe_params(config)
  for i in config.moe_layers:
    params["layers"][i]["mlp"] = {k: v * (0.01 if k == "router" else 3.0) for k, v in params["layers"][i]["mlp"].items()}
  return config, params


def _engine_rollout(config, params, prompts, sampling, min_decode_width=8, chunk_steps=3):
  """`SlotEngine.generate` of `prompts`: a lane per sample, one prompt bucket, KV blocks of 4, decode
  chunks of `chunk_steps` (rows finish in different chunks). min_decode_width 8: every chunk computes
  all lanes (3 programs); 1: the program set also holds the widths 2 and 1, which chunks take when
  at most that many rows are busy as they are dispatched. Returns (rollout, the engine's stats)."""
  from llamarl_jax.generation.engine import SlotEngine

  eng = SlotEngine(config, lanes=8, sampling=sampling, max_prompt_len=16, chunk_steps=chunk_steps, prompt_buckets=(16,),
                   kv_block_size=4, min_decode_width=min_decode_width, progress=False)
  rollout = eng.generate(params, prompts, sampling)
  return rollout, dict(eng.stats)


@pytest.fixture(scope="module")
def bf16_rollouts():
  """(config, fp32 params, {"static": batch, "slots": batch}): 8 rows of `_flippy_moe` sampled in bf16
  by the static sampler (device arrays) and by the slot engine (host numpy), routing recorded."""
  from llamarl_jax.generation import Sampler, SamplingParams

  config, params = _flippy_moe()
  gen_config = config.replace(dtype="bfloat16", param_dtype="bfloat16")
  gen_params = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), params)
  sampling = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=1)
  static = Sampler(gen_config, batch_multiple=8).generate(gen_params, routing_prompts(), sampling)
  slots, _ = _engine_rollout(gen_config, gen_params, routing_prompts(), sampling)
  return config, params, {"static": static, "slots": slots}


@functools.partial(jax.jit, static_argnums=0)
def replay_forward(config, params, batch, replay):
  """The trainer's log-probs `[B, R]` and routing trace of `batch`'s responses (fp32, prepared params),
  replaying `replay` (`routing_in_trainer_layout`) or, with None, routing by its own top-k."""
  from llamarl_jax.model.logprobs import policy_logprobs

  return policy_logprobs(config, params, batch.prompt_tokens, batch.prompt_mask, batch.response_tokens,
                         batch.response_mask, replay=replay, with_routing=True)


# the share of recorded (token, MoE layer) pairs an fp32 forward routes differently from the bf16
# static sampler in `bf16_rollouts` (measured; `test_routing_replay_...` asserts it)
DISAGREEMENT = 0.028846154


@pytest.mark.slow
def test_routing_replay_gives_the_trainer_the_bf16_generators_routing(bf16_rollouts):
  """A bf16 static sampler records each position's experts; an fp32 trainer forward that replays them
  gives log-probs within bf16 rounding of the behaviour log-probs (max 0.06 measured, bound 0.1),
  while without replay the forward routes some (token, layer) pairs differently (2.9% measured here,
  reported by `routing_disagreement`, not hidden) and those tokens' log-probs move far more (0.76
  measured, > 0.3 asserted)."""
  from llamarl_jax.batch import routing_in_trainer_layout, trainer_layout
  from llamarl_jax.model import moe

  config, params, rollouts = bf16_rollouts
  batch = rollouts["static"]
  P = batch.prompt_tokens.shape[1]
  assert batch.routing.shape == (8, P + 8, 2, 2)
  routing = np.asarray(batch.routing)
  assert (routing[:, P:P + 7] >= 0).all() and (routing[:, P + 7] == -1).all()  # the last token is never an input

  replay = routing_in_trainer_layout(batch.prompt_mask, batch.routing)
  prepared = prepare_params(jax.tree.map(jnp.asarray, params), "float32")
  lp_replay, trace_replay = replay_forward(config, prepared, batch, replay)
  lp_free, trace_free = replay_forward(config, prepared, batch, None)
  _, lengths, _ = trainer_layout(batch.prompt_tokens, batch.prompt_mask, batch.response_tokens, batch.response_mask)
  recorded = (np.arange(replay.shape[1])[None] < np.asarray(lengths)[:, None]) & (np.asarray(replay) >= 0).all((2, 3))
  disagreement = float(moe.routing_disagreement(trace_free.topk, replay, recorded))
  assert disagreement == pytest.approx(DISAGREEMENT, rel=1e-5)
  assert float(moe.routing_disagreement(trace_replay.topk, replay, recorded)) == disagreement  # own top-k, logged
  mask = np.asarray(batch.response_mask) > 0
  gap = lambda lp: np.abs(np.asarray(lp) - np.asarray(batch.behaviour_logprobs))[mask]
  assert gap(lp_replay).max() < 0.1
  assert gap(lp_free).max() > 0.3


@pytest.mark.slow
def test_slot_engine_records_the_static_samplers_routing():
  """The paged slot engine records each position's experts in the static sampler's format
  (`RolloutBatch.routing` `[B, P + R, moe layers, k]`, left-padded prompt then response, -1 where no
  forward ran: prompt padding, the last token, past a row's end): fp32, same prompts and seed, the
  same tokens and the same experts at every recorded position; and an fp32 trainer forward replaying
  them gives the behaviour log-probs (lag 0: fp32 rounding, 1e-4). Rows stop at different steps
  (stop tokens 3-11), decode chunks of one step."""
  from llamarl_jax.generation import Sampler, SamplingParams
  from llamarl_jax.batch import routing_in_trainer_layout

  config = tiny_moe_config()
  params = jax.tree.map(jnp.asarray, moe_params(config))
  prompts = routing_prompts()
  sampling = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=1, stop_token_ids=tuple(range(3, 12)))
  static = jax.device_get(Sampler(config, batch_multiple=8).generate(params, prompts, sampling))
  ours, _ = _engine_rollout(config, params, prompts, sampling, min_decode_width=1, chunk_steps=1)
  np.testing.assert_array_equal(ours.response_tokens, static.response_tokens)
  assert ours.routing.shape == static.routing.shape == (8, 16 + 8, 2, 2)
  assert ours.lengths.min() < 8  # a row stopped early: its routing ends there
  P = ours.prompt_tokens.shape[1]
  pm, rm = ours.prompt_mask > 0, ours.response_mask > 0
  inputs = np.concatenate([pm, rm & (np.arange(8)[None] < ours.lengths[:, None] - 1)], axis=1)  # [B, P + R]
  assert (ours.routing[inputs] >= 0).all() and (ours.routing[~inputs] == -1).all()
  np.testing.assert_array_equal(ours.routing[inputs], static.routing[inputs])
  np.testing.assert_array_equal(ours.routing[:, P:], static.routing[:, P:])

  lp, _ = replay_forward(config, prepare_params(params, "float32"), jax.tree.map(jnp.asarray, ours),
                         routing_in_trainer_layout(jnp.asarray(ours.prompt_mask), jnp.asarray(ours.routing)))
  np.testing.assert_allclose(np.asarray(lp)[rm], ours.behaviour_logprobs[rm], atol=1e-4, rtol=0)


@pytest.mark.slow
def test_trainer_replays_either_generators_routing_and_logs_the_disagreement(bf16_rollouts):
  """`TrainerExecutor` steps on the bf16 rollouts of both generators, with and without
  `routing_replay` (lr 0: each trainer keeps its params, so the batches see the same policy): both
  log `moe/routing_disagreement`, the trainer's own top-k against the generator's, the same either
  way (the static sampler's: the 2.9% of `DISAGREEMENT`; the slot engine's: > 1%), and replay cuts
  the trainer-generator mismatch (`rollout_corr/kl_k3`) by more than half (routing flips are most of
  this tiny model's gap). A batch without recorded routing trains too: replay falls back to the
  trainer's own top-k and no disagreement is counted."""
  from llamarl_jax import parallel
  from llamarl_jax.config import OptimizerConfig
  from llamarl_jax.executors.trainer import TrainerExecutor
  from llamarl_jax.batch import ScoredBatch

  config, params, rollouts = bf16_rollouts
  advantages = np.tile(np.float32([1.0, -1.0]), 4)
  batches = {name: ScoredBatch(rollout=jax.device_get(r), rewards=np.zeros(8, np.float32), advantages=advantages)
             for name, r in rollouts.items()}
  mesh = parallel.make_mesh(jax.devices()[:1])
  metrics = {}
  for replay in (False, True):
    trainer = TrainerExecutor(config, mesh, params, optimizer=OptimizerConfig(lr=0.0), loss_kwargs={"rho_max": 2.0},
                              routing_replay=replay)
    for name, batch in batches.items():
      metrics[name, replay] = trainer.step(batch)
  assert trainer.trace_count == 1
  for name in batches:
    off, on = metrics[name, False], metrics[name, True]
    assert on["moe/routing_disagreement"] == pytest.approx(off["moe/routing_disagreement"], rel=1e-6), name
    assert on["rollout_corr/kl_k3"] < 0.5 * off["rollout_corr/kl_k3"], name
  assert metrics["static", False]["moe/routing_disagreement"] == pytest.approx(DISAGREEMENT, rel=1e-5)
  assert metrics["slots", False]["moe/routing_disagreement"] > 0.01
  slots = batches["slots"]
  unrecorded = trainer.step(slots.replace(rollout=slots.rollout.replace(routing=None)))
  assert unrecorded["moe/routing_disagreement"] == 0 and np.isfinite(unrecorded["loss/total"])


def test_routing_replay_is_refused_where_it_cannot_replay():
  """`TrainConfig.routing_replay` (flat key `routing_replay`) is validated like the other keys, and
  refused naming the conflict: a dense model (the run's check and the trainer's), multi-turn episodes
  (no routing recorded for their rows), the packed layout (its step does not replay)."""
  from llamarl_jax import parallel
  from llamarl_jax.config import ConfigError, RunConfig, run_config
  from llamarl_jax.executors.trainer import TrainerExecutor
  from llamarl_jax.model.config import ModelConfig

  assert run_config(routing_replay=True).train.routing_replay is True
  with pytest.raises(ConfigError, match="routing_replay"):
    run_config(routing_replay="yes")
  with pytest.raises(ConfigError, match=r"routing_replay = True with TrainConfig.pack = True"):
    run_config(routing_replay=True, pack=True, tokens_per_microbatch=32)
  with pytest.raises(ConfigError, match=r"routing_replay = True with EnvConfig.name='tools'"):
    run_config(routing_replay=True, env_name="tools", max_turns=2)
  dense = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2)
  with pytest.raises(ConfigError, match=r"model is dense \(model_type 'llama', num_experts = 0\)"):
    run_config(routing_replay=True).check_model(dense)
  RunConfig().check_model(dense)  # off: any model
  run_config(routing_replay=True).check_model(tiny_moe_config())
  with pytest.raises(ValueError, match="this model is dense"):
    TrainerExecutor(dense, parallel.make_mesh(jax.devices()[:1]), None, routing_replay=True)


def test_bad_moe_configs_are_refused_with_the_field_named():
  """A qwen3_moe config.json without its expert fields, and a ModelConfig with more experts per token
  than experts, are refused naming what is wrong."""
  from llamarl_jax.model.hf import CheckpointError, config_from_hf
  from llamarl_jax.model.config import ModelConfig

  hf = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_experts_per_tok=2)
  with pytest.raises(CheckpointError, match=r"missing field\(s\) \['num_experts', 'moe_intermediate_size'\]"):
    config_from_hf(hf)
  with pytest.raises(ValueError, match=r"num_experts_per_tok \(5\) <= num_experts \(4\)"):
    ModelConfig(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=5, moe_intermediate_size=8)
