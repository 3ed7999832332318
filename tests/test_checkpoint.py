"""Checkpointer: damaged checkpoints are reported and skipped, configs are compared before anything is
read, retention never deletes the only good checkpoint; MetricsLogger rewinds its logs on resume.

Small pytrees on the default CPU device: the point is the file protocol, not the arrays.
"""

import json
import logging
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llamarl_jax.checkpoint import (MANIFEST, Checkpointer, IncompatibleCheckpoint, NoUsableCheckpoint,
                                    config_differences)
from llamarl_jax.metrics import START, MetricsLogger

CONFIG = {"model": {"hidden_size": 32, "num_layers": 2}, "optimizer": {"lr": 1e-3, "total_steps": 100},
          "max_policy_lag": 1, "mesh": {"trainer": [1, 2, 1]}, "data": {"task": "arithmetic", "seed": 0}}


def _state(step):
  return {"params": {"w": jnp.full((4, 8), float(step)), "b": jnp.arange(3.0) + step}, "step": jnp.int32(step)}


@pytest.fixture
def three_checkpoints(tmp_path):
  ck = Checkpointer(tmp_path / "ck", max_to_keep=3)
  for s in (2, 4, 6):
    ck.save(s, _state(s), {"step": s}, config=CONFIG)
  yield ck
  ck.close()


def _largest_file(ck, step):
  files = json.loads((ck.directory / str(step) / MANIFEST).read_text())["files"]
  return ck.directory / str(step) / max(files, key=files.get)


def test_restore_takes_the_newest_complete_checkpoint(three_checkpoints):
  ck = three_checkpoints
  step, state, meta = ck.restore(_state(0), config=CONFIG)
  assert (step, meta) == (6, {"step": 6}) and ck.skipped == []
  np.testing.assert_array_equal(state["params"]["w"], np.full((4, 8), 6.0))


@pytest.mark.parametrize("damage", ["truncate", "delete", "no_manifest"])
def test_a_damaged_newest_checkpoint_falls_back_with_a_warning_naming_the_file(three_checkpoints, damage, caplog):
  ck = three_checkpoints
  victim = _largest_file(ck, 6)
  if damage == "truncate":  # a kill during a copy, a full disk
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
  elif damage == "delete":
    victim.unlink()
  else:
    victim = ck.directory / "6" / MANIFEST
    victim.unlink()
  with caplog.at_level(logging.WARNING, logger="llamarl_jax.checkpoint"):
    step, state, _ = ck.restore(_state(0), config=CONFIG)
  assert step == 4 and float(state["params"]["b"][0]) == 4.0
  assert [s for s, _ in ck.skipped] == [6] and str(victim) in ck.skipped[0][1]
  assert any("step 6" in r.message and str(victim) in r.message for r in caplog.records)
  # never deleted: moved aside (the run writes step 6 again), the move logged
  moved = list((ck.directory / "damaged").iterdir())
  assert len(moved) == 1 and moved[0].name.startswith("6.") and not (ck.directory / "6").exists()
  assert any(str(moved[0]) in r.message for r in caplog.records)
  ck.save(6, _state(60), {"step": 6}, config=CONFIG)  # the step number is free again
  assert ck.restore(_state(0), config=CONFIG)[0] == 6


def test_data_that_fails_to_restore_falls_back(three_checkpoints):
  """Same size, garbage bytes: only the restore itself can tell."""
  ck = three_checkpoints
  victim = _largest_file(ck, 6)
  victim.write_bytes(b"\x00" * victim.stat().st_size)
  step, _, _ = ck.restore(_state(0), config=CONFIG)
  assert step == 4 and "failed to restore" in ck.skipped[0][1]


def test_no_usable_checkpoint_lists_every_problem(tmp_path):
  ck = Checkpointer(tmp_path / "ck")
  ck.save(1, _state(1), {}, config=CONFIG)
  (ck.directory / "1" / MANIFEST).unlink()
  with pytest.raises(NoUsableCheckpoint, match=r"step 1: .*MANIFEST.json is missing"):
    ck.restore(_state(0), config=CONFIG)
  assert (ck.directory / "1").exists()  # nothing moved when nothing was restored


