"""Where a kernel can run: the one place that answers capability, SM count, interpreter and
library questions for every kernel and every selection.

- `capability(device)`: (major, minor) of a CUDA device, None for the CPU. Tests fake it with
  `fake_capability((10, 0))` to check what a Blackwell GPU would select.
- `interpreting()`: Triton's interpreter (TRITON_INTERPRET=1) runs the Triton kernels on the CPU;
  inline PTX, Gluon and CuTe DSL cannot run there.
- `triton_runs(t)`: whether Triton kernels can serve tensor t (CUDA, or the interpreter).
- `sm_count(device)` / `sm_count_or_default(device)`: a GPU's SMs; the second, for launch rules,
  falls back to an H100 SXM's 132 where no GPU answers.
- `jit(fn)`: triton.jit where Triton is installed, else fn unchanged, so a module of kernels imports
  on a machine without Triton and its references still run.
- `cute_available()` / `gluon_missing()`: whether CuTe DSL is installed, and why the Gluon kernels
  cannot be built with this Triton (None where they can): the selection checks of those kernels
  ask, so that their lists fall through to the next kernel.
- `capture(graph, pool)`: torch.cuda.graph for graphs that launch Triton kernels, under either of
  torch's allocators (see its docstring for what cudaMallocAsync needs).
- `activation_empty(m, k, dtype, device)` / `storage_rows(t)`: FP8 activations whose storage holds
  whole GEMM tiles of rows, and how many rows a matrix's storage holds.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import torch

try:
    import triton
except ImportError:  # no Triton: every op runs its reference
    triton = None

_fake_capability: tuple[int, int] | None = None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def jit(fn=None, **options):
    """triton.jit(fn, **options), or fn itself where Triton is missing."""
    if fn is None:
        return lambda f: jit(f, **options)
    return triton.jit(fn, **options) if triton is not None else fn


def triton_runs(where: torch.Tensor | torch.device) -> bool:
    """Triton kernels run for a tensor (or device) here: on CUDA, or anywhere under the interpreter."""
    device = where.device if isinstance(where, torch.Tensor) else where
    return triton is not None and (device.type == "cuda" or interpreting())


def output_buffer(out: torch.Tensor | None, shape, dtype: torch.dtype, device, name: str = "out") -> torch.Tensor:
    """Where a kernel writes: the caller's buffer `out` (the step graphs' static buffers), checked
    to be contiguous and of this shape and dtype, or else a new tensor."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"{name}: a contiguous {dtype} tensor of shape {tuple(shape)} is needed, "
                         f"got {out.dtype} {tuple(out.shape)}")
    return out


# FP8 activations are allocated with their rows rounded up to this (the largest GEMM tile's rows), so
# that the FP8 GEMMs' TMA loads whole tiles of A: on Hopper a box that lies partly past the tensor's
# last row loads slowly (BENCHMARKS.md, "FP8 GEMMs"). The GEMMs read the padding rows (whatever they
# hold) into accumulator rows whose results they never store.
ACTIVATION_ROW_ALIGN = 128


