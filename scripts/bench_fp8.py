#!/usr/bin/env python
"""fp8 weight scales: per output channel (what `model.fp8` uses) against blocks of 128 x 128.

For one random model (bench_generate's shapes, fp32 compute) it compares next-token distributions
against the bf16 weights' (the generator's unquantised policy), on random tokens:
  bf16                     the reference
  W8 per channel           projections float8_e4m3fn with a scale per output column, de-quantised
  W8 block 128             a scale per 128 x 128 block (DeepSeek-V3's weight blocks), de-quantised
  W8A8 per channel         the fp8 generator itself (`Sampler(quantize='fp8')`: per-channel weights,
                           per-token activations, fp8 dots)
and the bytes the scales add. `--outliers S` multiplies each projection's input rows by
exp(S * N(0, 1)) first (input channels of very different magnitude, as trained LLMs have), the case
where a block's own scale helps most.

    python -m scripts.bench_fp8 --size 50m
    python -m scripts.bench_fp8 --size 50m --outliers 1.0

--step_costs 1b,8b: one decode step of the slot engine (every one of --slots slots running, prompts
<= 128, live lengths 100..500: `bench_generate --bytes`' rows) compiled for an H100 with no GPU
attached (`bench_generate --bytes_target h100`; needs JAX's CUDA plugin), for bf16 and fp8 weights,
with XLA's default GEMMs ("xla defaults": split-K, each GEMM's fp32 partial sums written and summed
by the next kernel) and with the decode programs' options (`program_set.DECODE_COMPILER_OPTIONS`,
what the engine compiles). Bytes: `decode_step_cost`'s (XLA's cost analysis of the GPU's fusions,
gathers and scatters charged what they touch); kernels: `hlo.kernel_counts`, "kernels / layers"
all of them over the layers, "per layer" a decoder layer's own (the step's count minus the count of
the same step with one layer, over the other layers). "fp8, lm_head fp8": the fp8 generator with
`quantize='fp8+lm_head'` (the logits an fp8 GEMM; decode options only). --max_kernels_per_layer N exits
with an error when a decoder layer launches more (the check of the kernel budget; a CPU-only install
cannot run it).

    python -m scripts.bench_fp8 --step_costs 1b,8b --max_kernels_per_layer 10   # 2026-11-28: 8.5 bf16, 9.0 fp8 (+ lm_head)
"""

import argparse
import dataclasses



