"""Helpers for the server tests: serve.py in a subprocess on 127.0.0.1, the official openai client
for it, and its /metrics parsed by prometheus_client's own parser."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
MODEL = "llama"
MAX_MODEL_LEN = 512
STARTUP_TIMEOUT_S = 240        # the model loads in seconds, but CI cores are shared


class Server:
    def __init__(self, *extra: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="serve-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "serve.py"), "--model", MODEL, "--port", str(self.port),
             "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-tokens", "8192", *extra],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if k != "MICROENGINE_API_KEY"})

    def wait_healthy(self):
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        pytest.fail(f"server not healthy within {STARTUP_TIMEOUT_S}s:\n{self.output()[-3000:]}")

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()
        os.unlink(self.log.name)


def client(server: Server, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def metrics(server: Server, headers=None) -> dict[str, float]:
    """The server's samples, keyed by name plus labels as the exposition writes them
    ('microengine_http_responses_total{code="200"}')."""
    return parse_metrics(httpx.get(server.url + "/metrics", headers=headers, timeout=30).text)


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out
