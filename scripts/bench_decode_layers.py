#!/usr/bin/env python
"""One slot-engine decode step compiled for an H100 on the CPU: kernels, bytes and compile time, with
the generator's weights fused (the serving layout: Q/K/V and gate/up, `model.serving`) or in the
trainer's layout, and the layers unrolled (the engine's model) or under `lax.scan`.

Nothing runs and nothing is allocated: each step (`SlotPrograms.decode_step`: the paged forward of one token
per slot, the lm_head, sampling, the slot state's update; every slot running) is lowered from abstract
shapes and compiled by XLA's GPU compiler for the H100 target description (`bench_generate --bytes_target`,
no autotuning without the device). Kernels are counted from the optimized module (`hlo.kernel_counts`:
fusions, GEMMs, custom calls, other launches; a scan's body times its trip count); per layer is the
difference between the model at L and L - 1 layers, the rest (embedding, final norm, lm_head,
sampling, state) is the remainder. Bytes are `decode_step_cost`'s (XLA's cost analysis with the
gather/scatter correction, cuBLAS calls and the Pallas kernel's reads added).
Scanned: the same Block code over stacked layer weights and a stacked KV pool `[L, blocks, ...]` (the
pool passes through the scan as its input and output per layer). Also the engine's decode program (a
chunk of steps in a `while_loop`, unrolled layers) compile time in each layout.

  JAX_PLATFORMS=cpu,cuda JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 PYTHONPATH=/tmp/cudasite \\
    PATH=/tmp/cudasite/nvidia/cuda_nvcc/bin:$PATH python -m scripts.bench_decode_layers --size 1b --slots 64
"""

import argparse
import json
import time
from pathlib import Path


class ScannedModel:
  """The duck-typed model `SlotPrograms.decode_step` calls (`hidden_states` over a paged cache, `logits`),
  its layers under `lax.scan`: params are `prepare_params`-stacked, the pool's k, v `[L, NB, bs, KV, D]`."""

  def __init__(self, config, layout, params):
    from flax import nnx

    from llamarl_jax.model.llama import Block

    self.config, self.params = config, params
    self.block = nnx.split(nnx.eval_shape(lambda: Block(config, nnx.Rngs(0), layout)))[0]

  def hidden_states(self, tokens, positions, pages):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from llamarl_jax.model.config import rope_frequencies
    from llamarl_jax.model.layers import rms_norm
    from llamarl_jax.model.paged_attention import PagedLayer

    c, p = self.config, self.params
    inv_freq = rope_frequencies(c)
    x = jnp.take(p["embed"], tokens, axis=0).astype(jnp.dtype(c.dtype))

    def layer(x, xs):
      lp, k, v = xs
      plan = PagedLayer(k, v, pages.write_block, pages.write_offset, pages.entry_row, pages.entry_block,
                        pages.entry_len)
      x, (k, v), _ = nnx.merge(self.block, lp)(x, positions, inv_freq, None, plan)
      return x, (k, v)

    x, (k, v) = jax.lax.scan(layer, x, (p["layers"], pages.k, pages.v))
    return rms_norm(x, p["final_norm"]["scale"], c.rms_norm_eps), pages.replace(k=k, v=v)

  def logits(self, x):
    import jax.numpy as jnp

    w = self.params["embed"].T if self.config.tie_word_embeddings else self.params["lm_head"]
    return jnp.einsum("...e,ev->...v", x, w.astype(x.dtype), preferred_element_type=jnp.float32)


