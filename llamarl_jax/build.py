"""The composition root: the one module that reads a `RunConfig` and turns it into executors.

One builder per role, each taking the run config and the values resolved before it (meshes, shapes,
params, the tokenizer) and handing the executors typed sections and plain values only:

  trainer        `trainer` (the policy's `TrainerExecutor`, its KL reference and LoRA adapters loaded),
                 `abstract_trainer` (shapes only: the memory plan and the compile checks), `trainer_options`
  generator      `sampler` (the generator's model copy: dtype and precision), `rollout_sampling`,
                 `generator` (the `GeneratorExecutor`, with a `SlotEngine` of the run's shapes)
  reward         `reward` (the worker pool of `RewardConfig.fn`), `reward_model` (a reward model's executor)
  weights        `weights` (one process: `WeightSync`), `weight_plan` (many processes: the W(v) transfer)

`Controller` holds what these build and runs it; `memory_plan` builds its abstract trainer here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from llamarl_jax import parallel
from llamarl_jax.config import RewardConfig, RunConfig
from llamarl_jax.executors.generator import GeneratorExecutor
from llamarl_jax.executors.reward import RewardExecutor
from llamarl_jax.executors.trainer import TrainerExecutor
from llamarl_jax.executors.weight_sync import WeightSync
from llamarl_jax.generation.engine import SlotEngine
from llamarl_jax.generation.sampler import Sampler, SamplingParams
from llamarl_jax.model import fp8, hf, moe
from llamarl_jax.model import lora as lora_lib
from llamarl_jax.model.config import ModelConfig, WeightLayout
from llamarl_jax.model.llama import abstract_model, split_params
from llamarl_jax.shapes import RunShapes


# ------------------------------------------------------------------------------------------------
# trainer


def trainer_options(run: RunConfig) -> dict:
  """The `TrainerExecutor` keyword settings a `RunConfig` sets (the run's trainer and the memory
  plan's abstract one are built from the same)."""
  t, r = run.train, run.rollout
  return dict(optimizer=t.optimizer, loss=t.loss, loss_kwargs=t.loss_kwargs, microbatches=t.microbatches,
              remat=t.remat, attention=t.attention, logprob_chunk=t.logprob_chunk,
              layout=t.layout, scan_layers=t.scan_layers,
              temperature=max(r.temperature, 1e-6) if r.temperature > 0 else 1.0,
              reference_is_initial=t.reference_path is None, lora=t.lora, base_dtype=run.generator.dtype,
              critic=t.critic, routing_replay=t.routing_replay, grouped_gemm=t.moe_grouped_gemm)


def run_model(model_config: ModelConfig, run: RunConfig) -> ModelConfig:
  """The policy's config as both roles compute it: with `RolloutConfig.exact_logprobs` every op in its
  batch-invariant form (`ModelConfig.exact`, `model.exact`), read by the trainer, the sampler and the
  slot engine alike."""
  return model_config.replace(exact=run.rollout.exact_logprobs)


def model_shapes(model_config: ModelConfig) -> dict:
  """The policy's parameters as fp32 `ShapeDtypeStruct`s (the trainer's master copy), nothing allocated."""
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jax.numpy.float32),
                      split_params(abstract_model(model_config))[1])


def trainer(model_config: ModelConfig, run: RunConfig, mesh, params: Any) -> TrainerExecutor:
  """The run's trainer on `mesh` from `params`: with a KL penalty (`kl_coef`) its reference (the
  initial params, or `TrainConfig.reference_path`), with LoRA its adapters (`LoraConfig.adapter_path`,
  else initialised from the rollout seed)."""
  t = run.train
  model_config = run_model(model_config, run)
  ref_params = None
  if t.loss_kwargs.get("kl_coef"):
    ref_params = params if t.reference_path is None else hf.load_reference_params(t.reference_path, model_config)
  adapters = None
  if t.lora is not None and t.lora.adapter_path:
    adapters = lora_lib.load_peft_adapter(t.lora.adapter_path, model_config, t.lora)
  return TrainerExecutor(model_config, mesh, params, ref_params=ref_params, adapters=adapters,
                         lora_seed=run.rollout.seed, **trainer_options(run))


