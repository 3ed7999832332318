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


def test_expert_parallel_layer_by_replicate_and_by_token_dispatch():
  """One MoE layer's grouped matmuls at Qwen3-30B-A3B's shapes (4096 tokens, embed 2048, 128 experts
  of 768, top-8, bf16) over expert=8 H100s, as `scripts/bench_moe_dispatch.py` compiles them. Today's
  way sends one all-reduce of the `[4096, 2048]` output over `expert` forward and one (x's and the
  routing weights' gradients) backward; token dispatch lowers with `ragged_all_to_all` for the GPU:
  forward the rows out and back (2 ragged all-to-alls) and the output's all-gather, no all-reduce,
  forward + backward 4 ragged all-to-alls. What each sends (the ragged ones at uniform routing) is
  `moe.expert_parallel_bytes`' figure within 5% (the counts' and offsets' all-to-alls, the ragged
  exchanges' offsets), and it puts dispatch at 1.5x replicate's bytes here, so the default stays
  replicate."""
  from llamarl_jax import parallel
  from llamarl_jax.model import moe
  from scripts import bench_moe_dispatch as bench

  mesh = parallel.make_mesh(h100.target_devices(8), expert=8)
  got = {way: bench.measure(mesh, way, 4096, 8, bench.A3B, concrete=False) for way in ("replicate", "dispatch")}
  assert got["replicate"]["forward"]["ops"] == {"all-reduce": 1}
  assert got["replicate"]["step"]["ops"] == {"all-reduce": 2}
  assert got["dispatch"]["forward"]["ops"] == {"ragged-all-to-all": 2, "all-gather": 1, "all-to-all": 3}
  step_ops = got["dispatch"]["step"]["ops"]
  assert step_ops["ragged-all-to-all"] == 4 and "all-reduce" not in step_ops, step_ops
  for way, programs in got.items():
    for name, f in programs.items():
      assert abs(f["sent"] - f["model"]) <= 0.05 * f["model"], (way, name, f["sent"], f["model"])
  assert 1.4 < got["dispatch"]["forward"]["sent"] / got["replicate"]["forward"]["sent"] < 1.6
  assert moe.choose_expert_parallel({"expert": 8}, 4096, 8, 2048, 128) == "replicate"


def test_engine_decode_on_a_generator_expert_axis_sends_only_partial_sums():
  """The generator on expert=4 H100s (`MeshConfig.generator_expert = 4`, `generator_tp = 1`): the
  engine's full-width decode step runs its MoE layers over the mesh (`moe.grouped_swiglu`, replicate:
  each device its 32 experts), so over `expert` it sends one psum of each layer's `[256, 2048]` bf16
  output, 2 * 3/4 of 1 MiB, and gathers no expert's weights. Under XLA's own partitioning of the
  layers (the forward not given its mesh) the step all-gathers both expert matrices whole, 864 MiB
  per device per layer (BENCHMARKS.md)."""
  from llamarl_jax.measure import hlo

  run = h100.load_run(MOE, "ModelConfig.num_layers = 2", "MeshConfig.generator_expert = 4",
                      "MeshConfig.generator_tp = 1")
  mesh = h100.meshes(run)[1]
  assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "expert": 4, "tp": 1}  # every collective is over `expert`
  programs = h100.slot_programs(run, mesh)
  key = min(k for k in programs.program_keys() if k[0] == "decode" and k[1] == programs.widths[0])
  found = hlo.collectives(h100.compile_slot_program(programs, key).text)
  assert [c["op"] for c in found] == ["all-reduce"] * 2, found
  assert sum(c["sent_bytes"] for c in found) == 2 * (2 * 3 / 4 * 256 * 2048 * 2)
