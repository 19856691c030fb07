// AVX2/FMA kernels for CPU decoding: a GEMV over weights repacked into panels, and the small
// per-layer ops (residual add + RMSNorm, SwiGLU, rope with the KV write, attention over the
// cache) as one call each.
//
// A decode step streams every weight once from memory; each product's weight arrives as
// [ceil(N/16)][K][16] float panels (`pack_panels` on the Python side): a panel is one linear
// stream, 16 outputs per row in two ymm accumulators. Rows go in groups of up to 3, each group
// over several panels side by side; the first group of a chunk of panels reads it from memory,
// the others from L2.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

namespace {

constexpr int kPanel = 16;
constexpr int64_t kChunk = 12;  // panels every row group reads in turn (divisible by 4, 3 and 2)
// Software prefetch 2 KiB ahead in each stream: on top of the hardware prefetchers, it keeps
// more of a stream's lines in flight (without it one stream reaches about 60% of the rate).
constexpr int64_t kAhead = 512;

// S panels side by side (S independent memory streams, which the prefetchers serve in parallel),
// M rows each: 2 * M * S accumulators.
template <int M, int S>
__attribute__((noinline)) void panel_product(const float* x, int64_t xs, const float* p, int64_t K,
                                             const float* bias, float* y, int64_t ys, int64_t n_left) {
  // acc[2 (s M + m)] and acc[2 (s M + m) + 1]: outputs 0-7 and 8-15 of row m in panel s. Every
  // loop over registers is unrolled, so the accumulators stay in registers (GCC keeps a rolled
  // array of vectors in memory and stores it back on every k).
  __m256 acc[2 * M * S];
#pragma GCC unroll 16
  for (int a = 0; a < 2 * M * S; ++a) acc[a] = _mm256_setzero_ps();
  const int64_t stride = K * kPanel;
  for (int64_t k = 0; k < K; ++k) {
    __m256 xb[M];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) xb[m] = _mm256_broadcast_ss(x + m * xs + k);
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s) {
      const float* q = p + s * stride + k * kPanel;
      _mm_prefetch(reinterpret_cast<const char*>(q + kAhead), _MM_HINT_T0);
      const __m256 w0 = _mm256_loadu_ps(q), w1 = _mm256_loadu_ps(q + 8);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        acc[2 * (s * M + m)] = _mm256_fmadd_ps(w0, xb[m], acc[2 * (s * M + m)]);
        acc[2 * (s * M + m) + 1] = _mm256_fmadd_ps(w1, xb[m], acc[2 * (s * M + m) + 1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int s = 0; s < S; ++s) {
    const int64_t width = std::min<int64_t>(kPanel, n_left - s * kPanel);
    const float* bs = bias ? bias + s * kPanel : nullptr;
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      __m256 lo = acc[2 * (s * M + m)], hi = acc[2 * (s * M + m) + 1];
      float* ym = y + m * ys + s * kPanel;
      if (width == kPanel) {
        if (bs) lo = _mm256_add_ps(lo, _mm256_loadu_ps(bs)), hi = _mm256_add_ps(hi, _mm256_loadu_ps(bs + 8));
        _mm256_storeu_ps(ym, lo);
        _mm256_storeu_ps(ym + 8, hi);
      } else {
        alignas(32) float out[kPanel];
        _mm256_store_ps(out, lo);
        _mm256_store_ps(out + 8, hi);
        for (int64_t j = 0; j < width; ++j) ym[j] = bs ? out[j] + bs[j] : out[j];
      }
    }
  }
}

// Rows [0, M) (M <= 3) times panels [0, P): as many panels side by side as the registers allow.
void rows_product(int M, const float* x, int64_t xs, const float* p, int64_t K, int64_t P, const float* bias,
                  float* y, int64_t ys, int64_t n_left) {
  const int64_t stride = K * kPanel;
  int64_t i = 0;
  auto run = [&](auto kernel, int S) {
    for (; i + S <= P; i += S) kernel(x, xs, p + i * stride, K, bias ? bias + i * kPanel : nullptr, y + i * kPanel, ys,
                                      n_left - i * kPanel);
  };
  if (M == 1) run(panel_product<1, 4>, 4), run(panel_product<1, 1>, 1);
  else if (M == 2) run(panel_product<2, 3>, 3), run(panel_product<2, 1>, 1);
  else run(panel_product<3, 2>, 2), run(panel_product<3, 1>, 1);
}

void check_f32(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(!t.is_cuda() && t.scalar_type() == torch::kFloat32, what, " must be a float32 CPU tensor");
}

// exp(v) for float32 lanes: 2^n * p(r) with r = v - n ln2 in [-ln2/2, ln2/2] (Cody-Waite split of
// ln2), p a degree-6 Taylor polynomial; within 2 ulp over the range that does not overflow.
inline __m256 exp_ps(__m256 v) {
  v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), v);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 s = _mm256_set1_ps(1.f / 720);
  s = _mm256_fmadd_ps(s, r, _mm256_set1_ps(1.f / 120));
  s = _mm256_fmadd_ps(s, r, _mm256_set1_ps(1.f / 24));
  s = _mm256_fmadd_ps(s, r, _mm256_set1_ps(1.f / 6));
  s = _mm256_fmadd_ps(s, r, _mm256_set1_ps(0.5f));
  s = _mm256_fmadd_ps(s, r, _mm256_set1_ps(1.f));
  s = _mm256_fmadd_ps(s, r, _mm256_set1_ps(1.f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(s, _mm256_castsi256_ps(e));
}

}  // namespace

