"""The runner loops against stand-ins for their executors and transport (no JAX program runs): what a
loop writes when it is interrupted, and the generator timer shared by two threads."""

import json
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from llamarl_jax.config import RunConfig, ScheduleConfig
from llamarl_jax.executors.generator import Timer
from llamarl_jax.batch import TRAIN_FIELDS
from llamarl_jax.multiprocess.protocol import run_key
from llamarl_jax.runners import trainer_process
from llamarl_jax.runners.common import Executors, RunState, StepRecorder
from llamarl_jax.schedule import versions_kept


class _Store:
  """The coordination store's get / set / delete (values set before the run)."""

  def __init__(self, values):
    self.values = dict(values)

  def get(self, key, timeout):
    if key not in self.values:
      raise TimeoutError(key)
    return self.values[key]

  def set(self, key, value):
    self.values[key] = value

  def delete(self, key):
    self.values.pop(key, None)


class _Trainer:
  """A trainer whose `params` is its step count; the `fail_at`-th step raises `error`."""

  def __init__(self, fail_at, error):
    self.params, self.calls, self.fail_at, self.error = 0, 0, fail_at, error

  def step(self, batch):
    self.calls += 1
    if self.calls == self.fail_at:
      raise self.error
    self.params += 1
    return {"loss/total": 0.0}


def _trainer_process_run(num_steps, fail_at, error, *, lag=1, checkpoint_every=0):
  """trainer_process.run over a stand-in transport whose batches are all in the store; returns the
  checkpoints written (their RunStates) and the raised exception."""
  shapes = {k: [2, 4] for k in TRAIN_FIELDS}
  meta = {"shapes": shapes, "data_state": None, "metrics": {}, "sync": {}, "tokens": 8.0,
          "generator_times": [0.0, 0.0], "reward_times": [0.0, 0.0],
          "lag": {"policy/lag_max": 0.0, "policy/lag_min": 0.0}}
  store = _Store({run_key(1, "batch", k): json.dumps(meta) for k in range(num_steps)})
  arrays = {k: np.zeros((2, 4), dtype) for k, dtype in TRAIN_FIELDS.items()}
  weights = SimpleNamespace(nbytes=0, stage=lambda params: ("wire", params), send=lambda wire: None)
  mp = SimpleNamespace(me=0, roles=SimpleNamespace(trainer_leader=0), new_run=lambda: 1, kv=store,
                       weights=weights, rows=lambda shapes: SimpleNamespace(send=lambda _: arrays),
                       stage_base=lambda: None, staged_mark=lambda: "1")  # no LoRA: no base to stage
  saved = []
  recorder = StepRecorder(checkpoint_every=checkpoint_every, save=saved.append)
  config = RunConfig(schedule=ScheduleConfig(max_policy_lag=lag, step_timeout_s=10.0))
  with pytest.raises(type(error)) as info:
    trainer_process.run(Executors(trainer=_Trainer(fail_at, error), mp=mp), RunState(), recorder, config, num_steps)
  return saved, info.value


def test_an_interrupted_trainer_process_checkpoints_its_last_step_with_the_weights_resume_needs():
  """Ctrl-C (or SIGTERM) during step 2 of 5: the checkpoint of step 2 is written, and it holds the
  generator weights of version 1 that batch 2 is generated with at lag 1, so the resume is exact."""
  saved, _ = _trainer_process_run(5, fail_at=3, error=KeyboardInterrupt())
  assert [s.step for s in saved] == [2]
  assert versions_kept(2, 1, first_version=0) == [1]
  assert saved[0].kept[1] == ("wire", 1)  # staged from the params after one step


def test_a_failed_trainer_process_leaves_the_newest_periodic_checkpoint():
  """Another failure writes nothing more (a peer may be gone and never join the write)."""
  saved, error = _trainer_process_run(5, fail_at=4, error=ValueError("bad batch"), checkpoint_every=2)
  assert [s.step for s in saved] == [2] and str(error) == "bad batch"


def test_the_generator_timer_loses_no_second_to_a_concurrent_take():
  """One thread adds 1 s 20000 times while another takes the total: what was taken adds up exactly."""
  timer, taken, done = Timer(), [], threading.Event()

  def add():
    try:
      for _ in range(20_000):
        timer.add(busy=1.0, wait=2.0)
    finally:
      done.set()

  thread = threading.Thread(target=add)
  thread.start()
  while not done.is_set():
    taken.append(timer.take())
  thread.join()
  taken.append(timer.take())
  assert sum(b for b, _ in taken) == 20_000 and sum(w for _, w in taken) == 40_000
