"""Make a compressed-tensors checkpoint of the embedded model (SmolLM2-135M-Instruct) with llm-compressor,
in one of the formats the engine loads as stored: fp8, nvfp4, 2:4, 2:4+fp8.

Contract: `python benchmarks/make_checkpoint.py --scheme SCHEME --out DIR` writes DIR, a Hugging Face
Llama directory (config.json with a compressed-tensors `quantization_config`, model.safetensors, the
tokenizer) that `python serve.py --model DIR`, `LLM(DIR)` and `bench.py --quality-only --checkpoint DIR`
load. The weights are the embedded GGUF file's, read by transformers. Schemes:

- fp8:     llm-compressor's FP8_DYNAMIC (e4m3 weights, one scale per output channel, round to nearest;
           dynamic per-token FP8 activations). No calibration data.
- nvfp4:   NVFP4A16 (e2m1 values, an e4m3 scale per 16 along K, a global scale; round to nearest).
           No calibration data.
- 2:4:     SparseGPT (one-shot, with its weight update) prunes the FFN projections (gate, up, down) to
           2:4 along K, as the engine's own `--sparse-ffn` pruning does; attention stays dense.
- 2:4+fp8: the same SparseGPT pruning, then FP8_DYNAMIC on every decoder projection.
With --gptq, fp8 and nvfp4 quantise with GPTQ (calibrated, error-compensating) instead of rounding to
nearest (not after 2:4 pruning: GPTQ's updates would fill the pruned positions).

Calibration text: engine/quality.py's `calibration_windows`, docstrings of other standard-library
modules than the evaluation text's, so no calibration token is an evaluation token.

llm-compressor no longer writes a `sparsity_config` (compressed-tensors dropped its sparse formats), so
for 2:4 this script records the structure itself: format "dense", structure "2:4", the pruned
projections as targets, written with compressed-tensors' own config class. The engine checks at load
that every such weight really holds a 2:4 pattern.

Set up: llm-compressor is the `compress` extra. It pins transformers and compressed-tensors to its own
versions (0.14.0.1, the newest: transformers>=5.15,<=5.17, compressed-tensors==0.19.0; the engine runs
with both), so install it in a virtual environment layered on the engine's, from the repository root
after the README's install:

    python -m venv --system-site-packages .venv-compress && .venv-compress/bin/pip install -e ".[compress]"
    .venv-compress/bin/python benchmarks/make_checkpoint.py --scheme 2:4+fp8 --out checkpoints/smollm2-2of4-fp8

Then, in the engine's environment: `python bench.py --quality-only --checkpoint checkpoints/smollm2-2of4-fp8`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCHEMES = ("fp8", "nvfp4", "2:4", "2:4+fp8")
# The decoder projections the engine's 2:4 FFN format prunes (compressed-tensors target syntax).
FFN_TARGETS = [r"re:.*mlp\.(gate|up|down)_proj$"]
# Layers SparseGPT leaves dense: attention and the LM head (names as llm-compressor matches them).
SPARSEGPT_IGNORE = [r"re:.*self_attn.*", r"re:.*lm_head.*"]


def hf_model(dtype: str, workdir: str):
    """transformers' LlamaForCausalLM with the embedded GGUF file's weights, and its tokenizer. The
    model is written to `workdir` and read back: llm-compressor reads the config.json of the directory
    a model comes from, which a GGUF file's folder does not have."""
    import torch
    from transformers import LlamaForCausalLM

    from models.loader import embedded_gguf_path, embedded_tokenizer
    path = embedded_gguf_path()
    gguf = LlamaForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                            dtype=getattr(torch, dtype))
    # transformers marks a model read from GGUF as quantised and will not save it: a plain copy will.
    config = gguf.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.load_state_dict(gguf.state_dict())
    model.save_pretrained(workdir)
    return LlamaForCausalLM.from_pretrained(workdir, dtype=getattr(torch, dtype)).eval(), embedded_tokenizer()


def calibration_dataset(tokenizer, window: int, count: int):
    from datasets import Dataset

    from engine.quality import calibration_windows
    windows = calibration_windows(tokenizer, window, count)
    if not windows:
        raise ValueError(f"--calibration-window {window}: the calibration text has fewer tokens")
    return Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * len(w) for w in windows]})


