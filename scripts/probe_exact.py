#!/usr/bin/env python
"""Batch invariance on this XLA: the model's plain ops against their `model.exact` forms.

For each op, a batch of rows X is computed whole (2048 rows) and as its first 1, 7 and 64 rows, and
permuted; "plain" and "exact" are the largest |difference| between a row's result in one run and the
same row's in another (exact must be 0: bit for bit). "cost@m" is the exact form's time over the
plain op's at m rows (best of 9 interleaved runs each, on this machine's CPU). Then the fusion
effects the exact forms also remove (one op in two programs), and the real tiny model's generator
(prefill + decode over a KV cache) against its trainer (`model.logprobs.token_logprobs`), plain ops.

  JAX_PLATFORMS=cpu python -m llamarl_jax.compat -- python -m scripts.probe_exact [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from llamarl_jax.model import exact
from llamarl_jax.model.attention import decode_attention, rope_cos_sin
from llamarl_jax.model.forward import chunked_token_logprobs
from llamarl_jax.model.layers import rms_norm
from llamarl_jax.model.paged_attention import rope_rotate

ROWS = (1, 7, 64, 2048)


def normal(shape, dtype, seed=0, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, dtype)


def row_spread(f, x, *args) -> float:
  """Largest |f(x[:m])[i] - f(x)[i]| over m in ROWS and over a permutation of the rows (fp32)."""
  g = jax.jit(f)
  full = np.asarray(g(x, *args), np.float32)
  worst = 0.0
  for m in ROWS[:-1]:
    worst = max(worst, float(np.max(np.abs(np.asarray(g(x[:m], *args), np.float32) - full[:m]))))
  perm = np.random.default_rng(1).permutation(len(x))
  return max(worst, float(np.max(np.abs(np.asarray(g(x[perm], *args), np.float32) - full[perm]))))


def cost(exact_fn, plain_fn, *args, reps=9) -> float:
  """Time of exact_fn(*args) over plain_fn(*args), jitted: the best of `reps` runs of each, the two
  interleaved (a shared machine's load falls on both)."""
  f, g = jax.jit(exact_fn), jax.jit(plain_fn)
  jax.block_until_ready((f(*args), g(*args)))
  best = [math.inf, math.inf]
  for _ in range(reps):
    for i, h in enumerate((f, g)):
      t = time.perf_counter()
      jax.block_until_ready(h(*args))
      best[i] = min(best[i], time.perf_counter() - t)
  return best[0] / best[1]


def ops(dtype):
  """(name, plain, exact, rows [2048, ...], extra args): each function maps rows to rows."""
  out = []
  for k, n, what in [(128, 256, "qkv"), (128, 768, "gate_up"), (384, 128, "down"), (1024, 1024, "1024^2")]:
    w = normal((k, n), dtype, 1, 1 / math.sqrt(k))
    out.append((f"dense {k}x{n} ({what})", lambda x, w: x @ w, lambda x, w: exact.dense(x, w), normal((2048, k), dtype), (w,)))
  e = normal((100, 128), dtype, 2, 0.5)  # the tiny config's tied embedding [vocab, embed]
  tok = jnp.asarray(np.random.default_rng(3).integers(0, 100, 2048), jnp.float32)[:, None]
  rows = jnp.concatenate([normal((2048, 128), jnp.float32), tok], axis=1)  # hidden | token, one row each
  out.append(("lm_head + log-prob V=100",
              lambda r, e: chunked_token_logprobs(r[:, None, :-1].astype(dtype), e.T, r[:, None, -1].astype(jnp.int32),
                                                  with_entropy=False)[0][:, 0],
              lambda r, e: exact.lm_head_logprobs(r[:, :-1].astype(dtype), e.T, r[:, -1].astype(jnp.int32)), rows, (e,)))
  lrows = jnp.concatenate([normal((2048, 4096), jnp.float32, 4, 4.0), tok], axis=1)
  out.append(("token log-prob V=4096",
              lambda r: (jnp.take_along_axis(r[:, :-1], r[:, -1:].astype(jnp.int32), 1)[:, 0]
                         - jax.nn.logsumexp(r[:, :-1], axis=-1)),
              lambda r: exact.token_logprob(r[:, :-1], r[:, -1].astype(jnp.int32)), lrows, ()))
  for d in (128, 1024):
    s = normal((d,), dtype, 5)
    out.append((f"rms_norm D={d}", lambda x, s: rms_norm(x, s, 1e-5), lambda x, s: exact.rms_norm(x, s, 1e-5),
                normal((2048, d), dtype, 6, 3.0), (s,)))
  inv = 1.0 / (10000.0 ** (jnp.arange(0, 32, 2, dtype=jnp.float32) / 32))
  prow = jnp.concatenate([normal((2048, 4 * 32), jnp.float32, 7),
                          jnp.asarray(np.random.default_rng(8).integers(0, 64, 2048), jnp.float32)[:, None]], axis=1)

  def rope_plain(r):
    cos, sin = rope_cos_sin(r[:, -1].astype(jnp.int32), inv)
    return rope_rotate(r[:, :-1].reshape(-1, 4, 32).astype(dtype), cos[:, None], sin[:, None])

  def rope_exact(r):
    cos, sin = exact.rope_cos_sin(r[:, -1].astype(jnp.int32), inv)
    return exact.rope(r[:, :-1].reshape(-1, 4, 32).astype(dtype), cos[:, None], sin[:, None])

  out.append(("rope H=4 D=32", rope_plain, rope_exact, prow, ()))
  # decode attention: row = (one query, its cache of 64 positions, its length)
  L, H, KV, D = 64, 4, 2, 32
  q, k, v = normal((2048, 1, H, D), dtype, 9), normal((2048, L, KV, D), dtype, 10), normal((2048, L, KV, D), dtype, 11)
  lengths = jnp.asarray(np.random.default_rng(12).integers(1, L + 1, 2048), jnp.int32)
  packed = (q, k, v, lengths)
  index = jnp.arange(2048)
  out.append(("decode attention L=64",
              lambda i, q, k, v, n: decode_attention(q[i], k[i], v[i], jnp.arange(L)[None] < n[i][:, None]),
              lambda i, q, k, v, n: exact.attention(q[i], k[i], v[i], n[i][:, None]), index, packed))
  return out


def decode_vs_full(dtype) -> tuple[float, float, float]:
  """Attention of query t in a causal pass over 64 positions vs the same query decoded alone over a
  cache of 64 (positions past t garbage); plain: the model's two paths (XLA's fused attention, the
  decode step's). Returns (plain max |diff|, exact max |diff|, exact/plain cost of the full pass)."""
  B, T, H, KV, D = 8, 64, 4, 2, 32
  q, k, v = normal((B, T, H, D), dtype, 13), normal((B, T, KV, D), dtype, 14), normal((B, T, KV, D), dtype, 15)
  causal = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None] + 1, (B, T))
  full_p = np.asarray(jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))(q, k, v), np.float32)
  full_e = np.asarray(jax.jit(exact.attention)(q, k, v, causal), np.float32)
  dec_p = jax.jit(lambda q, k, v, t: decode_attention(q, k, v, jnp.broadcast_to(jnp.arange(T) <= t, (B, T))))
  dec_e = jax.jit(lambda q, k, v, t: exact.attention(q, k, v, jnp.full((B, 1), t + 1, jnp.int32)))
  plain = worst = 0.0
  for t in (0, 7, 31, 63):
    garbage = lambda a: jnp.where((jnp.arange(T) <= t)[None, :, None, None], a, normal(a.shape, dtype, 16 + t))
    kc, vc = garbage(k), garbage(v)
    qt = q[:, t:t + 1]
    plain = max(plain, float(np.max(np.abs(np.asarray(dec_p(qt, kc, vc, t), np.float32)[:, 0] - full_p[:, t]))))
    worst = max(worst, float(np.max(np.abs(np.asarray(dec_e(qt, kc, vc, t), np.float32)[:, 0] - full_e[:, t]))))
  ratio = cost(lambda q, k, v: exact.attention(q, k, v, causal),
               lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True), q, k, v)
  return plain, worst, ratio


