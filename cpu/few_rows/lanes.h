// Lanes: 16 floats as native vectors, loads and conversions, the one horizontal sum, bf16 rounding.
#pragma once

namespace {

// Which instruction sets the code uses: the ones the compiler targets (-march), or none in the portable build
// (-DFEW_ROWS_PORTABLE). Each function written with intrinsics has its scalar reference beside it, named
// <function>_reference: plain C++ with the same lanes, sums and trees, which the portable build runs and
// tests/test_cpu.py compares with the build for this CPU, bit for bit.
#if defined(__AVX__) && !defined(FEW_ROWS_PORTABLE)
#define FR_AVX 1
#else
#define FR_AVX 0
#endif
#if defined(__AVX2__) && !defined(FEW_ROWS_PORTABLE)
#define FR_AVX2 1
#else
#define FR_AVX2 0
#endif
#if defined(__FMA__) && !defined(FEW_ROWS_PORTABLE)
#define FR_FMA 1
#else
#define FR_FMA 0
#endif
#if defined(__AVX512F__) && !defined(FEW_ROWS_PORTABLE)
#define FR_AVX512F 1
#else
#define FR_AVX512F 0
#endif
#if defined(__AVX512BF16__) && !defined(FEW_ROWS_PORTABLE)
#define FR_AVX512BF16 1
#else
#define FR_AVX512BF16 0
#endif
#if defined(__AVX512VBMI__) && !defined(FEW_ROWS_PORTABLE)
#define FR_AVX512VBMI 1
#else
#define FR_AVX512VBMI 0
#endif
#if defined(__AVX512VNNI__) && !defined(FEW_ROWS_PORTABLE)
#define FR_AVX512VNNI 1
#else
#define FR_AVX512VNNI 0
#endif
#if defined(__AVX512BW__) && !defined(FEW_ROWS_PORTABLE)
#define FR_AVX512BW 1
#else
#define FR_AVX512BW 0
#endif
#if defined(__AVX512VL__) && !defined(FEW_ROWS_PORTABLE)
#define FR_AVX512VL 1
#else
#define FR_AVX512VL 0
#endif
#if defined(__znver1__) && !defined(FEW_ROWS_PORTABLE)
#define FR_ZNVER1 1
#else
#define FR_ZNVER1 0
#endif

constexpr int L = 16;  // lanes of one accumulator

// 16 floats as native vectors: one with AVX-512, two elsewhere (one 64-byte GCC vector went through memory on
// AVX2). Lane j is part[j / W][j % W] either way, so the sums do not depend on W.
#if FR_AVX512F
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

// Software prefetch this far ahead of the weights being read: the tiles are short streams that the hardware
// prefetcher alone leaves short of the memory's bandwidth, most of all where a pass of 5-8 rows makes the loop
// compute-bound (the distances measured: docs/performance.md).
constexpr int64_t PREFETCH_BYTES = 8192;

inline f32x16 load(const float* p) {
  f32x16 v;
  for (int h = 0; h < L / W; h++) std::memcpy(&v.part[h], p + h * W, sizeof(native));  // one load each
  return v;
}

inline float bf16_value(uint32_t bits16) {
  const uint32_t b = bits16 << 16;
  float v;
  std::memcpy(&v, &b, 4);
  return v;
}

// 16 weights to float. The generic vector conversions from 16-bit integers come out as scalar code (GCC 12), so
// the usual targets get intrinsics.
inline f32x16 bf16_to_float_reference(const uint16_t* p) {
  f32x16 v;
  for (int j = 0; j < L; j++) v.part[j / W][j % W] = bf16_value(p[j]);
  return v;
}

inline f32x16 bf16_to_float(const uint16_t* p) {
#if FR_AVX512F
  f32x16 v;
  v.part[0] = (native)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
  return v;
#elif FR_AVX2
  f32x16 v;
  for (int h = 0; h < 2; h++)
    v.part[h] = (native)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + 8 * h))),
                                          16);
  return v;
#else
  return bf16_to_float_reference(p);
#endif
}

inline f32x16 to_float(const float* p) { return load(p); }
inline f32x16 to_float(const uint16_t* p) { return bf16_to_float(p); }
inline f32x16 to_float(const c10::BFloat16* p) { return bf16_to_float(reinterpret_cast<const uint16_t*>(p)); }

inline uint16_t round_to_bf16(float v) {  // nearest, ties to even; NaN stays NaN
  uint32_t b;
  std::memcpy(&b, &v, 4);
  if ((b & 0x7fffffff) > 0x7f800000) return uint16_t((b >> 16) | 0x40);
  return uint16_t((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}

// 8 floats: the attention's and the step's vectors, and the horizontal sums.
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

inline f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store8(float* p, f32x8 v) { std::memcpy(p, &v, sizeof v); }

// 8 keys or values as floats, straight from the cache.
inline f32x8 load8_reference(const c10::BFloat16* p) {
  f32x8 v;
  for (int j = 0; j < 8; j++) v[j] = float(p[j]);
  return v;
}

inline f32x8 load8(const c10::BFloat16* p) {
#if FR_AVX2
  return (f32x8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
#else
  return load8_reference(p);
#endif
}

// The one horizontal sum: a vector's lanes as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), the tree of AVX's
// hadd.
inline float sum8_reference(f32x8 v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }

// Four vectors at a time, where the attention's scores need them (three hadds for four sums).
inline void sum4x8(const f32x8* a, float* out) {
#if FR_AVX
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps((__m256)a[0], (__m256)a[1]),
                                  _mm256_hadd_ps((__m256)a[2], (__m256)a[3]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
#else
  for (int j = 0; j < 4; j++) out[j] = sum8_reference(a[j]);
#endif
}

// One vector, kept in registers (a round trip through the stack made products slower).
__attribute__((always_inline)) inline float sum8(f32x8 v) {
#if FR_AVX
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps((__m256)v, (__m256)v), (__m256)v);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
#else
  return sum8_reference(v);
#endif
}

// A row's 16 lane sums: lanes j and j + 8 added, then sum8's tree.
inline float sum_lanes_reference(const f32x16& v) {
  f32x8 halves;
  for (int j = 0; j < 8; j++) halves[j] = v.part[j / W][j % W] + v.part[(j + 8) / W][(j + 8) % W];
  return sum8_reference(halves);
}

// Inlined by force: as a call, the struct argument kept the accumulators on the stack during the whole tile loop.
__attribute__((always_inline)) inline float sum_lanes(f32x16 v) {
#if FR_AVX512F
  const __m512 all = (__m512)v.part[0];
  return sum8((f32x8)_mm256_add_ps(_mm512_castps512_ps256(all),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(all), 1))));
#elif FR_AVX
  return sum8(v.part[0] + v.part[1]);
#else
  return sum_lanes_reference(v);
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

}  // namespace
