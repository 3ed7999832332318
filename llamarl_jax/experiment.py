"""The main job: build a policy (HF checkpoint or a tiny random model), optionally warm-start it with
supervised fine-tuning, evaluate, run asynchronous RL with the Controller, evaluate again, export.

Everything here is bound by gin at the edge (`scripts/train.py`); the library code it calls takes
plain arguments.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import Any

import gin
import jax
import numpy as np
from flax import nnx

from llamarl_jax import config as cfg
from llamarl_jax import losses, parallel
from llamarl_jax.checkpoint import latest_complete_step
from llamarl_jax.config_check import RANGES, ConfigError, check_bindings
from llamarl_jax.controller import Controller
from llamarl_jax.data import PromptSource
from llamarl_jax.metrics import START, WANDB_MODES, MetricsLogger, wandb_available
from llamarl_jax.model import hf
from llamarl_jax.model.config import ModelConfig
from llamarl_jax.model.forward import resolve_attention
from llamarl_jax.model.llama import Llama, abstract_model, split_params
from llamarl_jax.shapes import RunShapes
from llamarl_jax.time_breakdown import format_breakdown
from llamarl_jax.train.state import init_state
from llamarl_jax.train.step import StepSpec, train_step

gin.external_configurable(ModelConfig, "ModelConfig")
gin.external_configurable(PromptSource, "PromptSource")
for _cls in (*cfg.SECTIONS.values(), cfg.OptimizerConfig, cfg.OverlongShaping, cfg.DynamicSampling, cfg.LoraConfig,
             cfg.CriticConfig):
  gin.external_configurable(_cls, _cls.__name__)


def parse_gin(files, bindings=()) -> None:
  """`gin.parse_config_files_and_bindings`, first refusing bindings of flat `Controller.*` keys (in the
  files, the files they include, and the bindings), each with the typed key that holds its setting."""
  problems = []
  for text in [*(_gin_text(f) for f in files), *bindings]:
    problems += cfg.flat_binding_problems(text)
  if problems:
    raise ConfigError("the run's settings are typed configs (llamarl_jax/config.py), each set by one key; "
                      "rename these binding(s):\n  " + "\n  ".join(dict.fromkeys(problems)))
  gin.parse_config_files_and_bindings(list(files), list(bindings))


def _gin_text(path, depth: int = 0) -> str:
  """The text of a gin file and of the files it includes (paths as gin resolves them: as written)."""
  import re

  text = Path(path).read_text() if Path(path).exists() else ""
  if depth < 8:
    for inc in re.findall(r"^\s*include\s+['\"]([^'\"]+)['\"]", text, flags=re.M):
      text += "\n" + _gin_text(inc, depth + 1)
  return text


def configured_run_config() -> cfg.RunConfig:
  """The `RunConfig` of the gin bindings (`MeshConfig.*`, `RolloutConfig.*`, ...; defaults where unbound)."""
  sections = {name: gin.get_configurable(cls.__name__)() for name, cls in cfg.SECTIONS.items() if name != "train"}
  try:
    gin.query_parameter("TrainConfig.optimizer")
    train = gin.get_configurable("TrainConfig")()
  except ValueError:  # unbound: the OptimizerConfig.* bindings still apply
    train = gin.get_configurable("TrainConfig")(optimizer=gin.get_configurable("OptimizerConfig")())
  return cfg.RunConfig(train=train, **sections)


def configured_prompt_source() -> PromptSource:
  """`PromptSource()` with the `PromptSource.*` gin bindings (the registration above does not wrap the
  class itself, so a plain `PromptSource()` ignores them)."""
  return gin.get_configurable("PromptSource")()


@gin.configurable
def build_policy(*, model_path: str | None = None, tiny: ModelConfig | None = None, config_json: str | None = None,
                 vocab_size: int | None = None, compute_dtype: str | None = None, seed: int = 0,
                 tokenizer_extra_chars: str = "", weights: bool = True) -> tuple[ModelConfig, Any, Any]:
  """(config, params, tokenizer): from an HF directory, or a random model + char tokenizer.

  The random model's architecture: `config_json` (an HF config.json: a real model's shapes without its
  weights), else `tiny` (a `ModelConfig`, gin-bound), else a 0.8M-parameter default. Its vocabulary is
  the tokenizer's unless `vocab_size` (or config_json) sets a larger one: a real model's embedding and
  lm_head sizes, the ids past the tokenizer's decoding to nothing. compute_dtype: the trainer's
  activations and matmuls (`ModelConfig.dtype`; None: the checkpoint's or config's own, fp32 for a
  checkpoint); the params stay fp32.
  weights=False: params is None (a generator process of a multi-process run: it receives the
  trainer's weights, so it neither reads the checkpoint's tensors nor initialises any; a memory plan).
  """
  if model_path:
    if weights:
      config, model = hf.load_hf_checkpoint(model_path, compute_dtype=compute_dtype)
    else:
      config = hf.config_from_hf(json.loads((Path(model_path) / "config.json").read_text()),
                                 source=str(Path(model_path) / "config.json"), compute_dtype=compute_dtype)
    tokenizer = hf.load_tokenizer(model_path)
    hf.check_tokenizer_matches(tokenizer, config)
    return config, split_params(model)[1] if weights else None, tokenizer
  from llamarl_jax.tokenizer import make_char_tokenizer

  tokenizer = make_char_tokenizer(tokenizer_extra_chars)
  if config_json:
    config = hf.config_from_hf(json.loads(Path(config_json).read_text()), source=str(config_json))
    vocab_size = vocab_size or config.vocab_size
  else:
    config = tiny or ModelConfig(hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2,
                                 max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=True)
  if vocab_size is not None and vocab_size < len(tokenizer):
    raise ConfigError(f"build_policy.vocab_size = {vocab_size} is smaller than the tokenizer's {len(tokenizer)} "
                      "tokens; leave it unset (the tokenizer's) or make it larger")
  config = config.replace(vocab_size=vocab_size or len(tokenizer), **({"dtype": compute_dtype} if compute_dtype else {}))
  if not weights:
    return config, None, tokenizer
  _, params = split_params(Llama(config, rngs=nnx.Rngs(params=seed)))
  return config, params, tokenizer


def mesh_layout() -> dict:
  """The bound `MeshConfig` (its defaults where unbound) as `parallel.make_meshes` arguments: where the
  roles come from."""
  import dataclasses

  return dataclasses.asdict(gin.get_configurable("MeshConfig")())


def process_roles():
  """`distributed.Roles` of this job under the bound config (call after jax.distributed starts)."""
  from llamarl_jax import distributed

  layout = mesh_layout()
  return distributed.derive_roles(*parallel.make_meshes(**layout), reward_mesh=parallel.make_reward_mesh(**layout))


def _sft_batch(tokenizer, examples, completions, prompt_len: int, resp_len: int, env=None):
  """Left-padded prompts and right-padded `completion + eos` as (prompt, mask, response, mask) arrays.
  With a multi-turn `env`, the response is the demonstration episode: model turns (+ eos, mask 1) and
  observations (mask 0)."""
  pad = tokenizer.pad_token_id or 0
  B = len(examples)
  pt = np.full((B, prompt_len), pad, np.int32)
  pm = np.zeros((B, prompt_len), np.int32)
  rt = np.full((B, resp_len), pad, np.int32)
  rm = np.zeros((B, resp_len), np.int32)
  for i, (ex, comp) in enumerate(zip(examples, completions)):
    p = ex.encode(tokenizer)[-prompt_len:]
    segments = [(comp, True)] if env is None else env.demonstration(ex, comp)
    r, m = [], []
    for text, by_model in segments:
      ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if by_model else [])
      r += ids
      m += [int(by_model)] * len(ids)
    r, m = r[:resp_len], m[:resp_len]
    pt[i, prompt_len - len(p):], pm[i, prompt_len - len(p):] = p, 1
    rt[i, :len(r)], rm[i, :len(r)] = r, m
  return pt, pm, rt, rm


@gin.configurable
def supervised_warmstart(config: ModelConfig, params, tokenizer, source: PromptSource, *, steps: int = 300,
                         batch_size: int = 64, learning_rate: float = 3e-3, prompt_len: int = 32,
                         resp_len: int = 16, log_every: int = 50, logger: MetricsLogger | None = None,
                         progress: bool = True, env=None, scan_layers: bool = True, on_params=None,
                         on_params_every: int = 0, weight_decay: float = 0.0, final_lr_ratio: float = 0.1):
  """Maximum-likelihood fine-tuning on the task's reference completions (`source.reference(ex)`).

  This is the warm start before RL, so RL starts from a policy that sometimes succeeds. env: the run's
  `Environment` (None: single-turn): a demonstration is `env.demonstration(example, completion)`, its
  model turns trained on (each + EOS), its observations only context. scan_layers: as
  `TrainConfig.scan_layers` (`scan_hidden_states`). on_params: called as `on_params(step, params)`
  every `on_params_every` steps (a held-out evaluation of the warm start as it trains). The optimizer:
  AdamW, `learning_rate` warmed up over the first tenth of `steps`, then a cosine to
  `learning_rate * final_lr_ratio`; `weight_decay` decoupled, as `OptimizerConfig.weight_decay`.
  """
  # the trainer's step (`train.step.train_step`) with the negative log-likelihood as its loss
  leaf = jax.tree.leaves(params)[0]
  platform = next(iter(leaf.devices())).platform if isinstance(leaf, jax.Array) else jax.default_backend()
  optimizer = cfg.OptimizerConfig(lr=learning_rate, warmup_steps=max(steps // 10, 1), schedule="cosine",
                                  total_steps=max(steps, 1), final_lr_ratio=final_lr_ratio, b2=0.999, max_grad_norm=1.0,
                                  weight_decay=weight_decay)
  spec = StepSpec(model=config, loss=losses.nll_loss, optimizer=optimizer, logprob_chunk=None,
                  attention=resolve_attention("auto", platform, config.dtype), scan_layers=scan_layers,
                  mismatch=False)
  state = init_state(params, spec.tx)
  # The batch goes to the params' devices, replicated (as jit would place host arrays in one process;
  # explicit so that a trainer spread over processes runs the same program); the state keeps its
  # shardings from step to step (one compiled program).
  batch_sharding = (jax.sharding.NamedSharding(leaf.sharding.mesh, jax.sharding.PartitionSpec())
                    if isinstance(getattr(leaf, "sharding", None), jax.sharding.NamedSharding) else None)
  if batch_sharding is None:
    step = jax.jit(functools.partial(train_step, spec))
  else:
    shardings = jax.tree.map(lambda x: x.sharding if isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding)
                             else batch_sharding, state)
    state = jax.device_put(state, shardings)
    step = jax.jit(functools.partial(train_step, spec), out_shardings=(shardings, batch_sharding))

  it = range(steps)
  if progress:
    from tqdm.auto import tqdm
    it = tqdm(it, desc="SFT warm start", dynamic_ncols=True)
  for i in it:
    examples = source.next_batch(batch_size)
    batch = _sft_batch(tokenizer, examples, [source.reference(ex) for ex in examples], prompt_len, resp_len, env=env)
    pt, pm, rt, rm = batch
    batch = {"prompt_tokens": pt, "prompt_mask": pm, "response_tokens": rt, "response_mask": rm,
             "behaviour_logprobs": np.zeros(rt.shape, np.float32), "advantages": np.zeros(len(rt), np.float32),
             "token_versions": np.full(rt.shape, -1, np.int32)}
    if batch_sharding is not None:
      batch = jax.device_put(batch, batch_sharding)
    state, metrics = step(state, batch)
    if on_params is not None and on_params_every and (i + 1) % on_params_every == 0:
      on_params(i + 1, state.params)
    if (i + 1) % log_every == 0 or i + 1 == steps:
      loss = float(np.asarray(metrics["loss/total"].addressable_data(0)))  # replicated; works across processes
      if progress:
        it.set_postfix(nll=f"{loss:.3f}")
      if logger is not None:
        logger.log(i + 1 - steps, {"sft/nll": loss})
  return state.params


def _bound_model_path() -> str | None:
  """`build_policy.model_path` as gin binds it (None when unbound)."""
  try:
    return gin.query_parameter("build_policy.model_path")
  except ValueError:
    return None


def export_lora_adapter(controller: Controller, config: ModelConfig, run_dir: Path, tokenizer, *,
                        base_path: str | None) -> dict:
  """A LoRA run's PEFT adapter directory (`run_dir/lora_adapter`) next to the base it adapts: `base_path`
  (the HF checkpoint the run started from, when no warm start changed it), else an HF export of the
  frozen base (`run_dir/hf_base`). Returns {"adapter_dir", "base_dir"}."""
  from llamarl_jax.model import lora as lora_lib
  from llamarl_jax.model.llama import merge_params
  from llamarl_jax.parallel import to_host

  trainer = controller.trainer
  adapters = to_host(trainer.params)
  base = None if base_path else to_host(trainer.base_params)
  if not controller.is_main:
    return {}
  if base is not None:
    model = merge_params(split_params(abstract_model(config))[0], base)
    base_path = hf.save_hf_checkpoint(model, config, run_dir / "hf_base", tokenizer=tokenizer)
  base_dir = str(Path(base_path).resolve())
  adapter_dir = lora_lib.save_peft_adapter(adapters, config, trainer.lora, run_dir / "lora_adapter",
                                           base_model_name_or_path=base_dir)
  return {"adapter_dir": str(adapter_dir), "base_dir": base_dir}


class RunInterrupted(KeyboardInterrupt):
  """Ctrl-C / SIGTERM stopped `run_experiment`; the message says what is on disk to resume from."""


def _interrupted_message(checkpoint_dir: Path) -> str:
  step = latest_complete_step(checkpoint_dir)
  if step is None:
    return ("interrupted before any checkpoint was written (set-up, SFT warm start or the first RL step): "
            "nothing was saved; run the same command again to start over")
  return f"interrupted: the newest complete checkpoint is step {step} in {checkpoint_dir}; continue with --resume"


@gin.configurable
def run_experiment(*, run_dir: str = "runs/tiny", rl_steps: int = 60, sft_source: PromptSource | None = None,
                   rl_source: PromptSource | None = None, eval_source: PromptSource | None = None,
                   eval_size: int = 256, eval_every: int = 0, eval_samples: int = 0, eval_window: int = 3,
                   sft: bool = True, resume: bool = False, export: bool = True,
                   tensorboard: bool = True, wandb_project: str | None = None, wandb_mode: str | None = None,
                   progress: bool = True, resume_allow_changes: list[str] | tuple[str, ...] = (), memory_check: bool = True,
                   export_sft: bool = False) -> dict:
  """SFT warm start (optional) -> eval -> async RL (eval every `eval_every` steps) -> eval -> HF export.

  Start-up order: gin bindings checked (`config_check`), policy and controller built, prompts checked
  against the model's context, then (with `resume`) the newest complete checkpoint compared with this
  config and restored; only then is anything in `run_dir` written (config, logs rewound to the
  restored step). `resume_allow_changes`: settings allowed to differ from the checkpoint's beyond
  `checkpoint.RESUMABLE_CHANGES` (e.g. ['optimizer.lr']); the evaluation settings below are among them.

  Logs: JSONL, TensorBoard (`tensorboard`) and, with `wandb_project`, Weights & Biases (`wandb_mode`
  'offline' by default: written under run_dir/wandb, needing no network; `wandb sync` uploads it) with
  the run's configuration, every logged row, and at the end the time breakdown and the memory plan.

  Held-out evaluations (`evaluate_and_log`): greedy accuracy, plus a sampled pass@1 from `eval_samples`
  draws per problem when > 0, logged at the step they were taken (JSONL/TensorBoard `eval/*`) and
  listed in the summary's `evals`. `eval_every=0` evaluates only before and after RL; `eval_size = 0`
  skips every evaluation. The summary's `eval_accuracy_window` is the mean greedy accuracy of the last
  `eval_window` evaluations during RL: a single final evaluation swings by several points between
  nearby steps, their mean less. `export_sft`: the warm-started policy is also written as an HF
  checkpoint (`run_dir/sft_export`), a starting point for other runs (`build_policy.model_path`,
  `sft=False`). Returns the summary.

  Before anything is built (one process): the memory plan (`memory_plan.plan_run`; printed, in the
  summary's "memory_plan"); a plan over the device's limit stops the run with its numbers and the
  knobs that help, unless `memory_check` is False. At the end: where the wall time went
  (`time_breakdown`; printed, in the summary's "time_breakdown").

  Across processes every process runs this: the trainer processes do the SFT, training, checkpoints
  and export, the generator processes generation, rewards and the evaluations' sampling; process 0
  (the trainer leader) writes the config, the logs, the summary and the export.
  """
  _check_arguments(rl_steps=rl_steps, eval_size=eval_size, eval_every=eval_every, eval_samples=eval_samples,
                   eval_window=eval_window, wandb_project=wandb_project, wandb_mode=wandb_mode)
  run_dir = Path(run_dir)
  main = jax.process_index() == 0
  progress = progress and main
  t_start = time.perf_counter()
  run_config, shapes, plan = _plan_run(eval_rows=eval_size * max(1, eval_samples), show=progress,
                                       check=memory_check)
  config, params, tokenizer = build_policy(weights=jax.process_index() in process_roles().trainer)
  lora = run_config.train.lora
  if lora is not None and lora.adapter_path and sft:
    raise ConfigError(f"LoraConfig.adapter_path = {lora.adapter_path!r} with run_experiment.sft = True: the warm "
                      "start would fine-tune the base under the adapter; set run_experiment.sft = False")
  rl_source, eval_examples = _prompts(rl_source, eval_source, tokenizer, shapes.prompt_limit, eval_size)
  controller = Controller(config, params, tokenizer, rl_source, run_dir=run_dir, config=run_config, shapes=shapes,
                          progress=progress)
  controller.evaluation_config = {"size": eval_size, "every": eval_every, "samples": eval_samples,
                                  "window": eval_window}  # in checkpoints; may change on resume
  logger = summary = None
  try:
    restored = _resume_or_refuse(controller, run_dir, resume=resume, allow_changes=resume_allow_changes,
                                 progress=progress)
    if main:
      logger = controller.logger = _open_logs(controller, run_dir, restored, tensorboard=tensorboard,
                                              wandb_project=wandb_project, wandb_mode=wandb_mode)
    controller.recorder.breakdown.add("warmup", time.perf_counter() - t_start)  # building and compiling
    summary = _sft_rl_eval_export(controller, config, tokenizer, rl_source, sft_source, eval_examples,
                                  run_dir=run_dir, rl_steps=rl_steps, sft=sft, restored=restored, export=export,
                                  export_sft=export_sft,
                                  eval_every=eval_every, eval_samples=eval_samples, eval_window=eval_window,
                                  logger=logger, progress=progress)
  except KeyboardInterrupt as e:  # Controller.run has already checkpointed the last finished RL step
    raise RunInterrupted(_interrupted_message(controller.run_dir / "checkpoints")) from e
  finally:
    with controller.recorder.breakdown.timed("waits_other"):  # stopping the reward pool and the tools
      controller.close()
    if logger is not None and summary is None:  # a failed or interrupted run: the logs end here
      logger.close()
  _finish_summary(summary, controller, plan, logger, run_dir, seconds=time.perf_counter() - t_start,
                  show=progress, write=main)
  return summary


def _check_arguments(*, wandb_project: str | None, wandb_mode: str | None, **counts: int) -> None:
  """The gin bindings (`config_check`) and `run_experiment`'s own arguments checked, each problem named."""
  check_bindings()
  rules = RANGES["run_experiment"]  # the gin check's rules, also when called from Python
  problems = [f"run_experiment.{k} = {v!r}: expected {why}" for k, v in counts.items() if (why := rules[k](v))]
  if wandb_project and not wandb_available():
    problems.append(f"run_experiment.wandb_project = {wandb_project!r} needs the wandb package: "
                    "pip install -e '.[wandb]' (or unset wandb_project)")
  if wandb_mode not in WANDB_MODES:
    problems.append(f"run_experiment.wandb_mode = {wandb_mode!r}: expected one of {WANDB_MODES}")
  if problems:
    raise ConfigError("; ".join(problems))


def _plan_run(*, eval_rows: int, show: bool, check: bool):
  """(RunConfig, RunShapes, memory plan) of the bound config. The plan (one process; None across
  processes) comes from shapes only: nothing is allocated before it is checked (`check`: a plan over
  the device's limit raises); `show` prints it."""
  run_config = configured_run_config()
  model_config = build_policy(weights=False)[0]
  shapes = RunShapes.of(model_config, run_config)  # one geometry: the memory plan's, the engine's, the data's
  if jax.process_count() > 1:
    return run_config, shapes, None
  from llamarl_jax import memory_plan
  from llamarl_jax.compile_cache import enable_persistent_cache

  enable_persistent_cache()  # on a GPU: the plan's compile of the train step is the run's first one's
  plan = memory_plan.plan_run(model_config, run_config, shapes=shapes, eval_rows=eval_rows)
  if show:
    print(plan.table())
  if check:
    plan.check()
  return run_config, shapes, plan


def _prompts(rl_source: PromptSource | None, eval_source: PromptSource | None, tokenizer, prompt_limit: int,
             eval_size: int) -> tuple[PromptSource, list]:
  """(the RL prompt source, the held-out examples): the sources formatted with the model's chat template
  when they have no tokenizer of their own, and their prompts checked against the generator's limit
  before anything is compiled (an overlong row is refused, file:line, or cut and counted at start, not
  after the engine's warm-up). The examples: `eval_size` of `eval_source`, else of the RL source's
  held-out split."""
  rl_source = configured_prompt_source() if rl_source is None else rl_source
  if rl_source.tokenizer is None:
    rl_source = rl_source.with_tokenizer(tokenizer)
  if eval_source is not None and eval_source.tokenizer is None:
    eval_source = eval_source.with_tokenizer(tokenizer)
  for source in (rl_source, eval_source):
    if source is not None:
      source.limit_prompts(prompt_limit)
  examples = (eval_source or rl_source.heldout()).next_batch(eval_size) if eval_size else []
  return rl_source, examples


def _open_logs(controller: Controller, run_dir: Path, restored: int | None, *, tensorboard: bool,
               wandb_project: str | None, wandb_mode: str | None) -> MetricsLogger:
  """Process 0: the run's gin config written to run_dir (config.gin; config.resume_<step>.gin on a
  resume) and its `MetricsLogger`, rewound to the restored step."""
  run_dir.mkdir(parents=True, exist_ok=True)
  (run_dir / ("config.gin" if restored is None else f"config.resume_{restored}.gin")).write_text(gin.config_str())
  return MetricsLogger(run_dir, tensorboard=tensorboard, wandb_project=wandb_project, wandb_mode=wandb_mode,
                       config={**controller.run_record(), "gin": gin.config_str()} if wandb_project else None,
                       rewind_to=START if restored is None else restored, breakdown=controller.recorder.breakdown)


def _finish_summary(summary: dict, controller: Controller, plan, logger: MetricsLogger | None, run_dir: Path, *,
                    seconds: float, show: bool, write: bool) -> None:
  """The run's total seconds, memory plan and time breakdown added to `summary`; the last two logged
  (then the logs closed), the breakdown printed (`show`), summary.json written (`write`)."""
  summary["total_seconds"] = seconds
  if plan is not None:
    summary["memory_plan"] = plan.as_dict()
  summary["time_breakdown"] = controller.recorder.breakdown.report(seconds, controller.timeline)
  if logger is not None:
    logger.log_summary({k: summary[k] for k in ("time_breakdown", "memory_plan") if k in summary})
    logger.close()
  if show:
    print(format_breakdown(summary["time_breakdown"]))
  if write:
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))


