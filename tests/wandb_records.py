"""What an offline Weights & Biases run wrote: the records of `<dir>/wandb/offline-run-*/run-*.wandb`.

The file is W&B's transaction log: a 7-byte header (`:W&B`, magic, version), then LevelDB-log records
(32 KiB blocks; each chunk a 7-byte header of CRC32C, length and type: full, first, middle, last),
each record a `wandb_internal_pb2.Record`. Read here independently of the writer, so a test sees what
reached the disk."""

import glob
import json
import struct
import time
from pathlib import Path

BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(run_dir, timeout_s: float = 60.0) -> list:
  """The run's records once its `exit` record is on disk (W&B's service process writes the file and may
  still be flushing when `finish()` returns); AssertionError after `timeout_s` without one."""
  deadline = time.monotonic() + timeout_s
  while True:
    records = _read(run_dir)
    if any(r.WhichOneof("record_type") == "exit" for r in records):
      return records
    assert time.monotonic() < deadline, f"no exit record in {run_dir}'s W&B log after {timeout_s} s"
    time.sleep(0.2)


def _read(run_dir) -> list:
  from wandb.proto import wandb_internal_pb2 as pb

  paths = glob.glob(str(Path(run_dir) / "wandb" / "offline-run-*" / "run-*.wandb"))
  assert len(paths) <= 1, paths
  data = Path(paths[0]).read_bytes() if paths else b""
  records, pending, pos = [], b"", 7
  if len(data) < 7:
    return records
  assert data[:4] == b":W&B", data[:7]
  while pos + 7 <= len(data):
    if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
      pos += BLOCK - pos % BLOCK
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
    if length == 0 and kind == 0:
      break
    if pos + 7 + length > len(data):  # a chunk still being written
      break
    chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
    if kind in (FULL, LAST):
      record = pb.Record()
      record.ParseFromString(pending + chunk if kind == LAST else chunk)
      records.append(record)
      pending = b""
    else:
      pending = chunk if kind == FIRST else pending + chunk
  return records


def _key(item) -> str:
  return "/".join(item.nested_key) if item.nested_key else item.key


def run_contents(run_dir) -> dict:
  """{"config": {key: value}, "history": [{key: value}, ...], "summary": {key: value}} (W&B's own `_*` keys
  left out; a summary key's last update wins)."""
  out = {"config": {}, "history": [], "summary": {}}
  for r in read_records(run_dir):
    kind = r.WhichOneof("record_type")
    if kind == "run":
      out["config"].update({u.key: json.loads(u.value_json) for u in r.run.config.update})
    elif kind == "config":
      out["config"].update({_key(u): json.loads(u.value_json) for u in r.config.update})
    elif kind == "history":
      out["history"].append({_key(i): json.loads(i.value_json) for i in r.history.item})
    elif kind == "summary":
      out["summary"].update({_key(u): json.loads(u.value_json) for u in r.summary.update})
  strip = lambda d: {k: v for k, v in d.items() if not k.startswith("_")}
  return {"config": strip(out["config"]), "history": [strip(h) | {"_step": h.get("_step")} for h in out["history"]],
          "summary": strip(out["summary"])}
