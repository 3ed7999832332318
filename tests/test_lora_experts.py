"""LoRA on a Qwen3-MoE's experts: per-expert adapters, the trainer's unmerged forward (grouped matmuls
over the rows sorted by expert) against the generator's merged weights, adapter-only training, and
PEFT's per-expert adapter format loaded by PEFT onto transformers' (fused-expert) Qwen3-MoE.

Tolerances: fp32 throughout. The unmerged forward `x @ w_x + s (x @ a_x) @ b_x` and the merged
`x @ (w_x + s a_x @ b_x)` differ by fp32 summation order only (~1e-6 relative on log-probs of a few
units, as tests/test_lora.py); the router sees the same hidden states up to that order, and at these
seeds no token's top-k is within 1e-5 of a tie, so both forwards route alike. Against transformers +
PEFT (torch, fp32), logits agree to 1e-4 as the HF export tests' do.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_hf_model
from llamarl_jax import parallel
from llamarl_jax.batch import trainer_layout
from llamarl_jax.config import LoraConfig, OptimizerConfig
from llamarl_jax.executors.trainer import TrainerExecutor
from llamarl_jax.executors.weight_sync import WeightSync, tree_bytes
from llamarl_jax.field_rules import ConfigError
from llamarl_jax.model import lora as lora_lib
from llamarl_jax.model.forward import prepare_params
from llamarl_jax.model.hf import load_hf_checkpoint
from llamarl_jax.model.llama import Llama, merge_params, split_params
from llamarl_jax.model.logprobs import policy_logprobs
from test_lora import arrays, host, make_batch

LORA = LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "expert_gate", "expert_up", "expert_down"))
EXPERTS_ONLY = LoraConfig(rank=4, alpha=8.0, targets=("expert_gate", "expert_up", "expert_down"))
OPT = OptimizerConfig(lr=1e-2, eps=1e-6)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
  """A tiny random Qwen3-MoE (2 sparse layers, 4 experts of 16, top-2) saved by transformers and loaded
  here: (its directory, our config, host params, the torch model)."""
  path = tmp_path_factory.mktemp("moe") / "base"
  ref = tiny_hf_model("qwen3_moe", seed=0, vocab_size=67)
  ref.save_pretrained(path)
  config, model = load_hf_checkpoint(path)
  return path, config, host(split_params(model)[1]), ref


def random_adapters(config, lora, seed, scale_b=0.1):
  """`init_adapters` with a nonzero `b` (a trained adapter's stand-in)."""
  rng = np.random.RandomState(seed)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: rng.normal(0, scale_b, x.shape).astype(np.float32) if path[-1].key == "b" else x,
      lora_lib.init_adapters(config, lora, seed))


def trainer_logprobs(config, params, adapters, batch, lora_scale):
  """The trainer's forward (layers under scan, adapters unmerged): response log-probs `[B, R]`."""
  lora = None if adapters is None else prepare_params(adapters, jnp.float32)
  return np.asarray(jax.jit(lambda p, l: policy_logprobs(config, prepare_params(p, jnp.float32), *batch, lora=l,
                                                         lora_scale=lora_scale))(params, lora))


def generator_logprobs(config, params, batch):
  """The generator's model (`Llama`, layers unrolled) over the same rows laid out as the trainer's
  (prompt from position 0, then the response): log-probs of the response tokens `[B, R]`."""
  tokens, lengths, predict = trainer_layout(*(jnp.asarray(a) for a in batch))
  graphdef = split_params(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))))[0]
  mask = (jnp.arange(tokens.shape[1])[None] < lengths[:, None]).astype(jnp.int32)
  logits = jax.jit(lambda p: merge_params(graphdef, p)(tokens, attention_mask=mask))(params)
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  picked = jnp.take_along_axis(jnp.take_along_axis(logp, predict[..., None], axis=1),
                               jnp.asarray(batch[2])[..., None], axis=-1)[..., 0]
  return np.asarray(jnp.where(jnp.asarray(batch[3]) > 0, picked, 0.0))


# --------------------------------------------------------------------------------------------------
# the adapters


