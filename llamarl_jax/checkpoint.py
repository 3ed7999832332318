"""Checkpoints of a run: trainer state, step, policy version, data position, RNG, and the config that
made them. Resume takes the newest checkpoint that restores completely.

Layout: `<directory>/<step>/` is one checkpoint: Orbax's `state/` (arrays, restored straight onto the
shardings of a target pytree) and `meta/` (JSON), then our `MANIFEST.json`, written last, listing every
file of the checkpoint with its size, and the run config (`run_config`).

Atomic saves: Orbax writes a step into `<step>.orbax-checkpoint-tmp-*` and renames it into place when
its files are complete; the manifest is then written under a temporary name and renamed. A checkpoint
counts only when its manifest exists and every file it lists has the listed size, and old checkpoints
are deleted only after the new manifest is in place, so a kill at any moment leaves the previous
checkpoints intact and usable.

Damage (a file missing or cut short, a manifest missing, data that fails to restore): `restore` logs
the step, the file and what is wrong, and falls back to the next older checkpoint. Damaged checkpoints
are never deleted: once a resume has restored an older step, they are moved to `<directory>/damaged/`
(the run will write those step numbers again) and the move is logged.

Config: `restore(..., config=...)` compares the current run config with the checkpoint's before any
array is read, and raises `IncompatibleCheckpoint` naming every differing setting with both values,
except settings that may change on resume (`RESUMABLE_CHANGES`, e.g. the lr schedule's end) or that
the caller allows.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
_TMP_MARK = ".orbax-checkpoint-tmp"
_FORMAT = 1

# Settings that may differ between a checkpoint and the run resuming it (prefix match): the lr
# schedule's length and end, the meshes (arrays are restored onto the new shardings), microbatching,
# length grouping, packing and remat (reformulations of the same step: the same loss and gradient up to
# float summation order), the held-out evaluation settings (they do not
# change what is trained). Everything else recorded must match.
RESUMABLE_CHANGES = ("optimizer.total_steps", "optimizer.final_lr_ratio", "mesh.", "trainer.microbatches",
                     "trainer.remat", "trainer.group_by_length", "trainer.pack", "trainer.tokens_per_microbatch",
                     "evaluation.", "lora.adapter_path")


class IncompatibleCheckpoint(ValueError):
  """The run's config differs from the checkpoint's in settings that cannot change on resume."""


class NoUsableCheckpoint(FileNotFoundError):
  """Checkpoints exist but none restores completely (each one's problem is in the message)."""


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """{"model": {"hidden_size": 8}} -> {"model.hidden_size": 8}; values made JSON-plain (tuples -> lists)."""
  out: dict[str, Any] = {}
  for k, v in config.items():
    key = f"{prefix}{k}"
    if isinstance(v, Mapping):
      out.update(flatten_config(v, key + "."))
    else:
      out[key] = json.loads(json.dumps(v, default=str))
  return out


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
  """(setting, checkpoint's value, current value) for every flattened setting that differs."""
  a, b = flatten_config(saved), flatten_config(current)
  missing = object()
  return [(k, a.get(k, "<not set>"), b.get(k, "<not set>")) for k in sorted(set(a) | set(b))
          if a.get(k, missing) != b.get(k, missing)]


def check_resume_config(saved: Mapping[str, Any], current: Mapping[str, Any], *, step: int, where: Path,
                        allow: Iterable[str] = ()) -> list[tuple[str, Any, Any]]:
  """Raise `IncompatibleCheckpoint` listing the settings that differ and may not; return the allowed
  differences (the caller logs them)."""
  allowed = tuple(RESUMABLE_CHANGES) + tuple(allow)
  diffs = config_differences(saved, current)
  bad = [d for d in diffs if not any(d[0] == p or (p.endswith(".") and d[0].startswith(p)) or
                                     d[0].startswith(p + ".") for p in allowed)]
  if bad:
    lines = "\n".join(f"  {k}: checkpoint {a!r}, now {b!r}" for k, a, b in bad)
    raise IncompatibleCheckpoint(
        f"cannot resume from step {step} in {where}: the run's config differs from the one that wrote the "
        f"checkpoint in {len(bad)} setting(s) that must not change on resume:\n{lines}\n"
        f"Nothing was changed. Restore those settings, start a new run (another --run_dir), or, if the change "
        f"is intended, allow it: run_experiment.resume_allow_changes = {[k for k, _, _ in bad]!r}")
  return diffs


def _file_sizes(root: Path) -> dict[str, int]:
  return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*"))
          if p.is_file() and p.name != MANIFEST}


