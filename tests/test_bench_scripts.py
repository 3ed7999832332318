"""The benchmark scripts run (tiny settings) and report what their tables claim to."""

import importlib

import pytest

from llamarl_jax.rewards import corpus


def _load(name):
  """scripts/<name>.py as `python -m scripts.<name>` imports it (the repository root is on pytest's path)."""
  return importlib.import_module(f"scripts.{name}")


@pytest.mark.devices(4)
@pytest.mark.slow
def test_bench_async_reports_each_lag_with_its_bound(capsys):
  rows = _load("bench_async").main(["--lags", "0,1", "--delays", "0.2", "--hidden", "32", "--layers", "2",
                                    "--prompts", "4", "--samples", "2", "--max_new_tokens", "4",
                                    "--warmup", "1", "--steps", "3"])
  assert [r["lag"] for r in rows] == [0, 1]
  assert all(r["lag_max"] <= r["lag"] for r in rows)
  sync, lag1 = rows
  assert sync["overlap_s"] < 0.05  # lag 0: generation never runs beside training (timer noise only)
  assert lag1["overlap_s"] > 0.0  # lag 1: the next batch is generated while the trainer trains
  assert "speed-up vs lag 0" in capsys.readouterr().out


def test_bench_verify_reports_per_category_and_false_positives(capsys):
  summary = _load("bench_verify").main(["--limit", "60", "--no_peer", "--repeats", "1"])
  assert set(summary) == set(corpus.CORPORA)  # the suite, the corpus in peers' styles, the held-out corpus
  for name in ("suite", "peers"):  # in-sample: the verifier's rules were written against them
    assert summary[name]["cases"] == 60 and summary[name]["ours"]["false_positives"] == 0
  out = capsys.readouterr().out
  assert "| gsm8k_hash |" in out and "ours accepted" in out and "calls/s" in out


def test_bench_gpu_fails_fast_without_a_gpu():
  """On a CPU-only machine it stops before any work, saying what is missing and what to do."""
  with pytest.raises(SystemExit, match=r"needs a GPU, but JAX's backend is 'cpu'.*\[cuda12\].*--dry_run"):
    _load("bench_gpu").main(["--out", "/nonexistent/never/written"])


@pytest.mark.slow
def test_bench_gpu_dry_run_writes_the_report_and_json(tmp_path):
  """--dry_run on CPU at toy sizes: the sections that run write their numbers to the JSON and the
  markdown; cuDNN is reported as skipped, not silently dropped. (engine, profile and e2e: the tests
  below; decode, transformers and torch_peer call bench_generate's and bench_train's tested functions.)"""
  import json

  results = _load("bench_gpu").main(["--dry_run", "--out", str(tmp_path),
                                     "--sections", "trainer,attention,weight_push,bytes"])
  saved = json.loads((tmp_path / "bench_gpu.json").read_text())
  assert saved["sections"].keys() == {"trainer", "attention", "weight_push", "bytes"} == results["sections"].keys()
  paged = [r for r in saved["sections"]["bytes"]["rows"] if r["layout"] == "paged"]
  assert [(r["kv_block_size"], r["paged_attention"]) for r in paged] == [(16, "auto")]
  assert all(r["bytes"] >= r["weights"] and r["kernel_bytes"] == 0 for r in paged)
  # on the CPU the kernel runs in interpret mode (XLA ops, not its traffic): not counted, saying so
  assert saved["sections"]["bytes"]["not_counted"] == ["KV block 4, pallas: the kernel's bytes are counted compiled for "
                                                   "a GPU only (on cpu it runs in Pallas' interpret mode)"]
  trainer = saved["sections"]["trainer"]
  assert trainer["step_s"] > 0 and 0 < trainer["mfu"] < 1 and trainer["B"] * (trainer["P"] + trainer["R"]) == 256
  attention = {r["implementation"]: r for r in saved["sections"]["attention"]["rows"]}
  assert attention["cudnn, causal + lengths"]["skipped"] == "cuDNN needs a GPU"
  assert attention["xla, causal + lengths"]["ms"] > 0
  push = saved["sections"]["weight_push"]
  assert push["bytes"] == 2 * push["params"]  # fp32 -> bf16: two bytes a parameter cross
  report = (tmp_path / "bench_gpu.md").read_text()
  assert "DRY RUN" in report and "| xla, causal + lengths |" in report and "push GB/s" in report
  assert "- not counted: KV block 4, pallas" in report


