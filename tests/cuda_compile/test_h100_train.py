"""The train step of `make run-gpu` compiled for an H100, in each of the trainer's three layouts, and the
fp8 configuration's.

configs/llama3_1b_1gpu.gin: Llama-3.2-1B shapes (tied embeddings, 128256 ids), bf16 compute over fp32
masters, 64 rows of 512 prompt + 1536 response positions, 8 microbatches, remat 'matmuls', cuDNN's fused
attention (forward and backward). Layouts: padded (the config's: one program), grouped by length (the
config with `TrainConfig.group_by_length`: prepare, one accumulation per width, apply), packed (the
config with `TrainConfig.pack`, rows of 2048 tokens). The fp8 configuration: `h100.FP8` on those shapes
(the trainer differs by its loss; the generator's programs are test_h100_engine.py's).
"""

import jax
import jax.numpy as jnp

from cuda_compile import h100
from llamarl_jax.build import abstract_trainer
from llamarl_jax.train.placement import abstract_batch


def _trainer(run):
  """The run's trainer of shapes only on its H100 trainer mesh (the memory plan's)."""
  return abstract_trainer(run.model, run.config, h100.meshes(run)[0])


def _step(run, figures, name):
  trainer = _trainer(run)
  s = run.shapes
  lowered = trainer.lower_step(s.rows, s.prompt_limit, s.response_width)
  return trainer, figures.add(name, h100.compile_program(lowered.compile)).text


def test_padded_step_runs_cudnn_attention_forward_and_backward(figures):
  trainer, text = _step(h100.load_run(h100.RUN_GPU), figures, "train/padded")
  assert trainer.attention == "cudnn"
  assert "__cudnn$fmhaSoftmax" in text and "__cudnn$fmhaSoftmaxBackward" in text
  figures.verify()


def test_fp8_configuration_step(figures):
  run = h100.load_run(h100.RUN_GPU, *h100.FP8)
  assert run.config.train.loss == "mis"
  _step(run, figures, "train/padded_fp8_config")
  figures.verify()


def test_packed_step(figures):
  """One program whatever the lengths: 64 rows packed into rows of 2048 (= P + R) tokens."""
  run = h100.load_run(h100.RUN_GPU, "TrainConfig.pack = True", "TrainConfig.microbatches = 1",
                      "TrainConfig.tokens_per_microbatch = 2048")
  trainer, _ = _step(run, figures, "train/packed")
  assert trainer.layout.packed
  figures.verify()


def test_grouped_step_programs(figures):
  """The grouped layout's programs, each fed the previous one's outputs as it runs them
  (`TrainPrograms._grouped`): prepare, an accumulation at the widest rung (P + R = 2048) and at a
  narrower one (1024), apply over the 8 microbatches."""
  run = h100.load_run(h100.RUN_GPU, "TrainConfig.group_by_length = True")
  trainer = _trainer(run)
  s, pl, programs, state = run.shapes, trainer.placement, trainer.programs, trainer.state
  shape_of = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  trained, frozen = jax.tree.map(shape_of, (state.trained, (state.base, state.ref)))
  scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=pl.replicated)
  batch = abstract_batch(pl, run.model, s.rows, s.prompt_limit, s.response_width)
  order = jax.ShapeDtypeStruct((s.rows,), jnp.int32, sharding=pl.replicated)
  prepared = figures.add("train/grouped/prepare", h100.compile_program(
      programs.prepare_step.trace(trained, frozen, batch, order).lower().compile)).compiled
  compute, frozen_c, ref_c, micro, totals, grads = prepared.out_info
  outs = None
  for width in (s.prompt_limit + s.response_width, 1024):
    lowered = programs.accumulate_step.trace(compute, frozen_c, ref_c, grads, micro, scalar, totals,
                                             shape_of(state.step), width=width).lower()
    compiled = figures.add(f"train/grouped/accumulate_{width}", h100.compile_program(lowered.compile)).compiled
    outs = outs or compiled.out_info
  grads_out, out = outs
  lowered = programs.apply_step.trace(trained, grads_out, [out] * run.config.train.microbatches, micro).lower()
  figures.add("train/grouped/apply", h100.compile_program(lowered.compile))
  figures.verify()
