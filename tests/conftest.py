"""Test setup: GPU tests (marker `gpu`) are skipped where torch sees no CUDA device; shared fixtures
load the embedded model once per session."""
import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
