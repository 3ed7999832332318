"""The step-time / memory model: reproduces LlamaRL's published step times within 25%, keeps its memory
plans within 80 GB, reports layouts that do not fit, and moves the right way when inputs change."""

import dataclasses

import pytest

from llamarl_jax import perf_model as pm

TOLERANCE = 0.25  # the model is a plan on paper: one constant set for all sizes, assumed workload


@pytest.fixture(scope="module")
def rows():
  return {(r.size, r.gpus): r for r in pm.compare_with_paper()}


@pytest.mark.parametrize("size,gpus", sorted(pm.PAPER))
def test_sync_step_within_25_percent_of_paper(rows, size, gpus):
  r = rows[(size, gpus)]
  assert abs(r.sync_error) <= TOLERANCE, f"{size}: predicted {r.sync.total:.1f} s, paper {r.paper_sync} s"


@pytest.mark.parametrize("size,gpus", sorted(pm.PAPER))
def test_async_step_within_25_percent_of_paper(rows, size, gpus):
  r = rows[(size, gpus)]
  assert abs(r.async_error) <= TOLERANCE, f"{size}: predicted {r.async_.total:.1f} s, paper {r.paper_async} s"


def test_speedup_grows_with_model_size(rows):
  """The paper's headline: 2.5x (8B) < 4.0x (70B) < 10.7x (405B)."""
  speedups = [rows[k].sync.total / rows[k].async_.total for k in (("8b", 256), ("70b", 256), ("405b", 1024))]
  assert speedups == sorted(speedups) and speedups[-1] > 8


def test_weight_sync_of_405b_under_two_seconds(rows):
  assert rows[("405b", 1024)].async_.weight_sync < pm.PAPER_MAX_SYNC_SECONDS


def test_llama3_parameter_counts():
  billions = {k: m.params / 1e9 for k, m in pm.LLAMA3.items()}
  assert billions == pytest.approx({"8b": 8.03, "70b": 70.55, "405b": 405.85}, abs=0.01)


def test_qwen_parameter_counts_match_the_model_and_the_releases():
  """Qwen's released sizes (1.54B, 7.62B, 1.72B, 8.19B with embeddings), and the same count as our
  ModelConfig of that shape: q/k/v biases (Qwen2), q/k norms and head_dim 128 (Qwen3), tied tables."""
  from llamarl_jax.model import ModelConfig

  billions = {k: m.params / 1e9 for k, m in pm.QWEN.items()}
  assert billions == pytest.approx({"qwen2.5-1.5b": 1.544, "qwen2.5-7b": 7.616, "qwen3-1.7b": 1.721,
                                    "qwen3-8b": 8.191}, abs=0.001)
  for m in pm.QWEN.values():
    config = ModelConfig(vocab_size=m.vocab, hidden_size=m.hidden, intermediate_size=m.intermediate,
                         num_layers=m.layers, num_heads=m.heads, num_kv_heads=m.kv_heads, head_dim=m.head_dim,
                         tie_word_embeddings=m.tied, model_type="qwen3" if m.qk_norm else "qwen2")
    assert config.num_params() == m.params
  # Qwen3-0.6B's heads x head_dim (16 x 128) is twice its hidden size (1024): attention work and KV
  # cache follow the heads, not the hidden size
  q06 = pm.ModelShape("qwen3-0.6b", layers=28, hidden=1024, heads=16, kv_heads=8, intermediate=3072, vocab=151936,
                      head_dim=128, tied=True, qk_norm=True)
  narrow = dataclasses.replace(q06, head_dim=64)
  assert q06.attention_flops_per_token(1000) == 2 * narrow.attention_flops_per_token(1000)
  assert q06.kv_bytes_per_token() == 2 * narrow.kv_bytes_per_token()
  assert q06.params / 1e9 == pytest.approx(0.596, abs=0.001)  # the released 0.6B
  assert q06.matmul_params == q06.params  # the tied table is also the output projection


@pytest.mark.parametrize("size,gpus", sorted(pm.PAPER))
def test_chosen_layouts_fit_80_gb(rows, size, gpus):
  r = rows[(size, gpus)]
  for plan in r.sync.memory + r.async_.memory:
    assert plan.check().total <= 80e9 * pm.CALIBRATED.usable_memory, str(plan)
  assert r.async_.trainer.gpus + r.async_.generator.gpus == gpus  # disjoint meshes, every GPU used
  assert r.sync.trainer.gpus == r.sync.generator.gpus == gpus  # colocated: both on all GPUs


def test_405b_trainer_on_8_gpus_does_not_fit_and_says_so():
  plan = pm.trainer_memory(pm.LLAMA3["405b"], pm.TrainerLayout(fsdp=8), pm.PAPER_WORKLOAD)
  assert not plan.fits and plan.total > 16 * 405e9 / 8  # fp32 params + grads + Adam alone: 812 GB per GPU
  assert "DOES NOT FIT" in str(plan)
  with pytest.raises(ValueError, match=r"trainer fsdp8xtp1 \(8 GPUs\) needs \d+\.\d GB per GPU"):
    plan.check()
  with pytest.raises(ValueError, match="no asynchronous layout of llama3-405b on 8 GPUs fits"):
    pm.choose_layout("405b", 8)


