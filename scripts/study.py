#!/usr/bin/env python
"""Learning-quality study: does asynchronous AIPO match synchronous RL? Seeds, intervals, plots.

  make study      # = JAX_PLATFORMS=cpu python -m llamarl_jax.compat --cpu_devices 2 -- \
                  #   python scripts/study.py --gin_file=configs/study.gin --out runs/study --seeds 5

1. One supervised warm start (SFT) for the whole study, saved as an HF checkpoint under OUT/sft and
   reused by every cell and seed (and by a resumed study).
2. The grid: every cell (`CELLS`: policy lag 0/1/2/4; at lag 4 AIPO detached / clamped / no
   truncation / PPO-clip; colocated vs disjoint at lag 0) x seeds 0..S-1, run one after another in this
   process (one reward worker pool, one XLA compilation cache). A run is a fresh Controller from the
   SFT weights with held-out evaluations (greedy + sampled pass@1) every `eval_every` steps. Under the
   'fixed' version schedule a run is a pure function of (cell, seed): the seed sets the prompt stream
   and the sampling noise, and seed s of every cell gets the same ones.
3. The report: per cell the mean and 95% Student-t interval over seeds of (a) held-out accuracy
   averaged over the last `eval_window` evaluations, (b) the area under the training-reward curve,
   (c) the steps to reach a training-reward threshold, plus KL(mu||pi), the truncated (AIPO) or clipped
   (PPO) token fraction and the step time; paired per-seed differences for the questions of the
   issue; tables as markdown/JSON/CSV and PNG plots (OUT/report/, `--docs` also copies the plots to
   docs/).

The off-policy grid (`OFF_POLICY_CELLS`: lag 4 and 8 x AIPO / CISPO / GSPO / sequence TIS /
sequence MIS x with and without DAPO dynamic sampling, all on the static engine) is not in the default
grid: `--cells offpolicy` (all 20) or `--cells op_lag4_aipo,op_lag4_aipo_dyn,...`, with its own --out
(`make study-offpolicy`); its report
adds the dropped-group rate, the paired objective-vs-AIPO and dynamic-vs-not questions and two figures.

Resumable: each finished (cell, seed) writes OUT/runs/<cell>/seed<k>/result.json and is skipped next
time; an unfinished one starts over. The settings are stored in OUT/study.json and a later call with
different settings is refused (use a new --out). `--report_only` rebuilds the report from disk.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> (description, run settings by their flat names: `config.run_config`). `buffer_capacity` is set to max(2, lag) for all.
INF = float("inf")
CELLS: dict[str, tuple[str, dict]] = {
    "lag0": ("lag 0 (synchronous), disjoint meshes", {"max_policy_lag": 0}),
    "lag1": ("lag 1, AIPO detached rho 2", {"max_policy_lag": 1}),
    "lag2": ("lag 2, AIPO detached rho 2", {"max_policy_lag": 2}),
    "lag4": ("lag 4, AIPO detached rho 2", {"max_policy_lag": 4}),
    "lag4_clamped": ("lag 4, AIPO clamped rho 2",
                     {"max_policy_lag": 4, "loss_kwargs": {"rho_max": 2.0, "form": "clamped"}}),
    "lag4_no_trunc": ("lag 4, no truncation (rho inf)", {"max_policy_lag": 4, "loss_kwargs": {"rho_max": INF}}),
    "lag4_ppo_clip": ("lag 4, PPO-clip eps 0.2", {"max_policy_lag": 4, "loss": "ppo_clip",
                                                  "loss_kwargs": {"eps_low": 0.2, "eps_high": 0.2}}),
    "lag0_colocated": ("lag 0, colocated (one mesh)", {"max_policy_lag": 0, "colocated": True}),
}


def _off_policy_cells() -> dict[str, tuple[str, dict]]:
  """The off-policy grid (not in the default study; select with --cells, in its own --out): at lag 4 and 8,
  AIPO detached vs CISPO vs GSPO vs sequence-level TIS vs sequence-level MIS, each without and with
  DAPO dynamic sampling. All on the static engine (dynamic sampling needs it), so the pairs differ
  only in the objective or the sampling. 20 cells x 5 seeds ~ 2 h of 2 cores.
  `dynamic_sampling` is given as DynamicSampling's fields (`run_one` builds it)."""
  objectives = {
      "aipo": ("AIPO detached rho 2", "aipo", {"rho_max": 2.0}),
      "cispo": ("CISPO weight in [0.5, 2]", "cispo", {"eps_low": 0.5, "eps_high": 1.0}),
      "gspo": ("GSPO eps 3e-4/4e-4, seq mean", "gspo",
               {"eps_low": 3e-4, "eps_high": 4e-4, "aggregation": "seq_mean_token_mean"}),
      "seq_tis": ("sequence TIS C 2", "seq_tis", {"is_threshold": 2.0}),
      "mis": ("sequence MIS [0.5, 2]", "mis", {"level": "sequence", "rs_threshold": 2.0}),
  }
  cells = {}
  for lag in (4, 8):
    for key, (desc, loss, kwargs) in objectives.items():
      for dyn in (False, True):
        overrides = {"max_policy_lag": lag, "loss": loss, "loss_kwargs": dict(kwargs), "generator_engine": "static"}
        if dyn:
          overrides["dynamic_sampling"] = {"max_draws": 4}
        cells[f"op_lag{lag}_{key}{'_dyn' if dyn else ''}"] = (
            f"lag {lag}, {desc}, static engine{', dynamic sampling' if dyn else ''}", overrides)
  return cells


