"""A run's device-memory plan, made before anything is allocated: what each part holds on a device,
against what the device gives the run; a run that does not fit is refused with the numbers.

Parts, per device (bytes of one device's shards):

  trainer    weights (fp32 masters, or LoRA's fp32 adapters and its frozen base), optimizer state
             (AdamW moments), KL reference policy when there is one: the abstract `TrainerExecutor`'s
             own arrays, so every layout and dtype is its.
             Gradients (one per trained weight, fp32) and the train step's activations and workspace:
             XLA's memory analysis of the compiled step at the configured microbatches and remat
             (`TrainerExecutor.lower_step`, the fused step at the widest batch: prompts at the run's
             prompt limit, responses at their maximum: `shapes.RunShapes`); its temporaries are the gradients plus the
             activations. Without a compile the activations are not counted (a CPU run).
  generator  weights in the generator dtype, sharded as the generator's mesh shards them (tp; a MoE
             model's experts also over `expert`): the versions the `WeightSync` holds for the schedule
             ('fixed': up to max_policy_lag + 1 waiting) plus the one the engine decodes with;
             the slot engine's KV pool (`paged.PageLayout`: prompt regions, response blocks, trash
             block, for the lanes and the staged slots) or the static sampler's cache of one batch;
             a held-out evaluation's cache (the static sampler, every problem of `eval_size` at once,
             times the sampled pass@1's draws).

  reward     with `RewardConfig.model_path`: the reward model's weights (its `config.json` in
             `RewardConfig.model_dtype`, sharded on its mesh) and its scoring program's temporaries (XLA's
             memory analysis of its widest chunk: `RewardModel.chunk_shape` of a step's rows at prompt +
             response tokens), on its own devices (`MeshConfig.reward_dp`) or on the generator's.

Colocated runs hold everything on one device at once (the slot engine keeps its pool while the
trainer trains). `device_limit` is what the allocator lets the run use (JAX's `bytes_limit`; for a
GPU compiled for without one, its memory times XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 by default).
`MemoryPlan.check` refuses a plan over the limit, naming the knobs that shrink its largest parts.
The widths and counts come from the run's `shapes.RunShapes`, the one the Controller builds its engine
from, so the planned KV pool is the allocated one. The train step compiles where a limit is known.

    plan = plan_run(model_config, run_config, shapes=shapes, eval_rows=256)  # shapes: the run's `RunShapes`
    print(plan.table()); plan.check()
`scripts/memory_plan.py` prints it for a gin config compiled for an H100 on a machine without one.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from llamarl_jax.config import RunConfig
from llamarl_jax.model.config import ModelConfig
from llamarl_jax.shapes import RunShapes

GB = 1e9
DEFAULT_MEM_FRACTION = 0.75  # XLA's GPU client default (XLA_PYTHON_CLIENT_MEM_FRACTION)

# What shrinks each part (the refusal names them for the largest parts).
KNOBS = {
    "trainer weights": "more trainer devices (MeshConfig.trainer_fsdp)",
    "optimizer state": "more trainer devices (MeshConfig.trainer_fsdp)",
    "frozen base": "more trainer devices (MeshConfig.trainer_fsdp)",
    "KL reference": "TrainConfig.loss_kwargs without kl_coef, or more trainer devices",
    "gradients": "more trainer devices (MeshConfig.trainer_fsdp)",
    "activations": "more TrainConfig.microbatches, TrainConfig.remat = 'full', a smaller TrainConfig.logprob_chunk",
    "generator weights": "a smaller ScheduleConfig.max_policy_lag (fewer versions held), MeshConfig.generator_tp "
                         "(a MoE model: or MeshConfig.generator_expert)",
    "KV pool": "fewer GeneratorConfig.slots / staged_slots, a shorter GeneratorConfig.max_prompt_len or "
               "RolloutConfig.max_new_tokens (fewer KV blocks)",
    "evaluation KV": "a smaller run_experiment.eval_size or eval_samples",
    "reward model weights": "a larger MeshConfig.reward_tp, RewardConfig.model_dtype = 'bfloat16'",
    "reward model activations": "a larger MeshConfig.reward_dp or reward_tp (fewer rows and heads per device)",
}


class MemoryPlanError(RuntimeError):
  """The run's memory plan does not fit its device; the message holds the table and the knobs."""


@dataclass(frozen=True)
class Part:
  """One row of the plan: bytes per device (None: not measured), on the "trainer", "generator" or
  "reward" device."""
  name: str
  nbytes: float | None
  device: str
  note: str = ""


