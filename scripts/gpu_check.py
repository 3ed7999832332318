#!/usr/bin/env python
"""Every GPU-only path checked against a reference on one GPU, in minutes (`make gpu-check`).

One H100 or H200, at most `--budget_s` (480) seconds of wall time, compilation included. Sections
run in order of value; each is written to `gpu_check.json` and `gpu_check.md` under `--out` as soon as
it finishes, so a run cut off keeps what it measured, and prints one summary line (pass / FAIL /
figure). A section that would start past the budget is skipped, saying so.

Numerics (each GPU path against a reference on the same inputs; pass/fail with the bound's reason):
  paged_kernel   the paged decode kernel, read-only ('pallas') and fused ('pallas_fused': RoPE and the
                 in-place key/value write inside the kernel), against XLA's 'reduce' form over the same
                 bf16 cache, and the pools after the fused write against XLA's rotation and scatter
  lag0_logprobs  the slot engine's behaviour log-probs against the trainer's at lag 0 on the same
                 sampled tokens (k3 KL, token_mult_prob_error): bf16 with the default paths, fp8
                 weights with the read-only kernel (XLA's quantise ops) and with 'pallas_fused' (the
                 fp8 activation kernels)
  fp8_kernels    `fp8_kernels.add_rms_norm_quantize` / `swiglu_quantize` against the unfused ops
                 (`rms_norm` + `fp8.quantize_rows`, silu * up + `quantize_rows`), then `fp8.dense`
                 of their rows against the fp32 product of the de-quantised operands
  cudnn_packed   cuDNN's packed attention (segment offsets, `llama.segment_attention`) against XLA's
                 masked form, forward and gradient (skipped where there is no GPU: no cuDNN)
  moe_ragged_dot the experts' grouped SwiGLU (`moe.grouped_swiglu`: `jax.lax.ragged_dot`) against a
                 per-expert dense loop at Qwen3-30B-A3B's expert shapes (fewer tokens)
  moe_grouped_gemm  the Pallas grouped GEMM (`grouped_gemm.grouped_gemm`, Triton) against
                 `jax.lax.ragged_dot` on the same bf16 rows and experts: value, d rows, d weights; fp8
                 experts read as fp8 (bit-equal to the widened ones); figures: ms of one MoE layer
                 by each, forward and forward + backward
  exact_logprobs the `exact_logprobs` switch (`ModelConfig.exact`, `model.exact`'s batch-invariant ops):
                 a bf16 slot engine of 64 slots against the trainer's `token_logprobs` of its sampled
                 tokens at lag 0, bit for bit (max |diff| and k3 KL 0); figures, exact / plain on the
                 same weights: ms per decode step at 64 busy slots and ms per trainer log-prob forward
                 of the batch (the 2-layer numerics model: the lm_head's share is larger than at 16)
  trainer_step   the trainer's forward and backward (layers under scan, remat, the GPU's attention,
                 lm_head in chunks) against a plain forward (`Llama.__call__`, full logits,
                 `log_softmax`) on the same bf16 weights: log-probs and the gradient of an AIPO-like
                 sum
The main job:
  main_job       `make run-gpu`'s config (configs/llama3_1b_1gpu.gin) for a few RL steps in a fresh
                 process: peak memory against the memory plan, the time breakdown, tokens per second
Figures:
  decode         slot-engine ms per decode step at 64 busy slots, 1B shapes, bf16 / fp8 / fp8 + fp8
                 lm_head, per paged-attention form, against the bytes roofline of the same step
                 (weights + live KV / HBM bandwidth), and kernels per step from a profiler trace
  packing        the trainer's real tokens per second, packed vs padded, on `bench_packing`'s
                 long-tail batch (16 of its 64 rows, to fit the budget)

`--dry_run` runs every section at toy sizes on whatever backend is present (the CPU in CI: Pallas in
interpret mode, cuDNN skipped). With a GPU its result goes into BENCHMARKS.md with the device and JAX
version, and the paths that passed are promoted in `llamarl_jax/gpu_paths.py`.

  make gpu-check                     # = python -m scripts.gpu_check --out results/gpu_check
  python -m scripts.gpu_check --dry_run --out /tmp/gpu_check
  python -m scripts.gpu_check --sections paged_kernel,decode
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # peak memory is the run's, not the pool's
from llamarl_jax import compat  # noqa: E402  (no jax import: before JAX starts)

compat.ensure_cpu_devices(1)

from scripts import bench_generate, bench_gpu, bench_packing, bench_train  # noqa: E402

SECTIONS = ("paged_kernel", "lag0_logprobs", "fp8_kernels", "cudnn_packed", "moe_ragged_dot", "moe_grouped_gemm",
            "exact_logprobs", "trainer_step", "main_job", "decode", "packing")
U = 2.0 ** -8  # bf16's unit roundoff (8 significant bits)

# Llama-3.2-1B's layer sizes: full depth for the figures, 2 layers for the numerics (seconds, not minutes)
ONE_B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_heads=32, num_kv_heads=8, head_dim=64,
             max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=False)
TOY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
           max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False)
FULL = dict(model=ONE_B, numerics_layers=2, decode_layers=16, paged=(64, 128, 512, 16, 100, 500),
            rollout=(8, 64, 128), attn=(2, 2048, 32, 8, 64, 5), moe=(512, 2048, 768, 128, 8),
            train=(8, 64, 128), main_steps=3, slots=64, decode_prompt=128, decode_R=256, decode_chunks=3,
            pack_rows=16, pack_steps=2, exact=(64, 64, 128, 16, 4, 3))
DRY = dict(model=TOY, numerics_layers=2, decode_layers=2, paged=(4, 16, 32, 4, 6, 40), rollout=(2, 8, 8),
           attn=(1, 64, 4, 2, 16, 3), moe=(32, 64, 32, 8, 2), train=(2, 8, 8), main_steps=3, slots=4,
           decode_prompt=8, decode_R=32, decode_chunks=2, pack_rows=4, pack_steps=1, exact=(64, 8, 12, 2, 2, 2))


SkipSection = bench_gpu.SkipSection  # a section that cannot run here; its reason goes into the report


def _check(name: str, value: float, bound: float, why: str, *, above: bool = False) -> dict:
  """One comparison: pass when value <= bound (or >= with `above`)."""
  ok = value >= bound if above else value <= bound
  return {"name": name, "value": float(value), "bound": float(bound), "why": why, "pass": bool(ok)}


def _config(cfg, layers: int, **over):
  from llamarl_jax.model import ModelConfig
  return ModelConfig(**{**cfg["model"], "num_layers": layers, **over})


def _f32(x):
  import numpy as np
  return np.asarray(x, np.float32)


# ------------------------------------------------------------------------------------------------
# numerics


def paged_kernel_section(cfg, env) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from llamarl_jax.generation import paged
  from llamarl_jax.generation.paged import PageLayout
  from llamarl_jax.model.paged_attention import PagedLayer, paged_decode_attention, rope_rotate, write_and_attend

  m = cfg["model"]
  S, Pm, R, bs, lo, hi = cfg["paged"]
  KV, H, D = m["num_kv_heads"], m["num_heads"], m["head_dim"]
  G = H // KV
  lay = PageLayout(S, Pm, R, bs)
  rng = np.random.RandomState(0)
  live = rng.randint(lo, hi + 1, S)
  prompt = np.minimum(rng.randint(max(1, Pm // 4), Pm + 1, S), live - 1)
  k_pool, v_pool = (jnp.asarray(rng.normal(size=(lay.num_blocks, bs, KV, D)), jnp.bfloat16) for _ in range(2))
  row, block, length = paged.live_entries(lay, jnp.arange(S, dtype=jnp.int32), jnp.asarray(prompt, jnp.int32),
                                          jnp.asarray(live - prompt, jnp.int32), jnp.ones(S, bool),
                                          S * (lay.prompt_blocks + lay.response_blocks))
  vmax = float(jnp.max(jnp.abs(v_pool.astype(jnp.float32))))
  q = jnp.asarray(rng.normal(size=(S, 1, H, D)), jnp.bfloat16)
  xla = _f32(paged_decode_attention(q, k_pool, v_pool, row, block, length, "reduce"))
  checks = []
  why = "both accumulate in fp32 from the same bf16 cache and round the output to bf16 once: 2u max|v|"
  read_only = _f32(jax.jit(lambda *a: paged_decode_attention(*a, "pallas"))(q, k_pool, v_pool, row, block, length))
  checks.append(_check("read-only kernel vs XLA 'reduce', max |diff|", np.abs(read_only - xla).max(), 2 * U * vmax,
                       why))
  # one decode step's write and attention: the new key (rotated) and value at each row's last position
  write_block = jnp.take(jnp.asarray(np.asarray(block)), jnp.asarray(np.cumsum([0] + [
      int(-(-p // bs) + -(-(n - p) // bs)) for p, n in zip(prompt, live)])[1:] - 1))  # each row's last entry
  write_offset = jnp.asarray((live - prompt - 1) % bs, jnp.int32)
  kv = jnp.asarray(rng.normal(size=(S, KV, G + 2, D)), jnp.bfloat16)  # the fused projection's output
  angles = rng.uniform(0, 6, (S, D // 2)).astype(np.float32)
  cos, sin = (jnp.asarray(np.concatenate([f(angles)] * 2, axis=-1), jnp.bfloat16) for f in (np.cos, np.sin))
  layer = PagedLayer(k_pool, v_pool, write_block.astype(jnp.int32), write_offset, row, block, length)
  channels = (G, G + 1)
  qg = G if G & (G - 1) == 0 else None
  q_in = None if qg else rope_rotate(kv[:, :, :G].reshape(S, 1, H, D), cos[:, None, None], sin[:, None, None])
  step = jax.jit(lambda q, kv, c, s, layer, form: write_and_attend(q, kv, channels, c, s, layer, form, q_group=qg),
                 static_argnums=5)
  out_f, k_f, v_f = step(q_in, kv, cos, sin, layer, "pallas_fused")
  out_x, k_x, v_x = step(q_in, kv, cos, sin, layer, "reduce")
  checks.append(_check("fused kernel vs XLA write + 'reduce', output max |diff|",
                       np.abs(_f32(out_f) - _f32(out_x)).max(), 2 * U * max(vmax, float(jnp.abs(kv).max())), why))
  checks.append(_check("fused kernel's value pool vs XLA's scatter, max |diff|",
                       np.abs(_f32(v_f) - _f32(v_x)).max(), 0.0, "the value is copied: bit for bit"))
  checks.append(_check("fused kernel's key pool vs XLA's rotation + scatter, max |diff|",
                       np.abs(_f32(k_f) - _f32(k_x)).max(), U * float(jnp.abs(k_x.astype(jnp.float32)).max()),
                       "the same rotation in fp32 rounded to bf16: at most one bf16 rounding apart"))
  return {"shape": {"rows": S, "heads": H, "kv_heads": KV, "head_dim": D, "block": bs, "live": [int(lo), int(hi)]},
          "checks": checks}


def _engine_rollout(config, params, cfg, **engine_kw):
  import numpy as np

  from llamarl_jax.generation import SamplingParams
  from llamarl_jax.generation.engine import SlotEngine

  B, Pm, R = cfg["rollout"]
  sampling = SamplingParams(temperature=1.0, max_new_tokens=R, seed=1)
  engine = SlotEngine(config, lanes=B, sampling=sampling, max_prompt_len=Pm, progress=False, **engine_kw)
  rng = np.random.RandomState(2)
  prompts = [rng.randint(1, config.vocab_size, n).tolist() for n in rng.randint(Pm // 8 + 1, Pm + 1, B)]
  return engine.generate(params, prompts, sampling), engine.programs.paths


def lag0_logprobs_section(cfg, env) -> dict:
  """The generator and the trainer on the same weights (lag 0): random weights, the lm_head x4 so
  logits spread like a trained model's. bf16 engines: NeMo-RL's bar for a correct inference backend
  (k3 <= 1e-3, token_mult_prob_error <= 1.05; tests/gpu derives them). fp8 engines: the mismatch is
  mostly the fp8 rounding of weights and activations (e4m3: 2^-4 relative), the same on every path,
  so each fp8 path is held to the fp8 engine on XLA's ops ('reduce'): at most twice its k3 (+1e-4)
  and twice its token_mult_prob_error's excess over 1 (+0.01), which allows for the sampled tokens
  differing between the engines; a kernel that errs adds to the rounding's share."""
  import functools

  import jax
  import jax.numpy as jnp

  from llamarl_jax.mismatch import mismatch_metrics
  from llamarl_jax.model import init_model, split_params
  from llamarl_jax.model.forward import resolve_attention
  from llamarl_jax.model.llama import abstract_model
  from llamarl_jax.model.logprobs import token_logprobs

  config = _config(cfg, cfg["numerics_layers"])
  graphdef, params = split_params(init_model(config, seed=0))
  params["lm_head"] = params["lm_head"] * 4.0
  gen_config = config.replace(dtype="bfloat16", param_dtype="bfloat16")
  bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  attention = resolve_attention("auto", jax.default_backend(), jnp.bfloat16)
  trainer_graph = split_params(abstract_model(config.replace(dtype="bfloat16")))[0]
  logprobs = jax.jit(functools.partial(token_logprobs, attention=attention, logprob_chunk=256), static_argnums=0)
  variants = [("bf16, default paths", {}), ("bf16, pallas_fused", dict(paged_attention="pallas_fused")),
              ("fp8, XLA 'reduce'", dict(quantize="fp8", paged_attention="reduce")),
              ("fp8, read-only kernel", dict(quantize="fp8", paged_attention="pallas")),
              ("fp8, pallas_fused", dict(quantize="fp8", paged_attention="pallas_fused"))]
  rows, checks, ref = [], [], None
  K3, MULT = "rollout_corr/kl_k3", "rollout_corr/token_mult_prob_error"
  for name, kw in variants:
    batch, used = _engine_rollout(gen_config, bf16, cfg, **kw)
    trainer = logprobs(trainer_graph, params, batch.prompt_tokens, batch.prompt_mask, batch.response_tokens,
                       batch.response_mask)
    m = {k: float(v) for k, v in mismatch_metrics(trainer, batch.behaviour_logprobs, batch.response_mask).items()}
    rows.append({"engine": name, "paths": used, "trainer_attention": attention, **m})
    if "quantize" not in kw:
      checks += [_check(f"{name}: k3 KL", m[K3], 1e-3, "NeMo-RL's bar (the section's docstring)"),
                 _check(f"{name}: token_mult_prob_error", m[MULT], 1.05, "NeMo-RL's bar")]
    elif ref is None:
      ref = m  # the fp8 reference: XLA's ops
    else:
      checks += [_check(f"{name}: k3 KL", m[K3], 2 * ref[K3] + 1e-4, "twice the fp8 engine's on XLA's ops"),
                 _check(f"{name}: token_mult_prob_error", m[MULT], 1 + 2 * (ref[MULT] - 1) + 0.01,
                        "twice the fp8 XLA engine's excess over 1")]
  return {"layers": config.num_layers, "rows": rows, "checks": checks,
          "figures": [f"{r['engine']}: k3 {r[K3]:.2g}" for r in rows]}


