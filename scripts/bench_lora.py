#!/usr/bin/env python
"""LoRA serving: one decode step with the adapters merged into the weights (`w + alpha / rank * a @ b`,
what the generator serves: `WeightSync` / `transfer.LoraPlan` merge each pushed version) against the
same step applying them unmerged (`y + scale * (x @ a) @ b` on every adapted projection, as the
trainer's forward does), from abstract shapes, nothing allocated: XLA's bytes accessed, FLOPs and
kernel count of the compiled step.

The step: B rows, one token each, every layer (unrolled) over a dense KV cache of --cache positions
(the attention is the same in both forms), greedy argmax over the fp32 logits; weights, adapters and
cache in bf16. Bytes are XLA's generic cost analysis of the optimized module (a GPU target: its
fusions, i.e. its kernels), corrected as `bench_generate --bytes` does (fused gathers / in-place
scatters charged what they touch, cuBLAS calls their operands and result). Kernels: the entry
computation's instructions that launch work (fusions, custom calls, copies; not parameters, tuples,
bitcasts or constants). --target h100 compiles for an H100 that is not there (JAX's CUDA plugin:
`bench_generate.CUDA_PLUGIN_HELP`); no autotuning runs without the device.

  JAX_PLATFORMS=cpu,cuda JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 PYTHONPATH=/tmp/cudasite \\
    PATH=/tmp/cudasite/nvidia/cuda_nvcc/bin:$PATH \\
    python -m scripts.bench_lora --target h100 --sizes 1b,8b --ranks 8,32 --batch 64
"""

import argparse
import re
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (vocab, hidden, intermediate, layers, heads, kv heads, head dim, tied embeddings)
SIZES = {
    "tiny": (256, 64, 128, 2, 4, 2, 16, True),
    "1b": (128256, 2048, 8192, 16, 32, 8, 64, True),      # Llama-3.2-1B
    "8b": (128256, 4096, 14336, 32, 32, 8, 128, False),   # Llama-3.1-8B
}
NOT_KERNELS = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all"}


def model_config(size: str):
  from llamarl_jax.model.config import ModelConfig

  vocab, d, f, layers, heads, kv, hd, tied = SIZES[size]
  return ModelConfig(vocab_size=vocab, hidden_size=d, intermediate_size=f, num_layers=layers, num_heads=heads,
                     num_kv_heads=kv, head_dim=hd, max_position_embeddings=8192, rope_theta=500000.0,
                     tie_word_embeddings=tied, dtype="bfloat16", param_dtype="bfloat16")


def decode_step(graphdef, params, adapters, lora_scale, tokens, cache):
  """One greedy decode step: tokens `[B, 1]`, a dense `KVCache` with a write slot per row
  (`index` `[B]`); adapters None (merged weights) or the `lora.adapter_shapes` tree applied unmerged.
  Returns (next tokens `[B]`, the cache with this token's K/V written)."""
  import jax.numpy as jnp

  from llamarl_jax.model.config import rope_frequencies
  from llamarl_jax.model.layers import LoraLayer
  from llamarl_jax.model.llama import KVCache, merge_params

  model = merge_params(graphdef, params)
  c = model.config
  positions = cache.index[:, None]
  mask = (jnp.arange(cache.max_len) <= positions)[:, None, :]  # [B, 1, S]
  inv_freq = rope_frequencies(c)
  x = jnp.take(model.embed[...], tokens, axis=0).astype(c.dtype)
  new_k, new_v = [], []
  for i, block in enumerate(model.layers):
    lora = None if adapters is None else LoraLayer(adapters["layers"][i], lora_scale)
    x, (k, v) = block(x, positions, inv_freq, mask, (cache.k[i], cache.v[i], cache.index), lora=lora)
    new_k.append(k)
    new_v.append(v)
  logits = model.logits(model.final_norm(x))[:, -1]
  return jnp.argmax(logits, axis=-1), KVCache(k=tuple(new_k), v=tuple(new_v), index=cache.index + 1)


def kernel_count(hlo_text: str) -> int:
  """Instructions of the entry computation that launch work (see the module docstring)."""
  count, inside = 0, False
  for line in hlo_text.splitlines():
    if line.startswith("ENTRY "):
      inside = True
      continue
    if inside:
      if line.startswith("}"):
        break
      m = re.match(r"\s*(?:ROOT\s+)?%\S+\s*=\s*.*?\s([a-z][a-z0-9-]*)\(", line)
      if m and m.group(1) not in NOT_KERNELS:
        count += 1
  return count


