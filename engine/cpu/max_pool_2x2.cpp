#include "engine/cpu/max_pool_2x2.h"

#include <algorithm>

#include "engine/cpu/vec16.h"
#include "engine/error.h"

namespace replica::cpu {

#if defined(__AVX512F__)

bool max_pool_2x2_built() { return true; }

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

#else  // builds without AVX-512 take the element-wise path (max_pool_2x2_built)

bool max_pool_2x2_built() { return false; }

void max_pool_2x2_row(const float*, const float*, int64_t, float*) {
  REPLICA_CHECK(false, "the vector 2x2 max pool is not in builds without AVX-512");
}

void max_pool_2x2_row_grad(const float*, const float*, const float*, int64_t, float*, float*) {
  REPLICA_CHECK(false, "the vector 2x2 max pool is not in builds without AVX-512");
}

#endif

}  // namespace replica::cpu
