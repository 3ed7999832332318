#!/usr/bin/env python
"""Bytes one MoE layer sends over the `expert` mesh axis: replicate-and-sum against token dispatch
(`moe.grouped_swiglu`'s `expert_parallel`), forward and forward + backward, per device.

Each program is one MoE layer's grouped matmuls (`moe.grouped_swiglu` of routed tokens) on a mesh of
expert x fsdp devices, the tokens sharded over fsdp (each fsdp group holds --tokens of them) and
replicated over `expert`, the experts' weights sharded over `expert`:

  forward   the layer's output `[tokens, embed]`, replicated over `expert` (as the next layer takes it)
  step      the output and the gradients (`jax.vjp`) of x and the routing weights (replicated over
            `expert`, as the layer below takes them) and of the experts' weights

Ways: 'replicate' (psum of the output over `expert`), 'dispatch' (each token's k rows exchanged with
the experts' owners by `ragged_all_to_all`, the output all-gathered), 'dispatch_dense' (the same
exchange as a dense all-to-all at the dropless worst-case capacity), and, for the forward, 'gspmd':
`grouped_swiglu` without a mesh under XLA's own partitioning (a forward not given its mesh).

Columns (MiB per device per layer): `hlo` sums what the compiled program's collectives over `expert`
send (`measure.hlo.collectives`: ring algorithms; a ragged all-to-all at its bound, every row of its
send buffer to another device); `sent` is the same with each ragged all-to-all at what it sends for
the routing (H100: uniform routing, n k (EP-1)/EP rows of a device's n tokens; --cpu: the rows this
run's routing sends, the busiest device's); `model` is `moe.expert_parallel_bytes`; `batch axes`
is what the other collectives send (the experts' weight gradients summed over fsdp: the same every way).

  # compiled for 8 H100s without a GPU (JAX's CUDA plugin: `make install-cuda-compile`), 30B-A3B shapes
  LLAMARL_CUDA_COMPILE=1 JAX_PLATFORMS=cpu,cuda JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 PYTHONPATH=.cuda-site \\
    PATH=.cuda-site/nvidia/cuda_nvcc/bin:$PATH python -m scripts.bench_moe_dispatch [--k 8,2]
  python -m scripts.bench_moe_dispatch --cpu     # toy sizes on 8 fake CPU devices, run and checked
"""

from __future__ import annotations

import argparse
import time

from llamarl_jax import compat  # noqa: E402  (no jax import: before JAX starts)

compat.ensure_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from llamarl_jax import parallel  # noqa: E402
from llamarl_jax.measure import hlo  # noqa: E402
from llamarl_jax.model import moe  # noqa: E402

MESHES = ((8, 1), (4, 2), (2, 4))  # (expert, fsdp) over 8 devices
# Qwen3-30B-A3B's MoE layer (configs/qwen3_30b_a3b.gin); --cpu: a toy one
A3B = {"embed": 2048, "width": 768, "experts": 128, "dtype": "bfloat16"}
TOY = {"embed": 64, "width": 32, "experts": 16, "dtype": "float32"}
MIB = 2 ** 20


def layer(mesh, way):
  """(forward, step) of one MoE layer over `mesh` the `way` given (see the module docstring)."""
  m = None if way == "gspmd" else mesh
  ep = None if way == "gspmd" else way

  def forward(x, experts, weights, w_gate, w_up, w_down):
    return moe.grouped_swiglu(x, experts, weights, (w_gate, w_up), w_down, m, expert_parallel=ep)

  def step(x, experts, weights, w_gate, w_up, w_down, ct):
    out, vjp = jax.vjp(lambda x, g, a, b, c: forward(x, experts, g, a, b, c), x, weights, w_gate, w_up, w_down)
    return out, vjp(ct)

  tok, exp = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P("expert"))
  return (jax.jit(forward, out_shardings=tok),
          jax.jit(step, out_shardings=(tok, (tok, tok, exp, exp, exp))))


