"""The weight-streaming decode GEMM (engine/kernels/stream_triton.py) on 16-bit weights, and the dense
format's kernel lists (its e4m3 entry point is tested in tests/test_fp8.py).

The kernel against a float64 reference in Triton's interpreter (marker `interpreter`: the child
process of tests/test_interpreter.py runs them without a GPU), compiled for sm_90 on the CPU with
its PTX read back, its launch rule and input checks, the format's selection with the capability
faked, and on a GPU (marker `gpu`) every configuration the tuner may pick at Llama-3.1-8B shapes,
and the kernel's loads and stores under compute-sanitizer's memcheck.
Inputs are fresh random draws; outputs start poisoned (NaN), so an element never written fails.
"""
from __future__ import annotations

import pytest
import torch

from engine.formats import dense
from engine.kernels import select
from engine.kernels.platform import fake_capability
from engine.kernels.select import Problem
from tests.cute_ptx import SANITIZER, run_under_memcheck

triton = pytest.importorskip("triton")
from engine.kernels import stream_triton  # noqa: E402  (needs Triton)
from tests.numerics import rel_err  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 output rounding alone is ~2^-9 relative per element; fp16's 2^-12
TOL = {torch.bfloat16: 4e-3, torch.float16: 1e-3}
LLAMA_8B = {"qkv": (6144, 4096, False), "o": (4096, 4096, False), "gate_up": (28672, 4096, True),
            "down": (4096, 14336, False)}


@pytest.fixture(autouse=True)
def fresh_choices():
    select.clear_cache()
    yield
    select.clear_cache()


def reference(x, w, swiglu):
    return stream_triton.stream_matmul_ref(x.double(), w.double(), swiglu)   # float64 in, float64 out


def check(x, w, swiglu, config=None):
    n = w.shape[0] // 2 if swiglu else w.shape[0]
    out = torch.full((x.shape[0], n), float("nan"), device=x.device, dtype=x.dtype)
    stream_triton.stream_matmul(x, w, out, config, swiglu)
    assert not out.isnan().any(), "unwritten (NaN) elements"
    err = rel_err(out, reference(x, w, swiglu))
    assert err < TOL[x.dtype], (tuple(x.shape), tuple(w.shape), swiglu, config, err)


# ------------------------------------------------------------------------------ the kernel
@pytest.mark.interpreter
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_stream_matmul_against_float64(m, split, swiglu):
    """N = 200 (a partial last row tile; 400 gate/up rows), K = 512 in 128-deep tiles, one or two
    K splits (the split's atomics and the last program's take), with and without SwiGLU."""
    torch.manual_seed(m * 10 + split)
    n, k = (400 if swiglu else 200), 512
    w = (torch.randn(n, k, device=DEVICE) / 16).to(torch.bfloat16)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    check(x, w, swiglu, (64, 128, split, 2))


@pytest.mark.interpreter
def test_stream_matmul_fp16_strided_rows_and_its_default_config():
    """fp16, x a row-strided view (unit stride along K only), the rule's own launch."""
    torch.manual_seed(1)
    w = (torch.randn(192, 256, device=DEVICE) / 8).to(torch.float16)
    x = torch.randn(3, 512, device=DEVICE, dtype=torch.float16)[:, :256]
    check(x, w, False)


@pytest.mark.interpreter
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("config", [(64, 128, 2, 2), (128, 64, 1, 2)])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_norm_handoff_against_float64(m, config, swiglu):
    """The GEMM before an RMSNorm (N = 320: 64-row groups in 64- and 128-row tiles, the last tile
    half past N; split K or not) and the one after it (K = 320: five groups of parts, padded to
    eight; with and without SwiGLU). Each output against float64 from the kernel's own inputs; then
    the pair against RMSNorm(h) * g @ W^T computed in float64."""
    torch.manual_seed(m + 7 * config[0] + swiglu)
    n, k, eps = 320, 512, 1e-5
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    w = (torch.randn(n, k, device=DEVICE) / k ** 0.5).to(torch.bfloat16)
    residual = torch.randn(m, n, device=DEVICE, dtype=torch.bfloat16)
    g = (1 + 0.2 * torch.randn(n, device=DEVICE)).to(torch.bfloat16)
    h = residual.clone()
    xg = torch.full_like(residual, float("nan"))
    parts = stream_triton.norm_parts(n, x.device).fill_(float("nan"))
    stream_triton.stream_matmul_norm_out(x, w, h, g, xg, parts, config)
    h_ref, _, parts_ref = stream_triton.norm_out_ref(x.double(), w.double(), residual.double(), g.double())
    assert rel_err(h, h_ref) < TOL[torch.bfloat16]
    assert rel_err(xg, h.double() * g.double()) < TOL[torch.bfloat16]          # one rounding of h * g
    squares = torch.zeros(16, 384, dtype=torch.float64, device=DEVICE)
    squares[:m, :n] = h.double() ** 2
    assert parts_ref.shape == parts.shape == (5, 16)
    assert rel_err(parts, squares.view(16, 6, 64).sum(-1).t()[:5]) < 1e-6  # fp32 sums of the stored rows

    w2 = (torch.randn(2 * 192 if swiglu else 192, n, device=DEVICE) / n ** 0.5).to(torch.bfloat16)
    y = stream_triton.stream_matmul_row_scaled(xg, w2, parts, eps, (64, 64, 1, 2), swiglu)
    assert not y.isnan().any()
    assert rel_err(y, stream_triton.stream_matmul_ref(xg.double(), w2.double(), swiglu, (parts.double(), eps))) \
        < TOL[torch.bfloat16]
    hd = h.double()
    normed = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + eps) * g.double()
    assert rel_err(y, reference(normed, w2, swiglu)) < 3 * TOL[torch.bfloat16]   # xg's rounding and y's


