// Decode attention over a paged cache whose one key per token is shared by every head (MLA's latent,
// MQA), for x86 CPUs with AVX2 and FMA: out[b, j, h] = softmax_p(scale * q[b, j, h] . kv[p]) kv[p][:value_dim]
// over the positions p = 0 .. q_pos[b, j] of sequence b, read in place through its block table.
//
// The general path gathers every sequence's context into a padded [B, L, D] tensor, multiplies by the
// queries, masks, takes the softmax over all L and multiplies again: at decode sizes (a handful of
// queries, a few hundred keys) most of its time goes to the copies and to the loops' index arithmetic,
// not to the products. Here each query row reads its own keys once, block by block, with an online
// softmax (a running max and sum, rescaled per chunk of positions), so nothing of size L is written.
// A query's result depends only on its own keys, in position order: not on the other queries of its
// step, their number or their context lengths (a token's output is the same whether it is decoded
// alone or verified with drafts beside it).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kChunk = 32;  // positions whose scores are taken together before the values are added
constexpr int kHeadGroup = 4;    // heads whose scores are taken in one pass over a key (x 2 keys: 8 chains)

// The lanes of 8 vectors summed: out[i] = sum of a[i]'s lanes, always in the same order.
inline __m256 sum8(const __m256 a[8]) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [a0..a3 | a0..a3], [a4..a7 | ...]
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// exp of 8 values (Cephes' single-precision polynomial, about 1 ulp; inputs below -87.3 give about 1e-38).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365478515625f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// Lanes 0..n-1 of a mask (n in 0..8).
inline __m256i lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// scores[h][c] = scale * q[h] . key[c] for the heads h0 .. h0 + 3 (those below `heads`) and the
// chunk's n keys: two keys and four heads per pass, each dot product in one accumulator over the
// dimensions in order (a masked load for the last dim % 8), so a score does not depend on the
// heads or keys it was computed beside.
void chunk_scores(const float* q, int64_t heads, int64_t dim, int64_t h0, const float* const* key, int64_t n,
                  float scale, float* scores) {
  const float* qh[kHeadGroup];
  for (int i = 0; i < kHeadGroup; ++i) qh[i] = q + std::min<int64_t>(h0 + i, heads - 1) * dim;
  const int64_t full = dim / 8 * 8;
  const __m256i tail = lanes(dim - full);
  alignas(32) float out[8];
  for (int64_t c = 0; c < n; c += 2) {
    const float* k0 = key[c];
    const float* k1 = key[std::min(c + 1, n - 1)];
    __m256 acc[8];
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int64_t d = 0; d < full; d += 8) {
      const __m256 v0 = _mm256_loadu_ps(k0 + d), v1 = _mm256_loadu_ps(k1 + d);
#pragma GCC unroll 4
      for (int i = 0; i < kHeadGroup; ++i) {
        const __m256 qv = _mm256_loadu_ps(qh[i] + d);
        acc[i] = _mm256_fmadd_ps(qv, v0, acc[i]);
        acc[kHeadGroup + i] = _mm256_fmadd_ps(qv, v1, acc[kHeadGroup + i]);
      }
    }
    if (full < dim) {
      const __m256 v0 = _mm256_maskload_ps(k0 + full, tail), v1 = _mm256_maskload_ps(k1 + full, tail);
      for (int i = 0; i < kHeadGroup; ++i) {
        const __m256 qv = _mm256_maskload_ps(qh[i] + full, tail);
        acc[i] = _mm256_fmadd_ps(qv, v0, acc[i]);
        acc[kHeadGroup + i] = _mm256_fmadd_ps(qv, v1, acc[kHeadGroup + i]);
      }
    }
    _mm256_store_ps(out, _mm256_mul_ps(sum8(acc), _mm256_set1_ps(scale)));
    for (int i = 0; i < kHeadGroup && h0 + i < heads; ++i) {
      scores[(h0 + i) * kChunk + c] = out[i];
      if (c + 1 < n) scores[(h0 + i) * kChunk + c + 1] = out[kHeadGroup + i];
    }
  }
}

// acc[0 .. 8V) = acc * keep + sum over c of p[c] * key[c][offset ..], in order of c, in registers.
template <int V>
void add_values(float* acc, float keep, const float* p, const float* const* key, int64_t n, int64_t offset) {
  __m256 a[V];
  const __m256 k = _mm256_set1_ps(keep);
#pragma GCC unroll 8
  for (int v = 0; v < V; ++v) a[v] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * v), k);
  for (int64_t c = 0; c < n; ++c) {
    const __m256 w = _mm256_set1_ps(p[c]);
    const float* x = key[c] + offset;
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) a[v] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 8 * v), a[v]);
  }
#pragma GCC unroll 8
  for (int v = 0; v < V; ++v) _mm256_storeu_ps(acc + 8 * v, a[v]);
}

// One head's values for a chunk: the accumulator in tiles of up to 64, then any last value_dim % 8.
void chunk_values(float* acc, int64_t value_dim, float keep, const float* p, const float* const* key, int64_t n) {
  int64_t d = 0;
  for (; d + 64 <= value_dim; d += 64) add_values<8>(acc + d, keep, p, key, n, d);
  for (; d + 32 <= value_dim; d += 32) add_values<4>(acc + d, keep, p, key, n, d);
  for (; d + 8 <= value_dim; d += 8) add_values<1>(acc + d, keep, p, key, n, d);
  for (; d < value_dim; ++d) {
    float a = acc[d] * keep;
    for (int64_t c = 0; c < n; ++c) a = std::fma(p[c], key[c][d], a);
    acc[d] = a;
  }
}

