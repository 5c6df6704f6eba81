"""Without a GPU, the Triton kernel tests (marker `interpreter`) run here, in a child pytest whose
environment has TRITON_INTERPRET=1 before Triton decorates any kernel."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="the kernel tests run in this process")
def test_triton_kernels_in_the_interpreter():
    pytest.importorskip("triton")
    root = Path(__file__).parents[1]
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
                            "interpreter and not gpu", "tests"], env={**os.environ, "TRITON_INTERPRET": "1"},
                           cwd=root, capture_output=True, text=True, timeout=1200)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-3000:]
    assert " passed" in child.stdout and " failed" not in child.stdout