// y [M, n] = x [M, K] @ W.T (+ bias), W given as panels [ceil(n/16), K, 16].
torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t n,
                           const c10::optional<torch::Tensor>& bias) {
  check_f32(x, "x");
  check_f32(panels, "panels");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, K] with unit stride along K");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous() &&
                  panels.size(1) == x.size(1) && panels.size(0) * kPanel >= n && (panels.size(0) - 1) * kPanel < n,
              "panels must be contiguous [ceil(n/16), K, 16] for x's K");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    check_f32(*bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(), "bias must be contiguous [n]");
    b = bias->data_ptr<float>();
  }
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), xs = x.stride(0);
  auto y = torch::empty({M, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* pp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Rows go in groups of at most 3 (more panels side by side pay more than more rows); every
  // group runs over a chunk of panels before the next chunk, so only the first reads it from memory.
  at::parallel_for(0, P, kChunk, [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; c += kChunk) {
      const int64_t cp = std::min<int64_t>(kChunk, hi - c);
      for (int64_t m = 0, g = 0; m < M; m += g) {
        g = M - m == 4 ? 2 : std::min<int64_t>(3, M - m);  // (4 rows: 2 + 2, not 3 + 1)
        rows_product(static_cast<int>(g), xp + m * xs, xs, pp + c * K * kPanel, K, cp, b ? b + c * kPanel : nullptr,
                     yp + m * n + c * kPanel, n, n - c * kPanel);
      }
    }
  });
  return y;
}

// (norm(x + residual), x + residual) per row of the last dimension; without residual (norm(x), x).
// The sum of squares accumulates in float32 lanes, like torch's reduction (not in its order).
std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& x, const c10::optional<torch::Tensor>& residual,
                                        const torch::Tensor& weight, double eps) {
  check_f32(x, "x");
  check_f32(weight, "weight");
  const int64_t N = x.size(-1);
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.numel() == N,
              "x must be contiguous and weight [", N, "]");
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res) {
    check_f32(*residual, "residual");
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes(), "residual must be contiguous like x");
  }
  auto total = has_res ? torch::empty_like(x) : x;
  auto y = torch::empty_like(x);
  const int64_t rows = x.numel() / N;
  const float *xp = x.data_ptr<float>(), *rp = has_res ? residual->data_ptr<float>() : nullptr;
  const float* w = weight.data_ptr<float>();
  float *tp = total.data_ptr<float>(), *yp = y.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* a = xp + r * N;
    float* t = tp + r * N;
    __m256 ss = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= N; j += 8) {
      __m256 v = _mm256_loadu_ps(a + j);
      if (has_res) {
        v = _mm256_add_ps(v, _mm256_loadu_ps(rp + r * N + j));
        _mm256_storeu_ps(t + j, v);
      }
      ss = _mm256_add_ps(ss, _mm256_mul_ps(v, v));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, ss);
    float sum = 0.f;
    for (int l = 0; l < 8; ++l) sum += lanes[l];
    for (; j < N; ++j) {
      float v = has_res ? a[j] + rp[r * N + j] : a[j];
      if (has_res) t[j] = v;
      sum += v * v;
    }
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(N) + static_cast<float>(eps));
    const __m256 vinv = _mm256_set1_ps(inv);
    float* o = yp + r * N;
    for (j = 0; j + 8 <= N; j += 8) {
      _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(t + j), vinv), _mm256_loadu_ps(w + j)));
    }
    for (; j < N; ++j) o[j] = t[j] * inv * w[j];
  }
  return {y, total};
}

