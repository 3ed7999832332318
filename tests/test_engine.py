"""The slot engine: exact against transformers and the static sampler whatever chunk a prompt enters
at, exact behaviour log-probs on both sides of an in-flight weight swap, version-gated admission,
bounded compilation, honest utilization metrics.

Reuses test_sampler's reference helpers (full-forward logits, the intended sampling distribution)
and its tiny fp32 transformers Llama (vocab 68). Two engines serve the module (compilation is the
slow part): a greedy one with 3 slots , 2-step chunks and two prompt buckets, and a sampling one (temperature 0.7,
top-k 10, top-p 0.9, n=2) with 4 slots. Both use KV blocks of 4 positions, so prompts span several
blocks, end mid-block or on a boundary, and responses cross blocks. Log-prob tolerance 1e-4 as in
test_sampler: fp32 end to end, the engine's cached decode and a full forward differ only in
summation order (~1e-6).
"""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from llamarl_jax import parallel
from llamarl_jax.generation import FINISH_LENGTH, Sampler, SamplingParams
from llamarl_jax.generation.engine import SlotEngine, rollout_from_groups
from llamarl_jax.model import KVCache, merge_params, split_params
# the reference model and its loaded copy are test_sampler's (same tiny Llama, module-scoped here too)
from test_sampler import R, V, full_forward_logits, hf_model, intended_logprobs, model  # noqa: F401

PROMPT_LENGTHS = (5, 11, 3, 7)
GREEDY = SamplingParams(temperature=0, max_new_tokens=R)
SAMPLED = SamplingParams(temperature=0.7, top_k=10, top_p=0.9, max_new_tokens=R, n=2, seed=3,
                         stop_token_ids=(7, 21, 40))


