"""The kernel layer's shape: one selection per op (checked per format, M and capability, with the
capability faked), the tuner's on-disk cache, weight-format backends as modules whose tensors are
buffers, and an import graph in which kernels stand below formats and nothing cycles."""
import ast
import json
import logging
import pathlib
import re
import types
import warnings

import pytest
import torch

from engine.formats import FORMATS, format_class
from engine.formats import fp8, nvfp4, sparse24
from engine.formats.fp8 import quantize_act_fp8
from engine.kernels import select
from engine.kernels.platform import cute_available, fake_capability
from engine.kernels.select import Kernel, Problem
from engine.kernels.tuner import Tuner
from engine.streams.offload import find_tensors
from tests.numerics import rel_err

REPO = pathlib.Path(__file__).resolve().parents[1]
CUDA = torch.device("cuda")   # never touched: the capability is faked


@pytest.fixture(autouse=True)
def fresh_choices():
    select.clear_cache()
    yield
    select.clear_cache()


def chosen(table, op, m, n, k, cap, detail=(), device=CUDA):
    with fake_capability(cap):
        return select.select(table, Problem(op, m, n, k, device, detail)).kernel.name


# ------------------------------------------------------------------------------------ selection
@pytest.mark.parametrize("m,n,k,want", [(1, 4096, 4096, "triton_stream"), (16, 28672, 4096, "triton_stream"),
                                        (16, 1000, 4096, "triton_stream"),     # any N: rows past it clamped
                                        (17, 4096, 14336, "cute_wgmma_sm90"), (8192, 6144, 4096, "cute_wgmma_sm90")])
def test_fp8_selection_on_hopper(m, n, k, want):
    assert chosen(fp8.FP8_GEMM, "fp8_gemm", m, n, k, (9, 0)) == want


@pytest.mark.parametrize("m,n,k,want", [(1, 4096, 4096, "cute_tcgen05_sm100"), (300, 28672, 4096, "cute_tcgen05_sm100"),
                                        (1, 960, 576, "triton_stream")])
def test_fp8_selection_on_blackwell_takes_tcgen05(m, n, k, want):
    assert chosen(fp8.FP8_GEMM, "fp8_gemm", m, n, k, (10, 0)) == want


@pytest.mark.parametrize("cap,n", [((9, 0), 100), ((10, 0), 960), ((8, 0), 4096)])
def test_fp8_reference_on_cuda_warns_once_with_the_reasons(cap, n):
    """A shape no kernel takes (N not a multiple of 64 / 256), or an architecture with no FP8
    kernels: the reference, with one warning that says why."""
    with pytest.warns(RuntimeWarning, match="runs the PyTorch reference on CUDA"):
        assert chosen(fp8.FP8_GEMM, "fp8_gemm", 64, n, 512, cap) == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert chosen(fp8.FP8_GEMM, "fp8_gemm", 64, n, 512, cap) == "reference"


@pytest.mark.parametrize("m,want", [(1, "gluon_decode"), (4, "gluon_decode"), (5, "gluon_wgmma_decode"),
                                    (16, "gluon_wgmma_decode"), (17, "triton_decode"),
                                    (128, "triton_decode"), (129, "large"), (8192, "large")])
def test_nvfp4_selection_on_hopper(m, want):
    if want == "large":
        want = "fp8_dequantize_wgmma" if cute_available() else "reference"
    assert chosen(nvfp4.NVFP4_GEMM, "nvfp4_gemm", m, 28672, 4096, (9, 0), (torch.bfloat16, True)) == want


