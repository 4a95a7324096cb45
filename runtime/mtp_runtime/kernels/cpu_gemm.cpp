// Float32 linear layer for x86 CPUs with AVX2 and FMA: y = x W^T (+ bias), with W prepacked.
//
// Decode and verify steps multiply a few rows (1 to a few dozen tokens) by each weight. A general
// GEMM library packs the weight on every call and, at that size, costs about as much per row as a
// matrix-vector product, so verifying k + 1 tokens costs nearly k + 1 decode steps. Here the weight
// is packed once, at load, into panels of 16 output features ([ceil(O/16), I, 16], zero-padded):
// each panel is read once per group of up to 4 rows, and the 2 x 4 accumulators stay in registers.
// Every row's sums run in the same order whatever the batch, so a token's logits do not depend on
// which other tokens share its step. The same panels serve a MoE layer's routed experts
// (moe_experts): each chosen expert's weights are read in place, for its tokens only.
//
// Panels are float32, or bfloat16 where every weight is exactly a bfloat16 value (a checkpoint
// stored in bfloat16 and loaded as float32): widening a bfloat16 to float32 is exact, so the
// products are bit for bit those of the float32 panels, from half the bytes. A decode step of a
// small model reads its weights from the CPU's caches and memory faster than it multiplies them
// only if there are few of them to read.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kPanel = 16;  // output features per panel: two AVX2 registers
constexpr int64_t kRows = 4;    // rows per pass over a panel: 8 accumulators + 2 weights + 4 broadcasts
// Up to this many rows the packed kernel ran faster than the BLAS library's GEMM on the bench model's
// weights (hack/bench_cpu_gemm.py); above it, at::linear.
constexpr int64_t kMaxRows = 256;
// One row by a weight of this many elements or more (32 MiB, the size of the bench machine's L3) is a
// matrix-vector product bound by streaming the weight from memory, where the BLAS library's gemv was
// as fast or faster (hack/bench_cpu_gemm.py): at::linear.
constexpr int64_t kGemvElements = int64_t{8} << 20;