@pytest.fixture(scope="module")
def model_b(model):
  """Version 1: the weights perturbed by 20% multiplicative noise (clearly different next-token logits)."""
  graphdef, params = split_params(model[1])
  rng = np.random.RandomState(1)  # numpy noise: no PRNG program to compile
  noisy = lambda x: jnp.asarray(np.asarray(x) * (1 + 0.2 * rng.randn(*x.shape)), x.dtype)
  return merge_params(graphdef, jax.tree.map(noisy, params))


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.RandomState(0)
  return [rng.randint(3, V, n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def static_sampler(model):
  return Sampler(model[0], batch_multiple=8)


@pytest.fixture(scope="module")
def greedy_engine(model):
  return SlotEngine(model[0], lanes=3, sampling=GREEDY, max_prompt_len=16, chunk_steps=2, prompt_buckets=(8, 16),
                    kv_block_size=4)


@pytest.fixture(scope="module")
def sampling_engine(model):
  return SlotEngine(model[0], lanes=4, sampling=SAMPLED, max_prompt_len=16, chunk_steps=3, max_insert=2,
                    kv_block_size=4)


def hf_greedy(ref, prompts):
  T = max(len(p) for p in prompts)
  ids = np.zeros((len(prompts), T), np.int64)
  mask = np.zeros_like(ids)
  for i, p in enumerate(prompts):
    ids[i, T - len(p):], mask[i, T - len(p):] = p, 1
  ref.generation_config.eos_token_id = None
  with torch.no_grad():
    out = ref.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False, max_new_tokens=R,
                       pad_token_id=0)
  return out[:, T:].numpy()


def token_logprobs(logits, tokens, sampling):
  lp = intended_logprobs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
  return np.take_along_axis(lp, np.asarray(tokens)[..., None], -1)[..., 0]


# -- exactness -----------------------------------------------------------------------------------


def test_greedy_matches_transformers_for_prompts_entering_at_different_chunks(hf_model, model, greedy_engine,
                                                                               prompts):
  """p0 enters at boundary 0, p1 at 1, p2 at 2 (beside running sequences, another prompt bucket),
  p3 waits in the queue until p0 finishes and then reuses p0's slot (stale KV of a longer sequence)."""
  eng = greedy_engine
  eng.swap(model[1], 0)
  groups = []
  for i in range(3):
    eng.submit([prompts[i]], tags=[i])
    groups += eng.step()
    assert eng.num_busy == i + 1
  eng.submit([prompts[3]], tags=[3])
  assert eng.queue_depth == 1 and eng.num_free == 0
  groups += eng.run()
  assert sorted(g.tag for g in groups) == [0, 1, 2, 3]
  stats_inserts = 4  # one insert call per prompt: each entered alone at its own chunk boundary
  assert eng.take_metrics()["generate/prefill_calls"] == stats_inserts

  expected = hf_greedy(hf_model[0], prompts)
  for g in groups:
    np.testing.assert_array_equal(g.tokens[0], expected[g.tag])
    assert g.lengths[0] == R and g.finish[0] == FINISH_LENGTH


def test_matches_static_sampler_with_sampling(model, static_sampler, sampling_engine, prompts):
  """Same seed, same rows: the engine samples the static sampler's tokens with its log-probs, though
  4 slots hold only 2 of the 4 prompt groups (n=2) at a time."""
  static = static_sampler.generate(model[1], prompts, SAMPLED, policy_version=2)
  batch = sampling_engine.generate(model[1], prompts, SAMPLED, policy_version=2)
  assert batch.prompt_tokens.shape == static.prompt_tokens.shape == (8, 16)
  for name in ("prompt_tokens", "prompt_mask", "response_tokens", "response_mask", "lengths", "finish_reason",
               "group_ids", "policy_version", "token_versions"):
    np.testing.assert_array_equal(getattr(batch, name), np.asarray(getattr(static, name)), err_msg=name)
  np.testing.assert_allclose(batch.behaviour_logprobs, static.behaviour_logprobs, atol=1e-5, rtol=0)
  np.testing.assert_array_equal(batch.token_versions, 2)


@pytest.mark.parametrize("form", ["pallas", "pallas_fused"])
def test_pallas_attention_samples_what_the_static_sampler_samples(model, static_sampler, prompts, form):
  """The one-kernel paged attention (`paged_attention='pallas'`, read-only, and 'pallas_fused', writing
  the new key and value itself; Pallas interpret mode on the CPU) in the engine: the static sampler's
  tokens and log-probs, with a queue, stops, prefix sharing and blocks of 4 (responses across several
  blocks)."""
  eng = SlotEngine(model[0], lanes=4, sampling=SAMPLED, max_prompt_len=16, chunk_steps=3, max_insert=2,
                   kv_block_size=4, paged_attention=form)
  static = static_sampler.generate(model[1], prompts, SAMPLED, policy_version=0)
  batch = eng.generate(model[1], prompts, SAMPLED)
  for name in ("response_tokens", "lengths", "finish_reason"):
    np.testing.assert_array_equal(getattr(batch, name), np.asarray(getattr(static, name)), err_msg=name)
  np.testing.assert_allclose(batch.behaviour_logprobs, static.behaviour_logprobs, atol=1e-5, rtol=0)
  with pytest.raises(ValueError, match="must be one of"):
    SlotEngine(model[0], lanes=4, sampling=SAMPLED, paged_attention="flash")



@pytest.mark.devices(2)
def test_pallas_attention_refuses_a_sharded_generator_mesh(model):
  """A Pallas call is not partitioned over a mesh (its pools would be gathered whole): refused, named."""
  mesh = parallel.make_mesh(jax.devices()[:2], data=2)
  with pytest.raises(ValueError, match="unsharded"):
    SlotEngine(model[0], mesh, lanes=4, sampling=SAMPLED, paged_attention="pallas")


def _run_with_swap(engine, model, model_b, prompts, recompute):
  """Two prompts (4 rows) start under version 0; after one chunk (tokens 0-3) the engine swaps to 1."""
  engine.swap(model[1], 0)
  engine.submit(prompts[:2], seed=5)
  groups = engine.step()
  engine.swap(model_b, 1, recompute_kv=recompute)
  groups += engine.run()
  assert engine.take_metrics()["generate/swaps_in_flight"] == 1
  groups.sort(key=lambda g: g.tag)
  batch = rollout_from_groups(groups, prompt_width=16)
  mask = batch.response_mask > 0
  pre = mask & (np.arange(R) < 1 + engine.chunk_steps)
  np.testing.assert_array_equal(batch.token_versions[mask], np.where(pre, 0, 1)[mask])
  assert (mask & ~pre).sum() >= 8, "too few tokens after the swap to test"
  np.testing.assert_array_equal(batch.policy_version, 0)  # the oldest token's version
  return batch, pre, mask


def test_behaviour_logprobs_exact_across_a_swap_with_kv_recompute(model, model_b, sampling_engine, prompts):
  """Recompute: every token is the full forward of its own version's weights (the trainer's log-prob)."""
  batch, pre, mask = _run_with_swap(sampling_engine, model, model_b, prompts, recompute=True)
  lp_a = token_logprobs(full_forward_logits(model[1], batch), batch.response_tokens, SAMPLED)
  lp_b = token_logprobs(full_forward_logits(model_b, batch), batch.response_tokens, SAMPLED)
  expected = np.where(pre, lp_a, lp_b)
  np.testing.assert_allclose(batch.behaviour_logprobs[mask], expected[mask], atol=1e-4, rtol=0)
  post = mask & ~pre
  assert np.abs(lp_a[post] - lp_b[post]).max() > 1e-2  # the versions really differ


def test_behaviour_logprobs_exact_across_a_swap_with_kv_kept(model, model_b, sampling_engine, prompts):
  """Kept cache (PipelineRL): pre-swap tokens are version 0's full forward; post-swap tokens are what
  actually sampled them: version 1 on top of the keys/values version 0 wrote for positions before
  the swap — computed independently here by a shared-index cached prefill under version 0 and one
  multi-token forward under version 1. They differ from version 1's full forward (AIPO corrects that)."""
  batch, pre, mask = _run_with_swap(sampling_engine, model, model_b, prompts, recompute=False)
  lp_a = token_logprobs(full_forward_logits(model[1], batch), batch.response_tokens, SAMPLED)
  lp_b = token_logprobs(full_forward_logits(model_b, batch), batch.response_tokens, SAMPLED)
  np.testing.assert_allclose(batch.behaviour_logprobs[pre & mask], lp_a[pre & mask], atol=1e-4, rtol=0)

  t_s = 1 + sampling_engine.chunk_steps  # first post-swap token; tokens[:t_s - 1] were in the cache at the swap
  logits = np.asarray(_kept_kv_reference(model[1], model_b, batch, t_s))
  hybrid = token_logprobs(logits, batch.response_tokens[:, t_s:], SAMPLED)
  post = (mask & ~pre)[:, t_s:]
  np.testing.assert_allclose(batch.behaviour_logprobs[:, t_s:][post], hybrid[post], atol=1e-4, rtol=0)
  assert np.abs(hybrid[post] - lp_b[:, t_s:][post]).max() > 1e-3  # kept KV is not version 1's full forward


@nnx.jit(static_argnums=3)
def _kept_kv_reference(model_a, model_b, batch, t_s):
  """Logits `[B, R - t_s]` for response tokens t_s.. when the weights changed from a to b before token t_s:
  a shared-index cache prefilled under a with prompt + tokens[:t_s - 1], then b over tokens[t_s - 1:R - 1]."""
  W, B = batch.prompt_tokens.shape[1], batch.batch_size
  cache_mask = jnp.concatenate([batch.prompt_mask, jnp.ones((B, R), jnp.int32)], axis=1)
  L = batch.prompt_mask.sum(1)
  seq = jnp.concatenate([batch.prompt_tokens, batch.response_tokens[:, :t_s - 1]], axis=1)
  pos = jnp.concatenate([jnp.maximum(jnp.cumsum(batch.prompt_mask, 1) - 1, 0), L[:, None] + jnp.arange(t_s - 1)], 1)
  _, cache = model_a(seq, positions=pos, cache=KVCache.init(model_a.config, B, W + R), attention_mask=cache_mask)
  logits, _ = model_b(batch.response_tokens[:, t_s - 1:R - 1], positions=L[:, None] + t_s - 1 + jnp.arange(R - t_s),
                      cache=cache, attention_mask=cache_mask)
  return logits


def test_behaviour_logprobs_exact_across_a_swap_to_pushed_lora_weights(model, sampling_engine, prompts):
  """Version 1 is a LoRA push (the adapters moved, merged into the base on the engine's mesh): the
  engine swaps to it in flight, and every post-swap token carries version 1 and the log-prob of the
  merged weights' full forward."""
  from llamarl_jax.config import LoraConfig
  from llamarl_jax.executors.weight_sync import WeightSync, tree_bytes
  from llamarl_jax.model import lora as lora_lib

  lora = LoraConfig(rank=2, alpha=4.0)
  graphdef, base = split_params(model[1])
  mesh = sampling_engine.mesh
  axes = parallel.logical_axes(model[1])
  rng = np.random.RandomState(2)
  adapters = jax.tree.map(lambda x: rng.normal(0, 0.3, x.shape).astype(np.float32),
                          lora_lib.init_adapters(model[0], lora))
  sync = WeightSync(parallel.param_shardings(base, axes, mesh), dtype=jnp.float32,
                    adapter_shardings=parallel.param_shardings(lora_lib.adapter_shapes(model[0], lora),
                                                               lora_lib.adapter_axes(axes, lora), mesh),
                    lora_scale=lora_lib.scale(lora), base=lambda: base)
  assert sync.push(adapters, 1)["sync/bytes"] == tree_bytes(adapters)
  merged = merge_params(graphdef, sync.latest()[0])
  batch, pre, mask = _run_with_swap(sampling_engine, model, merged, prompts, recompute=True)
  lp_base = token_logprobs(full_forward_logits(model[1], batch), batch.response_tokens, SAMPLED)
  lp_lora = token_logprobs(full_forward_logits(merged, batch), batch.response_tokens, SAMPLED)
  np.testing.assert_allclose(batch.behaviour_logprobs[mask], np.where(pre, lp_base, lp_lora)[mask], atol=1e-4, rtol=0)
  post = mask & ~pre
  assert np.abs(lp_base[post] - lp_lora[post]).max() > 1e-2  # the adapters really change the policy


# -- scheduling ----------------------------------------------------------------------------------


def test_version_gated_admission_waits_for_the_swap(model, model_b, static_sampler, sampling_engine, prompts):
  """Prompts submitted for version 1 are not admitted under version 0, and the engine asks for
  version 1 exactly when their admission is due (slots free), never earlier."""
  eng = sampling_engine
  eng.swap(model[1], 0)
  eng.submit(prompts[:2], seed=1, version=0, tags=["a0", "a1"])
  eng.submit(prompts[2:], seed=2, version=1, tags=["b0", "b1"])
  done = eng.step()  # admits the version-0 prompts (2 groups x n=2 fill the 4 slots)
  while eng.wanted_version is None:
    assert eng.queue_depth == 2  # the version-1 prompts wait
    done += eng.step()
  assert eng.wanted_version == 1 and eng.num_free >= 2
  waited = []
  done += eng.run(on_wait=lambda v: (waited.append(v), eng.swap(model_b, v)))
  assert waited == [1]
  by_tag = {g.tag: g for g in done}
  assert set(by_tag) == {"a0", "a1", "b0", "b1"}
  for tag, version in [("a0", 0), ("a1", 0), ("b0", 1), ("b1", 1)]:
    assert (by_tag[tag].versions == version).all(), tag
  # the version-1 groups are exactly what a static sampler with version-1 weights samples for them
  static = static_sampler.generate(model_b, prompts[2:], dataclasses.replace(SAMPLED, seed=2))
  np.testing.assert_array_equal(np.concatenate([by_tag["b0"].tokens, by_tag["b1"].tokens]), static.response_tokens)


def test_utilization_metrics_count_real_tokens(model, greedy_engine, prompts):
  """3 prompts in 3 slots, greedy, no stop: R-1 decode steps, each producing 3 real tokens."""
  greedy_engine.take_metrics()
  batch = greedy_engine.generate(model[1], prompts[:3], GREEDY)
  m = greedy_engine.take_metrics()
  assert m["generate/decode_steps"] == R - 1
  assert m["generate/tokens_per_decode_step"] == 3 and m["generate/slot_utilization"] == 1.0
  assert batch.lengths.sum() == 3 + m["generate/decode_steps"] * m["generate/tokens_per_decode_step"]


def test_utilization_with_a_queue_and_stops(model, sampling_engine, prompts):
  """Every useful slot-step is one sampled token beyond each sequence's first (prefill) token."""
  sampling_engine.take_metrics()
  batch = sampling_engine.generate(model[1], prompts * 2, SAMPLED)
  m = sampling_engine.take_metrics()
  assert batch.lengths.min() < R, "no sequence stopped early: pick other stop ids"
  useful = batch.lengths.sum() - batch.batch_size
  assert m["generate/tokens_per_decode_step"] * m["generate/decode_steps"] == pytest.approx(useful)
  assert m["generate/slot_occupancy"] == pytest.approx(useful / (4 * m["generate/decode_steps"]))
  computed = m["generate/decode_width_mean"] * m["generate/decode_steps"]  # rows the chunks computed
  assert m["generate/slot_utilization"] == pytest.approx(useful / computed)
  assert 0.5 < m["generate/slot_occupancy"] <= m["generate/slot_utilization"] <= 1.0


STOP_OFTEN = dataclasses.replace(SAMPLED, n=1, stop_token_ids=tuple(range(10, 30)))  # 20 of 68 tokens stop


def _samples_as_static(eng, static_sampler, model, prompts, sampling):
  """Generate with the engine and the static sampler: the same tokens, lengths and behaviour log-probs
  (fp32, 1e-5); returns the static batch and the engine's metrics of that generation."""
  ref = static_sampler.generate(model[1], prompts, sampling)
  eng.take_metrics()
  got = eng.generate(model[1], prompts, sampling)
  m = eng.take_metrics()
  np.testing.assert_array_equal(got.response_tokens, ref.response_tokens)
  np.testing.assert_array_equal(got.lengths, ref.lengths)
  np.testing.assert_allclose(got.behaviour_logprobs, ref.behaviour_logprobs, atol=1e-5)
  return ref, m


@pytest.mark.slow
def test_the_batch_shrinks_to_the_busy_slots_and_samples_the_same(model, static_sampler, prompts):
  """4 slots (decode widths 4, 1), 8 prompts, up to 16 tokens, 15 of the 68 tokens stop: once one row
  is busy, chunks compute only their rows (gathered, decoded, scattered back; each row
  writes its own slot's blocks), and the samples and behaviour log-probs are the static sampler's.
  Utilization counts the rows computed; occupancy every slot."""
  sampling = dataclasses.replace(STOP_OFTEN, max_new_tokens=16, stop_token_ids=tuple(range(10, 25)))
  eng = SlotEngine(model[0], lanes=4, sampling=sampling, max_prompt_len=16, chunk_steps=2, kv_block_size=4)
  assert eng.programs.widths == (4, 1)
  ref, m = _samples_as_static(eng, static_sampler, model, prompts * 2, sampling)
  assert m["generate/decode_width_mean"] < 4, f"the batch never shrank: lengths {ref.lengths}"
  useful = ref.lengths.sum() - ref.batch_size
  steps = m["generate/decode_steps"]
  assert m["generate/tokens_per_decode_step"] * steps == pytest.approx(useful)
  assert m["generate/slot_occupancy"] == pytest.approx(useful / (4 * steps))
  assert m["generate/slot_utilization"] == pytest.approx(useful / (m["generate/decode_width_mean"] * steps))
  assert m["generate/decode_width_mean"] < 4 and m["generate/slot_utilization"] > m["generate/slot_occupancy"]
  assert m["generate/slot_utilization"] <= 1.0


def _ideal_steps(lengths, lanes):
  """Decode steps of a scheduler that refills a freed lane at the very next step, FIFO (a response of
  l tokens holds a lane for l - 1 steps: its first token comes from the prefill)."""
  need, left, head, steps = [max(int(l) - 1, 0) for l in lengths], [0] * lanes, 0, 0
  while head < len(need) or any(left):
    for i in range(lanes):
      while left[i] == 0 and head < len(need):
        left[i], head = need[head], head + 1
    if any(left):
      steps += 1
      left = [max(x - 1, 0) for x in left]
  return steps


@pytest.mark.slow
def test_staged_slots_refill_lanes_on_device_at_the_next_step(model, static_sampler, prompts):
  """2 lanes + 6 staged slots, 8 prompts (20 of the 68 tokens stop): every prompt is prefilled at once
  and the decode chunks admit staged slots into lanes as lanes free, on device: the decode steps are
  exactly an ideal scheduler's (a freed lane refilled at the very next step, FIFO), whatever the
  chunks (3 steps, 2 in flight) and the host's harvests; the samples and log-probs are the static
  sampler's; a step never computes more than the 2 lanes."""
  sampling = STOP_OFTEN
  eng = SlotEngine(model[0], lanes=2, staged_slots=6, sampling=sampling, max_prompt_len=16, chunk_steps=3,
                   kv_block_size=4)
  assert eng.num_slots == 8 and eng.programs.num_lanes == 2 and eng.programs.widths == (2, 1)
  ref, m = _samples_as_static(eng, static_sampler, model, prompts * 2, sampling)
  assert len(set(ref.lengths.tolist())) > 2, f"lengths too alike to test the schedule: {ref.lengths}"
  assert m["generate/prefill_calls"] == 1  # all 8 prompts staged at once
  assert m["generate/decode_steps"] == _ideal_steps(ref.lengths, 2), (ref.lengths, m)
  assert m["generate/decode_width_mean"] <= 2
  # no chunk ended early for a refill: ceil(steps / 3) chunks, plus the one dispatched while the last
  # ran (0 steps); the same engine without a stage needs a chunk per refill (14 here: the host inserts)
  assert m["generate/chunks"] <= -(-m["generate/decode_steps"] // 3) + eng.chunks_in_flight - 1, m
  useful = ref.lengths.sum() - ref.batch_size
  assert m["generate/slot_occupancy"] == pytest.approx(useful / (2 * m["generate/decode_steps"]))


_EXIT_SCRIPT = """
from llamarl_jax.generation import SamplingParams
from llamarl_jax.generation.engine import SlotEngine
from llamarl_jax.model import ModelConfig, init_model
config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                     head_dim=16, max_position_embeddings=64)
engine = SlotEngine(config, lanes=2, sampling=SamplingParams(temperature=0, max_new_tokens=4), max_prompt_len=8)
print(engine.generate(init_model(config), [[1, 2, 3]]).lengths.tolist())
"""  # the engine (and its watcher thread) still alive when the interpreter exits


def test_a_process_exits_cleanly_with_an_engine_alive():
  """The engine's watcher thread is stopped and joined at interpreter exit (weakref.finalize's atexit
  hook): left running, finalization killed it mid-call, an abort with status 134."""
  import subprocess
  import sys

  done = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT], capture_output=True, text=True, timeout=240,
                        env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.strip().endswith("[4]")


def test_decode_widths():
  from llamarl_jax.generation.program_set import decode_widths
  assert decode_widths(64) == (64, 16, 4)  # quarters, down to 64 / 16
  assert decode_widths(16) == (16, 4, 1)
  assert decode_widths(256) == (256, 64, 16)  # at most three widths by default
  assert decode_widths(64, divisor=8) == (64, 16)  # rows stay a multiple of the data shards
  assert decode_widths(64, min_width=64) == (64,)  # never shrink
  assert decode_widths(12, min_width=1) == (12, 3, 1)
  assert decode_widths(8) == (8, 2, 1)
  assert decode_widths(3) == (3, 1)
  with pytest.raises(ValueError, match="min_decode_width"):
    decode_widths(8, min_width=0)


def test_the_program_set_is_compiled_at_construction_and_serves_every_workload(model, greedy_engine):
  """The engine's programs are fixed by its configuration and compiled when it is built: insert per
  prompt bucket (8, 16) with a fixed group count, decode per width (3 slots, then 1) and entry count
  (3 slots of <= 4 prompt + 2 response blocks of 4 positions: 18 entries, and a quarter of it at the
  full width for the XLA forms; 1 slot: 6). New prompts, lengths, groups and swaps compile nothing."""
  eng = greedy_engine
  keys = eng.programs.program_keys()
  assert keys == [("insert", 8, 3), ("insert", 16, 3), ("decode", 3, 5), ("decode", 3, 18), ("decode", 1, 6)]
  assert eng.programs.num_compiled == len(keys) and set(eng.programs.traced) >= set(keys)
  traces = eng.num_traces

  eng.generate(model[1], [[5] * 4], GREEDY)
  eng.generate(model[1], [[7] * 12, [5] * 3, [6] * 13], GREEDY)
  eng.swap(model[1], 1)
  eng.submit([[1] * 3])
  eng.step()
  eng.submit([[2] * 9, [8] * 2, [9] * 16])  # enter beside a running sequence
  eng.run()
  assert eng.num_traces == traces
  assert max(eng.programs.traced.values()) == 1  # no program traced twice
  with pytest.raises(ValueError, match="max_prompt_len=16"):
    eng.submit([[1] * 17])


def test_a_second_engine_of_the_same_configuration_reuses_the_programs(model, greedy_engine):
  """Programs belong to the configuration, not the engine: a second engine (another seed is the same
  configuration) compiles nothing and samples the same; another configuration gets its own."""
  first = greedy_engine
  again = SlotEngine(model[0], lanes=3, sampling=dataclasses.replace(GREEDY, seed=9), max_prompt_len=16,
                     chunk_steps=2, prompt_buckets=(8, 16), kv_block_size=4)
  assert again.programs is first.programs and again.warmup_s < 1.0
  prompts = [[3, 4, 5], [6] * 10]
  np.testing.assert_array_equal(again.generate(model[1], prompts).response_tokens,
                                first.generate(model[1], prompts).response_tokens)
  other = SlotEngine(model[0], lanes=3, sampling=GREEDY, max_prompt_len=16, chunk_steps=3,
                     prompt_buckets=(8, 16), kv_block_size=4)
  assert other.programs is not first.programs


@pytest.mark.slow
@pytest.mark.parametrize("prompt_len, R", [(128, 512), (1024, 4096)])
def test_program_count_is_bounded_at_real_shapes(model, prompt_len, R):
  """64 slots, n = 8 samples per prompt (groups of 1 too: a multi-turn episode's next turn), prompts
  up to `prompt_len`, responses up to R: at most 8 programs, all compiled when the engine is built,
  and nothing compiles over 9 drained batches of mixed prompt lengths and group sizes, long-tail
  response lengths (stop tokens) and in-flight swaps with and without the KV
  recompute. (A tiny model at real slot, prompt and response shapes: the program set depends on
  shapes, not on the model's size.)"""
  sampling = SamplingParams(temperature=1.0, max_new_tokens=R, n=8, seed=1, stop_token_ids=tuple(range(10, 40)))
  eng = SlotEngine(model[0], lanes=64, sampling=sampling, max_prompt_len=prompt_len, chunk_steps=8,
                   recompute_kv=False, progress=False)
  keys = eng.programs.program_keys()
  assert len(keys) <= 8, keys
  assert eng.programs.num_compiled == len(keys)
  traces = eng.num_traces
  rng = np.random.default_rng(0)
  version = 0
  eng.swap(model[1], version)
  for batch in range(9):
    n = 8 if batch % 2 == 0 else 1
    lengths = rng.integers(1, prompt_len + 1, size=12 if n == 1 else 6)
    lengths[0] = prompt_len if batch == 3 else lengths[0]
    prompts = [rng.integers(40, 68, size=int(L)).tolist() for L in lengths]
    eng.submit(prompts, seed=batch, n=n)
    if batch % 3 == 1:  # an in-flight swap, recomputing the KV cache every other time
      eng.step()
      version += 1
      # (the recompute's dense forward over 64 x (1024 + 4096) positions takes 54 GB: not at that size)
      eng.swap(model[1], version, recompute_kv=batch % 2 == 1 and prompt_len + R <= 1024)
    done = eng.run()
    assert len(done) == len(prompts)
  recompute = 1 if ("recompute",) in eng.programs.traced else 0  # a swap that recomputes: compiled at its first use
  assert eng.num_traces == traces + recompute
  assert eng.programs.num_compiled <= 8 + recompute


def test_a_groups_samples_share_its_prompt_region_until_all_are_harvested(model, sampling_engine, prompts):
  """n=2: the two slots of a prompt group read one prompt region of the KV pool (one prefill, the
  same physical blocks: `paged.live_entries` lists region blocks by the slot's region); groups alive
  at the same time hold different regions, and a region goes to a new group only after every
  sample of its previous group was harvested. 8 groups through 4 slots (2 groups at a time)."""
  eng = sampling_engine
  eng.swap(model[1], 0)
  eng.submit(prompts * 2, seed=4, tags=list(range(8)))
  holder, done, reused = {}, set(), 0  # region -> tag of the group holding it
  while not eng.idle:
    for g in eng.step():
      done.add(g.tag)
    region = np.asarray(eng._state.region)
    live = {}
    for s, owner in enumerate(eng._owner):
      if owner is None:
        continue
      g = owner[0]
      assert region[s] == g.region  # the device's region of the slot is its group's
      assert live.setdefault(g.tag, g.region) == g.region  # the group's samples share it
    assert len(set(live.values())) == len(live)  # live groups hold different regions
    for tag, r in live.items():
      if holder.get(r, tag) != tag:
        assert holder[r] in done, f"region {r} of group {holder[r]} handed to {tag} before it finished"
        reused += 1
      holder[r] = tag
  assert len(done) == 8 and reused >= 4  # 8 groups over 4 regions: regions were reused


def test_kv_pool_is_allocated_once_and_updated_in_place(model, greedy_engine, prompts):
  """One pool per layer of `PageLayout.num_blocks` blocks (3 slots x (4 prompt + 2 response blocks)
  + trash = 19 blocks of 4 positions), donated to every insert and decode: the old buffers are
  deleted, the new ones have the same shapes."""
  eng = greedy_engine
  eng.swap(model[1], 0)
  cfg = model[0]
  first = eng._cache.k[0]
  assert first.shape == (19, 4, cfg.num_kv_heads, cfg.head_dim) and eng.programs.layout.num_blocks == 19
  eng.submit([prompts[0]])
  eng.step()
  assert first.is_deleted()
  eng.run()
  assert [k.shape for k in eng._cache.k] == [first.shape] * cfg.num_layers
  assert [v.shape for v in eng._cache.v] == [first.shape] * cfg.num_layers


def test_no_recompilation_after_warm_up(model, model_b, sampling_engine, prompts):
  """The same workload twice (queued prompts refilling slots, stops, an in-flight swap with KV
  recompute): the second run traces nothing (every entry bucket, prompt bucket and insert size it
  needs was compiled by the first)."""
  eng = sampling_engine

  def workload():
    eng.swap(model[1], 0)
    eng.submit(prompts * 2, seed=6)
    out = eng.step()
    eng.swap(model_b, 1, recompute_kv=True)
    return out + eng.run()

  first = workload()
  traces = eng.num_traces
  second = workload()
  assert eng.num_traces == traces
  assert [g.tokens.tolist() for g in first] == [g.tokens.tolist() for g in second]


@pytest.mark.devices(4)
def test_sharded_slots_give_the_same_samples(model, sampling_engine, prompts):
  """Slots over data=2, params over tp=2: the same tokens and log-probs as one device."""
  mesh = parallel.make_mesh(jax.devices()[:4], data=2, tp=2)
  sharded = SlotEngine(model[0], mesh, lanes=4, sampling=SAMPLED, max_prompt_len=16, chunk_steps=3, max_insert=2,
                       kv_block_size=4)
  one = sampling_engine.generate(model[1], prompts, SAMPLED)
  four = sharded.generate(model[1], prompts, SAMPLED)
  np.testing.assert_array_equal(four.response_tokens, one.response_tokens)
  np.testing.assert_allclose(four.behaviour_logprobs, one.behaviour_logprobs, atol=1e-5, rtol=0)


@pytest.mark.devices(2)
def test_slots_must_divide_over_the_data_axes(model):
  with pytest.raises(ValueError, match="lanes must be a positive multiple"):
    SlotEngine(model[0], parallel.make_mesh(jax.devices()[:2], data=2), lanes=3)


def test_bad_input_errors(model, greedy_engine):
  with pytest.raises(ValueError, match="lanes must be a positive multiple"):
    SlotEngine(model[0], lanes=0)
  with pytest.raises(ValueError, match="samples per prompt need as many slots"):
    SlotEngine(model[0], lanes=2, sampling=SamplingParams(n=4))
  with pytest.raises(ValueError, match="only the seed"):
    greedy_engine.generate(model[1], [[1, 2]], SamplingParams(temperature=0.5, max_new_tokens=R))
  with pytest.raises(RuntimeError, match="no weights"):
    SlotEngine(model[0], lanes=1, sampling=GREEDY).step()


def test_chunks_in_flight_change_when_the_host_sees_results_not_the_samples(model, sampling_engine, prompts):
  """Two (or three) decode chunks in flight: the host harvests chunk k while chunk k+1 runs, and a slot
  refilled after a chunk was dispatched is not harvested from that chunk's older result. 16 sequences
  through 4 slots (queued prompts refilling freed slots, stops): the samples equal the
  one-chunk-at-a-time engine's (the per-row keys do not depend on slot or chunk), the log-probs to
  fp32 rounding."""
  def run(in_flight):
    eng = SlotEngine(model[0], lanes=4, sampling=SAMPLED, max_prompt_len=16, chunk_steps=3, max_insert=2,
                     chunks_in_flight=in_flight)
    eng.swap(model[1], 0)
    eng.submit(prompts * 2, seed=5, tags=list(range(8)))
    done = sorted(eng.run(), key=lambda g: g.tag)
    return done, eng.take_metrics()

  one, _ = run(1)
  assert len(one) == 8 and min(g.lengths.min() for g in one) < R, "no sequence stopped early"
  for in_flight in (2, 3):
    got, m = run(in_flight)
    assert [g.tag for g in got] == list(range(8))
    for a, b in zip(one, got):
      np.testing.assert_array_equal(a.tokens, b.tokens)
      np.testing.assert_array_equal(a.lengths, b.lengths)
      # a row's step may run in a program of another width or entry count (the chunks' timing picks
      # them): the same math, summed in another order by XLA (observed: 1 ulp of a log-prob ~2.2)
      np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-6)
    assert m["time/generate_device_idle"] >= 0 and m["time/generate_host_wait"] >= 0
  with pytest.raises(ValueError, match="chunks_in_flight"):
    SlotEngine(model[0], lanes=4, sampling=SAMPLED, chunks_in_flight=0)