def test_nvfp4_selection_on_blackwell_and_elsewhere():
    detail = (torch.bfloat16, False)
    assert chosen(nvfp4.NVFP4_GEMM, "nvfp4_gemm", 1, 4096, 4096, (10, 0), detail) == "cute_tcgen05_sm100"
    assert chosen(nvfp4.NVFP4_GEMM, "nvfp4_gemm", 1, 4096, 4160, (10, 0), detail) == "triton_decode"
    assert chosen(nvfp4.NVFP4_GEMM, "nvfp4_gemm", 1, 4096, 4096, (8, 6), detail) == "triton_decode"
    with pytest.warns(RuntimeWarning, match="takes bf16 / fp16 activations"):
        assert chosen(nvfp4.NVFP4_GEMM, "nvfp4_gemm", 1, 4096, 4096, (9, 0), (torch.float32, True)) == "reference"


def test_swiglu_epilogues_only_where_they_are_selected():
    d = (torch.bfloat16, True)
    assert chosen(nvfp4.NVFP4_SWIGLU, "nvfp4_swiglu", 1, 28672, 4096, (9, 0), d) == "gluon_decode_swiglu"
    assert chosen(nvfp4.NVFP4_SWIGLU, "nvfp4_swiglu", 4, 28672, 4096, (9, 0), d) == "gluon_decode_swiglu"
    assert chosen(nvfp4.NVFP4_SWIGLU, "nvfp4_swiglu", 5, 28672, 4096, (9, 0), d) == "gluon_wgmma_decode_swiglu"
    assert chosen(nvfp4.NVFP4_SWIGLU, "nvfp4_swiglu", 16, 28672, 4096, (9, 0), d) == "gluon_wgmma_decode_swiglu"
    assert chosen(nvfp4.NVFP4_SWIGLU, "nvfp4_swiglu", 17, 28672, 4096, (9, 0), d) == "separate"
    assert chosen(nvfp4.NVFP4_SWIGLU, "nvfp4_swiglu", 1, 28672, 4096, (10, 0), d) == "separate"
    s = (torch.bfloat16, torch.bfloat16, True, True)
    assert chosen(sparse24.SPARSE24_SWIGLU, "sparse24_swiglu", 1, 28672, 4096, (9, 0), s) == "gluon_sparse_mma_swiglu"
    assert chosen(sparse24.SPARSE24_SWIGLU, "sparse24_swiglu", 16, 28672, 4096, (9, 0), s) == "separate"


@pytest.mark.parametrize("m,detail,want", [
    (1, (torch.bfloat16, torch.bfloat16, True, True), "gluon_sparse_mma"),
    (16, (torch.bfloat16, torch.bfloat16, True, True), "gluon_sparse_mma"),
    (17, (torch.bfloat16, torch.bfloat16, True, True), "cusparselt"),
    (1, (torch.bfloat16, torch.bfloat16, True, False), "cusparselt"),
    (1, (torch.bfloat16, torch.bfloat16, False, False), "triton_stream"),
])
def test_sparse24_selection_on_hopper(m, detail, want):
    assert chosen(sparse24.SPARSE24_GEMM, "sparse24_gemm", m, 28672, 4096, (9, 0), detail) == want


def test_sparse24_fp8_and_other_architectures():
    # sm_90: the sparse-MMA kernel on e4m3 up to 16 tokens where the weight has its metadata in MMA
    # order, torchao's kernel past it (or without that metadata), else the Triton kernel.
    both = (torch.float8_e4m3fn, torch.bfloat16, True, True)
    lib = (torch.float8_e4m3fn, torch.bfloat16, True, False)
    none = (torch.float8_e4m3fn, torch.bfloat16, False, False)
    for m in (1, 16):
        assert chosen(sparse24.SPARSE24_FP8_GEMM, "s", m, 4096, 14336, (9, 0), both) == "gluon_sparse_mma_fp8"
    assert chosen(sparse24.SPARSE24_FP8_GEMM, "s", 17, 4096, 14336, (9, 0), both) == "torchao_cutlass_sm90"
    # K = 14336 + 64 divides no e4m3 configuration's K step (2 x 32 x WPT): the library's kernel
    assert chosen(sparse24.SPARSE24_FP8_GEMM, "s", 1, 4096, 14400, (9, 0), both) == "torchao_cutlass_sm90"
    assert chosen(sparse24.SPARSE24_FP8_GEMM, "s", 1, 4096, 14336, (9, 0), lib) == "torchao_cutlass_sm90"
    assert chosen(sparse24.SPARSE24_FP8_GEMM, "s", 1, 4096, 14336, (9, 0), none) == "triton_stream"
    assert chosen(sparse24.SPARSE24_FP8_GEMM, "s", 1, 4096, 14336, (10, 0), lib) == "triton_stream"
    # what each takes: e4m3 activations from the norm / SwiGLU before, or the model's dtype
    assert [k.input_quant for k in sparse24.SPARSE24_FP8_GEMM[9]] == ["fp8", "fp8", None, None]
    bf16 = (torch.bfloat16, torch.bfloat16, True, False)
    assert chosen(sparse24.SPARSE24_GEMM, "s", 1, 4096, 14336, (10, 0), bf16) == "cusparselt"


