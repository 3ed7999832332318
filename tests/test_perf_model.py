"""The step-time / memory model: stays within 25% of the LlamaRL step times it was fitted to (a
regression guard, not evidence), predicts a measurement it was not fitted to, learns its efficiencies
from a bench_gpu JSON, keeps its memory plans within 80 GB, reports layouts that do not fit, and moves
the right way when inputs change."""

import json

import dataclasses

import pytest

from llamarl_jax.measure import perf_model as pm

# CALIBRATED was chosen by a grid search to reproduce these six published step times, so the two
# tests below only guard that fit against accidental change; they say nothing about predictive power
# (test_predicts_a_trainer_step_it_was_not_fitted_to does).
TOLERANCE = 0.25  # the grid search's acceptance bound


@pytest.fixture(scope="module")
def rows():
  return {(r.size, r.gpus): r for r in pm.compare_with_paper()}


@pytest.mark.parametrize("size,gpus", sorted(pm.PAPER))
def test_regression_guard_fitted_sync_step_stays_within_25_percent(rows, size, gpus):
  r = rows[(size, gpus)]
  assert abs(r.sync_error) <= TOLERANCE, f"{size}: predicted {r.sync.total:.1f} s, paper {r.paper_sync} s"


@pytest.mark.parametrize("size,gpus", sorted(pm.PAPER))
def test_regression_guard_fitted_async_step_stays_within_25_percent(rows, size, gpus):
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


def test_controller_bindings_split_rows_evenly_and_size_the_slot_engine():
  """--this_repo: the slot engine streams (continuous batching), with as many KV slots per replica as
  fit beside its weights; the trainer's microbatches split the padded rows evenly."""
  work = pm.Workload(prompts=64, samples=8, response_mean=512, response_max=1024, packed=False)
  model = pm.LLAMA3["8b"]
  pred = pm.choose_layout(model, 8, work, quantize="bf16", max_pp=1, streaming=True)
  b = pm.controller_bindings(model, pred, work)
  assert b["trainer_fsdp"] * b["trainer_tp"] + b["generator_dp"] * b["generator_tp"] == 8
  rows_per_micro = work.sequences // (b["trainer_fsdp"] * b["microbatches"])
  assert work.sequences % (b["trainer_fsdp"] * b["microbatches"]) == 0
  assert rows_per_micro * work.max_len <= work.microbatch_tokens
  share = work.sequences // b["generator_dp"]
  per_replica = b.get("engine_slots", share * b["generator_dp"]) // b["generator_dp"]  # default: every row
  budget = 80e9 * pm.CALIBRATED.usable_memory
  weights, kv = pm.gen_weight_bytes(model, pred.generator), pm.kv_bytes_per_sequence(model, pred.generator, work)
  assert weights + per_replica * kv <= budget  # the slots fit ...
  assert per_replica == share or weights + (per_replica + 1) * kv > budget  # ... and are all that fit
  # a longer response budget caps the slots below the rows: the bindings then size the engine
  long = dataclasses.replace(work, response_max=32768)
  capped = pm.controller_bindings(model, pm.async_step(model, pred.trainer, pred.generator, long), long)
  slots = capped["engine_slots"] // capped["generator_dp"]
  kv_long = pm.kv_bytes_per_sequence(model, pred.generator, long)
  assert 0 < slots < share and weights + slots * kv_long <= budget < weights + (slots + 1) * kv_long


def test_controller_bindings_refuse_what_this_repo_cannot_run():
  """Pipeline parallelism (LlamaRL's trainer at 405B) has no mesh axis here."""
  model = pm.LLAMA3["8b"]
  pred = pm.async_step(model, pm.TrainerLayout(fsdp=2, pp=2), pm.GeneratorLayout(tp=4), pm.PAPER_WORKLOAD)
  with pytest.raises(ValueError, match=r"fsdp x tp only; got trainer fsdp2xtp1xpp2"):
    pm.controller_bindings(model, pred, pm.PAPER_WORKLOAD)