def test_device_idle_counts_the_time_the_host_kept_the_device_waiting(model, prompts):
  """One chunk in flight and a host that sleeps 0.15 s after each harvest: the device finished each
  chunk before the host's sleep, so it idles at least the sleep before every later dispatch
  (the watcher thread times each chunk's end); idle never exceeds the wall time."""
  eng = SlotEngine(model[0], lanes=4, sampling=GREEDY, max_prompt_len=16, chunk_steps=2, chunks_in_flight=1)
  eng.swap(model[1], 0)
  eng.submit(prompts, seed=0)
  eng.step()  # compiles insert and decode
  eng.take_metrics()
  t0, sleeps = time.perf_counter(), 0
  while not eng.idle:
    time.sleep(0.15)
    sleeps += 1
    eng.step()
  wall = time.perf_counter() - t0
  time.sleep(0.05)  # let the watcher time the last chunk
  m = eng.take_metrics()
  dispatches = sleeps - 1  # the last step may harvest without dispatching
  assert dispatches >= 2
  assert 0.15 * (dispatches - 1) <= m["time/generate_device_idle"] <= wall


def test_device_idle_does_not_count_the_time_between_batches(model, prompts):
  """An engine that ran out of work is not idle-waiting on the host: a second generate() 0.3 s after
  the first adds (almost) nothing, where the first gap would have been 0.3 s."""
  eng = SlotEngine(model[0], lanes=4, sampling=GREEDY, max_prompt_len=16, chunk_steps=2)
  eng.generate(model[1], prompts)  # compiles
  eng.take_metrics()
  time.sleep(0.3)
  eng.generate(model[1], prompts)
  time.sleep(0.05)
  assert eng.take_metrics()["time/generate_device_idle"] < 0.25


