"""Gluon kernels compiled for sm_90 on a machine without a GPU, and their PTX read back: shared by
the CPU tests of engine/kernels/nvfp4_gluon.py and engine/kernels/sparse24_gluon.py."""
from __future__ import annotations

import inspect
import re


def compile_sm90(kernel, arg_types: dict[str, str], constexprs: dict, num_warps: int = 4) -> str:
    """The PTX of a Gluon kernel for sm_90. arg_types gives every run-time argument's Triton type
    ("*bf16", "i32", ..), constexprs every compile-time one's value. Pointers and strides are
    declared multiples of 16, as torch's allocations and the kernels' row strides are. Defaulted
    compile-time arguments left out of constexprs take their defaults."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    names = kernel.arg_names
    constexprs = {p.name: p.default for p in kernel.params
                  if p.is_constexpr and p.default is not inspect.Parameter.empty} | constexprs
    signature = {n: arg_types.get(n, "constexpr") for n in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if n in arg_types and (n.endswith("_ptr") or n.startswith("stride"))}
    src = GluonASTSource(kernel, signature, {(names.index(n),): v for n, v in constexprs.items()}, aligned)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]


def ptx_loops(ptx: str) -> list[str]:
    """The bodies of a PTX function's loops: from a label to a later branch back to it."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"(\$L__BB\w+):", line))}
    return ["\n".join(lines[labels[m.group(1)]:i]) for i, line in enumerate(lines)
            if (m := re.search(r"bra(?:\.uni)?\s+(\$L__BB\w+);", line)) and labels.get(m.group(1), i) < i]