def test_expert_adapters_are_per_expert_and_shard_like_the_experts(moe):
  _, config, _, _ = moe
  X, E, F, r = config.num_experts, config.hidden_size, config.moe_intermediate_size, LORA.rank
  shapes = lora_lib.adapter_shapes(config, LORA)["layers"][0]["mlp"]
  assert {n: (ab["a"].shape, ab["b"].shape) for n, ab in shapes.items()} == {
      "w_gate": ((X, E, r), (X, r, F)), "w_up": ((X, E, r), (X, r, F)), "w_down": ((X, F, r), (X, r, E))}
  model_axes = parallel.logical_axes(nnx.eval_shape(
      lambda: Llama(config, rngs=nnx.Rngs(0))))
  axes = lora_lib.adapter_axes(model_axes, LORA)["layers"][0]["mlp"]
  assert axes["w_gate"] == {"a": ("expert", "embed", None), "b": ("expert", None, "mlp")}
  assert axes["w_down"] == {"a": ("expert", "mlp", None), "b": ("expert", None, "embed")}
  with pytest.raises(ValueError, match="layer 0 of this qwen3_moe model is a MoE layer: adapt its MLP with 'expert_"):
    lora_lib.adapter_shapes(config, LoraConfig(targets=("q", "gate")))
  with pytest.raises(ConfigError, match="dropout is applied to dense projections only"):
    LoraConfig(targets=("expert_up",), dropout=0.1)


def test_merge_is_each_experts_own_low_rank_update(moe):
  """merge_adapters on experts: w[x] + s a[x] @ b[x] for every expert x (numpy, per expert)."""
  _, config, params, _ = moe
  adapters = random_adapters(config, EXPERTS_ONLY, 1)
  s = lora_lib.scale(EXPERTS_ONLY)
  merged = host(lora_lib.merge_adapters(params, adapters, s))
  for name in ("w_gate", "w_up", "w_down"):
    ab, w = adapters["layers"][1]["mlp"][name], params["layers"][1]["mlp"][name]
    want = np.stack([w[x] + s * ab["a"][x] @ ab["b"][x] for x in range(config.num_experts)])
    np.testing.assert_allclose(merged["layers"][1]["mlp"][name], want, atol=1e-6, rtol=0)
  np.testing.assert_array_equal(merged["layers"][1]["mlp"]["router"], params["layers"][1]["mlp"]["router"])


# --------------------------------------------------------------------------------------------------
# the forward: trainer (unmerged) == generator (merged)


def test_trainer_adapted_forward_equals_the_generator_with_merged_weights(moe):
  """The push moves only the adapters; the generator merges them into its copy of the base; its
  model's log-probs equal the trainer's unmerged scanned forward (2e-5: fp32 order). Initial adapters
  (b = 0) add exact zeros, but they are another compiled program, whose fusion may round a log-prob of
  magnitude ~4 differently by an ulp or two (1e-6 relative); the expert adapters alone move the policy."""
  _, config, params, _ = moe
  batch = arrays(make_batch(0))
  s = lora_lib.scale(LORA)
  base = trainer_logprobs(config, params, None, batch, s)
  np.testing.assert_allclose(trainer_logprobs(config, params, lora_lib.init_adapters(config, LORA, 0), batch, s),
                             base, rtol=1e-6, atol=0)

  adapters = random_adapters(config, LORA, 1)
  mesh = parallel.make_mesh(jax.devices()[:1])
  abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
  axes = parallel.logical_axes(abstract)
  sync = WeightSync(parallel.param_shardings(split_params(abstract)[1], axes, mesh), dtype=jnp.float32,
                    adapter_shardings=parallel.param_shardings(lora_lib.adapter_shapes(config, LORA),
                                                               lora_lib.adapter_axes(axes, LORA), mesh),
                    lora_scale=s, base=lambda: params)
  sync.push(adapters, 1)
  pushed = sync.push(adapters, 2)
  assert pushed["sync/bytes"] == tree_bytes(adapters)  # the adapters only, once the base is there
  merged, _ = sync.latest()

  trainer = trainer_logprobs(config, params, adapters, batch, s)
  generator = generator_logprobs(config, merged, batch)
  np.testing.assert_allclose(trainer, generator, atol=2e-5, rtol=0)
  np.testing.assert_allclose(generator_logprobs(config, params, batch), base, atol=2e-5, rtol=0)

  experts_only = jax.tree_util.tree_map_with_path(
      lambda path, x: x if path[2].key == "mlp" or path[-1].key == "a" else np.zeros_like(x), adapters)
  assert np.abs(trainer_logprobs(config, params, experts_only, batch, s) - base).max() > 1e-2


# --------------------------------------------------------------------------------------------------
# training