// A panel row's 16 weights as float32 (features 0-7, 8-15): read as they are, or widened from
// bfloat16 (exact). bfloat16 rows are stored interleaved (cpu_gemm.py BF16_ORDER): 32-bit word j holds
// feature j in its low half and feature j + 8 in its high half, so one load, a shift and a mask widen
// all 16 (converting each half apart took two loads and four shuffles per row, and at one row per
// pass the shuffles, not the multiply-adds, set the pace).
inline void load16(const float* w, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(w);
  hi = _mm256_loadu_ps(w + 8);
}
inline void load16(const uint16_t* w, __m256& lo, __m256& hi) {
  const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// M rows times NP consecutive panels: 2 x M x NP accumulators in registers. Every output's sum runs
// over the inputs in order in one accumulator, whatever M and NP, so a row's result does not depend
// on how many rows or panels share its pass; NP > 1 only gives a pass of few rows enough independent
// chains of multiply-adds to hide their latency (one row by one panel keeps two chains, and a decode
// step's products ran at a quarter of the core's rate).
template <int M, int NP, typename W>
void panel_rows(const float* x, int64_t ldx, const W* panel, const float* bias, float* y, int64_t ldy,
                int64_t in_features, int64_t out_left) {
  __m256 lo[NP][M], hi[NP][M];
#pragma GCC unroll 4
  for (int q = 0; q < NP; ++q) {
#pragma GCC unroll 4
    for (int r = 0; r < M; ++r) {
      lo[q][r] = _mm256_setzero_ps();
      hi[q][r] = _mm256_setzero_ps();
    }
  }
  const int64_t stride = in_features * kPanel;  // from one panel to the next
  for (int64_t i = 0; i < in_features; ++i) {
    __m256 v[M];
#pragma GCC unroll 4
    for (int r = 0; r < M; ++r) v[r] = _mm256_broadcast_ss(x + r * ldx + i);
#pragma GCC unroll 4
    for (int q = 0; q < NP; ++q) {
      __m256 w_lo, w_hi;
      load16(panel + q * stride + i * kPanel, w_lo, w_hi);
#pragma GCC unroll 4
      for (int r = 0; r < M; ++r) {
        lo[q][r] = _mm256_fmadd_ps(v[r], w_lo, lo[q][r]);
        hi[q][r] = _mm256_fmadd_ps(v[r], w_hi, hi[q][r]);
      }
    }
  }
  // The accumulators leave their registers once, with constant indices (a runtime index would
  // keep them in memory through the loop above).
  alignas(32) float out[NP][M][kPanel];
#pragma GCC unroll 4
  for (int q = 0; q < NP; ++q) {
#pragma GCC unroll 4
    for (int r = 0; r < M; ++r) {
      _mm256_store_ps(out[q][r], lo[q][r]);
      _mm256_store_ps(out[q][r] + 8, hi[q][r]);
    }
  }
  for (int q = 0; q < NP; ++q) {
    const int64_t valid = std::min(kPanel, out_left - q * kPanel);  // the weight's last panel is padded
    const float* b = bias != nullptr ? bias + q * kPanel : nullptr;
    for (int r = 0; r < M; ++r) {
      if (b != nullptr) {
        for (int64_t j = 0; j < valid; ++j) out[q][r][j] += b[j];
      }
      std::memcpy(y + r * ldy + q * kPanel, out[q][r], valid * sizeof(float));
    }
  }
}

// Panels per pass for M rows: 8 accumulators where the rows alone give fewer.
template <int M>
constexpr int kPanelsPerPass = M == 1 ? 4 : M == 2 ? 2 : 1;

template <int M, typename W>
void rows_by_panels(const float* x, int64_t in_features, const W* packed, int64_t out_features, const float* bias,
                    float* y, int64_t begin, int64_t end) {
  constexpr int NP = kPanelsPerPass<M>;
  int64_t p = begin;
  for (; p + NP <= end; p += NP) {
    const int64_t col = p * kPanel;
    panel_rows<M, NP>(x, in_features, packed + p * in_features * kPanel, bias != nullptr ? bias + col : nullptr,
                      y + col, out_features, in_features, out_features - col);
  }
  for (; p < end; ++p) {
    const int64_t col = p * kPanel;
    panel_rows<M, 1>(x, in_features, packed + p * in_features * kPanel, bias != nullptr ? bias + col : nullptr,
                     y + col, out_features, in_features, out_features - col);
  }
}

// y[rows, out_features] (row stride out_features) = x[rows, in_features] times the packed panels
// [begin, end) of a weight (+ bias). With more rows than one pass takes, the panels go by in blocks
// small enough to stay in the core's cache while every group of up to kRows rows passes over them.
template <typename W>
void multiply_panels(const float* x, int64_t rows, int64_t in_features, const W* packed, int64_t out_features,
                     const float* bias, float* y, int64_t begin, int64_t end) {
  const auto pass = [&](int64_t r, int64_t first, int64_t last) {
    const float* xr = x + r * in_features;
    float* yr = y + r * out_features;
    switch (std::min(kRows, rows - r)) {
      case 4: rows_by_panels<4>(xr, in_features, packed, out_features, bias, yr, first, last); break;
      case 3: rows_by_panels<3>(xr, in_features, packed, out_features, bias, yr, first, last); break;
      case 2: rows_by_panels<2>(xr, in_features, packed, out_features, bias, yr, first, last); break;
      default: rows_by_panels<1>(xr, in_features, packed, out_features, bias, yr, first, last); break;
    }
  };
  if (rows <= kRows) {
    pass(0, begin, end);
    return;
  }
  const int64_t panel_bytes = in_features * kPanel * static_cast<int64_t>(sizeof(W));
  const int64_t block = std::max<int64_t>(1, std::min<int64_t>(4, (256 << 10) / panel_bytes));
  for (int64_t p = begin; p < end; p += block) {
    for (int64_t r = 0; r < rows; r += kRows) pass(r, p, std::min(end, p + block));
  }
}

// Panels per parallel task: at least ~64k multiply-adds each; smaller tasks run on the calling thread.
int64_t grain_for(int64_t rows, int64_t in_features) {
  return std::max<int64_t>(1, 65536 / std::max<int64_t>(1, rows * in_features * kPanel));
}

bool panel_dtype(const at::Tensor& t) { return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16; }

// Calls f with the panels' first weight as `const float*` or, for bfloat16 panels, `const uint16_t*`.
template <typename F>
void with_panels(const at::Tensor& packed, int64_t offset, F&& f) {
  if (packed.scalar_type() == at::kBFloat16) {
    f(reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()) + offset);
  } else {
    f(packed.data_ptr<float>() + offset);
  }
}

