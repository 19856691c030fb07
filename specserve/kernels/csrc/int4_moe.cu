// Routed int4 experts for a few (token, expert) pairs per expert (decode, short verifies), on the
// tensor cores: compiled at run time by NVRTC (kernels/moe.py), so it needs no headers.
//
// Weights are compressed-tensors' int32 words of eight 4-bit values along the input features (value j
// in bits 4j..4j+3, offset by 8) and one bf16 scale per row and group, in the tiled order of
// kernels/int4.py:tile_experts: each expert's rows in tiles of 16 (gate/up: 8 gate rows, then the same
// up rows), a tile's words chunk by chunk (16 rows x 16 words: 128 features, one 1-KB run) and its
// scales group by group (16 rows each). A warp owns one tile and walks its chunks: lane (g, q) =
// (lane / 4, lane % 4) takes the four words of rows g and g + 8 that hold features 32q..32q+31 of the
// chunk (so a warp's two 16-byte copies read 1 KB whole) and their scales. Those words are the A
// fragments of eight m16n8k16 steps once the features inside each step are taken in a fixed permuted
// order (the same order for the activations, so every sum is unchanged): masking word >> 4i with
// 0x000F000F and ORing in 128.0 gives the bf16 pair (128 + v_i, 128 + v_{i+4}) in one instruction.
// Subtracting 136 is exact; multiplying by the scale rounds once, as dequantizing to bf16 does. The
// eight columns of the B fragment are up to eight pairs of the block's expert; lane g reads pair g's
// activations.
//
// The weights stream through shared memory by cp.async, STAGES chunks a warp ahead: each lane copies
// and later reads only its own pieces, so no barrier is needed, and the bytes in flight do not depend
// on how the compiler schedules loads into registers. A decode's few pairs leave most of the GPU idle
// with one warp a tile, so SPLIT warps share a tile's chunks and add their sums at the end.

typedef unsigned int u32;
typedef unsigned short u16;
struct alignas(16) U4 { u32 x, y, z, w; };

__device__ __forceinline__ u32 bf2_fma(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

__device__ __forceinline__ void mma_bf16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float bf16_to_f32(u16 h) {
    float f;
    asm("mov.b32 %0, %1;" : "=f"(f) : "r"(((u32)h) << 16));
    return f;
}

__device__ __forceinline__ float silu(float v) {  // v / (1 + e^-v), e^-v as 2^(-v log2 e)
    float e;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(-1.4426950408889634f * v));
    return v / (1.f + e);
}

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ U4 load_features(const u16* p) {  // read by every warp of the block: cached
    U4 v;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void copy16(u32 dst, const void* src) {  // streamed once: past L1
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}

__device__ __forceinline__ void copy4(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src));
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;"); }

template <int N>
__device__ __forceinline__ void wait_all_but() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// A constant held in a register: the compiler would otherwise fold it into an instruction as an
// immediate, and an instruction takes one, so (w & MASK) | MAGIC would cost two LOP3s instead of one.
__device__ __forceinline__ u32 in_register(u32 v) {
    u32 r;
    asm volatile("mov.b32 %0, %1;" : "=r"(r) : "r"(v));
    return r;
}

// (a & b) | c in one instruction.
__device__ __forceinline__ u32 and_or(u32 a, u32 b, u32 c) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

struct Magic {  // the dequantizing constants, in registers for the whole loop
    u32 mask, magic;
    __device__ Magic() : mask(in_register(0x000F000Fu)), magic(in_register(0x43004300u)) {}
};

// The four bf16 pairs of one word, scaled: out[i] = ((v_i - 8) s, (v_{i+4} - 8) s). (128 + v) - 136 is
// exact; the product with the scale rounds once, as dequantizing to bf16 does.
__device__ __forceinline__ void dequant(u32 w, u32 s2, const Magic& m, u32* out) {
    const u32 ONE = 0x3F803F80u, NEG136 = 0xC308C308u, NEG0 = 0x80008000u;
#pragma unroll
    for (int i = 0; i < 4; i++) out[i] = bf2_fma(bf2_fma(and_or(w >> (4 * i), m.mask, m.magic), ONE, NEG136), s2, NEG0);
}

#ifndef WARPS  // row tiles a block: warps per slice of the input features (kernels/moe.py passes CUDA_WARPS)
#define WARPS 4
#endif
#ifndef SPLIT  // slices of the input features a block's warps share out (their sums meet in shared memory)
#define SPLIT 1
#endif
#ifndef STAGES  // chunks a warp has in flight (benchmarks/int4_moe_cuda.py --sweep compiles others)
#define STAGES 4
#endif
#ifndef GROUP  // input features a scale covers (kernels/moe.py compiles one build per group size)
#define GROUP 32
#endif

