// Comparing two checkpoint files tensor by tensor, bit for bit (resume tests).
#pragma once
#include <doctest/doctest.h>

#include <cstring>
#include <string>

#include "engine/checkpoint.h"

namespace test {

// Same step, same tensor names in the same order, identical bytes.
inline void check_same_checkpoint(const std::string& a_path, const std::string& b_path) {
  auto a = replica::load_checkpoint(a_path);
  auto b = replica::load_checkpoint(b_path);
  CHECK(a.metadata.at("step") == b.metadata.at("step"));
  REQUIRE(a.tensors.size() == b.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    CAPTURE(a.tensors[i].first);
    REQUIRE(a.tensors[i].first == b.tensors[i].first);
    const auto& ta = a.tensors[i].second;
    const auto& tb = b.tensors[i].second;
    REQUIRE(ta.bytes() == tb.bytes());
    CHECK(std::memcmp(ta.raw(), tb.raw(), ta.bytes()) == 0);
  }
}

}  // namespace test