@dataclass(frozen=True)
class MemoryPlan:
  """The parts, the device they sit on, and the device's capacity and the run's limit (bytes; None: unknown)."""
  parts: tuple[Part, ...]
  colocated: bool
  device_kind: str
  capacity: float | None
  limit: float | None
  step_memory: dict | None = None  # XLA's memory analysis of the train step (`train_step_memory`)

  def totals(self) -> dict[str, float]:
    """Bytes per device: {"trainer", "generator"}, or {"trainer + generator"} when colocated; and
    {"reward"} for a reward model on devices of its own."""
    out: dict[str, float] = {}
    for p in self.parts:
      key = "trainer + generator" if self.colocated and p.device != "reward" else p.device
      out[key] = out.get(key, 0.0) + (p.nbytes or 0.0)
    return out

  @property
  def peak(self) -> float:
    return max(self.totals().values())

  @property
  def fits(self) -> bool:
    return self.limit is None or self.peak <= self.limit

  def table(self) -> str:
    lines = [f"memory plan per device ({self.device_kind}{', colocated' if self.colocated else ''}):",
             f"  {'part':<20} {'device':<10} {'size':>10}  note"]
    for p in self.parts:
      lines.append(f"  {p.name:<20} {p.device:<10} {_size(p.nbytes):>10}  {p.note}")
    for key, total in self.totals().items():
      lines.append(f"  {'total':<20} {key:<10} {_size(total):>10}")
    cap = "unknown" if self.capacity is None else _size(self.capacity)
    lim = "not checked" if self.limit is None else f"{_size(self.limit)} the run may use"
    verdict = "" if self.limit is None else (" -> fits" if self.fits else f" -> DOES NOT FIT by {_size(self.peak - self.limit)}")
    lines.append(f"  device memory: {cap}; {lim}{verdict}")
    if self.step_memory is not None:
      lines.append(f"  (the train step compiled for {self.device_kind} in {self.step_memory['compile_seconds']:.0f} s)")
    return "\n".join(lines)

  def as_dict(self) -> dict:
    """For summary.json: bytes per part, the totals, the device's capacity and limit, whether it fits."""
    return {"parts": {p.name: p.nbytes for p in self.parts}, "totals": self.totals(), "device": self.device_kind,
            "colocated": self.colocated, "capacity": self.capacity, "limit": self.limit, "fits": self.fits}

  def check(self) -> "MemoryPlan":
    """Raise `MemoryPlanError` (the table, the overrun and the knobs of the largest parts) unless it fits."""
    if self.fits:
      return self
    largest = sorted((p for p in self.parts if p.nbytes), key=lambda p: -p.nbytes)[:3]
    knobs = "\n".join(f"  {p.name} ({_size(p.nbytes)}): {KNOBS[p.name]}" for p in largest)
    raise MemoryPlanError(f"the run does not fit its device memory:\n{self.table()}\nwhat shrinks the largest "
                          f"parts:\n{knobs}\n(or a device with more memory; XLA_PYTHON_CLIENT_MEM_FRACTION "
                          "raises the share JAX may use)")


def _size(nbytes: float | None) -> str:
  if nbytes is None:
    return "-"
  return f"{nbytes / GB:.2f} GB" if abs(nbytes) >= 0.1 * GB else f"{nbytes / 1e6:.2f} MB"


# ------------------------------------------------------------------------------------------------
# the parts


def kv_bytes_per_position(config: ModelConfig, dtype) -> int:
  """K and V of one position, every layer and KV head."""
  return 2 * config.num_layers * config.num_kv_heads * config.head_dim * jnp.dtype(dtype).itemsize


def slot_pool_bytes(config: ModelConfig, *, slots: int, max_prompt_len: int, max_new_tokens: int, block_size: int,
                    dtype) -> int:
  """The slot engine's paged KV pool (all of it: `paged.PageLayout.num_blocks` blocks)."""
  from llamarl_jax.generation.paged import PageLayout

  layout = PageLayout(slots, max_prompt_len, max_new_tokens, block_size)
  return layout.num_blocks * layout.block_size * kv_bytes_per_position(config, dtype)


def device_bytes(tree: Any) -> float:
  """Bytes one device holds of a tree of sharded `ShapeDtypeStruct`s / arrays (the largest shard's)."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    total += int(np.prod(shape)) * jnp.dtype(x.dtype).itemsize
  return float(total)


def generator_weight_bytes(model_config: ModelConfig, dtype, mesh) -> float:
  """Bytes one device of the generator's `mesh` holds of one copy of the weights in `dtype`: the
  trainer's (Hugging Face's) layout, as pushed and held, sharded by `parallel.RULES` (tp splits heads,
  the MLP and the vocabulary; `expert` a MoE model's experts; what does not divide stays replicated)."""
  from llamarl_jax import parallel
  from llamarl_jax.model.llama import abstract_model, split_params

  name = jnp.dtype(dtype).name
  abstract = abstract_model(model_config.replace(param_dtype=name, dtype=name))
  params = split_params(abstract)[1]
  shardings = parallel.param_shardings(params, parallel.logical_axes(abstract), mesh)
  return device_bytes(jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s), params, shardings))