def test_this_repo_models_the_slot_engine(capsys):
  """`--this_repo` plans with streaming generation (the slot engine: a batch costs its mean response
  length), not one static batch per replica (its longest)."""
  pm.main(["--size", "8b", "--gpus", "8", "--this_repo", "--prompts", "64", "--response_mean", "512",
           "--response_max", "1024"])
  line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("async:"))
  printed = float(line.split("generate ")[1].split(",")[0])
  work = pm.Workload(prompts=64, response_mean=512, response_max=1024, packed=False)
  pred = pm.choose_layout("8b", 8, work, quantize="bf16", max_pp=1, streaming=True)
  slots = pm.kv_slots(pm.LLAMA3["8b"], pred.generator, work, 72e9 - pm.gen_weight_bytes(pm.LLAMA3["8b"], pred.generator))
  stream, static = (pm.generate_seconds(pm.LLAMA3["8b"], pred.generator, work, streaming=s, slots=slots)
                    for s in (True, False))
  assert printed == pytest.approx(stream, abs=0.05) and static > 1.5 * stream


# -- calibration from measurements ------------------------------------------------------------------

H100_PEAK = 989e12
# Measured on one H100 (shared/GPU.md, main at 9b080fc, 2026-11-24): the trainer on Llama-3.2-1B shapes
# at 8 x (256 + 768) rows, 4 microbatches, remat: 19.6% MFU (6 N B (P + R) / step / peak); and at
# 16 x (512 + 1536), same settings: 1364 ms per step.
MEASURED_SMALL_MFU, MEASURED_LARGE_STEP_S = 0.196, 1.364


def bench_json(trainer=None, decode=None, push=None, **env):
  environment = {"device": "NVIDIA H100 80GB HBM3", "device_count": 1, "peak_flops": H100_PEAK,
                 "peak_bandwidth": 3.35e12, "dry_run": False, **env}
  sections = {k: v for k, v in (("trainer", trainer), ("decode", decode), ("weight_push", push)) if v}
  return {"date": "2026-11-24", "environment": environment, "sections": sections}


ONE_B = dataclasses.asdict(pm.LLAMA32_1B)


def trainer_section(B, P, R, step_s):
  n = pm.LLAMA32_1B.matmul_params
  return {"B": B, "P": P, "R": R, "mb": 4, "remat": True, "step_s": step_s, "shape": ONE_B,
          "mfu": 6 * n * B * (P + R) / step_s / H100_PEAK}


def test_predicts_a_trainer_step_it_was_not_fitted_to():
  """Calibrated on the 8 x 1024 measurement alone, the model predicts the 16 x 2048 step (4x the tokens,
  2x the context) that was measured separately. Tolerance 15%: the two runs' own MFUs differ by 8%
  (19.6% vs 18.0%: longer rows, more attention, other kernels), which one constant efficiency cannot
  follow, plus the model's approximate attention and optimizer terms."""
  n = pm.LLAMA32_1B.matmul_params
  small_step = 6 * n * 8 * 1024 / (MEASURED_SMALL_MFU * H100_PEAK)
  eff, hw, _ = pm.calibrate(bench_json(trainer=trainer_section(8, 256, 768, small_step)))
  large = pm.Workload(prompts=16, samples=1, prompt_len=512, response_mean=1536, response_max=1536)
  predicted = pm.train_seconds(pm.LLAMA32_1B, pm.TrainerLayout(), large, hw, eff)
  assert predicted == pytest.approx(MEASURED_LARGE_STEP_S, rel=0.15), predicted
  # and the uncalibrated assumption (50% MFU incl. remat) would have been far too optimistic
  assumed = pm.train_seconds(pm.LLAMA32_1B, pm.TrainerLayout(), large, hw, pm.CALIBRATED)
  assert assumed < 0.7 * MEASURED_LARGE_STEP_S


