"""The benchmark scripts run (tiny settings) and report what their tables claim to."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load(name):
  spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


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
  assert summary["cases"] == 60 and summary["ours"]["false_positives"] == 0
  out = capsys.readouterr().out
  assert "| gsm8k_hash |" in out and "ours accepted" in out and "calls/s" in out


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