OFF_POLICY_CELLS = _off_policy_cells()
ALL_CELLS = {**CELLS, **OFF_POLICY_CELLS}
LAG_CELLS = ("lag0", "lag1", "lag2", "lag4")
LAG4_CELLS = ("lag4", "lag4_clamped", "lag4_no_trunc", "lag4_ppo_clip")
# Per-step metrics kept in result.json (the full set is in each run's metrics.jsonl).
KEPT = ("reward/mean", "reward/accuracy", "policy/kl_behaviour", "policy/frac_truncated", "policy/frac_clipped",
        "policy/ratio_max", "policy/lag_mean", "time/step", "time/train", "time/generate_busy", "time/trainer_wait",
        "generate/response_length_mean", "rollout_corr/rollout_rs_masked_fraction", "dynamic_sampling/drop_rate")


def _parse(argv):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--gin_file", action="append", default=None, help="default: configs/study.gin")
  p.add_argument("--gin_param", action="append", default=[], help="extra gin binding (changes the study)")
  p.add_argument("--out", default="runs/study", help="study directory (results, SFT checkpoint, report)")
  p.add_argument("--seeds", type=int, default=5, help="seeds 0..S-1 per cell")
  p.add_argument("--cells", default=",".join(CELLS),
                 help=f"comma-separated subset of {list(CELLS)} (the default), or of the off-policy grid's "
                      f"{list(OFF_POLICY_CELLS)}; 'offpolicy': all of the off-policy grid")
  p.add_argument("--threshold", type=float, default=0.5,
                 help="training-reward threshold for 'steps to threshold' (trailing mean, see --threshold_window)")
  p.add_argument("--threshold_window", type=int, default=5, help="trailing window (steps) of that mean")
  p.add_argument("--smooth", type=int, default=5, help="moving-average window of the plotted reward curves")
  p.add_argument("--report_only", action="store_true", help="no training: rebuild the report from disk")
  p.add_argument("--docs", action="store_true", help="also copy the plots to docs/study_*.png")
  args = p.parse_args(argv)
  args.gin_file = args.gin_file or [str(ROOT / "configs" / "study.gin")]
  cells = [c for name in args.cells.split(",") for c in (OFF_POLICY_CELLS if name == "offpolicy" else [name])]
  unknown = [c for c in cells if c not in ALL_CELLS]
  if unknown:
    p.error(f"unknown cell(s) {unknown}; choose from {list(ALL_CELLS)} or 'offpolicy'")
  args.cells = cells
  if args.seeds < 2:
    p.error("--seeds must be >= 2: an interval over seeds needs at least two")
  return args


# ------------------------------------------------------------------------------------------------
# settings: what makes two results comparable


def _settings(cells=()) -> dict:
  """Everything that determines a run's result besides (cell, seed): the effective gin bindings of the
  configurables a run uses (not the files' text, so comments or unrelated bindings may change) and
  the cells' definitions."""
  import gin

  bound = {name: repr(sorted(gin.get_bindings(name).items()))
           for name in ("MeshConfig", "RolloutConfig", "GeneratorConfig", "TrainConfig", "ScheduleConfig",
                        "RewardConfig", "OptimizerConfig", "ModelConfig", "PromptSource", "supervised_warmstart",
                        "build_policy")}
  if gin.get_bindings("EnvConfig"):  # multi-turn episodes; recorded only when bound (single-turn studies match without it)
    bound["EnvConfig"] = repr(sorted(gin.get_bindings("EnvConfig").items()))
  bound["study"] = repr(sorted(_study_knobs().items()))
  settings = {"bindings": bound, "cells": {name: repr(CELLS[name]) for name in CELLS}}
  extra = {name: repr(OFF_POLICY_CELLS[name]) for name in cells if name in OFF_POLICY_CELLS}
  if extra:  # only when selected: studies of the default cells keep their settings
    settings["off_policy_cells"] = extra
  return settings


def _check_settings(out: Path, settings: dict) -> None:
  path = out / "study.json"
  if path.exists():
    old = json.loads(path.read_text())
    if old != json.loads(json.dumps(settings)):
      raise SystemExit(f"{out} holds a study with other settings ({path}: {old}); its results cannot be mixed "
                       f"with these ({settings}). Choose a new --out, or delete {out} to start over.")
  else:
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=2))


def _write_json(path: Path, obj) -> None:
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps(obj, indent=1, default=str))
  os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------
# running


def _study_knobs() -> dict:
  import gin

  q = lambda name, default: gin.query_parameter(name) if _bound(name) else default
  return {"rl_steps": q("run_experiment.rl_steps", 60), "eval_every": q("run_experiment.eval_every", 10),
          "eval_samples": q("run_experiment.eval_samples", 0), "eval_size": q("run_experiment.eval_size", 256),
          "eval_window": q("run_experiment.eval_window", 3)}