@pytest.mark.slow  # a whole run in a fresh interpreter (~1-2 min on 2 cores, mostly compiling)
def test_bench_gpu_e2e_dry_run_reports_a_runs_speed_breakdown_and_plan(tmp_path):
  """The e2e section's CPU path: the one-GPU config at its dry-run size (its first entry) run by
  `scripts/train.py`'s job in a child process; the row has the steps after the first, tokens/s from
  their response lengths, the plan's total and the time breakdown, and the markdown shows them."""
  import json

  bench = _load("bench_gpu")
  bench.DRY["e2e"] = bench.DRY["e2e"][:1]
  bench.main(["--dry_run", "--out", str(tmp_path), "--sections", "e2e"])
  (row,) = json.loads((tmp_path / "bench_gpu.json").read_text())["sections"]["e2e"]["rows"]
  assert row["config"] == "llama3_1b_1gpu.gin" and row["rl_steps"] == 3
  assert row["step_s"] > 0 and row["gen_tokens_per_s"] > 0 and row["peak_memory_gib"] is None  # CPU: no statistics
  assert 0 < row["plan_gib"] < 0.01 and row["eval_before"] is None  # the config evaluates nothing
  assert row["peak_over_plan"] is None  # no measured peak on a CPU: no ratio
  assert abs(row["unaccounted_s"]) <= 0.05 * row["wall_run_s"] and row["breakdown"]["warmup"] > 0
  report = (tmp_path / "bench_gpu.md").read_text()
  assert "peak memory GiB (plan) | peak / plan |" in report
  assert "| llama3_1b_1gpu.gin | 3 |" in report and "- llama3_1b_1gpu.gin seconds: warmup" in report


def test_bench_train_lowers_the_step_and_finds_the_largest_vocab_array(tmp_path, capsys):
  """--lower writes the step's StableHLO and names its largest vocabulary-sized array: with the
  lm_head in chunks of 4 positions that is the tied [100, 128] embedding, unchunked it is the
  [8, 64, 100] logits (8 rows: one per device of the test's 8-device mesh)."""
  bench = _load("bench_train")
  args = ["--sizes", "tiny", "--batch", "8", "--prompt_len", "8", "--resp_len", "64", "--lower", "cpu"]
  chunked = bench.main(args + ["--logprob_chunk", "4", "--dump_hlo", str(tmp_path / "step.mlir")])[0]
  assert chunked["largest_vocab"][0] == 100 * 128  # the embedding, [100, 128] or its transpose
  assert "tensor<8x64x100xf32>" not in (tmp_path / "step.mlir").read_text()
  assert chunked["attention"] == "xla" and "largest vocabulary-sized array" in capsys.readouterr().out
  unchunked = bench.main(args + ["--logprob_chunk", "0"])[0]
  assert unchunked["largest_vocab"] == (8 * 64 * 100, "tensor<8x64x100xf32>")


@pytest.mark.slow
def test_bench_generate_profile_traces_the_timed_calls(tmp_path):
  """--profile DIR: one trace per table (generation, each engine workload), the timed calls named in it."""
  import gzip
  import json

  _load("bench_generate").main(["--sizes", "5m", "--skip_hf", "--batch", "2", "--prompt_len", "8",
                                "--max_new_tokens", "4", "--repeats", "1", "--engine_workloads", "equal",
                                "--slots", "2", "--engine_prompts", "4", "--engine_max_new_tokens", "4",
                                "--chunk_steps", "2", "--profile", str(tmp_path)])
  for run, spans in [("generate_5m", {"ours R=4"}), ("engine_equal", {"static", "slots"})]:
    (trace,) = (tmp_path / run).glob("plugins/profile/*/perfetto_trace.json.gz")
    events = json.load(gzip.open(trace))
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert spans <= {e.get("name") for e in events}, run