def fp8_kernels_section(cfg, env) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from llamarl_jax.model import fp8, fp8_kernels
  from llamarl_jax.model.layers import rms_norm
  from llamarl_jax.model.paged_attention import interpret_kernels

  m = cfg["model"]
  E, F, N, eps = m["hidden_size"], m["intermediate_size"], cfg["paged"][0], 1e-5
  bf = jnp.bfloat16
  rng = np.random.RandomState(0)
  x = jnp.asarray(rng.normal(size=(N, 1, E)), bf)
  scale = jnp.asarray(rng.uniform(0.5, 1.5, E), jnp.float32)
  delta = fp8.Product(jnp.asarray(rng.normal(size=(N, 1, E)), jnp.float32), jnp.asarray(rng.uniform(0.5, 2, (N, 1)),
                      jnp.float32), jnp.asarray(rng.uniform(0.01, 0.1, E), jnp.float32))
  interpret = interpret_kernels()
  x_new, rows = fp8_kernels.add_rms_norm_quantize(x, scale, delta, eps=eps, interpret=interpret)
  ref_x = x + delta.value(bf)
  ref_q, ref_s = fp8.quantize_rows(rms_norm(ref_x, scale, eps))
  deq = lambda q, s: _f32(q) * _f32(s).reshape(*s.shape, 1)  # noqa: E731
  ref = deq(ref_q, ref_s[..., 0])
  checks = [
      _check("add_rms_norm_quantize: residual sum vs XLA's, max |diff|", np.abs(_f32(x_new) - _f32(ref_x)).max(),
             U * float(jnp.abs(ref_x.astype(jnp.float32)).max()), "the same add, rounded to bf16: one bf16 ulp"),
      _check("add_rms_norm_quantize: de-quantised rows vs XLA's, max |diff| / max|row|",
             np.abs(deq(rows.values, rows.scale) - ref).max() / np.abs(ref).max(), 2.0 ** -3,
             "e4m3 rounds at 2^-4 relative; the norm's fp32 sums in another order can move a value across "
             "a rounding boundary: one e4m3 step (2^-3 of the largest) at most")]
  gate_up = fp8.Product(jnp.asarray(rng.normal(size=(N, 1, 2, F)), jnp.float32),
                        jnp.asarray(rng.uniform(0.5, 2, (N, 1)), jnp.float32),
                        jnp.asarray(rng.uniform(0.01, 0.1, (2, F)), jnp.float32))
  h_rows = fp8_kernels.swiglu_quantize(gate_up, bf, interpret=interpret)
  both = gate_up.value(bf)
  h = jax.nn.silu(both[..., 0, :]) * both[..., 1, :]
  hq, hs = fp8.quantize_rows(h)
  href = deq(hq, hs[..., 0])
  checks.append(_check("swiglu_quantize: de-quantised rows vs silu(gate) * up quantised by XLA, max |diff| / max|h|",
                       np.abs(deq(h_rows.values, h_rows.scale) - href).max() / np.abs(href).max(), 2.0 ** -3,
                       "as above: one e4m3 step of the largest at most"))
  w = jnp.asarray(rng.normal(size=(E, E)) / np.sqrt(E), jnp.float32)
  wq, ws = fp8.quantize_weight(w, 1)
  y = _f32(fp8.dense(rows, wq, ws, jnp.float32))
  exact = deq(rows.values, rows.scale) @ (_f32(wq) * _f32(ws))
  checks.append(_check("fp8.dense of the kernel's rows vs the fp32 product of the de-quantised operands, "
                       "max |diff| / max|y|", np.abs(y - exact).max() / np.abs(exact).max(), 1e-5,
                       "e4m3 x e4m3 products are exact in fp32; only the fp32 sums' order differs"))
  return {"shape": {"rows": N, "hidden": E, "intermediate": F}, "interpret": interpret, "checks": checks}


