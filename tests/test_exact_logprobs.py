"""The `exact_logprobs` switch (`RolloutConfig.exact_logprobs`, `ModelConfig.exact`): at lag 0 the
generator's behaviour log-probs equal the trainer's log-probs of the same tokens bit for bit.

"Equal" is `np.array_equal` on the response tokens' fp32 log-probs. The generator is the static
sampler (left-padded prompts, prefill then decode over a dense KV cache) or the slot engine (prefill,
then decode over a paged pool, 7 slots; 1 and 64 under `slow`); the trainer is `token_logprobs` over
the rows in two orders (right-padded from position 0) and `packed_logprobs` over the rows packed end
to end. Models: tiny random transformers Llama, Qwen3 (q/k norms) and Qwen3-MoE (4 experts, top-2, in
every layer) checkpoints, fp32 and bf16 (the other pairs under `slow`). Without the switch the same comparison differs (the test is not vacuous).
"""

import dataclasses
import functools

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from conftest import tiny_hf_model
from llamarl_jax.config import ConfigError, LoraConfig, run_config
from llamarl_jax.generation import Sampler, SamplingParams
from llamarl_jax.generation.engine import SlotEngine
from llamarl_jax.model import load_hf_checkpoint, split_params
from llamarl_jax.model.attention import Segments
from llamarl_jax.batch import trainer_layout
from llamarl_jax.model.forward import prepare_params
from llamarl_jax.model.llama import abstract_model
from llamarl_jax.model.logprobs import packed_logprobs, token_logprobs
from llamarl_jax.train.layout import pack_rows

