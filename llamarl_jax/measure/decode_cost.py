"""The cost of one slot-engine decode step: its program lowered and compiled from abstract shapes
(nothing allocated, any target: the CPU or a GPU compiled for without one), its bytes by XLA's cost
analysis corrected for what the analysis mischarges (`hlo`), next to the ideal bytes. Measurement only
(benchmarks, tests, the GPU check)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from llamarl_jax import parallel
from llamarl_jax.generation import paged
from llamarl_jax.generation.program_set import DECODE_COMPILER_OPTIONS, compile_lowered
from llamarl_jax.generation.slot_programs import SlotPrograms
from llamarl_jax.measure import hlo
from llamarl_jax.model import paged_attention as paged_attention_module
from llamarl_jax.model.llama import KVCache, merge_params


def decode_step_cost(programs: SlotPrograms, prompt_lens, n_gen, *, layout: str = "paged",
                     num_entries: int | None = None, compiler_options: dict | None = None) -> dict[str, float]:
  """XLA's cost analysis of ONE decode step of `programs`, lowered and compiled from abstract shapes (nothing
  allocated), next to the ideal bytes (`hlo.ideal_step_bytes`: weights + live KV).

  prompt_lens, n_gen `[S]` (host ints): every slot running with this prompt length and n_gen
  response tokens sampled; the step attends to L + n_gen positions (its live length).
  layout: 'paged' (this engine: the step lists `num_entries` blocks, default the program set's
  smallest entry count that holds the live blocks) or 'dense' (a `[S, Pm + R]` cache per layer,
  attention over all of it). compiler_options: XLA's, default the decode programs'
  (`DECODE_COMPILER_OPTIONS`); {} compiles with XLA's defaults.
  Returns {'bytes', 'xla_bytes', 'overcount', 'kernel_bytes', 'library_bytes', 'ideal', 'weights',
  'layer_weights' (the decoder layers' parameters as the step holds them: fp8 + scales with an fp8
  generator), 'kv', 'ratio',
  'num_entries', 'kernels', 'compile_s'}: 'kernels' the step's kernel launches by kind
  (`hlo.kernel_counts`; a GPU target's module), 'compile_s' XLA's compile of the step;
  'xla_bytes' is XLA's 'bytes accessed' as is; 'bytes' charges each fused gather the bytes it
  gathers and each in-place scatter the bytes it updates instead of its whole operand
  (`hlo.fused_index_overcount`: the generic analysis charges the whole KV pool per gather and
  per token write, and the embedding table per lookup), and adds the Pallas kernel's reads where
  the step uses it (`paged_kernel.kernel_bytes`, counted from its structure: XLA's analysis sees
  a custom call as nothing) and the fp8 activation kernels' operands and results (`fp8_kernels`,
  `hlo.pallas_call_bytes`), and the operands and outputs of library GEMMs (cuBLAS custom calls,
  `hlo.library_call_bytes`); 'ratio' = bytes / ideal.
  """
  prompt_lens, n_gen = np.asarray(prompt_lens, np.int64), np.asarray(n_gen, np.int64)
  S, R, Pm = programs.num_slots, programs.R, programs.max_prompt_len
  if prompt_lens.shape != (S,) or n_gen.shape != (S,):
    raise ValueError(f"prompt_lens and n_gen must have one entry per slot ({S}), got {prompt_lens.shape}, "
                     f"{n_gen.shape}")
  if prompt_lens.min() < 1 or prompt_lens.max() > Pm or n_gen.min() < 1 or n_gen.max() > R - 1:
    raise ValueError(f"need 1 <= prompt_lens <= {Pm} and 1 <= n_gen <= R - 1 = {R - 1}")
  form = paged_attention_module.resolve_paged_implementation(programs.paged_attention, programs.platform)
  if layout == "paged" and form in paged_attention_module.KERNEL_FORMS and programs.platform != "gpu":
    raise ValueError(f"paged_attention={form!r} on {programs.platform} runs in Pallas' interpret mode: its XLA ops (a "
                     "loop over the kernel's programs, 46x the ideal at 5M) are not the kernel's traffic; count it "
                     "compiled for a GPU (bench_generate --bytes_target h100) or use paged_attention='auto'")
  sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  params = programs.param_avals
  state = jax.tree.map(sds, jax.eval_shape(lambda: programs.empty_state()))
  repl = parallel.replicated(programs.mesh)
  cache, cache_sharding, num_entries = _abstract_cache(programs, layout, prompt_lens, n_gen, num_entries)

  def step(params, cache, state, version):
    return programs.decode_step(merge_params(programs.graphdef, params), cache, state, version, num_entries)

  lowered = jax.jit(step, donate_argnums=(1, 2),
                    in_shardings=(programs.param_shardings, cache_sharding, programs.state_sharding, repl),
                    out_shardings=(cache_sharding, programs.state_sharding)).lower(
                        params, cache, state, jax.ShapeDtypeStruct((), jnp.int32))
  t0 = time.perf_counter()
  compiled = compile_lowered(lowered, DECODE_COMPILER_OPTIONS if compiler_options is None else compiler_options)
  compile_s = time.perf_counter() - t0
  xla_bytes, generic = hlo.compiled_bytes_accessed(compiled)
  text = compiled.as_text()  # megabytes for a 1B step: read once
  over = float(hlo.fused_index_overcount(text)) if generic else 0.0
  library = float(hlo.library_call_bytes(text)) if generic else 0.0  # cuBLAS GEMMs: opaque to it
  ideal = hlo.ideal_step_bytes(programs.config, prompt_lens + n_gen, params=params)
  layer_weights = sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params["layers"]))
  kernel = 0.0  # the Pallas kernel's reads, counted from its structure (a custom call to XLA's analysis)
  triton_call = 'custom_call_target="__gpu$xla.gpu.triton"' in text
  if layout == "paged" and form in paged_attention_module.KERNEL_FORMS and triton_call:
    kernel = _paged_kernel_bytes(programs, form, prompt_lens, n_gen)
  if generic:  # the fp8 activation kernels (`fp8_kernels`): each reads its operands, writes its results
    from llamarl_jax.model.fp8_kernels import KERNEL_NAMES
    kernel += float(hlo.pallas_call_bytes(text, KERNEL_NAMES))
  total = xla_bytes - over + kernel + library
  return {"bytes": total, "xla_bytes": xla_bytes, "overcount": over, "kernel_bytes": kernel, "library_bytes": library,
          "ideal": ideal["total"], "weights": ideal["weights"], "layer_weights": float(layer_weights), "kv": ideal["kv"],
          "ratio": total / ideal["total"],
          "num_entries": num_entries, "kernels": hlo.kernel_counts(text), "compile_s": compile_s}


def _abstract_cache(programs: SlotPrograms, layout: str, prompt_lens: np.ndarray, n_gen: np.ndarray,
                    num_entries: int | None) -> tuple:
  """(cache, its sharding, the step's entry count) of a decode step of `layout`, the cache as abstract
  shapes: 'paged', the pool, read through `num_entries` entries (default the program set's smallest
  count that holds the live blocks); 'dense', a `[S, Pm + R]` cache per layer (the count as given, or 0)."""
  S, R, Pm = programs.num_slots, programs.R, programs.max_prompt_len
  if layout == "paged":
    bs = programs.layout.block_size
    need = int(np.sum(-(-prompt_lens // bs) + -(-n_gen // bs)))
    plan = programs.entry_plan[programs.widths[0]]  # the full width's programs (need: more, with a stage)
    if num_entries is None:
      num_entries = paged.entry_bucket(need, plan) if need <= plan[-1] else need
    elif num_entries < need:
      raise ValueError(f"num_entries={num_entries} is fewer than the {need} live blocks")
    cache = jax.eval_shape(lambda: programs.layout.empty_pages(programs.config))
    cache_sharding = programs.cache_sharding
  elif layout == "dense":
    cache = jax.eval_shape(lambda: KVCache.init(programs.config, S, Pm + R).replace(index=jnp.zeros((S,), jnp.int32)))
    cs = programs.dense_cache_sharding
    cache_sharding = KVCache(k=(cs,) * programs.config.num_layers, v=(cs,) * programs.config.num_layers,
                             index=programs.state_sharding.n_gen)
  else:
    raise ValueError(f"layout must be 'paged' or 'dense', got {layout!r}")
  return cache, cache_sharding, int(num_entries or 0)


def _paged_kernel_bytes(programs: SlotPrograms, form: str, prompt_lens: np.ndarray, n_gen: np.ndarray) -> float:
  """The Pallas paged-attention kernel's bytes over the step's layers (`paged_kernel.kernel_bytes`,
  counted from its structure: XLA's analysis sees a custom call as nothing)."""
  from llamarl_jax.model.paged_kernel import kernel_bytes

  c, bs = programs.config, programs.layout.block_size
  live = int(np.sum(-(-prompt_lens // bs) + -(-n_gen // bs)))
  G, weights = c.num_heads // c.num_kv_heads, programs.weight_layout
  # the fused form reads q, k and v from the fused projection's output (`llama.Attention`'s paged
  # step: q too for a power-of-two group), an fp8 GEMM's fp32 product with fp8 weights, and writes
  # the new key and value; the read-only form reads q as given (XLA's ops write)
  fused, source = form == "pallas_fused", None
  if fused and weights.fused_qkv and not c.qk_norm and G & (G - 1) == 0:
    source = 4 if weights.fp8 and not c.qkv_bias else jnp.dtype(c.dtype).itemsize
  return c.num_layers * kernel_bytes(num_rows=programs.num_slots, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                                     head_dim=c.head_dim, block_size=bs, live_entries=live,
                                     itemsize=jnp.dtype(c.dtype).itemsize, write=fused, source_itemsize=source)
