"""The controller's protocol across processes: trainer processes <-> generator processes (<-> reward processes).

One `jax.distributed` job; the trainer mesh belongs to the trainer processes, the generator mesh to
the generator processes (`distributed.derive_roles`). Two kinds of cross-process transfer, both a
`jax.device_put` that every process issues in the same order (`transfer.py`):

  W(v)  policy version v, trainer -> generator (`WeightPlan`: staged on the trainer, one wire
        transfer, fan-out inside the generator mesh; LoRA: `LoraPlan`, the adapters, preceded by the
        frozen base when it changed, which the store mark "staged" = "base" announces)
  R(k)  scored batch k, generator -> trainer, straight into the trainer's batch shardings (`RowPlan`)

With the 'fixed' version schedule every version the generator uses is known in advance, so the
order of transfers is a pure function of (start step, steps, max_policy_lag): `schedule.transfer_schedule`.
W(v) goes just before R(v + max(lag - 1, 0)): late enough that the trainer has trained step v - 1
(it needs R(v - 1), earlier in the order), early enough that the generator has it when batch
v + lag starts. Each process walks that list in one transfer thread, so sends and receives always
match and never deadlock.

Small facts travel through the coordination key-value store (JSON, kilobytes): each batch's
metrics, data position, shapes and timings (set by the generator leader before R(k)), each
generator process's share of the rewards, "W(v) is staged" (so the receiver never waits inside a
transfer), and `Facts` shared once (checkpoint step, evaluation results). Arrays never do.

With a reward model on its own mesh (`MeshConfig.reward_dp`, `RewardConfig.model_path`) a third
group, the reward processes, owns its devices and no transfer touches them: per batch k the
generator leader sets "rm_rows/k" (the reward model's token rows, a JSON list of id lists, built as in
one process: `RewardModelExecutor.batch_rows`) and the reward leader answers "rm_scores/k" (the
scores, float32 values, and the model's metrics). Rows are ids in JSON, up to 8 bytes per token: a
batch of 512 rows of 4k tokens is about 16 MB (the store set and returned 16 MB in 0.35 s on the
2-core CPU machine).

Threads in a trainer process: the controller thread (train step, then stage W(s + 1): both run
programs on the trainer mesh, in step order on every trainer process) and the transfer thread.
In a generator process: the generator thread (every program on the generator mesh: sampling, the
gather of the rollout to host, the weight fan-out), the reward thread (host only: its share of the
rewards in its process pool) and the transfer thread. In a reward process: the controller thread,
which scores the batches in order (every program on the reward mesh).
"""

from __future__ import annotations

from typing import Any

import jax

from llamarl_jax.batch import ROUTING_FIELD, TRAIN_FIELDS


class Facts:
  """A value one process knows and every process needs, shared through the key-value store.

  Every process calls `share` the same number of times in the same order (like a collective); the
  source passes the value (JSON-able), the others get it back.
  """

  def __init__(self, kv, timeout_s: float = 3600.0):
    self.kv, self.timeout_s, self.seq = kv, timeout_s, 0

  def share(self, name: str, value: Any = None, *, source: int) -> Any:
    key = f"facts/{self.seq}/{name}"
    self.seq += 1
    if jax.process_index() == source:
      self.kv.set_json(key, value)
      return value
    return self.kv.get_json(key, self.timeout_s)


def run_key(run: int, *parts) -> str:
  return "/".join([f"run{run}", *map(str, parts)])


class Context:
  """What every process of a multi-process run keeps: roles, the store, facts, the transfer plans.

  weights: the `WeightPlan` (trainer params -> generator layout). `rows(shapes)`: the `RowPlan`
  moving a batch with these shapes into the trainer's batch shardings (cached per shape: prompt
  buckets vary).
  """

  def __init__(self, roles, weights, trainer_mesh, generator_mesh):
    from llamarl_jax.distributed import KVStore

    self.roles, self.weights = roles, weights
    self.trainer_mesh, self.generator_mesh = trainer_mesh, generator_mesh
    self.kv = KVStore()
    self.facts = Facts(self.kv)
    self.me = jax.process_index()
    self.runs = self.pushes = 0
    self._rows: dict = {}

  @property
  def is_trainer(self) -> bool:
    return self.me in self.roles.trainer

  @property
  def is_generator(self) -> bool:
    return self.me in self.roles.generator

  @property
  def generator_rank(self) -> int:
    """This process's index among the generator processes (its share of the rewards)."""
    return self.roles.generator.index(self.me)

  @property
  def lora(self) -> bool:
    """The push is a `LoraPlan`'s (adapters, and the frozen base when it changed)."""
    from llamarl_jax.transfer import LoraPlan

    return isinstance(self.weights, LoraPlan)

  def stage_base(self) -> None:
    """Trainer processes, in step order: LoRA's frozen base is staged if it changed (else nothing)."""
    if self.lora:
      self.weights.stage_base()

  def staged_mark(self) -> str:
    """The store value that marks a push staged: "base" when it carries LoRA's frozen base."""
    return "base" if self.lora and self.weights.base_pending else "1"

  def receive_weights(self, mark: str) -> Any:
    """Generator processes: the receive matching a push whose store mark is `mark`."""
    return self.weights.send(None, with_base=mark == "base") if self.lora else self.weights.send(None)

  def push_weights(self, params: Any = None, timeout_s: float = 3600.0) -> Any:
    """A weight push outside a run (evaluation): every process calls it; trainer processes pass
    their params, generator processes get the generator params back. The receivers start only once
    the trainer has staged the weights (a store key), so no receive waits long inside the transfer."""
    key = f"pushes/{self.pushes}"
    self.pushes += 1
    if self.is_trainer:
      self.stage_base()
      wire = self.weights.stage(params)
      if self.me == self.roles.trainer_leader:  # before the send, which may wait for its receive
        self.kv.set(key, self.staged_mark())
      self.weights.send(wire)
      return None
    return self.weights.finish(self.receive_weights(self.kv.get(key, timeout_s)))

  def new_run(self) -> int:
    self.runs += 1
    return self.runs

  def rows(self, shapes: dict[str, list[int]]):
    from llamarl_jax import parallel
    from llamarl_jax.transfer import RowPlan

    fields = {**TRAIN_FIELDS, **{k: v for k, v in ROUTING_FIELD.items() if k in shapes}}  # routing: when recorded
    key = tuple((k, tuple(shapes[k])) for k in fields)
    if key not in self._rows:
      structs = {k: jax.ShapeDtypeStruct(tuple(shapes[k]), fields[k]) for k in fields}
      dst = {k: parallel.batch_sharding(self.trainer_mesh, len(shapes[k])) for k in fields}
      self._rows[key] = RowPlan(structs, dst, self.generator_mesh)
    return self._rows[key]