def test_bench_generate_bytes_table_from_abstract_shapes(capsys):
  """--bytes: one decode step's bytes (XLA cost analysis, nothing allocated) for the paged and the
  dense layout next to the ideal; with a cache of 512 positions and 40..120 live ones the dense step
  reads more (every cached position) and XLA's as-is count of the paged step includes the fused
  gathers' whole-pool charge that `bytes` removes."""
  rows = _load("bench_generate").main(["--bytes", "--sizes", "5m", "--slots", "8", "--bytes_cache", "512",
                                       "--bytes_prompt", "32", "--bytes_live", "40,120"])
  paged, dense, floor = rows
  assert (paged["layout"], dense["layout"], floor["layout"]) == ("paged", "dense", "floor")
  assert paged["ideal"] == dense["ideal"] and paged["bytes"] < dense["bytes"]
  assert paged["xla_bytes"] > paged["bytes"] and paged["num_entries"] >= 8 * 2  # >= 2 blocks per row
  # the floor (2 live positions per row) moves the weights and less than the paged step
  assert floor["weights"] <= floor["bytes"] < paged["bytes"] and paged["floor_bytes"] == floor["bytes"]
  out = capsys.readouterr().out
  assert "| paged | " in out and "| dense | " in out and "bytes / ideal" in out and "| floor: " in out


def test_bench_generate_bytes_target_without_the_cuda_plugin_names_the_fix():
  """--bytes_target h100 on a machine without JAX's CUDA plugin stops with the install lines."""
  import jax
  if "cuda" in (jax.config.jax_platforms or "") or jax.default_backend() == "gpu":
    pytest.skip("a CUDA backend is configured here")
  with pytest.raises(SystemExit, match="jax-cuda12-plugin"):
    _load("bench_generate").main(["--bytes", "--bytes_target", "h100", "--sizes", "5m", "--slots", "8"])


def test_bench_fp8_step_costs_without_the_cuda_plugin_names_the_fix():
  """--step_costs compiles for an H100: without JAX's CUDA plugin it stops with the install lines."""
  import jax
  if "cuda" in (jax.config.jax_platforms or "") or jax.default_backend() == "gpu":
    pytest.skip("a CUDA backend is configured here")
  with pytest.raises(SystemExit, match="jax-cuda12-plugin"):
    _load("bench_fp8").main(["--step_costs", "5m", "--slots", "8"])


def test_ideal_utilization_refills_every_freed_slot_at_the_next_step():
  """Hand-counted: 2 slots, responses of 5, 2, 2, 2 tokens hold a slot 4, 1, 1, 1 steps: 4 steps,
  7 busy slot-steps of 8 (the last step has one busy slot); prompts waited during steps 1-2 (both
  busy). Equal lengths fill every slot; a lone long row drains alone."""
  ideal = _load("bench_generate").ideal_utilization
  assert ideal([5, 2, 2, 2], 2) == (7 / 8, 1.0)
  assert ideal([9] * 8, 4) == (1.0, 1.0)
  assert ideal([11, 2, 2], 2) == (12 / 20, 1.0)  # 10 steps: busy 2, 2, then 1 x 8; queued at step 1
  # the batch shrinks to one row when one is busy: 2 + 2 + 8 rows computed, all busy
  assert ideal([11, 2, 2], 2, widths=(2, 1)) == (1.0, 1.0)
  assert ideal([5, 2, 2, 2], 2, widths=(2, 1)) == (1.0, 1.0)  # rows 2, 2, 2, 1
  assert ideal([11, 2, 2, 2, 2], 4, widths=(4, 2)) == (14 / 22, 1.0)  # busy 4, 2, then 1 in rows of 2 x 8


def _write_trace(path, events):
  """A profiler trace as `jax.profiler` writes it: gzip'd Chrome-trace JSON under plugins/profile/<run>/."""
  import gzip
  import json

  path.mkdir(parents=True)
  with gzip.open(path / "perfetto_trace.json.gz", "wt") as f:
    json.dump({"displayTimeUnit": "ns", "traceEvents": events}, f)