def test_cpu_takes_the_references_without_a_warning():
    cpu = torch.device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert chosen(fp8.FP8_GEMM, "fp8_gemm", 1, 4096, 4096, None, device=cpu) == "reference"
        assert chosen(nvfp4.NVFP4_GEMM, "nvfp4_gemm", 1, 64, 64, None, (torch.float32, False), cpu) == "reference"
        assert chosen(sparse24.SPARSE24_GEMM, "s", 1, 64, 64, None, (torch.float32,) * 2 + (False, False), cpu) == "reference"


def test_choice_logged_once_per_shape_class(caplog):
    with caplog.at_level(logging.INFO, logger="microengine.kernels"):
        for m in (1, 2, 2, 3, 4, 4):
            chosen(fp8.FP8_GEMM, "fp8_gemm", m, 4096, 4096, (9, 0))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and all(": triton_stream" in line for line in lines)   # buckets 1, 2, 4


def test_tuned_choice_wins_where_it_can_run_and_nothing_runnable_raises():
    run = lambda *a, **k: None  # noqa: E731
    table = {"other": [Kernel("a", run, needs_cuda=False), Kernel("b", run, needs_cuda=False, max_m=8,
                                                                  configs=lambda p: [(1,), (2,)])]}
    p = Problem("toy", 4, 64, 64, torch.device("cpu"))
    assert select.select(table, p).kernel.name == "a"
    choice = select.select(table, p, tuned={4: ("b", (2,))})
    assert (choice.kernel.name, choice.config) == ("b", (2,))
    big = Problem("toy", 16, 64, 64, torch.device("cpu"))
    assert select.select(table, big, tuned={16: ("b", (2,))}).kernel.name == "a"   # b takes M <= 8
    with pytest.raises(ValueError, match="no kernel can run .* b: takes M <= 8"):
        select.select({"other": table["other"][1:]}, big)


# ------------------------------------------------------------------------------ attention selection
def _rows(m, heads, head_dim, dtype, device=CUDA):
    """What the attention's selection reads of q (shape, dtype, device): no memory on a CPU machine."""
    return types.SimpleNamespace(shape=(m, heads, head_dim), dtype=dtype, device=device)


def _cache(page, kv_heads):
    return types.SimpleNamespace(shape=(64, page, kv_heads, 128))


BF16, FP16 = torch.bfloat16, torch.float16