def cudnn_packed_section(cfg, env) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from llamarl_jax.model.attention import Segments, segment_attention

  if env["backend"] != "gpu":
    raise SkipSection("cuDNN needs a GPU")
  B, T, N, K, H, S = cfg["attn"]
  rng = np.random.RandomState(0)
  q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, H)), jnp.bfloat16) for n in (N, K, K))
  ids, seqlens, offsets = np.zeros((B, T), np.int32), -np.ones((B, S), np.int32), -np.ones((B, S + 1), np.int32)
  for b in range(B):  # S segments of random lengths, the row's last tenth left empty
    cuts = np.sort(rng.choice(np.arange(1, int(T * 0.9)), S - 1, replace=False))
    bounds = [0, *cuts.tolist(), int(T * 0.9)]
    for s in range(S):
      ids[b, bounds[s]:bounds[s + 1]] = s + 1
      seqlens[b, s], offsets[b, s] = bounds[s + 1] - bounds[s], bounds[s]
  segments = Segments(jnp.asarray(ids), jnp.asarray(seqlens), jnp.asarray(offsets))
  valid = ids > 0
  attend = {impl: jax.jit(lambda q, k, v, impl=impl: segment_attention(q, k, v, segments, impl))
            for impl in ("cudnn", "xla")}
  outs = {impl: _f32(fn(q, k, v)) for impl, fn in attend.items()}
  bound = 4 * U * float(jnp.abs(v.astype(jnp.float32)).max())
  checks = [_check("forward, max |cuDNN - XLA| over the segments' positions",
                   np.abs(outs["cudnn"] - outs["xla"])[valid].max(), bound,
                   "both accumulate in fp32, cuDNN also rounds the probabilities to bf16: 4u max|v|")]
  grads = {}
  for impl, fn in attend.items():
    loss = lambda q, k, v, fn=fn: jnp.sum(jnp.where(jnp.asarray(valid)[..., None, None], fn(q, k, v), 0)
                                          .astype(jnp.float32) ** 2)
    grads[impl] = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  for name, gc, gx in zip("qkv", grads["cudnn"], grads["xla"]):
    gc, gx = _f32(gc), _f32(gx)
    checks.append(_check(f"gradient wrt {name}, max |diff| / max |XLA's|", np.abs(gc - gx).max() / np.abs(gx).max(),
                         8 * U, "the backward's extra bf16 roundings (probabilities, dO): 8u of the largest"))
  return {"shape": {"B": B, "T": T, "heads": N, "kv_heads": K, "head_dim": H, "segments": S}, "checks": checks}


