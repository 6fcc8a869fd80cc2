// AMX tiles (Intel Xeons from Sapphire Rapids on: amx_tile, amx_int8): the integer formats' products of 2 or more
// rows take one tile dot product per block of 32 inputs, 16 columns and up to 16 rows (columns.h's *_amx kernels),
// where VNNI takes a vpdpbusd or vpdpwssd per row and 4 or 2 inputs. The integer sums are exact and the float steps
// after them are the VNNI kernels' own, in the same order: a verify's row on tiles is a decode's row on VNNI, bit for
// bit. A decode's one row stays on VNNI (as llama.cpp's does).
//
// Three tiles a product: A, a block's rounded inputs (rows x 32 bytes); B, the block's codes of 16 columns, 4
// consecutive k a column (8 x 64 bytes, Intel's VNNI layout); C, rows x 16 int32 sums. int4: C = A (signed) . B
// (unsigned codes), TDPBSUD. 16-bit inputs (int8, integer MX): q = 256 hi + lo, so C = A_lo (unsigned) . B +
// 256 (A_hi (signed) . B), TDPBUSD and TDPBSSD, |C| < 2^31: vpdpwssd's sum exactly.
//
// Linux hands out tile state on request (arch_prctl); every thread that runs tiles loads a tile configuration first,
// here before each tile's pass (other code in the thread, oneDNN's, loads its own). Without AMX (or refused) the VNNI
// kernels serve; tests run the same kernels over EmulatedTiles, Intel's pseudocode of the instructions in plain code.
#pragma once
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <cerrno>

namespace {

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && FR_AVX512VNNI && FR_AVX512BW
#define FR_AMX 1
#else
#define FR_AMX 0
#endif
// The tile kernels' float steps are AVX-512 (every CPU with AMX has it): where a build has it, tests emulate tiles.
constexpr bool kTileKernels = FR_AVX512VNNI && FR_AVX512BW;
constexpr int TILE_PASS_ROWS = 16;  // the most rows of a tile

enum class Amx { OFF, HARDWARE, EMULATED };
struct AmxState {
  Amx mode;
  std::string why;  // what serves, in a few words (cpu/__init__.py's report)
};

AmxState& amx_state() {
  static AmxState state = [] {
    if (!FR_AMX) return AmxState{Amx::OFF, "this build has no AMX code (its compiler targeted none)"};
#if defined(__linux__)
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0)
      return AmxState{Amx::OFF, std::string("AMX tiles refused by the kernel (arch_prctl: ") + std::strerror(errno) +
                                    "); AVX-512 serves"};
    return AmxState{Amx::HARDWARE, "AMX tiles serve the int4, int4k, int8 and integer MX products of 2+ rows"};
#else
    return AmxState{Amx::OFF, "AMX tiles unused: their permission is asked of Linux only; AVX-512 serves"};
#endif
  }();
  return state;
}

// The products' tiles now ("auto": the CPU's where it has them and the kernel permits; "off"; "emulated": plain code,
// for the tests) -> what serves, in words; "" only asks.
std::string amx(const std::string& mode) {
  static const AmxState initial = amx_state();
  AmxState& state = amx_state();
  if (mode == "auto") state = initial;
  else if (mode == "off") state = AmxState{Amx::OFF, "AMX tiles off (few_rows.amx)"};
  else if (mode == "emulated") {
    TORCH_CHECK(kTileKernels, "few_rows: tiles are emulated in builds with AVX512_VNNI only");
    state = AmxState{Amx::EMULATED, "AMX tiles emulated in plain code (a test)"};
  } else TORCH_CHECK(mode.empty(), "few_rows: amx takes auto, off or emulated, not ", mode);
  return state.why;
}

// TDPBSUD, TDPBUSD and TDPBSSD over the three tiles above in plain code: Intel's pseudocode's sums (exact int32),
// B read out of its VNNI layout first so that the compiler vectorizes the rows' sums.
struct EmulatedTiles {
  static void configure(int) {}
  template <class A, class B>
  static void dot(int rows, const A* a, const B* b, int32_t* c) {  // c = a . b
    int32_t columns[BLOCK][TILE];  // B's element (k, n)
    for (int k = 0; k < BLOCK; k++)
      for (int n = 0; n < TILE; n++) columns[k][n] = b[4 * TILE * (k / 4) + 4 * n + k % 4];
    for (int m = 0; m < rows; m++) {
      int32_t sums[TILE] = {};
      for (int k = 0; k < BLOCK; k++)
        for (int n = 0; n < TILE; n++) sums[n] += int32_t(a[BLOCK * m + k]) * columns[k][n];
      std::memcpy(c + TILE * m, sums, sizeof(sums));
    }
  }
  static void dot_su(int rows, const int8_t* a, const uint8_t* b, int32_t* c) { dot(rows, a, b, c); }
  static void dot_wide(int rows, const uint8_t* lo, const int8_t* hi, const int8_t* b, int32_t* c_lo, int32_t* c_hi) {
    dot(rows, lo, b, c_lo);
    dot(rows, hi, b, c_hi);
  }
};

#if FR_AMX
// tmm0: A (rows x 32 bytes), tmm1: B (8 x 64), tmm2: C (rows x 64), tmm3: A_hi, tmm4: C_hi.
struct HardwareTiles {
  struct Config {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  };
  static void configure(int rows) {
    alignas(64) Config config;
    for (int t : {0, 3}) config.rows[t] = uint8_t(rows), config.colsb[t] = BLOCK;
    for (int t : {2, 4}) config.rows[t] = uint8_t(rows), config.colsb[t] = 4 * TILE;
    config.rows[1] = BLOCK / 4, config.colsb[1] = 4 * TILE;
    _tile_loadconfig(&config);
  }
  static void dot_su(int, const int8_t* a, const uint8_t* b, int32_t* c) {
    _tile_zero(2);
    _tile_loadd(0, a, BLOCK);
    _tile_loadd(1, b, 4 * TILE);
    _tile_dpbsud(2, 0, 1);
    _tile_stored(2, c, 4 * TILE);
  }
  static void dot_wide(int, const uint8_t* lo, const int8_t* hi, const int8_t* b, int32_t* c_lo, int32_t* c_hi) {
    _tile_zero(2);
    _tile_zero(4);
    _tile_loadd(0, lo, BLOCK);
    _tile_loadd(3, hi, BLOCK);
    _tile_loadd(1, b, 4 * TILE);
    _tile_dpbusd(2, 0, 1);
    _tile_dpbssd(4, 3, 1);
    _tile_stored(2, c_lo, 4 * TILE);
    _tile_stored(4, c_hi, 4 * TILE);
  }
};
#endif

// run(Tiles) with the tiles the products use now, for M rows (AMX_OFF: none; a decode's one row: none).
template <class Run>
bool on_tiles(int64_t M, const Run& run) {
  if constexpr (kTileKernels) {
    const Amx mode = M >= 2 ? amx_state().mode : Amx::OFF;
#if FR_AMX
    if (mode == Amx::HARDWARE) return run(HardwareTiles{}), true;
#endif
    if (mode == Amx::EMULATED) return run(EmulatedTiles{}), true;
  }
  return false;
}

}  // namespace