@pytest.mark.parametrize("cap,dtype,hd,page,group,fp8_cache,want", [
    ((9, 0), BF16, 128, 16, 4, True, "gluon_fp8_cache"),
    ((8, 9), FP16, 128, 16, 8, True, "gluon_fp8_cache"),
    ((10, 0), BF16, 128, 16, 1, True, "gluon_fp8_cache"),
    ((9, 0), BF16, 128, 16, 4, False, "triton"),           # a 16-bit cache
    ((8, 6), BF16, 128, 16, 4, True, "triton"),            # no e4m3 conversion in hardware
    ((9, 0), torch.float32, 128, 16, 4, True, "triton"),
    ((9, 0), BF16, 64, 16, 4, True, "triton"),
    ((9, 0), BF16, 128, 32, 4, True, "triton"),
    ((9, 0), BF16, 128, 16, 16, True, "triton"),
])
def test_decode_attention_selection(monkeypatch, cap, dtype, hd, page, group, fp8_cache, want):
    """Over an FP8 cache the Gluon kernel (engine/kernels/attention_gluon.py) runs where it can:
    capability 8.9 and up, 16-bit q, heads of 128, pages of 16, up to 8 query heads per KV head;
    the Triton kernel everywhere else on a GPU."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from engine.kernels import attention
    with fake_capability(cap):
        assert attention.decode_kernel(_rows(1, 8 * group, hd, dtype), _cache(page, 8), fp8_cache).name == want


def test_attention_off_the_gpu_and_the_reasons_logged_once(monkeypatch, caplog):
    """No GPU: the references, or the Triton kernels under the interpreter (never Gluon). Each
    choice is logged once, with why the kernels before it cannot run."""
    from engine.kernels import attention
    cpu = torch.device("cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert attention.decode_kernel(_rows(4, 32, 128, BF16, cpu), _cache(16, 8), True).name == "reference"
    assert attention.prefill_kernel(_rows(64, 32, 128, BF16, cpu), False, 0, 1, 64).name == "reference"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert attention.decode_kernel(_rows(4, 32, 128, BF16, cpu), _cache(16, 8), True).name == "triton"
    assert attention.prefill_kernel(_rows(64, 32, 128, BF16, cpu), False, 0, 1, 64).name == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with caplog.at_level(logging.INFO, logger="microengine.kernels"):
        with fake_capability((8, 6)):
            for _ in range(3):
                attention.decode_kernel(_rows(1, 32, 128, BF16), _cache(16, 8), True)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode_attention")]
    assert len(lines) == 1, lines
    assert "triton" in lines[0] and "gluon_fp8_cache: needs sm_89+" in lines[0], lines[0]


def test_gluon_candidates_step_aside_where_triton_lacks_gluon(monkeypatch, caplog):
    """With a Triton whose Gluon the kernels cannot use (engine/kernels/platform.py gluon_missing),
    every Gluon candidate says why and the next kernel of its list runs: the NVFP4 decode and its
    SwiGLU epilogue, the 2:4 sparse-MMA kernel and its SwiGLU epilogue, the FP8-cache attention."""
    from engine.kernels import attention, platform
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert platform.gluon_missing() is None      # this machine's Triton has it: the kernels' own tests compile them
    monkeypatch.setattr(platform, "_gluon_import_error", lambda: "Triton 0.0 lacks the Gluon API")
    nv, sp = (BF16, True), (BF16, BF16, True, True)
    with caplog.at_level(logging.INFO, logger="microengine.kernels"):
        assert chosen(nvfp4.NVFP4_GEMM, "nvfp4_gemm", 1, 28672, 4096, (9, 0), nv) == "triton_decode"
    assert chosen(nvfp4.NVFP4_SWIGLU, "nvfp4_swiglu", 1, 28672, 4096, (9, 0), nv) == "separate"
    assert chosen(sparse24.SPARSE24_GEMM, "sparse24_gemm", 1, 28672, 4096, (9, 0), sp) == "cusparselt"
    assert chosen(sparse24.SPARSE24_SWIGLU, "sparse24_swiglu", 1, 28672, 4096, (9, 0), sp) == "separate"
    sp8 = (torch.float8_e4m3fn, BF16, True, True)
    assert chosen(sparse24.SPARSE24_FP8_GEMM, "sparse24_fp8_gemm", 1, 28672, 4096, (9, 0), sp8) == "torchao_cutlass_sm90"
    with fake_capability((9, 0)):
        assert attention.decode_kernel(_rows(1, 32, 128, BF16), _cache(16, 8), True).name == "triton"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("nvfp4_gemm")]
    assert len(lines) == 1 and "gluon_decode: Triton 0.0 lacks the Gluon API" in lines[0], lines


@pytest.mark.parametrize("tokens,seqs,max_prefix,max_len,dtype,cap,want", [
    (64 * 128, 64, 0, 128, BF16, (9, 0), "flash_attention_2"),
    (4 * 256 - 1, 4, 0, 700, FP16, (8, 0), "flash_attention_2"),
    (4 * 256, 4, 0, 700, BF16, (9, 0), "triton"),        # prompts averaging FRESH_PROMPT_LEN or more
    (64, 8, 16, 8, BF16, (9, 0), "triton"),              # a cached prefix
    (64, 8, None, 8, BF16, (9, 0), "triton"),            # whether there is one is not known
    (64, 8, 0, None, BF16, (9, 0), "triton"),            # the longest prompt not known on the host
    (64, 8, 0, 8, torch.float32, (9, 0), "triton"),
    (64, 8, 0, 8, BF16, (7, 5), "triton"),
])
def test_prefill_attention_selection(monkeypatch, tokens, seqs, max_prefix, max_len, dtype, cap, want):
    """FlashAttention-2 for fresh prompts averaging under FRESH_PROMPT_LEN tokens (sm_80+, 16-bit);
    longer ones, and any step with a prefix, the prefill kernel."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from engine.kernels import attention
    assert attention.FRESH_PROMPT_LEN == 256
    with fake_capability(cap):
        assert attention.prefill_kernel(_rows(tokens, 32, 128, dtype), False, max_prefix, seqs, max_len).name == want