def fusion_effects() -> list[tuple[str, float, float]]:
  """(what, plain |diff| between two programs of one op, exact |diff|)."""
  out = []
  rng = np.random.default_rng(17)
  a, b = (jnp.asarray(rng.standard_normal((64, 128)), jnp.bfloat16) for _ in range(2))
  stored = np.asarray((a + b).astype(jnp.float32))  # the add computed alone: rounded to bf16
  read = np.asarray(jax.jit(lambda a, b: (a + b).astype(jnp.float32))(a, b))  # its fused reader
  read_e = np.asarray(jax.jit(lambda a, b: exact.add(a, b).astype(jnp.float32))(a, b))
  out.append(("bf16 add read in fp32 by a fused op (excess precision)", float(np.max(np.abs(read - stored))),
              float(np.max(np.abs(read_e - stored)))))
  x, y, z = (jnp.asarray(rng.standard_normal((4096,)), jnp.float32) for _ in range(3))
  alone = np.asarray(x * y) + np.asarray(z)  # the product stored, then added
  fused = np.asarray(jax.jit(lambda x, y, z: x * y + z)(x, y, z))
  fused_e = np.asarray(jax.jit(lambda x, y, z: exact.product(x, y, exact.row_zero(x[:, None])[:, 0]) + z)(x, y, z))
  out.append(("fp32 multiply then add, fused (FMA) vs stored", float(np.max(np.abs(fused - alone))),
              float(np.max(np.abs(fused_e - alone)))))
  return out