def step_cost(config, mesh, *, batch: int, cache_len: int, lora=None) -> dict:
  """XLA's cost of one decode step compiled for `mesh`'s device; lora: a `LoraConfig` applied unmerged
  (None: merged weights, the step of full fine-tuning)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  from llamarl_jax.measure import hlo
  from llamarl_jax.model import lora as lora_lib
  from llamarl_jax.model.llama import KVCache, abstract_model, split_params

  repl = NamedSharding(mesh, P())
  sds = lambda x, dtype=None: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=repl)
  graphdef, params = split_params(abstract_model(config))
  params = jax.tree.map(sds, params)
  adapters = None if lora is None else jax.tree.map(lambda s: sds(s, jnp.bfloat16),
                                                    lora_lib.adapter_shapes(config, lora))
  cache = jax.eval_shape(lambda: KVCache.init(config, batch, cache_len).replace(index=jnp.zeros((batch,), jnp.int32)))
  cache = jax.tree.map(sds, cache)
  tokens = jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=repl)
  scale = 0.0 if lora is None else lora_lib.scale(lora)
  t0 = time.perf_counter()
  compiled = jax.jit(lambda p, a, t, c: decode_step(graphdef, p, a, scale, t, c), donate_argnums=(3,),
                     out_shardings=repl).lower(params, adapters, tokens, cache).compile()
  seconds = time.perf_counter() - t0
  xla_bytes, generic = hlo.compiled_bytes_accessed(compiled)
  text = compiled.as_text()
  over = float(hlo.fused_index_overcount(text)) if generic else 0.0
  library = float(hlo.library_call_bytes(text)) if generic else 0.0
  cost = hlo.generic_cost_analysis(compiled)
  adapter_bytes = 0 if adapters is None else sum(x.size * 2 for x in jax.tree.leaves(adapters))
  return {"bytes": xla_bytes - over + library, "flops": float((cost or {}).get("flops", float("nan"))),
          "kernels": kernel_count(text), "adapter_bytes": adapter_bytes, "compile_s": seconds}


def _gb(n):
  return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--sizes", default="1b,8b", help=f"comma-separated, of {sorted(SIZES)}")
  parser.add_argument("--ranks", default="8,32")
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--cache", type=int, default=1024, help="dense KV cache positions per row")
  parser.add_argument("--target", default="default", choices=["default", "h100"],
                      help="compile for this machine's first device, or for an H100 it does not have")
  args = parser.parse_args(argv)
  import jax

  from scripts import bench_generate
  from llamarl_jax.config import LORA_TARGETS, LoraConfig

  mesh = bench_generate.target_mesh(args.target)
  device = mesh.devices.flat[0]
  print(f"# one decode step, merged vs unmerged LoRA (every projection: {', '.join(LORA_TARGETS)}), B={args.batch}, "
        f"dense KV cache {args.cache}, bf16; compiled for {device.device_kind} ({device.platform}"
        f"{', no device attached' if args.target != 'default' else ''}), jax {jax.__version__}")
  print("| model | serving | rank | bytes/step | vs merged | kernels | GFLOP/step | adapters (bf16) | compile |")
  print("|---|---|---|---|---|---|---|---|---|")
  rows = []
  for size in args.sizes.split(","):
    config = model_config(size)
    merged = step_cost(config, mesh, batch=args.batch, cache_len=args.cache)
    print(f"| {size} | merged | - | {_gb(merged['bytes'])} | 1.000x | {merged['kernels']} | "
          f"{merged['flops'] / 1e9:.1f} | - | {merged['compile_s']:.0f} s |", flush=True)
    rows.append(dict(merged, size=size, serving="merged", rank=None))
    for rank in (int(r) for r in args.ranks.split(",")):
      lora = LoraConfig(rank=rank, alpha=2.0 * rank, targets=LORA_TARGETS)
      c = step_cost(config, mesh, batch=args.batch, cache_len=args.cache, lora=lora)
      print(f"| {size} | unmerged | {rank} | {_gb(c['bytes'])} | {c['bytes'] / merged['bytes']:.3f}x | "
            f"{c['kernels']} | {c['flops'] / 1e9:.1f} | {c['adapter_bytes'] / 1e6:.1f} MB | {c['compile_s']:.0f} s |",
            flush=True)
      rows.append(dict(c, size=size, serving="unmerged", rank=rank))
  return rows


if __name__ == "__main__":
  main()
