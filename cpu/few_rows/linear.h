// Every weight format's product behind one call.
#pragma once

namespace {

// x [M, K] @ w.T: w [N, K] (bf16 or fp32, times factors [N] or [N, K / block], by rows); bf16 tiles [N / 16, K / 32, 512]
// (Bf16Codes); int4 tiles uint8 [N / 16, K / 32, 256]
// (Int4Tiles); int8 tiles int8 [N / 16, K / 32, 512] (Int8Codes); MX 6-bit tiles uint8 [N / 16, K / 32, 384] with an
// int16 table (Fp6Codes); or MX 6-bit codes as packed uint8 [N, K * 3 / 4] with a bf16 table (Fp6Table), factors their
// E8M0 scales.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& factors,
                  const std::optional<at::Tensor>& table) {
  if (w.dim() == 3) {
    if (w.scalar_type() == at::kBFloat16 && !factors) return bf16_tiles(x, w);
    TORCH_CHECK(factors, "few_rows: tiles need their factors");
    if (w.scalar_type() == at::kByte && !table) return int4_tiles(x, w, *factors);
    return wide_tiles(x, w, *factors, table);
  }
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "few_rows: weight must be contiguous [N, K] or tiles");
  if (table) {
    TORCH_CHECK(w.scalar_type() == at::kByte && factors, "few_rows: a table goes with uint8 codes and their scales");
    return fp6(x, w, *factors, *table);
  }
  check_rows(x, w.size(1));
  switch (w.scalar_type()) {
    case at::kBFloat16: return dense<uint16_t>(x, w, factors);
    case at::kFloat: return dense<float>(x, w, factors);
    default: TORCH_CHECK(false, "few_rows: weight dtype must be bfloat16 or float32 (or tiles), not ", w.scalar_type());
  }
}

// A weight's output features: [N, ...], or column tiles [N / 16, K / 32, bytes].
int64_t outputs(const at::Tensor& w) { return w.dim() == 3 ? w.size(0) * TILE : w.size(0); }

// The op: x float32, or bf16 (a bf16 model's: its values are taken as they are).
at::Tensor product_op(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& factors,
                      const std::optional<at::Tensor>& table) {
  return linear(x.scalar_type() == at::kBFloat16 ? x.to(at::kFloat) : x, w, factors, table);
}

}  // namespace