TEMPERATURE = 0.8
R = 6
PROMPT_LENGTHS = (5, 11, 3, 7)
SAMPLING = SamplingParams(temperature=TEMPERATURE, max_new_tokens=R, n=2, seed=1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  out = {}
  for family in ("llama", "qwen3", "qwen3_moe"):
    path = tmp_path_factory.mktemp(family)
    tiny_hf_model(family).save_pretrained(path)
    out[family] = load_hf_checkpoint(path)
  return out


def policy(checkpoints, family, dtype, exact=True):
  """(config, graphdef, params) of the family's checkpoint computed in `dtype`, exact ops or not."""
  config, model = checkpoints[family]
  config = config.replace(exact=exact, dtype=dtype, param_dtype=dtype)
  params = jax.tree.map(lambda x: x.astype(dtype), split_params(model)[1])
  return config, split_params(abstract_model(config))[0], params


def prompts():
  rng = np.random.RandomState(0)
  return [rng.randint(3, 67, n).tolist() for n in PROMPT_LENGTHS]


def padded_logprobs(graphdef, params, batch, order):
  """The trainer's log-probs `[B, R]` of `batch`'s responses, its rows run in `order`."""
  take = lambda a: jnp.asarray(np.asarray(a)[order])
  lp = token_logprobs(graphdef, params, take(batch.prompt_tokens), take(batch.prompt_mask),
                      take(batch.response_tokens), take(batch.response_mask), temperature=TEMPERATURE)
  out = np.empty(lp.shape, np.float32)
  out[order] = np.asarray(lp)
  return out


def packed_rows_logprobs(config, params, batch):
  """The trainer's log-probs `[B, R]` with the rows packed end to end in bins of 2 rows' width."""
  tokens, lengths, predict = (np.asarray(a) for a in trainer_layout(
      batch.prompt_tokens, batch.prompt_mask, batch.response_tokens, batch.response_mask))
  B, W = tokens.shape
  T = 2 * W
  plan = pack_rows(lengths, T)
  N = plan.bins
  packed, pos, ids, targets = (np.zeros((N, T), np.int32) for _ in range(4))
  seqlens, offsets = np.full((N, B), -1, np.int32), np.full((N, B + 1), -1, np.int32)
  for b in range(B):
    n, o, k = lengths[b], plan.row_offset[b], plan.row_bin[b]
    packed[k, o:o + n], pos[k, o:o + n], ids[k, o:o + n] = tokens[b, :n], np.arange(n), b + 1
    targets[k, o:o + n - 1] = tokens[b, 1:n]
    seqlens[k, plan.row_slot[b]], offsets[k, plan.row_slot[b]] = n, o
  segments = Segments(jnp.asarray(ids), jnp.asarray(seqlens), jnp.asarray(offsets))
  lp = np.asarray(packed_logprobs(config, prepare_params(params, config.dtype), jnp.asarray(packed), jnp.asarray(pos),
                                  segments, jnp.asarray(targets), temperature=TEMPERATURE))
  return np.stack([lp[plan.row_bin[b], plan.row_offset[b] + predict[b]] for b in range(B)])


def assert_equal_on_responses(behaviour, trainer, batch, what):
  m = np.asarray(batch.response_mask).astype(bool)
  assert m.sum() >= 8
  got, want = np.asarray(behaviour)[m], np.asarray(trainer)[m]
  assert np.array_equal(got, want), f"{what}: max |diff| {np.abs(got - want).max():.3g} over {m.sum()} tokens"


def check_against_trainer(config, graphdef, params, batch):
  B = batch.response_tokens.shape[0]
  order = np.random.default_rng(3).permutation(B)
  assert_equal_on_responses(batch.behaviour_logprobs, padded_logprobs(graphdef, params, batch, np.arange(B)), batch,
                            "padded rows")
  assert_equal_on_responses(batch.behaviour_logprobs, padded_logprobs(graphdef, params, batch, order), batch,
                            "padded rows, permuted")
  assert_equal_on_responses(batch.behaviour_logprobs, packed_rows_logprobs(config, params, batch), batch,
                            "packed rows")


CASES = [("llama", "float32"), ("qwen3", "bfloat16"),
         pytest.param("llama", "bfloat16", marks=pytest.mark.slow), pytest.param("qwen3", "float32", marks=pytest.mark.slow),
         pytest.param("qwen3_moe", "float32", marks=pytest.mark.slow),
         pytest.param("qwen3_moe", "bfloat16", marks=pytest.mark.slow)]


@pytest.mark.parametrize("family,dtype", CASES)
def test_static_sampler_logprobs_equal_the_trainers(checkpoints, family, dtype):
  config, graphdef, params = policy(checkpoints, family, dtype)
  batch = Sampler(config, batch_multiple=8).generate(params, prompts(), SAMPLING)
  check_against_trainer(config, graphdef, params, batch)


@pytest.mark.parametrize("family,dtype,lanes", [
    ("llama", "float32", 7),
    pytest.param("qwen3", "bfloat16", 1, marks=pytest.mark.slow), pytest.param("llama", "float32", 1, marks=pytest.mark.slow),
    pytest.param("qwen3", "bfloat16", 7, marks=pytest.mark.slow),
    pytest.param("llama", "bfloat16", 64, marks=pytest.mark.slow), pytest.param("qwen3", "float32", 64, marks=pytest.mark.slow),
    ("qwen3_moe", "bfloat16", 7), pytest.param("qwen3_moe", "float32", 1, marks=pytest.mark.slow),
    pytest.param("qwen3_moe", "float32", 64, marks=pytest.mark.slow)])
def test_slot_engine_logprobs_equal_the_trainers(checkpoints, family, dtype, lanes):
  config, graphdef, params = policy(checkpoints, family, dtype)
  sampling = SAMPLING if lanes >= SAMPLING.n else dataclasses.replace(SAMPLING, n=1)  # one slot: one sample per prompt
  engine = SlotEngine(config, lanes=lanes, sampling=sampling, max_prompt_len=16, chunk_steps=3, kv_block_size=4)
  check_against_trainer(config, graphdef, params, engine.generate(params, prompts(), sampling))


def test_without_the_switch_the_logprobs_differ(checkpoints):
  # the plain ops: the sampler's decode (one row of GEMV per step, its own softmax sums) and the
  # trainer's full sequence sum in other orders; fp32, so the gap is ~1e-7..1e-6, not 0
  config, graphdef, params = policy(checkpoints, "llama", "float32", exact=False)
  batch = Sampler(config, batch_multiple=8).generate(params, prompts(), SAMPLING)
  m = np.asarray(batch.response_mask).astype(bool)
  gap = np.abs(np.asarray(batch.behaviour_logprobs) - padded_logprobs(graphdef, params, batch, np.arange(8)))[m]
  assert 0 < gap.max() < 1e-4


# -------------------------------------------------------------------------------------------- the run switch


def test_the_switch_is_off_by_default_and_one_flat_key():
  assert run_config().rollout.exact_logprobs is False
  on = run_config(exact_logprobs=True)
  assert on.rollout.exact_logprobs and on.record()["rollout"]["exact_logprobs"] is True
  assert "exact_logprobs" not in run_config().record()["rollout"]  # old checkpoints' records unchanged


@pytest.mark.parametrize("flat,keys", [
    (dict(top_k=10), "RolloutConfig.top_k"), (dict(top_p=0.9), "top_p=0.9"),
    (dict(quantize="fp8"), "GeneratorConfig.quantize"), (dict(generator_tp=2), "generator_tp=2"),
    (dict(lora=LoraConfig()), "TrainConfig.lora")])
def test_incompatible_settings_are_refused_by_name(flat, keys):
  with pytest.raises(ConfigError, match=keys.replace(".", r"\.")):
    run_config(exact_logprobs=True, **flat)
  run_config(**flat)  # each is fine without the switch


def test_another_compute_dtype_is_refused(checkpoints):
  run = run_config(exact_logprobs=True)
  run.check_model(checkpoints["llama"][0])  # fp32 model, fp32 generator
  config = checkpoints["qwen3_moe"][0]
  run.check_model(config)  # a mixture of experts too
  dataclasses.replace(run, train=dataclasses.replace(run.train, routing_replay=True)).check_model(config)
  with pytest.raises(ConfigError, match="compute dtype"):
    run.check_model(config.replace(dtype="bfloat16"))


@pytest.mark.parametrize("family", ["llama", "qwen3", pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_the_trainers_gradient_is_the_default_modes(checkpoints, family):
  """The exact forward's log-probs differentiate as the plain forward's: every parameter's gradient
  of the response tokens' summed log-prob, fp32, equal within 1e-4 of its largest entry (the two
  forwards' values differ by ~1e-7 and the backward runs the plain ops on them)."""
  config, _, params = policy(checkpoints, family, "float32")
  batch = Sampler(config, batch_multiple=8).generate(params, prompts(), SAMPLING)
  grads = {}
  for exact in (False, True):
    config, graphdef, params = policy(checkpoints, family, "float32", exact=exact)
    loss = lambda p: jnp.sum(token_logprobs(graphdef, p, batch.prompt_tokens, batch.prompt_mask, batch.response_tokens,
                                            batch.response_mask, temperature=TEMPERATURE) * batch.response_mask)
    grads[exact] = jax.grad(loss)(params)
  for path, plain in jax.tree_util.tree_leaves_with_path(grads[False]):
    got = np.asarray(functools.reduce(lambda t, k: t[k.key], path, grads[True]))
    scale = float(np.max(np.abs(plain)))
    assert scale > 0, jax.tree_util.keystr(path)
    np.testing.assert_allclose(got, plain, rtol=0, atol=1e-4 * scale, err_msg=jax.tree_util.keystr(path))
