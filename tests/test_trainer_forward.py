"""The trainer's forward: right-padded rows from position 0, layers under scan, fused-attention form,
chunked lm_head + log-prob + entropy, remat policies.

References: transformers' PyTorch models on the same weights (each row run alone, unpadded), the
sampler's behaviour log-probs (KV-cache decode of left-padded prompts), our unrolled `Llama` module,
and the unchunked computation. Tolerances: fp32 everywhere; the paths differ only in summation order
(~1e-6 relative), so 1e-4 absolute on log-probs (as test_model / test_sampler) is generous yet catches
a token shifted by one position (errors ~1) or a wrong mask. Chunked vs unchunked runs the same ops per
position, fused differently by XLA: values of magnitude ~5 agree to a few fp32 ulps (1e-5 absolute);
gradients w.r.t. the lm_head also sum over chunks in another order: 1e-5.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from llamarl_jax import gpu_paths, parallel
from llamarl_jax.executors.trainer import TrainerExecutor
from llamarl_jax.generation import Sampler, SamplingParams
from llamarl_jax.batch import trainer_layout
from llamarl_jax.model import load_hf_checkpoint, split_params
from llamarl_jax.model.config import ModelConfig
from llamarl_jax.model.forward import (chunked_token_logprobs, lm_head_weight, prepare_params, remat_policy,
                                       resolve_attention, scan_hidden_states, unstack_layers)
from llamarl_jax.model.llama import abstract_model
from llamarl_jax.model.logprobs import token_logprobs

logprobs_fn = jax.jit(token_logprobs, static_argnums=0,
                      static_argnames=("remat", "with_entropy", "attention", "logprob_chunk"))


def random_rows(rng, vocab, prompt_lens, resp_lens, P, R, right_padded_prompt=()):
  """Prompts `[B, P]` left-padded (right-padded for rows in `right_padded_prompt`), responses `[B, R]`."""
  B = len(prompt_lens)
  pt, pm = np.zeros((B, P), np.int32), np.zeros((B, P), np.int32)
  rt, rm = np.zeros((B, R), np.int32), np.zeros((B, R), np.int32)
  for i, (n, r) in enumerate(zip(prompt_lens, resp_lens)):
    cols = slice(0, n) if i in right_padded_prompt else slice(P - n, P)
    pt[i, cols], pm[i, cols] = rng.randint(1, vocab, n), 1
    rt[i, :r], rm[i, :r] = rng.randint(1, vocab, r), 1
  return pt, pm, rt, rm


def test_trainer_layout_by_hand():
  """Real prompt tokens first (from either padding side), then the response; predict = P_len - 1 + t."""
  pt = np.array([[0, 0, 5, 6], [3, 4, 9, 0]])
  pm = np.array([[0, 0, 1, 1], [1, 1, 1, 0]])
  rt = np.array([[7, 8, 2], [1, 0, 0]])
  rm = np.array([[1, 1, 0], [1, 0, 0]])
  tokens, lengths, predict = map(np.asarray, trainer_layout(pt, pm, rt, rm))
  np.testing.assert_array_equal(tokens, [[5, 6, 7, 8, 0, 0, 0], [3, 4, 9, 1, 0, 0, 0]])
  np.testing.assert_array_equal(lengths, [4, 4])
  np.testing.assert_array_equal(predict, [[1, 2, 3], [2, 3, 4]])


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_trainer_logprobs_match_transformers(make_hf_model, family):
  """Each row's response log-probs equal transformers' on the row alone (prompt + response, unpadded),
  with chunking (chunk 3 of R 7: a ragged last chunk), remat and entropy on."""
  extra = {"tie_word_embeddings": True} if family == "qwen3" else {}
  ref, path = make_hf_model(family=family, **extra)
  config, model = load_hf_checkpoint(path)
  graphdef, params = split_params(model)
  P, R = 6, 7
  rng = np.random.RandomState(0)
  pt, pm, rt, rm = random_rows(rng, config.vocab_size, [6, 2, 4, 1], [7, 3, 5, 1], P, R, right_padded_prompt=(2,))
  lp, ent = logprobs_fn(graphdef, params, pt, pm, rt, rm, temperature=0.8, remat="matmuls", with_entropy=True,
                        attention="xla", logprob_chunk=3)
  lp, ent = np.asarray(lp), np.asarray(ent)
  for i in range(len(pt)):
    seq = np.concatenate([pt[i][pm[i] > 0], rt[i][rm[i] > 0]])
    n_p, n_r = int(pm[i].sum()), int(rm[i].sum())
    with torch.no_grad():
      logits = ref(torch.tensor(seq[None], dtype=torch.long)).logits.numpy()[0] / 0.8
    logp = jax.nn.log_softmax(logits[n_p - 1:n_p - 1 + n_r])
    want = np.take_along_axis(np.asarray(logp), seq[n_p:, None], -1)[:, 0]
    np.testing.assert_allclose(lp[i, :n_r], want, atol=1e-4, rtol=0, err_msg=f"row {i}")
    np.testing.assert_allclose(ent[i, :n_r], -np.sum(np.exp(logp) * logp, -1), atol=1e-4, rtol=0)
    assert np.all(lp[i, n_r:] == 0) and np.all(ent[i, n_r:] == 0)


def test_trainer_logprobs_equal_sampler_behaviour_logprobs(make_hf_model):
  """The generator's behaviour log-probs (left-padded prompts, KV-cache decode, rows stopping at
  different lengths) equal the trainer's on the same batch, token for token."""
  _, path = make_hf_model()
  config, model = load_hf_checkpoint(path)
  rng = np.random.RandomState(1)
  prompts = [rng.randint(3, config.vocab_size, n).tolist() for n in (5, 11, 3, 8)]
  sampler = Sampler(config, batch_multiple=4)
  batch = sampler.generate(model, prompts, SamplingParams(temperature=1.0, max_new_tokens=9, n=2, seed=5,
                                                          stop_token_ids=(3, 4, 5, 6, 7)))
  rm = np.asarray(batch.response_mask)
  assert len(set(rm.sum(1).tolist())) > 1, "want rows of different lengths"
  graphdef, params = split_params(model)
  lp = logprobs_fn(graphdef, params, batch.prompt_tokens, batch.prompt_mask, batch.response_tokens, rm,
                   temperature=1.0, logprob_chunk=4)
  np.testing.assert_allclose(np.asarray(lp), np.where(rm > 0, batch.behaviour_logprobs, 0), atol=1e-4, rtol=0)