def train_step_memory(trainer, batch_size: int, prompt_len: int, resp_len: int) -> dict[str, float]:
  """XLA's memory analysis of the trainer's fused step compiled for its mesh's devices (per device):
  {"arguments", "outputs", "aliased", "temporaries", "compile_seconds"}."""
  import time

  t0 = time.perf_counter()
  stats = trainer.lower_step(batch_size, prompt_len, resp_len).compile().memory_analysis()
  return {"arguments": float(stats.argument_size_in_bytes), "outputs": float(stats.output_size_in_bytes),
          "aliased": float(stats.alias_size_in_bytes), "temporaries": float(stats.temp_size_in_bytes),
          "compile_seconds": time.perf_counter() - t0}


def device_limit(device) -> tuple[float | None, float | None]:
  """(capacity, limit) in bytes of a device: JAX's allocator limit where the backend keeps statistics
  (GPU, TPU), both None elsewhere (CPU: host memory is not planned)."""
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  limit = (stats or {}).get("bytes_limit")
  return (None, None) if limit is None else (float(limit) / _mem_fraction(), float(limit))


def _mem_fraction() -> float:
  if os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR") == "platform":
    return 1.0
  return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_MEM_FRACTION))


def target_limit(capacity: float) -> float:
  """What JAX's GPU allocator lets a process use of `capacity` bytes (XLA_PYTHON_CLIENT_MEM_FRACTION)."""
  return capacity * _mem_fraction()


# ------------------------------------------------------------------------------------------------
# the plan


def plan(model_config: ModelConfig, run: RunConfig, *, shapes: RunShapes, trainer, gen_weights: float, eval_rows: int,
         step_memory: dict | None, device_kind: str, capacity: float | None, limit: float | None,
         reward: list[Part] = ()) -> MemoryPlan:
  """The plan from the run's shapes, the abstract trainer (its arrays' shardings), the bytes of one copy
  of the generator's weights per device (`generator_weight_bytes`), the step's memory analysis (None:
  not compiled), `eval_rows` (rows of one held-out evaluation's generate call) and the reward model's
  parts (`reward_model_parts`)."""
  r, g, m = run.rollout, run.generator, run.mesh
  R, prompt_len = shapes.response_width, shapes.prompt_limit
  params = device_bytes(trainer.params)
  lora = run.train.lora
  parts = [Part("trainer weights", params, "trainer", "fp32 masters" if lora is None else
                f"fp32 LoRA adapters, rank {lora.rank}")]
  if trainer.base_params is not None:
    parts.append(Part("frozen base", device_bytes(trainer.base_params), "trainer", f"LoRA's base, {run.generator.dtype}"))
  parts.append(Part("optimizer state", device_bytes(trainer.opt_state), "trainer", "AdamW moments, fp32"))
  if trainer.ref_params is not None:
    parts.append(Part("KL reference", device_bytes(trainer.ref_params), "trainer", f"{model_config.dtype}"))
  parts.append(Part("gradients", params, "trainer", "fp32, one per trained weight (inside the step's temporaries)"))
  if step_memory is None:
    parts.append(Part("activations", None, "trainer", "not compiled: no device limit to check against"))
  else:
    acts = max(step_memory["temporaries"] - params, 0.0)
    parts.append(Part("activations", acts, "trainer",
                      f"XLA: step temporaries {_size(step_memory['temporaries'])} - gradients; "
                      f"{r.rows} x ({prompt_len} + {R}), {run.train.microbatches} microbatches, remat {run.train.remat!r}"))
  gen_dtype = jnp.dtype(g.dtype)
  copies = shapes.versions_held
  parts.append(Part("generator weights", copies * gen_weights, "generator",
                    f"{copies} x {_size(gen_weights)} ({gen_dtype.name}; versions held for lag {run.schedule.max_policy_lag} "
                    "+ the engine's)"))
  pool = shapes.kv_pool_positions * kv_bytes_per_position(model_config, gen_dtype) / m.generator_tp
  if shapes.engine == "slots":
    parts.append(Part("KV pool", pool, "generator", f"slot engine: {shapes.slots} slots x ({shapes.engine_prompt_len}"
                      f" + {r.max_new_tokens}) positions, blocks of {g.kv_block_size}"))
  else:
    parts.append(Part("KV pool", pool / m.generator_dp, "generator",
                      f"static sampler: {r.rows} rows x ({shapes.engine_prompt_len} + {R}) positions"))
  if eval_rows:
    ev = eval_rows * (prompt_len + R) * kv_bytes_per_position(model_config, gen_dtype) / (m.generator_dp * m.generator_tp)
    parts.append(Part("evaluation KV", ev, "generator", f"static sampler: {eval_rows} rows x ({prompt_len} + {R})"))
  parts.extend(reward)
  return MemoryPlan(tuple(parts), colocated=m.colocated, device_kind=device_kind, capacity=capacity, limit=limit,
                    step_memory=step_memory)


