#!/usr/bin/env python
"""A configuration over warm-start seeds: one run per (arm, seed), then mean and 95% interval per arm.

  python scripts/seeds.py --seeds 0 1 2 3 4                              # `make run` (configs/tiny_cpu.gin)
  python scripts/seeds.py --seeds 0 1 2 --arm tiny_cpu=configs/tiny_cpu.gin \\
      --arm lora8=configs/tiny_lora.gin,LoraConfig.rank=8 --shared_sft   # arms from one warm start per seed

Seed s sets everything a run draws: the initial weights (`build_policy.seed`), the SFT and RL prompt
streams (`PromptSource.seed`) and the sampling noise (`RolloutConfig.seed`), so each seed is its own
warm start followed by its own RL. Each run is `scripts/train.py` in a fresh interpreter under
`make run`'s environment (4 fake CPU devices; `--fusion_emitters`, `--llvm_opt`: another rounding of
the same run), one at a time, in OUT/<arm>_s<seed>/ (a run whose
summary.json exists is kept). The first arm's runs save their warm start (`run_experiment.export_sft`,
OUT/<arm>_s<seed>/sft_export); with `--shared_sft` the other arms start RL from it without an SFT of
their own, so the arms of a seed differ only in what RL does (paired).

The table (markdown, also OUT/seeds.json): per run held-out greedy accuracy before RL, after RL, the
mean of the last evaluations (`eval_accuracy_window`), RL seconds and wall seconds; per arm the mean
and Student-t 95% interval over seeds, and with more than one arm the paired difference to the first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from llamarl_jax import compat, stats  # noqa: E402

METRICS = (("eval_before_rl", "before RL %", 100), ("eval_after_rl", "after RL %", 100),
           ("eval_accuracy_window", "last evals %", 100), ("rl_seconds", "RL s", 1), ("wall_seconds", "wall s", 1))


def parse_arm(text: str) -> tuple[str, str, list[str]]:
  """'name=configs/x.gin,Key.a=1,Key.b=2' -> (name, gin file, bindings)."""
  name, sep, rest = text.partition("=")
  parts = rest.split(",") if sep else []
  if not name or not parts or not parts[0].endswith(".gin"):
    raise SystemExit(f"--arm {text!r}: expected NAME=FILE.gin[,Binding=value,...]")
  return name, parts[0], parts[1:]


def run_one(out: Path, arm: str, gin_file: str, bindings: list[str], seed: int, *, sft_from: Path | None,
            export_sft: bool, timeout_s: float, xla: dict | None = None) -> dict:
  run_dir = out / f"{arm}_s{seed}"
  summary_file = run_dir / "summary.json"
  if not summary_file.exists():
    params = [f"build_policy.seed={seed}", f"PromptSource.seed={seed}", f"RolloutConfig.seed={seed}",
              "run_experiment.tensorboard=False", *bindings]
    if export_sft:
      params.append("run_experiment.export_sft=True")
    if sft_from is not None:
      params += [f"build_policy.model_path='{sft_from}'", "run_experiment.sft=False"]
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), f"--gin_file={gin_file}", f"--run_dir={run_dir}",
           *[f"--gin_param={p}" for p in params]]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(f"{run_dir}.log", "w") as log:
      env = compat.xla_env({**os.environ, "JAX_PLATFORMS": "cpu"}, cpu_devices=4, **(xla or {}))  # make run's
      rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                          timeout=timeout_s).returncode
    if rc != 0:
      raise SystemExit(f"{arm} seed {seed}: exit {rc}; see {run_dir}.log")
    summary = json.loads(summary_file.read_text())
    summary["wall_seconds"] = time.perf_counter() - t0  # the interpreter's start and imports included
    summary_file.write_text(json.dumps(summary, indent=2))
  summary = json.loads(summary_file.read_text())
  return {"arm": arm, "seed": seed, **{k: summary.get(k) for k, _, _ in METRICS}}


def report(rows: list[dict], arms: list[str]) -> str:
  lines = ["| arm | seed | " + " | ".join(label for _, label, _ in METRICS) + " |",
           "|---|---|" + "---|" * len(METRICS)]
  fmt = lambda v, scale: "-" if v is None else f"{scale * v:.1f}"  # noqa: E731
  for r in rows:
    lines.append(f"| {r['arm']} | {r['seed']} | " + " | ".join(fmt(r[k], s) for k, _, s in METRICS) + " |")
  lines.append("")
  lines.append("| arm | seeds | " + " | ".join(f"{label}: mean ± 95% (min-max)" for _, label, _ in METRICS) + " |")
  lines.append("|---|---|" + "---|" * len(METRICS))
  for arm in arms:
    mine = [r for r in rows if r["arm"] == arm]
    cells = []
    for k, _, s in METRICS:
      vals = [s * r[k] for r in mine if r[k] is not None]
      if len(vals) >= 2:
        iv = stats.t_interval(vals)
        cells.append(f"{iv.mean:.1f} ± {iv.half_width:.1f} ({min(vals):.1f}-{max(vals):.1f})")
      else:
        cells.append(", ".join(f"{v:.1f}" for v in vals) or "-")
    lines.append(f"| {arm} | {len(mine)} | " + " | ".join(cells) + " |")
  for arm in arms[1:]:
    a = {r["seed"]: r for r in rows if r["arm"] == arm}
    b = {r["seed"]: r for r in rows if r["arm"] == arms[0]}
    seeds = sorted(set(a) & set(b))
    diffs = [100 * (a[s]["eval_after_rl"] - b[s]["eval_after_rl"]) for s in seeds
             if a[s]["eval_after_rl"] is not None and b[s]["eval_after_rl"] is not None]
    if len(diffs) >= 2:
      iv = stats.t_interval(diffs)
      lines.append(f"\n{arm} - {arms[0]}, held-out after RL, paired over seeds {seeds}: "
                   f"{iv.mean:+.1f} ± {iv.half_width:.1f} points")
  return "\n".join(lines)


def main(argv=None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
  p.add_argument("--arm", action="append", default=[],
                 help="NAME=FILE.gin[,Binding=value,...] (repeatable; default: tiny_cpu=configs/tiny_cpu.gin)")
  p.add_argument("--shared_sft", action="store_true",
                 help="the arms of a seed start RL from the first arm's warm start")
  p.add_argument("--out", default="runs/seeds")
  p.add_argument("--timeout_s", type=float, default=3600, help="per run")
  p.add_argument("--fusion_emitters", choices=("auto", "on", "off"), default="auto",
                 help="XLA's CPU fusion emitters (`llamarl_jax.compat.cpu_flags`; 'auto' as make run)")
  p.add_argument("--llvm_opt", type=int, default=None, help="XLA's LLVM optimisation level (default: XLA's)")
  args = p.parse_args(argv)
  xla = {"fusion_emitters": args.fusion_emitters, "llvm_opt": args.llvm_opt}
  arms = [parse_arm(a) for a in (args.arm or ["tiny_cpu=configs/tiny_cpu.gin"])]
  if len({a[0] for a in arms}) != len(arms):
    p.error("arm names must differ")
  out = ROOT / args.out
  rows = []
  for seed in args.seeds:  # seed-major: a cut-off study has every arm at equal depth
    first = None
    for i, (arm, gin_file, bindings) in enumerate(arms):
      sft_from = first / "sft_export" if args.shared_sft and i > 0 else None
      rows.append(run_one(out, arm, gin_file, bindings, seed, sft_from=sft_from,
                          export_sft=i == 0, timeout_s=args.timeout_s, xla=xla))
      first = first or out / f"{arm}_s{seed}"
      r = rows[-1]
      print(f"{arm} seed {seed}: held-out {100 * (r['eval_before_rl'] or 0):.1f}% -> "
            f"{100 * (r['eval_after_rl'] or 0):.1f}% in {r['wall_seconds'] or 0:.0f} s", flush=True)
  text = report(rows, [a[0] for a in arms])
  (out / "seeds.json").write_text(json.dumps(rows, indent=2))
  (out / "seeds.md").write_text(text + "\n")
  print(text)
  return rows


if __name__ == "__main__":
  main()