def activation_empty(m: int, k: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised [m, k] tensor whose storage holds m rounded up to ACTIVATION_ROW_ALIGN rows."""
    rows = -(-m // ACTIVATION_ROW_ALIGN) * ACTIVATION_ROW_ALIGN
    return torch.empty(rows, k, dtype=dtype, device=device)[:m]


def storage_rows(t: torch.Tensor) -> int:
    """Rows of the row-major matrix t [M, K] (unit stride along K) that its storage holds from t's
    first element: M or more (rows past M being whatever the storage holds there)."""
    if t.dim() != 2 or t.stride(1) != 1 or t.shape[0] == 0:
        return t.shape[0]
    elements = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    return max(t.shape[0], (elements - t.shape[1]) // t.stride(0) + 1)


def capability(device: torch.device | str | int | None) -> tuple[int, int] | None:
    """The CUDA compute capability of `device`, or None for a CPU device (or fake_capability's)."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cpu")
    if device.type != "cuda":
        return None
    if _fake_capability is not None:
        return _fake_capability
    return _real_capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _real_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@contextlib.contextmanager
def fake_capability(cap: tuple[int, int]):
    """Every CUDA device reports `cap` inside the block (selection tests on a CPU machine)."""
    global _fake_capability
    old, _fake_capability = _fake_capability, cap
    try:
        yield
    finally:
        _fake_capability = old


def arch_name(cap: tuple[int, int] | None) -> str:
    return "cpu" if cap is None else f"sm_{cap[0]}{cap[1]}"


def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device; a small fixed count elsewhere (the interpreter's grid sizing)."""
    if device.type != "cuda" or interpreting():
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def sm_count_or_default(device: torch.device | str = "cuda") -> int:
    """The SMs a launch rule plans for: a CUDA device's, or an H100 SXM's 132 where no GPU answers
    (the CPU and its interpreter, compiles for a GPU, selection with a faked capability)."""
    device = torch.device(device)
    return sm_count(device) if device.type == "cuda" and torch.cuda.is_available() else 132


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def cute_available() -> bool:
    """Whether nvidia-cutlass-dsl (CuTe DSL) is installed; optional on CPU-only machines."""
    return importlib.util.find_spec("cutlass") is not None


def gluon_missing() -> str | None:
    """Why the Gluon kernels (engine/kernels/*_gluon.py) cannot be built with this Triton, or None.
    Triton releases before its Gluon dialect (or with an older one) lack the modules and layouts
    they import; their candidates then say so and the next one in each list runs."""
    return _gluon_import_error()


@functools.cache
def _gluon_import_error() -> str | None:
    if triton is None:
        return "Triton is not installed"
    try:
        import engine.kernels.attention_gluon  # noqa: F401
        import engine.kernels.sparse24_gluon  # noqa: F401  (imports nvfp4_gluon)
    except (ImportError, AttributeError) as e:
        return f"Triton {triton.__version__} lacks the Gluon API these kernels use ({e})"
    return None


@functools.cache
def library_versions() -> dict[str, str]:
    """Versions that change what a kernel compiles to: part of every tuning-cache key."""
    versions = {"torch": torch.__version__, "triton": getattr(triton, "__version__", "none")}
    from importlib.metadata import PackageNotFoundError, version
    try:
        versions["cutlass_dsl"] = version("nvidia-cutlass-dsl")
    except PackageNotFoundError:
        versions["cutlass_dsl"] = "none"
    return versions


def device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    return _device_name(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@contextlib.contextmanager
def capture(graph: "torch.cuda.CUDAGraph", pool=None):
    """torch.cuda.graph(graph, pool=pool), made safe for Triton kernels under cudaMallocAsync.

    Under torch's cudaMallocAsync backend, what a capture allocates becomes a graph memory node: its
    address is reserved at capture but mapped only when the graph first runs. Two things follow:
    - Triton's launcher checks every tensor argument with cuPointerGetAttribute, which refuses such
      an address ("Pointer argument cannot be accessed from Triton"), while an integer address it
      passes through unchecked. So during the capture, Triton tensor arguments go to the launcher as
      their data_ptr(); the kernel receives the same address either way.
    - A capture may allocate memory that outlives it without the caller knowing: cuBLAS's workspace
      for the capture stream is one, and later graphs use it. So the graph runs once as soon as it
      is captured, which maps that memory for good.
    Give a graph its outputs from outside: a tensor the capture allocates and the caller keeps is
    the graph's memory, and freeing it outside the graph draws a warning from torch.
    """
    if torch.cuda.get_allocator_backend() != "cudaMallocAsync" or triton is None:
        with torch.cuda.graph(graph, pool=pool):
            yield
        return
    from triton.backends.nvidia.driver import CudaLauncher
    launch = CudaLauncher.__call__

    def launch_by_address(self, *args, **kwargs):
        return launch(self, *(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args), **kwargs)

    CudaLauncher.__call__ = launch_by_address
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        CudaLauncher.__call__ = launch
    graph.replay()