def test_scanned_forward_equals_unrolled_model():
  """scan_hidden_states over stacked layers == the Llama module's layer loop (logits at every valid
  position of right-padded rows); prepare_params / unstack_layers are inverse layouts."""
  config = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                       num_kv_heads=2, rope_theta=10000.0)
  from llamarl_jax.model import init_model

  model = init_model(config, seed=2)
  _, params = split_params(model)
  rng = np.random.RandomState(3)
  tokens = rng.randint(1, 50, (3, 10)).astype(np.int32)
  lengths = np.array([10, 6, 1], np.int32)
  prepared = prepare_params(params, jnp.float32)
  hidden = jax.jit(lambda p, t, l: scan_hidden_states(config, p, t, l))(prepared, tokens, lengths)
  ours = np.asarray(hidden @ lm_head_weight(config, prepared))
  for i, n in enumerate(lengths):
    want = np.asarray(model(jnp.asarray(tokens[i:i + 1, :n])))[0]
    np.testing.assert_allclose(ours[i, :n], want, atol=1e-5, rtol=0)
  back = unstack_layers(prepared)
  assert jax.tree.structure(back) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_remat_policies_give_equal_gradients():
  """'none', 'matmuls' and 'full' recompute different things, never change the gradient. Each policy is
  its own program, which XLA fuses differently, so a gradient entry's sum over positions and heads runs
  in another order: its rounding is bounded by the leaf's scale (entries cancel, so not elementwise),
  ~1e-6 of it in fp32; 1e-4 of the leaf's largest entry allows it on any CPU and XLA version, where a
  dropped or doubled term is O(1) of the scale."""
  config = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                       num_kv_heads=1, rope_theta=10000.0)
  from llamarl_jax.model import init_model

  graphdef, params = split_params(init_model(config, seed=4))
  pt, pm, rt, rm = random_rows(np.random.RandomState(5), 40, [3, 5], [4, 2], 5, 4)

  def grads(remat):
    f = lambda p: jnp.sum(token_logprobs(graphdef, p, pt, pm, rt, rm, remat=remat))
    return jax.jit(jax.grad(f))(params)

  base = grads("none")
  for remat in ("matmuls", "full", True):
    for a, b in zip(jax.tree.leaves(grads(remat)), jax.tree.leaves(base)):
      b = np.asarray(b)
      np.testing.assert_allclose(np.asarray(a), b, atol=1e-4 * np.abs(b).max(), rtol=0)


