"""Instructions in the main loop of the int4 kernels, compiled for a GPU without one.

    python benchmarks/moe_sass.py [--arch 90] [--tiles few many] [--kernels moe dense small]

moe: compiles `kernels.moe`'s gate_up and down kernels at Kimi-K2.5's expert widths (hidden 7168,
expert intermediate 2048, bf16, int4 in symmetric groups of 32) on the int4 default shapes.
dense: compiles `kernels.int4`'s W4A16 GEMV (what Int4Linear runs for 1-64 rows) for bf16 at a
SmolLM2-135M input width (576, groups of 32) and a Llama-3-8B one (4096, groups of 128),
symmetric and asymmetric, for one row and for 16, in its default tiles (the same loop at every
split of K), with 16-byte aligned pointers as torch allocates them.
Each is compiled for sm_<arch> with Triton's own ptxas and disassembled with its cuobjdump, and
the SASS opcodes of its longest loop (one BLOCK_K step over the weight tile) are counted, side by
side. A static count, not a timing: it shows what a tile costs per thread (conversions such as
I2FP and F2FP issue at a fraction of the integer and half-precision rate; STS/LDS/LDSM are layout
conversions through shared memory), not how the loop overlaps with memory. Runs on the CPU.
small: the programs around the MoE kernels, the decode-size routing and alignment
(`kernels.moe_routing`, at DeepSeek-V3's and Kimi-K2.5's router widths and 512 pairs) and the
final sum of each token's rows (`_combine_kernel`, split and not): their whole SASS (they have
no loop: their rounds are unrolled) and any local-memory spills.
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
DENSE = {"smollm2": (576, 32), "8b": (4096, 128)}  # input width, group size
DENSE_ROWS = (1, 16)  # a decode step's row, and a verify's


def compile_moe_kernel(kernel, tiles, arch: int) -> bytes:
    gate_up = kernel.__name__ == "_gate_up_kernel"
    K = H if gate_up else I
    ptrs = (
        ["x_ptr", "w_ptr", "s_ptr", "z_ptr", "h_ptr", "g_ptr"]
        if gate_up
        else ["h_ptr", "w_ptr", "s_ptr", "z_ptr", "rw_ptr", "out_ptr"]
    )
    sig = {p: "*i32" if p == "w_ptr" else "*fp32" if p == "g_ptr" else "*bf16" for p in ptrs}
    sig |= {"pairs_ptr": "*i32", "block_expert_ptr": "*i32", "P": "i32", "E": "i32"}
    consts = dict(
        H=H,
        I=I,
        GROUPS=K // GROUP,
        INT4=True,
        HAS_ZERO=False,
        BLOCK_M=16,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        K_SPAN=tiles.k_span(K),
        PRECISION="tf32",
        PDL=False,
        SWAP=tiles.swap,
    )
    if gate_up:
        consts["TOP_K"] = 8
    return _compile(kernel, sig, consts, arch, dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages))


def compile_dense_kernel(K: int, group: int, zero: bool, rows: int, arch: int) -> bytes:
    import triton

    from specserve.kernels.int4 import _int4_gemv_kernel, gemv_tiles

    block_n, block_k, warps = gemv_tiles(rows)
    sig = {
        "x_ptr": "*bf16",
        "w_ptr": "*i32",
        "s_ptr": "*bf16",
        "z_ptr": "*i8",
        "b_ptr": "*bf16",
        "y_ptr": "*bf16",
        "M": "i32",
        "N": "i32",
        "SPAN_STEPS": "i32",
    }
    consts = dict(
        K=K,
        GROUPS=K // group,
        HAS_ZERO=zero,
        HAS_BIAS=False,
        SPLIT=False,
        BLOCK_M=max(16, triton.next_power_of_2(rows)),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        ONE_ROW=rows == 1,
        PRECISION="tf32",
        PDL=False,
    )
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(6)}  # the pointers
    return _compile(_int4_gemv_kernel, sig, consts, arch, dict(num_warps=warps), aligned)


def _compile(kernel, sig: dict, consts: dict, arch: int, options: dict, attrs: dict | None = None) -> bytes:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = sig | {k: "constexpr" for k in consts}
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
        target=GPUTarget("cuda", arch, 32),
        options=options,
    )
    return compiled.asm["cubin"]


def small_cubins(arch: int) -> dict[str, bytes]:
    """The routing program at DeepSeek-V3's and Kimi-K2.5's routers (float32 logits, 8 of 256 in
    4 of 8 groups; 8 of 384), the alignment program at 512 pairs over 256 experts and the
    combine at hidden 7168 in bf16 (shared experts added), launched as `kernels.moe_routing` and `fused_experts` launch
    them."""
    import triton.language as tl

    from specserve.kernels.moe import COMBINE_BLOCK, _combine_kernel
    from specserve.kernels.moe_routing import _align_kernel, _route_kernel

    route_sig = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "w_ptr": "*fp32", "ids_ptr": "*i64"}
    common = dict(TOP_K=8, K_PAD=8, SIGMOID=True, NORM=True, SCORE_DT=tl.float32, CHOICE_DT=tl.float32, PDL=True)
    shapes = {
        "route deepseek-v3": dict(E=256, GROUPS=8, KEPT=4, G_PAD=8, PER_PAD=32, SCALE=2.5),
        "route kimi-k2.5": dict(E=384, GROUPS=1, KEPT=1, G_PAD=1, PER_PAD=512, SCALE=2.827),
    }
    out = {name: _compile(_route_kernel, route_sig, common | c, arch, dict(num_warps=1)) for name, c in shapes.items()}
    align_sig = {
        "ids_ptr": "*i64",
        "pairs_ptr": "*i32",
        "block_expert_ptr": "*i32",
        "first": "i32",
        "P": "i32",
        "BLOCKS": "i32",
    }
    out["align 512 pairs"] = _compile(
        _align_kernel,
        align_sig,
        dict(E=256, BLOCK_M=16, P_PAD=512, BINS=512, ROWS_PAD=8192, BLOCKS_PAD=512, PDL=True),
        arch,
        {},
    )
    combine_sig = {
        "y_ptr": "*fp32",
        "rw_ptr": "*bf16",
        "ids_ptr": "*i64",
        "add_ptr": "*bf16",
        "out_ptr": "*bf16",
        "first": "i32",
        "E": "i32",
    }
    for split in (False, True):  # (with the shared experts' output added, as on one rank)
        sig = combine_sig | ({} if split else {"y_ptr": "*bf16"})
        out[f"combine{' split' * split}"] = _compile(
            _combine_kernel,
            sig,
            dict(H=H, TOP_K=8, SPLIT=split, ADD=True, BLOCK=COMBINE_BLOCK, PDL=True),
            arch,
            dict(enable_fp_fusion=False),
        )
    return out


def opcodes(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of each instruction in cuobjdump's listing."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)\S*\s*(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), m.group(3)))
    return ins


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcodes between the target and the source of the longest backward branch."""
    ins = opcodes(sass)
    loops = []
    for at, op, args in ins:
        target = re.search(r"0x([0-9a-f]+)", args) if op == "BRA" else None
        if target and int(target.group(1), 16) < at:
            loops.append((int(target.group(1), 16), at))
    if not loops:
        raise RuntimeError("no loop found in the kernel's SASS")
    start, end = max(loops, key=lambda se: se[1] - se[0])
    return collections.Counter(op for at, op, _ in ins if start <= at <= end)