def test_top_kernels_counts_a_gpu_traces_device_events_only(tmp_path):
  """A GPU trace in the profiler's layout: a host process (whose XLA threads also have events) and a
  device process with a compute stream. Only the device's complete events count; hand-counted: the
  GEMM 3 x 20 us, the attention kernel 2 x 15 us, one norm of 10 us = 100 us in 6 events."""
  meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
          {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "tf_XLAEigen/1"}},
          {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0 (NVIDIA H200)"}},
          {"ph": "M", "pid": 2, "tid": 13, "name": "thread_name", "args": {"name": "Stream #13(Compute)"}}]
  kernel = lambda name, ts, dur: {"ph": "X", "pid": 2, "tid": 13, "ts": ts, "dur": dur, "name": name}
  events = meta + [kernel("gemm_fusion", 0, 20), kernel("paged_attention", 20, 15), kernel("gemm_fusion", 35, 20),
                   kernel("rms_norm_fusion", 55, 10), kernel("paged_attention", 65, 15), kernel("gemm_fusion", 80, 20),
                   {"ph": "X", "pid": 1, "tid": 7, "ts": 0, "dur": 500, "name": "ThunkExecutor::Execute"},
                   {"ph": "i", "pid": 2, "tid": 13, "ts": 5, "name": "marker"}]
  _write_trace(tmp_path / "decode" / "plugins" / "profile" / "run1", events)
  got = _load("bench_gpu").top_kernels(tmp_path / "decode", top=2)
  assert got["source"] == "device" and got["events"] == 6 and got["total_us"] == 100.0
  assert got["top"] == [{"name": "gemm_fusion", "count": 3, "us": 60.0, "share": 0.6},
                        {"name": "paged_attention", "count": 2, "us": 30.0, "share": 0.3}]


def test_top_kernels_of_a_cpu_trace_reads_the_xla_threads_and_a_missing_trace_is_named(tmp_path):
  """Without a device process (a CPU run) the XLA executor threads' events count, other threads' not;
  a directory without a trace is a FileNotFoundError naming it."""
  meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
          {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "tf_XLAEigen/1"}},
          {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "python3"}}]
  events = meta + [{"ph": "X", "pid": 1, "tid": 7, "ts": 0, "dur": 4, "name": "dot_fusion"},
                   {"ph": "X", "pid": 1, "tid": 7, "ts": 4, "dur": 1, "name": "add_fusion"},
                   {"ph": "X", "pid": 1, "tid": 8, "ts": 0, "dur": 99, "name": "$time perf_counter"}]
  _write_trace(tmp_path / "t" / "plugins" / "profile" / "run1", events)
  bench = _load("bench_gpu")
  got = bench.top_kernels(tmp_path / "t")
  assert (got["source"], got["events"], got["total_us"]) == ("host threads", 2, 5.0)
  assert [(k["name"], k["share"]) for k in got["top"]] == [("dot_fusion", 0.8), ("add_fusion", 0.2)]
  with pytest.raises(FileNotFoundError, match="no perfetto_trace.json.gz under .*empty"):
    bench.top_kernels(tmp_path / "empty")


@pytest.mark.slow  # an engine and a traced decode + train step at toy sizes: ~40 s on 2 busy cores
def test_bench_gpu_dry_run_engine_and_profile_sections(tmp_path):
  """The engine and profile sections at toy sizes on the CPU (the engine with a stage of 4 slots, the
  variant with the most machinery: refills on device): the row compares the slot engine
  with the static sampler on the same prompts and seeds (float32 on the CPU: the same tokens), with
  utilization at most the ideal scheduler's and a bounded program set; the profile traces whole decode
  chunks and a train step and reads them with `top_kernels` (host threads on the CPU)."""
  import json

  bench = _load("bench_gpu")
  bench.DRY.update(engine_variants=((16, "auto", 4),), engine_workloads="longtail")
  bench.main(["--dry_run", "--out", str(tmp_path), "--sections", "engine,profile"])
  saved = json.loads((tmp_path / "bench_gpu.json").read_text())["sections"]
  engine = saved["engine"]
  assert (engine["slots"], engine["prompts"]) == (4, 8)
  assert [(r["staged_slots"], r["workload"]) for r in engine["rows"]] == [(4, "longtail")]
  for r in engine["rows"]:
    assert r["same_tokens"] == 1.0 and r["slots_tokens_per_s"] > 0 and r["speedup"] > 0
    assert r["slot_utilization"] <= r["ideal_utilization"] + 1e-9 and 1 <= r["programs"] <= 8
    assert r["length_max"] <= engine["max_new_tokens"] and r["ms_per_decode_step"] > 0
  profile = saved["profile"]
  decode, train = profile["decode"], profile["train"]
  assert decode["source"] == train["source"] == "host threads"
  assert decode["steps"] == bench.DRY["profile_chunks"] * profile["chunk_steps"]
  assert decode["kernels_per_step"] == decode["events"] / decode["steps"] > 0
  assert decode["device_us_per_step"] * decode["steps"] == pytest.approx(decode["total_us"])
  for t in (decode, train):
    shares = [k["share"] for k in t["top"]]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1 + 1e-9
  report = (tmp_path / "bench_gpu.md").read_text()
  assert "## engine" in report and "## profile" in report and "decode: top kernels by time" in report
  assert f"{decode['steps']} decode steps traced" in report


