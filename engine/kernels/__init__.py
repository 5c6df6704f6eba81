"""Kernels, one module per technique; each has a plain PyTorch reference beside its fast path."""
