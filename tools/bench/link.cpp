#include "tools/bench/link.h"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>

#include <fmt/format.h>

#include "engine/error.h"

namespace replica::bench {

// Per direction, per GPU: the vendors' NVLink figures add both directions, and PCIe's is the
// lane rate after 128b/130b encoding. What NCCL reaches differs from the raw figure (protocol
// overheads lower it; NVLink SHARP's in-switch reduction raises an all-reduce's bus bandwidth),
// so a projection over a declared link is the link's arithmetic, not a measurement: a run on
// GPUs joined by that link is what tests it.
const std::vector<Link>& known_links() {
  static const std::vector<Link> links = {
      {"nvlink3", 300e9, "A100 SXM4: NVLink 3, 12 links, 600 GB/s both directions together"},
      {"nvlink4", 450e9, "H100 SXM5: NVLink 4, 18 links, 900 GB/s both directions together"},
      {"pcie4", 31.5e9, "PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b encoding"},
      {"pcie5", 63.0e9, "PCIe 5.0 x16: 32 GT/s x 16 lanes, 128b/130b encoding"},
  };
  return links;
}

Link parse_link(const std::string& text) {
  std::string t;
  for (char c : text) t += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const Link& l : known_links())
    if (t == l.name) return l;
  std::string number = t;
  if (number.size() > 4 && number.compare(number.size() - 4, 4, "gb/s") == 0)
    number.resize(number.size() - 4);
  while (!number.empty() && number.back() == ' ') number.pop_back();
  char* end = nullptr;
  errno = 0;
  const double gbps = number.empty() ? 0 : std::strtod(number.c_str(), &end);
  const bool ok = !number.empty() && end && *end == '\0' && errno == 0 && std::isfinite(gbps) &&
                  gbps > 0 && gbps <= 1e5;
  if (!ok) {
    std::string names;
    for (const Link& l : known_links()) names += l.name + ", ";
    throw UsageError(fmt::format("--link '{}': expected one of {}or a bandwidth per direction in "
                                 "GB/s (0 < GB/s <= 100000), e.g. 25 or 25GB/s",
                                 text, names));
  }
  return {fmt::format("{:g} GB/s", gbps), gbps * 1e9, "given with --link"};
}

}  // namespace replica::bench