def step_cost(programs, weight_layout, prompt, n_gen, scanned: bool) -> dict:
  """Kernels, bytes and compile seconds of one decode step of `programs` (every slot running; weights
  in `weight_layout`, the programs' sampler's)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from llamarl_jax.generation import paged
  from llamarl_jax.generation.paged import KVPages
  from llamarl_jax.measure import hlo
  from llamarl_jax.measure.decode_cost import decode_step_cost
  from llamarl_jax.generation.program_set import DECODE_COMPILER_OPTIONS, compile_lowered
  from llamarl_jax.model.forward import prepare_params

  if not scanned:
    return decode_step_cost(programs, prompt, n_gen)
  c, lay = programs.config, programs.layout
  bs = lay.block_size
  need = int(np.sum(-(-prompt // bs) + -(-n_gen // bs)))
  plan = programs.entry_plan[programs.widths[0]]
  num_entries = paged.entry_bucket(need, plan) if need <= plan[-1] else need
  pool = jax.eval_shape(lambda: lay.empty_pages(c))
  cache = KVPages(k=jax.ShapeDtypeStruct((c.num_layers, *pool.k[0].shape), pool.k[0].dtype),
                  v=jax.ShapeDtypeStruct((c.num_layers, *pool.v[0].shape), pool.v[0].dtype))
  params = jax.eval_shape(lambda p: prepare_params(p, c.dtype), programs.param_avals)
  sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  state = jax.tree.map(sds, jax.eval_shape(programs.empty_state))
  repl = jax.sharding.NamedSharding(programs.mesh, jax.sharding.PartitionSpec())

  def step(params, cache, state, version):
    return programs.decode_step(ScannedModel(c, weight_layout, params), cache, state, version, num_entries)

  lowered = jax.jit(step, donate_argnums=(1, 2), in_shardings=repl, out_shardings=repl).lower(
      params, cache, state, jax.ShapeDtypeStruct((), jnp.int32))
  t0 = time.perf_counter()
  compiled = compile_lowered(lowered, DECODE_COMPILER_OPTIONS)
  compile_s = time.perf_counter() - t0
  text = compiled.as_text()
  xla_bytes, generic = hlo.compiled_bytes_accessed(compiled)
  over = float(hlo.fused_index_overcount(text)) if generic else 0.0
  library = float(hlo.library_call_bytes(text)) if generic else 0.0
  kernel = 0.0
  if 'custom_call_target="__gpu$xla.gpu.triton"' in text and programs.attention_form == "pallas":
    from llamarl_jax.model.paged_kernel import kernel_bytes
    kernel = c.num_layers * kernel_bytes(num_rows=programs.num_slots, num_heads=c.num_heads,
                                         num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, block_size=bs,
                                         live_entries=need, itemsize=jnp.dtype(c.dtype).itemsize)
  ideal = hlo.ideal_step_bytes(c, prompt + n_gen)
  total = xla_bytes - over + kernel + library
  return {"bytes": total, "ideal": ideal["total"], "ratio": total / ideal["total"], "num_entries": num_entries,
          "kernels": hlo.kernel_counts(text), "compile_s": compile_s}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--size", default="1b", help="a bench_generate size (5m, 50m, 400m, 1b) or 8b (Llama-3-8B shapes)")
  parser.add_argument("--layers", type=int, default=None, help="compile this many layers (default: the size's)")
  parser.add_argument("--slots", type=int, default=64)
  parser.add_argument("--prompt", type=int, default=128, help="the longest prompt")
  parser.add_argument("--max_new_tokens", type=int, default=512)
  parser.add_argument("--live", default="100,500", help="live lengths uniform in lo,hi")
  parser.add_argument("--target", default="h100", help="a bench_generate GPU target, or 'default' (this backend)")
  parser.add_argument("--variants", default="serving:unrolled,hf:unrolled,serving:scanned,hf:scanned",
                      help="layout:layers pairs (layout serving|hf, layers unrolled|scanned)")
  parser.add_argument("--decode_program", action="store_true",
                      help="also compile the engine's decode program (a chunk loop) in each layout")
  parser.add_argument("--json", default=None, help="write the rows here")
  args = parser.parse_args(argv)

  import jax
  import numpy as np

  from scripts import bench_generate
  from llamarl_jax.generation import Sampler, SamplingParams
  from llamarl_jax.generation.program_set import DECODE_COMPILER_OPTIONS, compile_lowered
  from llamarl_jax.generation.slot_programs import SlotPrograms
  from llamarl_jax.model.config import HF_LAYOUT, ModelConfig

  mesh = bench_generate.target_mesh(args.target)
  sizes = {**bench_generate.SIZES, "8b": (128256, 4096, 14336, 32, 32, 8)}
  vocab, d, f, layers, heads, kv = sizes[args.size]
  config = ModelConfig(vocab_size=vocab, hidden_size=d, intermediate_size=f, num_layers=args.layers or layers,
                       num_heads=heads, num_kv_heads=kv, rope_theta=500000.0, param_dtype="bfloat16", dtype="bfloat16")
  S, Pm = args.slots, args.prompt
  lo, hi = (int(x) for x in args.live.split(","))
  rng = np.random.RandomState(0)
  live = rng.randint(lo, hi + 1, S)
  prompt = np.minimum(rng.randint(max(1, Pm // 4), Pm + 1, S), live - 1)
  sampling = SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens)
  device = mesh.devices.flat[0]

  def programs_for(layout_name, num_layers):
    c = config.replace(num_layers=num_layers)
    sampler = Sampler(c, mesh, layout=HF_LAYOUT if layout_name == "hf" else None)
    return SlotPrograms(c, sampler, num_slots=S, sampling=sampling, max_prompt_len=Pm, chunk_steps=16,
                        pad_id=0), sampler.layout

  print(f"# one decode step: {args.size} ({config.num_layers} layers) bf16, {S} slots running, prompts <= {Pm}, live lengths {lo}..{hi} "
        f"(mean {live.mean():.0f}), compiled for {device.device_kind} ({device.platform}), jax {jax.__version__}")
  print("| weights | layers | kernels / step | per layer (GEMMs) | rest | bytes / step | bytes / ideal | "
        "step compile s (L / L-1 layers) |")
  print("|---|---|---|---|---|---|---|---|")
  rows = []
  for variant in args.variants.split(","):
    layout_name, layers = variant.split(":")
    full = step_cost(*programs_for(layout_name, config.num_layers), prompt, live - prompt, layers == "scanned")
    less = step_cost(*programs_for(layout_name, config.num_layers - 1), prompt, live - prompt, layers == "scanned")
    per_layer = {k: full["kernels"][k] - less["kernels"][k] for k in full["kernels"]}
    rest = full["kernels"]["total"] - config.num_layers * per_layer["total"]
    row = dict(layout=layout_name, layers=layers, kernels=full["kernels"], per_layer=per_layer, rest=rest,
               bytes=full["bytes"], ratio=full["ratio"], compile_s=full["compile_s"], compile_s_less=less["compile_s"])
    rows.append(row)
    print(f"| {layout_name} | {layers} | {full['kernels']['total']} | {per_layer['total']} ({per_layer['gemm']}) | "
          f"{rest} | {full['bytes'] / 1e9:.3f} GB | {full['ratio']:.2f}x | {full['compile_s']:.1f} / "
          f"{less['compile_s']:.1f} |", flush=True)
  if args.decode_program:
    print("\n| weights | the engine's decode program (chunk of 16 steps, layers unrolled): compile s |")
    print("|---|---|")
    for layout_name in ("serving", "hf"):
      p, _ = programs_for(layout_name, config.num_layers)
      key = ("decode", p.widths[0], p.entry_plan[p.widths[0]][-1])
      t0 = time.perf_counter()
      lowered = p.lower(key)
      t1 = time.perf_counter()
      compile_lowered(lowered, DECODE_COMPILER_OPTIONS)
      seconds = time.perf_counter() - t1
      rows.append(dict(layout=layout_name, program=list(map(str, key)), trace_s=t1 - t0, compile_s=seconds))
      print(f"| {layout_name} | {seconds:.1f} (traced in {t1 - t0:.1f}) |", flush=True)
  if args.json:
    Path(args.json).write_text(json.dumps(rows, indent=1))
  return rows


if __name__ == "__main__":
  main()
