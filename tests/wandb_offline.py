"""Reads an offline Weights & Biases run back (its `run-*.wandb` file: a LevelDB-style log of protobuf
`Record`s in 32 KiB blocks after a 7-byte header), so tests check what was logged without a network."""

import json
from pathlib import Path

BLOCK, HEADER = 32768, 7  # block size; the file header and each record header are 7 bytes
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path):
  """The `wandb_internal_pb2.Record`s of a .wandb file, in order."""
  from wandb.proto import wandb_internal_pb2 as pb

  data = Path(path).read_bytes()
  assert data[:4] == b":W&B", f"{path} is not a wandb datastore"
  pos, parts = HEADER, b""
  while pos + HEADER <= len(data):
    left = BLOCK - pos % BLOCK
    if left < HEADER:  # a block's tail too short for a header is padding
      pos += left
      continue
    length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
    if kind == 0:  # zero padding to the block's end
      pos += left
      continue
    chunk = data[pos + HEADER:pos + HEADER + length]
    pos += HEADER + length
    parts = chunk if kind in (FULL, FIRST) else parts + chunk
    if kind in (FULL, LAST):
      yield pb.Record.FromString(parts)


def read_run(wandb_dir) -> dict:
  """{"config", "history" (one dict per logged row), "summary"} of the newest offline run under `wandb_dir`."""
  (path,) = sorted(Path(wandb_dir).glob("offline-run-*/run-*.wandb"))[-1:]
  config, history, summary = {}, [], {}
  key = lambda item: item.key or "/".join(item.nested_key)  # noqa: E731
  for r in records(path):
    kind = r.WhichOneof("record_type")
    if kind == "run":
      config.update({key(i): json.loads(i.value_json) for i in r.run.config.update})
    elif kind == "config":
      config.update({key(i): json.loads(i.value_json) for i in r.config.update})
    elif kind == "history":
      history.append({key(i): json.loads(i.value_json) for i in r.history.item})
    elif kind == "summary":
      summary.update({key(i): json.loads(i.value_json) for i in r.summary.update})
  config = {k: v.get("value", v) if isinstance(v, dict) else v for k, v in config.items()}
  return {"config": config, "history": history, "summary": summary}