def inputs(mesh, tokens, k, embed, width, experts, dtype, concrete, seed=0):
  """The layer's inputs over `mesh`: --tokens per fsdp group; abstract (`jax.ShapeDtypeStruct`) or,
  concrete, random (uniform routing: each token's k experts drawn without replacement)."""
  N = tokens * mesh.shape["fsdp"]
  dt = jnp.dtype(dtype)
  tok, exp = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P("expert"))
  spec = [((N, embed), dt, tok), ((N, k), jnp.int32, tok), ((N, k), dt, tok), ((experts, embed, width), dt, exp),
          ((experts, embed, width), dt, exp), ((experts, width, embed), dt, exp), ((N, embed), dt, tok)]
  if not concrete:
    return [jax.ShapeDtypeStruct(s, d, sharding=sh) for s, d, sh in spec]
  rng = np.random.RandomState(seed)
  values = [rng.randn(*spec[0][0]), np.argsort(rng.rand(N, experts), axis=1)[:, :k], rng.rand(N, k),
            rng.randn(*spec[3][0]) / np.sqrt(embed), rng.randn(*spec[4][0]) / np.sqrt(embed),
            rng.randn(*spec[5][0]) / np.sqrt(width), rng.randn(*spec[6][0])]
  return [jax.device_put(np.asarray(v, d), sh) for v, (_, d, sh) in zip(values, spec)]


def spans_expert(groups, mesh) -> bool:
  """Whether a collective of these replica groups (device positions in the mesh; () for one group of
  all devices) moves data between devices of different `expert` index."""
  if not groups:
    return mesh.shape["expert"] > 1
  coord = lambda d: np.unravel_index(d, mesh.devices.shape)[mesh.axis_names.index("expert")]
  return any(len({coord(d) for d in g}) > 1 for g in groups)


def routed_rows(experts: np.ndarray, mesh, k: int, num_experts: int) -> float:
  """Rows the busiest device sends to other devices in one ragged exchange (dispatch: its 1/EP of
  its group's tokens, each choice to its expert's owner), for this routing `[N, k]`."""
  EP, groups = mesh.shape["expert"], mesh.shape["fsdp"]
  owner = experts.reshape(groups, EP, -1, k) // (num_experts // EP)  # [group, device, tokens, k]
  return float(np.max(np.sum(owner != np.arange(EP)[None, :, None, None], axis=(2, 3))))


def measure(mesh, way, tokens, k, sizes, concrete):
  """{program: figures} of `way` over `mesh`."""
  fwd, step = layer(mesh, way)
  args = inputs(mesh, tokens, k, **sizes, concrete=concrete)
  EP = mesh.shape["expert"]
  row = sizes["embed"] * jnp.dtype(sizes["dtype"]).itemsize
  if concrete:
    ragged_rows = routed_rows(np.asarray(args[1]), mesh, k, sizes["experts"])
  else:  # uniform routing: (EP-1)/EP of a device's n k rows leave it
    ragged_rows = tokens / EP * k * (EP - 1) / EP
  model = moe.expert_parallel_bytes(dict(mesh.shape), tokens * mesh.shape["fsdp"], k, sizes["embed"],
                                    sizes["experts"], jnp.dtype(sizes["dtype"]).itemsize).get(way)
  out = {}
  for name, fn, a in (("forward", fwd, args[:6]), ("step", step, args)):
    if way == "gspmd" and name == "step":
      continue
    t0 = time.perf_counter()
    compiled = fn.lower(*a).compile()
    seconds = time.perf_counter() - t0
    found = hlo.collectives(compiled.as_text())
    over_expert = [c for c in found if spans_expert(c["groups"], mesh)]
    other = [c for c in found if not spans_expert(c["groups"], mesh)]
    # the row exchanges: ragged all-to-alls, or on a CPU (no ragged all-to-all) 'dispatch''s dense
    # stand-in, the all-to-alls of `[EP, capacity, embed]` rows: counted at what the ragged form sends
    cap = tokens // EP * min(k, sizes["experts"] // EP)
    exchanges = [c for c in over_expert if c["op"] == "ragged-all-to-all" or (
        way == "dispatch" and c["op"] == "all-to-all" and c["operand_bytes"] == EP * cap * row)]
    bound = sum(c["sent_bytes"] for c in over_expert)
    sent = bound - sum(c["sent_bytes"] for c in exchanges) + len(exchanges) * ragged_rows * row
    ops = {}
    for c in over_expert:
      ops[c["op"]] = ops.get(c["op"], 0) + 1
    figures = {"hlo": bound, "sent": sent, "batch": sum(c["sent_bytes"] for c in other), "ops": ops,
               "model": None if model is None else model["forward"] + (model["backward"] if name == "step" else 0),
               "compile_s": seconds}
    if concrete:
      figures["result"] = jax.device_get(fn(*a))
    out[name] = figures
  return out


