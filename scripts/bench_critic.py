#!/usr/bin/env python
"""PPO with a critic vs the group baseline: a table from `scripts/seeds.py` runs of the two arms.

  python scripts/seeds.py --seeds 0 --shared_sft --out runs/critic_seeds \\
      --arm tiny_cpu=configs/tiny_cpu.gin --arm ppo_critic=configs/tiny_ppo_critic.gin
  python scripts/bench_critic.py runs/critic_seeds

Per run (OUT/<arm>_s<seed>/): held-out greedy accuracy before and after RL (summary.json), the
critic's value loss (`critic/vf_loss`: on each batch before the critic trains on it) and explained
variance averaged over the first and the last 10 steps, and the median trainer step
(`time/train_step`: the critic's forward and updates included) and whole step (`time/step`).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def row(run_dir: Path) -> dict:
  summary = json.loads((run_dir / "summary.json").read_text())
  steps = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "time/train_step" in m]
  mean = lambda key, part: (statistics.fmean(m[key] for m in part) if part and key in part[0] else None)  # noqa: E731
  median = lambda key: statistics.median(m[key] for m in steps[1:]) if len(steps) > 1 else None  # noqa: E731
  return {"run": run_dir.name, "before": summary.get("eval_before_rl"), "after": summary.get("eval_after_rl"),
          "vf_first10": mean("critic/vf_loss", steps[:10]), "vf_last10": mean("critic/vf_loss", steps[-10:]),
          "ev_last10": mean("critic/explained_variance", steps[-10:]), "train_step_s": median("time/train_step"),
          "step_s": median("time/step"), "steps": len(steps)}


def main(argv=None) -> list[dict]:
  out = Path((argv or sys.argv[1:] or ["runs/critic_seeds"])[0])
  rows = [row(d) for d in sorted(out.iterdir()) if (d / "summary.json").exists()]
  fmt = lambda v, s="{:.3f}", scale=1: "-" if v is None else s.format(scale * v)  # noqa: E731
  print("| run | steps | held-out before -> after RL % | vf_loss first 10 -> last 10 steps | explained var. "
        "last 10 | train step s (median) | step s (median) |")
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['run']} | {r['steps']} | {fmt(r['before'], '{:.1f}', 100)} -> {fmt(r['after'], '{:.1f}', 100)} | "
          f"{fmt(r['vf_first10'])} -> {fmt(r['vf_last10'])} | {fmt(r['ev_last10'], '{:.2f}')} | "
          f"{fmt(r['train_step_s'])} | {fmt(r['step_s'])} |")
  return rows


if __name__ == "__main__":
  main()