@pytest.mark.slow
def test_unrolled_layers_give_the_scans_logprobs_and_gradients():
  """scan_layers=False unrolls the layer scan: the same fp32 ops per layer, so log-probs and gradients
  equal the scan's to rounding, with and without remat. XLA fuses the two programs differently, so
  sums run in other orders: the log-probs agree to 1e-6, the gradients (3 layers of backward, each a
  sum over every position) to 1e-4 relative, where a wrong layer or a dropped term is O(1)."""
  config = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_layers=3, num_heads=2,
                       num_kv_heads=1, rope_theta=10000.0)
  from llamarl_jax.model import init_model

  graphdef, params = split_params(init_model(config, seed=6))
  pt, pm, rt, rm = random_rows(np.random.RandomState(7), 40, [3, 5], [4, 2], 5, 4)
  for remat in ("none", "full"):
    def value_and_grads(scan_layers):
      f = lambda p: jnp.sum(token_logprobs(graphdef, p, pt, pm, rt, rm, remat=remat, scan_layers=scan_layers))
      return jax.jit(jax.value_and_grad(f))(params)
    (v1, g1), (v2, g2) = value_and_grads(True), value_and_grads(False)
    np.testing.assert_allclose(float(v1), float(v2), atol=1e-6, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)


def _loss(chunk):
  def loss(hidden, w, tokens, cl, ce):
    lp, ent = chunked_token_logprobs(hidden, w, tokens, temperature=0.7, chunk=chunk)
    return jnp.sum(cl * lp) + jnp.sum(ce * ent)
  return loss


@pytest.mark.parametrize("chunk", [1, 3, 4])
def test_chunked_logprobs_equal_unchunked_values_and_gradients(chunk):
  """B 2, R 8 (chunk 3: a padded last chunk), E 16, V 300: log-probs, entropies and the gradients of
  a weighted sum of both w.r.t. hidden states and lm_head equal the one-piece computation."""
  rng = np.random.RandomState(chunk)
  hidden = jnp.asarray(rng.normal(size=(2, 8, 16)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(16, 300)) / 4, jnp.float32)
  tokens = jnp.asarray(rng.randint(0, 300, (2, 8)), jnp.int32)
  cl, ce = (jnp.asarray(rng.normal(size=(2, 8)), jnp.float32) for _ in range(2))
  full = jax.jit(lambda h, w, t: chunked_token_logprobs(h, w, t, temperature=0.7))(hidden, w, tokens)
  part = jax.jit(lambda h, w, t: chunked_token_logprobs(h, w, t, temperature=0.7, chunk=chunk))(hidden, w, tokens)
  for a, b in zip(part, full):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
  g_full = jax.jit(jax.grad(_loss(None), argnums=(0, 1)))(hidden, w, tokens, cl, ce)
  g_part = jax.jit(jax.grad(_loss(chunk), argnums=(0, 1)))(hidden, w, tokens, cl, ce)
  for a, b in zip(g_part, g_full):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


def vocab_arrays(hlo_text: str, vocab: int) -> list[tuple[int, str]]:
  """(elements, type) of every tensor type in StableHLO text with a dimension of size `vocab`."""
  out = []
  for dims in set(re.findall(r"tensor<((?:\d+x)+)\w+>", hlo_text)):
    shape = [int(d) for d in dims.rstrip("x").split("x")]
    if vocab in shape:
      out.append((int(np.prod(shape)), dims))
  return sorted(out)


def test_chunked_gradient_program_has_no_full_logits():
  """Forward and backward of the chunked loss hold at most one [B, chunk, V] logits block: the
  largest vocabulary-sized array in the lowered program is B * chunk * V, not B * R * V."""
  B, R, E, V, chunk = 2, 64, 16, 1000, 8
  args = (jax.ShapeDtypeStruct((B, R, E), jnp.float32), jax.ShapeDtypeStruct((E, V), jnp.float32),
          jax.ShapeDtypeStruct((B, R), jnp.int32), jax.ShapeDtypeStruct((B, R), jnp.float32),
          jax.ShapeDtypeStruct((B, R), jnp.float32))
  text = jax.jit(jax.grad(_loss(chunk), argnums=(0, 1))).trace(*args).lower().as_text()
  largest = vocab_arrays(text, V)[-1][0]
  assert largest == max(B * chunk * V, E * V), vocab_arrays(text, V)
  unchunked = jax.jit(jax.grad(_loss(None), argnums=(0, 1))).trace(*args).lower().as_text()
  assert vocab_arrays(unchunked, V)[-1][0] == B * R * V  # the check would see a full logits array


