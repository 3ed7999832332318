"""The memory plan: its parts are the arrays the run allocates (the slot engine's pool, the trainer's
state), XLA's analysis of the compiled step moves with the knob it names, and a run over its device's
limit is refused with the numbers before anything is built."""

import dataclasses
import importlib.util
from pathlib import Path

import gin
import jax
import jax.numpy as jnp
import pytest

from llamarl_jax import memory_plan
from llamarl_jax.memory_plan import MemoryPlanError, device_bytes, slot_pool_bytes
from llamarl_jax.model.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
LLAMA_1B = ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                       num_kv_heads=8, head_dim=64, tie_word_embeddings=True)


def test_the_pool_of_64_slots_of_2048_positions_at_1b():
  """Prompt regions of 512/16 = 32 blocks, responses of ceil(1535/16) = 96 blocks, one trash block:
  8193 blocks of 16 positions x 32768 bytes (K and V, 16 layers x 8 heads x 64 x bf16)."""
  assert slot_pool_bytes(LLAMA_1B, slots=64, max_prompt_len=512, max_new_tokens=1536, block_size=16,
                         dtype=jnp.bfloat16) == 8193 * 16 * 32768


def test_the_pool_is_the_engines_own_allocation():
  from llamarl_jax import parallel
  from llamarl_jax.generation import Sampler, SamplingParams
  from llamarl_jax.generation.slot_programs import SlotPrograms

  config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       dtype="bfloat16", param_dtype="bfloat16")
  mesh = parallel.make_mesh(jax.devices()[:1])
  programs = SlotPrograms(config, Sampler(config, mesh), num_slots=6, sampling=SamplingParams(max_new_tokens=21, n=2),
                          max_prompt_len=13, chunk_steps=4, pad_id=0, kv_block_size=4)
  cache, _ = programs.empty()  # what the engine allocates once
  assert device_bytes(cache) == slot_pool_bytes(config, slots=6, max_prompt_len=13, max_new_tokens=21, block_size=4,
                                                dtype=jnp.bfloat16)


@pytest.fixture
def gin_config(monkeypatch):
  """(model config, run config, eval rows) of a gin file + bindings (from the repo root: includes resolve)."""
  from llamarl_jax import experiment

  monkeypatch.chdir(ROOT)

  def parse(name, *bindings):
    gin.clear_config()
    experiment.parse_gin([str(ROOT / "configs" / name)], list(bindings))
    return experiment.build_policy(weights=False)[0], experiment.configured_run_config()

  yield parse
  gin.clear_config()


def test_the_one_gpu_plan_at_llama_1b_shapes(gin_config):
  """Without a compile (a CPU run: no device limit), every part but the activations, from the shapes:
  N = 1.236B parameters; fp32 weights and gradients 4N, AdamW's two moments 8N (+ its step counts),
  3 bf16 generator copies (lag 1: two versions may wait, one in the engine) 6N, the pool as above."""
  model, run = gin_config("llama3_1b_1gpu.gin")
  assert (model.vocab_size, model.num_layers, model.dtype) == (128256, 16, "bfloat16")
  plan = memory_plan.plan_run(model, run, eval_rows=0)
  parts = {p.name: p.nbytes for p in plan.parts}
  n = model.num_params()
  assert n == 1_235_814_400
  assert parts["trainer weights"] == parts["gradients"] == 4 * n
  assert 8 * n <= parts["optimizer state"] <= 8 * n + 64
  assert parts["generator weights"] == 3 * 2 * n
  assert parts["KV pool"] == 8193 * 16 * 32768
  assert parts["activations"] is None and "evaluation KV" not in parts
  assert plan.colocated and plan.limit is None and plan.fits  # a CPU keeps no device limit: not checked
  assert plan.totals() == {"trainer + generator": sum(v for v in parts.values() if v)}


@pytest.mark.slow
def test_the_8b_lora_one_gpu_plan(gin_config):
  """configs/llama3_8b_lora_1gpu.gin without a compile: N = 8.03B (Llama-3.1-8B's count); the frozen
  base in bf16 2N; rank-8 fp32 adapters on every projection (per layer rank x (in + out) of q k v o
  gate up down) and their gradients 4 bytes each; 2 merged bf16 generator copies (lag 0: one version
  waits, one in the engine) 4N; the pool 32 slots x (512 + 1024) positions in blocks of 16, plus the
  trash block, at 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes a position."""
  model, run = gin_config("llama3_8b_lora_1gpu.gin")
  plan = memory_plan.plan_run(model, run, eval_rows=0)
  parts = {p.name: p.nbytes for p in plan.parts}
  n = model.num_params()
  assert n == 8_030_261_248
  E, F, KV = 4096, 14336, 1024
  adapters = 32 * 8 * ((E + E) + (E + KV) * 2 + (E + E) + (E + F) * 2 + (F + E))
  assert parts["trainer weights"] == parts["gradients"] == 4 * adapters
  assert parts["frozen base"] == 2 * n and parts["generator weights"] == 2 * 2 * n
  assert parts["KV pool"] == (32 * 1536 // 16 + 1) * 16 * (2 * 32 * 8 * 128 * 2)
  assert plan.colocated and run.schedule.max_policy_lag == 0


def test_a_plan_over_the_limit_is_refused_naming_the_knobs(gin_config):
  model, run = gin_config("llama3_1b_1gpu.gin", "run_experiment.eval_size = 64")
  plan = memory_plan.plan_run(model, run, eval_rows=64)
  assert dataclasses.replace(plan, limit=plan.peak).check().fits
  with pytest.raises(MemoryPlanError) as e:
    dataclasses.replace(plan, capacity=80e9, limit=plan.peak - 2e9).check()
  text = str(e.value)
  assert "DOES NOT FIT by 2.00 GB" in text and "KV pool" in text and "evaluation KV" in text
  # the three largest parts (optimizer state 9.89, generator weights 7.41, trainer weights 4.94 GB) and their knobs
  assert "optimizer state (9.89 GB): more trainer devices (MeshConfig.trainer_fsdp)" in text
  assert "generator weights (7.41 GB): a smaller ScheduleConfig.max_policy_lag" in text


def _memory_plan_script():
  spec = importlib.util.spec_from_file_location("memory_plan_script", ROOT / "scripts" / "memory_plan.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.main


SMALL = ["ModelConfig.hidden_size = 64", "ModelConfig.intermediate_size = 128", "ModelConfig.num_layers = 2",
         "ModelConfig.num_heads = 4", "ModelConfig.num_kv_heads = 2", "ModelConfig.head_dim = 16",
         "build_policy.vocab_size = 512", "RolloutConfig.prompts_per_step = 4", "RolloutConfig.samples_per_prompt = 4",
         "RolloutConfig.max_new_tokens = 64", "GeneratorConfig.slots = 16", "GeneratorConfig.max_prompt_len = 16",
         "ModelConfig.dtype = 'float32'"]


@pytest.mark.slow
def test_the_script_compiles_the_step_and_more_microbatches_shrink_its_activations(monkeypatch, capsys):
  """scripts/memory_plan.py on this machine's devices: XLA's analysis of the compiled step; 16 rows in
  8 microbatches of 2 hold a quarter of the activations of 2 microbatches of 8 (the activations scale
  with the rows a microbatch holds; the rest of the step's temporaries is the gradients)."""
  monkeypatch.chdir(ROOT)
  main = _memory_plan_script()
  acts = {}
  for mb in (2, 8):
    gin.clear_config()
    plan = main(["--gin_file", "configs/llama3_1b_1gpu.gin", *(f"--gin_param={b}" for b in SMALL),
                 f"--gin_param=TrainConfig.microbatches = {mb}"])
    acts[mb] = {p.name: p.nbytes for p in plan.parts}["activations"]
  gin.clear_config()
  assert acts[8] < acts[2] / 2, acts
  out = capsys.readouterr().out
  assert "activations" in out and "XLA: step temporaries" in out and "8 microbatches" in out


def test_a_run_that_does_not_fit_stops_before_building_anything(tmp_path, monkeypatch):
  """A device limit below the plan: run_experiment raises with the table before the policy, the
  controller or the run directory exist."""
  from llamarl_jax import experiment

  monkeypatch.chdir(ROOT)
  monkeypatch.setattr(memory_plan, "device_limit", lambda device: (2e6, 1.5e6))
  monkeypatch.setattr(experiment, "Controller", None)  # anything built past the plan fails loudly
  run_dir = tmp_path / "run"
  gin.clear_config()
  try:
    experiment.parse_gin([str(ROOT / "configs" / "llama3_1b_1gpu.gin")],
                         SMALL + [f"run_experiment.run_dir = '{run_dir}'", "run_experiment.progress = False"])
    with pytest.raises(MemoryPlanError, match=r"(?s)DOES NOT FIT by .* MB.*what shrinks the largest parts"):
      experiment.run_experiment()
  finally:
    gin.clear_config()
  assert not run_dir.exists()


@pytest.mark.parametrize("name", ["llama3_1b_1gpu.gin", "qwen2p5_1p5b_1gpu.gin", "llama3_1b_1gpu_gsm8k.gin"])
def test_the_one_gpu_configs_share_one_device_and_the_planned_pool(monkeypatch, name):
  """Every binding known; colocated on one GPU; the slot engine's 64 slots hold a step's 64 rows at
  512 + 1536 positions (the pool the plans above size); microbatches split the rows evenly."""
  from llamarl_jax import experiment  # noqa: F401  (registers the configurables)

  monkeypatch.chdir(ROOT)
  gin.clear_config()
  try:
    gin.parse_config_files_and_bindings([str(ROOT / "configs" / name)], [], skip_unknown=False)
    q = gin.query_parameter
    rows = q("RolloutConfig.prompts_per_step") * q("RolloutConfig.samples_per_prompt")
    assert q("%NUM_GPUS") == 1 and q("MeshConfig.colocated") is True
    assert q("MeshConfig.trainer_fsdp") * q("MeshConfig.trainer_tp") == q("MeshConfig.generator_dp") * q("MeshConfig.generator_tp") == 1
    assert (q("GeneratorConfig.engine"), q("GeneratorConfig.dtype")) == ("slots", "bfloat16")
    assert q("GeneratorConfig.slots") == rows == 64 and rows % q("TrainConfig.microbatches") == 0
    assert q("GeneratorConfig.max_prompt_len") + q("RolloutConfig.max_new_tokens") == 2048
  finally:
    gin.clear_config()


@pytest.mark.devices(5)
@pytest.mark.parametrize("case", ["plain", "dp_not_dividing_rows", "multi_turn"])
@pytest.mark.slow
def test_the_planned_kv_pool_is_what_the_controllers_engine_allocates(tmp_path, case):
  """The plan's KV pool (bytes per generator device) against the pool the Controller's slot engine
  allocates. plain: 8 rows on one generator device, first prompts up to 256 - 6 = 250 tokens, prompt
  regions of the 256-position bucket. dp_not_dividing_rows: 6 rows over 4 generator devices take 8
  lanes. multi_turn (2 turns of 6, observations of 8: R = 20): a later turn's prompt is the first
  prompt, a turn and an observation, up to (256 - 20) + 14 = 250 tokens, again the 256 bucket."""
  from flax import nnx

  from llamarl_jax.config import EnvConfig, run_config
  from llamarl_jax.controller import Controller
  from llamarl_jax.data import PromptSource
  from llamarl_jax.executors.reward import RewardExecutor
  from llamarl_jax.model.llama import Llama, split_params
  from llamarl_jax.shapes import RunShapes
  from llamarl_jax.tokenizer import make_char_tokenizer

  tok = make_char_tokenizer()
  model = ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
  kw = dict(prompts_per_step=4, samples_per_prompt=2, max_new_tokens=6, engine_kv_block_size=4)
  if case == "dp_not_dividing_rows":
    kw.update(prompts_per_step=3, generator_dp=4)
  run = run_config(**kw)
  if case == "multi_turn":
    run = dataclasses.replace(run, env=EnvConfig(name="tools", max_turns=2, max_observation_tokens=8))
  shapes = RunShapes.of(model, run)
  expected = {"plain": (8, 250, 256), "dp_not_dividing_rows": (8, 250, 256), "multi_turn": (8, 236, 256)}[case]
  assert (shapes.lanes, shapes.prompt_limit, shapes.engine_prompt_len) == expected
  plan = memory_plan.plan_run(model, run, eval_rows=0)
  _, params = split_params(Llama(model, rngs=nnx.Rngs(params=0)))
  c = Controller(model, params, tok, PromptSource(task="arithmetic", seed=0), run_dir=tmp_path, config=run,
                 reward=RewardExecutor("arithmetic", inline=True), progress=False)
  try:
    engine = c.ex.generator.engine
    assert engine.num_lanes == shapes.lanes and engine.max_prompt_len == shapes.engine_prompt_len
    assert {p.name: p.nbytes for p in plan.parts}["KV pool"] == device_bytes(engine._cache)
  finally:
    c.close()


@pytest.mark.devices(6)
@pytest.mark.slow
def test_the_reward_models_part_is_what_it_allocates_on_its_own_devices(tmp_path):
  """A reward model on devices of its own (reward dp 1 x tp 2 after a trainer of 2 and a generator of 2):
  the plan's weights per device equal the bytes a loaded `RewardModel` holds on one of its devices
  (the planned model is shapes only), its scoring temporaries come from a compile of its widest chunk
  (all 8 rows of the step at the prompt limit + responses, rounded to 64 positions), and it is a
  device total of its own."""
  from llamarl_jax import parallel
  from llamarl_jax.config import run_config
  from llamarl_jax.rewards.reward_model import RewardModel
  from llamarl_jax.shapes import RunShapes
  from test_reward_model import tiny_hf_classifier

  rm_dir = tmp_path / "rm"
  tiny_hf_classifier("llama", seed=3, vocab_size=64, max_position_embeddings=64).save_pretrained(rm_dir)
  model = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      max_position_embeddings=64, tie_word_embeddings=True)
  run = run_config(prompts_per_step=4, samples_per_prompt=2, max_new_tokens=6, trainer_fsdp=2, generator_dp=2,
                   reward_dp=1, reward_tp=2, reward_model_path=str(rm_dir), reward_model_dtype="float32")
  plan = memory_plan.plan_run(model, run, eval_rows=0, compile=True)
  parts = {p.name: p for p in plan.parts}
  loaded = RewardModel.from_pretrained(rm_dir, mesh=parallel.make_reward_mesh(**dataclasses.asdict(run.mesh)))
  assert parts["reward model weights"].nbytes == device_bytes(loaded.params)
  shapes = RunShapes.of(model, run)
  assert loaded.chunk_shape(shapes.rows, shapes.prompt_limit + shapes.response_width) == (8, 64)
  assert "8 rows x 64 tokens" in parts["reward model activations"].note
  assert parts["reward model activations"].nbytes > 0
  totals = plan.totals()
  assert set(totals) == {"trainer", "generator", "reward"}
  assert totals["reward"] == parts["reward model weights"].nbytes + parts["reward model activations"].nbytes


@pytest.mark.devices(8)
def test_a_moe_plan_is_what_expert_sharded_meshes_allocate():
  """A Qwen3-MoE on trainer fsdp 2 x expert 2 and generator expert 2 x tp 2 (bf16): the plan's trainer
  weights are the bytes a `TrainerExecutor` holds on one device, and each planned generator copy the
  bytes the `Sampler` places on one of its devices (experts split over expert x tp, so a copy is
  under a tp-only split's 2N / 2)."""
  from llamarl_jax import parallel
  from llamarl_jax.config import run_config
  from llamarl_jax.executors.trainer import TrainerExecutor
  from llamarl_jax.generation import Sampler
  from llamarl_jax.shapes import RunShapes
  from test_moe import moe_params, tiny_moe_config

  model = tiny_moe_config()
  run = run_config(prompts_per_step=4, samples_per_prompt=2, max_new_tokens=6, trainer_fsdp=2, trainer_expert=2,
                   generator_expert=2, generator_tp=2, generator_dtype="bfloat16")
  plan = memory_plan.plan_run(model, run, eval_rows=0, compile=False)
  parts = {p.name: p.nbytes for p in plan.parts}
  trainer_mesh, generator_mesh = parallel.make_meshes(**dataclasses.asdict(run.mesh))
  params = moe_params(model)
  trainer = TrainerExecutor(model, trainer_mesh, params)
  assert parts["trainer weights"] == device_bytes(trainer.params)
  sampler = Sampler(model.replace(param_dtype="bfloat16", dtype="bfloat16"), generator_mesh)
  placed = sampler.place_params(jax.tree.map(lambda p: p.astype(jnp.bfloat16), params))
  copies = RunShapes.of(model, run).versions_held
  assert parts["generator weights"] == copies * device_bytes(placed)
  assert device_bytes(placed) < 2 * model.num_params() / 2