def _bound(name: str) -> bool:
  import gin

  try:
    gin.query_parameter(name)
    return True
  except ValueError:
    return False


def sft_checkpoint(out: Path, reward) -> tuple:
  """(config, params, tokenizer, sft_meta): the shared warm start, trained and saved on first use.

  Trained as `run_experiment` trains it: on the params of a Controller built from the gin config, so
  on its trainer mesh (e.g. FSDP over 2 devices with configs/tiny_cpu.gin). The layout matters: a
  reduction split differently changes the last bits of a step, and over 1000 SFT steps that grows
  into another warm start (BENCHMARKS.md: one device vs FSDP 2 gave a sampled pass@1 before RL of 20%
  vs 28%, and held-out accuracies after RL tens of points apart), so only this way does
  `--gin_file=configs/tiny_cpu.gin` start from `make run`'s own warm start.
  """
  import jax

  from llamarl_jax import experiment
  from llamarl_jax.config import run_config
  from llamarl_jax.controller import Controller
  from llamarl_jax.model import hf
  from llamarl_jax.model.llama import abstract_model, merge_params, split_params

  sft_dir, meta_path = out / "sft" / "hf", out / "sft" / "sft.json"
  if not meta_path.exists():
    t0 = time.perf_counter()
    config, params, tokenizer = experiment.build_policy()
    source = experiment.configured_prompt_source().with_tokenizer(tokenizer)
    c = Controller(config, params, tokenizer, source, run_dir=out / "sft" / "build", progress=False, reward=reward,
                   config=run_config(experiment.configured_run_config(), reward_fn=reward.name, checkpoint_every=0))
    try:
      params = experiment.supervised_warmstart(config, c.trainer.policy_params(), tokenizer, source.fork(seed_offset=1),
                                               progress=False)
    finally:
      c.close()
    graphdef = split_params(abstract_model(config))[0]
    hf.save_hf_checkpoint(merge_params(graphdef, jax.device_get(params)), config, sft_dir, tokenizer=tokenizer)
    _write_json(meta_path, {"sft_seconds": time.perf_counter() - t0, "model_params": config.num_params(),
                            "source": repr(source)})
  config, model = hf.load_hf_checkpoint(sft_dir)
  tokenizer = hf.load_tokenizer(sft_dir)
  _, params = split_params(model)
  return config, params, tokenizer, json.loads(meta_path.read_text())


def run_one(cell: str, seed: int, *, out: Path, config, params, tokenizer, base_source, eval_examples, reward,
            knobs: dict, before: dict) -> dict:
  """One (cell, seed) run; returns (and writes) its result. Skipped if result.json exists."""
  from llamarl_jax.config import run_config
  from llamarl_jax.controller import Controller
  from llamarl_jax.experiment import configured_run_config, run_with_evals
  from llamarl_jax.metrics import MetricsLogger

  run_dir = out / "runs" / cell / f"seed{seed}"
  result_path = run_dir / "result.json"
  if result_path.exists():
    return json.loads(result_path.read_text())
  shutil.rmtree(run_dir, ignore_errors=True)  # an unfinished run starts over
  overrides = dict(ALL_CELLS[cell][1])
  if "dynamic_sampling" in overrides:
    from llamarl_jax.executors.generator import DynamicSampling

    overrides["dynamic_sampling"] = DynamicSampling(**overrides["dynamic_sampling"])
  overrides.setdefault("buffer_capacity", max(2, overrides["max_policy_lag"]))
  logger = MetricsLogger(run_dir, tensorboard=False)
  # Seed s: its own prompt stream (the SFT used offset 1) and sampling noise, the same in every cell.
  source = base_source.fork(seed_offset=1000 + seed)
  t0 = time.perf_counter()
  run = run_config(configured_run_config(), seed=seed, reward_fn=reward.name, checkpoint_every=0, **overrides)
  controller = Controller(config, params, tokenizer, source, run_dir=run_dir, logger=logger, progress=False,
                          config=run, reward=reward)
  evals = [dict(before)]  # step 0: the shared SFT policy, evaluated once for the whole study
  try:
    history = run_with_evals(controller, eval_examples, knobs["rl_steps"], eval_every=knobs["eval_every"],
                             samples=knobs["eval_samples"], logger=logger, evals=evals)
  finally:
    controller.close()
    logger.close()
  result = {"cell": cell, "seed": seed, "wall_seconds": time.perf_counter() - t0,
            "steps": {k: [m.get(k, math.nan) for m in history] for k in KEPT},
            "evals": [{k: v for k, v in e.items() if k != "samples"} for e in evals]}
  _write_json(result_path, result)
  return result


