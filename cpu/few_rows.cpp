// Few-row products on CPU: y[m, n] = sum_k x[m, k] * w[n, k] for the rows of a decode, draft or verify step
// (1 to 33 tokens a row, any number of rows), with w stored as bf16, fp32 or int8 (times per-channel or per-block
// factors), as int4 nibbles (times a per-group scale plus offset, against activations rounded to 8 bits: see
// round_rows) or as packed MX 6-bit codes (a table of their values, times an E8M0 scale per block of 32: see
// Fp6Table); those rows' attention over the KV cache; and a whole step of a Llama-family model, every layer and the
// LM head, in one call (llama_step). Built at first use by the CPU backend (cpu/kernels.py).
//
// Why by hand: a step is bound by reading the weights, and every row must get the same arithmetic whatever the
// number of rows (a verify then computes the logits a decode would). Each tile converts one weight row to float
// once, in registers, and multiplies it into every input row; a row's sum runs in 16 lanes over k in order
// (bf16: a pair of elements a lane at a time, see Bf16Pairs), then halves in a fixed tree. GCC/Clang vector
// extensions, compiled with -march=native; the int8/bf16 -> float conversions, the bf16 pairs and the int4
// integer dot products use AVX-512 (BF16, VNNI) or AVX2 intrinsics where present, plain loops elsewhere.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <type_traits>
#include <vector>
#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

constexpr int L = 16;  // lanes of one accumulator

// 16 floats as native vectors: one with AVX-512, two elsewhere. (One 64-byte GCC vector went through memory
// on AVX2: 4-10x slower.) Lane j is part[j / W][j % W] either way, so the sums do not depend on W.
#if defined(__AVX512F__)
constexpr int W = 16;
#else
constexpr int W = 8;
#endif
typedef float native __attribute__((vector_size(4 * W)));
struct f32x16 {
  native part[L / W];
  f32x16& operator+=(const f32x16& b) {
    for (int h = 0; h < L / W; h++) part[h] += b.part[h];
    return *this;
  }
  f32x16 operator*(const f32x16& b) const {
    f32x16 r;
    for (int h = 0; h < L / W; h++) r.part[h] = part[h] * b.part[h];
    return r;
  }
  f32x16 operator*(float s) const {
    f32x16 r;
    for (int h = 0; h < L / W; h++) r.part[h] = part[h] * s;
    return r;
  }
  f32x16 operator+(float s) const {
    f32x16 r;
    for (int h = 0; h < L / W; h++) r.part[h] = part[h] + s;
    return r;
  }
};

// Software prefetch this far ahead of the weights being read: the tiles are short streams (rows of 576
// weights) that the hardware prefetcher alone leaves at ~14 GB/s on two cores; 8 KB ahead, ~21 (Zen 3). On
// the Zen 4 (AVX512_BF16), 2 KB: SmolLM2's bf16 products 8-15% faster at 2-5 rows, as fast at 1 (same
// process, three runs; 2 / 5 rows 11.95 / 13.25 -> 10.20 / 12.02 ms); int8, int4, mxfp6 unchanged. Other
// CPUs keep the distance measured on theirs.
#if defined(__AVX512BF16__)
constexpr int64_t PREFETCH_BYTES = 2048;
#else
constexpr int64_t PREFETCH_BYTES = 8192;
#endif

inline f32x16 load(const float* p) {
  f32x16 v;
  for (int h = 0; h < L / W; h++) std::memcpy(&v.part[h], p + h * W, sizeof(native));  // one load each
  return v;
}

// 16 weights to float. The generic vector conversions from 8- and 16-bit integers come out as scalar code
// (GCC 12), so the usual targets get intrinsics; anything else a plain loop.
inline f32x16 bf16_to_float(const uint16_t* p) {
  f32x16 v;
#if defined(__AVX512F__)
  v.part[0] = (native)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
#elif defined(__AVX2__)
  for (int h = 0; h < 2; h++)
    v.part[h] = (native)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + 8 * h))),
                                          16);
#else
  for (int j = 0; j < L; j++) {
    uint32_t bits = uint32_t(p[j]) << 16;
    std::memcpy(&v.part[j / W][j % W], &bits, 4);
  }
#endif
  return v;
}

inline f32x16 int8_to_float(const int8_t* p) {
  f32x16 v;
#if defined(__AVX512F__)
  v.part[0] = (native)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif defined(__AVX2__)
  for (int h = 0; h < 2; h++)
    v.part[h] = (native)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8 * h))));
#else
  for (int j = 0; j < L; j++) v.part[j / W][j % W] = p[j];
#endif
  return v;
}

inline f32x16 to_float(const float* p) { return load(p); }
inline f32x16 to_float(const uint16_t* p) { return bf16_to_float(p); }
inline f32x16 to_float(const int8_t* p) { return int8_to_float(p); }
inline f32x16 to_float(const c10::BFloat16* p) { return bf16_to_float(reinterpret_cast<const uint16_t*>(p)); }

// A weight matrix hands out rows; row(k) gives the 16 weights from k as floats. Codes of type T, times one
// factor per block of 2^shift along k (Blocks). One factor per row (Rows) multiplies the row's finished sums
// instead: a multiply per output, not per 16 weights (int8 products 5-10% faster).
enum Factors { None, Blocks, Rows };
template <class T, Factors F>
struct DenseWeight {
  const T* w;
  const float* factors;
  int64_t K, per_row, shift;
  struct Row {
    const T* w;
    const float* factors;
    int64_t shift;
    void prefetch(int64_t k) const { __builtin_prefetch(reinterpret_cast<const char*>(w + k) + PREFETCH_BYTES); }
    __attribute__((always_inline)) f32x16 operator()(int64_t k) const {
      f32x16 v = to_float(w + k);
      return F == Blocks ? v * factors[k >> shift] : v;
    }
    float finish(float sum) const { return F == Rows ? sum * factors[0] : sum; }
  };
  Row row(int64_t n) const { return {w + n * K, factors + n * per_row, shift}; }
};

// bf16 weights (without block factors) against the activations rounded to bf16, which a bf16 model's already
// are, multiplied in pairs: lane i of 16 adds the exact products of elements 2i + 1, then 2i, of each 32 along
// k, each with one rounding (a fused multiply-add). That is AVX512_BF16's vdpbf16ps, one instruction per 32
// weights and input row, where converting the weights and two FMAs took three (Zen 4 runs a 512-bit FMA as two
// halves): see tile(Bf16Pairs). Other CPUs get the same sums from the halves of each 32-bit pair, the high bf16
// being the word with its low half cleared and the low one the word shifted up 16. (The instruction also flushes
// denormal operands and results to zero; the two agree unless a weight, an input or a partial sum is below
// 1.2e-38 in magnitude.)
template <Factors F>  // None or Rows
struct Bf16Pairs {
  const uint32_t* w;  // [N, K / 2] pairs
  const float* factors;
  float finish(int64_t n, float sum) const { return F == Rows ? sum * factors[n] : sum; }
};

inline uint16_t round_to_bf16(float v) {  // nearest, ties to even; NaN stays NaN
  uint32_t b;
  std::memcpy(&b, &v, 4);
  if ((b & 0x7fffffff) > 0x7f800000) return uint16_t((b >> 16) | 0x40);
  return uint16_t((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}

inline float bf16_value(uint32_t bits16) {
  const uint32_t b = bits16 << 16;
  float v;
  std::memcpy(&v, &b, 4);
  return v;
}

// The input rows [M, K] as tile(Bf16Pairs) reads them: bf16 in order for vdpbf16ps; elsewhere floats, each 32
// along k stored as its 16 odd elements, then its 16 even ones (lane i: elements 2i + 1 and 2i).
// In a tensor, for its 64-byte alignment: with a vector's 16, every 64-byte load of x straddled two cache lines and
// 5-row products took ~1.5x as long (Zen 4).
#if defined(__AVX512BF16__)
typedef uint16_t PairInput;
constexpr auto kPairInput = at::kBFloat16;
#else
typedef float PairInput;
constexpr auto kPairInput = at::kFloat;
#endif
at::Tensor pair_inputs(const float* x, int64_t M, int64_t K) {
  at::Tensor buffer = at::empty({M * K}, at::TensorOptions().dtype(kPairInput));
  PairInput* out = reinterpret_cast<PairInput*>(buffer.data_ptr());
#if defined(__AVX512BF16__)  // nearest, ties to even, 32 at a time (denormals flushed to zero, as in vdpbf16ps)
  for (int64_t i = 0; i < M * K; i += 2 * L)
    _mm512_storeu_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + L), _mm512_loadu_ps(x + i)));
#else
  for (int64_t i = 0; i < M * K; i += 2 * L)
    for (int j = 0; j < L; j++) {
      out[i + j] = bf16_value(round_to_bf16(x[i + 2 * j + 1]));
      out[i + L + j] = bf16_value(round_to_bf16(x[i + 2 * j]));
    }