@pytest.mark.interpreter
@pytest.mark.parametrize("group", [16, 4])
@pytest.mark.parametrize("m", [1, 7])
def test_row_scaled_takes_any_producers_parts(m, group):
    """The GEMM after a handed-off norm reads whatever G rows of partial sums the GEMM before wrote
    (another format's kernel groups its own row tiles): 20 rows, loaded before the weight loop, or
    80, loaded after it. The columns past M hold NaN: they must not reach the rows stored."""
    from tests.handoff import check_row_scaled, random_parts
    torch.manual_seed(m + group)
    n, k, eps = 320, 192, 1e-5
    h, g, xg, parts = random_parts(m, n, group, DEVICE)
    w = (torch.randn(k, n, device=DEVICE) / n ** 0.5).to(torch.bfloat16)
    y = stream_triton.stream_matmul_row_scaled(xg, w, parts, eps, (64, 64, 1, 2))
    check_row_scaled(y, h, g, w.double(), eps, False, tol=3 * TOL[torch.bfloat16])


def test_stream_matmul_refuses_what_it_cannot_take():
    w = torch.zeros(64, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="up to 16 rows"):
        stream_triton.stream_matmul(torch.zeros(17, 128, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="not a multiple of 64"):
        stream_triton.stream_matmul(torch.zeros(1, 96, dtype=torch.bfloat16), torch.zeros(64, 96, dtype=torch.bfloat16))
    assert stream_triton.stream_matmul(torch.zeros(0, 128, dtype=torch.bfloat16), w).shape == (0, 64)
    with pytest.raises(ValueError, match="same K and dtype"):
        stream_triton.stream_matmul(torch.zeros(1, 128, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="same K and dtype"):
        stream_triton.stream_matmul(torch.zeros(1, 64, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="not a multiple"):
        stream_triton.stream_matmul(torch.zeros(1, 128, dtype=torch.bfloat16), w, config=(64, 128, 2, 2))
    with pytest.raises(ValueError, match="even row count"):
        stream_triton.stream_matmul(torch.zeros(1, 128, dtype=torch.bfloat16), w[:63], swiglu=True)
    x, res, g = torch.zeros(2, 128, dtype=torch.bfloat16), torch.zeros(2, 64, dtype=torch.bfloat16), torch.ones(64)
    with pytest.raises(ValueError, match="residual"):
        stream_triton.stream_matmul_norm_out(x, w, res[:1], g, res.clone(), torch.zeros(1, 16))
    with pytest.raises(ValueError, match="parts"):
        stream_triton.stream_matmul_norm_out(x, w, res, g, res.clone(), torch.zeros(2, 16))
    with pytest.raises(ValueError, match="parts"):     # [G, 16] fp32, G any
        stream_triton.stream_matmul_row_scaled(x, w, torch.zeros(2, 8), 1e-5)
    with pytest.raises(ValueError, match="parts"):
        stream_triton.stream_matmul_row_scaled(x, w, torch.zeros(2, 16, dtype=torch.float16), 1e-5)


def test_launch_rule_at_llama_shapes():
    """One rule for 16-bit and e4m3 weights (132 SMs, an H200): K split only where the row tiles
    are fewer than half the SMs, and never below 8 tiles of K a split; unsplit short layers run 6
    stages deep (a SwiGLU program streams two weight tiles). Every listed configuration divides K
    and fits shared memory, the rule's first."""
    def launch(n, k, weight_bytes=2, swiglu=False):
        c = stream_triton.stream_config(n, k, 132, weight_bytes, swiglu)
        return c["BLOCK_K"], c["SPLIT_K"], c["num_stages"]
    bf16 = {name: launch(n // 2 if sw else n, k, 2, sw) for name, (n, k, sw) in LLAMA_8B.items()}
    assert bf16 == {"qkv": (128, 1, 6), "o": (128, 4, 4), "gate_up": (128, 1, 4), "down": (128, 4, 4)}
    e4m3 = {name: launch(n, k, 1) for name, (n, k, _) in LLAMA_8B.items()}   # FP8 runs gate/up unfused
    assert e4m3 == {"qkv": (256, 1, 6), "o": (256, 2, 4), "gate_up": (256, 1, 4), "down": (256, 4, 4)}
    assert launch(128256, 4096) == (128, 1, 4)             # the LM head: many tiles, no split
    assert launch(1024, 1024) == (128, 1, 6)               # a split would keep 512 of K
    assert launch(1024, 576) == (64, 1, 6)                 # 576 is not a multiple of 128
    for n, k, sw in LLAMA_8B.values():
        configs = stream_triton.stream_configs(n // 2 if sw else n, k, 132, sw)
        rule = stream_triton.stream_config(n // 2 if sw else n, k, 132, swiglu=sw)
        assert configs[0] == (rule["BLOCK_N"], rule["BLOCK_K"], rule["SPLIT_K"], rule["num_stages"])
        assert len(configs) == len(set(configs)) >= 4
        for bn, bk, split, stages in configs:
            assert k % (split * bk) == 0 and stages * 2 * (bn * bk * (2 if sw else 1) + 16 * bk) <= 227 * 1024


@pytest.mark.skipif(__import__("os").environ.get("TRITON_INTERPRET") == "1", reason="compiles, not interprets")
@pytest.mark.parametrize("kind", ["bf16", "bf16 SwiGLU", "e4m3 + residual", "bf16 norm hand-off",
                                  "bf16 norm hand-off, 256 parts"])
def test_compiles_for_sm90_to_wgmma_fed_by_cp_async(kind):
    """The PTX for Hopper: the weight tile feeds a WGMMA (bf16 m64n16k16, or e4m3 m64n16k32 on the
    bytes as stored) from shared memory, filled by cp.async in a multi-stage pipeline; the SwiGLU
    variant runs two per K step; the split's partial sums leave by atomics. The norm hand-off's
    epilogues (both in one binary here) leave the weight loop as it is, with the partial sums
    loaded before it (64 rows) or after it (256, from a producer of narrower tiles)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    kernel = stream_triton._stream_kernel
    names = kernel.arg_names
    e4m3 = kind.startswith("e4m3")
    value = "*fp8e4nv" if e4m3 else "*bf16"
    handoff = kind.startswith("bf16 norm hand-off")
    types = {"x_ptr": value, "w_ptr": value, "x_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "res_ptr": "*bf16",
             "out_ptr": "*bf16", "acc_ptr": "*fp32", "count_ptr": "*i32", "g_ptr": "*bf16", "xg_ptr": "*bf16",
             "part_ptr": "*fp32", "part_in_ptr": "*fp32", "n_parts": "i32", "eps": "fp32", "M": "i32",
             "N": "i32", "stride_xm": "i32", "stride_om": "i32"}
    constexprs = {"K": 4096, "SPLIT_K": 2, "BLOCK_N": 64, "BLOCK_K": 256 if e4m3 else 128,
                  "SWIGLU": kind.endswith("SwiGLU"), "E4M3": e4m3, "HAS_RESIDUAL": e4m3 or handoff,
                  "NORM_OUT": handoff, "ROW_SCALE": handoff, "NATIVE": True,
                  "PARTS": (256 if kind.endswith("256 parts") else 64) if handoff else 1}
    assert set(types) | set(constexprs) == set(names)
    signature = {n: types.get(n, "constexpr") for n in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n.endswith("_ptr")}
    src = ASTSource(kernel, signature, {(names.index(n),): v for n, v in constexprs.items()}, aligned)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4}).asm["ptx"]
    wgmma = [line for line in ptx.splitlines() if "wgmma.mma_async" in line]
    shape = "m64n16k32.f32.e4m3.e4m3" if e4m3 else "m64n16k16.f32.bf16.bf16"
    assert wgmma and all(shape in line for line in wgmma), wgmma[:2]
    assert "cp.async.cg.shared.global" in ptx and "cp.async.wait_group" in ptx
    assert "red.global.add.f32" in ptx or "atom.global" in ptx     # the split's reduction


# ------------------------------------------------------------------------------ selection
def chosen(table, op, m, n, k, cap, detail, device=torch.device("cuda")):
    with fake_capability(cap):
        return select.select(table, Problem(op, m, n, k, device, detail)).kernel.name


@pytest.mark.parametrize("m,cap,detail,want", [
    (1, (9, 0), (torch.bfloat16, torch.bfloat16, True), "triton_stream"),
    (16, (9, 0), (torch.float16, torch.float16, True), "triton_stream"),
    (17, (9, 0), (torch.bfloat16, torch.bfloat16, True), "torch_linear"),
    (1, (9, 0), (torch.float32, torch.float32, True), "torch_linear"),
    (1, (9, 0), (torch.bfloat16, torch.bfloat16, False), "torch_linear"),
    (1, (10, 0), (torch.bfloat16, torch.bfloat16, True), "torch_linear"),
    (1, (8, 0), (torch.bfloat16, torch.bfloat16, True), "torch_linear"),
])
def test_dense_selection(m, cap, detail, want):
    assert chosen(dense.DENSE_GEMM, "dense_gemm", m, 4096, 4096, cap, detail) == want
    fused = want == "triton_stream"
    assert chosen(dense.DENSE_SWIGLU, "dense_swiglu", m, 28672, 4096, cap, detail) == (
        "triton_stream_swiglu" if fused else "separate")


def test_dense_on_the_cpu_is_torch_and_tunes_nothing():
    w = torch.randn(96, 64)
    backend = dense.DenseWeight(w)
    calls = []

    class Tuner:
        def best(self, problem, candidates):
            calls.append(candidates())
            return None
    backend.tune(Tuner(), [1, 16, 64], swiglu=True)
    assert not calls and not backend.tuned      # off CUDA the tuner is never asked
    x = torch.randn(3, 64)
    torch.testing.assert_close(backend(x), x @ w.t())
    assert backend.swiglu_forward(x) is None


# ------------------------------------------------------------------------------ on the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("name", list(LLAMA_8B))
def test_gpu_every_listed_config_at_llama_shapes(name):
    """Every configuration the tuner may pick, at M = 1, 7 and 16, against float64."""
    n, k, swiglu = LLAMA_8B[name]
    torch.manual_seed(0)
    w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for config in stream_triton.stream_configs(n // 2 if swiglu else n, k, sms, swiglu):
        for m in (1, 7, 16):
            check(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), w, swiglu, config)


@pytest.mark.gpu
def test_gpu_tuned_backend_and_its_graph_replay(tmp_path):
    """The backend tuned against cuBLAS, at M 1..16 and past it, eager and replayed in a CUDA
    graph (the split-K scratch and counters return to zero between calls), SwiGLU included."""
    from engine.kernels.platform import capture
    from engine.kernels.tuner import Tuner
    torch.manual_seed(0)
    w = (torch.randn(2 * 1536, 1024, device="cuda") / 32).to(torch.bfloat16)
    backend = dense.DenseWeight(w)
    backend.tune(Tuner(tmp_path / "t.json"), [1, 2, 4, 8, 16, 32], swiglu=True)
    assert set(backend.tuned) <= {"dense_gemm", "dense_swiglu"}
    for m in (1, 3, 16, 17, 40):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        assert rel_err(backend(x), reference(x, w, False)) < TOL[torch.bfloat16]
        h = backend.swiglu_forward(x)
        if h is not None:
            assert rel_err(h, reference(x, w, True)) < TOL[torch.bfloat16]
    x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    backend(x)
    graph = torch.cuda.CUDAGraph()
    with capture(graph):
        y = backend(x)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        y.fill_(float("nan"))
        graph.replay()
        assert rel_err(y, reference(x, w, False)) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.skipif(SANITIZER is None, reason="needs compute-sanitizer (the CUDA toolkit)")
def test_gpu_reads_nothing_past_its_operands():
    """Under memcheck, each tensor its own allocation: M = 5 of 16 columns (x's rows past M
    masked), N ending inside a row tile (weight rows clamped), K split, with and without SwiGLU."""
    run_under_memcheck("""
        import torch
        from engine.kernels.stream_triton import stream_matmul
        for n, swiglu in [(4096 + 32, False), (2 * (2048 + 16), True)]:
            x = torch.randn(5, 4096, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, 4096, device="cuda", dtype=torch.bfloat16)
            stream_matmul(x, w, swiglu=swiglu, config=(64, 128, 2, 4))
            torch.cuda.synchronize()
        """)