def test_bench_packing_long_tail_packs_within_15_percent_of_its_real_tokens():
  """The long-tail 1B batch (64 rows, prompts 512, responses log-normal mean 1024, capped at 8192):
  padded computes ~6x its real tokens, packed into rows of P + R tokens at most 1.15x (arithmetic over
  lengths; BENCHMARKS.md: 5.88x and 1.065x over 50 batches)."""
  bench = _load("bench_packing")
  batches, width = bench.long_tail_batches(10)
  rows = {r[0]: r for r in bench.layouts(batches, width, [16], [width])}
  assert rows["padded"][1] > 5
  assert rows[f"packed, {width} tokens a row"][2] <= 1.15  # the worst of the 10 batches
  assert rows[f"packed, {width} tokens a row"][3] == 1  # one program whatever the lengths


def test_gpu_check_dry_run_writes_each_section_as_it_finishes(tmp_path, capsys):
  """`scripts/gpu_check.py --dry_run` on the CPU: the numerics sections that take seconds (the paged
  kernel in interpret mode, the fp8 kernels, MoE's ragged_dot; cuDNN skipped, named) pass their
  checks, every section lands in gpu_check.json with a summary line, and a spent budget skips the
  sections after it, saying so (CI runs the whole dry run: `make gpu-check ARGS=--dry_run`)."""
  import json

  gc = _load("gpu_check")
  out = tmp_path / "gc"
  gc.main(["--dry_run", "--out", str(out), "--sections", "paged_kernel,fp8_kernels,cudnn_packed,moe_ragged_dot"])
  results = json.loads((out / "gpu_check.json").read_text())
  s = results["sections"]
  assert list(s) == ["paged_kernel", "fp8_kernels", "cudnn_packed", "moe_ragged_dot"]
  assert s["cudnn_packed"]["skipped"] == "cuDNN needs a GPU"
  for name in ("paged_kernel", "fp8_kernels", "moe_ragged_dot"):
    assert s[name]["checks"] and all(c["pass"] for c in s[name]["checks"]), s[name]
  printed = capsys.readouterr().out
  assert "paged_kernel: pass (4 checks)" in printed and "cudnn_packed: skipped (cuDNN needs a GPU)" in printed
  assert "## fp8_kernels: pass" in (out / "gpu_check.md").read_text()

  gc.main(["--dry_run", "--out", str(out), "--sections", "moe_ragged_dot,fp8_kernels", "--budget_s", "0"])
  s = json.loads((out / "gpu_check.json").read_text())["sections"]
  assert "checks" in s["moe_ragged_dot"] and "budget was spent" in s["fp8_kernels"]["skipped"]


def test_gpu_check_fails_on_a_failed_check(tmp_path, monkeypatch):
  """A check over its bound fails the command (after writing every section), naming the section."""
  gc = _load("gpu_check")
  monkeypatch.setitem(gc.RUNNERS, "moe_ragged_dot", lambda cfg, env: {"checks": [gc._check("x", 2.0, 1.0, "why")]})
  with pytest.raises(SystemExit, match=r"sections \['moe_ragged_dot'\] failed"):
    gc.main(["--dry_run", "--out", str(tmp_path), "--sections", "moe_ragged_dot"])
  assert "FAIL: x = 2" in (tmp_path / "gpu_check.md").read_text()