#endif
  return buffer;
}

#if !defined(__AVX512BF16__)
// The 16 high (odd) or low (even) bf16 of 16 pairs, as floats.
inline f32x16 pair_halves(const uint32_t* p, bool high) {
  f32x16 v;
#if defined(__AVX512F__)
  const __m512i words = _mm512_loadu_si512(p);
  v.part[0] = (native)(high ? _mm512_and_si512(words, _mm512_set1_epi32(int(0xffff0000))) : _mm512_slli_epi32(words, 16));
#elif defined(__AVX2__)
  for (int h = 0; h < 2; h++) {
    const __m256i words = _mm256_loadu_si256((const __m256i*)(p + 8 * h));
    v.part[h] = (native)(high ? _mm256_and_si256(words, _mm256_set1_epi32(int(0xffff0000))) : _mm256_slli_epi32(words, 16));
  }
#else
  for (int j = 0; j < L; j++) {
    uint32_t word;
    std::memcpy(&word, p + j, 4);
    v.part[j / W][j % W] = bf16_value(high ? word >> 16 : word & 0xffff);
  }
#endif
  return v;
}
#endif

// Inlined by force: as a call, the struct argument made GCC keep the accumulators on the stack during the
// whole tile loop, a store-to-load round trip in every FMA chain (AVX2 on Zen 3: 1-row int8 products 2x slower).
__attribute__((always_inline)) inline float sum_lanes(f32x16 v) {
#if defined(__AVX2__)
  // The tree below, kept in registers: through the stack it made 5-row products 18% slower (AVX2, Zen 3), and
  // 1-row ones 5-10% (AVX-512, Zen 4).
#if defined(__AVX512F__)
  const __m512 all = (__m512)v.part[0];
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(all), 1));
  const __m256 h8 = _mm256_add_ps(_mm512_castps512_ps256(all), high);
#else
  const __m256 h8 = _mm256_add_ps((__m256)v.part[0], (__m256)v.part[1]);
#endif
  const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
  const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
  const __m128 h1 = _mm_add_ss(h2, _mm_movehdup_ps(h2));
  return _mm_cvtss_f32(h1);
#else
  float t[L];
  for (int h = 0; h < L / W; h++) std::memcpy(t + h * W, &v.part[h], sizeof(native));
  for (int width = L / 2; width >= 1; width /= 2)
    for (int j = 0; j < width; j++) t[j] += t[j + width];
  return t[0];
#endif
}

// R input rows (up to RowsPerPass) times weight rows n0 .. n1 - 1, one pass over each row: it streams one row of weights at a time.
// Reading several weight rows side by side (a 4-row tile on AVX-512, 2 on AVX2) was slower on both AMD CPUs
// measured: SmolLM2's products, 4 weight rows side by side vs one at a time, same process, bit-identical (Zen 4,
// AVX-512, 2 threads), at 1 row: bf16 13.35 -> 7.73 ms, int8 7.52 -> 4.95; at 5 rows 15.87 -> 14.30 and 11.77 -> 10.43 (the
// Xeon that chose the 4-row tile is not at hand to re-measure). Zen 3 (AVX2): decode steps 26.4 -> 23.0 ms
// (bf16), 17.4 -> 14.6 (int8); 2 rows side by side, bf16 pairs on Zen 4: 1.3x slower at 2 and 5 rows.
// Two sums per row, of the even and the odd 16 weights of each 32, added at the end: one chain of FMAs waited on
// itself (4 cycles a link, 16 int8 weights each: ~4 bytes a cycle a core), which weights in huge pages
// (cpu.modules.move_to_huge_pages) outrun. SmolLM2's int8 products in huge pages, Zen 4, 2 threads, same process, nine
// alternating runs: at 1 / 2 / 5 rows 4.47 / 5.25 / 9.23 -> 4.25 / 4.92 / 9.07 ms. (With the weights in 4 KiB pages,
// memory was the limit, and a second sum no faster on Zen 4 or Zen 3.) Prefetching once per 64 bytes instead of
// per 16, or not at all, was slower (1 row 5.1 / 6.2 ms, 2 rows 5.1 / 9.4).
// Registers: 2R sums and two converted weight vectors, 16 lanes each: 16 of AVX-512's 32; AVX2 holds 16 lanes in
// two registers of its 16, so it takes at most 3 rows a pass (RowsPerPass).
// (Integer dot products, int8 weights times activations rounded to 8 bits, were no faster on Zen 3 and cost
// int8 +0.4% perplexity.)
// Not inlined: inlined into product's parallel loop, GCC kept the accumulators on the stack, a store and a load
// in every FMA chain (measured no slower on Zen 3, whose memory renaming hides that round trip; not every CPU
// has it). The explicit zeroing, unlike `= {}`, does not clear a stack copy with `rep stos` at every call.
template <int R, class Weight>
__attribute__((noinline)) void tile(const Weight& weight, const float* x, int64_t K, int64_t N, int64_t n0, int64_t n1,
                                    float* y) {
  for (int64_t n = n0; n < n1; n++) {
    f32x16 even[R], odd[R];
    for (int r = 0; r < R; r++)
      for (int h = 0; h < L / W; h++) even[r].part[h] = odd[r].part[h] = native{};
    const auto row = weight.row(n);
    int64_t k = 0;
    for (; k + 2 * L <= K; k += 2 * L) {
      const f32x16 w0 = row(k), w1 = row(k + L);
      row.prefetch(k);
      row.prefetch(k + L);
      for (int r = 0; r < R; r++) {
        even[r] += load(x + r * K + k) * w0;
        odd[r] += load(x + r * K + k + L) * w1;
      }
    }
    if (k < K) {  // K an odd multiple of 16
      const f32x16 w0 = row(k);
      for (int r = 0; r < R; r++) even[r] += load(x + r * K + k) * w0;
    }
    for (int r = 0; r < R; r++) y[r * N + n] = row.finish(sum_lanes(even[r] += odd[r]));
  }
}

// The most input rows a pass (registers: see tile above): on AVX-512 8, so that a verify of K = 7 (8 rows) reads the
// weights once. More rows a pass were slower: their inputs outgrow L1 (docs/performance.md, the rows of a forward).
template <class Weight>
struct RowsPerPass {
  static constexpr int value = W == 16 ? 8 : 7;
};
template <class T, Factors F>
struct RowsPerPass<DenseWeight<T, F>> {
  static constexpr int value = W == 16 ? 7 : 3;  // at 8 rows int8 products were 1.2x slower (Zen 4)
};

// The same for bf16 pairs (Bf16Pairs), x from pair_inputs: 32 weights a step. On Zen 4, against converting each
// weight to float, same process: a 5-row product over a 113 MB weight 11.0 -> 6.4 ms on one thread (1 row: 6.6 ->
// 6.5, bound by memory); SmolLM2's 121 bf16 products on 2 threads at 1 / 2 / 5 rows 10.6 / 14.0 / 15.6 -> 9.8 /
// 11.1 / 14.0 ms (with the 16 weight rows a call of product()).
// At 2 rows and more, a second prefetch, into L2 and 16 KB ahead (AVX512_BF16 only, where measured): with the
// weights in huge pages the 2-row products were as slow as the 5-row ones, the stream waiting on memory and on the
// multiply-adds in turn. SmolLM2's 121 bf16 products (Zen 4, 2 threads, same process, five alternating runs) at
// 2 / 5 rows 10.94 / 11.13 -> 9.67 / 9.23 ms; at 1 row it cost ~5% (8.76 -> 9.20, at 8 or 16 KB), so 1 row has
// none. int8 tiles gained nothing from it (5 rows 8.68 -> 8.98 ms): they wait on converting the codes.
template <int R, Factors F>
__attribute__((noinline)) void tile(const Bf16Pairs<F>& weight, const PairInput* x, int64_t K, int64_t N, int64_t n0,
                                    int64_t n1, float* y) {
  for (int64_t n = n0; n < n1; n++) {
    f32x16 acc[R];
    for (int r = 0; r < R; r++)
      for (int h = 0; h < L / W; h++) acc[r].part[h] = native{};
    const uint32_t* pairs = weight.w + n * (K / 2);
    for (int64_t k = 0; k < K; k += 2 * L) {
      const uint32_t* p = pairs + k / 2;
      __builtin_prefetch(reinterpret_cast<const char*>(p) + PREFETCH_BYTES);
#if defined(__AVX512BF16__)
      if (R >= 2) __builtin_prefetch(reinterpret_cast<const char*>(p) + 16384, 0, 2);  // to L2: see above
      const __m512bh w = (__m512bh)_mm512_loadu_si512(p);
      for (int r = 0; r < R; r++)
        acc[r].part[0] = (native)_mm512_dpbf16_ps((__m512)acc[r].part[0], w, (__m512bh)_mm512_loadu_si512(x + r * K + k));
#else
      const f32x16 high = pair_halves(p, true), low = pair_halves(p, false);
      for (int r = 0; r < R; r++) {
        acc[r] += load(x + r * K + k) * high;
        acc[r] += load(x + r * K + k + L) * low;
      }
#endif
    }
    for (int r = 0; r < R; r++) y[r * N + n] = weight.finish(n, sum_lanes(acc[r]));
  }
}

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
  // ~64 KB of int8 weights per task: big enough to amortize scheduling, small enough to balance two cores.
  // A call per 16 weight rows: a 5-row pass over one weight row is short enough that the call around it cost
  // ~1/3 (bf16 pairs, Zen 4); a pass over 16 rows of weights leaves them in cache for the next pass.
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / K), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; n += 16) rows(weight, xp, M, K, N, n, std::min(n + 16, end), yp);
  });
  return y;
}