def run_grid(args, out: Path) -> None:
  import gin
  import jax

  from llamarl_jax.config import run_config
  from llamarl_jax.controller import Controller
  from llamarl_jax.executors.reward import RewardExecutor
  from llamarl_jax.experiment import configured_prompt_source, configured_run_config, evaluate_and_log
  from llamarl_jax.metrics import MetricsLogger

  # Compiled XLA executables are cached on disk: the same train / sample functions recompile for every
  # run otherwise (each Controller jits its own), which on 2 cores is a large share of a short run.
  jax.config.update("jax_compilation_cache_dir", str(out / "xla_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  knobs = _study_knobs()
  t_sft = time.perf_counter()
  reward_name = gin.query_parameter("RewardConfig.fn") if _bound("RewardConfig.fn") else "arithmetic"
  with RewardExecutor(reward_name, num_workers=1) as reward:
    config, params, tokenizer, sft_meta = sft_checkpoint(out, reward)
    base_source = configured_prompt_source().with_tokenizer(tokenizer)
    eval_examples = base_source.heldout().next_batch(knobs["eval_size"])
    before_path = out / "sft" / "eval_before_rl.json"
    if not before_path.exists():
      c = Controller(config, params, tokenizer, base_source, run_dir=out / "sft" / "eval", progress=False,
                     reward=reward, config=run_config(configured_run_config(), reward_fn=reward.name,
                                                      checkpoint_every=0))
      try:
        logger = MetricsLogger(out / "sft" / "eval", tensorboard=False)
        row = evaluate_and_log(c, eval_examples, samples=knobs["eval_samples"], logger=logger)
        logger.close()
      finally:
        c.close()
      _write_json(before_path, {k: v for k, v in row.items() if k != "samples"})
    before = json.loads(before_path.read_text())
    print(f"SFT checkpoint ready ({time.perf_counter() - t_sft:.0f} s; held-out greedy before RL "
          f"{before['eval/accuracy']:.3f}, sampled pass@1 {before.get('eval/pass1_sampled', math.nan):.3f})",
          flush=True)
    for seed in range(args.seeds):  # seed-major: a cut-off study has every cell at equal depth
      for cell in args.cells:
        done = (out / "runs" / cell / f"seed{seed}" / "result.json").exists()
        t0 = time.perf_counter()
        r = run_one(cell, seed, out=out, config=config, params=params, tokenizer=tokenizer,
                    base_source=base_source, eval_examples=eval_examples, reward=reward, knobs=knobs,
                    before=before)
        tail = r["evals"][-knobs["eval_window"]:]
        print(f"{cell:>15} seed {seed}: {'(on disk) ' if done else ''}held-out "
              f"{sum(e['eval/accuracy'] for e in tail) / len(tail):.3f}, reward AUC "
              f"{sum(r['steps']['reward/mean']) / len(r['steps']['reward/mean']):.3f}, "
              f"{time.perf_counter() - t0:.0f} s", flush=True)


# ------------------------------------------------------------------------------------------------
# report


def load_results(out: Path, cells) -> dict[str, list[dict]]:
  found = {}
  for cell in cells:
    rs = [json.loads(p.read_text()) for p in sorted((out / "runs" / cell).glob("seed*/result.json"))]
    if rs:
      found[cell] = sorted(rs, key=lambda r: r["seed"])
  return found


def run_scalars(r: dict, *, eval_window: int, threshold: float, threshold_window: int) -> dict:
  """The per-run numbers the cells are compared on."""
  import numpy as np

  from llamarl_jax import stats

  s = r["steps"]
  evals = [e for e in r["evals"] if e["step"] > 0]
  reached = stats.steps_to_threshold(s["reward/mean"], threshold, threshold_window)
  # The fraction of tokens the objective clips, rejects or truncates (whichever it reports).
  nan = [math.nan] * len(s["reward/mean"])
  frac = next((s[k] for k in ("policy/frac_clipped", "rollout_corr/rollout_rs_masked_fraction")
               if not all(map(math.isnan, s.get(k, nan)))), s["policy/frac_truncated"])
  return {
      "heldout": 100 * stats.window_mean([e["eval/accuracy"] for e in evals], eval_window),
      "pass1": 100 * stats.window_mean([e.get("eval/pass1_sampled", math.nan) for e in evals], eval_window),
      "auc": stats.curve_area(s["reward/mean"]),
      "steps_to_threshold": reached,
      "kl_behaviour": float(np.mean(s["policy/kl_behaviour"])),
      "frac_truncated": float(np.nanmean(frac)),
      "step_seconds": float(np.median(s["time/step"][3:] or s["time/step"])),
      # DAPO dynamic sampling: the fraction of drawn groups dropped as uninformative (NaN without it)
      "drop_rate": _nanmean(s.get("dynamic_sampling/drop_rate", nan)),
  }


def _nanmean(values) -> float:
  kept = [v for v in values if not math.isnan(v)]
  return sum(kept) / len(kept) if kept else math.nan


def summarise(results: dict[str, list[dict]], *, eval_window: int, threshold: float, threshold_window: int,
              rl_steps: int) -> dict:
  """Per cell: each metric's mean and 95% t-interval over seeds (steps to threshold: censored at the budget)."""
  from llamarl_jax import stats

  table = {}
  for cell, rs in results.items():
    per_run = [run_scalars(r, eval_window=eval_window, threshold=threshold, threshold_window=threshold_window)
               for r in rs]
    row = {"cell": cell, "description": ALL_CELLS[cell][0], "seeds": [r["seed"] for r in rs]}
    for key in ("heldout", "pass1", "auc", "kl_behaviour", "frac_truncated", "step_seconds", "drop_rate"):
      values = [p[key] for p in per_run]  # pass1 is NaN when the study ran without sampled evaluations
      row[key] = stats.t_interval([v for v in values if not math.isnan(v)]).as_dict()
      row[key]["values"] = values
    hits = [p["steps_to_threshold"] for p in per_run]
    row["steps_to_threshold"] = stats.t_interval([h if h is not None else rl_steps for h in hits]).as_dict()
    row["steps_to_threshold"].update(values=hits, reached=sum(h is not None for h in hits),
                                     censored=[h if h is not None else rl_steps for h in hits])
    table[cell] = row
  return table


def compare(table: dict, a: str, b: str, key: str) -> dict | None:
  """Paired (by seed) t-interval of a - b on `key`, over the seeds both cells have."""
  from llamarl_jax import stats

  if a not in table or b not in table:
    return None
  values = lambda cell: table[cell][key].get("censored", table[cell][key]["values"])  # steps: never = budget
  va = dict(zip(table[a]["seeds"], values(a)))
  vb = dict(zip(table[b]["seeds"], values(b)))
  common = sorted(set(va) & set(vb))
  if len(common) < 2:
    return None
  return stats.paired_t_interval([va[s] for s in common], [vb[s] for s in common]).as_dict()


def verdict(d: dict | None, *, margin: float = 0.0, unit: str = "points", better: str = "higher") -> str:
  """Words for a difference interval (first minus second): separable from 0 (or inside -+margin), or
  not at this budget. better: which sign is good for this quantity ('lower' for times and steps)."""
  if d is None:
    return "not enough seeds"
  lo, hi = d["low"], d["high"]
  if lo == hi == 0:
    return "identical in every seed"
  if margin:
    if -margin <= lo and hi <= margin:
      return f"yes: the whole interval is within {margin:g} {unit}"
    if hi < -margin or lo > margin:
      return f"no: the whole interval is beyond {margin:g} {unit}"
    return f"not separable at this budget (the interval reaches beyond -+{margin:g} {unit})"
  if lo > 0 or hi < 0:
    direction = "higher" if lo > 0 else "lower"
    return f"first is {direction} ({'better' if direction == better else 'worse'})"
  return "not separable at this budget (interval contains 0)"


QUESTIONS = (  # (a, b, key, margin, question)
    ("lag1", "lag0", "heldout", 2.0, "Is lag 1 within 2 points of lag 0 (held-out)?"),
    ("lag1", "lag0", "auc", 0.0, "Lag 1 vs lag 0, training-reward AUC"),
    ("lag1", "lag0", "steps_to_threshold", 0.0, "Lag 1 vs lag 0, steps to the reward threshold"),
    ("lag2", "lag0", "heldout", 0.0, "Lag 2 vs lag 0 (held-out)"),
    ("lag4", "lag0", "heldout", 0.0, "Lag 4 vs lag 0 (held-out)"),
    ("lag4", "lag0", "auc", 0.0, "Lag 4 vs lag 0, training-reward AUC"),
    ("lag4", "lag0", "steps_to_threshold", 0.0, "Lag 4 vs lag 0, steps to the reward threshold"),
    ("lag4", "lag4_no_trunc", "heldout", 0.0, "Lag 4: AIPO detached vs no truncation (held-out)"),
    ("lag4", "lag4_no_trunc", "auc", 0.0, "Lag 4: AIPO detached vs no truncation (AUC)"),
    ("lag4_clamped", "lag4_no_trunc", "heldout", 0.0, "Lag 4: AIPO clamped vs no truncation (held-out)"),
    ("lag4_clamped", "lag4_no_trunc", "auc", 0.0, "Lag 4: AIPO clamped vs no truncation (AUC)"),
    ("lag4_ppo_clip", "lag4_no_trunc", "heldout", 0.0, "Lag 4: PPO-clip vs no truncation (held-out)"),
    ("lag4_ppo_clip", "lag4_no_trunc", "auc", 0.0, "Lag 4: PPO-clip vs no truncation (AUC)"),
    ("lag4", "lag4_clamped", "heldout", 0.0, "Lag 4: AIPO detached vs clamped (held-out)"),
    ("lag4", "lag4_ppo_clip", "heldout", 0.0, "Lag 4: AIPO detached vs PPO-clip (held-out)"),
    ("lag0_colocated", "lag0", "heldout", 0.0, "Lag 0: colocated vs disjoint (held-out)"),
    ("lag0_colocated", "lag0", "step_seconds", 0.0, "Lag 0: colocated vs disjoint (step seconds)"),
)


def _off_policy_questions() -> tuple:
  """The off-policy grid's comparisons: at each lag every objective against AIPO detached (held-out, AUC), dynamic
  sampling against none for every objective (held-out, AUC), and lag 8 against lag 4 (held-out)."""
  names = {"cispo": "CISPO", "gspo": "GSPO", "seq_tis": "sequence TIS", "mis": "sequence MIS", "aipo": "AIPO"}
  out = []
  for lag in (4, 8):
    for key in ("cispo", "gspo", "seq_tis", "mis"):
      for metric, label in (("heldout", "held-out"), ("auc", "AUC")):
        out.append((f"op_lag{lag}_{key}", f"op_lag{lag}_aipo", metric, 0.0,
                    f"Lag {lag}: {names[key]} vs AIPO detached ({label})"))
  for lag in (4, 8):
    for key in names:
      for metric, label in (("heldout", "held-out"), ("auc", "AUC")):
        out.append((f"op_lag{lag}_{key}_dyn", f"op_lag{lag}_{key}", metric, 0.0,
                    f"Lag {lag}, {names[key]}: dynamic sampling vs not ({label})"))
  for key in names:
    out.append((f"op_lag8_{key}", f"op_lag4_{key}", "heldout", 0.0, f"{names[key]}: lag 8 vs lag 4 (held-out)"))
  return tuple(out)


QUESTIONS += _off_policy_questions()


def _fmt(iv: dict, scale: float = 1.0, digits: int = 1) -> str:
  if iv["n"] == 0:
    return "-"
  return f"{iv['mean'] * scale:.{digits}f} ± {iv['half_width'] * scale:.{digits}f}"


def markdown(table: dict, comparisons: list[dict], *, knobs: dict, threshold: float, threshold_window: int,
             before: dict) -> str:
  n_eval = knobs["eval_window"]
  lines = [
      f"Mean ± 95% half-width over seeds (Student t, n-1 degrees of freedom). Held-out: greedy exact-match "
      f"accuracy on {knobs['eval_size']} held-out problems, mean of the last {n_eval} evaluations (every "
      f"{knobs['eval_every']} of {knobs['rl_steps']} steps); pass@1: sampled at the training temperature, "
      f"{knobs['eval_samples']} draws per problem, same window. AUC: mean training reward over steps "
      f"1..{knobs['rl_steps']}. Steps to {threshold:g}: first step whose trailing {threshold_window}-step mean "
      f"training reward reaches {threshold:g} (runs that never do count as {knobs['rl_steps']}). Before RL "
      f"(the shared SFT policy): held-out {100 * before['eval/accuracy']:.1f}%, pass@1 "
      f"{100 * before.get('eval/pass1_sampled', math.nan):.1f}%.",
      "",
      f"| cell | seeds | held-out % (last {n_eval} evals) | sampled pass@1 % | reward AUC | steps to {threshold:g} "
      f"(reached) | KL(mu‖pi) | trunc./clip/masked frac | groups dropped (dyn.) | step s (median) |",
      "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for cell, row in table.items():
    st = row["steps_to_threshold"]
    drop = row.get("drop_rate", {"n": 0})
    lines.append(
        f"| {row['description']} | {row['heldout']['n']} | {_fmt(row['heldout'])} | {_fmt(row['pass1'])} | "
        f"{_fmt(row['auc'], digits=3)} | {_fmt(st, digits=0)} ({st['reached']}/{st['n']}) | "
        f"{_fmt(row['kl_behaviour'], digits=4)} | {_fmt(row['frac_truncated'], digits=4)} | "
        f"{_fmt(drop, digits=3)} | {_fmt(row['step_seconds'], digits=2)} |")
  lines += ["", "Paired differences (first minus second, matched by seed; 95% t-interval of the per-seed "
            "differences):", "", "| question | difference | 95% interval | verdict |", "|---|---|---|---|"]
  for c in comparisons:
    d = c["difference"]
    unit = {"heldout": " pts", "auc": "", "step_seconds": " s", "steps_to_threshold": " steps"}.get(c["key"], "")
    digits = 1 if c["key"] in ("heldout", "steps_to_threshold") else 3
    lines.append(f"| {c['question']} | {d['mean']:+.{digits}f}{unit} | [{d['low']:+.{digits}f}, "
                 f"{d['high']:+.{digits}f}] | {c['verdict']} |")
  return "\n".join(lines) + "\n"


def plots(results: dict[str, list[dict]], table: dict, report: Path, *, smooth: int, knobs: dict) -> list[Path]:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  from llamarl_jax import stats

  paths = []
  if any(c in OFF_POLICY_CELLS for c in results):
    paths += off_policy_plots(results, table, report, smooth=smooth)
  if not any(c in CELLS for c in results):
    return paths

  def band(ax, cell, color, label):
    curves = np.array([stats.moving_average(r["steps"]["reward/mean"], smooth) for r in results[cell]])
    x = np.arange(1, curves.shape[1] + 1)
    mean = curves.mean(0)
    if len(curves) > 1:
      half = stats.t_quantile(0.975, len(curves) - 1) * curves.std(0, ddof=1) / np.sqrt(len(curves))
      ax.fill_between(x, mean - half, mean + half, color=color, alpha=0.2, linewidth=0)
    ax.plot(x, mean, color=color, label=f"{label} (n={len(curves)})")

  fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
  colors = plt.get_cmap("tab10").colors
  for i, cell in enumerate(c for c in LAG_CELLS if c in results):
    band(axes[0], cell, colors[i], CELLS[cell][0])
  for i, cell in enumerate(c for c in ("lag0",) + LAG4_CELLS if c in results):
    band(axes[1], cell, colors[i], CELLS[cell][0])
  axes[0].set_title("training reward by policy lag")
  axes[1].set_title("lag 4: correction forms (lag 0 for reference)")
  for ax in axes:
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
  axes[0].set_ylabel(f"reward/mean, {smooth}-step moving average\n(band: 95% t-interval over seeds)")
  fig.tight_layout()
  paths.append(report / "study_reward_curves.png")
  fig.savefig(paths[-1], dpi=110)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(8, 0.5 * len(table) + 1.5))
  names = list(table)
  for y, cell in enumerate(names):
    iv = table[cell]["heldout"]
    ax.errorbar(iv["mean"], y, xerr=[[iv["mean"] - iv["low"]], [iv["high"] - iv["mean"]]], fmt="o",
                color="k", capsize=4)
    ax.scatter(iv["values"], [y] * len(iv["values"]), color=colors[y % 10], alpha=0.5, s=14, zorder=3)
  ax.set_yticks(range(len(names)), [table[c]["description"] for c in names], fontsize=8)
  ax.invert_yaxis()
  ax.set_xlabel(f"held-out greedy accuracy %, mean of the last {knobs['eval_window']} evaluations\n"
                "(black: mean and 95% t-interval over seeds; dots: seeds)")
  ax.grid(axis="x", alpha=0.3)
  fig.tight_layout()
  paths.append(report / "study_heldout.png")
  fig.savefig(paths[-1], dpi=110)
  plt.close(fig)

  fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
  for ax, group in zip(axes, (LAG_CELLS, ("lag0",) + LAG4_CELLS)):
    for i, cell in enumerate(c for c in group if c in results):
      steps = [e["step"] for e in results[cell][0]["evals"]]
      acc = 100 * np.array([[e["eval/accuracy"] for e in r["evals"]] for r in results[cell]])
      mean = acc.mean(0)
      if len(acc) > 1:
        half = stats.t_quantile(0.975, len(acc) - 1) * acc.std(0, ddof=1) / np.sqrt(len(acc))
        ax.fill_between(steps, mean - half, mean + half, color=colors[i], alpha=0.2, linewidth=0)
      ax.plot(steps, mean, "o-", ms=3, color=colors[i], label=f"{CELLS[cell][0]} (n={len(acc)})")
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
  axes[0].set_title("held-out greedy accuracy by policy lag")
  axes[1].set_title("lag 4: correction forms (lag 0 for reference)")
  axes[0].set_ylabel("held-out greedy accuracy %\n(band: 95% t-interval over seeds)")
  fig.tight_layout()
  paths.append(report / "study_heldout_curves.png")
  fig.savefig(paths[-1], dpi=110)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(5.5, 4))
  lags = [(int(c[3:]), table[c]["kl_behaviour"]) for c in LAG_CELLS if c in table]
  if lags:
    x = [lag for lag, _ in lags]
    ax.errorbar(x, [iv["mean"] for _, iv in lags], yerr=[iv["half_width"] for _, iv in lags], fmt="o-",
                capsize=4, color="k", label="AIPO detached, rho 2")
    for lag, iv in lags:
      ax.scatter([lag] * len(iv["values"]), iv["values"], alpha=0.4, s=12, color="tab:blue", zorder=3)
  for i, cell in enumerate(c for c in LAG4_CELLS[1:] if c in table):
    iv = table[cell]["kl_behaviour"]
    ax.errorbar([4 + 0.15 * (i + 1)], [iv["mean"]], yerr=[iv["half_width"]], fmt="s", capsize=3,
                color=colors[i + 1], label=CELLS[cell][0])
  ax.set_xlabel("max_policy_lag")
  ax.set_ylabel("KL(mu‖pi) per token, mean over steps\n(policy/kl_behaviour; 95% t-interval)")
  ax.set_xticks([0, 1, 2, 4])
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  paths.append(report / "study_kl_vs_lag.png")
  fig.savefig(paths[-1], dpi=110)
  plt.close(fig)
  return paths


def off_policy_plots(results: dict[str, list[dict]], table: dict, report: Path, *, smooth: int) -> list[Path]:
  """The off-policy grid's figures: training-reward curves per lag (objectives without / with dynamic sampling), and
  held-out accuracy, KL(mu||pi) and the clipped / masked fraction per objective and lag."""
  import matplotlib.pyplot as plt
  import numpy as np

  from llamarl_jax import stats

  keys = ("aipo", "cispo", "gspo", "seq_tis", "mis")
  colors = dict(zip(keys, plt.get_cmap("tab10").colors))
  paths = []
  fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharey=True)
  for row, dyn in enumerate(("", "_dyn")):
    for col, lag in enumerate((4, 8)):
      ax = axes[row, col]
      for key in keys:
        cell = f"op_lag{lag}_{key}{dyn}"
        if cell not in results:
          continue
        curves = np.array([stats.moving_average(r["steps"]["reward/mean"], smooth) for r in results[cell]])
        x = np.arange(1, curves.shape[1] + 1)
        mean = curves.mean(0)
        if len(curves) > 1:
          half = stats.t_quantile(0.975, len(curves) - 1) * curves.std(0, ddof=1) / np.sqrt(len(curves))
          ax.fill_between(x, mean - half, mean + half, color=colors[key], alpha=0.15, linewidth=0)
        ax.plot(x, mean, color=colors[key], label=f"{key} (n={len(curves)})")
      ax.set_title(f"lag {lag}, {'with' if dyn else 'without'} dynamic sampling")
      ax.grid(alpha=0.3)
      if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="lower right")
      ax.set_xlabel("RL step")
    axes[row, 0].set_ylabel(f"reward/mean, {smooth}-step moving average\n(band: 95% t-interval over seeds)")
  fig.tight_layout()
  paths.append(report / "study_offpolicy_reward_curves.png")
  fig.savefig(paths[-1], dpi=110)
  plt.close(fig)

  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  panels = (("heldout", "held-out greedy accuracy %"), ("kl_behaviour", "KL(mu‖pi) per token"),
            ("frac_truncated", "clipped / truncated / masked fraction"))
  width = 0.2
  for ax, (metric, label) in zip(axes, panels):
    for j, (lag, dyn) in enumerate(((4, ""), (4, "_dyn"), (8, ""), (8, "_dyn"))):
      xs, ys, errs = [], [], []
      for i, key in enumerate(keys):
        cell = f"op_lag{lag}_{key}{dyn}"
        if cell in table and table[cell][metric]["n"]:
          xs.append(i + (j - 1.5) * width)
          ys.append(table[cell][metric]["mean"])
          errs.append(table[cell][metric]["half_width"])
      if xs:
        ax.errorbar(xs, ys, yerr=errs, fmt="o" if not dyn else "s", capsize=3, color=f"C{j}",
                    label=f"lag {lag}{', dyn.' if dyn else ''}")
    ax.set_xticks(range(len(keys)), keys)
    ax.set_ylabel(label + "\n(mean, 95% t-interval over seeds)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=7)
  fig.tight_layout()
  paths.append(report / "study_offpolicy_summary.png")
  fig.savefig(paths[-1], dpi=110)
  plt.close(fig)
  return paths


def report(args, out: Path) -> Path:
  knobs = _study_knobs()
  results = load_results(out, args.cells)
  if not results:
    raise SystemExit(f"no finished runs under {out / 'runs'}: run the study first (without --report_only)")
  before = json.loads((out / "sft" / "eval_before_rl.json").read_text())
  table = summarise(results, eval_window=knobs["eval_window"], threshold=args.threshold,
                    threshold_window=args.threshold_window, rl_steps=knobs["rl_steps"])
  comparisons = []
  for a, b, key, margin, question in QUESTIONS:
    d = compare(table, a, b, key)
    if d is not None:
      comparisons.append({"question": question, "a": a, "b": b, "key": key, "difference": d,
                          "verdict": verdict(d, margin=margin,
                                             better="lower" if key in ("step_seconds", "steps_to_threshold")
                                             else "higher")})
  report_dir = out / "report"
  report_dir.mkdir(parents=True, exist_ok=True)
  md = markdown(table, comparisons, knobs=knobs, threshold=args.threshold,
                threshold_window=args.threshold_window, before=before)
  (report_dir / "study.md").write_text(md)
  _write_json(report_dir / "study.json", {"knobs": knobs, "threshold": args.threshold,
                                          "threshold_window": args.threshold_window, "before_rl": before,
                                          "cells": table, "comparisons": comparisons})
  with open(report_dir / "study.csv", "w", newline="") as f:
    w = csv.writer(f)
    keys = ("heldout", "pass1", "auc", "steps_to_threshold", "kl_behaviour", "frac_truncated", "step_seconds",
            "drop_rate")
    w.writerow(["cell", "description", "n"] + [f"{k}_{s}" for k in keys for s in ("mean", "low", "high")])
    for cell, row in table.items():
      w.writerow([cell, row["description"], row["heldout"]["n"]]
                 + [row[k][s] for k in keys for s in ("mean", "low", "high")])
  paths = plots(results, table, report_dir, smooth=args.smooth, knobs=knobs)
  if args.docs:
    for p in paths:
      shutil.copy(p, ROOT / "docs" / p.name)
  print(md)
  print(f"report: {report_dir} ({', '.join(p.name for p in paths)})")
  return report_dir


def main(argv=None) -> Path:
  args = _parse(argv)

  from llamarl_jax import experiment  # registers the configurables

  experiment.parse_gin(args.gin_file, args.gin_param)
  out = Path(args.out)
  _check_settings(out, _settings(args.cells))
  if not args.report_only:
    t0 = time.perf_counter()
    run_grid(args, out)
    print(f"grid finished in {time.perf_counter() - t0:.0f} s", flush=True)
  return report(args, out)


if __name__ == "__main__":
  main()
