"""Gluon kernels compiled for sm_90 on a machine without a GPU, their PTX read back, and assembled by
Triton's own ptxas for their registers, spills and SASS loops: shared by the CPU tests of the Gluon
kernels (engine/kernels/nvfp4_gluon.py, sparse24_gluon.py, attention_gluon.py)."""
from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile


def compile_sm90(kernel, arg_types: dict[str, str], constexprs: dict, num_warps: int = 4,
                 maxnreg: int | None = None) -> str:
    """The PTX of a Gluon kernel for sm_90. arg_types gives every run-time argument's Triton type
    ("*bf16", "i32", ..), constexprs every compile-time one's value. Pointers and strides are
    declared multiples of 16, as torch's allocations and the kernels' row strides are. Defaulted
    compile-time arguments left out of constexprs take their defaults; maxnreg: the launch's
    register cap, if it sets one."""
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
    options = {"num_warps": num_warps} | ({"maxnreg": maxnreg} if maxnreg else {})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def ptx_loops(ptx: str) -> list[str]:
    """The bodies of a PTX function's loops: from a label to a later branch back to it."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"(\$L__BB\w+):", line))}
    return ["\n".join(lines[labels[m.group(1)]:i]) for i, line in enumerate(lines)
            if (m := re.search(r"bra(?:\.uni)?\s+(\$L__BB\w+);", line)) and labels.get(m.group(1), i) < i]


def _assemble(ptx: str, disassemble: bool = False) -> tuple[str, str]:
    """ptxas's report on PTX assembled for sm_90a, and the SASS if asked, by the ptxas (and
    cuobjdump) that Triton ships and uses itself, as its compile would on a Hopper GPU."""
    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as d:
        src, obj = os.path.join(d, "kernel.ptx"), os.path.join(d, "kernel.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", obj], capture_output=True, text=True,
                             check=True).stderr
        sass = subprocess.run([os.path.join(os.path.dirname(ptxas), "cuobjdump"), "-sass", obj],
                              capture_output=True, text=True, check=True).stdout if disassemble else ""
    return log, sass


def ptxas_usage(ptx: str) -> tuple[int, int]:
    """(registers a thread, bytes of spill stores and loads) of PTX for sm_90a."""
    log, _ = _assemble(ptx)
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    return registers, sum(int(b) for b in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))


def sass_loops(ptx: str) -> list[str]:
    """The loop bodies of PTX assembled for sm_90a: the SASS from a backward branch's target to the
    branch."""
    code = [(int(m.group(1), 16), m.group(2)) for line in _assemble(ptx, True)[1].splitlines()
            if (m := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line))]
    loops = []
    for at, instr in code:
        if (m := re.search(r"\bBRA\s+(?:`?\()?0x([0-9a-f]+)", instr)) and int(m.group(1), 16) < at:
            loops.append("\n".join(i for a, i in code if int(m.group(1), 16) <= a <= at))
    return loops


def preset_gemms(*presets: str) -> list[tuple[str, int, int]]:
    """(role, N, K) of every weight GEMM a decode step of these shape presets runs on one GPU: the
    roles "qkv", "o", "gate_up" (fused), "down" and "lm_head"."""
    from models.presets import SHAPE_PRESETS
    shapes = []
    for name in presets:
        c = SHAPE_PRESETS[name]
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        shapes += [("qkv", q + 2 * kv, c.hidden_size), ("o", c.hidden_size, q),
                   ("gate_up", 2 * c.intermediate_size, c.hidden_size), ("down", c.hidden_size, c.intermediate_size),
                   ("lm_head", c.vocab_size, c.hidden_size)]
    return list(dict.fromkeys(shapes))