def abstract_trainer(model_config: ModelConfig, run: RunConfig, mesh) -> TrainerExecutor:
  """A `TrainerExecutor` of shapes only (nothing allocated) with the run's trainer settings: what
  `lower_step` compiles and the memory plan measures."""
  model_config = run_model(model_config, run)
  shapes = model_shapes(model_config)
  ref = shapes if run.train.loss_kwargs.get("kl_coef") else None
  return TrainerExecutor(model_config, mesh, shapes, ref_params=ref, **trainer_options(run))


# ------------------------------------------------------------------------------------------------
# generator


def rollout_sampling(rollout, tokenizer) -> SamplingParams:
  """How a run samples: its `RolloutConfig`'s settings; the tokenizer's end-of-sequence token stops a row."""
  stop_ids = tuple(i for i in (tokenizer.eos_token_id,) if i is not None)
  return SamplingParams(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                        max_new_tokens=rollout.max_new_tokens, n=rollout.samples_per_prompt, stop_token_ids=stop_ids,
                        seed=rollout.seed)


def sampler(model_config: ModelConfig, run: RunConfig, mesh, tokenizer) -> Sampler:
  """The generator's model copy on `mesh`: `GeneratorConfig.dtype`, its precision (`quantize`) and a
  MoE policy's expert matmuls (`moe_grouped_gemm`, resolved for the mesh's devices); exact ops with
  `RolloutConfig.exact_logprobs` (`run_model`; the slot engine takes the sampler's config)."""
  g = run.generator
  mesh = mesh if mesh is not None else parallel.make_mesh(jax.devices()[:1])
  gemm = moe.resolve_grouped_gemm(g.moe_grouped_gemm, mesh.devices.flat[0].platform)
  config = run_model(model_config, run).replace(param_dtype=g.dtype, dtype=g.dtype, grouped_gemm=gemm)
  return Sampler(config, mesh, pad_id=tokenizer.pad_token_id or 0, quantize=g.quantize)


def generator(sampler: Sampler, tokenizer, prompt_source, sampling: SamplingParams, run: RunConfig,
              shapes: RunShapes, *, device_turn: Any, score: Callable, env: Any) -> GeneratorExecutor:
  """The `GeneratorExecutor` of a run: its rollout, schedule and generator settings and `shapes`
  (the slot engine's lanes, staged slots and prompt width). score: the run's `RewardExecutor.score`
  (dynamic sampling uses it)."""
  r, g = run.rollout, run.generator
  engine = None
  if g.engine == "slots":
    engine = SlotEngine(sampler.config, sampler.mesh, lanes=shapes.lanes, sampling=sampling,
                        max_prompt_len=shapes.engine_prompt_len, chunk_steps=g.chunk_steps, pad_id=sampler.pad_id,
                        recompute_kv=g.recompute_kv, kv_block_size=shapes.kv_block_size,
                        chunks_in_flight=g.chunks_in_flight, paged_attention=g.paged_attention,
                        min_decode_width=g.min_decode_width, staged_slots=shapes.staged_slots,
                        quantize=sampler.layout.quantize)
  return GeneratorExecutor(sampler, tokenizer, prompt_source, sampling, prompts_per_step=r.prompts_per_step,
                           max_policy_lag=run.schedule.max_policy_lag,
                           version_schedule=run.schedule.version_schedule, seed=r.seed, delay_s=g.delay_s,
                           device_turn=device_turn, engine=engine, dynamic_sampling=r.dynamic_sampling,
                           score=score if r.dynamic_sampling else None, env=env, env_config=run.env)


# ------------------------------------------------------------------------------------------------
# reward


def reward(run: RunConfig) -> RewardExecutor:
  """The worker pool scoring `RewardConfig.fn`."""
  c = run.reward
  return RewardExecutor(c.fn, num_workers=c.workers, timeout_s=c.timeout_s)


