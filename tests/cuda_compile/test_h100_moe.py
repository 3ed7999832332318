"""The mixture-of-experts configuration's train step and slot engine program set compiled for an H100.

configs/qwen3_30b_a3b.gin with 2 of its 48 layers: each layer at Qwen3-30B-A3B's shapes (hidden 2048,
128 experts of width 768, 8 per token, 32 query / 4 KV heads of 128), every layer sparse, on its meshes
(trainer FSDP over 4 H100s, generator tensor-parallel over 4 others), LoRA on q/k/v/o, routing replay,
512 rows of 512 + 1024 positions in 64 microbatches, 256 slots. Two layers take the same code paths as
48 (the trainer scans its layers; the engine's programs unroll them, so their compile time grows with
the layer count: the 48-layer trainer step alone compiles in about a minute on 2 cores).
"""

from cuda_compile import h100

MOE = "configs/qwen3_30b_a3b.gin"


def _run():
  run = h100.load_run(MOE, "ModelConfig.num_layers = 2")
  assert run.model.num_experts == 128 and run.model.moe_layers == (0, 1) and run.config.train.routing_replay
  return run


def test_train_step(figures):
  from llamarl_jax.build import abstract_trainer

  run = _run()
  trainer = abstract_trainer(run.model, run.config, h100.meshes(run)[0])
  s = run.shapes
  lowered = trainer.lower_step(s.rows, s.prompt_limit, s.response_width)
  figures.add("moe/train/padded", h100.compile_program(lowered.compile))
  figures.verify()


def test_engine_program_set(figures):
  run = _run()
  programs = h100.slot_programs(run, h100.meshes(run)[1])
  assert programs.moe_layers == 2  # the generator records each token's experts for routing replay
  keys = programs.program_keys()
  program_set = {"attention": programs.attention_form, "programs": [list(k) for k in keys]}
  recorded = h100.recorded("moe/engine/set", program_set)
  assert recorded == program_set, f"the program set is {program_set}, bounds.json records {recorded}"
  for key in keys:
    figures.add(f"moe/engine/{'_'.join(map(str, key))}", h100.compile_slot_program(programs, key))
  figures.verify()