def sass_of(cubin: bytes, work: Path, name: str) -> str:
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    path = work / f"{name.replace(' ', '_')}.cubin"
    path.write_bytes(cubin)
    return subprocess.run([str(cuobjdump), "-sass", str(path)], capture_output=True, text=True, check=True).stdout


def count(cubin: bytes, work: Path, name: str) -> collections.Counter:
    return loop_opcodes(sass_of(cubin, work, name))


def table(title: str, counts: dict[str, collections.Counter]) -> None:
    ops = sorted(set().union(*counts.values()), key=lambda k: -max(c[k] for c in counts.values()))
    print(f"\n{title}: SASS instructions of one BLOCK_K step, per thread")
    print("| opcode | " + " | ".join(counts) + " |")
    for op in ops:
        if max(c[op] for c in counts.values()) >= 4:
            print(f"| {op} | " + " | ".join(str(c[op]) for c in counts.values()) + " |")
    print("| total | " + " | ".join(str(sum(c.values())) for c in counts.values()) + " |")


def main() -> None:
    from specserve.kernels.int4 import gemv_tiles
    from specserve.kernels.moe import _down_kernel, _gate_up_kernel, default_tiles

    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90, help="compute capability to compile for (90: H100/H200)")
    ap.add_argument(
        "--tiles",
        nargs="+",
        choices=list(PAIRS),
        default=list(PAIRS),
        help="the MoE int4 default shape for a few pairs, for many, or both",
    )
    ap.add_argument(
        "--kernels",
        nargs="+",
        choices=["moe", "dense", "small"],
        default=["moe", "dense", "small"],
        help="the fused-MoE kernels, the dense W4A16 GEMV, the MoE routing/alignment/combine programs",
    )
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="moe-sass-"))
    if "moe" in args.kernels:
        for kernel in (_gate_up_kernel, _down_kernel):
            counts = {}
            for which in args.tiles:
                tiles = default_tiles(PAIRS[which], int4=True)
                label = (
                    f"{which} pairs: {tiles.block_n}x{tiles.block_k} w{tiles.num_warps} split{tiles.split_k}"
                    + " swap" * tiles.swap
                )
                counts[label] = count(compile_moe_kernel(kernel, tiles, args.arch), work, f"{kernel.__name__}_{which}")
            table(kernel.__name__, counts)
    if "dense" in args.kernels:
        for rows in DENSE_ROWS:
            counts = {}
            block_n, block_k, warps = gemv_tiles(rows)
            for shape, (K, group) in DENSE.items():
                for zero in (False, True):
                    label = f"{shape} K{K} g{group} {'asym' if zero else 'sym'}"
                    counts[label] = count(
                        compile_dense_kernel(K, group, zero, rows, args.arch), work, f"dense_{shape}_{rows}_{zero}"
                    )
            table(f"_int4_gemv_kernel, {rows} row{'s' * (rows > 1)} ({block_n}x{block_k} w{warps})", counts)
    if "small" in args.kernels:
        print("\nrouting, alignment and combine programs: whole SASS, per thread")
        print("| program | instructions | local-memory spills (LDL/STL) |")
        for name, cubin in small_cubins(args.arch).items():
            ops = [op for _, op, _ in opcodes(sass_of(cubin, work, name))]
            print(f"| {name} | {len(ops)} | {sum(op in ('LDL', 'STL') for op in ops)} |")


if __name__ == "__main__":
    main()