// p[c] = exp(p[c] - top) for c < n; returns their sum (added in order of c).
float exp_chunk(float* p, int64_t n, float top) {
  const __m256 t = _mm256_set1_ps(top);
  for (int64_t c = 0; c < n; c += 8) {
    const __m256i m = lanes(std::min<int64_t>(8, n - c));
    _mm256_maskstore_ps(p + c, m, exp8(_mm256_sub_ps(_mm256_maskload_ps(p + c, m), t)));
  }
  float total = 0.0f;
  for (int64_t c = 0; c < n; ++c) total += p[c];
  return total;
}

at::Tensor mla_decode_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
                                const at::Tensor& q_pos, int64_t value_dim, double scale) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 4,
              "mla_decode_attention: q must be a float32 CPU [batch, queries, heads, dim] tensor, got ",
              q.scalar_type(), " ", q.sizes(), " on ", q.device());
  const int64_t batch = q.size(0), queries = q.size(1), heads = q.size(2), dim = q.size(3);
  TORCH_CHECK(cache.device().is_cpu() && cache.scalar_type() == at::kFloat && cache.dim() == 3 &&
                  cache.size(2) == dim && cache.is_contiguous(),
              "mla_decode_attention: cache must be a contiguous float32 [blocks, block_size, ", dim, "] tensor, got ",
              cache.scalar_type(), " ", cache.sizes());
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == batch && tables.scalar_type() == at::kLong,
              "mla_decode_attention: tables must be int64 [", batch, ", width], got ", tables.scalar_type(), " ",
              tables.sizes());
  TORCH_CHECK(q_pos.dim() == 2 && q_pos.size(0) == batch && q_pos.size(1) == queries &&
                  q_pos.scalar_type() == at::kLong,
              "mla_decode_attention: q_pos must be int64 [", batch, ", ", queries, "], got ", q_pos.scalar_type(),
              " ", q_pos.sizes());
  TORCH_CHECK(value_dim > 0 && value_dim <= dim, "mla_decode_attention: value_dim ", value_dim,
              " must lie in 1..", dim);
  const int64_t blocks = cache.size(0), block_size = cache.size(1), width = tables.size(1);
  const at::Tensor qc = q.contiguous(), tc = tables.contiguous(), pc = q_pos.contiguous();
  const int64_t* table = tc.data_ptr<int64_t>();
  const int64_t* pos = pc.data_ptr<int64_t>();
  // Every index the kernel will follow, checked before any is: a position past its table, a block
  // outside the cache.
  for (int64_t i = 0; i < batch * queries; ++i) {
    TORCH_CHECK(pos[i] >= 0 && pos[i] < width * block_size, "mla_decode_attention: query ", i, " at position ",
                pos[i], " lies outside its table of ", width, " blocks of ", block_size);
  }
  for (int64_t b = 0; b < batch; ++b) {
    int64_t last = -1;
    for (int64_t j = 0; j < queries; ++j) last = std::max(last, pos[b * queries + j]);
    for (int64_t w = 0; w <= last / block_size; ++w) {
      const int64_t id = table[b * width + w];
      TORCH_CHECK(id >= 0 && id < blocks, "mla_decode_attention: sequence ", b, " reads block ", id, " of ", blocks);
    }
  }
  at::Tensor out = at::empty({batch, queries, heads, value_dim}, q.options());
  const float* qp = qc.data_ptr<float>();
  const float* kv = cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  // One task per query row; a row costs about its positions x heads x dim multiply-adds.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, heads * dim * (width * block_size / 2 + 1)));
  at::parallel_for(0, batch * queries, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> score(heads * kChunk), max(heads), sum(heads), acc(heads * value_dim);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / queries, last = pos[row];
      const float* qr = qp + row * heads * dim;
      std::fill(max.begin(), max.end(), -std::numeric_limits<float>::infinity());
      std::fill(sum.begin(), sum.end(), 0.0f);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t p0 = 0; p0 <= last; p0 += kChunk) {
        const int64_t n = std::min(kChunk, last + 1 - p0);
        const float* key[kChunk];
        for (int64_t c = 0; c < n; ++c) {
          const int64_t p = p0 + c;
          key[c] = kv + (table[b * width + p / block_size] * block_size + p % block_size) * dim;
        }
        for (int64_t h0 = 0; h0 < heads; h0 += kHeadGroup) chunk_scores(qr, heads, dim, h0, key, n, s, score.data());
        for (int64_t h = 0; h < heads; ++h) {
          float* sc = score.data() + h * kChunk;
          float top = max[h];
          for (int64_t c = 0; c < n; ++c) top = std::max(top, sc[c]);
          const float keep = std::exp(max[h] - top);  // 0 on the first chunk (max was -inf)
          sum[h] = sum[h] * keep + exp_chunk(sc, n, top);
          chunk_values(acc.data() + h * value_dim, value_dim, keep, sc, key, n);
          max[h] = top;
        }
      }
      float* o = op + row * heads * value_dim;
      for (int64_t h = 0; h < heads; ++h) {
        const float inv = 1.0f / sum[h];
        for (int64_t d = 0; d < value_dim; ++d) o[h * value_dim + d] = acc[h * value_dim + d] * inv;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mtp_runtime, m) {
  m.def("mla_decode_attention(Tensor q, Tensor cache, Tensor tables, Tensor q_pos, int value_dim, float scale) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(mtp_runtime, CPU, m) {
  m.impl("mla_decode_attention", &mla_decode_attention);
}