def test_one_step_trains_only_the_adapters(moe):
  """One AIPO step of a LoRA trainer over the MoE base: the base stays bit for bit, the optimizer's
  state is the adapters', and every expert's `b` of every adapted projection that saw rows moved
  (from 0), while the router (frozen, not an adapter) is untouched."""
  _, config, params, _ = moe
  trainer = TrainerExecutor(config, parallel.make_mesh(jax.devices()[:1]), params, optimizer=OPT,
                            loss_kwargs={"rho_max": 2.0}, lora=LORA)
  before = host(trainer.params)
  metrics = trainer.step(make_batch(1))
  assert metrics["train/update_applied"] == 1.0
  jax.tree.map(np.testing.assert_array_equal, host(trainer.base_params), params)
  assert jax.tree.structure(trainer.opt_state[1][0].mu) == jax.tree.structure(trainer.params)
  after = host(trainer.params)
  for i in range(config.num_layers):
    for name in ("w_gate", "w_up", "w_down"):
      b0, b1 = before["layers"][i]["mlp"][name]["b"], after["layers"][i]["mlp"][name]["b"]
      assert not np.any(b0) and np.all(np.abs(b1).reshape(config.num_experts, -1).max(-1) > 0), (i, name)


# --------------------------------------------------------------------------------------------------
# PEFT


def test_peft_expert_adapter_keys_and_round_trip(moe, tmp_path):
  """Written as transformers 4's Qwen3-MoE modules: one lora_A `[r, in]` / lora_B `[out, r]` per
  expert and projection; target_modules gate_proj, up_proj, down_proj; read back exactly."""
  from safetensors.numpy import load_file

  _, config, _, _ = moe
  adapters = random_adapters(config, LORA, 2)
  path = lora_lib.save_peft_adapter(adapters, config, LORA, tmp_path / "adapter")
  tensors = load_file(str(path / lora_lib.ADAPTER_WEIGHTS))
  X, E, F, r = config.num_experts, config.hidden_size, config.moe_intermediate_size, LORA.rank
  key = "base_model.model.model.layers.{}.mlp.experts.{}.{}.lora_{}.weight"
  for i in range(config.num_layers):
    for x in range(X):
      assert tensors[key.format(i, x, "gate_proj", "A")].shape == (r, E)
      assert tensors[key.format(i, x, "gate_proj", "B")].shape == (F, r)
      assert tensors[key.format(i, x, "down_proj", "A")].shape == (r, F)
      np.testing.assert_array_equal(tensors[key.format(i, x, "down_proj", "B")],
                                    adapters["layers"][i]["mlp"]["w_down"]["b"][x].T)
  assert len(tensors) == config.num_layers * (2 * 2 + 3 * X * 2)  # q, v + 3 projections x experts, A and B
  assert lora_lib.peft_adapter_config(LORA, None)["target_modules"] == [
      "down_proj", "gate_proj", "q_proj", "up_proj", "v_proj"]
  jax.tree.map(np.testing.assert_array_equal, lora_lib.load_peft_adapter(path, config, LORA), adapters)


def test_peft_loads_our_expert_adapter_onto_transformers_qwen3_moe(moe, tmp_path):
  """PeftModel(transformers' Qwen3-MoE, our adapter directory): PEFT converts the per-expert adapter to
  LoRA of transformers 5's fused expert parameters (gate_up_proj, down_proj) and gives the logits of
  our merged HF export (fp32, 1e-4), which differ from the base's."""
  torch = pytest.importorskip("torch")
  peft = pytest.importorskip("peft")
  import transformers

  from llamarl_jax.model import hf

  base_path, config, params, _ = moe
  graphdef = split_params(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))))[0]
  adapters = random_adapters(config, LORA, 3, scale_b=0.3)
  merged = lora_lib.merge_adapters(params, adapters, lora_lib.scale(LORA))
  hf.save_hf_checkpoint(merge_params(graphdef, merged), config, tmp_path / "merged")
  lora_lib.save_peft_adapter(adapters, config, LORA, tmp_path / "adapter", base_model_name_or_path=str(base_path))

  load = lambda p: transformers.AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
  tokens = torch.tensor(np.random.RandomState(4).randint(0, config.vocab_size, (2, 12)))
  with torch.no_grad():
    base_logits = load(base_path)(tokens).logits.numpy()
    peft_model = peft.PeftModel.from_pretrained(load(base_path), tmp_path / "adapter")
    peft_logits = peft_model(tokens).logits.numpy()
    merged_logits = load(tmp_path / "merged")(tokens).logits.numpy()
  np.testing.assert_allclose(peft_logits, merged_logits, atol=1e-4, rtol=0)
  assert np.abs(peft_logits - base_logits).max() > 1e-2
  # the experts' LoRA is there, fused as transformers 5 fuses the experts: gate and up at rank 2r
  lora_a = {n: tuple(p.shape) for n, p in peft_model.named_parameters()
            if "layers.0.mlp.experts" in n and "lora_A" in n}
  assert lora_a == {"base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.default.weight":
                        (config.num_experts * 2 * LORA.rank, config.hidden_size),
                    "base_model.model.model.layers.0.mlp.experts.lora_A.default.weight":
                        (config.num_experts * LORA.rank, config.moe_intermediate_size)}