void check_rows(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == K,
              "few_rows: x must be contiguous float32 [M, ", K, "]");
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

// int4 products take 8-bit activations, as llama.cpp's 4-bit formats do: a block of 32 codes times 32 rounded
// activations is then an exact integer dot product (vpdpbusd with AVX512_VNNI, else vpmaddubsw and vpmaddwd), one
// or two instructions per 32 multiplies where converting the codes to float took one per 8 (SmolLM2's 211
// products: 8.6 vs 11.3 ms at one row, Zen 3).
// Each input row is rounded per block b of 32 along k to q * d_b, d_b = max|x| / 127, q = round(x / d_b)
// (quantize.round_activations, the same formula for quantize.py's reference forward). With the weights
// w = code * scale + offset per group g: y = sum_b scale_g d_b dot_b + sum_g offset_g sum_(b in g) d_b sum(q_b).
struct RoundedRows {
  std::vector<int8_t> q;          // [M, K]
  std::vector<float> d;           // [M, K / 32]
  std::vector<float> group_sums;  // [M, K / group]: sum over the group's blocks of d_b * sum(q_b)
};

RoundedRows round_rows(const float* x, int64_t M, int64_t K, int64_t shift) {
  const int64_t blocks = K / 32, per_group = (int64_t(1) << shift) / 32;
  RoundedRows r{std::vector<int8_t>(M * K), std::vector<float>(M * blocks), std::vector<float>(M * (K >> shift))};
  for (int64_t b = 0; b < M * blocks; b++) {
    const float* xb = x + b * 32;
    float amax = 0.f;
    for (int j = 0; j < 32; j++) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127;
    int sum = 0;
    for (int j = 0; j < 32; j++) {
      const float q = d > 0 ? std::nearbyint(xb[j] / d) : 0.f;  // ties to even, as torch.round
      const int8_t code = std::isfinite(q) ? int8_t(q) : 0;
      r.q[b * 32 + j] = code;
      sum += code;
    }
    r.d[b] = d;
    float& group_sum = r.group_sums[b / per_group];  // blocks of a group in order
    group_sum = std::fma(d, float(sum), group_sum);
  }
  return r;
}

// Int4Linear's runtime layout (cpu.modules.int4_layout): each 64 codes of a row in 32 bytes, byte j holding code j
// in its low nibble and code 32 + j in its high one, so one mask and one shift of a 32-byte load give two blocks
// of 32 codes in order; where K ends in a lone block, its 16 bytes hold code j low and code 16 + j high. Code i
// of a row, for the plain code below:
inline int int4_code(const uint8_t* row, int64_t K, int64_t i) {
  const int64_t chunk = i / 64 * 64, span = std::min<int64_t>(64, K - chunk), j = i - chunk;
  const uint8_t byte = row[chunk / 2 + j % (span / 2)];
  return j < span / 2 ? byte & 15 : byte >> 4;
}

// C weight rows n0.. times R rounded rows m0..: one 8-lane float sum per output over the blocks in order (lane l of
// a block: the integer dot product of its codes 4l .. 4l + 3), then a fixed tree, plus the offsets' sum, which runs
// group by group in its own scalar chain alongside the blocks; every output the same arithmetic whatever R and C.
// (Added after the tree, the offsets were a chain of G dependent multiply-adds per output that nothing overlapped:
// Zen 1 class EPYC, 2 threads, a 49152 x 576 int4 product at 1 row 2.33 -> 1.85 ms, at 5 rows 8.56 -> 7.37.)
// Two blocks a step from one 32-byte load (a mask and a shift per 32 codes), where one block a step from 16 bytes
// took a shift, an insert and a mask, and an activation order to match: SmolLM2 int4 steps on Zen 4 (one call,
// both layouts in one process, three runs of 30-40 alternating blocks) 4.68-5.05 -> 4.34-4.78 ms at 1 row,
// 14.3-15.7 -> 11.9-14.3 at 5 (vpdpbusd included; a broadcast load and a multiply for each block's scale instead
// of a scalar product and a broadcast: 11% slower at 5 rows).
template <int R, int C>
__attribute__((noinline)) void tile_int4(const uint8_t* nibbles, const float* groups, const RoundedRows& a,
                                         int64_t K, int64_t N, int64_t shift, int64_t m0, int64_t n0, float* y) {
  const int64_t G = K >> shift;
  const uint8_t* w[C];
  const float* g[C];
  for (int c = 0; c < C; c++) w[c] = nibbles + (n0 + c) * (K / 2), g[c] = groups + 2 * (n0 + c) * G;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256i low = _mm256_set1_epi8(15);
  __m256 acc[R][C];
  float offsets[R][C];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps(), offsets[r][c] = 0.f;
  // At a group's first block, its term of every output's offset sum. std::fma, as in round_rows: left to the
  // compiler, a multiply-add was fused in one build and not in the other (AVX2 vs Zen 4's AVX-512 build: outputs
  // 1 ulp apart).
  const auto add_offsets = [&](int64_t k) {
    if (k & ((int64_t(1) << shift) - 1)) return;
    const int64_t group = k >> shift;
    for (int r = 0; r < R; r++)
      for (int c = 0; c < C; c++)
        offsets[r][c] = std::fma(g[c][2 * group + 1], a.group_sums[(m0 + r) * G + group], offsets[r][c]);
  };
  // Block k (32 codes in order) of weight row c times each row's block, into the rows' sums.
  const auto add_block = [&](const __m256i* codes, int64_t k) {
    const int64_t b = k >> 5, group = k >> shift;
    add_offsets(k);
    for (int r = 0; r < R; r++) {
      const __m256i xq = _mm256_loadu_si256((const __m256i*)(a.q.data() + (m0 + r) * K + k));
      const float d = a.d[(m0 + r) * (K / 32) + b];
      for (int c = 0; c < C; c++) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), codes[c], xq);
#else
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(codes[c], xq), _mm256_set1_epi16(1));
#endif
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(g[c][2 * group] * d), acc[r][c]);
      }
    }
  };
#if defined(__znver1__)
  // One row on a Zen 1 class core (256-bit AVX2 run as two 128-bit halves; -march=native defines __znver1__)
  // in 128-bit halves: the same lanes, sums and tree, so the same bits, without the 256-bit broadcast of each
  // block's scale that costs two operations there. In the earlier layout (an insert per 32 codes too), a 49152 x
  // 576 product at 1 row 1.85 -> 1.64-1.73 ms (2 threads), int4 decode 0.93-1.00x -> 1.05-1.09x llama.cpp's
  // Q4_1; at 2 rows the halves were slower (3.00 -> 3.32 ms).
  if constexpr (R == 1) {
    const __m128i ones = _mm_set1_epi16(1), low4 = _mm_set1_epi8(15);
    __m128 lo_acc[C], hi_acc[C];  // lanes 0-3 and 4-7 of acc[0][c]
    for (int c = 0; c < C; c++) lo_acc[c] = hi_acc[c] = _mm_setzero_ps();
    const int8_t* q = a.q.data() + m0 * K;
    const float* d = a.d.data() + m0 * (K / 32);
    const auto add_halves = [&](const __m128i* lo, const __m128i* hi, int64_t k) {  // codes 0-15, 16-31
      add_offsets(k);
      const __m128i xlo = _mm_loadu_si128((const __m128i*)(q + k));
      const __m128i xhi = _mm_loadu_si128((const __m128i*)(q + k + 16));
      for (int c = 0; c < C; c++) {
        const __m128 scale = _mm_set1_ps(g[c][2 * (k >> shift)] * d[k >> 5]);
        const __m128i dot_lo = _mm_madd_epi16(_mm_maddubs_epi16(lo[c], xlo), ones);
        const __m128i dot_hi = _mm_madd_epi16(_mm_maddubs_epi16(hi[c], xhi), ones);
        lo_acc[c] = _mm_fmadd_ps(_mm_cvtepi32_ps(dot_lo), scale, lo_acc[c]);
        hi_acc[c] = _mm_fmadd_ps(_mm_cvtepi32_ps(dot_hi), scale, hi_acc[c]);
      }
    };
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
      __m128i lo[C], hi[C], lo2[C], hi2[C];
      for (int c = 0; c < C; c++) {
        const __m128i p0 = _mm_loadu_si128((const __m128i*)(w[c] + k / 2));
        const __m128i p1 = _mm_loadu_si128((const __m128i*)(w[c] + k / 2 + 16));
        lo[c] = _mm_and_si128(p0, low4), hi[c] = _mm_and_si128(p1, low4);
        lo2[c] = _mm_and_si128(_mm_srli_epi16(p0, 4), low4), hi2[c] = _mm_and_si128(_mm_srli_epi16(p1, 4), low4);
        __builtin_prefetch(w[c] + k / 2 + PREFETCH_BYTES);
      }
      add_halves(lo, hi, k);
      add_halves(lo2, hi2, k + 32);
    }
    if (k < K) {
      __m128i lo[C], hi[C];
      for (int c = 0; c < C; c++) {
        const __m128i p = _mm_loadu_si128((const __m128i*)(w[c] + k / 2));
        lo[c] = _mm_and_si128(p, low4), hi[c] = _mm_and_si128(_mm_srli_epi16(p, 4), low4);
      }
      add_halves(lo, hi, k);
    }
    for (int c = 0; c < C; c++) acc[0][c] = _mm256_set_m128(hi_acc[c], lo_acc[c]);
  } else