def test_changed_config_lists_every_difference_and_touches_nothing(three_checkpoints):
  ck = three_checkpoints
  before = sorted(p.relative_to(ck.directory) for p in ck.directory.rglob("*"))
  changed = json.loads(json.dumps(CONFIG))
  changed["model"]["hidden_size"] = 64
  changed["max_policy_lag"] = 2
  changed["optimizer"]["total_steps"] = 500  # a new lr schedule end: allowed
  changed["mesh"]["trainer"] = [1, 1, 2]      # restored onto new shardings: allowed
  changed.setdefault("trainer", {}).update(pack=True, tokens_per_microbatch=256)  # the same step, packed: allowed
  with pytest.raises(IncompatibleCheckpoint) as info:
    ck.restore(_state(0), config=changed)
  msg = str(info.value)
  assert "model.hidden_size: checkpoint 32, now 64" in msg and "max_policy_lag: checkpoint 1, now 2" in msg
  assert "total_steps" not in msg and "mesh" not in msg and "pack" not in msg and "resume_allow_changes" in msg
  assert sorted(p.relative_to(ck.directory) for p in ck.directory.rglob("*")) == before
  step, _, _ = ck.restore(_state(0), config=changed, allow_changes=["model.hidden_size", "max_policy_lag"])
  assert step == 6


def test_config_differences_reports_added_and_removed_settings():
  assert config_differences({"a": {"b": 1}, "c": 2}, {"a": {"b": 1}, "d": (1, 2)}) == [
      ("c", 2, "<not set>"), ("d", "<not set>", [1, 2])]


def test_retention_keeps_the_newest_complete_checkpoints(tmp_path):
  ck = Checkpointer(tmp_path / "ck", max_to_keep=2)
  for s in (1, 2, 3):
    ck.save(s, _state(s), {}, config=CONFIG)
  assert ck.all_steps() == [2, 3]
  (ck.directory / "3" / MANIFEST).unlink()  # the newest became incomplete: it does not count
  ck.save(4, _state(4), {}, config=CONFIG)
  assert ck.all_steps() == [2, 4] and ck.step_dirs() == [2, 3, 4]  # 3 is left for a resume to report
  ck.close()


# ---- metrics rewind ----

def _tb_events(tb_dir):
  """(step, tag or 'START') of every event in the TensorBoard files of `tb_dir`, in file order."""
  from tensorboardX.proto import event_pb2

  out = []
  for path in sorted(tb_dir.glob("events.out.tfevents.*")):
    data = path.read_bytes()
    pos = 0
    while pos < len(data):
      (n,) = struct.unpack("<Q", data[pos:pos + 8])
      ev = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
      pos += 12 + n + 4
      if ev.HasField("summary"):
        out += [(ev.step, v.tag) for v in ev.summary.value]
      elif ev.HasField("session_log") and ev.session_log.status == ev.session_log.START:
        out.append((ev.step, "START"))
  return out


def test_logs_rewind_to_the_restored_step(tmp_path):
  log = MetricsLogger(tmp_path, tensorboard=True)
  for s in range(1, 6):
    log.log(s, {"reward/mean": s / 10})
  log.close()
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 6, "reward/me')  # a line cut short by kill -9
  log = MetricsLogger(tmp_path, tensorboard=True, rewind_to=3)  # resumed from the step-3 checkpoint
  assert log.dropped_rows == 3
  for s in range(4, 7):
    log.log(s, {"reward/mean": s})
  log.close()
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
  assert [r["reward/mean"] for r in rows[3:]] == [4.0, 5.0, 6.0]
  assert len((tmp_path / "metrics.dropped.jsonl").read_text().splitlines()) == 3  # kept, not lost
  # TensorBoard: the new file starts with a purge marker at step 4, so 4 and 5 of the first file go
  assert (4, "START") in _tb_events(tmp_path / "tb")
  assert MetricsLogger(tmp_path, tensorboard=False, rewind_to=START).dropped_rows == 6
