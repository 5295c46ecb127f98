// Settings every rank must share, compared with one all-gather (rank_agreement.h).
#include "parallel/comm/rank_agreement.h"

#include <fmt/format.h>

#include "engine/error.h"

namespace replica {

void require_same_on_every_rank(
    const std::vector<Agreed>& items,
    const std::function<std::vector<int64_t>(const std::vector<int64_t>&)>& gather) {
  std::vector<int64_t> mine;
  for (const Agreed& a : items) mine.push_back(a.value);
  const std::vector<int64_t> all = gather(mine);
  const size_t n = items.size();
  REPLICA_CHECK(n > 0 && all.size() % n == 0, "rank agreement: {} values for {} items",
                all.size(), n);
  for (size_t i = 0; i < n; ++i)
    for (size_t r = 1; r < all.size() / n; ++r) {
      const int64_t theirs = all[r * n + i], rank0 = all[i];
      if (theirs == rank0) continue;
      const Agreed& a = items[i];
      throw UsageError(fmt::format("rank {} differs from rank 0 in {}{}: {}", r, a.what,
                                   a.count ? fmt::format(" ({} against {})", theirs, rank0) : "",
                                   a.hint));
    }
}

}  // namespace replica