struct Stage {  // one chunk of a warp: each lane's 16-byte pieces of rows g and g + 8, and the words holding their scales
    U4 w[2][32];
    u32 s[2][32];
};

// A bf16 pair of the scale of row parity `odd` from the 32-bit word holding rows 2j and 2j + 1.
__device__ __forceinline__ u32 scale_pair(u32 word, int odd) {
    u32 h = odd ? word >> 16 : word & 0xFFFFu;
    return h | (h << 16);
}

// acc += rows (g, g + 8) x features of chunks [c0, c1) against the pairs' activations (x, null for a padding column).
// wa / wb: the lane's piece of rows g / g + 8 in chunk 0 (a chunk is 256 words on); sa / sb: the word holding
// their scales in group 0 (a group is 16 scales on).
__device__ __forceinline__ void row_pair_dot(float* acc, Stage* st, const u32* wa, const u32* wb, const u16* sa,
                                             const u16* sb, const u16* x, int c0, int c1, int lane, int g, int q) {
    // shared-memory addresses of this lane's slots in stage 0 (stage k: + k * sizeof(Stage))
    const u32 base = smem_addr(st), dwa = base + 16 * lane, dwb = dwa + 512, dsa = base + 1024 + 4 * lane, dsb = dsa + 128;
    auto issue = [&](int c) {
        const u32 at = (c % STAGES) * (u32)sizeof(Stage);
        copy16(dwa + at, wa + 256 * c);
        copy16(dwb + at, wb + 256 * c);
        copy4(dsa + at, sa + 16 * ((128 * c + 32 * q) / GROUP));  // (the group of the lane's features)
        copy4(dsb + at, sb + 16 * ((128 * c + 32 * q) / GROUP));
    };
    const Magic m;
#pragma unroll
    for (int c = c0; c < c0 + STAGES - 1; c++) {
        if (c < c1) issue(c);
        commit();
    }
    for (int c = c0; c < c1; c++) {
        if (c + STAGES - 1 < c1) issue(c + STAGES - 1);
        commit();
        u32 r[16];
        if (x) {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                U4 v = load_features(x + 128 * c + 32 * q + 8 * j);
                r[4 * j] = v.x, r[4 * j + 1] = v.y, r[4 * j + 2] = v.z, r[4 * j + 3] = v.w;
            }
        } else {
#pragma unroll
            for (int j = 0; j < 16; j++) r[j] = 0;
        }
        wait_all_but<STAGES - 1>();  // this lane's copies of chunk c have landed
        const Stage& s = st[c % STAGES];
        const U4 wa4 = s.w[0][lane], wb4 = s.w[1][lane];
        const u32 s2a = scale_pair(s.s[0][lane], g & 1), s2b = scale_pair(s.s[1][lane], g & 1);
        const u32 wav[4] = {wa4.x, wa4.y, wa4.z, wa4.w}, wbv[4] = {wb4.x, wb4.y, wb4.z, wb4.w};
#pragma unroll
        for (int w = 0; w < 4; w++) {  // word w: features 8w..8w+7 of the lane's 32, two m16n8k16 steps
            u32 a[4], b[4];
            dequant(wav[w], s2a, m, a);
            dequant(wbv[w], s2b, m, b);
#pragma unroll
            for (int i = 0; i < 4; i += 2) {
                // features (8w + i, 8w + i + 4) then (8w + i + 1, 8w + i + 5) of the lane's 32
                u32 lo = r[4 * w + i / 2], hi = r[4 * w + i / 2 + 2];
                mma_bf16(acc, a[i], b[i], a[i + 1], b[i + 1], prmt(lo, hi, 0x5410), prmt(lo, hi, 0x7632));
            }
        }
    }
}

// A block's warps: WARPS row tiles x SPLIT slices of the input features. Each warp sums its slice's
// chunks; the other slices' sums are added to slice 0's in a fixed order, so results do not vary.
struct Block {
    int tile, slice, lane, g, q;
    __device__ Block() {
        const int warp = threadIdx.x >> 5;
        tile = warp % WARPS, slice = warp / WARPS, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    }
    __device__ void chunks(int K, int& c0, int& c1) const {
        const int n = K >> 7, per = (n + SPLIT - 1) / SPLIT;
        c0 = min(n, slice * per), c1 = min(n, c0 + per);
    }
};

