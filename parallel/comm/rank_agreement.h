// What every rank of a DDP job must share, checked before the first collective that depends on
// it. Ranks started with different flags (a node whose command line differs) used to meet in an
// all-reduce of mismatched sizes, which Gloo ends with an abort in its own thread, or to train
// silently apart (another learning rate, seed or optimizer). One all-gather of a fixed size
// compares them instead, so every rank stops with the same one-line error naming the setting.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "parallel/rendezvous/store.h"

namespace replica {

struct Agreed {
  std::string what;  // "the model's parameters", "--lr", ...
  int64_t value = 0;  // a count, or text_hash() (store.h) of the setting as text
  bool count = false;  // a count is shown in the error; a hash is not
  std::string hint;   // what to make equal: "give every rank the same --model"
};

// Every process of the job calls it with the same items in the same order; `gather` is the
// group's integer all-gather (rank 0's values first). Throws UsageError when a rank's value
// differs from rank 0's: the first such item, and the first rank.
void require_same_on_every_rank(
    const std::vector<Agreed>& items,
    const std::function<std::vector<int64_t>(const std::vector<int64_t>&)>& gather);

}  // namespace replica