def model_gap(dtype) -> float:
  """The real tiny model (configs/tiny_cpu.gin's sizes), plain ops: max |generator log-prob - trainer
  log-prob| over 8 sequences of 8 prompt + 8 response tokens, the generator prefilling the 8 rows and
  decoding one token per step over a `KVCache`, the trainer `token_logprobs` over the 8 rows."""
  from llamarl_jax.model import KVCache, ModelConfig, init_model, merge_params, split_params
  from llamarl_jax.model.logprobs import token_logprobs

  config = ModelConfig(vocab_size=100, hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
                       num_kv_heads=2, max_position_embeddings=64, rope_theta=10000.0, tie_word_embeddings=True,
                       dtype=jnp.dtype(dtype).name)
  model = init_model(config, seed=0)
  graphdef, params = split_params(model)
  rng = np.random.default_rng(18)
  B, P, R = 8, 8, 8
  prompts = jnp.asarray(rng.integers(4, 100, (B, P)), jnp.int32)
  responses = jnp.asarray(rng.integers(4, 100, (B, R)), jnp.int32)

  @jax.jit
  def generate(params):
    m = merge_params(graphdef, params)
    logits, cache = m(prompts, cache=KVCache.init(config, B, P + R))
    out = [logits[:, -1]]
    for i in range(R - 1):
      logits, cache = m(responses[:, i:i + 1], cache=cache)
      out.append(logits[:, 0])
    logits = jnp.stack(out, axis=1).astype(jnp.float32)
    return jnp.take_along_axis(jax.nn.log_softmax(logits, -1), responses[..., None], -1)[..., 0]

  ones = lambda a: jnp.ones_like(a)
  train = jax.jit(lambda params: token_logprobs(graphdef, params, prompts, ones(prompts), responses, ones(responses)))
  return float(np.max(np.abs(np.asarray(generate(params)) - np.asarray(train(params)))))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--dtypes", default="float32,bfloat16")
  parser.add_argument("--no_model", action="store_true", help="skip the real model's generator-vs-trainer gap")
  args = parser.parse_args(argv)
  print(f"jax {jax.__version__}, {jax.devices()[0].platform}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  print(f"exact.ROW_TILE={exact.ROW_TILE}, exact.KEY_BLOCK={exact.KEY_BLOCK}; rows {ROWS} and a permutation\n")
  head = f"{'op':<30} {'dtype':<9} {'plain max|diff|':>16} {'exact max|diff|':>16} {'cost@1':>7} {'cost@64':>8} {'cost@2048':>10}"
  print(head)
  print("-" * len(head))
  for name in args.dtypes.split(","):
    dtype = jnp.dtype(name)
    for op, plain, ex, x, extra in ops(dtype):
      p, e = row_spread(plain, x, *extra), row_spread(ex, x, *extra)
      c1, c64, c2k = (cost(ex, plain, x[:m], *extra) for m in (1, 64, len(x)))
      print(f"{op:<30} {dtype.name:<9} {p:>16.3g} {e:>16.3g} {c1:>7.2f} {c64:>8.2f} {c2k:>10.2f}", flush=True)
    p, e, c = decode_vs_full(dtype)
    print(f"{'attention decode vs full T=64':<30} {dtype.name:<9} {p:>16.3g} {e:>16.3g} {'':>7} {'':>8} {c:>10.2f}", flush=True)
  print("\nfusion effects (one op in two programs)")
  for what, p, e in fusion_effects():
    print(f"  {what:<58} plain {p:.3g}  exact {e:.3g}")
  if not args.no_model:
    print("\nthe tiny model with the plain ops: generator (prefill + KV-cache decode) vs trainer log-probs")
    for name in args.dtypes.split(","):
      print(f"  {name:<9} max |diff| = {model_gap(name):.3g}", flush=True)


if __name__ == "__main__":
  main()