def recipe(scheme: str, gptq: bool, dampening: float):
    from llmcompressor.modifiers.pruning.sparsegpt import SparseGPTModifier
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    quant = {"fp8": "FP8_DYNAMIC", "nvfp4": "NVFP4A16", "2:4": None, "2:4+fp8": "FP8_DYNAMIC"}[scheme]
    steps = []
    if scheme.startswith("2:4"):
        steps.append(SparseGPTModifier(sparsity=0.5, mask_structure="2:4", targets=["Linear"],
                                       ignore=SPARSEGPT_IGNORE, dampening_frac=dampening))
    if quant is not None:
        cls = GPTQModifier if gptq else QuantizationModifier
        steps.append(cls(targets="Linear", scheme=quant, ignore=["lm_head"]))
    return steps


def check_24(pruned: dict) -> None:
    """Every pruned weight ({name: weight before compression}) holds a 2:4 pattern along K."""
    from engine.formats.sparse24 import is_24_sparse
    for name, w in pruned.items():
        if not is_24_sparse(w):
            raise ValueError(f"{name}: SparseGPT left a weight that is not 2:4 along K")


def record_sparsity(out: str, pruned: dict) -> None:
    """Write the 2:4 sparsity_config llm-compressor leaves empty into `out`'s config.json, after
    checking the pattern (`check_24`)."""
    from compressed_tensors.config import DenseSparsityConfig
    check_24(pruned)
    zeros = sum(int((w == 0).sum()) for w in pruned.values())
    sparsity = DenseSparsityConfig(sparsity_structure="2:4", targets=FFN_TARGETS, ignore=[],
                                   global_sparsity=zeros / sum(w.numel() for w in pruned.values()))
    cfg_path = os.path.join(out, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    qc = cfg.setdefault("quantization_config", {"quant_method": "compressed-tensors", "format": "dense"})
    qc["sparsity_config"] = sparsity.model_dump()
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scheme", required=True, choices=SCHEMES)
    ap.add_argument("--out", required=True, help="the checkpoint directory to write")
    ap.add_argument("--gptq", action="store_true", help="fp8 / nvfp4: GPTQ instead of round to nearest")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="dtype of the model while compressing and of the tensors kept dense "
                         "(default float32: the GGUF file's values exactly)")
    ap.add_argument("--calibration-window", type=int, default=512, help="tokens per calibration sample")
    ap.add_argument("--calibration-windows", type=int, default=64,
                    help="calibration samples at most (as many as the calibration text holds)")
    ap.add_argument("--dampening", type=float, default=0.01, help="SparseGPT's Hessian dampening fraction")
    args = ap.parse_args(argv)
    if args.gptq and args.scheme.startswith("2:4"):
        # GPTQ's error compensation writes into the pruned positions: the 2:4 pattern would be lost.
        ap.error("--gptq: fp8 and nvfp4 only")

    from llmcompressor import oneshot
    workdir = tempfile.TemporaryDirectory(prefix="make_checkpoint-")
    model, tokenizer = hf_model(args.dtype, workdir.name)
    needs_data = args.scheme.startswith("2:4") or args.gptq
    data = calibration_dataset(tokenizer, args.calibration_window, args.calibration_windows) if needs_data else None
    oneshot(model=model, tokenizer=tokenizer, recipe=recipe(args.scheme, args.gptq, args.dampening),
            dataset=data, num_calibration_samples=len(data) if data is not None else 0,
            max_seq_length=args.calibration_window, shuffle_calibration_samples=False)
    if args.scheme.startswith("2:4"):
        pruned = {n: m.weight.detach().clone() for n, m in model.named_modules()
                  if n.rsplit(".", 1)[-1] in ("gate_proj", "up_proj", "down_proj")}
        check_24(pruned)     # before anything is written
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)
    if args.scheme.startswith("2:4"):
        record_sparsity(args.out, pruned)
    workdir.cleanup()
    print(f"wrote {args.out}: {args.scheme}{' (GPTQ)' if args.gptq else ''}")


if __name__ == "__main__":
    main()