def moe_ragged_dot_section(cfg, env) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from llamarl_jax.model import moe

  N, E, F, X, k = cfg["moe"]
  rng = np.random.RandomState(0)
  x = jnp.asarray(rng.normal(size=(N, E)), jnp.bfloat16)
  experts = jnp.asarray(np.stack([rng.choice(X, k, replace=False) for _ in range(N)]), jnp.int32)
  weights = jax.nn.softmax(jnp.asarray(rng.normal(size=(N, k)), jnp.float32), -1).astype(jnp.bfloat16)
  gate, up = (jnp.asarray(rng.normal(size=(X, E, F)) / np.sqrt(E), jnp.bfloat16) for _ in range(2))
  down = jnp.asarray(rng.normal(size=(X, F, E)) / np.sqrt(F), jnp.bfloat16)
  got = _f32(jax.jit(moe.grouped_swiglu)(x, experts, weights, (gate, up), down))
  # the reference: each token's k experts one at a time, fp32 from the same bf16 operands
  xf, gf, uf, df = (_f32(a) for a in (x, gate, up, down))
  e, w = np.asarray(experts), _f32(weights)
  ref = np.zeros((N, E), np.float32)
  for j in range(k):
    g = np.einsum("ne,nef->nf", xf, gf[e[:, j]])
    u = np.einsum("ne,nef->nf", xf, uf[e[:, j]])
    h = g / (1 + np.exp(-g)) * u
    ref += w[:, j:j + 1] * np.einsum("nf,nfe->ne", h, df[e[:, j]])
  rel = np.abs(got - ref).max() / np.abs(ref).max()
  return {"shape": {"tokens": N, "hidden": E, "expert_intermediate": F, "experts": X, "k": k},
          "checks": [_check("grouped SwiGLU (ragged_dot) vs a per-expert fp32 loop, max |diff| / max |ref|", rel,
                            16 * U, "bf16 inputs and intermediates (gate, up, silu * up rounded to bf16) through "
                                    "three GEMMs and k weighted sums: a few u each, 16u of the largest")]}


