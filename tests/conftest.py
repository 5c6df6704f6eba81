"""Test setup: GPU tests (marker `gpu`) are skipped where torch sees no CUDA device, Triton kernel
tests (marker `interpreter`) run on the CPU in an interpreter child process, and shared fixtures
load the embedded model once per session."""
import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker gpu)")
    # Triton reads TRITON_INTERPRET when it decorates a kernel, so the kernels' CPU tests run in a
    # child process that has it from the start (tests/test_interpreter.py), not in this one.
    child = pytest.mark.skip(reason="runs under TRITON_INTERPRET=1 in tests/test_interpreter.py")
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
        elif "interpreter" in item.keywords and not interpreting:
            item.add_marker(child)


@pytest.fixture(scope="session")
def llm():
    """The embedded SmolLM2 model on the CPU in fp32 (the reference path)."""
    from engine import LLM
    engine = LLM("llama", device="cpu", dtype="fp32")
    yield engine
    engine.shutdown(timeout=1)


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' LlamaForCausalLM read from the same GGUF file."""
    from transformers import LlamaForCausalLM

    from models.loader import embedded_gguf_path
    path = embedded_gguf_path()
    model = LlamaForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                             dtype=torch.float32)
    return model.eval()
