"""Meshes and logical-axis sharding rules (FSDP x TP), nanodo style.

Every mesh has the axes `("data", "fsdp", "expert", "tp")` (sizes may be 1), so one rule table serves
the trainer (fsdp x expert x tp) and the generator (data x expert x tp): an axis of size 1 shards
nothing. `expert` holds a mixture of experts' experts (`model.moe`: each device computes its own
experts for the tokens it sees, the results summed over the axis); dense weights and batches are
replicated over it. Parameters carry
logical axis names (see `llamarl_jax.model.llama`); `RULES` maps them to mesh axes. A dimension not
divisible by its mesh axis is replicated instead (tiny test models on 4 devices, odd vocab sizes).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "expert", "tp")
BATCH_AXES = ("data", "fsdp")

# logical axis -> mesh axis (None = replicated)
RULES: dict[str, str | None] = {
    "vocab": "tp",
    "embed": "fsdp",
    "heads": "tp",
    "kv_heads": "tp",
    "head_dim": None,
    "mlp": "tp",
    "norm": None,
    "expert": "expert",  # MoE experts
}


def make_mesh(devices: Sequence[jax.Device], *, data: int = 1, fsdp: int = 1, tp: int = 1, expert: int = 1) -> Mesh:
  """A `(data, fsdp, expert, tp)` mesh over exactly `data * fsdp * expert * tp` of `devices` (tp innermost)."""
  n = data * fsdp * expert * tp
  if n != len(devices):
    raise ValueError(f"mesh data={data} x fsdp={fsdp} x expert={expert} x tp={tp} = {n} devices, but got "
                     f"{len(devices)}")
  return Mesh(np.asarray(devices, dtype=object).reshape(data, fsdp, expert, tp), MESH_AXES)


def device_counts(*, trainer_fsdp: int = 1, trainer_tp: int = 1, generator_dp: int = 1, generator_tp: int = 1,
                  colocated: bool = False, reward_dp: int = 0, reward_tp: int = 1, trainer_expert: int = 1,
                  generator_expert: int = 1) -> tuple[int, int, int, int]:
  """(trainer, generator, reward model, all) devices of a layout (`MeshConfig`'s fields): colocated,
  the generator's are the trainer's and count once in all."""
  n_train = trainer_fsdp * trainer_expert * trainer_tp
  n_gen = generator_dp * generator_expert * generator_tp
  n_reward = reward_dp * reward_tp
  return n_train, n_gen, n_reward, n_train + (0 if colocated else n_gen) + n_reward


def make_meshes(*, trainer_fsdp: int = 1, trainer_tp: int = 1, generator_dp: int = 1,
                generator_tp: int = 1, colocated: bool = False, reward_dp: int = 0, reward_tp: int = 1,
                trainer_expert: int = 1, generator_expert: int = 1,
                devices: Sequence[jax.Device] | None = None) -> tuple[Mesh, Mesh]:
  """Split `jax.devices()` into disjoint (trainer, generator) meshes.

  The trainer takes the first `trainer_fsdp * trainer_expert * trainer_tp` devices, the generator the
  next `generator_dp * generator_expert * generator_tp`. With `colocated=True` both roles share one
  mesh over the trainer's devices: the generator mesh is the same devices reshaped to
  `(generator_dp, 1, generator_expert, generator_tp)`.
  reward_dp * reward_tp devices after those are the reward model's (`make_reward_mesh`); they are
  counted here so that a layout that does not fit fails at once.
  """
  devices = list(jax.devices() if devices is None else devices)
  n_train, n_gen, n_reward, n_all = device_counts(
      trainer_fsdp=trainer_fsdp, trainer_tp=trainer_tp, generator_dp=generator_dp, generator_tp=generator_tp,
      colocated=colocated, reward_dp=reward_dp, reward_tp=reward_tp, trainer_expert=trainer_expert,
      generator_expert=generator_expert)
  if n_reward and n_all > len(devices):
    raise ValueError(
        f"the reward model's {reward_dp}x{reward_tp} devices come after the trainer's and the generator's "
        f"({n_train if colocated else n_train + n_gen}), but only {len(devices)} devices are available; reduce "
        "MeshConfig.reward_dp / reward_tp, or set reward_dp = 0 to run the reward model on the generator's devices")
  if colocated:
    if n_gen != n_train:
      raise ValueError(f"colocated mode needs generator_dp*generator_expert*generator_tp ({n_gen}) == "
                       f"trainer_fsdp*trainer_expert*trainer_tp ({n_train})")
    if n_train > len(devices):
      raise ValueError(f"colocated mesh needs {n_train} devices, only {len(devices)} available")
    shared = devices[:n_train]
    return (make_mesh(shared, fsdp=trainer_fsdp, expert=trainer_expert, tp=trainer_tp),
            make_mesh(shared, data=generator_dp, expert=generator_expert, tp=generator_tp))
  if n_train + n_gen > len(devices):
    raise ValueError(
        f"trainer ({trainer_fsdp}x{trainer_tp}={n_train}) + generator ({generator_dp}x{generator_tp}="
        f"{n_gen}) need {n_train + n_gen} devices, only {len(devices)} available; reduce the meshes, "
        "use colocated=True, or on CPU fake N devices: python -m llamarl_jax.compat --cpu_devices N -- <command>")
  return (make_mesh(devices[:n_train], fsdp=trainer_fsdp, expert=trainer_expert, tp=trainer_tp),
          make_mesh(devices[n_train:n_train + n_gen], data=generator_dp, expert=generator_expert, tp=generator_tp))


def make_reward_mesh(*, trainer_fsdp: int = 1, trainer_tp: int = 1, generator_dp: int = 1,
                     generator_tp: int = 1, colocated: bool = False, reward_dp: int = 0, reward_tp: int = 1,
                     trainer_expert: int = 1, generator_expert: int = 1,
                     devices: Sequence[jax.Device] | None = None) -> Mesh | None:
  """The reward model's own `(reward_dp, 1, reward_tp)` mesh over the devices after the trainer's and
  the generator's (the same arguments as `make_meshes`); None when reward_dp = 0 (the reward model
  then shares the generator's mesh)."""
  if not reward_dp:
    return None
  devices = list(jax.devices() if devices is None else devices)
  *_, n, end = device_counts(trainer_fsdp=trainer_fsdp, trainer_tp=trainer_tp, generator_dp=generator_dp,
                             generator_tp=generator_tp, colocated=colocated, reward_dp=reward_dp, reward_tp=reward_tp,
                             trainer_expert=trainer_expert, generator_expert=generator_expert)
  start = end - n
  if end > len(devices):
    raise ValueError(f"the reward mesh needs devices {start}..{start + n - 1}, only {len(devices)} available; "
                     "reduce MeshConfig.reward_dp / reward_tp, or set reward_dp = 0 (the generator's devices)")
  return make_mesh(devices[start:start + n], data=reward_dp, tp=reward_tp)


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: Mapping[str, str | None] = RULES) -> P:
  """PartitionSpec for one array; dims not divisible by their mesh axis stay replicated."""
  if len(axes) != len(shape):
    raise ValueError(f"logical axes {tuple(axes)} do not match array rank {len(shape)} (shape {tuple(shape)})")
  spec = []
  for name, dim in zip(axes, shape):
    if name is not None and name not in rules:
      raise KeyError(f"no sharding rule for logical axis {name!r}; known: {sorted(rules)}")
    mesh_axis = None if name is None else rules[name]
    if mesh_axis is not None and (mesh.shape[mesh_axis] == 1 or dim % mesh.shape[mesh_axis]):
      mesh_axis = None
    spec.append(mesh_axis)
  return P(*spec)