def moe_grouped_gemm_section(cfg, env) -> dict:
  import functools

  import jax
  import jax.numpy as jnp
  import numpy as np

  from llamarl_jax.model import grouped_gemm
  from llamarl_jax.model.paged_attention import interpret_kernels

  N, E, F, X, k = cfg["moe"]
  rng = np.random.RandomState(1)
  sizes = jnp.asarray(np.bincount(rng.randint(0, X, N * k), minlength=X), jnp.int32)  # uneven, some may be 0
  lhs, ct = (jnp.asarray(rng.normal(size=s), jnp.bfloat16) for s in ((N * k, E), (N * k, F)))
  rhs = jnp.asarray(rng.normal(size=(X, E, F)) / np.sqrt(E), jnp.bfloat16)
  fns = {"pallas": functools.partial(grouped_gemm.grouped_gemm, interpret=interpret_kernels()),
         "ragged_dot": jax.lax.ragged_dot}
  out = {}
  for name, fn in fns.items():
    y, vjp = jax.vjp(lambda a, b, fn=fn: fn(a, b, sizes), lhs, rhs)
    out[name] = [_f32(a) for a in (y, *vjp(ct))]
  checks = [_check(f"{what}, max |Pallas - ragged_dot| / max |ragged_dot's|",
                   np.abs(g - r).max() / np.abs(r).max(), 4 * U,
                   "both accumulate in fp32 and round once to bf16 (an ulp each), summation order: 4u")
            for what, g, r in zip(("value", "d rows", "d weights"), out["pallas"], out["ragged_dot"])]
  q = rhs.astype(jnp.float8_e4m3fn)  # the generator's fp8 experts: read as fp8, each tile widened in the kernel
  fp8_gap = np.abs(_f32(fns["pallas"](lhs, q, sizes)) - _f32(fns["pallas"](lhs, q.astype(jnp.bfloat16), sizes))).max()
  checks.append(_check("fp8 experts, max |kernel on fp8 - kernel on the widened bf16|", fp8_gap, 0.0,
                       "fp8 -> bf16 is exact: the same products"))
  times = _moe_layer_ms(N, E, F, X, k)
  return {"shape": {"rows": N * k, "embed": E, "width": F, "experts": X}, "checks": checks, "ms": times,
          "figures": [f"one MoE layer, {N} tokens top-{k} of {X} experts: forward {times['pallas']['forward']:.3g} ms "
                      f"(ragged_dot {times['ragged_dot']['forward']:.3g}), forward + backward "
                      f"{times['pallas']['step']:.3g} ms (ragged_dot {times['ragged_dot']['step']:.3g})"]}


