"""Code run in a fresh interpreter from the repository root, and CuTe DSL kernels compiled that way
on a machine without a GPU: shared by the CPU tests of engine/kernels/cute (FP8 for sm_90a and
sm_100a, NVFP4 for sm_100a), which read their PTX back, and the FP8 interpreter test."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str, env_extra: dict, timeout: int = 600) -> str:
    """Run `code` (dedented) in a fresh interpreter, with the repository on its path and env_extra
    in its environment (for what a library reads at import); returns what it printed."""
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT,
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