#endif
  {
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
      __m256i first[C], second[C];
      for (int c = 0; c < C; c++) {
        const __m256i packed = _mm256_loadu_si256((const __m256i*)(w[c] + k / 2));
        first[c] = _mm256_and_si256(packed, low);
        second[c] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
        __builtin_prefetch(w[c] + k / 2 + PREFETCH_BYTES);
      }
      add_block(first, k);
      add_block(second, k + 32);
    }
    if (k < K) {  // a lone last block
      __m256i codes[C];
      for (int c = 0; c < C; c++) {
        const __m128i packed = _mm_loadu_si128((const __m128i*)(w[c] + k / 2));
        codes[c] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low);
      }
      add_block(codes, k);
    }
  }
#endif
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) {
#if defined(__AVX2__) && defined(__FMA__)
      // The 8 lanes in a fixed tree (lanes j + 4, j + 2, j + 1), the same instructions in an AVX-512 build.
      const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(acc[r][c]), _mm256_extractf128_ps(acc[r][c], 1));
      const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
      const float sum = _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
      const float offset = offsets[r][c];
#else
      float sum = 0.f, offset = 0.f;
      for (int64_t group = 0; group < G; group++)
        offset = std::fma(g[c][2 * group + 1], a.group_sums[(m0 + r) * G + group], offset);
      for (int64_t k = 0; k < K; k += 32) {
        int dot = 0;
        for (int j = 0; j < 32; j++) dot += int4_code(w[c], K, k + j) * a.q[(m0 + r) * K + k + j];
        sum += float(dot) * (g[c][2 * (k >> shift)] * a.d[(m0 + r) * (K / 32) + k / 32]);
      }
#endif
      y[(m0 + r) * N + n0 + c] = sum + offset;
    }
}

template <int C>
void rows_int4(const uint8_t* nibbles, const float* groups, const RoundedRows& a, int64_t M, int64_t K, int64_t N,
               int64_t shift, int64_t n0, float* y) {
  for (int64_t m = 0; m < M; m += 4) {
    switch (M - m < 4 ? M - m : 4) {
      case 1: tile_int4<1, C>(nibbles, groups, a, K, N, shift, m, n0, y); break;
      case 2: tile_int4<2, C>(nibbles, groups, a, K, N, shift, m, n0, y); break;
      case 3: tile_int4<3, C>(nibbles, groups, a, K, N, shift, m, n0, y); break;
      default: tile_int4<4, C>(nibbles, groups, a, K, N, shift, m, n0, y); break;
    }
  }
}

at::Tensor int4(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& groups) {
  const int64_t N = w.size(0), K = 2 * w.size(1);
  check_rows(x, K);
  TORCH_CHECK(groups && groups->scalar_type() == at::kFloat && groups->is_contiguous() && groups->dim() == 3 &&
                  groups->size(0) == N && groups->size(2) == 2,
              "few_rows: int4 codes need float32 [N, K / group, 2] (scale, offset) factors");
  const int64_t shift = block_shift(K, groups->size(1), "int4 groups");
  TORCH_CHECK(shift >= 5, "few_rows: int4 groups must hold at least 32 elements");
  const int64_t M = x.size(0);
  const RoundedRows a = round_rows(x.data_ptr<float>(), M, K, shift);
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* nibbles = w.data_ptr<uint8_t>();
  const float* factors = groups->data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t pairs = N / 2;
  at::parallel_for(0, pairs + N % 2, std::max<int64_t>(1, 65536 / K), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {
      if (t < pairs) rows_int4<2>(nibbles, factors, a, M, K, N, shift, 2 * t, yp);
      else rows_int4<1>(nibbles, factors, a, M, K, N, shift, N - 1, yp);
    }
  });
  return y;
}

template <class T>
at::Tensor dense(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& factors) {
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  const T* codes = reinterpret_cast<const T*>(w.data_ptr());
  const float* xp = x.data_ptr<float>();
  if (!factors) return product(DenseWeight<T, None>{codes, nullptr, K, 0, 0}, xp, M, K, N);
  TORCH_CHECK(factors->scalar_type() == at::kFloat && factors->is_contiguous() && factors->size(0) == N,
              "few_rows: factors must be contiguous float32 [N] or [N, K / block]");
  const int64_t per_row = factors->numel() / N;
  if (per_row == 1) return product(DenseWeight<T, Rows>{codes, factors->data_ptr<float>(), K, 1, 0}, xp, M, K, N);
  return product(DenseWeight<T, Blocks>{codes, factors->data_ptr<float>(), K, per_row,
                                        block_shift(K, per_row, "factors")}, xp, M, K, N);
}

// bf16 weights: in pairs (Bf16Pairs) when no block factor scales them and K is a multiple of 32.
at::Tensor bf16(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& factors) {
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  if (K % (2 * L) || (factors && factors->numel() != N)) return dense<uint16_t>(x, w, factors);
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(w.data_ptr());
  const at::Tensor inputs = pair_inputs(x.data_ptr<float>(), M, K);
  const PairInput* xp = reinterpret_cast<const PairInput*>(inputs.data_ptr());
  if (!factors) return product(Bf16Pairs<None>{pairs, nullptr}, xp, M, K, N);
  TORCH_CHECK(factors->scalar_type() == at::kFloat && factors->is_contiguous() && factors->size(0) == N,
              "few_rows: factors must be contiguous float32 [N] or [N, K / block]");
  return product(Bf16Pairs<Rows>{pairs, factors->data_ptr<float>()}, xp, M, K, N);
}

// MX 6-bit elements (E2M3, E3M2) read as the file packs them: 4 codes in 3 bytes, little-endian (code j of 8 at
// bits 6j of 6 bytes), with one E8M0 scale byte per block of 32. A block's 32 codes become bf16 values through a
// 64-entry table (exact: 2 or 3 mantissa bits) and multiply the inputs rounded to bf16 in pairs, as bf16 weights
// do (Bf16Pairs), into 16 lane sums of their own; the block's scale (a power of two) then multiplies them into the
// row's 16 lanes (a fused multiply-add), block after block. Against the codes expanded to int8 at load (8 bits +
// a float factor per 32 read per weight, not 6.25), SmolLM2's 121 mxfp6 products (Zen 4, 2 threads, same process)
// took 4.37 instead of 4.95-5.01 ms at 1 row (bf16: 7.35-7.40), 5.9 instead of 5.6 at 2 rows, 10.2 instead of 9.9
// at 5. With AVX512_VBMI and AVX512_BF16 (a byte permute and a bit-field select unpack 64 codes, a 64-word permute
// looks them up); elsewhere plain code with the same sums, slow: there cpu.modules.MXLinear expands the codes at load
// instead (packed_fp6_is_fast). (A mask and a branch per step for the odd last block cost 8% at 1 row.)
#if defined(__AVX512VBMI__) && defined(__AVX512BF16__)
constexpr bool kFastFp6 = true;
#else
constexpr bool kFastFp6 = false;
#endif

struct Fp6Table {
  const uint8_t* codes;   // [N, K * 3 / 4]
  const uint8_t* scales;  // [N, K / 32], E8M0
  const uint16_t* table;  // [64] bf16 values of the codes
  const float* scale_values = e8m0_values();