// Calls f with an expert's gate/up and down panels (one dtype, checked by check_packed_experts), from
// the given element offsets.
template <typename F>
void with_expert_panels(const at::Tensor& w13, int64_t offset13, const at::Tensor& w2, int64_t offset2, F&& f) {
  if (w13.scalar_type() == at::kBFloat16) {
    f(reinterpret_cast<const uint16_t*>(w13.data_ptr<at::BFloat16>()) + offset13,
      reinterpret_cast<const uint16_t*>(w2.data_ptr<at::BFloat16>()) + offset2);
  } else {
    f(static_cast<const float*>(w13.data_ptr<float>()) + offset13,
      static_cast<const float*>(w2.data_ptr<float>()) + offset2);
  }
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat,
              "packed_linear: input must be a float32 CPU tensor, got ", x.scalar_type(), " on ", x.device());
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) > 0 && packed.size(2) == kPanel && packed.is_contiguous() &&
                  panel_dtype(packed),
              "packed_linear: packed weight must be a contiguous float32 or bfloat16 [panels, in_features, 16] "
              "tensor, got ", packed.scalar_type(), " ", packed.sizes());
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == packed.size(1) && weight.size(0) <= packed.size(0) * kPanel,
              "packed_linear: weight ", weight.sizes(), " does not match its packed panels ", packed.sizes());
  const int64_t out_features = weight.size(0), in_features = packed.size(1);
  TORCH_CHECK(x.size(-1) == in_features, "packed_linear: input has ", x.size(-1),
              " features, the weight expects ", in_features);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == out_features,
                "packed_linear: bias must be float32 with ", out_features, " values");
  }
  const int64_t rows = x.numel() / in_features;
  if (rows > kMaxRows || (rows == 1 && weight.numel() >= kGemvElements)) {
    return at::linear(x, weight, b);  // a prefill chunk, or one row streaming a large weight
  }
  const at::Tensor input = x.reshape({-1, in_features}).contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  at::Tensor y = at::empty({rows, out_features}, x.options());
  if (rows > 0) {
    const float* xp = input.data_ptr<float>();
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    float* yp = y.data_ptr<float>();
    const int64_t panels = (out_features + kPanel - 1) / kPanel;
    with_panels(packed, 0, [&](const auto* wp) {
      at::parallel_for(0, panels, grain_for(rows, in_features), [&](int64_t begin, int64_t end) {
        multiply_panels(xp, rows, in_features, wp, out_features, bp, yp, begin, end);
      });
    });
  }
  return y.view(shape);
}

// out[tok[r]] += wt[r] * W2 (silu(G x) * U x) for the m rows x[tok[r]], one expert: w13 its packed gate
// then up rows ([2I, H] as panels), w2 its packed down projection ([H, I]). tok == nullptr: every row of
// x in order, read in place, each with weight 1 (the shared expert). The buffers hold m rows.
struct ExpertBuffers {
  std::vector<float> rows, gate_up, act, down;
};

template <typename W>
void add_expert(const float* x, int64_t hidden, const int64_t* tok, const float* wt, int64_t m, const W* w13,
                const W* w2, int64_t inter, ExpertBuffers& buf, float* out) {
  if (tok != nullptr) buf.rows.resize(m * hidden);
  buf.gate_up.resize(m * 2 * inter);
  buf.act.resize(m * inter);
  buf.down.resize(m * hidden);
  const float* rows = x;
  if (tok != nullptr) {
    for (int64_t r = 0; r < m; ++r) std::memcpy(buf.rows.data() + r * hidden, x + tok[r] * hidden, hidden * sizeof(float));
    rows = buf.rows.data();
  }
  const int64_t p13 = (2 * inter + kPanel - 1) / kPanel, p2 = (hidden + kPanel - 1) / kPanel;
  at::parallel_for(0, p13, grain_for(m, hidden), [&](int64_t begin, int64_t end) {
    multiply_panels(rows, m, hidden, w13, 2 * inter, nullptr, buf.gate_up.data(), begin, end);
  });
  for (int64_t r = 0; r < m; ++r) {
    const float* g = buf.gate_up.data() + r * 2 * inter;
    float* a = buf.act.data() + r * inter;
    for (int64_t j = 0; j < inter; ++j) a[j] = g[j] / (1.0f + std::exp(-g[j])) * g[inter + j];
  }
  at::parallel_for(0, p2, grain_for(m, inter), [&](int64_t begin, int64_t end) {
    multiply_panels(buf.act.data(), m, inter, w2, hidden, nullptr, buf.down.data(), begin, end);
  });
  for (int64_t r = 0; r < m; ++r) {
    const float* d = buf.down.data() + r * hidden;
    if (tok == nullptr) {
      float* o = out + r * hidden;
      for (int64_t j = 0; j < hidden; ++j) o[j] += d[j];
    } else {
      float* o = out + tok[r] * hidden;
      for (int64_t j = 0; j < hidden; ++j) o[j] += wt[r] * d[j];
    }
  }
}

void check_packed_experts(const at::Tensor& w13, const at::Tensor& w2, int64_t hidden, const char* what) {
  for (const at::Tensor* w : {&w13, &w2}) {
    TORCH_CHECK(w->dim() == 4 && w->size(3) == kPanel && w->is_contiguous() && panel_dtype(*w),
                "moe_experts: packed ", what, " weights must be contiguous float32 or bfloat16 [experts, panels, "
                "in_features, 16], got ", w->scalar_type(), " ", w->sizes());
  }
  TORCH_CHECK(w13.scalar_type() == w2.scalar_type(), "moe_experts: packed ", what, " w13 is ", w13.scalar_type(),
              " but w2 is ", w2.scalar_type());
  const int64_t inter = w2.size(2);
  TORCH_CHECK(w13.size(2) == hidden && w2.size(0) == w13.size(0) && w13.size(1) == (2 * inter + kPanel - 1) / kPanel &&
                  w2.size(1) == (hidden + kPanel - 1) / kPanel,
              "moe_experts: packed ", what, " w13 ", w13.sizes(), " and w2 ", w2.sizes(), " do not fit hidden size ",
              hidden);
}