def test_attention_and_remat_choices():
  assert resolve_attention("auto", "cpu", jnp.bfloat16) == "xla"
  assert resolve_attention("auto", "gpu", jnp.bfloat16) == "cudnn"
  assert resolve_attention("auto", "cuda", jnp.float32) == "xla"  # cuDNN's kernel takes bf16/fp16 only
  assert resolve_attention("xla", "gpu", jnp.bfloat16) == "xla"
  # packed rows: 'auto' takes cuDNN's segment-offset form only once it has passed on a GPU (`gpu_paths`),
  # XLA's masked form until then; cuDNN's runs when named
  packed_auto = "cudnn" if gpu_paths.passed("packed_attention", "cudnn") else "xla"
  assert resolve_attention("auto", "gpu", jnp.bfloat16, packed=True) == packed_auto
  assert resolve_attention("cudnn", "gpu", jnp.bfloat16, packed=True) == "cudnn"
  with pytest.raises(ValueError, match="needs a CUDA GPU"):
    resolve_attention("cudnn", "cpu", jnp.bfloat16)
  with pytest.raises(ValueError, match="one of"):
    resolve_attention("flash", "gpu", jnp.bfloat16)
  assert [remat_policy(x) for x in (False, True, None, "matmuls")] == ["none", "full", "none", "matmuls"]
  with pytest.raises(ValueError, match="remat must be one of"):
    remat_policy("dots")


def test_trainer_refuses_cudnn_where_it_cannot_run():
  """Asking for cuDNN on CPU is an error when the trainer is built, not a silent XLA fallback."""
  config = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                       num_kv_heads=1, dtype="bfloat16")
  shapes = split_params(abstract_model(config))[1]
  mesh = parallel.make_mesh(jax.devices()[:1])
  with pytest.raises(ValueError, match="attention='cudnn'.*needs a CUDA GPU"):
    TrainerExecutor(config, mesh, shapes, attention="cudnn")
  with pytest.raises(ValueError, match="logprob_chunk"):
    TrainerExecutor(config, mesh, shapes, logprob_chunk=0)


def test_abstract_trainer_lowers_a_step_without_full_logits():
  """A trainer built from shapes only lowers its exact step (2 microbatches of 4 rows, R 64, chunk 16):
  the largest vocabulary-sized array is one chunk's [4, 16, V] logits (or the lm_head itself)."""
  config = ModelConfig(vocab_size=1000, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                       num_kv_heads=1)
  shapes = split_params(abstract_model(config))[1]
  trainer = TrainerExecutor(config, parallel.make_mesh(jax.devices()[:1]), shapes, microbatches=2,
                            logprob_chunk=16, remat="full")
  with pytest.raises(RuntimeError, match="abstract"):
    trainer.step(None)
  text = trainer.lower_step(8, 8, 64).as_text()
  assert vocab_arrays(text, 1000)[-1][0] == 4 * 16 * 1000, vocab_arrays(text, 1000)[-3:]


def _cuda_lowering_available() -> bool:
  try:
    import jax_cuda12_plugin  # noqa: F401
    import nvidia.cudnn  # noqa: F401
  except ImportError:
    return False
  return True


@pytest.mark.skipif(not _cuda_lowering_available(),
                    reason="lowering for CUDA needs jax-cuda12-plugin and nvidia-cudnn-cu12 (shared/GPU.md)")
def test_step_lowered_for_cuda_uses_cudnn_fused_attention():
  """On a CPU machine with the CUDA plugin: the bf16 step lowered for CUDA calls cuDNN's fused
  attention forward and backward."""
  config = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, dtype="bfloat16")
  shapes = split_params(abstract_model(config))[1]
  trainer = TrainerExecutor(config, parallel.make_mesh(jax.devices()[:1]), shapes, platform="cuda",
                            attention="auto", remat="matmuls")
  assert trainer.attention == "cudnn"
  text = trainer.lower_step(4, 64, 64).as_text()
  assert "__cudnn$fmhaSoftmax" in text and "__cudnn$fmhaSoftmaxBackward" in text


def test_padding_fraction_metric():
  """train/padding_fraction = padded positions / real tokens of the trainer's rows: 2 rows of width
  P + R = 4 + 4 = 8 holding 2 + 3 and 4 + 1 real tokens -> (16 - 10) / 10."""
  from llamarl_jax.train.step import padding_fraction

  batch = {"prompt_tokens": np.array([[0, 0, 5, 6], [1, 2, 3, 4]]), "prompt_mask": np.array([[0, 0, 1, 1], [1, 1, 1, 1]]),
           "response_tokens": np.array([[7, 8, 9, 0], [5, 0, 0, 0]]),
           "response_mask": np.array([[1, 1, 1, 0], [1, 0, 0, 0]])}
  assert float(padding_fraction(batch)) == pytest.approx(0.6)