def test_generator_kv_cache_is_capped_by_memory_left():
  """405B fp8 on one node: the weights take 50.7 GB of 72, so only some of the 1024 rows decode at once."""
  model, gen = pm.LLAMA3["405b"], pm.GeneratorLayout(tp=8, replicas=1, dtype="fp8")
  plan = pm.generator_memory(model, gen, pm.PAPER_WORKLOAD)
  assert plan.fits and 0 < plan.kv_cache < plan.budget - plan.gen_weights
  assert not pm.generator_memory(model, gen, pm.PAPER_WORKLOAD, whole_share=True).fits


@pytest.mark.parametrize("mode,size,gpus", [("async", "8b", [32, 64, 128, 256, 512]),
                                            ("async", "70b", [64, 128, 256, 512]),
                                            ("async", "405b", [256, 512, 1024]),
                                            ("sync", "70b", [64, 128, 256, 512, 1024])])
def test_more_gpus_is_never_slower(mode, size, gpus):
  totals = [pm.choose_layout(size, g, mode=mode).total for g in gpus]
  assert all(b <= a for a, b in zip(totals, totals[1:])), totals


@pytest.mark.parametrize("streaming", [True, False])
def test_longer_responses_generate_slower(streaming):
  model, gen = pm.LLAMA3["70b"], pm.GeneratorLayout(tp=8, replicas=8)
  times = []
  for mean, longest in [(256, 1024), (512, 2048), (1024, 4096), (2048, 8192)]:
    work = dataclasses.replace(pm.PAPER_WORKLOAD, response_mean=mean, response_max=longest)
    free = pm.generator_memory(model, gen, work).budget - pm.gen_weight_bytes(model, gen)
    times.append(pm.generate_seconds(model, gen, work, streaming=streaming,
                                     slots=pm.kv_slots(model, gen, work, free)))
  assert all(b > a for a, b in zip(times, times[1:])), times


def test_sync_generation_is_bound_by_the_longest_response():
  """Same mean, longer tail: the static batch pays it, the streaming generator does not."""
  model, gen = pm.LLAMA3["8b"], pm.GeneratorLayout(tp=8, replicas=16)
  short, long = (dataclasses.replace(pm.PAPER_WORKLOAD, response_max=m) for m in (2048, 8192))
  static = [pm.generate_seconds(model, gen, w, streaming=False, slots=64) for w in (short, long)]
  stream = [pm.generate_seconds(model, gen, w, streaming=True, slots=64) for w in (short, long)]
  assert static[1] > 3.5 * static[0]
  assert stream[1] == pytest.approx(stream[0])


def test_fp8_weights_halve_the_weight_sync():
  model, trainer = pm.LLAMA3["70b"], pm.TrainerLayout(fsdp=128)
  bf16, fp8 = (pm.weight_sync_seconds(model, trainer, pm.GeneratorLayout(tp=8, replicas=16, dtype=d))
               for d in ("bf16", "fp8"))
  assert fp8 == pytest.approx(bf16 / 2, rel=0.01)


def test_controller_bindings_split_rows_evenly():
  work = pm.Workload(prompts=64, samples=8, response_mean=512, response_max=1024, packed=False)
  pred = pm.choose_layout("8b", 8, work, quantize="bf16", max_pp=1, streaming=False)
  b = pm.controller_bindings(pm.LLAMA3["8b"], pred, work)
  assert b["trainer_fsdp"] * b["trainer_tp"] + b["generator_dp"] * b["generator_tp"] == 8
  rows_per_micro = work.sequences // (b["trainer_fsdp"] * b["microbatches"])
  assert work.sequences % (b["trainer_fsdp"] * b["microbatches"]) == 0
  assert rows_per_micro * work.max_len <= work.microbatch_tokens


def test_main_prints_the_table(capsys):
  pm.main([])
  out = capsys.readouterr().out
  assert "| 405b | 1024 |" in out and "(635.8)" in out and "DOES NOT FIT" not in out


def test_controller_bindings_refuse_what_this_repo_cannot_run():
  """LlamaRL's layout for 8B on one node streams a KV-capped batch; this repo's Sampler would hold the
  replica's whole share (1024 rows x 4608 tokens of KV cache) at once, which does not fit."""
  pred = pm.choose_layout("8b", 8, max_pp=1)
  assert pred.fits
  with pytest.raises(ValueError, match=r"generator .* needs \d+\.\d GB per GPU"):
    pm.controller_bindings(pm.LLAMA3["8b"], pred, pm.PAPER_WORKLOAD)
