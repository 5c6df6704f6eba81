"""A reference peer for decode: a gpt-fast-style Llama compiled with torch.compile(mode="reduce-overhead").

    python benchmarks/compiled_peer.py                      # GPU: llama-3.1-8b shapes, batch 1 and 16
    python benchmarks/compiled_peer.py --fp8                # torchao's FP8 dynamic-activation linears
    python benchmarks/compiled_peer.py --preset llama-tiny --device cpu --no-compile --steps 3   # smoke

What it is: plain PyTorch, the shapes of a models/presets.py preset, random bf16 weights drawn on the
device (no checkpoint), fused q/k/v and separate gate / up / down projections, RoPE without the llama3
frequency scaling (it changes no cost), and a static KV cache [B, kv heads, max_len, head_dim] per
layer that SDPA reads whole under a mask, so every decode step has the same shapes and
torch.compile captures it in a CUDA graph. The cache holds random K/V for the first `--context`
positions (a prefill's output, without its cost), and each timed step decodes one token per
sequence at the next position: batch B decodes B tokens a step.

Prints, per batch size: decode tok/s (B x steps / wall time, after warm-up steps that compile and
capture) and ms per step. `--fp8` swaps every linear layer but the LM head for torchao's
Float8DynamicActivationFloat8WeightConfig (per-row e4m3 weights, per-token dynamic activations).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models.presets import SHAPE_PRESETS  # noqa: E402


class Attention(nn.Module):
    def __init__(self, c, batch, max_len, device, dtype):
        super().__init__()
        self.h, self.kv, self.d = c.num_heads, c.num_kv_heads, c.head_dim
        self.wqkv = nn.Linear(c.hidden_size, (self.h + 2 * self.kv) * self.d, bias=False, device=device, dtype=dtype)
        self.wo = nn.Linear(self.h * self.d, c.hidden_size, bias=False, device=device, dtype=dtype)
        shape = (batch, self.kv, max_len, self.d)
        self.register_buffer("k_cache", torch.randn(shape, device=device, dtype=dtype))
        self.register_buffer("v_cache", torch.randn(shape, device=device, dtype=dtype))

    def forward(self, x, cos, sin, pos, mask):
        b = x.shape[0]
        q, k, v = self.wqkv(x).split([self.h * self.d, self.kv * self.d, self.kv * self.d], dim=-1)
        q = rope(q.view(b, 1, self.h, self.d), cos, sin).transpose(1, 2)
        k = rope(k.view(b, 1, self.kv, self.d), cos, sin).transpose(1, 2)
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v.view(b, 1, self.kv, self.d).transpose(1, 2))
        o = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)
        return self.wo(o.transpose(1, 2).reshape(b, 1, self.h * self.d))


def rope(x, cos, sin):
    """x [B, 1, heads, d] rotated by the angles of its position (halves, as HF Llama)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Block(nn.Module):
    def __init__(self, c, batch, max_len, device, dtype):
        super().__init__()
        self.attn = Attention(c, batch, max_len, device, dtype)
        lin = lambda i, o: nn.Linear(i, o, bias=False, device=device, dtype=dtype)  # noqa: E731
        self.w1, self.w3 = lin(c.hidden_size, c.intermediate_size), lin(c.hidden_size, c.intermediate_size)
        self.w2 = lin(c.intermediate_size, c.hidden_size)
        self.norm1 = nn.RMSNorm(c.hidden_size, c.rms_norm_eps, device=device, dtype=dtype)
        self.norm2 = nn.RMSNorm(c.hidden_size, c.rms_norm_eps, device=device, dtype=dtype)

    def forward(self, x, cos, sin, pos, mask):
        x = x + self.attn(self.norm1(x), cos, sin, pos, mask)
        h = self.norm2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, c, batch, max_len, device, dtype):
        super().__init__()
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size, device=device, dtype=dtype)
        self.layers = nn.ModuleList(Block(c, batch, max_len, device, dtype) for _ in range(c.num_layers))
        self.norm = nn.RMSNorm(c.hidden_size, c.rms_norm_eps, device=device, dtype=dtype)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False, device=device, dtype=dtype)
        inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2, device=device).float() / c.head_dim)
        self.register_buffer("angles", torch.arange(max_len, device=device).float()[:, None] * inv_freq)
        self.max_len = max_len
        for p in self.parameters():     # random weights at a scale that keeps activations finite
            p.requires_grad_(False).normal_(0, 0.02) if p.dim() > 1 else p.requires_grad_(False).fill_(1)

    def forward(self, tokens, pos):
        """tokens [B, 1] at position pos [1] -> fp32 logits [B, vocab]."""
        a = self.angles[pos].view(1, 1, 1, -1)
        cos, sin = a.cos(), a.sin()
        mask = (torch.arange(self.max_len, device=pos.device) <= pos).view(1, 1, 1, -1)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, pos, mask)
        return self.lm_head(self.norm(x))[:, -1].float()


@torch.no_grad()     # not inference_mode: torchao's quantize_ swaps parameters
def bench(args, batch):
    device, dtype = torch.device(args.device), torch.bfloat16
    c = SHAPE_PRESETS[args.preset]
    model = Llama(c, batch, args.context + args.warmup + args.steps, device, dtype)
    if args.fp8:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_
        quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
                  filter_fn=lambda m, name: isinstance(m, nn.Linear) and name != "lm_head")
    step = model if args.no_compile else torch.compile(model, mode="reduce-overhead", fullgraph=True)
    tokens = torch.randint(0, c.vocab_size, (batch, 1), device=device)
    # The position advances on the device and the sampled token feeds the next step there: the host
    # never waits for the GPU between steps (a fresh host tensor each step would sync on its copy).
    pos = torch.tensor([args.context], device=device)

    def run(n):
        nonlocal tokens
        for _ in range(n):
            tokens = step(tokens, pos).argmax(-1, keepdim=True)     # greedy: the next step's input
            pos.add_(1)

    run(args.warmup)        # compile, capture, and the allocator's first requests
    sync(device)
    t = time.perf_counter()
    run(args.steps)
    sync(device)
    elapsed = time.perf_counter() - t
    return batch * args.steps / elapsed, 1e3 * elapsed / args.steps


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-3.1-8b", choices=sorted(SHAPE_PRESETS))
    ap.add_argument("--batches", default="1,16", help="comma list of decode batch sizes (default %(default)s)")
    ap.add_argument("--context", type=int, default=512, help="tokens already in the cache (default %(default)s)")
    ap.add_argument("--steps", type=int, default=128, help="timed decode steps (default %(default)s)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (default %(default)s)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--fp8", action="store_true", help="torchao FP8 dynamic-activation linears")
    ap.add_argument("--no-compile", action="store_true", help="eager (the CPU smoke test)")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if min(batches) < 1 or args.steps < 1 or args.context < 0 or args.warmup < 0:
        ap.error("--batches, --steps: at least 1; --context, --warmup: at least 0")
    mode = "eager" if args.no_compile else 'torch.compile(mode="reduce-overhead")'
    print(f"{args.preset}, bf16{' + torchao fp8' if args.fp8 else ''}, {mode}, {args.device}, "
          f"context {args.context}, {args.steps} steps")
    results = {}
    for b in batches:
        tok_s, ms = bench(args, b)
        results[b] = tok_s, ms
        print(f"batch {b:4d}: {tok_s:10.1f} tok/s  {ms:8.3f} ms/step", flush=True)
        torch._dynamo.reset()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    main()