// silu(gate) * up for gate_up [..., 2I] (gate first) -> [..., I].
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check_f32(gate_up, "gate_up");
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0, "gate_up must be contiguous [..., 2I]");
  const int64_t I = gate_up.size(-1) / 2, rows = gate_up.numel() / (2 * I);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const float *gr = g + r * 2 * I, *ur = gr + I;
    float* orow = o + r * I;
    int64_t j = 0;
    for (; j + 8 <= I; j += 8) {
      __m256 v = _mm256_loadu_ps(gr + j);
      __m256 s = _mm256_div_ps(v, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(zero, v))));
      _mm256_storeu_ps(orow + j, _mm256_mul_ps(s, _mm256_loadu_ps(ur + j)));
    }
    for (; j < I; ++j) orow[j] = gr[j] / (1.f + std::exp(-gr[j])) * ur[j];
  }
  return out;
}

// heads [B, T, H + 2 Hkv, D] (contiguous): q and k heads rotated in place, x * cos + roll(x, D/2)
// * sin with cos/sin [B, T, D] (sin's first half negated); then k and v written into the caches
// [blocks, Hkv, block_size, D] at each token's slot: block blocks[b, w / bs], offset w % bs for
// w = write_idx[b, t] (paged), else block row_start + b, offset w.
void rope_store_(torch::Tensor& heads, int64_t H, const torch::Tensor& cos, const torch::Tensor& sin,
                 torch::Tensor& k_cache, torch::Tensor& v_cache, const c10::optional<torch::Tensor>& blocks,
                 int64_t row_start, const torch::Tensor& write_idx) {
  check_f32(heads, "heads");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  check_f32(k_cache, "k_cache");
  check_f32(v_cache, "v_cache");
  TORCH_CHECK(heads.dim() == 4 && heads.is_contiguous() && heads.size(3) % 16 == 0,
              "heads must be contiguous [B, T, heads, D] with D a multiple of 16");
  const int64_t B = heads.size(0), T = heads.size(1), n = heads.size(2), D = heads.size(3), half = D / 2;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == B * T * D && sin.numel() == B * T * D,
              "cos/sin must be contiguous [B, T, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.strides() == v_cache.strides() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.stride(3) == 1 && k_cache.size(3) == D,
              "k_cache and v_cache must be alike [blocks, Hkv, block_size, D] with unit stride along D");
  const int64_t Hkv = k_cache.size(1), bs = k_cache.size(2);
  TORCH_CHECK(H + 2 * Hkv == n, "heads must hold H q heads and the cache's k and v heads");
  TORCH_CHECK(write_idx.scalar_type() == torch::kLong && write_idx.dim() == 2 && write_idx.size(0) == B &&
                  write_idx.size(1) == T, "write_idx must be int64 [B, T]");
  const bool paged = blocks.has_value() && blocks->defined();
  if (paged) TORCH_CHECK(blocks->scalar_type() == torch::kLong && blocks->dim() == 2 && blocks->size(0) == B &&
                             blocks->stride(1) == 1, "blocks must be int64 [B, n]");
  float *hp = heads.data_ptr<float>(), *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int64_t *wi = write_idx.data_ptr<int64_t>(), *bt = paged ? blocks->data_ptr<int64_t>() : nullptr;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t tok = b * T + t;
      const float *c = cp + tok * D, *s = sp + tok * D;
      for (int64_t h = 0; h < H + Hkv; ++h) {
        float* x = hp + (tok * n + h) * D;
        for (int64_t j = 0; j < half; j += 8) {
          __m256 x1 = _mm256_loadu_ps(x + j), x2 = _mm256_loadu_ps(x + half + j);
          __m256 o1 = _mm256_add_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(c + j)), _mm256_mul_ps(x2, _mm256_loadu_ps(s + j)));
          __m256 o2 = _mm256_add_ps(_mm256_mul_ps(x2, _mm256_loadu_ps(c + half + j)),
                                    _mm256_mul_ps(x1, _mm256_loadu_ps(s + half + j)));
          _mm256_storeu_ps(x + j, o1);
          _mm256_storeu_ps(x + half + j, o2);
        }
      }
      const int64_t w = wi[b * write_idx.stride(0) + t * write_idx.stride(1)];
      const int64_t block = paged ? bt[b * blocks->stride(0) + w / bs] : row_start + b, off = paged ? w % bs : w;
      TORCH_CHECK(block >= 0 && block < k_cache.size(0) && off >= 0 && off < bs, "cache slot out of range");
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t slot = block * k_cache.stride(0) + h * k_cache.stride(1) + off * k_cache.stride(2);
        std::copy_n(hp + (tok * n + H + h) * D, D, kc + slot);
        std::copy_n(hp + (tok * n + H + Hkv + h) * D, D, vc + slot);
      }
    }
  }
}

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace

