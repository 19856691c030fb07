"""Instructions in the main loop of the int4 fused-MoE kernels, compiled for a GPU without one.

    python benchmarks/moe_sass.py [--arch 90] [--tiles few many]

Compiles `kernels.moe`'s gate_up and down kernels at Kimi-K2.5's expert widths (hidden 7168,
expert intermediate 2048, bf16, int4 in symmetric groups of 32) for sm_<arch> with Triton's own
ptxas, disassembles them with its cuobjdump, and counts the SASS opcodes of each kernel's
longest loop (one BLOCK_K step over the weight tile) on the int4 default shapes, side by side.
A static count, not a timing: it shows what a tile costs per thread (conversions such as I2FP
and F2FP issue at a fraction of the integer and half-precision rate; STS/LDS/LDSM are layout
conversions through shared memory), not how the loop overlaps with memory. Runs on the CPU.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H, I, GROUP = 7168, 2048, 32  # Kimi-K2.5's routed experts
PAIRS = {"few": 8, "many": 64}  # a batch-1 decode's pairs, and a batch of 8's


def compile_kernel(kernel, tiles, arch: int) -> bytes:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    gate_up = kernel.__name__ == "_gate_up_kernel"
    K = H if gate_up else I
    ptrs = (["x_ptr", "w_ptr", "s_ptr", "z_ptr", "h_ptr", "g_ptr"] if gate_up
            else ["h_ptr", "w_ptr", "s_ptr", "z_ptr", "rw_ptr", "out_ptr"])
    sig = {p: "*i32" if p == "w_ptr" else "*fp32" if p == "g_ptr" else "*bf16" for p in ptrs}
    sig |= {"pairs_ptr": "*i32", "block_expert_ptr": "*i32", "P": "i32", "E": "i32"}
    consts = dict(H=H, I=I, GROUPS=K // GROUP, INT4=True, HAS_ZERO=False, BLOCK_M=16, BLOCK_N=tiles.block_n,
                  BLOCK_K=tiles.block_k, K_SPAN=tiles.k_span(K), PRECISION="tf32", PDL=False, SWAP=tiles.swap)
    if gate_up:
        consts["TOP_K"] = 8
    sig |= {k: "constexpr" for k in consts}
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts),
                              target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages))
    return compiled.asm["cubin"]


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcodes between the target and the source of the longest backward branch."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)\S*\s*(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), m.group(3)))
    loops = []
    for at, op, args in ins:
        target = re.search(r"0x([0-9a-f]+)", args) if op == "BRA" else None
        if target and int(target.group(1), 16) < at:
            loops.append((int(target.group(1), 16), at))
    if not loops:
        raise RuntimeError("no loop found in the kernel's SASS")
    start, end = max(loops, key=lambda se: se[1] - se[0])
    return collections.Counter(op for at, op, _ in ins if start <= at <= end)


def main() -> None:
    import triton

    from specserve.kernels.moe import _down_kernel, _gate_up_kernel, default_tiles

    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90, help="compute capability to compile for (90: H100/H200)")
    ap.add_argument("--tiles", nargs="+", choices=list(PAIRS), default=list(PAIRS),
                    help="the int4 default shape for a few pairs, for many, or both")
    args = ap.parse_args()
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    work = Path(tempfile.mkdtemp(prefix="moe-sass-"))
    for kernel in (_gate_up_kernel, _down_kernel):
        counts = {}
        for which in args.tiles:
            tiles = default_tiles(PAIRS[which], int4=True)
            cubin = work / f"{kernel.__name__}_{which}.cubin"
            cubin.write_bytes(compile_kernel(kernel, tiles, args.arch))
            sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True,
                                  check=True).stdout
            label = (f"{which} pairs: {tiles.block_n}x{tiles.block_k} w{tiles.num_warps} split{tiles.split_k}"
                     + " swap" * tiles.swap)
            counts[label] = loop_opcodes(sass)
        ops = sorted(set().union(*counts.values()), key=lambda k: -max(c[k] for c in counts.values()))
        print(f"\n{kernel.__name__}: SASS instructions of one BLOCK_K step, per thread")
        print("| opcode | " + " | ".join(counts) + " |")
        for op in ops:
            if max(c[op] for c in counts.values()) >= 4:
                print(f"| {op} | " + " | ".join(str(c[op]) for c in counts.values()) + " |")
        print("| total | " + " | ".join(str(sum(c.values())) for c in counts.values()) + " |")


if __name__ == "__main__":
    main()