def _moe_layer_ms(N: int, E: int, F: int, X: int, k: int, repeats: int = 5) -> dict:
  """ms of one MoE layer (`moe.grouped_swiglu`, bf16, random routing) by each grouped matmul, forward and
  forward + backward (the rows' and every expert weight's gradients), median of `repeats` after one."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from llamarl_jax.model import moe

  rng = np.random.RandomState(2)
  bf = lambda *shape: jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[-2] if len(shape) > 2 else 1), jnp.bfloat16)
  x, gate, up, down = bf(N, E), bf(X, E, F), bf(X, E, F), bf(X, F, E)
  experts = jnp.asarray(np.stack([rng.choice(X, k, replace=False) for _ in range(N)]), jnp.int32)
  weights = jax.nn.softmax(jnp.asarray(rng.normal(size=(N, k)), jnp.float32), -1).astype(jnp.bfloat16)
  out = {}
  for impl in ("pallas", "ragged_dot"):
    layer = lambda x, gu, d, impl=impl: moe.grouped_swiglu(x, experts, weights, gu, d, grouped_gemm=impl)
    loss = lambda *a, layer=layer: jnp.sum(layer(*a).astype(jnp.float32))
    fns = {"forward": jax.jit(layer), "step": jax.jit(jax.grad(loss, argnums=(0, 1, 2)))}
    out[impl] = {}
    for what, fn in fns.items():
      jax.block_until_ready(fn(x, (gate, up), down))
      times = []
      for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x, (gate, up), down))
        times.append(time.perf_counter() - t0)
      out[impl][what] = statistics.median(times) * 1e3
  return out


def _decode_ms(engine, prompts, chunks: int) -> float:
  """ms per decode step of `engine` (idle, weights installed, one chunk in flight at a time) with a slot
  per prompt busy: the prompts inserted and a first chunk run, then `chunks` chunks timed (the
  engine's R leaves every row running through them)."""
  engine.submit(prompts, seed=3)
  engine.step()  # inserts every prompt and runs the first chunk
  t0 = time.perf_counter()
  for _ in range(chunks):
    engine.step()
  return (time.perf_counter() - t0) * 1e3 / (chunks * engine.programs.chunk_steps)


def exact_logprobs_section(cfg, env) -> dict:
  """`ModelConfig.exact` on both sides (the `exact_logprobs` run switch): the slot engine's behaviour
  log-probs of its sampled tokens equal the trainer's `token_logprobs` of the same tokens bit for bit,
  on the same bf16 weights (random, lm_head x4 as in `lag0_logprobs`), every slot of 64 busy. The
  plain ops (the engine's paged attention and decode GEMMs, the trainer's attention and lm_head in
  chunks) give the reference figures: their mismatch (the check is not vacuous where it is not 0)
  and their times. Figures per mode: ms per decode step at 64 busy slots (`_decode_ms`) and ms per
  trainer log-prob forward of the generated batch (median of a few calls after a first one)."""
  import functools

  import jax
  import jax.numpy as jnp
  import numpy as np

  from llamarl_jax.generation import SamplingParams
  from llamarl_jax.generation.engine import SlotEngine
  from llamarl_jax.mismatch import mismatch_metrics
  from llamarl_jax.model import exact as exact_lib
  from llamarl_jax.model import init_model, split_params
  from llamarl_jax.model.forward import resolve_attention
  from llamarl_jax.model.llama import abstract_model
  from llamarl_jax.model.logprobs import token_logprobs

  S, Pm, R, steps, chunks, repeats = cfg["exact"]
  if R < (chunks + 2) * steps:
    raise ValueError(f"exact: R={R} must cover the warm-up chunk and {chunks} timed chunks of {steps} steps")
  config = _config(cfg, cfg["numerics_layers"], dtype="bfloat16", param_dtype="bfloat16")
  params = split_params(init_model(config, seed=0))[1]
  params["lm_head"] = params["lm_head"] * 4.0
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  attention = resolve_attention("auto", jax.default_backend(), jnp.bfloat16)
  sampling = SamplingParams(temperature=1.0, max_new_tokens=R, seed=1)
  rng = np.random.RandomState(2)
  prompts = [rng.randint(1, config.vocab_size, n).tolist() for n in rng.randint(Pm // 8 + 1, Pm + 1, S)]
  K3 = "rollout_corr/kl_k3"
  rows = []
  for exact in (True, False):
    model = config.replace(exact=exact)
    graphdef = split_params(abstract_model(model))[0]
    engine = SlotEngine(model, lanes=S, sampling=sampling, max_prompt_len=Pm, chunk_steps=steps, chunks_in_flight=1,
                        progress=False)
    t0 = time.perf_counter()
    batch = engine.generate(params, prompts, sampling)
    generate_s = time.perf_counter() - t0  # S rows of R tokens, the program set compiled before (`warmup_s`)
    decode_ms = _decode_ms(engine, prompts, chunks)
    used, engine_warmup_s = dict(engine.programs.paths), engine.warmup_s
    del engine
    logprobs = jax.jit(functools.partial(token_logprobs, attention=attention, logprob_chunk=256), static_argnums=0,
                       compiler_options=exact_lib.COMPILER_OPTIONS if exact else None)  # as the trainer's step
    args = (batch.prompt_tokens, batch.prompt_mask, batch.response_tokens, batch.response_mask)
    t0 = time.perf_counter()
    trainer = np.asarray(logprobs(graphdef, params, *args))
    first_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(logprobs(graphdef, params, *args))
      times.append(time.perf_counter() - t0)
    mask = np.asarray(batch.response_mask).astype(bool)
    behaviour = np.asarray(batch.behaviour_logprobs, np.float32)
    m = {k: float(v) for k, v in mismatch_metrics(trainer, behaviour, mask).items()}
    rows.append({"ops": "exact" if exact else "plain",
                 "engine_attention": "exact" if exact else used["paged_attention"],
                 "trainer_attention": "exact" if exact else attention, "tokens": int(mask.sum()),
                 "max_abs_diff": float(np.abs(behaviour - trainer)[mask].max()), "k3": m[K3],
                 "decode_ms_per_step": decode_ms, "forward_ms": statistics.median(times) * 1e3,
                 "warmup_s": engine_warmup_s, "generate_s": generate_s, "first_forward_s": first_s})
    jax.clear_caches()
  ex, plain = rows
  decode_ratio, forward_ratio = (ex[k] / plain[k] for k in ("decode_ms_per_step", "forward_ms"))
  why = "the same batch-invariant ops in the same order on both sides (`model.exact`): bit for bit"
  checks = [_check(f"exact: max |behaviour - trainer| over {ex['tokens']} response tokens", ex["max_abs_diff"],
                   0.0, why),
            _check("exact: k3 KL", ex["k3"], 0.0, why)]
  return {"layers": config.num_layers, "slots": S, "prompt_max": Pm, "R": R, "rows": rows, "checks": checks,
          "decode_ratio": decode_ratio, "forward_ratio": forward_ratio,
          "figures": [f"decode {ex['decode_ms_per_step']:.3g} ms/step exact vs {plain['decode_ms_per_step']:.3g} "
                      f"plain ({decode_ratio:.2f}x)",
                      f"trainer forward {ex['forward_ms']:.3g} ms exact vs {plain['forward_ms']:.3g} plain "
                      f"({forward_ratio:.2f}x)", f"plain max |diff| {plain['max_abs_diff']:.3g}"]}


def trainer_step_section(cfg, env) -> dict:
  """The trainer's forward kit (scan over layers, remat of matmul outputs, the GPU's attention, lm_head
  in chunks) against the plain module forward, both bf16 compute on the same fp32 master weights."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from llamarl_jax.batch import trainer_layout
  from llamarl_jax.model import init_model, split_params
  from llamarl_jax.model.forward import resolve_attention
  from llamarl_jax.model.llama import abstract_model, merge_params
  from llamarl_jax.model.logprobs import token_logprobs

  config = _config(cfg, cfg["numerics_layers"], dtype="bfloat16")
  _, params = split_params(init_model(config.replace(dtype="float32"), seed=0))
  graphdef = split_params(abstract_model(config))[0]
  B, P, R = cfg["train"]
  rng = np.random.RandomState(0)
  pt = jnp.asarray(rng.randint(1, config.vocab_size, (B, P)), jnp.int32)
  pm = jnp.asarray(np.arange(P)[None, :] >= rng.randint(0, P // 2, B)[:, None], jnp.int32)  # left-padded prompts
  rt = jnp.asarray(rng.randint(1, config.vocab_size, (B, R)), jnp.int32)
  rm = jnp.asarray(np.arange(R)[None, :] < rng.randint(R // 2, R + 1, B)[:, None], jnp.int32)
  adv = jnp.asarray(rng.choice([-1.0, 1.0], B), jnp.float32)
  attention = resolve_attention("auto", jax.default_backend(), jnp.bfloat16)

  def ours(p):
    return token_logprobs(graphdef, p, pt, pm, rt, rm, attention=attention, remat="matmuls",
                          logprob_chunk=max(1, R // 2))

  def plain(p):
    tokens, lengths, predict = trainer_layout(pt, pm, rt, rm)
    model = merge_params(graphdef, jax.tree.map(lambda x: x.astype(jnp.bfloat16), p))
    mask = (jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]).astype(jnp.int32)  # rows from position 0
    logits = model(tokens, attention_mask=mask).astype(jnp.float32)
    logits = jnp.take_along_axis(logits, predict[..., None], axis=1)
    lp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), rt[..., None], axis=-1)[..., 0]
    return jnp.where(rm > 0, lp, 0.0)

  objective = lambda f: lambda p: jnp.sum(adv[:, None] * f(p)) / jnp.sum(rm)  # noqa: E731
  (lp_ours, g_ours), (lp_plain, g_plain) = (jax.jit(jax.value_and_grad(objective(f), has_aux=False))(params)
                                            for f in (ours, plain))
  lp_a, lp_b = _f32(jax.jit(ours)(params)), _f32(jax.jit(plain)(params))
  valid = np.asarray(rm) > 0
  num = sum(float(jnp.sum((a - b) ** 2)) for a, b in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_plain)))
  den = sum(float(jnp.sum(b ** 2)) for b in jax.tree.leaves(g_plain))
  rel = (num / den) ** 0.5
  return {"shape": {"layers": config.num_layers, "B": B, "P": P, "R": R}, "attention": attention,
          "checks": [
              _check("log-probs, max |ours - plain|", np.abs(lp_a - lp_b)[valid].max(), 0.1,
                     "bf16 compute on both sides, other attention kernels and summation orders: a logit of "
                     "size ~|z| carries ~u|z| sqrt(k) error; 0.1 nats is 25u at |z| ~ 4"),
              _check("gradient, ||ours - plain|| / ||plain||", rel, 0.05,
                     "each gradient entry a bf16-rounded sum along different paths: ~sqrt(k) u, k ~ 10-100")]}


# ------------------------------------------------------------------------------------------------
# the main job and figures


def main_job_section(cfg, env) -> dict:
  dry = env["dry_run"]
  bindings = [*(bench_gpu.DRY["e2e"][0][2] if dry else ()), f"run_experiment.rl_steps = {cfg['main_steps']}"]
  r = bench_gpu.e2e_section({"e2e": (("llama3_1b_1gpu", "llama3_1b_1gpu.gin", tuple(bindings)),)}, env, None)
  row = r["rows"][0]
  row["figures"] = [f"{_cell(row['step_s'])} s per RL step, {_cell(row['gen_tokens_per_s'])} generated tokens/s, "
                    f"peak memory {_cell(row['peak_memory_gib'])} GiB against a plan of {_cell(row['plan_gib'])} GiB"]
  checks = []
  if row["peak_over_plan"] is not None:
    checks.append(_check("peak device memory / the memory plan", row["peak_over_plan"], 1.10,
                         "the plan is the run's budget: the allocator's peak within 10% of it"))
  return {**row, "checks": checks}


def _engine_figure(config, params, cfg, env, quantize, form) -> dict:
  import jax
  import numpy as np

  from llamarl_jax.generation import SamplingParams
  from llamarl_jax.measure import hlo
  from llamarl_jax.generation.engine import SlotEngine

  S, P, R, chunks = cfg["slots"], cfg["decode_prompt"], cfg["decode_R"], cfg["decode_chunks"]
  steps = max(1, min(16, R // (2 * chunks + 2)))  # every chunk runs all its steps: no row reaches R
  t0 = time.perf_counter()
  engine = SlotEngine(config, lanes=S, sampling=SamplingParams(temperature=1.0, max_new_tokens=R),
                      max_prompt_len=P, chunk_steps=steps, chunks_in_flight=1, progress=False, quantize=quantize,
                      paged_attention=form)
  rng = np.random.RandomState(0)
  placed = engine.sampler.place_params(params)
  engine.swap(placed, 0)
  engine.submit(rng.randint(1, config.vocab_size, (S, P)).tolist(), seed=0)
  engine.step()  # inserts every prompt and runs the first chunk
  warm = time.perf_counter() - t0  # the engine's program set compiled, the weights placed, a first chunk
  t0 = time.perf_counter()
  for _ in range(chunks):
    engine.step()
  ms = (time.perf_counter() - t0) * 1e3 / (chunks * steps)
  trace = Path(tempfile.mkdtemp(prefix="gpu_check_decode_"))
  with bench_generate.profiled(str(trace), "decode"):
    engine.step()
  kernels = bench_gpu.top_kernels(trace / "decode")
  live = np.full(S, P + (2 + chunks) * steps)  # the traced chunk's positions, on average
  ideal = hlo.ideal_step_bytes(config, live, params=engine.programs.param_avals)
  bw = env["peak_bandwidth"]
  roofline_ms = ideal["total"] / bw * 1e3 if bw else None
  paths = engine.programs.paths
  del engine, placed
  jax.clear_caches()
  return {"weights": {None: "bf16", "fp8": "fp8", "fp8+lm_head": "fp8 + fp8 lm_head"}[quantize],
          "paged_attention": paths["paged_attention"], "ms_per_step": ms, "roofline_ms": roofline_ms,
          "of_roofline": roofline_ms / ms if roofline_ms else None, "ideal_bytes": ideal["total"],
          "kernels_per_step": kernels["events"] / steps, "kernel_source": kernels["source"], "warmup_s": warm}


def decode_section(cfg, env) -> dict:
  from llamarl_jax.model import init_model, split_params

  config = _config(cfg, cfg["decode_layers"], dtype="bfloat16", param_dtype="bfloat16")
  params = split_params(init_model(config, seed=0))[1]
  rows = []
  for quantize in (None, "fp8", "fp8+lm_head"):
    for form in ("auto", "pallas_fused"):
      if form == "pallas_fused" and env["backend"] != "gpu" and not env["dry_run"]:
        continue
      rows.append(_engine_figure(config, params, cfg, env, quantize, form))
      print(f"    decode {rows[-1]['weights']}, {rows[-1]['paged_attention']}: {rows[-1]['ms_per_step']:.3f} ms/step",
            flush=True)
  return {"slots": cfg["slots"], "layers": config.num_layers, "rows": rows,
          "figures": [f"{r['weights']} / {r['paged_attention']}: {r['ms_per_step']:.2f} ms/step" +
                      (f" ({r['of_roofline']:.0%} of the bytes roofline)" if r["of_roofline"] else "")
                      for r in rows]}


def packing_section(cfg, env) -> dict:
  import jax
  import numpy as np

  from llamarl_jax import parallel
  from llamarl_jax.executors.trainer import OptimizerConfig, TrainerExecutor, TrainLayout

  dry = env["dry_run"]
  lengths, width = bench_packing.long_tail_batches(1)
  rows = cfg["pack_rows"]
  real = lengths[0][:rows]
  P = 512
  if dry:  # the same distribution's shape, scaled to the toy model's context
    real = np.maximum(2, real * 64 // width).astype(np.int64)
    P, width = 8, 64
  R = width - P
  config = _config(cfg, cfg["numerics_layers"] if dry else cfg["decode_layers"], dtype="bfloat16",
                   max_position_embeddings=max(width, cfg["model"]["max_position_embeddings"]))
  mesh = parallel.make_mesh(jax.devices()[:1])
  rng = np.random.RandomState(0)
  batch = bench_train.random_batch(rng, config, rows, P, R)
  resp = np.clip(real - P, 1, R)
  mask = (np.arange(R)[None, :] < resp[:, None]).astype(np.int32)
  batch = batch.replace(rollout=batch.rollout.replace(response_mask=mask, lengths=resp.astype(np.int32)))
  tokens = int(P * rows + resp.sum())
  out = []
  for layout, kw in (("padded", dict(microbatches=rows // 2 if rows >= 4 else 1)),
                     ("packed", dict(layout=TrainLayout("packed", width),
                                     attention="cudnn" if env["backend"] == "gpu" else "xla"))):
    from flax import nnx
    from llamarl_jax.model.llama import Llama, split_params
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    shardings = parallel.param_shardings(split_params(abstract)[1], parallel.logical_axes(abstract), mesh)
    trainer = TrainerExecutor(config, mesh, bench_train.random_params(config, shardings),
                              optimizer=OptimizerConfig(lr=1e-5), loss="aipo", loss_kwargs={"rho_max": 2.0},
                              remat="matmuls", **kw)
    t0 = time.perf_counter()
    trainer.step(batch)
    first = time.perf_counter() - t0
    times = [trainer.step(batch)["time/train_step"] for _ in range(cfg["pack_steps"])]
    step = statistics.median(times)
    out.append({"layout": layout, "attention": trainer.attention, "step_s": step, "real_tokens_per_s": tokens / step,
                "first_step_s": first})
    del trainer
    jax.clear_caches()
  speedup = out[1]["real_tokens_per_s"] / out[0]["real_tokens_per_s"]
  return {"rows": rows, "P": P, "R": R, "real_tokens": tokens, "layers": config.num_layers, "layouts": out,
          "figures": [f"packed / padded real tokens per second: {speedup:.2f}x"]}


RUNNERS = {"paged_kernel": paged_kernel_section, "lag0_logprobs": lag0_logprobs_section,
           "fp8_kernels": fp8_kernels_section, "cudnn_packed": cudnn_packed_section,
           "moe_ragged_dot": moe_ragged_dot_section, "moe_grouped_gemm": moe_grouped_gemm_section,
           "exact_logprobs": exact_logprobs_section, "trainer_step": trainer_step_section,
           "main_job": main_job_section, "decode": decode_section, "packing": packing_section}


# ------------------------------------------------------------------------------------------------
# report


def summary(name: str, r: dict) -> str:
  """The section's one line: pass / FAIL (the failed checks) / skipped / error, and its figures."""
  if "skipped" in r:
    return f"{name}: skipped ({r['skipped']})"
  if "error" in r:
    return f"{name}: ERROR ({r['error']})"
  checks = r.get("checks", [])
  failed = [c["name"] for c in checks if not c["pass"]]
  head = (f"FAIL ({'; '.join(failed)})" if failed else f"pass ({len(checks)} checks)") if checks else "figure"
  figures = r.get("figures", [])
  return f"{name}: {head}" + (": " + "; ".join(figures) if figures else "") + f" [{r['seconds']:.0f} s]"


def markdown(results: dict) -> str:
  env = results["environment"]
  lines = [f"# gpu_check: {env['device']} ({env['backend']}), jax {env['jax']}, {results['date']}"
           + (" (DRY RUN: toy sizes)" if env["dry_run"] else ""),
           f"command: `{results['command']}`; {results['total_s']:.0f} s in all", ""]
  for name, r in results["sections"].items():
    lines += [f"## {summary(name, r)}"]
    for c in r.get("checks", []):
      lines.append(f"- {'pass' if c['pass'] else 'FAIL'}: {c['name']} = {c['value']:.3g} (bound {c['bound']:.3g}: "
                   f"{c['why']})")
    for key in ("rows", "layouts"):
      if isinstance(r.get(key), list) and r[key] and isinstance(r[key][0], dict):
        cols = [k for k in r[key][0] if k not in ("checks", "breakdown", "bindings")]
        lines += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(_cell(x.get(c)) for c in cols) + " |" for x in r[key]]
    lines.append("")
  return "\n".join(lines)


def _cell(v) -> str:
  if isinstance(v, float):
    return f"{v:.4g}"
  if isinstance(v, dict):
    return ", ".join(f"{k}={x}" for k, x in v.items())
  return "-" if v is None else str(v)


def environment(dry_run: bool) -> dict:
  env = bench_gpu.check_environment(dry_run)  # stops with what to do where there is no GPU
  import jax
  env["devices_used"] = 1
  env["jaxlib"] = compat.jaxlib_version()
  env["platform_version"] = getattr(jax.devices()[0].client, "platform_version", None)
  return env


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default="results/gpu_check", help="directory for gpu_check.md and gpu_check.json")
  parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from {SECTIONS}")
  parser.add_argument("--dry_run", action="store_true", help="toy sizes on any backend (tests the script)")
  parser.add_argument("--budget_s", type=float, default=480.0,
                      help="no section after the first starts after this many seconds")
  args = parser.parse_args(argv)
  sections = args.sections.split(",")
  unknown = [s for s in sections if s not in SECTIONS]
  if unknown:
    parser.error(f"unknown sections {unknown}; choose from {SECTIONS}")
  env = environment(args.dry_run)
  cfg = DRY if args.dry_run else FULL
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  command = "python -m scripts.gpu_check " + " ".join(argv if argv is not None else sys.argv[1:])
  results = {"date": datetime.date.today().isoformat(), "command": command.strip(), "environment": env,
             "sections": {}, "total_s": 0.0}
  print(f"gpu_check: {env['device']} ({env['backend']}), jax {env['jax']}, sections {sections}", flush=True)
  start = time.perf_counter()
  for name in sections:
    t0 = time.perf_counter()
    if results["sections"] and t0 - start > args.budget_s:  # the first section always runs
      r = {"skipped": f"the {args.budget_s:.0f} s budget was spent before it started"}
    else:
      try:
        r = RUNNERS[name](cfg, env)
      except SkipSection as e:
        r = {"skipped": str(e)}
      except Exception as e:  # a failed section is reported; the others still run
        traceback.print_exc()
        r = {"error": f"{type(e).__name__}: {e}"}
    r["seconds"] = time.perf_counter() - t0
    results["sections"][name] = r
    results["total_s"] = time.perf_counter() - start
    print("  " + summary(name, r), flush=True)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))  # a cut-off run keeps these
    (out / "gpu_check.md").write_text(markdown(results))
  print("\n" + markdown(results))
  bad = [n for n, r in results["sections"].items() if "error" in r or any(not c["pass"] for c in r.get("checks", []))]
  if bad:
    raise SystemExit(f"gpu_check: sections {bad} failed (see above); every section is in {out}")
  return results


if __name__ == "__main__":
  main()