// Attention of every query over the cached keys it sees (indices <= its write index, below kv_len):
// heads [B, T, n, D] (q is heads [:, :, :H]), caches [blocks, Hkv, block_size, D] read through
// `blocks` [B, >=ceil(kv_len/bs)] (paged) or, without it, block row_start + b of row b. -> [B, T, H*D].
torch::Tensor cache_attention(const torch::Tensor& heads, int64_t H, const torch::Tensor& k_cache,
                              const torch::Tensor& v_cache, const c10::optional<torch::Tensor>& blocks,
                              int64_t row_start, const torch::Tensor& write_idx, int64_t kv_len, double scale) {
  check_f32(heads, "heads");
  check_f32(k_cache, "k_cache");
  check_f32(v_cache, "v_cache");
  TORCH_CHECK(heads.dim() == 4 && heads.is_contiguous() && heads.size(3) % 8 == 0, "heads must be contiguous [B, T, n, D], D % 8 == 0");
  const int64_t B = heads.size(0), T = heads.size(1), n = heads.size(2), D = heads.size(3);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.strides() == v_cache.strides() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.stride(3) == 1 && k_cache.size(3) == D,
              "k_cache and v_cache must be alike [blocks, Hkv, block_size, D] with unit stride along D");
  const int64_t Hkv = k_cache.size(1), bs = k_cache.size(2);
  TORCH_CHECK(H % Hkv == 0 && H + 2 * Hkv <= n, "H must be a multiple of the cache's KV heads");
  TORCH_CHECK(write_idx.scalar_type() == torch::kLong && write_idx.dim() == 2 && write_idx.size(0) == B &&
                  write_idx.size(1) == T, "write_idx must be int64 [B, T]");
  const bool paged = blocks.has_value() && blocks->defined();
  if (paged) {
    TORCH_CHECK(blocks->scalar_type() == torch::kLong && blocks->dim() == 2 && blocks->size(0) == B &&
                    blocks->stride(1) == 1 && blocks->size(1) * bs >= kv_len, "blocks must be int64 [B, >=kv_len/bs]");
  } else {
    TORCH_CHECK(bs >= kv_len && row_start + B <= k_cache.size(0), "an unpaged cache must hold kv_len keys per row");
  }
  const int64_t G = H / Hkv;
  auto out = torch::empty({B, T, H * D}, heads.options());
  const float *hp = heads.data_ptr<float>(), *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  const int64_t *wi = write_idx.data_ptr<int64_t>(), *bt = paged ? blocks->data_ptr<int64_t>() : nullptr;
  const int64_t bts = paged ? blocks->stride(0) : 0, ws0 = write_idx.stride(0), ws1 = write_idx.stride(1);
  const int64_t cs0 = k_cache.stride(0), cs1 = k_cache.stride(1), cs2 = k_cache.stride(2);
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * T * Hkv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> scores;
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t b = item / (T * Hkv), t = (item / Hkv) % T, h = item % Hkv;
      const int64_t L = std::min<int64_t>(wi[b * ws0 + t * ws1] + 1, kv_len);
      scores.assign(G * std::max<int64_t>(L, 1), 0.f);
      auto slot = [&](int64_t j) {
        const int64_t block = paged ? bt[b * bts + j / bs] : row_start + b, off = paged ? j % bs : j;
        return block * cs0 + h * cs1 + off * cs2;
      };
      const float* q = hp + ((b * T + t) * n + h * G) * D;
      for (int64_t j = 0; j < L; ++j) {
        const float* k = kc + slot(j);
        for (int64_t g = 0; g < G; ++g) {
          __m256 acc = _mm256_setzero_ps();
          for (int64_t d = 0; d < D; d += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d), _mm256_loadu_ps(k + d), acc);
          scores[g * L + j] = hsum(acc) * sc;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * L;
        float mx = -INFINITY;
        for (int64_t j = 0; j < L; ++j) mx = std::max(mx, s[j]);
        float sum = 0.f;
        int64_t j = 0;
        const __m256 vmx = _mm256_set1_ps(mx);
        __m256 vsum = _mm256_setzero_ps();
        for (; j + 8 <= L; j += 8) {
          __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmx));
          _mm256_storeu_ps(s + j, e);
          vsum = _mm256_add_ps(vsum, e);
        }
        sum = hsum(vsum);
        for (; j < L; ++j) sum += (s[j] = std::exp(s[j] - mx));
        const float inv = L > 0 ? 1.f / sum : 0.f;
        float* o = op + ((b * T + t) * H + h * G + g) * D;
        for (int64_t d0 = 0; d0 < D; d0 += 32) {  // 4 accumulators of 8 dims at a time
          const int64_t w = std::min<int64_t>(32, D - d0);
          __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
          for (int64_t jj = 0; jj < L; ++jj) {
            const float* v = vc + slot(jj) + d0;
            const __m256 p = _mm256_set1_ps(s[jj]);
            for (int64_t u = 0; u < w / 8; ++u) acc[u] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * u), acc[u]);
          }
          for (int64_t u = 0; u < w / 8; ++u) _mm256_storeu_ps(o + d0 + 8 * u, _mm256_mul_ps(acc[u], _mm256_set1_ps(inv)));
        }
      }
    }
  });
  return out;
}

