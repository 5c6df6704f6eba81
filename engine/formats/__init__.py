"""Weight formats: one module each (storage, quantisation, reference, backend, kernel lists).

FORMATS maps a format's name to its backend class; non-dense formats are imported on first use.
"""
from __future__ import annotations

import importlib

from engine.formats.base import WeightFormat
from engine.formats.dense import DenseWeight

FORMATS: dict[str, type | str] = {
    "bf16": DenseWeight,
    "fp8": "engine.formats.fp8:Fp8Weight",
    "nvfp4": "engine.formats.nvfp4:Nvfp4Weight",
    "2:4": "engine.formats.sparse24:Sparse24Weight",
    "2:4+fp8": "engine.formats.sparse24:Sparse24Fp8Weight",
}


def format_class(name: str) -> type[WeightFormat]:
    if name not in FORMATS:
        raise ValueError(f"weight format {name!r} is not one of {', '.join(FORMATS)}")
    cls = FORMATS[name]
    if isinstance(cls, str):
        module, attr = cls.split(":")
        cls = FORMATS[name] = getattr(importlib.import_module(module), attr)
    return cls


__all__ = ["FORMATS", "DenseWeight", "WeightFormat", "format_class"]
