"""The inputs of the step-time and memory model (`perf_model`): model shapes, the hardware, the
achieved efficiencies (`CALIBRATED`), the workload of one RL step, the trainer's and the generator's
layouts, and the paper's published step times.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


# ------------------------------------------------------------------------------------------------
# inputs


@dataclass(frozen=True)
class ModelShape:
  """A dense decoder: Llama 3 (untied embeddings, GQA) by default; Qwen2 / Qwen3 set the rest.

  head_dim: 0 means hidden / heads (Llama, Qwen2); Qwen3 states its own (128). tied: one embedding table
  that is also the output projection. qkv_bias (Qwen2) and qk_norm (Qwen3) add a few parameters.
  """

  name: str
  layers: int
  hidden: int
  heads: int
  kv_heads: int
  intermediate: int
  vocab: int = 128256
  head_dim: int = 0
  tied: bool = False
  qkv_bias: bool = False
  qk_norm: bool = False

  def __post_init__(self):
    if not self.head_dim:
      object.__setattr__(self, "head_dim", self.hidden // self.heads)

  @property
  def layer_params(self) -> int:
    d, hd = self.hidden, self.head_dim
    qkv = hd * (self.heads + 2 * self.kv_heads)
    attn = d * qkv + self.heads * hd * d + self.qkv_bias * qkv + self.qk_norm * 2 * hd
    return attn + 3 * d * self.intermediate + 2 * d

  @property
  def params(self) -> int:
    return self.layers * self.layer_params + (1 if self.tied else 2) * self.vocab * self.hidden + self.hidden

  @property
  def matmul_params(self) -> int:
    """Parameters a token multiplies with: all but the input embedding (a gather), unless it is tied
    to the output projection (which is a matmul)."""
    return self.params - (0 if self.tied else self.vocab * self.hidden)

  def kv_bytes_per_token(self, nbytes: int = 2) -> int:
    """K and V of one token, every layer and kv head."""
    return 2 * self.layers * self.kv_heads * self.head_dim * nbytes

  def attention_flops_per_token(self, context: float) -> float:
    """Forward FLOPs of q.k and p.v for one token attending to `context` tokens."""
    return 4 * self.layers * self.heads * self.head_dim * context


LLAMA3 = {
    "8b": ModelShape("llama3-8b", layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336),
    "70b": ModelShape("llama3-70b", layers=80, hidden=8192, heads=64, kv_heads=8, intermediate=28672),
    "405b": ModelShape("llama3-405b", layers=126, hidden=16384, heads=128, kv_heads=8, intermediate=53248),
}
# Shapes from the released config.json files (Qwen2.5-1.5B(-Instruct), Qwen2.5-7B, Qwen3-1.7B, Qwen3-8B).
QWEN = {
    "qwen2.5-1.5b": ModelShape("qwen2.5-1.5b", layers=28, hidden=1536, heads=12, kv_heads=2, intermediate=8960,
                               vocab=151936, tied=True, qkv_bias=True),
    "qwen2.5-7b": ModelShape("qwen2.5-7b", layers=28, hidden=3584, heads=28, kv_heads=4, intermediate=18944,
                             vocab=152064, qkv_bias=True),
    "qwen3-1.7b": ModelShape("qwen3-1.7b", layers=28, hidden=2048, heads=16, kv_heads=8, intermediate=6144,
                             vocab=151936, head_dim=128, tied=True, qk_norm=True),
    "qwen3-8b": ModelShape("qwen3-8b", layers=36, hidden=4096, heads=32, kv_heads=8, intermediate=12288,
                           vocab=151936, head_dim=128, qk_norm=True),
}
MODELS = {**LLAMA3, **QWEN}  # what `--size` and `choose_layout(model="...")` accept


@dataclass(frozen=True)
class Hardware:
  """H100 SXM 80 GB nodes: 8 GPUs on NVLink 4 per node, one 400 Gb/s InfiniBand NIC per GPU."""

  peak_flops: float = 989e12  # dense bf16
  fp8_speedup: float = 2.0  # dense fp8 peak / bf16 peak
  hbm_bandwidth: float = 3.35e12
  hbm_bytes: float = 80 * GB
  nvlink_bandwidth: float = 450 * GB  # per GPU, one direction (900 GB/s both ways)
  network_bandwidth: float = 50 * GB  # per GPU, one direction
  gpus_per_node: int = 8


@dataclass(frozen=True)
class Efficiency:
  """Achieved fractions of peak and fixed latencies: the calibration, one set for every model size.

  Chosen by a coarse grid search over plausible values against the paper's six step times (with
  `PAPER_WORKLOAD`). `mfu` counts the remat recompute (without it, 0.5 is 0.375 of model FLOPs).
  """

  mfu: float = 0.50  # training (and FLOP-bound decode): FLOPs incl. the remat recompute / (GPUs x peak)
  hbm: float = 0.60  # decode: achieved / peak HBM bandwidth
  link: float = 0.75  # achieved / peak NVLink or network bandwidth
  nvlink_latency: float = 1.5e-6  # one ring step between GPUs of a node (s)
  network_latency: float = 10e-6  # one ring step between nodes (s)
  step_overhead: float = 3.0  # per RL step: reward scoring, orchestration, host work (s)
  decode_overhead: float = 1e-3  # per decode step: sampling, scheduling, launches (s)
  usable_memory: float = 0.90  # of HBM; the rest is CUDA context, NCCL buffers, fragmentation


CALIBRATED = Efficiency()

# Llama 3.2 1B (tied embeddings): the size scripts/bench_gpu.py measures on one GPU
LLAMA32_1B = ModelShape("llama3.2-1b", layers=16, hidden=2048, heads=32, kv_heads=8, intermediate=8192, tied=True)


@dataclass(frozen=True)
class Workload:
  """One RL step: `prompts x samples` sequences of `prompt_len` prompt tokens and a response each."""

  prompts: int = 128
  samples: int = 8
  prompt_len: int = 512
  response_mean: int = 1536
  response_max: int = 4096
  microbatch_tokens: int = 16384  # per trainer data-parallel rank and microbatch
  packed: bool = True  # the trainer packs rows; False: pads each to prompt_len + response_max (this repo)

  @property
  def sequences(self) -> int:
    return self.prompts * self.samples

  @property
  def train_tokens(self) -> int:
    """Tokens the trainer processes per step: prompt + response per row, packed or padded to the max."""
    return self.sequences * (self.prompt_len + (self.response_mean if self.packed else self.response_max))

  @property
  def max_len(self) -> int:
    return self.prompt_len + self.response_max


PAPER_WORKLOAD = Workload()

# (model, GPUs): (sync s, async s) published by LlamaRL (arXiv 2505.24034, Llama 3 post-training, H100).
PAPER = {("8b", 256): (22.45, 8.90), ("70b", 256): (82.32, 20.67), ("405b", 1024): (635.8, 59.5)}
PAPER_MAX_SYNC_SECONDS = 2.0  # "weight sync under 2 s" at 405B


@dataclass(frozen=True)
class TrainerLayout:
  """dp x fsdp x tp x pp GPUs: tp innermost (inside a node), then pp, then fsdp (ZeRO-3 shards)."""

  fsdp: int = 1
  tp: int = 1
  pp: int = 1
  dp: int = 1

  @property
  def gpus(self) -> int:
    return self.dp * self.fsdp * self.tp * self.pp

  @property
  def model_parallel(self) -> int:
    return self.tp * self.pp

  def __str__(self) -> str:
    axes = [f"fsdp{self.fsdp}", f"tp{self.tp}"] + [f"pp{self.pp}"] * (self.pp > 1) + [f"dp{self.dp}"] * (self.dp > 1)
    return "x".join(axes) + f" ({self.gpus} GPUs)"


@dataclass(frozen=True)
class GeneratorLayout:
  """`replicas` independent decoders of tp x pp GPUs each, weights in `dtype` ("bf16" or "fp8")."""

  tp: int = 1
  replicas: int = 1
  pp: int = 1
  dtype: str = "bf16"

  def __post_init__(self):
    if self.dtype not in ("bf16", "fp8"):
      raise ValueError(f"generator dtype must be 'bf16' or 'fp8', got {self.dtype!r}")

  @property
  def gpus(self) -> int:
    return self.replicas * self.tp * self.pp

  @property
  def model_parallel(self) -> int:
    return self.tp * self.pp

  @property
  def weight_bytes(self) -> int:
    return 2 if self.dtype == "bf16" else 1

  def __str__(self) -> str:
    mp = f"tp{self.tp}" + (f"xpp{self.pp}" if self.pp > 1 else "")
    return f"{mp} x {self.replicas} replicas {self.dtype} ({self.gpus} GPUs)"

