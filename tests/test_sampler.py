"""The sampler: exact against transformers and the trainer's forward pass, correct distributions,
padding-, sharding- and seed-invariant, stops rows correctly, does not recompile for new prompts.

One random tiny transformers Llama (fp32, vocab 68 so tp=2 shards it) and one Sampler serve the
module: compilation is the slow part on CPU, so tests share the prompt bucket, the padded batch
(batch_multiple=8, which also exercises dropping the padding rows), R and the sampling switches.
Log-prob tolerance: fp32 end to end; the cached decode and the full forward differ only in
summation order (~1e-6), so 1e-4 is tight enough to catch a wrong position, mask or temperature.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from conftest import tiny_hf_config
from sequence_layout import sequence_layout
from llamarl_jax import parallel
from llamarl_jax.generation import FINISH_LENGTH, FINISH_STOP, Sampler, SamplingParams, sample_logits
from llamarl_jax.model import load_hf_checkpoint, split_params

V = 68
R = 8  # max_new_tokens everywhere: one compiled decode loop per sampling mode
PROMPT_LENGTHS = (5, 11, 3)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
  import transformers

  torch.manual_seed(0)
  ref = transformers.LlamaForCausalLM(tiny_hf_config(vocab_size=V)).eval()
  path = tmp_path_factory.mktemp("sampler") / "ref"
  ref.save_pretrained(path)
  return ref, path


@pytest.fixture(scope="module")
def model(hf_model):
  return load_hf_checkpoint(hf_model[1])


@pytest.fixture(scope="module")
def sampler(model):
  return Sampler(model[0], batch_multiple=8)


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.RandomState(0)
  return [rng.randint(3, V, n).tolist() for n in PROMPT_LENGTHS]


@nnx.jit
def _forward(model, tokens, positions, mask):
  return model(tokens, positions=positions, attention_mask=mask)


def full_forward_logits(model, batch):
  """The trainer's view: logits `[B, R, V]` for the response tokens from one full forward pass."""
  tokens, positions, mask = sequence_layout(batch.prompt_tokens, batch.prompt_mask, batch.response_tokens,
                                            batch.response_mask)
  logits = np.asarray(_forward(model, tokens, positions, mask))
  Pb = batch.prompt_tokens.shape[1]
  return logits[:, Pb - 1:Pb - 1 + R]


def intended_logprobs(logits, temperature, top_k=0, top_p=1.0):
  """log of the intended sampling distribution `[..., V]` (-inf outside the top-k/top-p set), numpy."""
  x = np.asarray(logits, np.float64) / temperature
  order = np.argsort(-x, axis=-1, kind="stable")
  ranked = np.take_along_axis(x, order, axis=-1)
  keep = np.ones_like(ranked, bool)
  if top_k:
    keep[..., top_k:] = False
  if top_p < 1:
    p = np.exp(ranked - ranked.max(-1, keepdims=True)) * keep
    p /= p.sum(-1, keepdims=True)
    keep &= (np.cumsum(p, -1) - p) < top_p
  ranked = np.where(keep, ranked, -np.inf)
  lp = ranked - ranked.max(-1, keepdims=True)
  lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
  out = np.empty_like(lp)
  np.put_along_axis(out, order, lp, axis=-1)
  return out


def assert_greedy_matches_transformers(ref, model, sampler, prompts, policy_version=0):
  """Greedy tokens equal `ref.generate`'s token for token (left-padded batch), and the behaviour
  log-probs, computed by the KV-cache decode loop, equal the full forward's. Returns the batch."""
  batch = sampler.generate(model, prompts, SamplingParams(temperature=0, max_new_tokens=R),
                           policy_version=policy_version)
  T = max(len(p) for p in prompts)
  ids = np.zeros((len(prompts), T), np.int64)
  mask = np.zeros_like(ids)
  for i, p in enumerate(prompts):
    ids[i, T - len(p):], mask[i, T - len(p):] = p, 1
  ref.generation_config.eos_token_id = None  # no stop tokens on either side: R tokens per row
  with torch.no_grad():
    out = ref.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
                       max_new_tokens=R, pad_token_id=0)
  np.testing.assert_array_equal(np.asarray(batch.response_tokens), out[:, T:].numpy())
  # greedy reports the model's own (untempered) log-prob of the argmax token
  logits = full_forward_logits(model, batch)
  expected = np.take_along_axis(jax.nn.log_softmax(logits), np.asarray(batch.response_tokens)[..., None], -1)[..., 0]
  np.testing.assert_allclose(batch.behaviour_logprobs, expected, atol=1e-4, rtol=0)
  return batch


