#include "engine/cpu/max_pool_rows.h"

#include <algorithm>
#include <limits>

#include "engine/cpu/vec16.h"
#include "engine/error.h"

namespace replica::cpu {

#if defined(__AVX512F__)

bool max_pool_rows_built() { return true; }

namespace {

// The elements of up to kLanes windows of a row, a window to a lane.
struct TileQuad {
  Vec top_left, top_right, bottom_left, bottom_right;
};

// The 2n floats at row (n <= kLanes pairs), split into lefts and rights; lanes past n hold zeros.
void load_pairs(const float* row, int64_t n, Vec& left, Vec& right) {
  const VecPair v = load_floats(row, 2 * n);
  left = __builtin_shuffle(v.lo, v.hi, kEven);
  right = __builtin_shuffle(v.lo, v.hi, kOdd);
}

// n <= kLanes pairs (left[l], right[l]) to the 2n floats at row.
void store_pairs(float* row, int64_t n, Vec left, Vec right) {
  store_floats(row, 2 * n,
               {__builtin_shuffle(left, right, kInterleaveLow),
                __builtin_shuffle(left, right, kInterleaveHigh)});
}

TileQuad load_quad(const float* top, const float* bottom, int64_t n) {
  TileQuad t;
  load_pairs(top, n, t.top_left, t.top_right);
  load_pairs(bottom, n, t.bottom_left, t.bottom_right);
  return t;
}

}  // namespace

void max_pool_2x2_row(const float* top, const float* bottom, int64_t q, float* out) {
  for (int64_t ox = 0; ox < q; ox += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, q - ox);
    const TileQuad t = load_quad(top + 2 * ox, bottom + 2 * ox, n);
    Vec m = t.top_left;
    m = takes_over(t.top_right, m) ? t.top_right : m;
    m = takes_over(t.bottom_left, m) ? t.bottom_left : m;
    m = takes_over(t.bottom_right, m) ? t.bottom_right : m;
    store_first(out + ox, n, m);
  }
}

void max_pool_2x2_row_grad(const float* top, const float* bottom, const float* grad, int64_t q,
                           float* dtop, float* dbottom) {
  const Vec zero{};
  for (int64_t ox = 0; ox < q; ox += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, q - ox);
    const TileQuad t = load_quad(top + 2 * ox, bottom + 2 * ox, n);
    // took_e: element e took over from those before it, so the winner is the last that did.
    const Lanes took1 = takes_over(t.top_right, t.top_left);
    Vec m = took1 ? t.top_right : t.top_left;
    const Lanes took2 = takes_over(t.bottom_left, m);
    m = took2 ? t.bottom_left : m;
    const Lanes took3 = takes_over(t.bottom_right, m);
    const Lanes after1 = took2 | took3, after0 = took1 | after1;
    const Vec g = load_first(grad + ox, n) + zero;  // +0 + g, not g (see the header)
    store_pairs(dtop + 2 * ox, n, after0 ? zero : g, (took1 & ~after1) ? g : zero);
    store_pairs(dbottom + 2 * ox, n, (took2 & ~took3) ? g : zero, took3 ? g : zero);
  }
}

namespace {

inline const Lanes kLaneNumbers = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
// Over (v, w): v moved up one lane, w's lane 0 into lane 0.
inline const Lanes kUpOne = {16, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14};

// A window's winner so far, a window to a lane: the value, its index in the plane, and whether
// any element of the window has been met (the first one met is taken whatever it is, as the
// element-wise path starts from it).
struct Winners {
  Vec value;
  Lanes at;
  Lanes met;

  // The elements v at plane indices at, where `in` (those in the plane), in row-major order.
  void meet(Vec v, Lanes in, Lanes index) {
    const Lanes take = in & (~met | takes_over(v, value));
    value = take ? v : value;
    at = take ? index : at;
    met |= in;
  }
};

}  // namespace

void max_pool_3x3_s2_row(const float* plane, int64_t h, int64_t w, int64_t oy, int64_t q,
                         float* best, int32_t* at) {
  const int64_t y0 = std::max<int64_t>(2 * oy - 1, 0), y1 = std::min<int64_t>(2 * oy + 2, h);
  for (int64_t ox = 0; ox < q; ox += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, q - ox);
    const Lanes middle = 2 * (int(ox) + kLaneNumbers);  // each window's middle column
    const Lanes window = kLaneNumbers < int(n);
    const Lanes left_in = window & (middle >= 1), right_in = window & (middle + 1 < int(w));
    Winners win{splat(-std::numeric_limits<float>::infinity()), Lanes{} - 1, Lanes{}};
    for (int64_t iy = y0; iy < y1; ++iy) {
      const float* row = plane + iy * w;
      // Columns 2ox .. 2ox + 2n - 1 (2ox < w for every window there is), even and odd.
      const VecPair v = load_floats(row + 2 * ox, std::min<int64_t>(2 * n, w - 2 * ox));
      const Vec middles = __builtin_shuffle(v.lo, v.hi, kEven);
      const Vec rights = __builtin_shuffle(v.lo, v.hi, kOdd);
      const Vec lefts = __builtin_shuffle(rights, splat(ox > 0 ? row[2 * ox - 1] : 0.f), kUpOne);
      const Lanes index = int(iy * w) + middle;
      win.meet(lefts, left_in, index - 1);
      win.meet(middles, window, index);
      win.meet(rights, right_in, index + 1);
    }
    store_first(best + ox, n, win.value);
    _mm512_mask_storeu_epi32(at + ox, __mmask16((1u << n) - 1), __m512i(win.at));
  }
}

#else  // builds without AVX-512 take the element-wise path (max_pool_rows_built)

bool max_pool_rows_built() { return false; }

void max_pool_2x2_row(const float*, const float*, int64_t, float*) {
  REPLICA_CHECK(false, "the vector 2x2 max pool is not in builds without AVX-512");
}

void max_pool_2x2_row_grad(const float*, const float*, const float*, int64_t, float*, float*) {
  REPLICA_CHECK(false, "the vector 2x2 max pool is not in builds without AVX-512");
}

void max_pool_3x3_s2_row(const float*, int64_t, int64_t, int64_t, int64_t, float*, int32_t*) {
  REPLICA_CHECK(false, "the vector 3x3 max pool is not in builds without AVX-512");
}

#endif

}  // namespace replica::cpu
