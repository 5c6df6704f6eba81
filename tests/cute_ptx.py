"""Code run in a fresh interpreter from the repository root: CuTe DSL kernels compiled that way on a
machine without a GPU, for the CPU tests of engine/kernels/cute (FP8 for sm_90a and sm_100a, NVFP4
for sm_100a) that read their PTX back, and the FP8 interpreter test; on a GPU, kernels run under
compute-sanitizer's memcheck."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str, env_extra: dict, timeout: int = 600, prefix: tuple = ()) -> str:
    """Run `code` (dedented) in a fresh interpreter, with the repository on its path and env_extra
    in its environment (for what a library reads at import); returns what it printed. prefix: a
    command the interpreter runs under."""
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([*prefix, sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def compile_in_subprocess(code: str, arch: str, dump_dir) -> str:
    """Run `code` in a fresh interpreter (CuTe DSL reads the architecture at import) compiling for
    `arch`, with the PTX kept so that `__ptx__` returns it. CuTe DSL writes the kept PTX to a file
    too: into `dump_dir`, not the working directory. Returns what the code printed."""
    # CUTE_DSL_KEEP=ptx from CuTe DSL 4.8 on; CUTE_DSL_KEEP_PTX=1 before (4.8 still reads it).
    return run_python(code, {"CUTE_DSL_ARCH": arch, "CUTE_DSL_KEEP": "ptx", "CUTE_DSL_KEEP_PTX": "1",
                             "CUTE_DSL_DUMP_DIR": str(dump_dir)})


SANITIZER = shutil.which("compute-sanitizer")


def run_under_memcheck(code: str, timeout: int = 600) -> str:
    """Run `code` on the GPU under compute-sanitizer's memcheck with torch's caching allocator off:
    every tensor is then its own allocation, so a read or write past any tensor's end is reported
    (inside the allocator's segments it would go unseen). Fails on any access error memcheck
    reports; failed CUDA API calls are not reported (libraries probe the device with calls that
    may fail, e.g. CuTe DSL's architecture detection)."""
    return run_python(code, {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}, timeout,
                      prefix=(SANITIZER, "--tool", "memcheck", "--report-api-errors", "no", "--error-exitcode", "1",
                              "--print-limit", "20"))