def test_gluon_fp8_decode_kernel_compiles_for_sm90():
    """Compiled on the CPU for sm_90 (with and without RoPE's prologue): per page and thread the loop
    copies its bytes by cp.async in 16-byte pieces (K: 2 rows x 32 bytes, V: 4 rows x 16) and its
    scales into the shared ring, reads the page before it back in 16-byte loads, converts them a word
    (4 values) at a time in two cvt.rn.f16x2.e4m3x2, and runs 8 + 8 m16n8k16 MMAs; it reads nothing
    from global memory itself but the next pages' block-table entries, once for K, V and scales."""
    from gluon_ptx import compile_sm90, ptx_loops, ptxas_usage, sass_loops
    from engine.kernels.attention_gluon import MAX_REGISTERS, NUM_WARPS, fp8_cache_decode_kernel
    args = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", inv_freq_ptr="*fp32", k_cache_ptr="*fp8e4nv",
                v_cache_ptr="*fp8e4nv", k_scale_ptr="*fp32", v_scale_ptr="*fp32", block_tables_ptr="*i32",
                context_lens_ptr="*i32", out_ptr="*bf16", part_acc_ptr="*fp32", part_max_ptr="*fp32",
                part_sum_ptr="*fp32", scale_log2e="fp32")
    args |= {n: "i32" for n in fp8_cache_decode_kernel.arg_names
             if n.startswith("stride") or n in ("bt_stride", "n_heads", "num_splits")}
    for rope_ in (False, True):
        ptx = compile_sm90(fp8_cache_decode_kernel, args, {"GROUP": 4, "ROPE": rope_}, NUM_WARPS, MAX_REGISTERS)
        # Under the launch's register cap the page loop keeps everything in registers; RoPE's
        # prologue spills a little there (BENCHMARKS.md, "Tried and did not pay": a higher cap for
        # it costs programs an SM).
        registers, spilled = ptxas_usage(ptx)
        assert rope_ or spilled == 0, (registers, spilled)
        page_loops = [body for body in sass_loops(ptx) if "HMMA" in body]
        assert len(page_loops) == 1 and not re.search(r"\b(LDL|STL)\b", page_loops[0])
        loops = [body for body in ptx_loops(ptx) if "mma.sync" in body]
        assert len(loops) == 1, len(loops)
        body = loops[0]
        assert body.count("cp.async.cg.shared.global") == 8
        assert body.count("cp.async.ca.shared.global") == 4     # the scales of keys g and g + 8
        assert body.count("cp.async.commit_group") == 1 and body.count("cp.async.wait_group") == 1
        assert body.count("ld.shared.v4") == 8
        assert body.count("ld.global") == 1                      # the next pages' block-table entries only
        assert body.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32") == 16
        assert body.count("cvt.rn.f16x2.e4m3x2") == 64