def test_greedy_matches_transformers_generate(hf_model, model, sampler, prompts):
  batch = assert_greedy_matches_transformers(hf_model[0], model[1], sampler, prompts, policy_version=7)
  # the RolloutBatch contract
  T = max(PROMPT_LENGTHS)
  Pb = sampler.prompt_bucket(T)
  assert batch.prompt_tokens.shape == (3, Pb) and batch.response_tokens.shape == (3, R)
  np.testing.assert_array_equal(np.asarray(batch.prompt_mask).sum(1), PROMPT_LENGTHS)
  np.testing.assert_array_equal(np.asarray(batch.prompt_tokens)[2, -3:], prompts[2])
  np.testing.assert_array_equal(batch.lengths, [R] * 3)
  np.testing.assert_array_equal(batch.finish_reason, [FINISH_LENGTH] * 3)
  np.testing.assert_array_equal(batch.group_ids, [0, 1, 2])
  np.testing.assert_array_equal(batch.policy_version, [7] * 3)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_greedy_matches_transformers_generate_qwen(make_hf_model, prompts, family):
  """The same for Qwen2 (q/k/v bias) and Qwen3 (q/k norm, head_dim 16 != hidden / heads, yarn RoPE)."""
  extra = {"head_dim": 16, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 32}} if family == "qwen3" else {}
  ref, path = make_hf_model(family=family, vocab_size=V, **extra)
  config, model = load_hf_checkpoint(path)
  assert_greedy_matches_transformers(ref, model, Sampler(config, batch_multiple=8), prompts)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 10, 0.9)])
def test_behaviour_logprobs_equal_full_forward(model, sampler, prompts, temperature, top_k, top_p):
  sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=R, n=2, seed=3)
  batch = sampler.generate(model[1], prompts, sampling)
  logits = full_forward_logits(model[1], batch)
  lp = intended_logprobs(logits, temperature, top_k, top_p)
  tokens = np.asarray(batch.response_tokens)
  expected = np.take_along_axis(lp, tokens[..., None], -1)[..., 0]
  assert np.isfinite(expected).all(), "a sampled token lies outside the top-k/top-p set"
  assert np.asarray(batch.response_mask).all()
  np.testing.assert_allclose(batch.behaviour_logprobs, expected, atol=1e-4, rtol=0)
  np.testing.assert_array_equal(batch.group_ids, [0, 0, 1, 1, 2, 2])


# -- the sampling step on logits we control ------------------------------------------------------

LOGITS = np.array([2.0, 1.5, 1.1, 0.4, 0.0, -0.3, -1.0, -2.5], np.float32)
N_DRAWS = 40_000


@pytest.mark.parametrize("temperature,top_k,top_p,candidates", [
    (0.7, 0, 1.0, 8),   # temperature only: full-vocabulary path, no sort
    (1.0, 3, 1.0, 8),   # top-k only
    (1.0, 0, 0.8, 8),   # top-p only, 8 = V: sorted (mass before the 4th token 0.79 < 0.8 < 0.90 before the 5th)
    (1.0, 0, 0.8, 4),   # the same from 4 candidates (mass 0.90 >= 0.8: they hold the nucleus)
    (1.0, 0, 0.8, 3),   # 3 candidates hold 0.79 < 0.8: the fallback sorts the whole vocabulary
    (1.5, 5, 0.6, 8),   # top-k then top-p on the renormalised top-k
])
def test_sampled_frequencies_match_intended_distribution(temperature, top_k, top_p, candidates):
  logits = jnp.broadcast_to(LOGITS, (N_DRAWS, len(LOGITS)))
  step = jax.jit(lambda key, x: sample_logits(key, x, temperature=temperature, top_k=top_k, top_p=top_p,
                                              top_p_candidates=candidates))
  tokens, logprobs = map(np.asarray, step(jax.random.key(0), logits))
  lp = intended_logprobs(LOGITS, temperature, top_k, top_p)
  p = np.exp(lp)
  freq = np.bincount(tokens, minlength=len(LOGITS)) / N_DRAWS
  assert (freq[p == 0] == 0).all(), f"excluded tokens {np.nonzero(p == 0)[0]} were sampled: {freq}"
  # each frequency is a binomial mean: within 5 standard deviations (false alarm ~1e-6 per entry)
  tol = 5 * np.sqrt(p * (1 - p) / N_DRAWS) + 1e-9
  assert (np.abs(freq - p) <= tol).all(), f"freq {freq.round(4)} vs p {p.round(4)} (tol {tol.round(4)})"
  np.testing.assert_allclose(logprobs, lp[tokens], atol=1e-5, rtol=0)  # the reported log mu


