"""Test setup: GPU tests (marker `gpu`) are skipped where torch sees no CUDA device, Triton kernel
tests (marker `interpreter`) run on the CPU in an interpreter child process, shared fixtures
load the embedded model once per session, and `poisoned` makes kernels' outputs start as NaN."""
import copy
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


@pytest.fixture
def poisoned(monkeypatch):
    """torch.empty hands out NaN-filled floats (-1 for integers) while the test runs: an output
    element a kernel never writes fails its test."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -1)

    monkeypatch.setattr(torch, "empty", empty)


@pytest.fixture
def norm_handoff_on_cpu(monkeypatch):
    """Dense weights hand RMSNorms off on the CPU too (models/llama.py `NormedRows`), the hand-off's
    two GEMMs stood in for by their float references (engine/kernels/stream_triton.py): the model's
    side of the hand-off, testable without Hopper. Yields the norms handed off, in order."""
    import models.llama
    from engine.formats.dense import DenseWeight
    from engine.kernels import stream_triton
    handed = []
    real_after = models.llama.NormedRows.after

    def after(producer, x, residual, norm):
        handed.append(norm)
        return real_after(producer, x, residual, norm)

    def norm_out(self, x, residual, g):
        h, xg, parts = stream_triton.norm_out_ref(x, self.weight, residual, g)
        residual.copy_(h)
        return xg, parts

    monkeypatch.setattr(models.llama.NormedRows, "after", staticmethod(after))
    monkeypatch.setattr(DenseWeight, "norm_handoff", lambda self, m, swiglu=False: True)
    monkeypatch.setattr(DenseWeight, "norm_out_forward", norm_out)
    monkeypatch.setattr(DenseWeight, "row_scaled_forward", lambda self, xg, parts, eps, swiglu=False:
                        stream_triton.stream_matmul_ref(xg, self.weight, swiglu, (parts, eps)))
    yield handed


@pytest.fixture(scope="session", autouse=True)
def gguf_read_once():
    """Every engine of the session that loads a GGUF file (`LLM("llama", ...)` with any options)
    shares the weights of one read of it per (file, device, dtype): reading the file (its metadata,
    then dequantising every tensor) takes seconds. The first load of each runs the real loader, so
    its results and errors are tested. Each later engine gets its own module tree and tensor
    objects over the same storage: converting to another format makes new tensors, and moving or
    streaming a layer repoints that engine's own tensor objects. Nothing may write into the shared
    storage; that is checked when the session ends."""
    import models.loader as loader
    from engine.streams.offload import find_tensors
    read, first = loader.load_gguf, {}

    def share(model):
        memo = {}
        for t in find_tensors(model):
            twin = t.detach()
            memo[id(t)] = torch.nn.Parameter(twin, requires_grad=False) if isinstance(t, torch.nn.Parameter) \
                else twin
        return copy.deepcopy(model, memo)

    def load_gguf(path, device, dtype, name, tp=None):
        if tp is not None:      # a rank's shards: not the shared full model
            return read(path, device, dtype, name=name, tp=tp)
        key = (os.path.realpath(path), os.path.getmtime(path), str(device), dtype, name)
        if key not in first:
            loaded = read(path, device, dtype, name=name)
            first[key] = loaded, _checksum(loaded.model)
        loaded = first[key][0]
        return loader.LoadedModel(share(loaded.model), loaded.tokenizer, loaded.name, loaded.source)

    loader.load_gguf = load_gguf
    yield
    loader.load_gguf = read
    for key, (loaded, checksum) in first.items():
        assert _checksum(loaded.model) == checksum, f"an engine wrote into the shared weights of {key}"


def _checksum(model) -> list[float]:
    with torch.inference_mode():
        return [t.double().sum().item() for t in model.state_dict().values()]


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
