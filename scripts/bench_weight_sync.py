#!/usr/bin/env python
"""Weight-sync cost: `WeightSync.push` (trainer FSDP mesh -> generator TP mesh, disjoint devices) against
the copy limit of the same machine.

For each model size and sync mode it times `WeightSync.push` (its own `sync/seconds`: cast or quantise
on the trainer mesh, `jax.device_put` reshard to the generator's shardings, `block_until_ready`), the median of `--repeats` pushes after one warm-up push (compilation). Modes:

  fp32 -> fp32   no cast: the trainer's fp32 weights resharded as they are
  fp32 -> bf16   cast on the trainer mesh, half the bytes cross
  fp8 -> bf16    the projections quantised to float8_e4m3fn + per-output-channel fp32 scales on the
                 trainer mesh (`model.fp8`), the rest cast to bf16; what crosses is what the fp8
                 generator computes with (no de-quantisation)
  LoRA r8 / r32  a LoRA policy (every projection): the fp32 adapters cross and the generator merges
                 `w + alpha / rank * a @ b` into its bf16 copy of the frozen base (moved once, by the
                 warm-up push); the push time includes the merge

The copy limit is a plain `jax.device_put` of an already-cast tree of the same bytes between the same
two device sets, with identical shardings on both sides (the source laid out like the generator over
the trainer's devices), so every shard is one device-to-device copy: no cast, no reshuffle. push /
copy is what the cast and the resharding cost on top of moving the bytes.

On CPU the devices are fake (`compat.ensure_cpu_devices`: 8, unless XLA_FLAGS sets a count)
and a "transfer" is a memcpy on the same cores; on GPUs it is NVLink / the network.

  python scripts/bench_weight_sync.py                     # ~1M, ~10M, ~50M params, < 60 s on 2 cores
  python scripts/bench_weight_sync.py --sizes 50m,200m,1b --repeats 5
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from llamarl_jax import compat  # noqa: E402  (no jax import: before JAX starts)

compat.ensure_cpu_devices(8)


# name: (vocab, hidden, intermediate, layers, heads, kv_heads)
SIZES = {
    "1m": (1024, 128, 384, 4, 4, 2),
    "10m": (8192, 256, 768, 8, 4, 2),
    "50m": (16384, 512, 1536, 10, 8, 4),
    "200m": (32000, 1024, 2816, 12, 16, 8),
    "1b": (128256, 2048, 8192, 16, 32, 8),  # Llama 3.2 1B shapes, untied
}
# mode: (generator dtype, quantize, LoRA rank or None)
MODES = {"fp32 -> fp32": ("float32", None, None), "fp32 -> bf16": ("bfloat16", None, None),
         "fp8 -> bf16": ("bfloat16", "fp8", None), "LoRA r8 -> bf16": ("bfloat16", None, 8),
         "LoRA r32 -> bf16": ("bfloat16", None, 32)}


def model_config(name):
  from llamarl_jax.model.config import ModelConfig

  vocab, d, f, layers, heads, kv = SIZES[name]
  return ModelConfig(vocab_size=vocab, hidden_size=d, intermediate_size=f, num_layers=layers, num_heads=heads,
                     num_kv_heads=kv, max_position_embeddings=2048)


def trainer_params(config, mesh, seed=0):
  """Random fp32 params in the trainer's FSDP shardings (drawn on the host: setup, not timed), and axes."""
  import jax
  import numpy as np

  from llamarl_jax import parallel
  from llamarl_jax.model.llama import abstract_model, split_params

  abstract = abstract_model(config)
  _, shapes = split_params(abstract)
  axes = parallel.logical_axes(abstract)
  rng = np.random.default_rng(seed)
  host = jax.tree.map(lambda s: 0.02 * rng.standard_normal(s.shape, dtype=np.float32), shapes)
  return jax.block_until_ready(jax.device_put(host, parallel.param_shardings(shapes, axes, mesh))), axes


def same_layout_on(devices_mesh, target):
  """`target`'s sharding, over the devices of `devices_mesh` reshaped like `target`'s mesh."""
  from jax.sharding import Mesh, NamedSharding

  mesh = Mesh(devices_mesh.devices.reshape(target.mesh.devices.shape), target.mesh.axis_names)
  return NamedSharding(mesh, target.spec)


