// The CPU backend's kernels: every weight format's product for any number of rows (each row computed alike, whatever
// their number, so a verify's rows are a decode's), and model.py's ops rms_norm and attention, registered as their CPU
// kernels when the backend serves (serve). Built at first use for this CPU (cpu/kernels.py), as one translation unit
// of the headers in few_rows/:
//
//   lanes.h      16 floats as native vectors, conversions, the horizontal sum, exp, bf16 rounding
//   tiles.h      the product skeleton: passes of input rows over tiles of weight rows, on every core
//   amx.h        AMX tiles: the permission, a thread's configuration, the instructions and their plain-code emulation
//   dense.h      fp32 and bf16 weights by rows                columns.h  integer codes and bf16 in column tiles
//   fp6.h        MX 6-bit codes as packed, bf16 values         linear.h   the formats: their layouts, one product call
//   attention.h  query rows over the KV cache                  norm.h     RMSNorm of rows
//
// Why by hand: a step is bound by reading the weights, and every row must get the same arithmetic whatever the
// number of rows. Float weights: each tile converts one weight row to float once, in registers, and multiplies it into
// every input row; a row's sum runs in 16 lanes over k in order (bf16: a pair of elements a lane at a time), then in a
// fixed tree (sum_lanes). Integer codes: exact integer sums per block of 32, 16 output columns in the lanes of a vector
// (columns.h). GCC/Clang vector extensions, compiled with -march=native; the conversions, the pairs and the integer
// dot products use AVX-512 (BF16, VNNI, VBMI) or AVX2 intrinsics where present. Each routine with intrinsics has a
// scalar reference beside it (<routine>_reference: the same lanes, sums and trees in plain C++), which runs elsewhere
// and in the build with -DFEW_ROWS_PORTABLE that the tests compare with the build for this CPU bit for bit.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <optional>
#include <type_traits>
#include <vector>
#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "few_rows/lanes.h"
#include "few_rows/tiles.h"
#include "few_rows/amx.h"
#include "few_rows/dense.h"
#include "few_rows/columns.h"
#include "few_rows/fp6.h"
#include "few_rows/linear.h"
#include "few_rows/attention.h"
#include "few_rows/norm.h"

namespace {

// Hands an op back to its reference (the CompositeExplicitAutograd kernel model.py's custom_op registered): inputs a
// kernel does not take (another dtype, a head dim not a multiple of 16) run model.py's own code.
template <class Signature, class... Args>
at::Tensor reference(const char* name, const Args&... args) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
  return op.redispatch(c10::DispatchKeySet(c10::DispatchKey::CompositeExplicitAutograd), args...);
}

at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (rms_norm_takes(x, weight)) return rms_norm(x, weight, eps);
  return reference<decltype(rms_norm_op)>("fastdecode::rms_norm", x, weight, eps);
}

at::Tensor attention_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& visible,
                        double scale) {
  if (attention_takes(q, k, v, visible)) return attention(q, k, v, visible, scale);
  return reference<decltype(attention_op)>("fastdecode::attention", q, k, v, visible, scale);
}

// model.py's ops this library serves, by name, while serve(name, true) holds: the kernel at the CPU key, and a
// fallthrough at the CPU autograd key (no gradient is ever taken of a step: the custom op's autograd wrapper, Python,
// cost ~3.5 us a call).
std::map<std::string, std::vector<std::unique_ptr<torch::Library>>> served;

bool serve(const std::string& name, bool on) {
  if (!on) return served.erase(name) > 0;
  if (served.count(name)) return true;
  TORCH_CHECK(name == "rms_norm" || name == "attention", "few_rows: no kernel for fastdecode::", name);
  auto kernel = std::make_unique<torch::Library>(torch::Library::IMPL, "fastdecode", c10::DispatchKey::CPU, __FILE__,
                                                 __LINE__);
  if (name == "rms_norm") kernel->impl("rms_norm", &rms_norm_op);
  else kernel->impl("attention", &attention_op);
  auto autograd = std::make_unique<torch::Library>(torch::Library::IMPL, "fastdecode", c10::DispatchKey::AutogradCPU,
                                                   __FILE__, __LINE__);
  autograd->impl(name.c_str(), torch::CppFunction::makeFallthrough());
  served[name].push_back(std::move(kernel));
  served[name].push_back(std::move(autograd));
  return true;
}

}  // namespace

TORCH_LIBRARY(few_rows, m) {
  // No defaults: Inductor's C++ wrapper leaves out trailing arguments that equal their defaults, and the dispatcher
  // call it makes then reads past the ones it was given (torch 2.13: a segfault in the first step).
  m.def("layout(int format, Tensor weight, Tensor? factors, Tensor? values, int bits, int multiple, int wanted) -> "
        "(int, Tensor, Tensor?, Tensor?)", &layout);
  m.def("linear(Tensor x, int layout, Tensor weight, Tensor? factors, Tensor? table, Tensor? bias, int outputs) -> "
        "Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor visible, float scale) -> Tensor");
  m.def("serve(str op, bool on) -> bool", &serve);
  m.def("paths() -> str[]", &paths);
  m.def("amx(str mode) -> str", &amx);
  m.def("format_codes() -> int[]", [] { return std::vector<int64_t>{PLAIN, INT8, INT4, MX, INT4K}; });
  m.def("int4_codes(Tensor tiles) -> Tensor");
  m.def("stream_read(Tensor buffer) -> int");
}

TORCH_LIBRARY_IMPL(few_rows, CPU, m) {
  m.impl("linear", &linear);
  m.impl("rms_norm", &rms_norm);
  m.impl("attention", &attention);
  m.impl("int4_codes", &int4_codes);
  m.impl("stream_read", &stream_read);
}
