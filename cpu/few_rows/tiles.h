// The product skeleton every weight format shares: passes of input rows over tiles of weight rows, on every core.
#pragma once

namespace {

constexpr int TILE = 16;  // output columns a column tile (columns.h)
constexpr int BLOCK = 32;  // inputs that share an activation scale d_b (columns.h)

// tile<R>(weight, x, ...): R input rows x [R, K] times weight rows n0 .. n1 - 1 into y [R, N], one overload per
// weight format (dense.h, fp6.h), every output the same arithmetic whatever R.
template <int R, class Weight>
void tile(const Weight& weight, const float* x, int64_t K, int64_t N, int64_t n0, int64_t n1, float* y);

// The most input rows a pass: on AVX-512 8, so that a verify of K = 7 (8 rows) reads the weights once (more were
// slower: their inputs outgrow L1); a format may take fewer (its registers).
template <class Weight>
struct RowsPerPass {
  static constexpr int value = W == 16 ? 8 : 7;
};

// tile<r> for r = R .. RowsPerPass: one instantiation per row count.
template <int R, class Weight, class X>
inline void tile_of(int r, const Weight& weight, const X* x, int64_t K, int64_t N, int64_t n0, int64_t n1, float* y) {
  if constexpr (R < RowsPerPass<Weight>::value) {
    if (r > R) return tile_of<R + 1>(r, weight, x, K, N, n0, n1, y);
  }
  tile<R>(weight, x, K, N, n0, n1, y);
}

// Weight rows n0 .. n1 - 1 times the M input rows, in the fewest passes of RowsPerPass rows at most, rows split
// evenly between passes.
template <class Weight, class X>
inline void rows(const Weight& weight, const X* x, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1, float* y) {
  constexpr int most = RowsPerPass<Weight>::value;
  const int64_t passes = (M + most - 1) / most;
  for (int64_t p = 0, m = 0, r; p < passes; p++, m += r) {
    r = (M - m) / (passes - p);
    tile_of<1>(int(r), weight, x + m * K, K, N, n0, n1, y + m * N);
  }
}

// x: [M, K], floats, or what tile() takes for this Weight.
template <class Weight, class X>
at::Tensor product(const Weight& weight, const X* xp, int64_t M, int64_t K, int64_t N) {
  at::Tensor y = at::empty({M, N}, at::TensorOptions().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  // ~64 KB of int8 weights per task: big enough to amortize scheduling, small enough to balance two cores. A call
  // per 16 weight rows: one row's pass is too short for the call around it, 16 rows' stay in cache for the next.
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / K), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; n += 16) rows(weight, xp, M, K, N, n, std::min(n + 16, end), yp);
  });
  return y;
}

// The memory's read bandwidth as the products see it: a buffer streamed as they stream weights (the same tasks over
// every core, 64-byte loads, the same prefetch), its words combined by xor, the cheapest use that keeps the loads.
// The bench's roofline (scripts/bench.py): a probe that reads another way measured less than the decode read.
int64_t stream_read(const at::Tensor& buffer) {
  typedef int32_t words __attribute__((vector_size(64)));
  TORCH_CHECK(buffer.is_contiguous() && buffer.numel() * buffer.element_size() % 4096 == 0,
              "few_rows: stream_read needs a contiguous buffer of whole 4 KiB pages");
  const char* bytes = reinterpret_cast<const char*>(buffer.data_ptr());
  const int64_t pages = buffer.numel() * buffer.element_size() / 4096;
  int32_t all = 0;
  std::mutex lock;
  at::parallel_for(0, pages, 16, [&](int64_t begin, int64_t end) {
    words acc[4] = {};
    for (const char* p = bytes + begin * 4096; p < bytes + end * 4096; p += 256) {
      __builtin_prefetch(p + PREFETCH_BYTES);
      __builtin_prefetch(p + PREFETCH_BYTES + 64);
      __builtin_prefetch(p + PREFETCH_BYTES + 128);
      __builtin_prefetch(p + PREFETCH_BYTES + 192);
      for (int i = 0; i < 4; i++) {
        words v;
        std::memcpy(&v, p + 64 * i, 64);
        acc[i] ^= v;
      }
    }
    int32_t word = 0;
    for (auto& a : acc)
      for (int j = 0; j < 16; j++) word ^= a[j];
    std::lock_guard<std::mutex> guard(lock);
    all ^= word;
  });
  return all;
}

void check_rows(const at::Tensor& x, int64_t K, bool bf16 = false) {  // bf16: the kernel takes bf16 rows too
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || (bf16 && x.scalar_type() == at::kBFloat16)) &&
                  x.is_contiguous() && x.size(1) == K,
              "few_rows: x must be float32 or bf16 [M, ", K, "]");
  TORCH_CHECK(K % L == 0, "few_rows: in_features ", K, " is not a multiple of ", L);
}

// log2 of the block length along k of `blocks` factors per row.
int64_t block_shift(int64_t K, int64_t blocks, const char* what) {
  TORCH_CHECK(blocks > 0 && K % blocks == 0, "few_rows: ", blocks, " ", what, " per row do not divide in_features ", K);
  const int64_t block = K / blocks;
  TORCH_CHECK(block % L == 0 && (block & (block - 1)) == 0, "few_rows: ", what, " of ", block,
              " elements; need a power of two >= ", L);
  return __builtin_ctzll(block);
}

}  // namespace
