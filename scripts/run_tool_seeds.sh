#!/usr/bin/env bash
# The tool study's runs: configs/tiny_tools.gin (calculator) vs configs/tiny_tools_notool.gin (no tool), same
# budget, seeds given as arguments (default 0 1 2), one run at a time; results in runs/tools/<config>_s<seed>/.
# Summarise with: python scripts/tool_study_report.py
set -euo pipefail
cd "$(dirname "$0")/.."
seeds=${*:-0 1 2}
for seed in $seeds; do
  for cfg in tiny_tools tiny_tools_notool; do
    dir=runs/tools/${cfg}_s${seed}
    [ -f "$dir/summary.json" ] && continue
    rm -rf "$dir"
    JAX_PLATFORMS=cpu .venv/bin/python -m llamarl_jax.compat --cpu_devices 4 -- \
      /usr/bin/time -f "%e s wall" .venv/bin/python scripts/train.py --gin_file=configs/$cfg.gin --run_dir=$dir \
      --gin_param="build_policy.seed=$seed" --gin_param="PromptSource.seed=$seed" --gin_param="RolloutConfig.seed=$seed" \
      --gin_param="run_experiment.tensorboard=False" > "$dir.log" 2>&1
  done
done
