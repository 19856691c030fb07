// Routed int4 experts for a few (token, expert) pairs per expert (decode, short verifies), on the
// tensor cores: compiled at run time by NVRTC (kernels/moe.py), so it needs no headers.
//
// Weights stay as compressed-tensors stores them: int32 words of eight 4-bit values along the input
// features (value j in bits 4j..4j+3, offset by 8), one bf16 scale per row and group. A warp owns 16
// weight rows and walks the input features 128 at a time (a chunk): lane (g, q) = (lane / 4, lane % 4)
// takes the four words of rows g and g + 8 that hold features 32q..32q+31 (one 16-byte piece a row, so
// a row's chunk is one 64-byte run) and their scale (group sizes are multiples of 32). Those words are
// the A fragments of eight m16n8k16 steps once the features inside each step are taken in a fixed
// permuted order (the same order for the activations, so every sum is unchanged): masking word >> 4i
// with 0x000F000F and ORing in 128.0 gives the bf16 pair (128 + v_i, 128 + v_{i+4}) in one
// instruction. Subtracting 136 is exact; multiplying by the scale rounds once, as dequantizing to bf16
// does. The eight columns of the B fragment are up to eight pairs of the block's expert; lane g reads
// pair g's activations.
//
// The weights stream through shared memory by cp.async, STAGES chunks a warp ahead: each lane copies
// and later reads only its own pieces, so no barrier is needed, and the bytes in flight do not depend
// on how the compiler schedules loads into registers.

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

__device__ __forceinline__ void copy16(void* dst, const void* src) {  // streamed once: past L1
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src));
}

__device__ __forceinline__ void copy4(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(dst)), "l"(src));
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;"); }

template <int N>
__device__ __forceinline__ void wait_all_but() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// The four bf16 pairs of one word, unscaled: out[i] = (v_i - 8, v_{i+4} - 8), exact.
__device__ __forceinline__ void dequant_unscaled(u32 w, u32* out) {
    const u32 MASK = 0x000F000Fu, MAGIC = 0x43004300u, ONE = 0x3F803F80u, NEG136 = 0xC308C308u;
#pragma unroll
    for (int i = 0; i < 4; i++) out[i] = bf2_fma(((w >> (4 * i)) & MASK) | MAGIC, ONE, NEG136);
}

// ... scaled: out[i] = ((v_i - 8) s, (v_{i+4} - 8) s), one rounding as dequantizing to bf16 has.
__device__ __forceinline__ void dequant(u32 w, u32 s2, u32* out) {
    const u32 NEG0 = 0x80008000u;
    dequant_unscaled(w, out);
#pragma unroll
    for (int i = 0; i < 4; i++) out[i] = bf2_fma(out[i], s2, NEG0);
}

#ifndef WARPS  // warps a block (kernels/moe.py passes CUDA_WARPS)
#define WARPS 4
#endif
#ifndef STAGES  // chunks a warp has in flight (benchmarks/int4_moe_cuda.py --sweep compiles others)
#define STAGES 4
#endif

struct Stage {  // one chunk of a warp: each lane's 16-byte pieces of rows g and g + 8, and the words holding their scales
    U4 w[2][32];
    u32 s[2][32];
};

// The bf16 bits of scale `gi` from the 32-bit word holding it (scales gi & ~1 and gi | 1).
__device__ __forceinline__ u32 scale_bits(u32 word, int gi) { return (gi & 1) ? word >> 16 : word & 0xFFFFu; }

// ... as a bf16 pair of that scale.
__device__ __forceinline__ u32 scale_pair(u32 word, int gi) {
    u32 h = scale_bits(word, gi);
    return h | (h << 16);
}