# ------------------------------------------------------------------------------------ tuner
def test_tuner_times_once_caches_on_disk_and_reuses(tmp_path):
    path = tmp_path / "tuning.json"
    times = {"slow": 3.0, "fast": 1.0, "mid": 2.0}
    timed = []

    def timer(fn):
        timed.append(fn())
        return times[timed[-1]]
    p = Problem("toy", 3, 128, 256, torch.device("cpu"), ("bf16",))
    candidates = [(name, (i, [i]), lambda name=name: name) for i, name in enumerate(times)]
    tuner = Tuner(path, timer=timer)
    assert tuner.best(p, lambda: candidates) == ("fast", (1, (1,)))
    assert len(timed) == 3 + 3 and tuner.timed == 6
    tuner.save()
    entry = json.loads(path.read_text())["entries"]
    assert len(entry) == 1 and json.loads(next(iter(entry)))["m_bucket"] == 4

    def no_timer(fn):
        raise AssertionError("a cached entry must not be timed again")
    again = Tuner(path, timer=no_timer)
    assert again.best(Problem("toy", 4, 128, 256, torch.device("cpu"), ("bf16",)), lambda: candidates) == ("fast", (1, (1,)))
    # Another shape is not in the cache; with tuning off it is not timed either.
    assert Tuner(path, enabled=False, timer=no_timer).best(Problem("toy", 4, 64, 256, torch.device("cpu")),
                                                           lambda: candidates) is None


def test_tuner_ignores_a_corrupt_cache_with_a_warning(tmp_path):
    path = tmp_path / "tuning.json"
    path.write_text("{not json")
    with pytest.warns(RuntimeWarning, match="unreadable"):
        tuner = Tuner(path, timer=lambda fn: 1.0)
    assert tuner.entries == {}
    p = Problem("toy", 1, 8, 8, torch.device("cpu"))
    assert tuner.best(p, lambda: [("a", None, lambda: None), ("b", None, lambda: None)]) is not None
    tuner.save()
    assert Tuner(path).entries == tuner.entries


def test_tuner_cache_default_location(monkeypatch, tmp_path):
    monkeypatch.setenv("MICROENGINE_CACHE_DIR", str(tmp_path))
    assert Tuner().path == tmp_path / "tuning.json"
    monkeypatch.delenv("MICROENGINE_CACHE_DIR")
    assert Tuner().path == pathlib.Path.home() / ".cache" / "microengine" / "tuning.json"


# ------------------------------------------------------------------------------------ backends
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_backend_tensors_are_buffers_and_survive_to_state_dict_and_offload(fmt):
    torch.manual_seed(0)
    w = torch.randn(64, 256) * 0.05
    backend = format_class(fmt).from_dense(w)
    x = torch.randn(5, 256)
    y = backend(x)
    buffers = {id(b) for b in backend.buffers()}
    loose = [k for k, v in vars(backend).items() if isinstance(v, torch.Tensor) and id(v) not in buffers]
    assert not loose, f"tensors outside buffers: {loose}"
    assert {id(t) for t in find_tensors(backend)} == buffers
    # state_dict round trip into a backend built from other weights
    other = format_class(fmt).from_dense(torch.randn(64, 256))
    other.load_state_dict(backend.state_dict())
    assert torch.equal(other(x), y)
    # .to() moves every tensor (the meta device: no copy, and any tensor left behind would show)
    moved = backend.to("meta")
    assert all(b.device.type == "meta" for b in moved.buffers())