def _fsync_dir(path: Path) -> None:
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def _write_json_atomic(path: Path, obj: Any) -> None:
  """Write to `path.tmp`, fsync, rename over `path`: readers see the old file or the whole new one."""
  tmp = path.with_name(path.name + ".tmp")
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1, default=str)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
  _fsync_dir(path.parent)


def checkpoint_problems(directory: str | os.PathLike, step: int) -> list[str]:
  """What is wrong with checkpoint `step` in `directory` ([] when its manifest and every listed file
  are in place with the listed sizes)."""
  root = Path(directory) / str(step)
  manifest = root / MANIFEST
  if not manifest.exists():
    return [f"{manifest} is missing (the save of step {step} did not finish)"]
  try:
    files = json.loads(manifest.read_text())["files"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    return [f"{manifest} is unreadable ({type(e).__name__}: {e})"]
  out = []
  for rel, size in files.items():
    path = root / rel
    try:
      found = path.stat().st_size
    except OSError:
      out.append(f"{path} is missing")
      continue
    if found != size:
      out.append(f"{path} has {found} bytes, expected {size} (truncated or rewritten)")
  return out


def step_dirs(directory: str | os.PathLike) -> list[int]:
  """Every `<step>/` directory in `directory`, complete or not, oldest first."""
  directory = Path(directory)
  if not directory.is_dir():
    return []
  return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def latest_complete_step(directory: str | os.PathLike) -> int | None:
  """The newest complete checkpoint in `directory` (None when there is none). Reads no array."""
  for s in reversed(step_dirs(directory)):
    if not checkpoint_problems(directory, s):
      return s
  return None


def _host_local(x) -> bool:
  """An array whose devices all belong to this process, in a job of several processes (a trainer
  mesh inside one process). Orbax writes only global arrays there, so such arrays go as numpy."""
  sharding = getattr(x, "sharding", None)
  return jax.process_count() > 1 and sharding is not None and sharding.is_fully_addressable


def _savable(x):
  return np.asarray(x) if _host_local(x) else x


class Checkpointer:
  """Saves and restores a run's checkpoints in `directory` (see the module docstring).

  max_to_keep: complete checkpoints kept (the oldest are deleted after a newer one is complete).
  processes: the process ids that save and restore together (the trainer processes of a
  multi-process run; the first one writes the metadata and the manifest); None = every process.
  """

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 3, processes: Iterable[int] | None = None):
    if max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
    self.directory = Path(directory).absolute()
    self.max_to_keep = max_to_keep
    options = ocp.options.MultiprocessingOptions()
    primary = 0
    if processes is not None:
      processes = sorted(processes)
      primary = processes[0]
      options = ocp.options.MultiprocessingOptions(primary_host=primary, active_processes=set(processes),
                                                   barrier_sync_key_prefix="trainer")
    # Every handler gets the process subset, else its barriers would wait for processes that never save.
    handler = ocp.CompositeCheckpointHandler(
        composite_options=ocp.CompositeOptions(multiprocessing_options=options),
        state=ocp.StandardCheckpointHandler(multiprocessing_options=options),
        meta=ocp.JsonCheckpointHandler(multiprocessing_options=options))
    self._ckpt = ocp.Checkpointer(handler, multiprocessing_options=options)
    self._primary = jax.process_index() == primary
    self.skipped: list[tuple[int, str]] = []  # (step, problem) of damaged checkpoints the last restore passed

  # ----------------------------------------------------------------------------------------------
  # what is on disk

  def step_dirs(self) -> list[int]:
    """Every `<step>/` directory, complete or not, oldest first."""
    return step_dirs(self.directory)

  def problems(self, step: int) -> list[str]:
    """What is wrong with checkpoint `step` ([] when it is complete)."""
    return checkpoint_problems(self.directory, step)

  def all_steps(self) -> list[int]:
    """Complete checkpoints, oldest first."""
    return [s for s in self.step_dirs() if not self.problems(s)]

  def latest_step(self) -> int | None:
    """The newest complete checkpoint (manifest and file sizes checked; None when there is none)."""
    return latest_complete_step(self.directory)

  def manifest(self, step: int) -> dict:
    return json.loads((self.directory / str(step) / MANIFEST).read_text())

  # ----------------------------------------------------------------------------------------------
  # save

  def save(self, step: int, state: Any, meta: dict, config: Mapping[str, Any] | None = None) -> None:
    """Write checkpoint `step`: `state` a pytree of arrays, `meta` a JSON-able dict, `config` the run
    config `restore` will compare against. Returns when the checkpoint is complete on disk."""
    step = int(step)
    final = self.directory / str(step)
    if self._primary:
      self.directory.mkdir(parents=True, exist_ok=True)
      self._remove_unfinished_saves()
      if final.exists():  # a damaged or unfinished checkpoint of this step: keep it, out of the way
        self._set_aside(step, "a new checkpoint of the same step is being written")
    state = jax.tree.map(_savable, state)
    self._ckpt.save(final, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta)))
    if not self._primary:
      return
    _write_json_atomic(final / MANIFEST, {"format": _FORMAT, "step": step, "time": time.time(),
                                          "config": dict(config or {}), "files": _file_sizes(final)})
    complete = self.all_steps()
    for old in complete[:max(len(complete) - self.max_to_keep, 0)]:
      shutil.rmtree(self.directory / str(old), ignore_errors=True)

  def _remove_unfinished_saves(self) -> None:
    """Orbax's temporary directories left by a save that was killed: never a checkpoint, only space."""
    for p in self.directory.glob(f"*{_TMP_MARK}*"):
      log.warning("removing %s: the unfinished save of a killed process (it never was a checkpoint)", p)
      shutil.rmtree(p, ignore_errors=True)

  def _set_aside(self, step: int, why: str) -> Path:
    dest = self.directory / "damaged" / f"{step}.{time.strftime('%Y%m%d-%H%M%S')}.{os.getpid()}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(self.directory / str(step), dest)
    log.warning("checkpoint step %d moved to %s (%s); it is kept for inspection, delete it when done", step,
                dest, why)
    return dest

  # ----------------------------------------------------------------------------------------------
  # restore

  def read_meta(self, step: int) -> dict:
    out = self._ckpt.restore(self.directory / str(step), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    return dict(out["meta"])

  def restore(self, target: Any, step: int | None = None, *, config: Mapping[str, Any] | None = None,
              allow_changes: Iterable[str] = ()) -> tuple[int, Any, dict]:
    """(step, state, meta) of checkpoint `step`, or of the newest one that restores completely.

    target: pytree giving the structure, dtypes and shardings of the state, or a function of the
    checkpoint's meta returning it (when the structure depends on what was saved). config: the current
    run config; checked against the checkpoint's (`check_resume_config`) before any array is read.
    Damaged checkpoints newer than the one restored are logged, listed in `self.skipped`, and moved
    to `damaged/` (step=None only; an explicit step that is damaged raises).
    """
    candidates = [step] if step is not None else list(reversed(self.step_dirs()))
    if not candidates:
      raise FileNotFoundError(f"no checkpoint found in {self.directory}")
    def abstract(meta):
      tree = target(meta) if callable(target) else target
      return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
          x.shape, x.dtype, sharding=None if _host_local(x) else getattr(x, "sharding", None)), tree)

    self.skipped = []
    checked_config = False
    for s in candidates:
      problems = self.problems(s)
      if not problems and config is not None and not checked_config:
        changes = check_resume_config(self.manifest(s).get("config", {}), config, step=s, where=self.directory,
                                      allow=allow_changes)
        for k, a, b in changes:
          log.warning("resuming step %d with %s changed: checkpoint %r, now %r", s, k, a, b)
        checked_config = True
      if not problems:
        try:
          meta = self.read_meta(s)
          out = self._ckpt.restore(self.directory / str(s), args=ocp.args.Composite(
              state=ocp.args.StandardRestore(abstract(meta)), meta=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001 - damaged data: reported, then the next older one
          problems = [f"its data failed to restore: {type(e).__name__}: {str(e)[:500]}"]
      if problems:
        self.skipped.append((s, "; ".join(problems)))
        log.warning("checkpoint step %d in %s is damaged and was skipped: %s", s, self.directory,
                    "; ".join(problems))
        continue
      if self._primary:
        for bad, _ in self.skipped:
          if bad > s:
            self._set_aside(bad, f"damaged; the run resumed from step {s} and will write step {bad} again")
      return s, out["state"], dict(out["meta"])
    listing = "\n".join(f"  step {s}: {p}" for s, p in self.skipped)
    raise NoUsableCheckpoint(f"no checkpoint in {self.directory} restores completely:\n{listing}\n"
                             "Nothing was changed; start a new run (another --run_dir) or repair the files")

  def close(self) -> None:
    self._ckpt.close()
