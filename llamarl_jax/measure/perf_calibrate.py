"""Calibration of the step-time model (`perf_model`) from measurements: the efficiencies a
`make bench-gpu` JSON (scripts/bench_gpu.py) implies, in place of the assumed `CALIBRATED` ones.
"""

from __future__ import annotations

import dataclasses

from llamarl_jax.measure.perf_inputs import CALIBRATED, GB, Efficiency, Hardware, ModelShape, TrainerLayout, Workload
from llamarl_jax.measure.perf_predict import train_seconds


# ------------------------------------------------------------------------------------------------
# calibration from measurements


def shape_from_json(d: dict) -> ModelShape:
  """A ModelShape from the `shape` dict bench_gpu records with each measurement."""
  fields = {f.name for f in dataclasses.fields(ModelShape)}
  return ModelShape(**{k: v for k, v in d.items() if k in fields})


def _trainer_mfu(tr: dict, hw: Hardware, eff: Efficiency, devices: int) -> float:
  """The `Efficiency.mfu` at which `train_seconds` reproduces the measured step `tr["step_s"]`.

  train_seconds = C / mfu + A on one FSDP group (C: the FLOPs, remat recompute included; A: the Adam
  update and other terms independent of mfu), so two evaluations give C and A, and mfu = C / (step - A).
  """
  model = shape_from_json(tr["shape"])
  rows = tr["B"]
  work = Workload(prompts=rows, samples=1, prompt_len=tr["P"], response_mean=tr["R"], response_max=tr["R"],
                  microbatch_tokens=-(-rows // devices) * (tr["P"] + tr["R"]) // max(tr.get("mb", 1), 1))
  layout = TrainerLayout(fsdp=devices)
  remat = bool(tr.get("remat", True))
  at = lambda m: train_seconds(model, layout, work, hw, dataclasses.replace(eff, mfu=m), remat=remat)
  c = at(0.5) - at(1.0)
  a = at(1.0) - c
  if tr["step_s"] <= a:
    raise ValueError(f"measured train step {tr['step_s']:.3f} s is below the model's floor {a:.3f} s")
  return c / (tr["step_s"] - a)


def _decode_fit(dec: dict, hw: Hardware) -> tuple[float, float]:
  """(hbm efficiency, per-step overhead s) from decode steps at several batch sizes: the least-squares
  line step = bytes / (peak bandwidth x hbm) + overhead, with bytes = bf16 weights + the mean valid KV
  cache as `decode_step_seconds` counts them (one replica, tp 1)."""
  model = shape_from_json(dec["shape"])
  context = dec["prompt_len"] + dec["new_tokens"] / 2
  pts = [(model.matmul_params * 2 + r["batch"] * context * model.kv_bytes_per_token(2), r["step_ms"] / 1e3)
         for r in dec["rows"]]
  if len(pts) < 2:
    raise ValueError("the decode fit needs steps at two batch sizes at least")
  mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
  slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
  overhead = my - slope * mx
  if slope <= 0 or overhead < 0:  # noisy or flat: all the time is bandwidth, no fixed part
    slope, overhead = sum(x * y for x, y in pts) / sum(x * x for x, _ in pts), 0.0
  return min(1.0, 1 / (slope * hw.hbm_bandwidth)), overhead


def calibrate(results: dict, base: Efficiency = CALIBRATED) -> tuple[Efficiency, Hardware, list[str]]:
  """`base` with the efficiencies a `bench_gpu` JSON measured; the measured device's peaks; one note per
  value saying where it came from (or why it kept the assumed value).

  mfu (counts the remat recompute, as `Efficiency.mfu` does): fitted so `train_seconds` gives the
  measured trainer step. hbm and decode_overhead: `_decode_fit`. link: the weight push's bytes/s over
  the NVLink peak when it crossed devices (one GPU pushes in place: nothing crosses, link is kept).
  """
  sections, env = results.get("sections"), results.get("environment") or {}
  if not isinstance(sections, dict) or not sections:
    raise ValueError("not a bench_gpu result: no 'sections' (write one with `make bench-gpu`)")
  if env.get("dry_run"):
    raise ValueError("this is a --dry_run (toy sizes, maybe on CPU): it does not calibrate a GPU model; "
                     "run `make bench-gpu` on the GPU")
  hw = Hardware(peak_flops=env.get("peak_flops") or Hardware.peak_flops,
                hbm_bandwidth=env.get("peak_bandwidth") or Hardware.hbm_bandwidth)
  eff, notes = base, []
  dec = sections.get("decode") or {}
  if dec.get("rows") and "shape" in dec:
    hbm, overhead = _decode_fit(dec, hw)
    eff = dataclasses.replace(eff, hbm=hbm, decode_overhead=overhead)
    notes.append(f"hbm {base.hbm:.2f} -> {hbm:.3f}, decode_overhead {base.decode_overhead * 1e3:.2f} -> "
                 f"{overhead * 1e3:.3f} ms: decode of {dec['shape'].get('name', '?')} at batches "
                 f"{[r['batch'] for r in dec['rows']]}")
  else:
    notes.append(f"hbm {base.hbm:.2f}, decode_overhead {base.decode_overhead * 1e3:.2f} ms kept: no decode section")
  tr = sections.get("trainer") or {}
  if "step_s" in tr and "shape" in tr:
    mfu = _trainer_mfu(tr, hw, eff, int(env.get("device_count", 1)))
    eff = dataclasses.replace(eff, mfu=mfu)
    notes.append(f"mfu {base.mfu:.2f} -> {mfu:.3f} (remat recompute counted; the bench's model-FLOPs MFU was "
                 f"{tr['mfu']:.1%}): trainer {tr['B']} x ({tr['P']}+{tr['R']}), {tr['step_s'] * 1e3:.0f} ms/step")
  else:
    notes.append(f"mfu {base.mfu:.2f} kept: no trainer section")
  push = sections.get("weight_push") or {}
  if "push_gbps" in push and "disjoint" in push.get("layout", ""):
    link = min(1.0, push["push_gbps"] * GB / hw.nvlink_bandwidth)
    eff = dataclasses.replace(eff, link=link)
    notes.append(f"link {base.link:.2f} -> {link:.3f}: weight push {push['push_gbps']:.1f} GB/s ({push['layout']})")
  elif "push_gbps" in push:
    notes.append(f"link {base.link:.2f} kept: the weight push ran on one device ({push['push_gbps']:.1f} GB/s, "
                 f"{push['push_s'] / push['copy_s']:.1f}x a plain copy), nothing crossed a link")
  return eff, hw, notes