  static const float* e8m0_values() {  // 2^(e - 127); 255: NaN
    static const std::vector<float> values = [] {
      std::vector<float> v(256);
      for (int e = 0; e < 255; e++) v[e] = std::ldexp(1.f, e - 127);
      v[255] = NAN;
      return v;
    }();
    return values.data();
  }
};

#if defined(__AVX512VBMI__) && defined(__AVX512BF16__)
// 32 or 64 codes from 24 or 48 packed bytes at p (bytes past them are not read) as bf16 values, 32 to a vector.
inline void unpack_fp6(const uint8_t* p, __mmask64 bytes, __m512i table_low, __m512i table_high, __m512i& w0, __m512i& w1) {
  // Bytes 6q .. 6q + 5 to qword q, then byte j of each qword from its bits 6j .. 6j + 7: code j, with two bits of
  // the next above it, which the 64-word permute ignores (it reads 6 bits of each index).
  const __m512i spread = _mm512_set_epi8(
      0, 0, 47, 46, 45, 44, 43, 42, 0, 0, 41, 40, 39, 38, 37, 36, 0, 0, 35, 34, 33, 32, 31, 30, 0, 0, 29, 28, 27, 26,
      25, 24, 0, 0, 23, 22, 21, 20, 19, 18, 0, 0, 17, 16, 15, 14, 13, 12, 0, 0, 11, 10, 9, 8, 7, 6, 0, 0, 5, 4, 3, 2,
      1, 0);
  const __m512i fields = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x2a241e18120c0600LL),
                                                      _mm512_permutexvar_epi8(spread, _mm512_maskz_loadu_epi8(bytes, p)));
  w0 = _mm512_permutex2var_epi16(table_low, _mm512_cvtepu8_epi16(_mm512_castsi512_si256(fields)), table_high);
  w1 = _mm512_permutex2var_epi16(table_low, _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(fields, 1)), table_high);
}
#endif

// The 16 lane sums of one block's products, values [32] (bf16) times x (pair_inputs): lane i adds the products of
// elements 2i + 1, then 2i, as vdpbf16ps does.
inline f32x16 block_pairs(const uint16_t* values, const PairInput* x) {
  f32x16 t;
#if defined(__AVX512BF16__)
  t.part[0] = (native)_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(values),
                                       (__m512bh)_mm512_loadu_si512(x));
#else
  f32x16 high, low;
  for (int j = 0; j < L; j++) {
    high.part[j / W][j % W] = bf16_value(values[2 * j + 1]);
    low.part[j / W][j % W] = bf16_value(values[2 * j]);
  }
  t = load(x) * high;
  t += load(x + L) * low;  // exact products: fused into a multiply-add or not, one rounding
#endif
  return t;
}

template <int R>
__attribute__((noinline)) void tile(const Fp6Table& weight, const PairInput* x, int64_t K, int64_t N, int64_t n0,
                                    int64_t n1, float* y) {
#if defined(__AVX512VBMI__) && defined(__AVX512BF16__)
  const __m512i table_low = _mm512_loadu_si512(weight.table), table_high = _mm512_loadu_si512(weight.table + 32);
#endif
  for (int64_t n = n0; n < n1; n++) {
    f32x16 acc[R];
    for (int r = 0; r < R; r++)
      for (int h = 0; h < L / W; h++) acc[r].part[h] = native{};
    const uint8_t* row = weight.codes + n * (K / 4 * 3);
    const uint8_t* scales = weight.scales + n * (K / 32);
    // Each block's lane sums times its scale, a power of two: exact, so fused into a multiply-add or not, the sum
    // is rounded once. Two blocks a step; a last odd one alone.
#if defined(__AVX512VBMI__) && defined(__AVX512BF16__)
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
      const uint8_t* p = row + k / 4 * 3;
      __builtin_prefetch(p + PREFETCH_BYTES);
      __m512i w0, w1;
      unpack_fp6(p, 0xffffffffffffULL, table_low, table_high, w0, w1);
      const __m512 s0 = _mm512_set1_ps(weight.scale_values[scales[k / 32]]);
      const __m512 s1 = _mm512_set1_ps(weight.scale_values[scales[k / 32 + 1]]);
      for (int r = 0; r < R; r++) {
        const PairInput* xr = x + r * K + k;
        __m512 a = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)w0, (__m512bh)_mm512_loadu_si512(xr)),
                                   s0, (__m512)acc[r].part[0]);
        a = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)w1, (__m512bh)_mm512_loadu_si512(xr + 32)),
                            s1, a);
        acc[r].part[0] = (native)a;
      }
    }
    if (k < K) {
      __m512i w0, w1;
      unpack_fp6(row + k / 4 * 3, 0xffffffULL, table_low, table_high, w0, w1);
      const __m512 s0 = _mm512_set1_ps(weight.scale_values[scales[k / 32]]);
      for (int r = 0; r < R; r++)
        acc[r].part[0] = (native)_mm512_fmadd_ps(
            _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)w0, (__m512bh)_mm512_loadu_si512(x + r * K + k)), s0,
            (__m512)acc[r].part[0]);
    }
#else
    for (int64_t k = 0; k < K; k += 64) {
      const uint8_t* p = row + k / 4 * 3;
      const int blocks = K - k >= 64 ? 2 : 1;
      uint16_t values[64];
      for (int j = 0; j < 32 * blocks; j += 4) {
        const uint32_t word = p[j / 4 * 3] | p[j / 4 * 3 + 1] << 8 | p[j / 4 * 3 + 2] << 16;
        for (int i = 0; i < 4; i++) values[j + i] = weight.table[(word >> (6 * i)) & 63];
      }
      for (int b = 0; b < blocks; b++) {
        const float s = weight.scale_values[scales[k / 32 + b]];
        for (int r = 0; r < R; r++) {
          const f32x16 t = block_pairs(values + 32 * b, x + r * K + k + 32 * b);
          for (int h = 0; h < L / W; h++) acc[r].part[h] = t.part[h] * s + acc[r].part[h];
        }
      }
    }
#endif
    for (int r = 0; r < R; r++) y[r * N + n] = sum_lanes(acc[r]);
  }
}

at::Tensor fp6(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, const at::Tensor& table) {
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  check_rows(x, K);
  TORCH_CHECK(K % 32 == 0 && w.size(1) * 4 == K * 3, "few_rows: 6-bit codes of ", K, " inputs take ", K / 4 * 3,
              " bytes per row (and inputs a multiple of 32), not ", w.size(1));
  TORCH_CHECK(scales.scalar_type() == at::kByte && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == N && scales.size(1) == K / 32,
              "few_rows: 6-bit codes need uint8 E8M0 scales [N, K / 32]");
  TORCH_CHECK(table.scalar_type() == at::kBFloat16 && table.is_contiguous() && table.numel() == 64,
              "few_rows: 6-bit codes need their 64 values as bfloat16");
  const Fp6Table weight{w.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(),
                        reinterpret_cast<const uint16_t*>(table.data_ptr())};
  const at::Tensor inputs = pair_inputs(x.data_ptr<float>(), M, K);
  return product(weight, reinterpret_cast<const PairInput*>(inputs.data_ptr()), M, K, N);
}

// x [M, K] @ w.T; w [N, K] (bf16, fp32, int8 times factors), uint8 [N, K / 2] (int4 codes, see tile_int4), or
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

// Attention of a few query rows over the KV cache, each row on its own (the same arithmetic whatever the number
// of rows, as for the products). q [B, H, R, D]: the R = G * T query rows of KV head h, row i being token i % T
// at position positions[b, i % T]; k, v [B, H, L, D], the cache; a row attends slots 0..its position (later
// slots hold padding or rejected drafts). In float: a score is a dot product in two 8-lane chains (even and odd
// 8-element chunks of D) summed in a fixed tree (sum4x8); the softmax's exp is exp8; the weighted sum of values
// runs over slots in order. The G rows of a token (its query heads) go together, sharing each load of a key or a
// value, which is converted to float in registers as it is read: against converting a head's cache to a float copy
// once and running row by row, SmolLM2's attention (3 KV heads x 3 query heads, 190 slots, 2 threads, Zen 4)
// took 8.4 instead of 14.0 us per layer in a decode step, 22 instead of 42 in a 5-token verify, and 28 instead of
// 62 at 1000 slots, bit-identical (the copy was written for every call, and past ~500 slots spilled out of L2).
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

