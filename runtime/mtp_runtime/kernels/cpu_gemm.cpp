// Float32 linear layer for x86 CPUs with AVX2 and FMA: y = x W^T (+ bias), with W prepacked.
//
// Decode and verify steps multiply a few rows (1 to a few dozen tokens) by each weight. A general
// GEMM library packs the weight on every call and, at that size, costs about as much per row as a
// matrix-vector product, so verifying k + 1 tokens costs nearly k + 1 decode steps. Here the weight
// is packed once, at load, into panels of 16 output features ([ceil(O/16), I, 16], zero-padded):
// each panel is read once per group of up to 4 rows, and the 2 x 4 accumulators stay in registers.
// Every row's sums run in the same order whatever the batch, so a token's logits do not depend on
// which other tokens share its step.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

namespace {

constexpr int64_t kPanel = 16;  // output features per panel: two AVX2 registers
constexpr int64_t kRows = 4;    // rows per pass over a panel: 8 accumulators + 2 weights + 1 broadcast
// Up to this many rows the packed kernel ran faster than the BLAS library's GEMM on the bench model's
// weights (hack/bench_cpu_gemm.py); above it, at::linear.
constexpr int64_t kMaxRows = 256;
// One row by a weight of this many elements or more (32 MiB, the size of the bench machine's L3) is a
// matrix-vector product bound by streaming the weight from memory, where the BLAS library's gemv was
// as fast or faster (hack/bench_cpu_gemm.py): at::linear.
constexpr int64_t kGemvElements = int64_t{8} << 20;

template <int M>
void panel_rows(const float* x, int64_t ldx, const float* panel, const float* bias, float* y, int64_t ldy,
                int64_t in_features, int64_t valid) {
  __m256 lo[M], hi[M];
#pragma GCC unroll 4
  for (int r = 0; r < M; ++r) {
    lo[r] = _mm256_setzero_ps();
    hi[r] = _mm256_setzero_ps();
  }
  for (int64_t i = 0; i < in_features; ++i) {
    const __m256 w_lo = _mm256_loadu_ps(panel + i * kPanel);
    const __m256 w_hi = _mm256_loadu_ps(panel + i * kPanel + 8);
#pragma GCC unroll 4
    for (int r = 0; r < M; ++r) {
      const __m256 v = _mm256_broadcast_ss(x + r * ldx + i);
      lo[r] = _mm256_fmadd_ps(v, w_lo, lo[r]);
      hi[r] = _mm256_fmadd_ps(v, w_hi, hi[r]);
    }
  }
  // The accumulators leave their registers once, with constant indices (a runtime index would
  // keep them in memory through the loop above).
  alignas(32) float out[M][kPanel];
#pragma GCC unroll 4
  for (int r = 0; r < M; ++r) {
    _mm256_store_ps(out[r], lo[r]);
    _mm256_store_ps(out[r] + 8, hi[r]);
  }
  for (int r = 0; r < M; ++r) {
    if (bias != nullptr) {
      for (int64_t j = 0; j < valid; ++j) out[r][j] += bias[j];
    }
    std::memcpy(y + r * ldy, out[r], valid * sizeof(float));
  }
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat,
              "packed_linear: input must be a float32 CPU tensor, got ", x.scalar_type(), " on ", x.device());
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) > 0 && packed.size(2) == kPanel && packed.is_contiguous() &&
                  packed.scalar_type() == at::kFloat,
              "packed_linear: packed weight must be a contiguous float32 [panels, in_features, 16] tensor, got ",
              packed.sizes());
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
    const float* wp = packed.data_ptr<float>();
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    float* yp = y.data_ptr<float>();
    const int64_t panels = (out_features + kPanel - 1) / kPanel;
    // A task of at least ~64k multiply-adds: smaller ones run on the calling thread.
    const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, rows * in_features * kPanel));
    at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const float* panel = wp + p * in_features * kPanel;
        const int64_t col = p * kPanel;
        const int64_t valid = std::min(kPanel, out_features - col);
        const float* pb = bp != nullptr ? bp + col : nullptr;
        for (int64_t r = 0; r < rows; r += kRows) {
          const float* xr = xp + r * in_features;
          float* yr = yp + r * out_features + col;
          switch (std::min(kRows, rows - r)) {
            case 4: panel_rows<4>(xr, in_features, panel, pb, yr, out_features, in_features, valid); break;
            case 3: panel_rows<3>(xr, in_features, panel, pb, yr, out_features, in_features, valid); break;
            case 2: panel_rows<2>(xr, in_features, panel, pb, yr, out_features, in_features, valid); break;
            default: panel_rows<1>(xr, in_features, panel, pb, yr, out_features, in_features, valid); break;
          }
        }
      }
    });
  }
  return y.view(shape);
}

}  // namespace

TORCH_LIBRARY(mtp_runtime, m) {
  m.def("packed_linear(Tensor x, Tensor weight, Tensor packed, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtp_runtime, CPU, m) { m.impl("packed_linear", &packed_linear); }