OP_NAMES = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS", "all-to-all": "A2A",
            "ragged-all-to-all": "RA2A", "collective-permute": "CP"}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--cpu", action="store_true", help="toy sizes on 8 fake CPU devices, run and checked")
  parser.add_argument("--tokens", type=int, default=None, help="tokens per fsdp group (H100: 4096, --cpu: 256)")
  parser.add_argument("--k", default=None, help="experts per token, comma-separated (H100: 8, --cpu: 2)")
  parser.add_argument("--ways", default=None, help="H100: replicate,dispatch,dispatch_dense,gspmd; --cpu (where "
                      "'dispatch' runs its dense form): replicate,dispatch,gspmd")
  args = parser.parse_args(argv)
  sizes = TOY if args.cpu else A3B
  tokens = args.tokens or (256 if args.cpu else 4096)
  ks = [int(k) for k in (args.k or ("2" if args.cpu else "8")).split(",")]
  default_ways = "replicate,dispatch,gspmd" if args.cpu else "replicate,dispatch,dispatch_dense,gspmd"
  ways = (args.ways or default_ways).split(",")
  if args.cpu:
    devices, target = jax.devices("cpu")[:8], f"8 fake CPU devices (jax {jax.__version__}), run"
  else:
    from scripts.bench_generate import target_devices

    devices, target = target_devices("h100", 8), f"8 H100s, compiled without a GPU (jax {jax.__version__})"
  print(f"one MoE layer's grouped matmuls: {tokens} tokens per fsdp group, embed {sizes['embed']}, "
        f"{sizes['experts']} experts of {sizes['width']}, {sizes['dtype']}; {target}")
  print("MiB sent per device over `expert` (hlo: ragged all-to-alls at their bound; sent: at "
        + ("this routing's busiest device" if args.cpu else "uniform routing") + "); x: sent / replicate's sent")
  header = (f"{'k':>2} {'expert x fsdp':>13} {'way':<15} {'program':<8} {'collectives over expert':<24} "
            f"{'hlo':>8} {'sent':>8} {'model':>8} {'x':>6} {'batch axes':>10} {'compile s':>9}")
  print(header)
  for k in ks:
    for EP, fsdp in MESHES:
      mesh = parallel.make_mesh(devices, expert=EP, fsdp=fsdp)
      chosen = moe.choose_expert_parallel(dict(mesh.shape), tokens * fsdp, k, sizes["embed"], sizes["experts"])
      results = {way: measure(mesh, way, tokens, k, sizes, args.cpu) for way in ways}
      for way, programs in results.items():
        for name, f in programs.items():
          base = results.get("replicate", {}).get(name)
          ratio = f"{f['sent'] / base['sent']:.2f}" if base and base["sent"] else ""
          ops = ", ".join(f"{OP_NAMES[o]} {n}" for o, n in sorted(f["ops"].items()))
          model = "" if f["model"] is None else f"{f['model'] / MIB:.2f}"
          mark = "*" if way == chosen else " "
          print(f"{k:>2} {f'{EP} x {fsdp}':>13} {way + mark:<15} {name:<8} {ops:<24} {f['hlo'] / MIB:>8.2f} "
                f"{f['sent'] / MIB:>8.2f} {model:>8} {ratio:>6} {f['batch'] / MIB:>10.2f} {f['compile_s']:>9.1f}")
          if args.cpu and way != "replicate":  # every way computes the same layer
            want = jax.tree.leaves(results["replicate"][name]["result"])
            got = jax.tree.leaves(f["result"])
            err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(got, want))
            assert err < 1e-4, f"{way} {name} differs from replicate by {err}"
  print("*: choose_expert_parallel's default for these sizes")


if __name__ == "__main__":
  main()
