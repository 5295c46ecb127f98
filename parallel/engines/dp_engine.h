// The DataParallel engine (see dp_engine.cpp for the iteration).
#pragma once
#include <vector>

#include "parallel/comm/local_group.h"
#include "parallel/engines/train_engine.h"

namespace replica {

struct DpOptions {
  ReduceStrategy strategy = ReduceStrategy::ToRoot;
  size_t first_bucket_bytes = size_t(1) << 20;
  size_t bucket_bytes = size_t(25) << 20;
};

std::unique_ptr<TrainEngine> make_dp_engine(const std::vector<Device>& devices,
                                            const EngineOptions& options,
                                            const DpOptions& dp = {});

}  // namespace replica
