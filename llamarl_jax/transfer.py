"""Cross-process transfers between the trainer's and the generator's meshes (device to device).

JAX moves an array between meshes owned by different processes with one `jax.device_put` that
every process of the job calls, in the same order (the transfer keys are a per-process counter, so
a process that skips a call desynchronises every later one), and only when source and destination
have the same number of devices and identical shard shapes. Two transfers are built on that:

`WeightPlan` (trainer params -> generator layout, the DDMA analogue; T trainer, G generator devices,
generator mesh (dp, fsdp_g, tp_g), one replica = G / dp devices):
  1. stage: on the trainer, cast and reshard the params into the generator's layout expressed on a
     trainer-side mesh `(k, r, fsdp_g, tp_g)` over all T devices (k copies of r replicas);
  2. wire:  replica block 0 of that staging mesh (r * G/dp trainer devices, no copy) -> the first r
     replicas of the generator mesh, one cross-process `device_put`;
  3. fan out (r < dp): inside the generator mesh, the other replicas are filled by one jitted
     select over a `(dp/r, r, fsdp_g, tp_g)` view of it (collectives among generator processes).
  T >= G: r = dp (k = T/G). T < G: r = the largest divisor of dp with r * G/dp <= T.

`LoraPlan` (a LoRA policy): two `WeightPlan`s, the frozen base (only when it changed) and the
adapters (every push); the generator processes merge them on their devices.

`RowPlan` (a batch of rows known on every sending process's host -> any destination shardings,
e.g. the trainer's batch sharding): the destination devices are covered in chunks of at most as
many devices as the source mesh has; chunk j is one array `[c, *shard_shape]` sharded over c source
devices (row i = destination device i's shard, cut on the host) and moved with one `device_put`;
each receiver keeps its own shards and assembles the global arrays without a copy.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def _owned(mesh: Mesh) -> bool:
  me = jax.process_index()
  return any(d.process_index == me for d in mesh.devices.flat)


def _shards_by_device(x: jax.Array) -> dict:
  return {s.device: s.data for s in x.addressable_shards}


def _placeholder(shape, sharding, dtype) -> jax.Array:
  """A global array this process holds no shard of (it still takes part in the transfer call)."""
  return jax.make_array_from_single_device_arrays(tuple(shape), sharding, [], dtype=dtype)


# --------------------------------------------------------------------------------------------------
# weights


@dataclasses.dataclass
class WeightPlan:
  """How params move from the trainer mesh to the generator shardings; see the module docstring.

  gen_shardings: pytree of NamedSharding on the generator mesh (the generator's layout).
  shapes: matching pytree of ShapeDtypeStruct (the dtypes that cross: the generator's).
  """

  gen_shardings: Any
  shapes: Any
  trainer_mesh: Mesh
  transform: Any = None

  def __post_init__(self):
    leaves = jax.tree.leaves(self.gen_shardings)
    self.gen_mesh = gen = leaves[0].mesh
    T, G = self.trainer_mesh.devices.size, gen.devices.size
    dp, rest = gen.devices.shape[0], gen.devices.shape[1:]
    replica = G // dp
    if replica > T:
      raise ValueError(f"one generator replica spans {replica} devices (fsdp x tp {rest}) but the trainer has only "
                       f"{T}: the weight push stages one whole replica on the trainer. Use generator_tp <= "
                       f"trainer_fsdp * trainer_tp")
    r = dp if T >= G else max(d for d in range(1, dp + 1) if dp % d == 0 and d * replica <= T)
    n = r * replica
    if T % n:
      raise ValueError(f"the trainer's {T} devices cannot hold whole copies of {r} generator replica(s) of "
                       f"{replica} devices; choose meshes whose device counts divide each other")
    self.replicas_sent, self.replica_copies = r, dp // r
    axes = ("replica",) + gen.axis_names
    flat = self.trainer_mesh.devices.reshape(-1)
    self.stage_mesh = Mesh(flat.reshape(T // n, r, *rest), axes)
    wire_src = Mesh(flat[:n].reshape(r, *rest), gen.axis_names)
    self.landing_mesh = Mesh(gen.devices[:r], gen.axis_names)
    self.fan_mesh = Mesh(gen.devices.reshape(dp // r, r, *rest), axes)
    on = lambda mesh: jax.tree.map(lambda s: NamedSharding(mesh, s.spec), self.gen_shardings)
    self.stage_shardings, self.wire_src, self.wire_dst = on(self.stage_mesh), on(wire_src), on(self.landing_mesh)
    self.nbytes = int(sum(np.prod(s.shape) * jnp.dtype(s.dtype).itemsize for s in jax.tree.leaves(self.shapes)))
    self._stage = jax.jit(self.transform or (lambda p: p), out_shardings=self.stage_shardings)
    self._fan = jax.jit(lambda t: jax.tree.map(lambda x: x[0], t), out_shardings=self.gen_shardings)

  @property
  def is_trainer(self) -> bool:
    return _owned(self.trainer_mesh)

  @property
  def is_generator(self) -> bool:
    return _owned(self.gen_mesh)

  def stage(self, params: Any) -> Any:
    """Trainer processes (all of them, in step order): transform + reshard into the generator layout
    on the trainer's devices; returns the wire arrays (replica block 0). Dispatched at once, so it
    reads `params` before a later train step donates them."""
    staged = self._stage(params)
    return jax.tree.map(self._replica0, staged, self.wire_src)

  def send(self, wire: Any = None) -> Any:
    """The cross-process `device_put`: every process calls it, in the same order; the trainer
    processes pass `stage`'s result. Returns the landed arrays on generator processes, else None."""
    if wire is None:
      wire = jax.tree.map(lambda s, sh: _placeholder(s.shape, sh, s.dtype), self.shapes, self.wire_src)
    landed = jax.device_put(wire, self.wire_dst)
    return landed if self.is_generator else None

  def finish(self, landed: Any) -> Any:
    """Generator processes (all of them, in the same order): fan the landed replicas out to every
    replica of the generator mesh; returns params in `gen_shardings`."""
    if self.replica_copies == 1:
      return jax.tree.map(lambda x, s: jax.device_put(x, s), landed, self.gen_shardings)
    return self._fan(jax.tree.map(self._stacked, landed, self.gen_shardings))

  def push(self, params: Any = None) -> Any:
    """stage + send + finish in one call (every process; trainer processes pass params)."""
    landed = self.send(self.stage(params) if self.is_trainer else None)
    return self.finish(landed) if self.is_generator else None

  def _replica0(self, x: jax.Array, wire: NamedSharding) -> jax.Array:
    mine = _shards_by_device(x)
    local = [mine[d] for d in wire.mesh.devices.flat if d in mine]
    return jax.make_array_from_single_device_arrays(x.shape, wire, local, dtype=x.dtype)

  def _stacked(self, landed: jax.Array, target: NamedSharding) -> jax.Array:
    """`[dp/r, *shape]` over the fan-out view: block 0 = the landed replicas, the others zeros."""
    sharding = NamedSharding(self.fan_mesh, P("replica", *target.spec))
    shape = (self.replica_copies, *landed.shape)
    got = _shards_by_device(landed)
    shard_shape = sharding.shard_shape(shape)
    pieces = []
    for d in sharding.addressable_devices:
      x = got.get(d)
      pieces.append(x[None] if x is not None else jax.device_put(jnp.zeros(shard_shape, landed.dtype), d))
    return jax.make_array_from_single_device_arrays(shape, sharding, pieces)


# --------------------------------------------------------------------------------------------------
# LoRA


class LoraPlan:
  """A LoRA policy's push across processes: the adapters (fp32) every push, the frozen base (generator
  dtype) only when the trainer's base is not the tree moved last (the first push, after a warm start or
  a restore); the generator processes merge them on their devices (`lora.merge_adapters`).

  base_plan: the `WeightPlan` of the whole model in the generator dtype (its `transform` casts);
  adapter_plan: the `WeightPlan` of the adapters (fp32, shardings of `lora.adapter_axes`);
  base: a callable returning the trainer's frozen base (trainer processes); lora_scale: alpha / rank.

  Trainer processes call `stage_base` in step order with the other programs on their mesh (it stages
  the base when it changed: `base_pending`); the next `send` carries it first. Generator processes
  learn from the sender whether a push carries the base (`send(with_base=...)`, the protocol's store
  mark). `nbytes` (and `shapes`, `wire_src`: what a kept version is) are the adapters'; `last_bytes`
  is what the generator's last receive moved, base included.
  """

  def __init__(self, base_plan: WeightPlan, adapter_plan: WeightPlan, *, base: Any, lora_scale: float, dtype):
    from llamarl_jax.model.lora import merge_adapters

    self.base_plan, self.adapter_plan, self._base_fn = base_plan, adapter_plan, base
    self.nbytes, self.shapes, self.wire_src = adapter_plan.nbytes, adapter_plan.shapes, adapter_plan.wire_src
    self.base_bytes = base_plan.nbytes
    self._base_source = self._base_wire = None   # trainer: the base tree staged last, its wire until sent
    self._landed_bases: dict[int, Any] = {}      # generator: landed bases by arrival number
    self._base_id = self._finished_id = 0
    self._base = None                            # generator: the finished base the versions merge into
    self._lock = threading.Lock()
    self.last_bytes = 0
    self._merge = jax.jit(lambda b, a: merge_adapters(b, a, lora_scale, dtype), out_shardings=base_plan.gen_shardings)

  is_trainer = property(lambda self: self.adapter_plan.is_trainer)
  is_generator = property(lambda self: self.adapter_plan.is_generator)

  @property
  def base_pending(self) -> bool:
    """Trainer processes: the next `send` carries the base."""
    return self._base_wire is not None

  def stage_base(self) -> None:
    """Trainer processes (all of them, in step order): stage the base if it is not the tree staged last."""
    base = self._base_fn()
    if base is not self._base_source:
      self._base_wire, self._base_source = self.base_plan.stage(base), base

  def stage(self, adapters: Any) -> Any:
    """Trainer processes: the adapters' wire arrays (`WeightPlan.stage`)."""
    return self.adapter_plan.stage(adapters)

  def send(self, wire: Any = None, *, with_base: bool = False) -> Any:
    """Every process, in the same order: trainer processes pass `stage`'s result (and send the staged
    base first when one is pending), generator processes say whether the base comes too. Returns
    (base number, landed adapters) on generator processes, else None."""
    if self.is_trainer:
      if self._base_wire is not None:
        self.base_plan.send(self._base_wire)
        self._base_wire = None
      self.adapter_plan.send(wire)
      return None
    moved = 0
    if with_base:
      landed_base = self.base_plan.send(None)
      moved += _global_bytes(landed_base)
      with self._lock:
        self._base_id += 1
        self._landed_bases[self._base_id] = landed_base
    landed = self.adapter_plan.send(None)
    self.last_bytes = moved + _global_bytes(landed)
    with self._lock:
      return self._base_id, landed

  def finish(self, landed: Any) -> Any:
    """Generator processes (all of them, in the same order): fan out the landed adapters (and a newly
    landed base) inside the generator mesh and merge; returns params in `base_plan.gen_shardings`."""
    base_id, adapters = landed
    if base_id == 0:
      raise RuntimeError("LoRA adapters arrived before any base: the trainer's first push must carry the "
                         "frozen base (stage_base before the first send)")
    if base_id != self._finished_id:
      with self._lock:
        base = self._landed_bases.pop(base_id)
        for old in [i for i in self._landed_bases if i < base_id]:
          del self._landed_bases[old]
      self._base, self._finished_id = None, base_id  # the old base's memory goes before the new one lands
      self._base = self.base_plan.finish(base)
    return self._merge(self._base, self.adapter_plan.finish(adapters))


def _global_bytes(tree: Any) -> int:
  return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


# --------------------------------------------------------------------------------------------------
# rows


@dataclasses.dataclass
class RowPlan:
  """Host arrays on the sending processes -> global arrays in `dst_shardings` (see the docstring).

  shapes: pytree of ShapeDtypeStruct of the whole arrays; dst_shardings: matching NamedShardings
  (on one destination mesh); src_mesh: the sending processes' mesh (any shape: its devices are used).
  """

  shapes: Any
  dst_shardings: Any
  src_mesh: Mesh

  def __post_init__(self):
    self.dst_mesh = jax.tree.leaves(self.dst_shardings)[0].mesh
    dst, src = list(self.dst_mesh.devices.flat), list(self.src_mesh.devices.flat)
    c = min(len(src), len(dst))
    self.chunks = [dst[i:i + c] for i in range(0, len(dst), c)]
    self._src = src

  @property
  def is_sender(self) -> bool:
    return _owned(self.src_mesh)

  @property
  def is_receiver(self) -> bool:
    return _owned(self.dst_mesh)

  def send(self, host: Any = None) -> Any:
    """Every process calls this, in the same order; senders pass the host arrays (the same on each
    sender), receivers get the global arrays back (others None)."""
    received: list[dict] = []
    for chunk in self.chunks:
      src_mesh = Mesh(np.asarray(self._src[:len(chunk)]), ("w",))
      dst_mesh = Mesh(np.asarray(chunk), ("w",))

      def wire(shape_struct, dst_sharding, array=None, mesh=src_mesh, chunk=chunk):
        shard_shape = dst_sharding.shard_shape(shape_struct.shape)
        sharding = NamedSharding(mesh, P("w"))
        shape = (len(chunk), *shard_shape)
        if array is None:
          return _placeholder(shape, sharding, shape_struct.dtype)
        index = dst_sharding.devices_indices_map(shape_struct.shape)
        mine = {d: i for i, d in enumerate(mesh.devices.flat) if d.process_index == jax.process_index()}
        pieces = [jax.device_put(np.asarray(array[index[chunk[i]]], shape_struct.dtype)[None], d)
                  for d, i in mine.items()]
        return jax.make_array_from_single_device_arrays(shape, sharding, pieces, dtype=shape_struct.dtype)

      if self.is_sender:
        wires = jax.tree.map(lambda s, d, a: wire(s, d, a), self.shapes, self.dst_shardings, host)
      else:
        wires = jax.tree.map(lambda s, d: wire(s, d), self.shapes, self.dst_shardings)
      dst_wire = jax.tree.map(lambda _: NamedSharding(dst_mesh, P("w")), self.shapes)
      moved = jax.device_put(wires, dst_wire)
      received.append(moved)
    if not self.is_receiver:
      return None

    def assemble(shape_struct, dst_sharding, *parts):
      pieces = [s.data[0] for part in parts for s in part.addressable_shards]
      return jax.make_array_from_single_device_arrays(shape_struct.shape, dst_sharding, pieces,
                                                      dtype=shape_struct.dtype)

    return jax.tree.map(assemble, self.shapes, self.dst_shardings, *received)
