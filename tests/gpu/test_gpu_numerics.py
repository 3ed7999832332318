"""Numerics that only a GPU can show (`make test-gpu`; skipped without a GPU, see tests/conftest.py).

1. cuDNN fused attention and XLA's attention agree on the trainer's layout (causal, rows right-padded
   from position 0 with per-row lengths, GQA), forward and backward. Written against
   `jax.nn.dot_product_attention(implementation=...)` directly, so it holds for whichever attention
   the model is configured to use.
2. At policy lag 0, the trainer's bf16 log-probs and the generator's bf16 behaviour log-probs (the
   slot engine's KV-cache decode) of the same sampled tokens stay within NeMo-RL's bar for a correct
   inference backend, on layers of Llama-3.2-1B's real size.
   Checked on both trainer paths: XLA attention with full logits, and the GPU path the trainer
   takes by default there (cuDNN fused attention, lm_head + log-prob in chunks of 256 positions).
3. The trainer's log-prob function in bf16 against itself in fp32, and chunked against full logits
   in bf16 (the chunked path must add no error of its own beyond summation order).

Bounds, with bf16's unit roundoff u = 2^-8 (8 significant bits):
- attention: both implementations accumulate in fp32 and round the output to bf16; cuDNN also rounds
  the softmax probabilities to bf16 before the PV product. Each output is a convex combination of
  value rows, so its error is at most ~2u max|v| per rounding: 4u max|v| allows two. cuDNN must also be
  about as accurate as XLA against an fp32 reference (mean error at most 2x XLA's).
- log-probs: a logit of magnitude |z| carries ~u |z| sqrt(k) rounding error after k roundings along
  its path (k ~ 10 for 2 layers + head); with logits of std ~4 (the lm_head is scaled to give a
  trained model's spread) per-token |log pi - log mu| is ~1e-2, so KL k3 ~ d^2/2 ~ 1e-4: bound 1e-3.
  token_mult_prob_error (mean e^|d|) <= 1.05 is NeMo-RL's CI threshold for a correct backend.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llamarl_jax.model.logprobs import token_logprobs
from llamarl_jax.generation import SamplingParams
from llamarl_jax.generation.engine import SlotEngine
from llamarl_jax.mismatch import mismatch_metrics
from llamarl_jax.model import Llama, ModelConfig, init_model, split_params

pytestmark = pytest.mark.gpu

U = 2.0**-8
# Llama-3.2-1B's layer and vocabulary sizes; 2 of its 16 layers keep the test to seconds
ONE_B_LAYERS = ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=2, num_heads=32,
                           num_kv_heads=8, head_dim=64, max_position_embeddings=4096, rope_theta=500000.0,
                           tie_word_embeddings=False)


def _attention_inputs(B=4, T=1024, N=32, K=8, H=64, seed=0):
  rng = np.random.RandomState(seed)
  q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, H)), jnp.bfloat16) for n in (N, K, K))
  lengths = jnp.asarray([T, T - 1, T // 2 + 3, 17], jnp.int32)[:B]
  return q, k, v, lengths


def _attend(q, k, v, lengths, implementation):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lengths,
                                      key_value_seq_lengths=lengths, implementation=implementation)


def test_cudnn_and_xla_attention_agree_on_the_trainer_layout():
  q, k, v, lengths = _attention_inputs()
  valid = np.arange(q.shape[1])[None, :] < np.asarray(lengths)[:, None]  # [B, T]: rows right-padded
  outs = {impl: np.asarray(jax.jit(_attend, static_argnums=4)(q, k, v, lengths, impl), np.float32)
          for impl in ("cudnn", "xla")}
  with jax.default_matmul_precision("highest"):
    exact = np.asarray(jax.jit(_attend, static_argnums=4)(*(x.astype(jnp.float32) for x in (q, k, v)), lengths,
                                                          "xla"))
  bound = 4 * U * float(jnp.abs(v).max())
  err = {impl: np.abs(o - exact)[valid] for impl, o in outs.items()}
  assert np.abs(outs["cudnn"] - outs["xla"])[valid].max() <= bound
  assert err["cudnn"].mean() <= 2 * err["xla"].mean() + 1e-6
  # the gradients the trainer takes through attention (w.r.t. q, k and v) agree to the same order
  def loss(impl):
    return lambda q, k, v: jnp.sum(jnp.where(valid[..., None, None], _attend(q, k, v, lengths, impl), 0)
                                   .astype(jnp.float32) ** 2)
  grads = {impl: jax.jit(jax.grad(loss(impl), argnums=(0, 1, 2)))(q, k, v) for impl in ("cudnn", "xla")}
  for gc, gx in zip(grads["cudnn"], grads["xla"]):
    gc, gx = np.asarray(gc, np.float32), np.asarray(gx, np.float32)
    scale = np.abs(gx).max()
    assert np.abs(gc - gx).max() <= 8 * U * scale, (np.abs(gc - gx).max(), scale)


@pytest.fixture(scope="module")
def one_b_layers():
  """(fp32 graphdef, fp32 params): random weights, lm_head scaled x4 so logits spread like a trained
  model's (std ~4 instead of ~1) and the sampled tokens have probabilities far from uniform."""
  graphdef, params = split_params(init_model(ONE_B_LAYERS, seed=0))
  params["lm_head"] = params["lm_head"] * 4.0
  return graphdef, params


@pytest.fixture(scope="module")
def bf16_rollout(one_b_layers):
  """8 prompts x 128 sampled tokens from the bf16 slot engine (the generator's default engine)."""
  config = ONE_B_LAYERS.replace(dtype="bfloat16", param_dtype="bfloat16")
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), one_b_layers[1])
  sampling = SamplingParams(temperature=1.0, max_new_tokens=128, seed=1)
  engine = SlotEngine(config, lanes=8, sampling=sampling, max_prompt_len=64)
  rng = np.random.RandomState(2)
  prompts = [rng.randint(1, ONE_B_LAYERS.vocab_size, n).tolist() for n in (64, 5, 33, 17, 64, 48, 9, 60)]
  return engine.generate(params, prompts, sampling)