def lora_sync(config, params, axes, trainer_mesh, gen_mesh, rank, dtype):
  """(a LoRA WeightSync whose base is `params` cast to `dtype` on the trainer mesh, random fp32 adapters
  of `rank` on every projection in the trainer's shardings)."""
  import jax
  import numpy as np

  from llamarl_jax import parallel
  from llamarl_jax.config import LORA_TARGETS, LoraConfig
  from llamarl_jax.executors.weight_sync import WeightSync
  from llamarl_jax.model import lora as lora_lib

  lora = LoraConfig(rank=rank, alpha=2.0 * rank, targets=LORA_TARGETS)
  shapes, adapter_axes = lora_lib.adapter_shapes(config, lora), lora_lib.adapter_axes(axes, lora)
  rng = np.random.default_rng(1)
  adapters = jax.device_put(jax.tree.map(lambda s: 0.01 * rng.standard_normal(s.shape, dtype=np.float32), shapes),
                            parallel.param_shardings(shapes, adapter_axes, trainer_mesh))
  base = jax.block_until_ready(jax.tree.map(lambda x: x.astype(dtype), params))
  gen_shapes = jax.eval_shape(lambda p: p, params)
  sync = WeightSync(parallel.param_shardings(gen_shapes, axes, gen_mesh), dtype=dtype,
                    adapter_shardings=parallel.param_shardings(shapes, adapter_axes, gen_mesh),
                    lora_scale=lora_lib.scale(lora), base=lambda: base)
  return sync, adapters


def bench_one(config, params, axes, trainer_mesh, gen_mesh, mode, repeats):
  import jax
  import jax.numpy as jnp

  from llamarl_jax import parallel
  from llamarl_jax.executors.weight_sync import WeightSync, tree_bytes

  dtype, quantize, rank = MODES[mode]
  num_params = sum(x.size for x in jax.tree.leaves(params))
  if rank is None:
    shapes = jax.eval_shape(lambda p: p, params)
    sync = WeightSync(parallel.param_shardings(shapes, axes, gen_mesh), dtype=jnp.dtype(dtype), quantize=quantize)
  else:
    sync, params = lora_sync(config, params, axes, trainer_mesh, gen_mesh, rank, jnp.dtype(dtype))
  sync.push(params, 0)  # warm-up: compiles the cast / quantise (LoRA: the merge; moves the base)
  push = [sync.push(params, v + 1)["sync/seconds"] for v in range(repeats)]
  nbytes = int(sync.history[-1]["sync/bytes"])

  moved, targets = sync.wire(params)  # exactly the bytes and layout a push moves across meshes
  is_sharding = lambda x: isinstance(x, jax.sharding.Sharding)
  sources = jax.tree.map(lambda t: same_layout_on(trainer_mesh, t), targets, is_leaf=is_sharding)
  source = jax.block_until_ready(jax.device_put(moved, sources))
  assert tree_bytes(source) == nbytes, (tree_bytes(source), nbytes)
  jax.block_until_ready(jax.device_put(source, targets))  # warm-up
  copy = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(jax.device_put(source, targets))
    copy.append(time.perf_counter() - start)
  return dict(params=num_params, mode=mode, bytes=nbytes,
              push=statistics.median(push), copy=statistics.median(copy))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--sizes", default="1m,10m,50m", help=f"comma-separated, from {sorted(SIZES)}")
  parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {list(MODES)}")
  parser.add_argument("--repeats", type=int, default=5, help="timed pushes (median) after one warm-up")
  parser.add_argument("--trainer_fsdp", type=int, default=4)
  parser.add_argument("--generator_tp", type=int, default=4)
  args = parser.parse_args(argv)
  sizes, modes = args.sizes.split(","), args.modes.split(",")
  for name in sizes:
    if name not in SIZES:
      parser.error(f"unknown size {name!r}; choose from {sorted(SIZES)}")
  for mode in modes:
    if mode not in MODES:
      parser.error(f"unknown mode {mode!r}; choose from {list(MODES)}")

  import jax

  from llamarl_jax import parallel

  trainer_mesh, gen_mesh = parallel.make_meshes(trainer_fsdp=args.trainer_fsdp,
                                                 generator_tp=args.generator_tp)
  dev = jax.devices()[0]
  print(f"# weight sync: trainer fsdp{args.trainer_fsdp} -> generator tp{args.generator_tp}, disjoint "
        f"{dev.platform} devices ({dev.device_kind}; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores), median of {args.repeats}\n")
  print("| params | mode | bytes moved | push s | push GB/s | copy-limit s | copy GB/s | push / copy |")
  print("|---|---|---|---|---|---|---|---|")
  t0 = time.perf_counter()
  for name in sizes:
    config = model_config(name)
    params, axes = trainer_params(config, trainer_mesh)
    for mode in modes:
      r = bench_one(config, params, axes, trainer_mesh, gen_mesh, mode, args.repeats)
      print(f"| {r['params'] / 1e6:.1f}M | {mode} | {r['bytes'] / 1e6:.1f} MB | {r['push']:.4f} | "
            f"{r['bytes'] / r['push'] / 1e9:.2f} | {r['copy']:.4f} | {r['bytes'] / r['copy'] / 1e9:.2f} | "
            f"{r['push'] / r['copy']:.1f}x |", flush=True)
  print(f"\n({time.perf_counter() - t0:.0f} s in all)")


if __name__ == "__main__":
  main()
