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


def _compile_fp8_decode(impl: str, fp8: bool, tokens: int = 256):
  """One MoE layer's forward for a decode step of `tokens` rows (the generator's), experts in bf16 or
  weight-only fp8 (`moe.ScaledExperts`: values and a scale per expert and output channel)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import SingleDeviceSharding

  from llamarl_jax.measure import hlo
  from llamarl_jax.model import grouped_gemm as gg
  from llamarl_jax.model import moe, paged_attention

  s = SingleDeviceSharding(h100.target_devices(1)[0])
  sd = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=s)
  wd = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
  weights = [sd((X, E, F), wd), sd((X, E, F), wd), sd((X, F, E), wd)]
  scales = [sd((X, F), jnp.float32), sd((X, F), jnp.float32), sd((X, E), jnp.float32)]

  def layer(x, e, w, ws, ss):
    ws = [moe.ScaledExperts(v, c) for v, c in zip(ws, ss)] if fp8 else ws
    return moe.grouped_swiglu(x, e, w, (ws[0], ws[1]), ws[2], grouped_gemm=impl)

  args = (sd((tokens, E)), sd((tokens, K), jnp.int32), sd((tokens, K)), weights, scales)
  with paged_attention.target_platform("gpu"):
    compiled = jax.jit(layer).lower(*args).compile()
  text = compiled.as_text()
  kernels = set(re.findall(rf'name = "({gg.NAME}_[ntw]_[0-9x]+)"', text))
  widened = [d for d in re.findall(r"\bbf16\[([0-9,]+)\]", text) if d in (f"{X},{E},{F}", f"{X},{F},{E}")]
  return {"bytes": hlo.generic_cost_analysis(compiled)["bytes accessed"] + hlo.pallas_call_bytes(text, tuple(kernels)),
          "widened": widened}


def test_fp8_experts_are_read_as_fp8_by_the_kernels(record_property):
  """A decode step's MoE layer (256 rows, top-8) with fp8 experts: the tile kernels take the fp8 values
  (no bf16 copy of an expert matrix anywhere in the program), so the layer moves at least 95% of a
  byte per expert weight less than with bf16 experts (the weights: 1.21 GB in bf16 of the layer's
  1.55 GB; the rest, the rows padded to 64-row tiles per expert, is the same)."""
  bf16, fp8 = _compile_fp8_decode("pallas", False), _compile_fp8_decode("pallas", True)
  record_property("grouped_gemm_fp8", {"pallas_bf16": bf16, "pallas_fp8": fp8})
  print(f"\ndecode MoE layer, 256 rows: pallas bf16 {bf16['bytes'] / 1e9:.3f} GB, fp8 {fp8['bytes'] / 1e9:.3f} GB")
  assert not fp8["widened"], fp8["widened"]
  assert bf16["bytes"] - fp8["bytes"] >= 0.95 * 3 * X * E * F, (fp8["bytes"], bf16["bytes"])


def test_exact_layer_is_fixed_tile_gemms_with_no_dense_operand(record_property):
  """`grouped_gemm='exact'` (`ModelConfig.exact`: `exact.grouped_dot`) at the same shapes, forward: every
  GEMM is one 64-row tile of an expert's rows against that expert's whole `[K, N]` matrix (`exact.ROW_TILE`
  x 2048 x 768 for gate and up, x 768 x 2048 for down), unbatched and accumulated in fp32, in a loop over
  the (512 + 127) tiles of the grouped_gemm tile plan (1.25x the routed FLOPs, the Pallas kernels'
  grid); no array larger than the experts' weights."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import SingleDeviceSharding

  from llamarl_jax.model import exact, grouped_gemm as gg, moe

  s = SingleDeviceSharding(h100.target_devices(1)[0])
  sd = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=s)
  args = (sd((ROWS // K, E)), sd((ROWS // K, K), jnp.int32), sd((ROWS // K, K)), (sd((X, E, F)), sd((X, E, F))),
          sd((X, F, E)))
  layer = lambda x, e, w, gu, d: moe.grouped_swiglu(x, e, w, gu, d, grouped_gemm="exact")
  compiled = jax.jit(layer).lower(*args).compile(exact.COMPILER_OPTIONS)
  text = compiled.as_text()
  dots = re.findall(r"= (\w+)\[([0-9,]*)\]\{[^}]*\} dot\(([^)]*)\), ([^\n]*)", text)
  shapes = sorted({(dt, dims) for dt, dims, _, _ in dots})
  record_property("grouped_gemm_exact", {"dots": shapes, "tiles": gg.num_tiles(ROWS, X)})
  print(f"\nexact MoE layer: dots {shapes}, {gg.num_tiles(ROWS, X)} tiles per matmul")
  assert shapes == [("f32", f"{exact.ROW_TILE},{E}"), ("f32", f"{exact.ROW_TILE},{F}")], shapes
  assert all("batch_dims" not in rest for *_, rest in dots)
  assert gg.num_tiles(ROWS, X) * exact.ROW_TILE <= 1.25 * ROWS
  largest = max(math.prod(int(n) for n in d.split(",")) for d in _ARRAY.findall(text))
  assert largest <= X * E * F, largest