def test_linear_moves_and_converts_as_a_module():
    from engine.linear import Linear
    lin = Linear(256, 64, dtype=torch.float32)
    lin.weight.normal_()
    assert list(lin.state_dict()) == ["backend.weight"]
    lin.convert("fp8")
    assert sorted(lin.state_dict()) == ["backend.qweight", "backend.scale"]
    with pytest.raises(RuntimeError, match="stored as fp8"):
        lin.weight  # noqa: B018
    assert lin.to("meta").backend.qweight.device.type == "meta"


# ------------------------------------------------------------------------------------ imports
def _imports(path: pathlib.Path, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {f for f in found if f.split(".")[0] in ("engine", "models")}


def _modules():
    mods = {}
    for path in sorted([*REPO.glob("engine/**/*.py"), *REPO.glob("models/**/*.py")]):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def test_kernels_import_nothing_above_them():
    for name, path in _modules().items():
        if name.startswith("engine.kernels"):
            bad = {i for i in _imports(path, top_level_only=False)
                   if not i.startswith("engine.kernels")}
            assert not bad, f"{name} imports {bad}"


def test_no_import_cycles():
    """Module-level imports between engine/ and models/ modules form no cycle (a package's
    __init__ is not counted as imported by its submodules)."""
    mods = _modules()
    graph = {name: {i for i in _imports(path, top_level_only=True) if i in mods and i != name}
             for name, path in mods.items()}
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2
    for name in graph:
        if name not in state:
            visit(name, [name])


# ------------------------------------------------------------------------------------ on the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4", "2:4", "2:4+fp8"])
def test_gpu_every_selected_kernel_matches_the_format_reference(fmt, tmp_path):
    """Each format's backend on CUDA, at every M regime of its kernel lists (tails included), tuned
    and untuned, against the same stored values multiplied in float64 (bf16 output rounding and,
    for fp8 activations, their e4m3 rounding aside); outputs are poisoned first by the kernels'
    own allocations being uninitialised, and every element is checked finite."""
    torch.manual_seed(0)
    bound = {"fp8": 0.08, "2:4+fp8": 0.08}.get(fmt, 0.01)   # e4m3 activations: 3 mantissa bits
    # NVFP4 past the decode kernels' 128 rows, where the FP8 GEMM runs: e4m3 activations too
    fp8_path = cute_available()
    for n, k in ((1024, 512), (4096, 4096), (1536, 1152)):
        w = (torch.randn(n, k, device="cuda") * 0.05).to(torch.bfloat16)
        backend = format_class(fmt).from_dense(w)
        dense = backend.dequantize().double()
        tuned = format_class(fmt).from_dense(w)
        tuned.tune(Tuner(tmp_path / "t.json"), [1, 16, 64, 256], swiglu=True)
        for m in (1, 3, 4, 5, 16, 17, 64, 100, 128, 129, 300, 2048):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.double() @ dense.t()
            for b in (backend, tuned):
                out = b(x)
                assert out.shape == (m, n)   # rel_err below fails a non-finite output
                tol = 0.08 if fmt == "nvfp4" and m > 128 and fp8_path else bound
                assert rel_err(out, ref) < tol, (fmt, n, k, m, b.tuned)
                if fmt in ("fp8", "nvfp4") and b.input_quant(m) == "fp8":   # as the norm / SwiGLU hand it
                    assert torch.equal(b(*quantize_act_fp8(x)), out), (fmt, n, k, m)
            for b in (backend, tuned):
                h = b.swiglu_forward(x)
                if h is not None:
                    g, u = ref.chunk(2, dim=-1)
                    assert rel_err(h, torch.nn.functional.silu(g) * u) < bound, (fmt, n, k, m, "swiglu", b.tuned)