def reward_model_config(run: RunConfig) -> ModelConfig | None:
  """The reward model's config (`RewardConfig.model_path`'s config.json in `model_dtype`); None without one."""
  import json
  from pathlib import Path

  from llamarl_jax.model import hf

  if not run.reward.model_path:
    return None
  path = Path(run.reward.model_path) / "config.json"
  if not path.is_file():
    raise hf.CheckpointError(f"RewardConfig.model_path = {run.reward.model_path!r}: no config.json there (a reward "
                             "model is an HF *ForSequenceClassification directory)")
  return hf.config_from_hf(json.loads(path.read_text()), source=str(path), dtype=jnp.dtype(run.reward.model_dtype))


def reward_model_parts(config: ModelConfig, run: RunConfig, shapes: RunShapes, mesh, *, compile: bool) -> list[Part]:
  """The reward model's weights and (compiled) scoring temporaries on `mesh`, its devices' share."""
  from llamarl_jax.rewards.reward_model import RewardModel

  device = "reward" if run.mesh.reward_dp else "generator"
  where = (f"its own {run.mesh.reward_dp} x tp {run.mesh.reward_tp} devices" if run.mesh.reward_dp
           else "the generator's devices")
  model = RewardModel(config, None, mesh=mesh)  # shapes only
  parts = [Part("reward model weights", device_bytes(model.params), device,
                f"{config.num_params() / 1e9:.2f}B, {jnp.dtype(config.dtype).name}, on {where}")]
  rows, width = model.chunk_shape(min(shapes.rows, model.batch_rows), shapes.prompt_limit + shapes.response_width)
  if not compile:
    parts.append(Part("reward model activations", None, device, "not compiled"))
    return parts
  stats = model.lower_scores(rows, width).compile().memory_analysis()
  parts.append(Part("reward model activations", float(stats.temp_size_in_bytes), device,
                    f"XLA: its widest chunk, {rows} rows x {width} tokens (the policy's tokens; re-tokenised "
                    "text may be longer)"))
  return parts


def plan_run(model_config: ModelConfig, run: RunConfig, *, eval_rows: int, shapes: RunShapes | None = None,
             mesh=None, compile: bool | None = None, capacity: float | None = None,
             limit: float | None = None, reward_mesh=None, generator_mesh=None) -> MemoryPlan:
  """The plan of a run of `model_config` under `run`, made before anything is allocated.

  shapes: the run's geometry (default `RunShapes.of(model_config, run)`).

  mesh, generator_mesh: the trainer mesh to compile for and the generator's (default: the run's,
  `parallel.make_meshes`); meshes over a target topology's devices (GPUs compiled for on a CPU
  machine) work, with capacity and limit given.
  reward_mesh: the reward model's mesh (with `RewardConfig.model_path`; default: the run's own reward
  mesh, else the generator's).
  compile: compile the train step (and the reward model's scoring) for XLA's memory analysis (default:
  where the device has a limit).
  """
  from llamarl_jax import parallel

  if mesh is None or generator_mesh is None:
    meshes = parallel.make_meshes(**dataclasses.asdict(run.mesh))
    mesh = meshes[0] if mesh is None else mesh
    generator_mesh = meshes[1] if generator_mesh is None else generator_mesh
  if reward_mesh is None and run.reward.model_path:
    reward_mesh = parallel.make_reward_mesh(**dataclasses.asdict(run.mesh)) or generator_mesh
  device = mesh.devices.flat[0]
  if capacity is None and limit is None:
    capacity, limit = device_limit(device)
  shapes = RunShapes.of(model_config, run) if shapes is None else shapes
  from llamarl_jax import build

  trainer = build.abstract_trainer(model_config, run, mesh)
  do_compile = limit is not None if compile is None else compile
  step = (train_step_memory(trainer, shapes.rows, shapes.prompt_limit, shapes.response_width)
          if do_compile else None)
  rm_config = reward_model_config(run)
  reward = [] if rm_config is None else reward_model_parts(rm_config, run, shapes, reward_mesh, compile=do_compile)
  gen_weights = generator_weight_bytes(model_config, run.generator.dtype, generator_mesh)
  return plan(model_config, run, shapes=shapes, trainer=trainer, gen_weights=gen_weights, eval_rows=eval_rows, step_memory=step,
              device_kind=device.device_kind, capacity=capacity, limit=limit, reward=reward)