def block_dequantized(w, n_in, block=128):
  """w `[*in, *out]` quantised to e4m3 with a scale per `block` x `block` tile of its [in, out]
  matrix (edge tiles smaller), de-quantised back to fp32; and the number of scales."""
  import jax.numpy as jnp

  from llamarl_jax.model import fp8

  shape = w.shape
  K = 1
  for d in shape[:n_in]:
    K *= d
  m = w.reshape(K, -1).astype(jnp.float32)
  M = m.shape[1]
  kb, mb = -(-K // block), -(-M // block)
  padded = jnp.pad(m, ((0, kb * block - K), (0, mb * block - M))).reshape(kb, block, mb, block)
  scale = jnp.max(jnp.abs(padded), axis=(1, 3), keepdims=True) / fp8.E4M3_MAX
  scale = jnp.where(scale == 0, 1.0, scale)
  back = ((padded / scale).astype(fp8.FP8).astype(jnp.float32) * scale).reshape(kb * block, mb * block)[:K, :M]
  return back.reshape(shape), kb * mb


def step_costs(sizes, slots=64, max_kernels_per_layer=None):
  """The --step_costs table (see the module docstring); returns its rows as dicts."""
  import jax
  import numpy as np

  from scripts import bench_generate
  from llamarl_jax.generation import Sampler, SamplingParams
  from llamarl_jax.generation.program_set import DECODE_COMPILER_OPTIONS
  from llamarl_jax.generation.slot_programs import SlotPrograms
  from llamarl_jax.measure.decode_cost import decode_step_cost
  from llamarl_jax.model.hf import config_from_hf

  mesh = bench_generate.target_mesh("h100")
  T, Pm = 2048, 128  # bench_generate --bytes' cache and prompt limit
  rng = np.random.RandomState(0)
  live = rng.randint(100, 501, slots)
  prompt = np.minimum(rng.randint(Pm // 4, Pm + 1, slots), live - 1)
  print(f"# one decode step compiled for an H100 (no GPU attached), {slots} slots, live lengths mean "
        f"{live.mean():.0f}, jax {jax.__version__}; decode options {DECODE_COMPILER_OPTIONS}")
  print("| shapes | weights | GEMMs compiled with | bytes / step | fp8 / bf16 | ideal (weights + live KV) | "
        "kernels (GEMMs) | kernels / layers | per layer |")
  print("|---|---|---|---|---|---|---|---|---|")
  # (label, Sampler's quantize); the fp8 lm_head with the decode options only
  weights = (("bf16", None), ("fp8", "fp8"), ("fp8, lm_head fp8", "fp8+lm_head"))
  rows, over = [], []
  for size in sizes:
    config = config_from_hf(bench_generate.hf_config(size).to_dict(), dtype=jax.numpy.bfloat16)
    bf16 = {}
    for options, label in (({}, "xla defaults"), (None, "decode options")):
      for name, quantize in weights:
        if quantize == "fp8+lm_head" and options is not None:
          continue

        def programs(cfg):
          return SlotPrograms(cfg, Sampler(cfg, mesh, quantize=quantize), num_slots=slots,
                              pad_id=0, max_prompt_len=Pm, chunk_steps=16, kv_block_size=16,
                              sampling=SamplingParams(temperature=0, max_new_tokens=T - Pm))
        c = decode_step_cost(programs(config), prompt, live - prompt, compiler_options=options)
        # a layer's kernels: the step's minus the same step's with one layer, over the other layers
        c1 = decode_step_cost(programs(dataclasses.replace(config, num_layers=1)), prompt, live - prompt,
                              compiler_options=options)
        per_layer = (c["kernels"]["total"] - c1["kernels"]["total"]) / (config.num_layers - 1)
        ratio = "" if quantize is None else f"{c['bytes'] / bf16[label]:.2f}x"
        bf16.setdefault(label, c["bytes"])
        print(f"| {size} | {name} | {label} | {c['bytes'] / 1e9:.3f} GB | {ratio} | "
              f"{c['ideal'] / 1e9:.3f} GB | {c['kernels']['total']} ({c['kernels']['gemm']}) | "
              f"{c['kernels']['total'] / config.num_layers:.1f} | {per_layer:.1f} |", flush=True)
        rows.append(dict(size=size, quantize=quantize, options=label, bytes=c["bytes"],
                         ideal=c["ideal"], kernels=c["kernels"], kernels_per_layer=per_layer))
        if options is None and max_kernels_per_layer is not None and per_layer > max_kernels_per_layer:
          over.append(f"{size} {name}: {per_layer:.1f} kernels per layer")
  if over:
    raise SystemExit(f"over the budget of {max_kernels_per_layer} kernels per layer: " + "; ".join(over))
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--size", default="50m", help="a bench_generate size (5m, 50m, 400m, 1b, 8b)")
  parser.add_argument("--outliers", type=float, default=0.0, help="log-normal spread of input-row magnitudes")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=64)
  parser.add_argument("--step_costs", default=None, help="sizes (e.g. 1b,8b): the decode step's bytes and kernels "
                      "compiled for an H100, bf16 vs fp8 (see above)")
  parser.add_argument("--slots", type=int, default=64, help="--step_costs: slots")
  parser.add_argument("--max_kernels_per_layer", type=float, default=None,
                      help="--step_costs: fail when a row with the decode options launches more per layer")
  args = parser.parse_args(argv)
  if args.step_costs:
    return step_costs(args.step_costs.split(","), args.slots, args.max_kernels_per_layer)

  import jax
  import jax.numpy as jnp
  import numpy as np

  from scripts import bench_generate
  from llamarl_jax.generation import Sampler
  from llamarl_jax.model import fp8
  from llamarl_jax.model.config import ModelConfig
  from llamarl_jax.model.llama import abstract_model, init_model, merge_params, split_params

  vocab, d, f, layers, heads, kv = bench_generate.SIZES[args.size]
  config = ModelConfig(vocab_size=vocab, hidden_size=d, intermediate_size=f, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv, rope_theta=500000.0)
  _, params = split_params(init_model(config, seed=0))
  rng = np.random.RandomState(0)
  for layer in params["layers"].values():
    for m, name, n_in in fp8.projections(layer):
      w = np.asarray(layer[m][name])
      rows = np.exp(args.outliers * rng.randn(*w.shape[:n_in], *([1] * (w.ndim - n_in))))
      layer[m][name] = jnp.asarray(w * rows, jnp.float32)
  bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)  # the reference weights

  channel = fp8.dequantize_params(fp8.quantize_params(bf16))
  block = jax.tree.map(lambda x: x, bf16)
  channel_scales = block_scales = 0
  for i, layer in block["layers"].items():
    for m, name, n_in in fp8.projections(layer):
      layer[m][name], n = block_dequantized(bf16["layers"][i][m][name], n_in)
      block_scales += n
      channel_scales += int(np.prod(layer[m][name].shape[n_in:]))
  weights = sum(x.size for i in bf16["layers"] for m, name, _ in fp8.projections(bf16["layers"][i])
                for x in [bf16["layers"][i][m][name]])

  tokens = jnp.asarray(rng.randint(0, vocab, (args.batch, args.seq)))
  graphdef = split_params(abstract_model(config))[0]
  forward = jax.jit(lambda p, t: merge_params(graphdef, p)(t))
  sampler = Sampler(config, quantize="fp8")
  forward8 = jax.jit(lambda p, t: merge_params(sampler.graphdef, p)(t))
  ref = jax.nn.log_softmax(forward(bf16, tokens))

  def compare(logits):
    lp = jax.nn.log_softmax(logits)
    kl = jnp.sum(jnp.exp(ref) * (ref - lp), -1)
    return float(jnp.mean(kl)), float(jnp.max(jnp.abs(logits - forward(bf16, tokens)))), \
        float(jnp.mean(jnp.argmax(lp, -1) == jnp.argmax(ref, -1)))

  print(f"# {args.size}: {config.num_params() / 1e6:.0f}M parameters, {weights / 1e6:.1f}M in projections, "
        f"input-row spread exp({args.outliers} N(0,1)); {args.batch} x {args.seq} random tokens, jax {jax.__version__}")
  print("| weights | KL(bf16 || it) per token | max |logit diff| | same argmax | scale bytes / fp8 weight bytes |")
  print("|---|---|---|---|---|")
  rows = []
  for name, logits, scales in (("W8 per channel", forward(channel, tokens), channel_scales),
                               ("W8 block 128", forward(block, tokens), block_scales),
                               ("W8A8 per channel (the fp8 generator)",
                                forward8(sampler.place_params(bf16), tokens), channel_scales)):
    kl, diff, same = compare(logits)
    rows.append({"weights": name, "kl": kl, "max_logit_diff": diff, "same_argmax": same,
                 "scale_bytes": 4 * scales, "fp8_bytes": weights})
    print(f"| {name} | {kl:.2e} | {diff:.3f} | {same:.1%} | {4 * scales / weights:.2%} |")
  return rows


if __name__ == "__main__":
  main()