// acc += rows (g, g + 8) x features [0, K) against the pairs' activations (x, null for a padding column).
__device__ __forceinline__ void row_pair_dot(float* acc, Stage* st, const u32* wa, const u32* wb, const u16* sa,
                                             const u16* sb, const u16* x, int K, int lane, int q, int group) {
    const int chunks = K >> 7;
    auto issue = [&](int c) {
        Stage& s = st[c % STAGES];
        const int gi = (128 * c + 32 * q) / group;
        copy16(&s.w[0][lane], wa + 16 * c + 4 * q);
        copy16(&s.w[1][lane], wb + 16 * c + 4 * q);
        copy4(&s.s[0][lane], sa + (gi & ~1));
        copy4(&s.s[1][lane], sb + (gi & ~1));
    };
#pragma unroll
    for (int c = 0; c < STAGES - 1; c++) {
        if (c < chunks) issue(c);
        commit();
    }
    for (int c = 0; c < chunks; c++) {
        if (c + STAGES - 1 < chunks) issue(c + STAGES - 1);
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
        const int gi = (128 * c + 32 * q) / group;
        const U4 wa4 = s.w[0][lane], wb4 = s.w[1][lane];
        const u32 s2a = scale_pair(s.s[0][lane], gi), s2b = scale_pair(s.s[1][lane], gi);
        const u32 wav[4] = {wa4.x, wa4.y, wa4.z, wa4.w}, wbv[4] = {wb4.x, wb4.y, wb4.z, wb4.w};
#pragma unroll
        for (int w = 0; w < 4; w++) {  // word w: features 8w..8w+7 of the lane's 32, two m16n8k16 steps
            u32 a[4], b[4];
            dequant(wav[w], s2a, a);
            dequant(wbv[w], s2b, b);
#pragma unroll
            for (int i = 0; i < 4; i += 2) {
                // features (8w + i, 8w + i + 4) then (8w + i + 1, 8w + i + 5) of the lane's 32
                u32 lo = r[4 * w + i / 2], hi = r[4 * w + i / 2 + 2];
                mma_bf16(acc, a[i], b[i], a[i + 1], b[i + 1], prmt(lo, hi, 0x5410), prmt(lo, hi, 0x7632));
            }
        }
    }
}

// gate/up and SwiGLU: h[p, i] = silu(gate_i . x_t) * (up_i . x_t) for the pairs p = (token t, slot) of
// each block of eight (`pairs`, P on padding; `block_expert`, E past the last block). A warp owns gate
// rows i0..i0+7 (as rows g) and the same up rows (as rows g + 8), so both sums of a pair meet in a lane.
extern "C" __global__ void __launch_bounds__(32 * WARPS) int4_moe_gate_up(const u16* __restrict__ x, const u32* __restrict__ w,
                                            const u16* __restrict__ scale, u16* __restrict__ h,
                                            const int* __restrict__ pairs, const int* __restrict__ block_expert,
                                            int P, int E, int H, int I, int top_k, int group) {
    __shared__ Stage stages[WARPS][STAGES];
    const int blk = blockIdx.x, e = block_expert[blk];
    if (e >= E) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int i0 = (blockIdx.y * (blockDim.x >> 5) + warp) * 8;
    if (i0 >= I) return;
    const int words = H >> 3, groups = H / group;
    const long row_a = (long)e * 2 * I + i0 + g, row_b = row_a + I;
    const int p = pairs[blk * 8 + g];
    const u16* xp = p < P ? x + (long)(p / top_k) * H : nullptr;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    row_pair_dot(acc, stages[warp], w + row_a * words, w + row_b * words, scale + row_a * groups,
                 scale + row_b * groups, xp, H, lane, q, group);
#pragma unroll
    for (int j = 0; j < 2; j++) {  // pairs 2q and 2q + 1: gate in acc[j], up in acc[2 + j]
        const int pj = pairs[blk * 8 + 2 * q + j];
        if (pj < P) {
            float gate = bf16_to_f32(f32_to_bf16(acc[j])), up = bf16_to_f32(f32_to_bf16(acc[2 + j]));
            h[(long)pj * I + i0 + g] = f32_to_bf16(silu(gate) * up);
        }
    }
}

// down: out[p, n] = down_n . h[p] for rows n0..n0+15 a warp, stored in bf16 (the combine adds them).
extern "C" __global__ void __launch_bounds__(32 * WARPS) int4_moe_down(const u16* __restrict__ h, const u32* __restrict__ w,
                                         const u16* __restrict__ scale, u16* __restrict__ out,
                                         const int* __restrict__ pairs, const int* __restrict__ block_expert,
                                         int P, int E, int H, int I, int group) {
    __shared__ Stage stages[WARPS][STAGES];
    const int blk = blockIdx.x, e = block_expert[blk];
    if (e >= E) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int n0 = (blockIdx.y * (blockDim.x >> 5) + warp) * 16;
    if (n0 >= H) return;
    const int words = I >> 3, groups = I / group;
    const long row_a = (long)e * H + n0 + g, row_b = row_a + 8;
    const int p = pairs[blk * 8 + g];
    const u16* xp = p < P ? h + (long)p * I : nullptr;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    row_pair_dot(acc, stages[warp], w + row_a * words, w + row_b * words, scale + row_a * groups,
                 scale + row_b * groups, xp, I, lane, q, group);
#pragma unroll
    for (int j = 0; j < 2; j++) {
        const int pj = pairs[blk * 8 + 2 * q + j];
        if (pj < P) {
            out[(long)pj * H + n0 + g] = f32_to_bf16(acc[j]);
            out[(long)pj * H + n0 + g + 8] = f32_to_bf16(acc[2 + j]);
        }
    }
}
