"""Which device allocator torch uses, and whether the stream-ordered pool keeps what it frees.

`configure_allocator` picks the backend through PYTORCH_ALLOC_CONF. torch reads that variable when
it loads (and checks it again when it initialises CUDA: a change in between aborts), so the variable
must be set before `import torch`. This module imports torch only inside its functions; since the
`engine` package itself loads torch, command-line entry points (serve.py, bench.py) call
`configure_allocator(..., reexec=True)`, which restarts the process once with the variable set.
The release threshold of the device's default memory pool (the pool cudaMallocAsync draws from) is
a CUDA attribute, set through cuda-bindings once torch has initialised the pool:

- dedicated (threshold = UINT64_MAX): freed memory stays in the pool; the GPU belongs to this process.
- shared (threshold = 0): at each synchronisation the pool returns what it does not hold to the
  driver, so other processes on the GPU can have it; the next growth pays a real allocation again.
"""
from __future__ import annotations

import argparse
import os
import sys

BACKENDS = ("native", "cudaMallocAsync")
RELEASES = ("dedicated", "shared")
# The command-line default. With CUDA graphs on both backends decode, prefill and serve at the same
# speed (BENCHMARKS.md, allocators); native needs no restart of the process to be chosen, and
# cudaMallocAsync's gain, the shared release threshold, is for a GPU shared with other processes.
DEFAULT_BACKEND = "native"
DEFAULT_RELEASE = "dedicated"
ENV = "PYTORCH_ALLOC_CONF"
UINT64_MAX = 2 ** 64 - 1
REEXEC_MARK = "MICROENGINE_ALLOCATOR_REEXEC"

_release = "dedicated"      # what configure_allocator chose; apply_release puts it on the device


def configure_allocator(backend: str, release: str, reexec: bool = False) -> None:
    """Select torch's device allocator; call before `import torch`.

    If torch is already loaded with another backend it is too late: a RuntimeError says so, or with
    `reexec=True` (for command-line entry points such as serve.py) the process restarts itself with
    the same command line and the variable set, and this call then finds it in force.

    backend: "native" (the caching allocator over cudaMalloc) or "cudaMallocAsync" (the driver's
    stream-ordered pool). release: "dedicated" or "shared", see the module docstring; the native
    allocator never returns memory by itself, so it takes "dedicated" only. Other settings already
    in PYTORCH_ALLOC_CONF are kept.
    """
    if backend not in BACKENDS:
        raise ValueError(f"allocator backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if release not in RELEASES:
        raise ValueError(f"memory release {release!r} is not one of {', '.join(RELEASES)}")
    if backend == "native" and release == "shared":
        raise ValueError("memory release 'shared' needs the cudaMallocAsync backend: the native "
                         "caching allocator keeps every block it frees")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        loaded = torch.cuda.get_allocator_backend()     # what torch chose when it loaded
        if loaded != backend and reexec and not os.environ.get(REEXEC_MARK):
            _set_env(backend)
            os.environ[REEXEC_MARK] = "1"          # restart once: never loop if torch ignores it
            sys.stdout.flush()
            os.execv(sys.executable, sys.orig_argv)
        if loaded != backend:
            raise RuntimeError(f"configure_allocator({backend!r}) came too late: torch is already "
                               f"loaded with the {loaded!r} allocator, and it reads "
                               f"PYTORCH_ALLOC_CONF only when it loads; call this before "
                               f"`import torch`, or start the process with "
                               f"PYTORCH_ALLOC_CONF=backend:{backend}")
    _set_env(backend)
    global _release
    _release = release


def _set_env(backend: str) -> None:
    """backend:<backend> in PYTORCH_ALLOC_CONF, its other settings kept."""
    entries = [kv for kv in os.environ.get(ENV, "").split(",")
               if kv.strip() and kv.split(":")[0].strip() != "backend"]
    os.environ[ENV] = ",".join([f"backend:{backend}", *entries])
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)   # the old name would override the new one


def allocator_backend() -> str:
    """The allocator torch uses: 'native' or 'cudaMallocAsync'."""
    import torch
    return torch.cuda.get_allocator_backend()


def _check(result):
    err, *values = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA runtime call failed: {err!r}")
    return values[0] if len(values) == 1 else values


def _default_pool(device):
    import torch
    from cuda.bindings import runtime as cudart
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    return cudart, _check(cudart.cudaDeviceGetDefaultMemPool(index))


def set_release_threshold(device, dedicated: bool) -> None:
    """Set the release threshold of `device`'s default memory pool (what cudaMallocAsync uses).

    torch configures this pool (threshold included) on its first allocation on the device; a
    tensor is allocated first so that this setting comes after torch's, not before it.
    """
    if allocator_backend() != "cudaMallocAsync":
        raise RuntimeError("set_release_threshold: torch is not using the cudaMallocAsync backend "
                           f"(it uses {allocator_backend()!r}); call configure_allocator first")
    import torch
    torch.empty(1, device=device)            # makes torch initialise (and configure) the pool
    cudart, pool = _default_pool(device)
    from cuda.bindings import driver
    value = driver.cuuint64_t(UINT64_MAX if dedicated else 0)
    _check(cudart.cudaMemPoolSetAttribute(pool, cudart.cudaMemPoolAttr.cudaMemPoolAttrReleaseThreshold,
                                          value))


def release_threshold(device) -> int:
    """The release threshold of `device`'s default memory pool, in bytes."""
    cudart, pool = _default_pool(device)
    value = _check(cudart.cudaMemPoolGetAttribute(pool, cudart.cudaMemPoolAttr.cudaMemPoolAttrReleaseThreshold))
    return int(value)


def apply_release(device) -> None:
    """Apply the release chosen in configure_allocator to `device` (after CUDA is initialised);
    nothing to do on the CPU or under the native allocator."""
    import torch
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return
    if allocator_backend() == "cudaMallocAsync":
        set_release_threshold(device, _release == "dedicated")


# ----------------------------------------------------------------------------- command line

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--allocator and --memory-release, for serve.py and bench.py."""
    group = parser.add_argument_group("device memory")
    group.add_argument("--allocator", choices=BACKENDS, default=DEFAULT_BACKEND,
                       help="torch's device allocator: 'native' (the caching allocator over "
                            "cudaMalloc) or 'cudaMallocAsync' (the driver's stream-ordered pool) "
                            "(default: %(default)s)")
    group.add_argument("--memory-release", choices=RELEASES, default=DEFAULT_RELEASE,
                       help="cudaMallocAsync only: 'dedicated' keeps freed memory in the pool (the "
                            "GPU is this process's), 'shared' returns it to the driver at each "
                            "synchronisation for other processes (default: %(default)s)")


def configure_from_args(args, parser: argparse.ArgumentParser | None = None) -> None:
    """Check the two options and select the backend, restarting the process once if torch already
    loaded with another one (call it before anything touches CUDA). A bad combination is a
    command-line error."""
    try:
        configure_allocator(args.allocator, args.memory_release, reexec=True)
    except ValueError as e:
        if parser is None:
            raise
        parser.error(str(e))