// acc += tile `tile`'s rows (g, g + 8) x this warp's slice of the K input features.
__device__ __forceinline__ void tile_dot(float* acc, Stage* st, const u32* w, const u16* scale, long tile, int K,
                                         const u16* x, const Block& b) {
    int c0, c1;
    b.chunks(K, c0, c1);
    const u32* wt = w + tile * (K >> 3) * 16 + 4 * b.q;
    const u16* st_ = scale + tile * (K / GROUP) * 16 + (b.g & ~1);
    row_pair_dot(acc, st, wt + 16 * b.g, wt + 16 * (b.g + 8), st_, st_ + 8, x, c0, c1, b.lane, b.g, b.q);
}

// Adds the other slices' acc into slice 0's warps (every thread of the block calls it); true for those.
__device__ __forceinline__ bool gather_slices(float* acc, const Block& b) {
#if SPLIT > 1
    __shared__ float part[SPLIT - 1][WARPS][4][32];
    if (b.slice > 0)
        for (int j = 0; j < 4; j++) part[b.slice - 1][b.tile][j][b.lane] = acc[j];
    __syncthreads();
    if (b.slice > 0) return false;
    for (int s = 0; s < SPLIT - 1; s++)
        for (int j = 0; j < 4; j++) acc[j] += part[s][b.tile][j][b.lane];
#endif
    return true;
}

// gate/up and SwiGLU: h[p, i] = silu(gate_i . x_t) * (up_i . x_t) for the pairs p = (token t, slot) of
// each block of eight (`pairs`, P on padding; `block_expert`, E past the last block). A warp owns gate
// rows i0..i0+7 (as rows g) and the same up rows (as rows g + 8), so both sums of a pair meet in a lane.
extern "C" __global__ void __launch_bounds__(32 * WARPS * SPLIT) int4_moe_gate_up(
        const u16* __restrict__ x, const u32* __restrict__ w, const u16* __restrict__ scale, u16* __restrict__ h,
        const int* __restrict__ pairs, const int* __restrict__ block_expert, int P, int E, int H, int I, int top_k) {
    __shared__ Stage stages[WARPS * SPLIT][STAGES];
    const int blk = blockIdx.x, e = block_expert[blk];
    if (e >= E) return;
    const Block b;
    const int i0 = (blockIdx.y * WARPS + b.tile) * 8;  // (the launch covers I exactly: kernels/moe.py)
    const int p = pairs[blk * 8 + b.g];
    const u16* xp = p < P ? x + (long)(p / top_k) * H : nullptr;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    // (a gate/up tile: 8 gate rows, then the same up rows)
    tile_dot(acc, stages[threadIdx.x >> 5], w, scale, (long)e * (I >> 3) + (i0 >> 3), H, xp, b);
    if (!gather_slices(acc, b)) return;
#pragma unroll
    for (int j = 0; j < 2; j++) {  // pairs 2q and 2q + 1: gate in acc[j], up in acc[2 + j]
        const int pj = pairs[blk * 8 + 2 * b.q + j];
        if (pj < P) {
            float gate = bf16_to_f32(f32_to_bf16(acc[j])), up = bf16_to_f32(f32_to_bf16(acc[2 + j]));
            h[(long)pj * I + i0 + b.g] = f32_to_bf16(silu(gate) * up);
        }
    }
}

// down: out[p, n] = down_n . h[p] for rows n0..n0+15 a warp, stored in bf16 (the combine adds them).
extern "C" __global__ void __launch_bounds__(32 * WARPS * SPLIT) int4_moe_down(
        const u16* __restrict__ h, const u32* __restrict__ w, const u16* __restrict__ scale, u16* __restrict__ out,
        const int* __restrict__ pairs, const int* __restrict__ block_expert, int P, int E, int H, int I) {
    __shared__ Stage stages[WARPS * SPLIT][STAGES];
    const int blk = blockIdx.x, e = block_expert[blk];
    if (e >= E) return;
    const Block b;
    const int n0 = (blockIdx.y * WARPS + b.tile) * 16;  // (the launch covers H exactly: kernels/moe.py)
    const int p = pairs[blk * 8 + b.g];
    const u16* xp = p < P ? h + (long)p * I : nullptr;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    tile_dot(acc, stages[threadIdx.x >> 5], w, scale, (long)e * (H >> 4) + (n0 >> 4), I, xp, b);
    if (!gather_slices(acc, b)) return;
#pragma unroll
    for (int j = 0; j < 2; j++) {
        const int pj = pairs[blk * 8 + 2 * b.q + j];
        if (pj < P) {
            out[(long)pj * H + n0 + b.g] = f32_to_bf16(acc[j]);
            out[(long)pj * H + n0 + b.g + 8] = f32_to_bf16(acc[2 + j]);
        }
    }
}
