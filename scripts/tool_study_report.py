#!/usr/bin/env python
"""The tool study: the tool task with the calculator vs the same budget without tools, over seeds.

  scripts/run_tool_seeds.sh 0 1 2          # runs/tools/tiny_tools_s<k>, runs/tools/tiny_tools_notool_s<k>
  python scripts/tool_study_report.py      # this table (markdown), from their summary.json and metrics.jsonl

Per arm: held-out greedy accuracy before RL (the SFT policy) and after RL (mean of the last
`eval_window` evaluations: `eval_accuracy_window`), tool calls per held-out episode after RL, the
run's wall time; mean and 95% Student-t half-width over seeds; then the paired (by seed) difference
tools - no tools of the held-out accuracy after RL.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from llamarl_jax import stats  # noqa: E402


def load(root: Path, name: str) -> dict[int, dict]:
  out = {}
  for d in sorted(root.glob(f"{name}_s*")):
    summary = d / "summary.json"
    if d.is_dir() and summary.exists() and d.name[len(name) + 2:].isdigit():
      s = json.loads(summary.read_text())
      last = s["evals"][-1] if s.get("evals") else {}
      out[int(d.name[len(name) + 2:])] = {
          "before": 100 * s["eval_before_rl"], "after": 100 * s["eval_accuracy_window"],
          "calls": last.get("eval/episode_tool_calls_mean", float("nan")), "seconds": s["total_seconds"],
          "step_seconds": s["mean_step_seconds"]}
  return out


def fmt(values, digits=1) -> str:
  iv = stats.t_interval(values)
  return f"{iv.mean:.{digits}f} ± {iv.half_width:.{digits}f}" if len(values) > 1 else f"{values[0]:.{digits}f}"


def main(argv=None) -> str:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--root", default="runs/tools")
  args = p.parse_args(argv)
  root = Path(args.root)
  arms = {"calculator (configs/tiny_tools.gin)": load(root, "tiny_tools"),
          "no tool (configs/tiny_tools_notool.gin)": load(root, "tiny_tools_notool")}
  lines = ["| arm | seeds | held-out % before RL | held-out % after RL | tool calls / episode | run wall s | "
           "RL step s |", "|---|---|---|---|---|---|---|"]
  for name, runs in arms.items():
    if not runs:
      continue
    col = lambda k: [r[k] for r in runs.values()]  # noqa: E731
    lines.append(f"| {name} | {','.join(map(str, runs))} | {fmt(col('before'))} | {fmt(col('after'))} | "
                 f"{fmt(col('calls'), 2)} | {fmt(col('seconds'), 0)} | {fmt(col('step_seconds'), 2)} |")
  tools, base = arms.values()
  common = sorted(set(tools) & set(base))
  if len(common) >= 2:
    d = stats.paired_t_interval([tools[s]["after"] for s in common], [base[s]["after"] for s in common])
    lines.append("")
    lines.append(f"Paired by seed ({len(common)} seeds): calculator - no tool, held-out after RL: "
                 f"{d.mean:+.1f} points, 95% interval [{d.low:+.1f}, {d.high:+.1f}]")
  text = "\n".join(lines)
  print(text)
  return text


if __name__ == "__main__":
  main()