// A MoE layer's experts: out[t] = sum over t's chosen local experts e (ascending e) of
// weight(t, e) * W2_e (silu(G_e x_t) * U_e x_t), plus, if given, the shared expert's output for every
// token (added last). Only the chosen experts' weights are read, each once per group of up to kRows of
// its tokens, in place (no per-step copies of the chosen weights, no product with the experts a token
// did not choose). w13 [E, panels, H, 16] holds each expert's gate then up rows ([2I, H]) packed, w2
// [E, panels, I, 16] its down projection ([H, I]); the shared expert's are [1, ...] of its own width.
// `first` is the global id of local expert 0 (expert parallelism: other ids belong to other ranks).
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids, const at::Tensor& w13,
                       const at::Tensor& w2, int64_t first, const c10::optional<at::Tensor>& shared_w13,
                       const c10::optional<at::Tensor>& shared_w2) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "moe_experts: x must be a float32 CPU [tokens, hidden] tensor, got ", x.scalar_type(), " ",
              x.sizes(), " on ", x.device());
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kLong,
              "moe_experts: ids must be int64 [tokens, k] with ", x.size(0), " tokens, got ", ids.scalar_type(), " ",
              ids.sizes());
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat,
              "moe_experts: weights must be float32 shaped like ids ", ids.sizes(), ", got ",
              weights.scalar_type(), " ", weights.sizes());
  const int64_t tokens = x.size(0), hidden = x.size(1), topk = ids.size(1);
  check_packed_experts(w13, w2, hidden, "routed");
  const bool shared = shared_w13.has_value() && shared_w13->defined();
  TORCH_CHECK(shared == (shared_w2.has_value() && shared_w2->defined()),
              "moe_experts: give both shared_w13 and shared_w2, or neither");
  if (shared) {
    check_packed_experts(*shared_w13, *shared_w2, hidden, "shared");
    TORCH_CHECK(shared_w13->size(0) == 1, "moe_experts: one shared expert block, got ", shared_w13->size(0));
  }
  const int64_t experts = w13.size(0), inter = w2.size(2);
  at::Tensor out = at::zeros({tokens, hidden}, x.options());
  if (tokens == 0) return out;
  const at::Tensor input = x.contiguous(), route = ids.contiguous(), scale = weights.contiguous();
  const int64_t* idp = route.data_ptr<int64_t>();
  const float* sp = scale.data_ptr<float>();
  // (token, weight) pairs sorted by local expert, tokens ascending within an expert.
  std::vector<int64_t> start(experts + 1, 0);
  for (int64_t i = 0; i < tokens * topk; ++i) {
    const int64_t local = idp[i] - first;
    if (local >= 0 && local < experts) ++start[local + 1];
  }
  for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> pair_token(start[experts]);
  std::vector<float> pair_weight(start[experts]);
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < tokens * topk; ++i) {
    const int64_t local = idp[i] - first;
    if (local >= 0 && local < experts) {
      pair_token[fill[local]] = i / topk;
      pair_weight[fill[local]++] = sp[i];
    }
  }
  const float* xp = input.data_ptr<float>();
  float* op = out.data_ptr<float>();
  ExpertBuffers buf;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t m = start[e + 1] - start[e];
    if (m == 0) continue;
    with_expert_panels(w13, e * w13.size(1) * hidden * kPanel, w2, e * w2.size(1) * inter * kPanel,
                       [&](const auto* gate_up, const auto* down) {
                         add_expert(xp, hidden, pair_token.data() + start[e], pair_weight.data() + start[e], m,
                                    gate_up, down, inter, buf, op);
                       });
  }
  if (shared) {
    with_expert_panels(*shared_w13, 0, *shared_w2, 0, [&](const auto* gate_up, const auto* down) {
      add_expert(xp, hidden, nullptr, nullptr, tokens, gate_up, down, shared_w2->size(2), buf, op);
    });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(mtp_runtime, m) {
  m.def("packed_linear(Tensor x, Tensor weight, Tensor packed, Tensor? bias=None) -> Tensor");
  m.def("moe_experts(Tensor x, Tensor weights, Tensor ids, Tensor w13, Tensor w2, int first, "
        "Tensor? shared_w13=None, Tensor? shared_w2=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtp_runtime, CPU, m) {
  m.impl("packed_linear", &packed_linear);
  m.impl("moe_experts", &moe_experts);
}