# Rows of a [B, V] batch for the top-p branches: "peaked" rows (logits ~ 4 N(0, 1)) have a nucleus of
# a few tokens at top_p 0.9; a "flat" row (0.1 N(0, 1)) needs nearly all V tokens.
STEP_V, CANDIDATES = 512, 32


def _step_logits(rows):
  rng = np.random.RandomState(1)
  scale = {"peaked": 4.0, "flat": 0.1}
  return np.stack([scale[r] * rng.randn(STEP_V) for r in rows]).astype(np.float32)


@pytest.mark.parametrize("rows,temperature,top_k,top_p,branch", [
    (["peaked"] * 16, 1.0, 0, 0.9, "candidates"),                # top-p alone: the candidates hold it
    (["peaked"] * 15 + ["flat"], 1.0, 0, 0.9, "full sort"),      # one wide nucleus sorts the batch
    (["flat"] * 16, 1.0, 0, 0.999, "full sort"),                 # top-p near 1 on flat rows
    (["peaked"] * 16, 0.6, 0, 0.95, "candidates"),               # temperature, then top-p: the candidates
    (["peaked"] * 8 + ["flat"] * 8, 0.6, 0, 0.95, "full sort"),  # flat rows at 0.6: still ~480 tokens
    (["peaked"] * 8 + ["flat"] * 8, 0.8, 40, 0.9, "top-k"),      # top-k then top-p within it
    (["peaked"] * 8 + ["flat"] * 8, 0.7, 0, 1.0, "no filter"),   # temperature only
])
def test_step_logprobs_are_the_sampled_distributions(rows, temperature, top_k, top_p, branch):
  """The reported log mu is the reference distribution's log-prob of the sampled token, on each
  path; ranking 32 candidates draws the same tokens as sorting all 512 (same keys, same order).
  Tolerance 1e-5: an f32 log-softmax over <= 512 logits against float64 (error ~1e-6)."""
  logits = _step_logits(rows)
  lp = intended_logprobs(logits, temperature, top_k, top_p)
  nucleus = np.isfinite(lp).sum(-1)
  if branch == "candidates":
    assert nucleus.max() < CANDIDATES, nucleus  # the case is what it claims: no row needs the fallback
  if branch == "full sort":
    assert nucleus.max() > CANDIDATES, nucleus
  step = jax.jit(lambda key, x, n: sample_logits(key, x, temperature=temperature, top_k=top_k, top_p=top_p,
                                                 top_p_candidates=n), static_argnums=2)
  for seed in range(4):
    tokens, logprobs = map(np.asarray, step(jax.random.key(seed), logits, CANDIDATES))
    expected = np.take_along_axis(lp, tokens[:, None], -1)[:, 0]
    assert np.isfinite(expected).all(), f"tokens outside the top-k/top-p set: {tokens[~np.isfinite(expected)]}"
    np.testing.assert_allclose(logprobs, expected, atol=1e-5, rtol=0)
    sorted_tokens, _ = step(jax.random.key(seed), logits, STEP_V)  # candidates = V: always the full sort
    np.testing.assert_array_equal(tokens, sorted_tokens)


def test_greedy_step_is_argmax_with_model_logprob():
  logits = jnp.asarray(np.random.RandomState(0).randn(16, 50), jnp.float32)
  tokens, logprobs = sample_logits(jax.random.key(0), logits, greedy=True)
  np.testing.assert_array_equal(tokens, np.argmax(logits, -1))
  np.testing.assert_allclose(logprobs, jax.nn.log_softmax(logits).max(-1), atol=1e-6)


# -- invariances ---------------------------------------------------------------------------------


@pytest.mark.devices(4)
def test_dp_tp_mesh_gives_same_outputs_as_one_device(model, sampler, prompts):
  mesh = parallel.make_mesh(jax.devices()[:4], data=2, tp=2)
  sharded = Sampler(model[0], mesh, batch_multiple=8)
  assert sharded.param_shardings["lm_head"].spec == jax.sharding.PartitionSpec(None, "tp")
  sampling = SamplingParams(temperature=1.0, max_new_tokens=R, n=2, seed=5)
  one = sampler.generate(model[1], prompts, sampling)
  params = split_params(model[1])[1]
  params = jax.device_put(params, parallel.param_shardings(params, parallel.logical_axes(model[1]), mesh))
  four = sharded.generate(params, prompts, sampling)  # a params dict already on the mesh
  assert four.response_tokens.shape == (6, R)
  np.testing.assert_array_equal(four.response_tokens, one.response_tokens)
  np.testing.assert_allclose(four.behaviour_logprobs, one.behaviour_logprobs, atol=1e-5, rtol=0)