def _watched_chunk(steps):
  """A dispatched chunk as the watcher thread sees it (`InFlight`'s fields), its result's `steps` given."""
  import threading
  import types

  from llamarl_jax.generation import inflight

  chunk = types.SimpleNamespace(local=types.SimpleNamespace(steps=steps), error=None, done_at=None,
                                done=threading.Event())
  chunk.get = lambda: inflight.InFlight.get(chunk)
  return chunk


def test_a_chunk_that_fails_on_the_device_raises_in_the_thread_driving_the_engine():
  """The watcher blocks on every chunk; when the device reports a failure there, the error is handed
  to the engine's thread: `get` (what `step` harvests with) raises it, after the watcher is done."""
  import queue
  import threading

  from llamarl_jax.generation import inflight

  class Failed:  # a chunk result whose computation failed on the device
    def block_until_ready(self):
      raise RuntimeError("INTERNAL: device lost")

  chunk = _watched_chunk(Failed())
  chunks = queue.SimpleQueue()
  watcher = threading.Thread(target=inflight.watch, args=(chunks,), daemon=True)
  watcher.start()
  chunks.put(chunk)
  with pytest.raises(RuntimeError, match="device lost"):
    chunk.get()
  assert chunk.done.is_set() and isinstance(chunk.error, RuntimeError)
  chunks.put(None)
  watcher.join(5)
  assert not watcher.is_alive()


def test_the_engines_end_waits_for_a_hung_chunk_at_most_watcher_exit_s(monkeypatch, capsys):
  """At the engine's end the watcher is joined for at most WATCHER_EXIT_S: a chunk the device never
  finishes does not hold the process (it is named on stderr); once it does finish, the thread ends."""
  import queue
  import threading

  from llamarl_jax.generation import inflight

  monkeypatch.setattr(inflight, "WATCHER_EXIT_S", 0.3)
  release = threading.Event()

  class Hung:  # a chunk result the device does not finish until released
    def block_until_ready(self):
      release.wait(20)

  chunk = _watched_chunk(Hung())
  chunks = queue.SimpleQueue()
  watcher = threading.Thread(target=inflight.watch, args=(chunks,), daemon=True)
  watcher.start()
  chunks.put(chunk)
  t0 = time.monotonic()
  inflight.stop_watcher(chunks, watcher)
  waited = time.monotonic() - t0
  assert 0.3 <= waited < 2.0 and watcher.is_alive()
  assert "still running on the device 0.3 s after the engine ended" in capsys.readouterr().err
  release.set()
  watcher.join(5)
  assert not watcher.is_alive() and chunk.done.is_set() and chunk.error is None