inline f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The lane sums of a[0..3], each ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)): the tree of AVX's hadd.
inline void sum4x8(const f32x8* a, float* out) {
#if defined(__AVX__)
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps((__m256)a[0], (__m256)a[1]),
                                  _mm256_hadd_ps((__m256)a[2], (__m256)a[3]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
#else
  for (int j = 0; j < 4; j++)
    out[j] = ((a[j][0] + a[j][1]) + (a[j][2] + a[j][3])) + ((a[j][4] + a[j][5]) + (a[j][6] + a[j][7]));
#endif
}

// e^x for x <= 88 (a score minus its row's largest; silu's e^-g): 2^n times a degree-6 polynomial of the remainder
// (Cephes' expf coefficients; relative error at most 8.6e-8, checked at every float from -87 to -1e-30 and from 0
// to 88); 0 below -87, where e^x leaves the normal floats.
inline f32x8 exp8(f32x8 x) {
  const f32x8 n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // x / ln 2 rounded to an integer
  const f32x8 r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  f32x8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = (p * r) * r + r + 1.f;
  const i32x8 exponent = (__builtin_convertvector(n, i32x8) + 127) << 23;
  f32x8 two_n;
  std::memcpy(&two_n, &exponent, sizeof two_n);
  return x < -87.f ? f32x8{} : p * two_n;
}

// 8 keys or values as floats, straight from the cache.
inline f32x8 load8(const c10::BFloat16* p) {
#if defined(__AVX2__)
  return (f32x8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
#else
  f32x8 v;
  for (int j = 0; j < 8; j++) v[j] = float(p[j]);
  return v;
#endif
}

// The scores of RB query rows (float [RB][D]) over slots s0 .. s0 + 3 of keys [4][D]: per row and slot a dot
// product in two 8-lane chains (even and odd 8-element chunks of D) summed in a fixed tree (sum4x8).
template <int RB, class T>
inline void scores4(const T* keys, const float* queries, int64_t D, float* scores, int64_t stride) {
  f32x8 even[RB][4], odd[RB][4];
  for (int r = 0; r < RB; r++)
    for (int j = 0; j < 4; j++) even[r][j] = odd[r][j] = f32x8{};
  for (int64_t d = 0; d < D; d += 16)
    for (int j = 0; j < 4; j++) {
      const f32x8 k_even = load8(keys + j * D + d), k_odd = load8(keys + j * D + d + 8);
      for (int r = 0; r < RB; r++) {
        even[r][j] += k_even * load8(&queries[r * D + d]);
        odd[r][j] += k_odd * load8(&queries[r * D + d + 8]);
      }
    }
  for (int r = 0; r < RB; r++) {
    for (int j = 0; j < 4; j++) even[r][j] += odd[r][j];
    sum4x8(even[r], scores + r * stride);
  }
}

// Scores of RB rows of one token (they share each key load) over slots 0 .. last, 4 at a time: past last they
// are masked later; past the cache's end a zero-padded copy stands in.
template <int RB, class T>
void scores_rows(const T* keys, int64_t cache, const float* queries, int64_t last, int64_t D, float* scores,
                 int64_t stride) {
  int64_t s0 = 0;
  for (; s0 <= last && s0 + 4 <= cache; s0 += 4) scores4<RB>(keys + s0 * D, queries, D, scores + s0, stride);
  if (s0 <= last) {
    std::vector<T> tail(4 * D, T(0.f));
    std::copy(keys + s0 * D, keys + cache * D, tail.begin());
    scores4<RB>(tail.data(), queries, D, scores + s0, stride);
  }
}

// out[r][0 .. 8 NC) = (sum over slots s < n, in order, of weights[r][s] * values[s D + 0 .. 8 NC)) / total[r], for
// RB rows sharing each load of values.
template <int NC, int RB, class T>
void weighted_sum(const T* values, const float* weights, int64_t stride, int64_t n, int64_t D, const float* total,
                  float* out) {
  f32x8 acc[RB][NC];
  for (int r = 0; r < RB; r++)
    for (int c = 0; c < NC; c++) acc[r][c] = f32x8{};
  for (int64_t s = 0; s < n; s++)
    for (int c = 0; c < NC; c++) {
      const f32x8 value = load8(values + s * D + 8 * c);
      for (int r = 0; r < RB; r++) acc[r][c] += value * weights[r * stride + s];
    }
  for (int r = 0; r < RB; r++)
    for (int c = 0; c < NC; c++) {
      const f32x8 v = acc[r][c] / total[r];
      std::memcpy(out + r * D + 8 * c, &v, sizeof v);
    }
}

template <int RB, class T>
void weighted_sums(const T* values, const float* weights, int64_t stride, int64_t n, int64_t D, const float* total,
                   float* out) {
  for (int64_t d = 0; d < D; d += 64) {
    switch (std::min<int64_t>(D - d, 64) / 8) {  // D is a multiple of 16
      case 8: weighted_sum<8, RB>(values + d, weights, stride, n, D, total, out + d); break;
      case 6: weighted_sum<6, RB>(values + d, weights, stride, n, D, total, out + d); break;
      case 4: weighted_sum<4, RB>(values + d, weights, stride, n, D, total, out + d); break;
      default: weighted_sum<2, RB>(values + d, weights, stride, n, D, total, out + d); break;
    }
  }
}

// Rows of one token at a time, up to 3 together (AVX-512 has the registers; AVX2's 16 hold one row's chains).
#if defined(__AVX512F__)
constexpr int ROW_BLOCK = 3;
#else
constexpr int ROW_BLOCK = 1;
#endif

template <class T>
at::Tensor attention_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions) {
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), D = q.size(3), cache = k.size(2), tokens = positions.size(1);
  at::Tensor y = at::empty(q.sizes(), q.options());
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  const T* kp = reinterpret_cast<const T*>(k.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v.data_ptr());
  T* yp = reinterpret_cast<T*>(y.data_ptr());
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float root = std::sqrt(float(D));
  const int64_t groups = R / tokens;  // query heads per KV head; row g * tokens + t is token t of head g
  // A task per KV head and token: a verify's 15 (5 tokens x 3 KV heads) split 8 / 7 over 2 threads, where the
  // 3 KV heads alone split 2 / 1.
  at::parallel_for(0, B * H * tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(ROW_BLOCK * D), scores, out(ROW_BLOCK * D);
    for (int64_t job = begin; job < end; job++) {
      const int64_t task = job / tokens, t = job % tokens, b = task / H;
      const T* head_keys = kp + task * cache * D;
      const T* head_values = vp + task * cache * D;
      for (int64_t g0 = 0; g0 < groups; g0 += ROW_BLOCK) {
        const int rb = int(std::min<int64_t>(ROW_BLOCK, groups - g0));
        const int64_t last = std::min(pos[b * tokens + t], cache - 1);
        const int64_t padded = (last + 8) / 8 * 8;  // scores go 4 and 8 slots at a time
        scores.resize(ROW_BLOCK * padded);
        for (int r = 0; r < rb; r++)
          for (int64_t d = 0; d < D; d++) queries[r * D + d] = float(qp[(task * R + (g0 + r) * tokens + t) * D + d]);
        switch (rb) {
          case 3: scores_rows<3>(head_keys, cache, queries.data(), last, D, scores.data(), padded); break;
          case 2: scores_rows<2>(head_keys, cache, queries.data(), last, D, scores.data(), padded); break;
          default: scores_rows<1>(head_keys, cache, queries.data(), last, D, scores.data(), padded); break;
        }
        float total[ROW_BLOCK];
        for (int r = 0; r < rb; r++) {
          float* row_scores = scores.data() + r * padded;
          f32x8 top = f32x8{} - INFINITY;  // slots past last (to the next 8) hold other slots' scores: masked
          for (int64_t s0 = 0; s0 <= last; s0 += 8) {
            const f32x8 s = load8(&row_scores[s0]) / root;
            std::memcpy(&row_scores[s0], &s, sizeof s);
            top = i32x8{0, 1, 2, 3, 4, 5, 6, 7} + int32_t(s0) <= int32_t(last) && s > top ? s : top;
          }
          float largest = top[0];
          total[r] = 0.f;
          for (int j = 1; j < 8; j++) largest = std::max(largest, top[j]);
          f32x8 totals = {};
          for (int64_t s0 = 0; s0 <= last; s0 += 8) {
            f32x8 e = exp8(load8(&row_scores[s0]) - largest);
            e = i32x8{0, 1, 2, 3, 4, 5, 6, 7} + int32_t(s0) <= int32_t(last) ? e : f32x8{};
            std::memcpy(&row_scores[s0], &e, sizeof e);
            totals += e;
          }
          for (int j = 0; j < 8; j++) total[r] += totals[j];
        }
        switch (rb) {
          case 3: weighted_sums<3>(head_values, scores.data(), padded, last + 1, D, total, out.data()); break;
          case 2: weighted_sums<2>(head_values, scores.data(), padded, last + 1, D, total, out.data()); break;
          default: weighted_sums<1>(head_values, scores.data(), padded, last + 1, D, total, out.data()); break;
        }
        for (int r = 0; r < rb; r++)
          for (int64_t d = 0; d < D; d++)
            yp[(task * R + (g0 + r) * tokens + t) * D + d] = static_cast<T>(out[r * D + d]);
      }
    }
  });
  return y;
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions) {
  TORCH_CHECK(q.dim() == 4 && q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && k.sizes() == v.sizes() &&
                  k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(3) == q.size(3),
              "few_rows: attention takes contiguous q [B, H, R, D] and k, v [B, H, L, D]");
  TORCH_CHECK(q.size(3) % L == 0, "few_rows: head dim ", q.size(3), " is not a multiple of ", L);
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "few_rows: q, k, v dtypes differ");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.dim() == 2 &&
                  positions.size(0) == q.size(0) && q.size(2) % positions.size(1) == 0,
              "few_rows: positions must be contiguous int64 [B, T], T dividing the query rows");
  switch (q.scalar_type()) {
    case at::kBFloat16: return attention_rows<c10::BFloat16>(q, k, v, positions);
    case at::kFloat: return attention_rows<float>(q, k, v, positions);
    default: TORCH_CHECK(false, "few_rows: attention dtype must be bfloat16 or float32, not ", q.scalar_type());
  }
}

