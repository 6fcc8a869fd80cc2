// Every weight format's product behind one call.
#pragma once

namespace {

// x [M, K] @ w.T; w [N, K] (bf16, fp32, int8 times factors), uint8 [N, K / 2] (int4 codes, see Int4Weight), or
// with a table, uint8 [N, K * 3 / 4] (MX 6-bit codes, factors their E8M0 scales).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& factors,
                  const std::optional<at::Tensor>& table) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "few_rows: weight must be contiguous [N, K]");
  if (table) {
    TORCH_CHECK(w.scalar_type() == at::kByte && factors, "few_rows: a table goes with uint8 codes and their scales");
    return fp6(x, w, *factors, *table);
  }
  if (w.scalar_type() == at::kByte) return int4(x, w, factors);
  check_rows(x, w.size(1));
  switch (w.scalar_type()) {
    case at::kBFloat16: return bf16(x, w, factors);
    case at::kFloat: return dense<float>(x, w, factors);
    case at::kChar: return dense<int8_t>(x, w, factors);
    default: TORCH_CHECK(false, "few_rows: weight dtype must be bfloat16, float32, int8 or uint8 (int4), not ", w.scalar_type());
  }
}

}  // namespace
