"""CuTe DSL kernels compiled on a machine without a GPU: shared by the CPU tests of
engine/kernels/cute (FP8 for sm_90a and sm_100a, NVFP4 for sm_100a), which read their PTX back."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compile_in_subprocess(code: str, arch: str, dump_dir) -> str:
    """Run `code` in a fresh interpreter (CuTe DSL reads the architecture at import) compiling for
    `arch`, with the PTX kept so that `__ptx__` returns it. CuTe DSL writes the kept PTX to a file
    too: into `dump_dir`, not the working directory. Returns what the code printed."""
    # CUTE_DSL_KEEP=ptx from CuTe DSL 4.8 on; CUTE_DSL_KEEP_PTX=1 before (4.8 still reads it).
    env = dict(os.environ, CUTE_DSL_ARCH=arch, CUTE_DSL_KEEP="ptx", CUTE_DSL_KEEP_PTX="1",
               CUTE_DSL_DUMP_DIR=str(dump_dir))
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout
