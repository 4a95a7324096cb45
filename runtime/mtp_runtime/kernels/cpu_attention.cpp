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

inline float hsum(__m256 v) {
  const __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  float s = hsum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y = y * keep + w * x (n values)
inline void scale_add(float* y, float keep, float w, const float* x, int64_t n) {
  const __m256 k = _mm256_set1_ps(keep), wv = _mm256_set1_ps(w);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i), _mm256_mul_ps(k, _mm256_loadu_ps(y + i))));
  }
  for (; i < n; ++i) y[i] = y[i] * keep + w * x[i];
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
          for (int64_t h = 0; h < heads; ++h) score[h * kChunk + c] = s * dot(qr + h * dim, key[c], dim);
        }
        for (int64_t h = 0; h < heads; ++h) {
          float* sc = score.data() + h * kChunk;
          float top = max[h];
          for (int64_t c = 0; c < n; ++c) top = std::max(top, sc[c]);
          const float keep = std::exp(max[h] - top);  // 0 on the first chunk (max was -inf)
          float total = sum[h] * keep;
          for (int64_t c = 0; c < n; ++c) {
            sc[c] = std::exp(sc[c] - top);
            total += sc[c];
          }
          float* a = acc.data() + h * value_dim;
          scale_add(a, keep, sc[0], key[0], value_dim);
          for (int64_t c = 1; c < n; ++c) scale_add(a, 1.0f, sc[c], key[c], value_dim);
          max[h] = top;
          sum[h] = total;
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