@pytest.mark.devices(4)
@pytest.mark.slow
@pytest.mark.parametrize("way", ["replicate", "dispatch_dense"])
def test_expert_adapters_train_the_same_under_fsdp_and_expert_parallelism(moe, way, monkeypatch):
  """fsdp=2 x expert=2: the experts' adapters shard over `expert` like the experts (`a` `[X, E, r]`
  on (expert, fsdp)), each device runs its own experts' rows (replicate-and-sum, or token dispatch
  in its dense CPU form), and 2 steps land where the one-device run's do (summation order only:
  1e-5 on adapters after lr-1e-2 Adam steps)."""
  from llamarl_jax.model import moe as moe_lib

  _, config, params, _ = moe
  batch = make_batch(1)
  P_ = jax.sharding.PartitionSpec

  def run(mesh):
    trainer = TrainerExecutor(config, mesh, params, optimizer=OPT, loss_kwargs={"rho_max": 2.0}, lora=LORA)
    for _ in range(2):
      trainer.step(batch)
    return trainer

  one = run(parallel.make_mesh(jax.devices()[:1]))
  monkeypatch.setattr(moe_lib, "choose_expert_parallel", lambda *a, **k: way.removesuffix("_dense"))
  ep = run(parallel.make_mesh(jax.devices()[:4], fsdp=2, expert=2))
  assert ep.params["layers"][0]["mlp"]["w_gate"]["a"].sharding.spec == P_("expert", "fsdp", None)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=0), host(ep.params), host(one.params))
  jax.tree.map(np.testing.assert_array_equal, host(ep.base_params), params)


def test_expert_adapters_take_the_experts_grouped_gemm():
  """`grouped_swiglu` with expert adapters by the Pallas grouped GEMM (interpret mode on the CPU)
  equals the `ragged_dot` form, and both equal the per-expert merged weights' (fp32: 1e-5)."""
  from llamarl_jax.model import moe as moe_lib
  from llamarl_jax.model.layers import LoraLayer

  rng = np.random.RandomState(0)
  N, E, F, X, k, r = 24, 16, 8, 4, 2, 3
  x = jnp.asarray(rng.normal(size=(N, E)), jnp.float32)
  experts = jnp.asarray(np.stack([rng.choice(X, k, replace=False) for _ in range(N)]), jnp.int32)
  weights = jnp.asarray(rng.uniform(size=(N, k)), jnp.float32)
  w = {n: jnp.asarray(rng.normal(size=s) / np.sqrt(s[1]), jnp.float32)
       for n, s in (("w_gate", (X, E, F)), ("w_up", (X, E, F)), ("w_down", (X, F, E)))}
  ab = {n: {"a": jnp.asarray(rng.normal(size=(X, v.shape[1], r)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=(X, r, v.shape[2])), jnp.float32)} for n, v in w.items()}
  lora = LoraLayer(ab, 0.5)
  run = lambda gemm, p, l: moe_lib.grouped_swiglu(x, experts, weights, (p["w_gate"], p["w_up"]), p["w_down"],
                                                  lora=l, grouped_gemm=gemm)
  merged = {n: v + 0.5 * jnp.einsum("xir,xro->xio", ab[n]["a"], ab[n]["b"]) for n, v in w.items()}
  want = np.asarray(run("ragged_dot", merged, None))
  np.testing.assert_allclose(np.asarray(run("ragged_dot", w, lora)), want, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(run("pallas", w, lora)), want, atol=1e-5, rtol=1e-5)