// One dense (Llama-style) decoder layer for a decode or verify step, the ops above in turn without a
// return to Python between them (which costs more than the small ops themselves at a 135M model's
// widths): h [B, T, hidden], residual as for add_rms_norm; weights as panels with their output
// counts; the cache arguments as for rope_store_ / cache_attention. -> {mlp_out, residual, stream}:
// the MLP's output, the residual stream it adds to, and the stream entering the layer.
std::vector<torch::Tensor> dense_layer(const torch::Tensor& h, const c10::optional<torch::Tensor>& residual,
                                       const torch::Tensor& ln1, const torch::Tensor& ln2, double eps,
                                       const torch::Tensor& qkv, int64_t n_qkv, const torch::Tensor& o, int64_t n_o,
                                       const torch::Tensor& gate_up, int64_t n_gu, const torch::Tensor& down,
                                       int64_t n_down, int64_t H, int64_t D, const torch::Tensor& cos,
                                       const torch::Tensor& sin, torch::Tensor& k_cache, torch::Tensor& v_cache,
                                       const c10::optional<torch::Tensor>& blocks, int64_t row_start,
                                       const torch::Tensor& write_idx, int64_t kv_len, double scale) {
  TORCH_CHECK(h.dim() == 3 && n_qkv % D == 0, "h must be [B, T, hidden] and the qkv outputs whole heads");
  const int64_t B = h.size(0), T = h.size(1), hidden = h.size(2);
  auto normed = add_rms_norm(h, residual, ln1, eps);  // {norm, stream}
  auto heads = panel_linear(normed[0].view({B * T, hidden}), qkv, n_qkv, c10::nullopt).view({B, T, n_qkv / D, D});
  rope_store_(heads, H, cos, sin, k_cache, v_cache, blocks, row_start, write_idx);
  auto attn = cache_attention(heads, H, k_cache, v_cache, blocks, row_start, write_idx, kv_len, scale);
  auto attn_out = panel_linear(attn.view({B * T, H * D}), o, n_o, c10::nullopt).view({B, T, n_o});
  auto post = add_rms_norm(attn_out, normed[1], ln2, eps);  // {norm, residual}
  auto act = silu_mul(panel_linear(post[0].view({B * T, n_o}), gate_up, n_gu, c10::nullopt));
  auto out = panel_linear(act, down, n_down, c10::nullopt).view({B, T, n_down});
  return {out, post[1], normed[1]};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("panel_linear", &panel_linear, "x @ W.T over W packed as [ceil(n/16), K, 16] panels");
  m.def("add_rms_norm", &add_rms_norm, "(norm(x + residual), x + residual)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("rope_store_", &rope_store_, "rotary embedding of q and k in place, k and v written to the cache");
  m.def("cache_attention", &cache_attention, "attention over the (paged) KV cache, keys up to each write index");
  m.def("dense_layer", &dense_layer, "one dense decoder layer: norm, qkv, rope + KV write, attention, o, norm, MLP");
}