// ---------------------------------------------------------------------------------------------------------------
// A whole few-row step of a Llama-family model in one call (cpu.modules.OneCallStep): the embedding
// rows, then per layer RMSNorm, q/k/v, rotary, the cache write, attention, the output product and the residual,
// RMSNorm, gate/up, SiLU(gate) times up, down and the residual; then the final RMSNorm and the LM head. The same
// operations as model.py's forward, rounded to the model's dtype where its eager PyTorch rounds them, and every
// row computed by itself, so a verify's rows are a decode's. Compiled by torch.compile instead, a step ran ~150
// small kernels from Python between the products, behind Dynamo's guards and the gathering of ~370 inputs: SmolLM2
// decode steps (Zen 4, one process, alternating) bf16 12.28 -> 10.78 ms, int8 7.90 -> 6.30, mxfp6 8.76 -> 6.45,
// int4 10.46 -> 7.69. What remains outside the products and attention: ~0.35 ms of an int8 step.
template <class T>
inline float rounded(float v) {  // v rounded to T (bf16: nearest, ties to even), as a float
  return float(T(v));
}

// The same, 8 at a time: bf16's rounding as c10::BFloat16 does it (a NaN becomes its quiet NaN), in integer lanes.
typedef uint32_t u32x8 __attribute__((vector_size(32)));

template <class T>
inline f32x8 rounded8(f32x8 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    u32x8 bits;
    std::memcpy(&bits, &v, sizeof v);
    bits = (bits + ((bits >> 16) & 1u) + 0x7FFFu) & 0xFFFF0000u;
    bits = (u32x8)(v != v) ? u32x8{} + 0x7FC00000u : bits;
    std::memcpy(&v, &bits, sizeof v);
    return v;
  }
}

inline void store8(float* p, f32x8 v) { std::memcpy(p, &v, sizeof v); }

// out[i] = round(x[i] + y[i]), or round(x[i]) without y: a residual add, a bias, a product's output in T.
template <class T>
void add_rounded(const float* x, const float* y, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8(out + i, rounded8<T>(y ? load8(x + i) + load8(y + i) : load8(x + i)));
  for (; i < n; i++) out[i] = rounded<T>(y ? x[i] + y[i] : x[i]);
}

// out[i] = round(round(silu(gate[i])) * up[i]), as F.silu(gate) * up in T; silu(g) = g / (1 + exp(-g)) with exp8,
// and exp(-g) infinite for g < -88 (exp8 does not reach infinity by itself), so silu is -0 there, as in PyTorch.
template <class T>
void silu_times(const float* gate, const float* up, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const f32x8 g = load8(gate + i);
    const f32x8 e = g < -88.f ? f32x8{} + INFINITY : exp8(-g);
    store8(out + i, rounded8<T>(rounded8<T>(g / (1.f + e)) * load8(up + i)));
  }
  for (; i < n; i++) out[i] = rounded<T>(rounded<T>(gate[i] / (1.f + std::exp(-gate[i]))) * up[i]);
}

// The sum of x[i]^2 in the order of PyTorch's CPU sum over a row (four 8-lane sums, 32 elements a step, added in
// turn, then their lanes in order; the remaining 8-element vectors into the sum, then the elements): RMSNorm's mean
// then agrees with eager PyTorch's (in 295 of 300 random 576-element rows; a sequential sum in 1), and so do its
// bf16 roundings.
__attribute__((optimize("fp-contract=off"))) inline float sum_of_squares(const float* x, int64_t n) {
  f32x8 acc[4] = {};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int a = 0; a < 4; a++) {
      const f32x8 v = load8(x + i + 8 * a);
      acc[a] += v * v;
    }
  f32x8 sum = ((acc[0] + acc[1]) + acc[2]) + acc[3];
  for (; i + 8 <= n; i += 8) {
    const f32x8 v = load8(x + i);
    sum += v * v;
  }
  float total = 0.f;
  for (int j = 0; j < 8; j++) total += sum[j];
  for (; i < n; i++) total += x[i] * x[i];
  return total;
}

template <class T>
void rms_norm_rows(const float* x, const at::Tensor& weight, double eps, int64_t R, int64_t dim, float* out) {
  const T* w = reinterpret_cast<const T*>(weight.data_ptr());
  for (int64_t r = 0; r < R; r++) {
    const float* xr = x + r * dim;
    const float scale = 1.f / std::sqrt(sum_of_squares(xr, dim) / float(dim) + float(eps));
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8)
      store8(out + r * dim + i, rounded8<T>(load8(w + i) * rounded8<T>(load8(xr + i) * scale)));
    for (; i < dim; i++) out[r * dim + i] = rounded<T>(float(w[i]) * rounded<T>(xr[i] * scale));
  }
}

// One head's q or k, rotated on its first 2 * half dims (pairs j, j + half; model.apply_rotary) and rounded to T:
// each product rounded, as PyTorch's eager rotary computes them (not fused into multiply-adds).
template <class T>
__attribute__((optimize("fp-contract=off"))) void rotate(const float* in, const float* cos, const float* sin,
                                                          int64_t half, int64_t D, T* out) {
  for (int64_t j = 0; j < half; j++) {
    out[j] = T(in[j] * cos[j] - in[j + half] * sin[j]);
    out[j + half] = T(in[j + half] * cos[j] + in[j] * sin[j]);
  }
  for (int64_t j = 2 * half; j < D; j++) out[j] = T(in[j]);
}

// What llama_step takes besides tokens and positions (cpu.modules.OneCallStep.operands): per layer 2
// norms and 4 products (q/k/v stacked, wo, gate/up stacked, w2) with their factors, tables and biases, then the
// final norm and the LM head.
struct StepOperands {
  const at::Tensor& embeddings;
  const at::Tensor& cos;
  const at::Tensor& sin;
  at::TensorList norms, weights;
  const c10::List<std::optional<at::Tensor>>& factors;
  const c10::List<std::optional<at::Tensor>>& tables;
  const c10::List<std::optional<at::Tensor>>& biases;
  at::TensorList k_caches, v_caches;
  int64_t n_heads, n_kv_heads;
  double eps;
};

// Product i of the step: y [R, N] = x [R, K] times weight i (with its factors and table), plus its bias, each
// output rounded to T as the Linear modules round theirs.
template <class T>
at::Tensor step_product(const at::Tensor& x, const StepOperands& s, int64_t i, int64_t outputs) {
  at::Tensor y = linear(x, s.weights[i], s.factors.get(i), s.tables.get(i));
  TORCH_CHECK(y.size(1) == outputs, "few_rows: llama_step's product ", i, " has ", y.size(1), " outputs, not ",
              outputs);
  float* yp = y.data_ptr<float>();
  const int64_t R = y.size(0), N = y.size(1);
  const std::optional<at::Tensor> bias = s.biases.get(i);
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous()),
              "few_rows: llama_step's biases must be float32 [outputs]");
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  for (int64_t r = 0; r < R; r++) add_rounded<T>(yp + r * N, b, N, yp + r * N);
  return y;
}

