// Routed int4 experts for a few (token, expert) pairs per expert (decode, short verifies), on the
// tensor cores: compiled at run time by NVRTC (kernels/int4_moe.py), so it needs no headers.
//
// Weights stay as compressed-tensors stores them: int32 words of eight 4-bit values along the input
// features (value j in bits 4j..4j+3, offset by 8), one bf16 scale per row and group. A warp owns 16
// weight rows and walks the input features 64 at a time: lane (g, q) = (lane / 4, lane % 4) loads the
// two words of rows g and g + 8 that hold features 16q..16q+15, which is exactly the A fragment of
// four m16n8k16 steps once the features inside each step are taken in a fixed permuted order (the
// same order for the activations, so every sum is unchanged): masking word >> 4i with 0x000F000F and
// ORing in 128.0 gives the bf16 pair (128 + v_i, 128 + v_{i+4}) in one instruction. Subtracting 136
// is exact; multiplying by the scale rounds once, as dequantizing to bf16 does. The eight columns of
// the B fragment are up to eight pairs of the block's expert; lane g reads pair g's activations.

typedef unsigned int u32;
typedef unsigned short u16;
struct U2 { u32 x, y; };
struct U4 { u32 x, y, z, w; };

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

__device__ __forceinline__ U2 load_weights(const u32* p) {  // streamed once: kept out of L1
    U2 v;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

__device__ __forceinline__ U4 load_features(const u16* p) {  // read by every warp of the block: cached
    U4 v;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// The four scaled bf16 pairs of one word: out[i] = ((v_i - 8) s, (v_{i+4} - 8) s).
__device__ __forceinline__ void dequant(u32 w, u32 s2, u32* out) {
    const u32 MASK = 0x000F000Fu, MAGIC = 0x43004300u, ONE = 0x3F803F80u, NEG136 = 0xC308C308u, NEG0 = 0x80008000u;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 v = ((w >> (4 * i)) & MASK) | MAGIC;
        out[i] = bf2_fma(bf2_fma(v, ONE, NEG136), s2, NEG0);
    }
}

struct Step {
    U2 wa, wb;  // the words of rows g and g + 8
    u32 sa, sb;  // their scales, as bf16 pairs
    U4 x0, x1;  // features 16q..16q+15 of pair g
};

// acc += rows (g, g + 8) x features [k, k + 64) against the pairs' activations, for one loaded Step.
__device__ __forceinline__ void step_mma(float* acc, const Step& st) {
    u32 a[8], b[8];
    dequant(st.wa.x, st.sa, a);
    dequant(st.wa.y, st.sa, a + 4);
    dequant(st.wb.x, st.sb, b);
    dequant(st.wb.y, st.sb, b + 4);
    u32 r[8] = {st.x0.x, st.x0.y, st.x0.z, st.x0.w, st.x1.x, st.x1.y, st.x1.z, st.x1.w};
#pragma unroll
    for (int s = 0; s < 4; s++) {
        const int w = s >> 1, i = 2 * (s & 1);
        // features (8w + i, 8w + i + 4) then (8w + i + 1, 8w + i + 5) of the lane's sixteen
        u32 lo = r[4 * w + i / 2], hi = r[4 * w + i / 2 + 2];
        mma_bf16(acc, a[4 * w + i], b[4 * w + i], a[4 * w + i + 1], b[4 * w + i + 1],
                 prmt(lo, hi, 0x5410), prmt(lo, hi, 0x7632));
    }
}

__device__ __forceinline__ Step load_step(const u32* wa, const u32* wb, const u16* sa, const u16* sb,
                                          const u16* x, int k, int q, int group) {
    Step st;
    st.wa = load_weights(wa + (k >> 3) + 2 * q);
    st.wb = load_weights(wb + (k >> 3) + 2 * q);
    u32 ga = sa[(k + 16 * q) / group], gb = sb[(k + 16 * q) / group];
    st.sa = ga | (ga << 16);
    st.sb = gb | (gb << 16);
    if (x) {
        st.x0 = load_features(x + k + 16 * q);
        st.x1 = load_features(x + k + 16 * q + 8);
    } else {
        st.x0 = U4{0, 0, 0, 0};
        st.x1 = st.x0;
    }
    return st;
}

#ifndef UNROLL  // (benchmarks/int4_moe_cuda.py --sweep compiles others)
#define UNROLL 8
#endif

// acc over features [0, K): UNROLL steps loaded before any is used, so each lane keeps that many in flight.
__device__ __forceinline__ void row_pair_dot(float* acc, const u32* wa, const u32* wb, const u16* sa, const u16* sb,
                                             const u16* x, int K, int q, int group) {
    int k = 0;
    for (; k + 64 * UNROLL <= K; k += 64 * UNROLL) {
        Step st[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) st[u] = load_step(wa, wb, sa, sb, x, k + 64 * u, q, group);
#pragma unroll
        for (int u = 0; u < UNROLL; u++) step_mma(acc, st[u]);
    }
    for (; k < K; k += 64) step_mma(acc, load_step(wa, wb, sa, sb, x, k, q, group));
}

// gate/up and SwiGLU: h[p, i] = silu(gate_i . x_t) * (up_i . x_t) for the pairs p = (token t, slot) of
// each block of eight (`pairs`, P on padding; `block_expert`, E past the last block). A warp owns gate
// rows i0..i0+7 (as rows g) and the same up rows (as rows g + 8), so both sums of a pair meet in a lane.
extern "C" __global__ void int4_moe_gate_up(const u16* __restrict__ x, const u32* __restrict__ w,
                                            const u16* __restrict__ scale, u16* __restrict__ h,
                                            const int* __restrict__ pairs, const int* __restrict__ block_expert,
                                            int P, int E, int H, int I, int top_k, int group) {
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
    row_pair_dot(acc, w + row_a * words, w + row_b * words, scale + row_a * groups, scale + row_b * groups, xp, H, q,
                 group);
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
extern "C" __global__ void int4_moe_down(const u16* __restrict__ h, const u32* __restrict__ w,
                                         const u16* __restrict__ scale, u16* __restrict__ out,
                                         const int* __restrict__ pairs, const int* __restrict__ block_expert,
                                         int P, int E, int H, int I, int group) {
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
    row_pair_dot(acc, w + row_a * words, w + row_b * words, scale + row_a * groups, scale + row_b * groups, xp, I, q,
                 group);
#pragma unroll
    for (int j = 0; j < 2; j++) {
        const int pj = pairs[blk * 8 + 2 * q + j];
        if (pj < P) {
            out[(long)pj * H + n0 + g] = f32_to_bf16(acc[j]);
            out[(long)pj * H + n0 + g + 8] = f32_to_bf16(acc[2 + j]);
        }
    }
}
