"""One MoE layer's grouped matmuls compiled for an H100 at Qwen3-30B-A3B's shapes (4096 tokens, top-8 of
128 experts, embed 2048, expert width 768, bf16; `moe.grouped_swiglu` on one device), forward and
forward + backward, by `jax.lax.ragged_dot` and by the Pallas tile kernels (`model.grouped_gemm`).

XLA's cost analysis sees no FLOPs inside a Pallas call, so the kernels' FLOPs are counted from their
grids (`grouped_gemm.kernel_flops_in_hlo`) and added to XLA's count of the rest. The routed FLOPs are
2 * 32768 rows * 2048 * 768 per matmul, three matmuls forward, twice that backward.
"""

import math
import re

import pytest

from cuda_compile import h100

ROWS, E, F, X, K = 4096 * 8, 2048, 768, 128, 8
ROUTED = {"forward": 3 * 2 * ROWS * E * F, "step": 9 * 2 * ROWS * E * F}
_ARRAY = re.compile(r"\b(?:bf16|f32|s32|pred|u32|f16)\[([0-9,]+)\]")


def _compile(impl: str, program: str):
  import jax
  import jax.numpy as jnp
  from jax.sharding import SingleDeviceSharding

  from llamarl_jax.measure import hlo
  from llamarl_jax.model import grouped_gemm as gg
  from llamarl_jax.model import moe, paged_attention

  s = SingleDeviceSharding(h100.target_devices(1)[0])
  sd = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=s)
  args = (sd((ROWS // K, E)), sd((ROWS // K, K), jnp.int32), sd((ROWS // K, K)), (sd((X, E, F)), sd((X, E, F))),
          sd((X, F, E)))
  layer = lambda x, e, w, gu, d: moe.grouped_swiglu(x, e, w, gu, d, grouped_gemm=impl)
  loss = lambda *a: jnp.sum(layer(*a).astype(jnp.float32))
  fn = layer if program == "forward" else jax.grad(loss, argnums=(0, 2, 3, 4))
  with paged_attention.target_platform("gpu"):  # Pallas compiles for the GPU, not in interpret mode
    lowered = jax.jit(fn).lower(*args)
  compiled = lowered.compile()
  text = compiled.as_text()
  kernels = set(re.findall(rf'name = "({gg.NAME}_[ntw]_[0-9x]+)"', text))
  cost = hlo.generic_cost_analysis(compiled)
  return {"flops": cost["flops"] + gg.kernel_flops_in_hlo(text),
          "kernel_flops": gg.kernel_flops_in_hlo(text),
          "bytes": cost["bytes accessed"] + hlo.pallas_call_bytes(text, tuple(kernels)),
          "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
          "largest": max(math.prod(int(n) for n in d.split(",")) for d in _ARRAY.findall(text)),
          "kernels": sum(1 for line in text.splitlines() if f'name = "{gg.NAME}_' in line and " custom-call(" in line)}


@pytest.mark.parametrize("program", ["forward", "step"])
def test_grouped_gemm_layer_computes_the_routed_flops_with_no_dense_operand(program, record_property):
  """ragged_dot: 128x the routed FLOPs and a `[rows, experts * embed]` operand (32768 x 262144, bf16:
  17 GB); the tile kernels: at most 1.3x (the grid's tiles: (512 + 127) / 512 = 1.25x, plus XLA's
  gathers and SwiGLU), no array larger than the experts' weights `[128, 2048, 768]`, 3 kernels forward,
  9 forward + backward (each matmul's forward, d lhs, d weights)."""
  ragged, pallas = _compile("ragged_dot", program), _compile("pallas", program)
  routed = ROUTED[program]
  record_property("grouped_gemm", {program: {"ragged_dot": ragged, "pallas": pallas, "routed": routed}})
  print(f"\n{program}: routed {routed:.4g} FLOPs")
  for name, f in (("ragged_dot", ragged), ("pallas", pallas)):
    print(f"  {name:<10} {f['flops'] / routed:7.3f}x routed, {f['flops']:.4g} FLOPs, {f['bytes'] / 1e9:.3f} GB "
          f"moved, {f['temp_bytes'] / 1e9:.3f} GB temporaries, largest array {f['largest']:.4g} elements")
  assert ragged["flops"] > 100 * routed and ragged["largest"] >= ROWS * X * E
  assert pallas["kernels"] == (3 if program == "forward" else 9)
  assert routed <= pallas["flops"] <= 1.3 * routed, pallas["flops"] / routed
  assert pallas["largest"] <= X * E * F, pallas["largest"]
  assert pallas["temp_bytes"] < ragged["temp_bytes"] / 10
