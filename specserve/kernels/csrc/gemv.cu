// One bf16 row times a bf16 weight [N, K] (a decode step's products at batch 1), compiled at run time by
// NVRTC (kernels/gemv.py) for WARPS warps a block, RPW weight rows a warp, SPLIT warps sharing those rows'
// features and UNROLL 16-byte weight loads a lane per row and step batch, so it needs no headers.
//
// Lane l of a warp reads features 8(32i + l)..+7 of its rows in step i (256 features a step):
// each load instruction of the warp takes 512 contiguous bytes of a row. The next UNROLL steps' loads are
// issued before the current UNROLL are multiplied, so loads stay in flight throughout. The weights are read
// once (past L1); the activation row, read by every warp, stays cached. Each lane adds its products in
// float32 in step order, the warp its lanes' sums in a fixed tree, and the SPLIT warps of a row in slice
// order: a row's result depends on the launch shape, never on other rows. K is a multiple of 256.

typedef unsigned int u32;
typedef unsigned short u16;
struct alignas(16) U4 { u32 x, y, z, w; };

__device__ __forceinline__ U4 load_weights(const u16* p) {
    U4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ U4 load_activations(const u16* p) {
    U4 v;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ float lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi(u32 v) { return __uint_as_float(v & 0xffff0000u); }

__device__ __forceinline__ float dot8(float acc, U4 w, U4 x) {
    acc = fmaf(lo(w.x), lo(x.x), acc);
    acc = fmaf(hi(w.x), hi(x.x), acc);
    acc = fmaf(lo(w.y), lo(x.y), acc);
    acc = fmaf(hi(w.y), hi(x.y), acc);
    acc = fmaf(lo(w.z), lo(x.z), acc);
    acc = fmaf(hi(w.z), hi(x.z), acc);
    acc = fmaf(lo(w.w), lo(x.w), acc);
    acc = fmaf(hi(w.w), hi(x.w), acc);
    return acc;
}

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ void load_step(U4 (&wv)[UNROLL][RPW], const u16* const (&wr)[RPW], int s, int stride,
                                          int steps) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
        for (int r = 0; r < RPW; ++r)
            if (s + u * stride < steps) wv[u][r] = load_weights(wr[r] + (size_t)(s + u * stride) * 256);
}

extern "C" __global__ void __launch_bounds__(32 * WARPS) gemv_bf16(const u16* __restrict__ x, const u16* __restrict__ w,
                                                                 u16* __restrict__ y, int N, int K) {
    // SPLIT warps share RPW rows: warp slice j takes steps j, j + SPLIT, .. and slice 0 adds the slices'
    // sums in order at the end.
    __shared__ float part[WARPS][RPW];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, slice = warp % SPLIT;
    const int row0 = (blockIdx.x * (WARPS / SPLIT) + warp / SPLIT) * RPW;
    // Under programmatic dependent launch: wait for the kernel before (the activations), and let the next
    // one start its launch. Without it both return at once.
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
    const int steps = row0 < N ? K >> 8 : 0;  // 256 features a step (8 a lane); rows past N do nothing
    const u16* wr[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) wr[r] = w + (size_t)(row0 + r < N ? row0 + r : N - 1) * K + lane * 8;
    const u16* xr = x + lane * 8;
    float acc[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) acc[r] = 0.f;
    // UNROLL steps of loads in flight while the UNROLL before them are multiplied
    U4 cur[UNROLL][RPW], next[UNROLL][RPW];
    load_step(cur, wr, slice, SPLIT, steps);
    for (int s = slice; s < steps; s += UNROLL * SPLIT) {
        load_step(next, wr, s + UNROLL * SPLIT, SPLIT, steps);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (s + u * SPLIT < steps) {
                U4 xv = load_activations(xr + (s + u * SPLIT) * 256);
#pragma unroll
                for (int r = 0; r < RPW; ++r) acc[r] = dot8(acc[r], cur[u][r], xv);
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int r = 0; r < RPW; ++r) cur[u][r] = next[u][r];
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
#pragma unroll
        for (int d = 16; d > 0; d >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], d);
    }
    if (SPLIT > 1) {
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < RPW; ++r) part[warp][r] = acc[r];
        }
        __syncthreads();
        if (slice != 0) return;
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
            acc[r] = part[warp][r];
            for (int j = 1; j < SPLIT; ++j) acc[r] += part[warp + j][r];
        }
    }
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < RPW; ++r)
            if (row0 + r < N) y[row0 + r] = f32_to_bf16(acc[r]);
    }
}
