"""Quality next to speed: a fixed evaluation text every machine already has, and perplexity on it.

The text is the docstrings of a fixed list of standard-library modules, read at run time (nothing is
copied into the repository). It is the same on every machine with the same Python minor version.
"""
from __future__ import annotations

import importlib
import math

EVAL_MODULES = ("json", "textwrap", "fractions", "heapq", "bisect", "shlex", "difflib", "string",
                "calendar", "functools", "contextlib", "dataclasses", "argparse", "collections")
# Activation-aware pruning calibrates on other text than the evaluation's.
CALIBRATION_MODULES = ("statistics", "pathlib", "logging", "enum", "random", "datetime")


def eval_text(modules=EVAL_MODULES) -> str:
    parts = []
    for name in modules:
        mod = importlib.import_module(name)
        if mod.__doc__:
            parts.append(mod.__doc__.strip())
        for attr in sorted(dir(mod)):
            obj = getattr(mod, attr, None)
            doc = getattr(obj, "__doc__", None)
            if attr.startswith("_") or not isinstance(doc, str) or getattr(obj, "__module__", None) != name:
                continue
            parts.append(doc.strip())
    return "\n\n".join(parts)


def calibration_windows(tokenizer, window: int = 256, count: int = 16) -> list[list[int]]:
    return eval_token_windows(tokenizer, window, count, CALIBRATION_MODULES)


def eval_token_windows(tokenizer, window: int = 512, count: int = 8, modules=EVAL_MODULES) -> list[list[int]]:
    ids = tokenizer.encode(eval_text(modules), add_special_tokens=False)
    return [ids[i * window:(i + 1) * window] for i in range(min(count, len(ids) // window))]


def evaluate(llm, window: int = 512, count: int = 8, reference: list | None = None, cache_chunk: int | None = None):
    """Perplexity (exp of the mean next-token NLL) over `count` windows of the evaluation text, the
    model's argmax predictions at every position, and, given a reference model's predictions, the
    fraction of positions where the two agree (teacher-forced top-1 agreement). cache_chunk: the
    logits computed through the paged KV cache, this many tokens a step (LLM.logits)."""
    import torch
    nll, n, predictions = 0.0, 0, []
    for ids in eval_token_windows(llm.tokenizer, window, count):
        logits = llm.logits(ids, cache_chunk)
        lp = torch.log_softmax(logits[:-1].double(), -1)
        nll -= lp.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
        n += len(ids) - 1
        predictions.append(logits.argmax(-1))
    agreement = None if reference is None else top1_agreement(predictions, reference)
    return math.exp(nll / n), predictions, agreement


def top1_agreement(predictions: list, reference: list) -> float:
    """The fraction of positions where two models' argmax predictions (evaluate's) agree."""
    import torch
    return (torch.cat(predictions) == torch.cat(reference)).float().mean().item()


def perplexity(llm, window: int = 512, count: int = 8) -> float:
    return evaluate(llm, window, count)[0]
