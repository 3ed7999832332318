#!/usr/bin/env python
"""Trace, lower and compile time of the trainer's log-prob gradient against depth (CPU, small widths).

The trainer runs its layers under `lax.scan`, so its program and compile time should stay flat as
layers grow; an unrolled forward grows linearly. Runs whatever `llamarl_jax` is on PYTHONPATH, so
two checkouts compare directly:

  PYTHONPATH=. JAX_PLATFORMS=cpu python scripts/bench_compile_depth.py 4 16 32
"""
import sys, time, jax, jax.numpy as jnp
from llamarl_jax.model.logprobs import token_logprobs
from llamarl_jax.model.config import ModelConfig
from llamarl_jax.model.llama import abstract_model, split_params
for L in map(int, sys.argv[1:]):
  c = ModelConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=L, num_heads=4,
                  num_kv_heads=2, tie_word_embeddings=True)
  g, shapes = split_params(abstract_model(c))
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  f = lambda p, *a: jnp.sum(token_logprobs(g, p, *a, remat=True))
  t0 = time.perf_counter()
  lowered = jax.jit(jax.grad(f)).trace(shapes, i32(4, 32), i32(4, 32), i32(4, 64), i32(4, 64)).lower()
  t1 = time.perf_counter()
  lowered.compile()
  print(f"layers {L}: trace+lower {t1 - t0:.2f} s, compile {time.perf_counter() - t1:.2f} s", flush=True)