def test_calibrated_mfu_reproduces_the_measured_step_exactly():
  tr = trainer_section(8, 256, 768, 0.3134)
  eff, hw, notes = pm.calibrate(bench_json(trainer=tr))
  work = pm.Workload(prompts=8, samples=1, prompt_len=256, response_mean=768, response_max=768)
  assert pm.train_seconds(pm.LLAMA32_1B, pm.TrainerLayout(), work, hw, eff) == pytest.approx(0.3134, rel=1e-9)
  assert eff.mfu > tr["mfu"]  # counts the remat recompute (8N per token, not 6N)
  assert any(n.startswith("mfu 0.50 -> ") for n in notes)


def test_decode_fit_recovers_bandwidth_efficiency_and_overhead():
  """Steps made from known values (35% of 3.35 TB/s, 0.4 ms fixed) by the model's own byte count are
  fitted back exactly; the trainer's and the push's values are kept when those sections are absent."""
  shape = pm.ModelShape("1b-untied", layers=16, hidden=2048, heads=32, kv_heads=8, intermediate=8192)
  P, R, hbm, overhead = 128, 64, 0.35, 4e-4
  rows = [{"batch": b, "step_ms": 1e3 * ((shape.matmul_params * 2 + b * (P + R / 2) * shape.kv_bytes_per_token(2))
                                        / (3.35e12 * hbm) + overhead)} for b in (16, 64, 256)]
  decode = {"prompt_len": P, "new_tokens": R, "rows": rows, "shape": dataclasses.asdict(shape)}
  eff, _, notes = pm.calibrate(bench_json(decode=decode))
  assert eff.hbm == pytest.approx(hbm, rel=1e-9) and eff.decode_overhead == pytest.approx(overhead, rel=1e-6)
  assert (eff.mfu, eff.link) == (pm.CALIBRATED.mfu, pm.CALIBRATED.link)
  assert any("mfu 0.50 kept" in n for n in notes)


def test_one_gpu_weight_push_keeps_the_link_efficiency():
  push = {"push_gbps": 900.0, "copy_gbps": 1500.0, "push_s": 1.0, "copy_s": 0.6,
          "layout": "colocated on one device (cast in place)"}
  eff, _, notes = pm.calibrate(bench_json(push=push))
  assert eff.link == pm.CALIBRATED.link and any("nothing crossed a link" in n for n in notes)
  eff, _, _ = pm.calibrate(bench_json(push={**push, "push_gbps": 225.0, "layout": "disjoint devices"}))
  assert eff.link == pytest.approx(225e9 / pm.Hardware().nvlink_bandwidth)


def test_calibrate_refuses_what_is_not_a_gpu_measurement():
  with pytest.raises(ValueError, match="dry_run"):
    pm.calibrate(bench_json(trainer=trainer_section(8, 256, 768, 0.3), dry_run=True))
  with pytest.raises(ValueError, match="not a bench_gpu result"):
    pm.calibrate({"decode": []})


def test_main_calibrate_predicts_the_paper_configurations(tmp_path, capsys):
  n = pm.LLAMA32_1B.matmul_params
  path = tmp_path / "bench_gpu.json"
  path.write_text(json.dumps(bench_json(trainer=trainer_section(8, 256, 768, 6 * n * 8192 / (0.196 * H100_PEAK)))))
  pm.main(["--calibrate", str(path)])
  out = capsys.readouterr().out
  assert "calibrated from" in out and "mfu 0.50 -> 0.2" in out and "| 405b | 1024 |" in out
  # slower training than assumed: every predicted step is longer than the default calibration's
  default = {r.size: r.async_.total for r in pm.compare_with_paper()}
  eff = pm.calibrate(json.loads(path.read_text()))[0]
  assert all(r.async_.total > default[r.size] for r in pm.compare_with_paper(eff=eff))
