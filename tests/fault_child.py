"""`scripts/train.py` in a fresh interpreter, SIGKILLing itself at a chosen point (for
tests/test_fault_tolerance.py; not a test module).

  python tests/fault_child.py --kill_in_save=4 -- <train.py arguments>
      the save of checkpoint 4 has written its arrays and metadata (Orbax's directory is in place) but
      not yet its manifest: the process dies there, as under a kill -9 or a power cut mid-save.
  python tests/fault_child.py --kill_in_step=5 -- <train.py arguments>
      the trainer has taken the batch of step 5 from the buffer and is about to update: the process dies
      in the middle of the step, with generation of the following batches in flight.
"""

import argparse
import importlib.util
import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _die():
  sys.stdout.flush()
  sys.stderr.flush()
  os.kill(os.getpid(), signal.SIGKILL)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--kill_in_save", type=int, default=None)
  parser.add_argument("--kill_in_step", type=int, default=None)
  args, rest = parser.parse_known_args()
  rest = [a for a in rest if a != "--"]

  from llamarl_jax import checkpoint
  from llamarl_jax.executors import trainer

  if args.kill_in_save is not None:
    write = checkpoint._write_json_atomic

    def write_or_die(path, obj):
      if path.name == checkpoint.MANIFEST and path.parent.name == str(args.kill_in_save):
        _die()
      return write(path, obj)

    checkpoint._write_json_atomic = write_or_die

  if args.kill_in_step is not None:
    step = trainer.TrainerExecutor.step

    def step_or_die(self, batch):
      if self.num_steps + 1 == args.kill_in_step:
        _die()
      return step(self, batch)

    trainer.TrainerExecutor.step = step_or_die

  spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts" / "train.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  module.main(rest)


if __name__ == "__main__":
  main()
