"""The reward model's scoring program and the weight push compiled for an H100.

Reward model: configs/llama3_8b_rm.gin (a Llama-3.1-8B policy; Skywork-Reward-Llama-3.1-8B, bf16, on its
own 2 devices, tensor-parallel): the scoring program of the widest chunk a step sends it
(`RewardModel.chunk_shape`: 64 rows of 512 + 1024 tokens, rounded to 2048), as the memory plan
compiles it. The checkpoints' config.json files (their architectures, no weights) are written here.

Weight push (`executors.weight_sync.WeightSync`): the trainer's fp32 params cast (bf16) or quantised
(fp8) on the trainer mesh, then `jax.device_put` onto the generator's shardings. On `make run-gpu`'s one
GPU the two meshes are one device with the same layout, so the put moves nothing: the push is the cast.
On meshes sharing devices in two layouts (colocated over 2 GPUs: trainer FSDP 2, generator tensor
parallel 2) the put is a resharding program, compiled here as `device_put` builds it (an identity
with the generator's shardings). Across disjoint meshes it is a device-to-device copy, not a program.
"""

import json

import jax
import pytest

from cuda_compile import h100
from llamarl_jax import build, memory_plan, parallel
from llamarl_jax.executors.weight_sync import WeightSync
from llamarl_jax.model.llama import abstract_model

LLAMA_31_8B = {  # Llama-3.1-8B's config.json (architecture only)
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def _config_json(directory, **extra):
  directory.mkdir()
  (directory / "config.json").write_text(json.dumps({**LLAMA_31_8B, **extra}))
  return directory


def test_reward_model_scoring(tmp_path, figures):
  from llamarl_jax.rewards.reward_model import RewardModel

  policy = _config_json(tmp_path / "policy", architectures=["LlamaForCausalLM"])
  rm = _config_json(tmp_path / "rm", architectures=["LlamaForSequenceClassification"], id2label={"0": "LABEL_0"})
  run = h100.load_run("configs/llama3_8b_rm.gin", "build_policy.model_path = None",
                      f"build_policy.config_json = '{policy}/config.json'", f"RewardConfig.model_path = '{rm}'")
  mesh = h100.meshes(run)[2]
  assert dict(mesh.shape)["tp"] == 2
  model = RewardModel(memory_plan.reward_model_config(run.config), None, mesh=mesh)  # shapes only
  rows, width = model.chunk_shape(min(run.shapes.rows, model.batch_rows),
                                  run.shapes.prompt_limit + run.shapes.response_width)
  assert (rows, width, model.attention) == (64, 2048, "cudnn")
  program = figures.add("reward_model/score_64x2048", h100.compile_program(model.lower_scores(rows, width).compile))
  assert "__cudnn$fmhaSoftmax" in program.text  # each layer's attention, its heads split over the 2 devices
  figures.verify()


PUSHES = {  # name: the bindings on `make run-gpu`'s config
    "bf16": (),
    "fp8": h100.FP8,
    "bf16_colocated_fsdp2_tp2": ("MeshConfig.trainer_fsdp = 2", "MeshConfig.generator_tp = 2"),
}


@pytest.mark.parametrize("push", PUSHES)
def test_weight_push(push, figures):
  run = h100.load_run(h100.RUN_GPU, *PUSHES[push])
  trainer_mesh, generator_mesh, _ = h100.meshes(run)
  abstract = abstract_model(run.model)
  axes = parallel.logical_axes(abstract)
  trainer = build.abstract_trainer(run.model, run.config, trainer_mesh)
  sync = build.weights(run.config, run.model, axes, parallel.param_shardings(trainer.params, axes, generator_mesh),
                       generator_mesh, base=lambda: None)
  wire = figures.add(f"push/{push}/wire", h100.compile_program(
      jax.jit(lambda params: sync.wire(params)[0]).trace(trainer.params).lower().compile)).compiled
  same = jax.tree.leaves(jax.tree.map(lambda x, want: x.sharding.is_equivalent_to(want, len(x.shape)),
                                      wire.out_info, sync.out_shardings))
  if all(same):  # the put moves nothing
    assert trainer_mesh.devices.size == 1
  else:
    lowered = jax.jit(lambda tree: tree, out_shardings=sync.out_shardings).trace(wire.out_info).lower()
    figures.add(f"push/{push}/reshard", h100.compile_program(lowered.compile))
  figures.verify()