def _trainer_logprobs(one_b_layers, batch, dtype, attention="xla", logprob_chunk=None):
  """The trainer's `token_logprobs` with fp32 master params and `dtype` compute: `[B, R]`."""
  graphdef = split_params(nnx.eval_shape(lambda: Llama(ONE_B_LAYERS.replace(dtype=dtype), rngs=nnx.Rngs(0))))[0]
  fn = jax.jit(functools.partial(token_logprobs, attention=attention, logprob_chunk=logprob_chunk),
               static_argnums=0)
  return fn(graphdef, one_b_layers[1], batch.prompt_tokens, batch.prompt_mask, batch.response_tokens,
            batch.response_mask)


@pytest.mark.parametrize("attention,logprob_chunk", [("xla", None), ("cudnn", 256)])
def test_bf16_trainer_and_generator_logprobs_agree_at_lag_0(one_b_layers, bf16_rollout, attention, logprob_chunk):
  batch = bf16_rollout
  trainer = _trainer_logprobs(one_b_layers, batch, "bfloat16", attention, logprob_chunk)
  m = {k: float(v) for k, v in mismatch_metrics(trainer, batch.behaviour_logprobs, batch.response_mask).items()}
  assert m["rollout_corr/num_tokens"] == 8 * 128
  assert m["rollout_corr/kl_k3"] <= 1e-3, m
  assert m["rollout_corr/token_mult_prob_error"] <= 1.05, m
  # and the mismatch is real bf16 rounding, not a silent fp32 path on one side
  assert m["rollout_corr/kl_k3"] > 0, m


def test_trainer_logprobs_bf16_against_fp32(one_b_layers, bf16_rollout):
  """The trainer's bf16 log-probs against its fp32 ("highest") ones on the same tokens: the numerics
  share of the mismatch above that the trainer alone contributes (same bounds)."""
  batch = bf16_rollout
  bf16 = _trainer_logprobs(one_b_layers, batch, "bfloat16")
  with jax.default_matmul_precision("highest"):
    fp32 = _trainer_logprobs(one_b_layers, batch, "float32")
  m = {k: float(v) for k, v in mismatch_metrics(bf16, fp32, batch.response_mask).items()}
  assert 0 < m["rollout_corr/kl_k3"] <= 1e-3, m
  assert m["rollout_corr/token_mult_prob_error"] <= 1.05, m


def test_chunked_and_full_logprobs_agree_in_bf16(one_b_layers, bf16_rollout):
  """The trainer's chunked lm_head (chunks of 32 positions: 4 chunks of the 128-token responses) against
  the full logits, both bf16 compute with cuDNN attention: the same fp32-accumulated logits, cut
  differently, so the only difference is the order of the logsumexp's fp32 sums: |d| <= 1e-3 per
  token (fp32 unit roundoff 6e-8 times a few thousand-term sum of terms <= 1, with margin)."""
  batch = bf16_rollout
  full = np.asarray(_trainer_logprobs(one_b_layers, batch, "bfloat16", "cudnn", None))
  chunked = np.asarray(_trainer_logprobs(one_b_layers, batch, "bfloat16", "cudnn", 32))
  mask = np.asarray(batch.response_mask) > 0
  assert np.abs(full - chunked)[mask].max() <= 1e-3


def test_pallas_paged_kernel_agrees_with_the_xla_form_on_the_gpu():
  """The one-kernel paged attention compiled by Triton (not interpret mode) against XLA's 'reduce'
  form, Llama-3.2-1B's heads, 64 rows of 100..500 live positions in blocks of 16, bf16 pools. Both
  compute in fp32 from the same bf16 keys and values; the outputs round to bf16 once: 2u max|v|."""
  from llamarl_jax.generation import paged
  from llamarl_jax.generation.paged import PageLayout
  from llamarl_jax.model.paged_attention import paged_decode_attention
  from llamarl_jax.model.paged_kernel import paged_decode_attention_kernel

  S, Pm, R, bs, KV, H, D = 64, 128, 512, 16, 8, 32, 64
  lay = PageLayout(S, Pm, R, bs)
  rng = np.random.RandomState(0)
  live = rng.randint(100, 501, S)
  prompt = np.minimum(rng.randint(32, Pm + 1, S), live - 1)
  k_pool, v_pool = (jnp.asarray(rng.normal(size=(lay.num_blocks, bs, KV, D)), jnp.bfloat16) for _ in range(2))
  need = int(np.sum(-(-prompt // bs) + -(-(live - prompt) // bs)))
  row, block, length = paged.live_entries(lay, jnp.arange(S, dtype=jnp.int32), jnp.asarray(prompt, jnp.int32),
                                          jnp.asarray(live - prompt, jnp.int32), jnp.ones(S, bool),
                                          S * (lay.prompt_blocks + lay.response_blocks))  # every entry a step could list: the kernel walks only the live ones
  q = jnp.asarray(rng.normal(size=(S, 1, H, D)), jnp.bfloat16)
  xla = paged_decode_attention(q, k_pool, v_pool, row, block, length, "reduce")
  kernel = paged_decode_attention_kernel(q, k_pool, v_pool, row, block, length)
  err = float(jnp.max(jnp.abs(kernel.astype(jnp.float32) - xla.astype(jnp.float32))))
  assert err <= 2 * U * float(jnp.max(jnp.abs(v_pool.astype(jnp.float32))))