def logical_axes(model: nnx.Module) -> dict:
  """Nested dict (same structure as `split_params`) of each parameter's logical axis names."""
  state = nnx.state(model, nnx.Param)
  axes = jax.tree.map(lambda v: v.get_metadata().get("logical_axes"), state,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.to_pure_dict(axes)


def param_shardings(params: Any, axes: Any, mesh: Mesh, rules: Mapping[str, str | None] = RULES) -> Any:
  """NamedSharding pytree for `params` (arrays or ShapeDtypeStructs) given their logical `axes`."""
  return jax.tree.map(lambda ax, p: NamedSharding(mesh, logical_to_spec(ax, p.shape, mesh, rules)),
                      axes, params, is_leaf=lambda x: isinstance(x, tuple))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Shard dim 0 (the batch) over `data` x `fsdp`; the rest replicated."""
  return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def local_value(x: jax.Array) -> np.ndarray:
  """A replicated array's value from this process's own copy (also when the mesh spans processes)."""
  return np.asarray(x.addressable_data(0))


def batch_divisor(mesh: Mesh) -> int:
  """The batch dimension must be a multiple of this to shard over `data` x `fsdp`."""
  return mesh.shape["data"] * mesh.shape["fsdp"]


def to_host(tree):
  """Numpy copy of a pytree of global arrays, on every process that owns part of their meshes.

  Arrays not fully addressable are first replicated inside their own mesh (a collective among the
  processes of that mesh only), so this must be called by all of them.
  """
  def host(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return np.asarray(jax.device_get(x))
    full = jax.jit(lambda y: y, out_shardings=NamedSharding(x.sharding.mesh, P()))(x)
    return np.asarray(full.addressable_data(0))
  return jax.tree.map(host, tree)