template <class T>
at::Tensor llama_step_rows(const at::Tensor& tokens, const at::Tensor& positions, const StepOperands& s) {
  const at::Tensor& embeddings = s.embeddings;
  const int64_t n_heads = s.n_heads, n_kv_heads = s.n_kv_heads;
  const int64_t B = tokens.size(0), S = tokens.size(1), R = B * S, dim = embeddings.size(1);
  const int64_t layers = s.k_caches.size(), D = s.k_caches[0].size(3), slots = s.k_caches[0].size(2);
  const int64_t G = n_heads / n_kv_heads, half = s.cos.size(1), Q = n_heads * D, KV = n_kv_heads * D;
  const int64_t* token = tokens.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cos_p = s.cos.data_ptr<float>();
  const float* sin_p = s.sin.data_ptr<float>();
  const T* table = reinterpret_cast<const T*>(embeddings.data_ptr());
  const auto floats = embeddings.options().dtype(at::kFloat);
  std::vector<float> x(R * dim);  // the residual stream, values of T
  for (int64_t r = 0; r < R; r++)
    for (int64_t i = 0; i < dim; i++) x[r * dim + i] = float(table[token[r] * dim + i]);
  at::Tensor h = at::empty({R, dim}, floats), a = at::empty({R, Q}, floats);
  at::Tensor q = at::empty({B, n_kv_heads, G * S, D}, embeddings.options());
  T* qp = reinterpret_cast<T*>(q.data_ptr());
  float* hp = h.data_ptr<float>();
  float* ap = a.data_ptr<float>();
  for (int64_t l = 0; l < layers; l++) {
    rms_norm_rows<T>(x.data(), s.norms[2 * l], s.eps, R, dim, hp);
    const at::Tensor qkv = step_product<T>(h, s, 4 * l, Q + 2 * KV);
    const float* qkv_p = qkv.data_ptr<float>();
    T* kc = reinterpret_cast<T*>(s.k_caches[l].data_ptr());
    T* vc = reinterpret_cast<T*>(s.v_caches[l].data_ptr());
    for (int64_t r = 0; r < R; r++) {
      const int64_t b = r / S, t = r % S, p = pos[r];
      const float* row = qkv_p + r * (Q + 2 * KV);
      const float *c = cos_p + p * half, *sn = sin_p + p * half;
      for (int64_t head = 0; head < n_heads; head++)  // q [B, KV heads, G * S, D], row g * S + t of its KV head
        rotate(row + head * D, c, sn, half, D, qp + ((b * n_kv_heads + head / G) * G * S + (head % G) * S + t) * D);
      for (int64_t head = 0; head < n_kv_heads; head++) {
        const int64_t slot = ((b * n_kv_heads + head) * slots + p) * D;
        rotate(row + Q + head * D, c, sn, half, D, kc + slot);
        for (int64_t j = 0; j < D; j++) vc[slot + j] = T(row[Q + KV + head * D + j]);
      }
    }
    const at::Tensor y = attention_rows<T>(q, s.k_caches[l], s.v_caches[l], positions);
    const T* yp = reinterpret_cast<const T*>(y.data_ptr());
    for (int64_t r = 0; r < R; r++)  // y [B, H, S, D] -> a [B * S, H * D]
      for (int64_t head = 0; head < n_heads; head++)
        for (int64_t j = 0; j < D; j++)
          ap[r * Q + head * D + j] = float(yp[(((r / S) * n_heads + head) * S + r % S) * D + j]);
    const at::Tensor o = step_product<T>(a, s, 4 * l + 1, dim);
    add_rounded<T>(x.data(), o.data_ptr<float>(), R * dim, x.data());
    rms_norm_rows<T>(x.data(), s.norms[2 * l + 1], s.eps, R, dim, hp);
    const int64_t I = s.weights[4 * l + 2].size(0) / 2;
    const at::Tensor gate_up = step_product<T>(h, s, 4 * l + 2, 2 * I);
    at::Tensor m = at::empty({R, I}, floats);
    const float* gu = gate_up.data_ptr<float>();
    float* mp = m.data_ptr<float>();
    for (int64_t r = 0; r < R; r++) silu_times<T>(gu + r * 2 * I, gu + r * 2 * I + I, I, mp + r * I);
    const at::Tensor down = step_product<T>(m, s, 4 * l + 3, dim);
    add_rounded<T>(x.data(), down.data_ptr<float>(), R * dim, x.data());
  }
  rms_norm_rows<T>(x.data(), s.norms[2 * layers], s.eps, R, dim, hp);
  const int64_t V = s.weights[4 * layers].size(0);
  const at::Tensor logits = step_product<T>(h, s, 4 * layers, V);
  if constexpr (std::is_same_v<T, float>) {
    return logits.view({B, S, V});
  } else {  // values of T already: their upper halves
    at::Tensor out = at::empty({B, S, V}, embeddings.options());
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(logits.data_ptr<float>());
    uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
    for (int64_t i = 0; i < R * V; i++) op[i] = uint16_t(bits[i] >> 16);
    return out;
  }
}

at::Tensor llama_step(const at::Tensor& tokens, const at::Tensor& positions, const at::Tensor& embeddings,
                      const at::Tensor& cos, const at::Tensor& sin, at::TensorList norms, at::TensorList weights,
                      const c10::List<std::optional<at::Tensor>>& factors,
                      const c10::List<std::optional<at::Tensor>>& tables,
                      const c10::List<std::optional<at::Tensor>>& biases, at::TensorList k_caches,
                      at::TensorList v_caches, int64_t n_heads, int64_t n_kv_heads, double eps) {
  const int64_t layers = k_caches.size();
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong && tokens.is_contiguous() &&
                  positions.sizes() == tokens.sizes() && positions.scalar_type() == at::kLong &&
                  positions.is_contiguous(),
              "few_rows: llama_step takes contiguous int64 tokens and positions [B, S]");
  TORCH_CHECK(layers > 0 && int64_t(v_caches.size()) == layers && int64_t(norms.size()) == 2 * layers + 1 &&
                  int64_t(weights.size()) == 4 * layers + 1 && int64_t(factors.size()) == 4 * layers + 1 &&
                  int64_t(tables.size()) == 4 * layers + 1 && int64_t(biases.size()) == 4 * layers + 1,
              "few_rows: llama_step takes 2 norms and 4 products per layer, a final norm and the LM head");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && n_heads % n_kv_heads == 0,
              "few_rows: llama_step takes float32 rotary tables [positions, rotary_dim / 2]");
  const int64_t B = tokens.size(0), slots = k_caches[0].size(2), vocabulary = embeddings.size(0);
  for (int64_t l = 0; l < layers; l++)
    TORCH_CHECK(k_caches[l].dim() == 4 && k_caches[l].size(0) == B && k_caches[l].size(1) == n_kv_heads &&
                    k_caches[l].sizes() == k_caches[0].sizes() && v_caches[l].sizes() == k_caches[0].sizes() &&
                    k_caches[l].is_contiguous() && v_caches[l].is_contiguous() &&
                    k_caches[l].scalar_type() == embeddings.scalar_type() &&
                    v_caches[l].scalar_type() == embeddings.scalar_type(),
                "few_rows: llama_step's caches must be contiguous [B, KV heads, slots, head dim] in the model's dtype");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) >= slots &&
                  2 * cos.size(1) <= k_caches[0].size(3) && embeddings.dim() == 2 && embeddings.is_contiguous(),
              "few_rows: llama_step's rotary tables or embeddings do not fit its caches");
  for (int64_t i = 0; i < tokens.numel(); i++) {
    const int64_t token = tokens.data_ptr<int64_t>()[i], position = positions.data_ptr<int64_t>()[i];
    TORCH_CHECK(token >= 0 && token < vocabulary, "few_rows: token ", token, " is outside the vocabulary of ",
                vocabulary);
    TORCH_CHECK(position >= 0 && position < slots, "few_rows: position ", position, " is outside the cache of ",
                slots);
  }
  for (int64_t l = 0; l <= 2 * layers; l++)
    TORCH_CHECK(norms[l].numel() == embeddings.size(1) && norms[l].scalar_type() == embeddings.scalar_type() &&
                    norms[l].is_contiguous(),
                "few_rows: llama_step's norm weights must be [dim] in the model's dtype");
  const StepOperands operands{embeddings, cos, sin, norms, weights, factors, tables, biases, k_caches, v_caches,
                              n_heads, n_kv_heads, eps};
  switch (embeddings.scalar_type()) {
    case at::kBFloat16: return llama_step_rows<c10::BFloat16>(tokens, positions, operands);
    case at::kFloat: return llama_step_rows<float>(tokens, positions, operands);
    default:
      TORCH_CHECK(false, "few_rows: llama_step dtype must be bfloat16 or float32, not ", embeddings.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(few_rows, m) {
  // No defaults: Inductor's C++ wrapper leaves out trailing arguments that equal their defaults, and the dispatcher
  // call it makes then reads past the ones it was given (torch 2.13: a segfault in the first step).
  m.def("product(Tensor x, Tensor weight, Tensor? factors, Tensor? table) -> Tensor");
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor positions) -> Tensor");
  m.def("llama_step(Tensor tokens, Tensor positions, Tensor embeddings, Tensor cos, Tensor sin, Tensor[] norms, "
        "Tensor[] weights, Tensor?[] factors, Tensor?[] tables, Tensor?[] biases, Tensor(a!)[] k_caches, "
        "Tensor(b!)[] v_caches, int n_heads, int n_kv_heads, float eps) -> Tensor");
  m.def("packed_fp6_is_fast() -> bool", [] { return kFastFp6; });
}

TORCH_LIBRARY_IMPL(few_rows, CPU, m) {
  m.impl("product", &linear);
  m.impl("attention", &attention);
  m.impl("llama_step", &llama_step);
}