def reward_model(reward_config: RewardConfig, policy_tokenizer, *, mesh=None, device_turn=None,
                 weights: bool = True):
  """The reward model of `reward_config.model_path` in its `model_dtype`, on `mesh`. weights=False: its
  config and tokenizer only, for `batch_rows` and `combine` (a generator process of a multi-process
  run, whose reward model scores in the reward processes)."""
  from llamarl_jax.executors.reward_model import RewardModelExecutor
  from llamarl_jax.rewards.reward_model import RewardModel

  model = RewardModel.from_pretrained(reward_config.model_path, dtype=reward_config.model_dtype, mesh=mesh,
                                      weights=weights)
  return RewardModelExecutor(model, policy_tokenizer, reward_config, name=f"reward model {reward_config.model_path}",
                             device_turn=device_turn)


def run_reward_model(run: RunConfig, policy_tokenizer, generator_mesh, device_turn):
  """A one-process run's reward model: on its own mesh (`MeshConfig.reward_dp`), else on the
  generator's; colocated on one shared mesh it takes turns with the others (`device_turn`)."""
  own_mesh = parallel.make_reward_mesh(**dataclasses.asdict(run.mesh))
  turn = device_turn if run.mesh.colocated and own_mesh is None else None
  return reward_model(run.reward, policy_tokenizer, mesh=own_mesh or generator_mesh, device_turn=turn)


# ------------------------------------------------------------------------------------------------
# weights


def weights(run: RunConfig, model_config: ModelConfig, axes, gen_shardings, generator_mesh, *, base) -> WeightSync:
  """A one-process run's weight sync: the generator dtype and precision; the 'fixed' schedule keeps
  every pending version; with LoRA a push moves the adapters and the generator merges them into the
  frozen base (`base()`: the trainer's)."""
  g, lora = run.generator, run.train.lora
  kw = {}
  if lora is not None:
    kw = dict(adapter_shardings=parallel.param_shardings(lora_lib.adapter_shapes(model_config, lora),
                                                         lora_lib.adapter_axes(axes, lora), generator_mesh),
              lora_scale=lora_lib.scale(lora), base=base)
  return WeightSync(gen_shardings, dtype=g.dtype, quantize=g.quantize,
                    keep_pending=run.schedule.version_schedule == "fixed", **kw)


def weight_plan(run: RunConfig, model_config: ModelConfig, shapes, axes, gen_shardings, trainer_mesh, generator_mesh,
                *, base: Callable[[], Any] | None = None):
  """A multi-process run's W(v) transfer: trainer params (`shapes`: fp32 structs) -> the generator's
  layout in `GeneratorConfig.dtype` (`transfer.WeightPlan`); with `quantize='fp8'` quantised on the
  trainer, so fp8 values and their scales cross (`model.fp8`; 'fp8+lm_head': the lm_head too);
  with LoRA the adapters every push and the frozen base (`base()`: the trainer's) when it changed,
  merged (and then quantised) on the generator (`transfer.LoraPlan`)."""
  from llamarl_jax.transfer import LoraPlan, WeightPlan

  g, lora = run.generator, run.train.lora
  dtype = jax.numpy.dtype(g.dtype)
  plan = WeightPlan(gen_shardings, jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), shapes),
                    trainer_mesh, transform=lambda p: jax.tree.map(lambda x: x.astype(dtype), p))
  wire = WeightLayout(quantize=g.quantize)  # Hugging Face's projections in the generator's precision
  head = dict(lm_head=wire.fp8_lm_head)
  if wire.fp8 and lora is None:
    return WeightPlan(fp8.quantized_shardings(gen_shardings, **head), fp8.quantized_shapes(shapes, dtype, **head),
                      trainer_mesh, transform=lambda p: fp8.quantize_params(p, dtype, **head))
  if lora is None:
    return plan
  adapter_shapes = lora_lib.adapter_shapes(model_config, lora)
  adapters = WeightPlan(parallel.param_shardings(adapter_shapes, lora_lib.adapter_axes(axes, lora), generator_mesh),
                        adapter_shapes, trainer_mesh)
  return LoraPlan(plan, adapters, base=base, lora_scale=lora_lib.scale(lora), dtype=dtype)