def evaluate_and_log(controller: Controller, examples, *, samples: int = 0,
                     logger: MetricsLogger | None = None) -> dict:
  """One held-out evaluation of the controller's current weights, logged at its step.

  Greedy accuracy and (samples > 0) the sampled pass@1 (`Controller.evaluate`); the sampled pass's seed
  is the step, so every run and cell sees the same noise at the same step. Returns
  {"step", "eval/accuracy", "eval/reward_mean", ["eval/pass1_sampled"], "time/eval"} and the sample
  completions under "samples" (not logged). Across processes every process calls it (the result is
  shared); only the process with a logger logs.
  """
  t0 = time.perf_counter()
  out = controller.evaluate(examples, samples=samples, seed=controller.step)
  row = {"step": controller.step, **{k: v for k, v in out.items() if k != "eval/samples"}}
  row["time/eval"] = time.perf_counter() - t0
  controller.recorder.breakdown.add("evaluation", row["time/eval"])
  if logger is not None:
    logger.log(controller.step, {k: v for k, v in row.items() if k != "step"})
  row["samples"] = out["eval/samples"]
  return row


def run_with_evals(controller: Controller, examples, num_steps: int, *, eval_every: int, samples: int = 0,
                   logger: MetricsLogger | None = None, evals: list | None = None) -> list[dict]:
  """`controller.run(num_steps)` with `evaluate_and_log` after every step divisible by `eval_every`.

  One process: the evaluations run on the controller thread between steps (`run(on_step=)`) while
  the generator keeps working. Across processes (every process calls this): the run is split at the
  evaluation steps, `run` up to one, evaluate in every process, go on; the generator's pipeline
  refills after each evaluation. Either way, under the 'fixed' schedule the evaluations do not change
  what is trained. They are appended to `evals` (also on an interrupt). Returns the steps' metrics.
  """
  evals = [] if evals is None else evals

  def on_step(step: int, _metrics: dict | None) -> None:
    if eval_every and step % eval_every == 0:
      evals.append(evaluate_and_log(controller, examples, samples=samples, logger=logger))

  if controller.mp is None:
    return controller.run(num_steps, on_step=on_step)
  history, end = [], controller.step + num_steps
  while controller.step < end:
    stop = min(end, (controller.step // eval_every + 1) * eval_every) if eval_every else end
    history += controller.run(stop - controller.step)
    on_step(controller.step, None)
  return history


def _resume_or_refuse(controller: Controller, run_dir: Path, *, resume: bool, allow_changes, progress: bool):
  """The restored step (resume), None (a fresh start); raises before writing anything when run_dir holds
  checkpoints and resume is off, or when the checkpoint's config is incompatible / none restores."""
  directory = controller.run_dir / "checkpoints"
  existing = controller.checkpoint_dirs()  # every process calls it: the trainer leader looks
  if existing and not resume:
    raise FileExistsError(f"{run_dir} already holds checkpoints (steps {existing}): pass --resume to continue "
                          "that run, or choose a new --run_dir; nothing was overwritten")
  if not existing:
    if resume and progress:
      print(f"--resume: no checkpoint in {directory}; starting from scratch")
    return None
  step = controller.restore_checkpoint(allow_changes=allow_changes)
  if progress:
    skipped = "".join(f"\n  skipped damaged step {s}: {why}" for s, why in controller.checkpointer.skipped)
    print(f"resumed from step {step} ({directory / str(step)}){skipped}")
  return step


def _export_policy(controller: Controller, config: ModelConfig, tokenizer, path: Path) -> str | None:
  """The trainer's policy (LoRA: merged) as an HF checkpoint at `path`, written by process 0 (every
  trainer process gathers: the params may span them); returns the path there, None elsewhere."""
  from llamarl_jax.model.llama import merge_params
  from llamarl_jax.parallel import to_host

  host = to_host(controller.trainer.policy_params())
  if not controller.is_main:
    return None
  model = merge_params(split_params(abstract_model(config))[0], host)
  return str(hf.save_hf_checkpoint(model, config, path, tokenizer=tokenizer))


def _sft_rl_eval_export(controller: Controller, config, tokenizer, rl_source, sft_source, eval_examples, *,
                        run_dir: Path, rl_steps: int, sft: bool, restored: int | None, export: bool,
                        export_sft: bool, eval_every: int, eval_samples: int, eval_window: int, logger: MetricsLogger,
                        progress: bool) -> dict:
  summary: dict = {"run_dir": str(run_dir), "model_params": config.num_params()}
  before_file = run_dir / "eval_before_rl.json"
  resumed = restored is not None
  if resumed:
    summary["resumed_from_step"] = restored
    summary["skipped_checkpoints"] = [f"step {s}: {why}" for s, why in
                                      (controller.checkpointer.skipped if controller.is_trainer else [])]
  elif sft and controller.is_trainer:
    source = sft_source or rl_source.fork(seed_offset=1)
    env = None
    if controller.config.env.multi_turn:  # demonstrations are episodes (a trainer-only process has no env)
      from llamarl_jax.envs import make_environment

      env = controller.env if controller.env is not None else make_environment(controller.config.env)
    with controller.recorder.breakdown.timed("sft"):
      params = supervised_warmstart(config, controller.trainer.policy_params(), tokenizer, source, logger=logger,
                                    progress=progress, env=env)
      controller.trainer.load_params(params)
    if export_sft:
      with controller.recorder.breakdown.timed("checkpointing"):
        summary["sft_export_dir"] = _export_policy(controller, config, tokenizer, run_dir / "sft_export")
  evaluating = len(eval_examples) > 0  # eval_size = 0 skips every held-out evaluation
  evals: list[dict] = []
  if not evaluating:
    summary["eval_before_rl"] = None
  elif resumed and before_file.exists():  # the baseline is the policy RL started from, not the resume point
    summary["eval_before_rl"] = json.loads(before_file.read_text())["eval/accuracy"]
  else:
    evals.append(evaluate_and_log(controller, eval_examples, samples=eval_samples, logger=logger))
    summary["eval_before_rl"] = evals[-1]["eval/accuracy"]
    if controller.is_main:
      before_file.write_text(json.dumps({"eval/accuracy": summary["eval_before_rl"]}))
  if progress and evaluating:
    print(f"held-out accuracy before RL: {summary['eval_before_rl']:.3f} ({len(eval_examples)} problems)")
  remaining = max(rl_steps - controller.step, 0)
  t_rl = time.perf_counter()
  history = (run_with_evals(controller, eval_examples, remaining, eval_every=eval_every, samples=eval_samples,
                            logger=logger, evals=evals) if remaining else [])
  summary["rl_seconds"] = time.perf_counter() - t_rl
  if evaluating:
    if not evals or evals[-1]["step"] != controller.step:
      evals.append(evaluate_and_log(controller, eval_examples, samples=eval_samples, logger=logger))
    after = evals[-1]
    summary["eval_after_rl"] = after["eval/accuracy"]
    summary["eval_gain_points"] = 100 * (after["eval/accuracy"] - summary["eval_before_rl"])
    summary["samples_after"] = after["samples"]
    during = [e for e in evals if e["step"] > 0][-eval_window:]
    if during:
      summary["eval_accuracy_window"] = float(np.mean([e["eval/accuracy"] for e in during]))
      summary["eval_window_steps"] = [e["step"] for e in during]
    summary["evals"] = [{k: v for k, v in e.items() if k != "samples"} for e in evals]
  if history:
    last = history[-min(10, len(history)):]
    summary["train_reward_last10"] = float(np.mean([m["reward/mean"] for m in last]))
    summary["mean_step_seconds"] = float(np.mean([m["time/step"] for m in history]))
    summary["policy_lag_max"] = float(max(m["policy/lag_max"] for m in history))
  if logger is not None and evaluating:
    logger.log(controller.step, {"eval/accuracy_before": summary["eval_before_rl"],
                                 "eval/accuracy_after": after["eval/accuracy"]})
  if export and controller.is_trainer:
    with controller.recorder.breakdown.timed("checkpointing"):
      summary["export_dir"] = _export_policy(controller, config, tokenizer, run_dir / "hf_export")
      if controller.trainer.lora is not None:
        summary.update(export_lora_adapter(controller, config, run_dir, tokenizer,
                                           base_path=None if sft else _bound_model_path()))
  return summary