def test_padded_prompt_continues_like_the_prompt_alone(model, prompts):
  sampler = Sampler(model[0], prompt_buckets=(5, 16))
  sampling = SamplingParams(temperature=1.0, max_new_tokens=R, seed=11)
  alone = sampler.generate(model[1], prompts[:1], sampling)      # 5 tokens, no padding at all
  batched = sampler.generate(model[1], prompts[:2], sampling)    # left-padded to 16 beside 11 tokens
  assert alone.prompt_tokens.shape == (1, 5) and batched.prompt_tokens.shape == (2, 16)
  np.testing.assert_array_equal(batched.response_tokens[0], alone.response_tokens[0])
  np.testing.assert_allclose(batched.behaviour_logprobs[0], alone.behaviour_logprobs[0], atol=1e-5, rtol=0)


def test_stop_tokens_end_rows(model, sampler, prompts):
  greedy = SamplingParams(temperature=0, max_new_tokens=R)
  free = np.asarray(sampler.generate(model[1], prompts, greedy).response_tokens)
  first_seen = {}
  for k, tok in enumerate(free[0]):
    first_seen.setdefault(int(tok), k)
  stop = max(first_seen, key=first_seen.get)  # row 0's latest first occurrence: stops it at k >= 1
  k0 = first_seen[stop]
  assert 1 <= k0 < R

  stopping = SamplingParams(temperature=0, max_new_tokens=R, stop_token_ids=(stop,))
  batch = sampler.generate(model[1], prompts, stopping)
  tokens, mask = np.asarray(batch.response_tokens), np.asarray(batch.response_mask)
  for row in range(len(prompts)):
    hits = np.nonzero(free[row] == stop)[0]
    length = hits[0] + 1 if len(hits) else R
    assert batch.lengths[row] == length
    assert batch.finish_reason[row] == (FINISH_STOP if len(hits) else FINISH_LENGTH)
    np.testing.assert_array_equal(tokens[row, :length], free[row, :length])  # the stop token included
    np.testing.assert_array_equal(tokens[row, length:], 0)                   # pad after the finish
    np.testing.assert_array_equal(mask[row], np.arange(R) < length)
    np.testing.assert_array_equal(np.asarray(batch.behaviour_logprobs)[row, length:], 0)
  assert batch.lengths[0] == k0 + 1 and batch.finish_reason[0] == FINISH_STOP


def test_decode_loop_exits_when_every_row_has_stopped(model, sampler, prompts):
  greedy = SamplingParams(temperature=0, max_new_tokens=R)
  first = np.asarray(sampler.generate(model[1], prompts, greedy).response_tokens)[:, 0]
  stop_first = SamplingParams(temperature=0, max_new_tokens=R, stop_token_ids=tuple(set(first.tolist())))
  batch = sampler.generate(model[1], prompts, stop_first)
  np.testing.assert_array_equal(batch.lengths, [1, 1, 1])
  np.testing.assert_array_equal(batch.finish_reason, [FINISH_STOP] * 3)
  assert int(sampler.last_decode_steps) == 1  # the loop never ran a step past the first token


def test_reproducible_per_seed_and_seeds_differ(model, sampler, prompts):
  sample = lambda **kw: np.asarray(sampler.generate(
      model[1], prompts, SamplingParams(temperature=1.0, max_new_tokens=R, n=2, seed=3), **kw).response_tokens)
  a, b = sample(), sample()
  np.testing.assert_array_equal(a, b)
  c = sample(rng=jax.random.key(4))
  assert (a != c).mean() > 0.5  # V=68, near-uniform tiny model: most tokens differ
  assert (a[0] != a[1]).any()    # the n samples of one prompt differ too


def test_new_prompts_do_not_recompile(model, sampler):
  gen = lambda prompts, **kw: sampler.generate(model[1], prompts, SamplingParams(max_new_tokens=R, n=2, **kw))
  batch = gen([[5] * 5, [6] * 9], temperature=1.0, seed=0, stop_token_ids=(3,))
  assert batch.response_tokens.shape == (4, R)  # 4 rows computed in a batch of 8
  traces = sampler.num_traces  # prefill and decode for this mode are compiled now
  # other prompts in the same bucket, another prompt count within batch_multiple, other traced values
  gen([[7] * 3, [8] * 12, [9] * 16], temperature=0.6, seed=1, stop_token_ids=(4, 5))
  gen([[1] * 16], temperature=1.3, seed=2)
  assert sampler.num_traces == traces
  gen([[5] * 17], temperature=1.0)  # the next prompt bucket (32): one new prefill and decode
  assert sampler.num_traces == traces + 2
  gen([[5] * 20, [6] * 32], temperature=0.9, seed=3)
  assert sampler.num_traces == traces + 2
