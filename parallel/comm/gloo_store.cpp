// GlooStoreAdapter (see gloo_store.h). Compiles to nothing without REPLICA_WITH_GLOO.
#include "parallel/comm/gloo_store.h"

#ifdef REPLICA_WITH_GLOO
#include <utility>

namespace replica {

GlooStoreAdapter::GlooStoreAdapter(replica::Store& store, std::chrono::milliseconds timeout,
                                   std::string prefix)
    : store_(store), timeout_(timeout), prefix_(std::move(prefix)) {}

std::vector<std::string> GlooStoreAdapter::prefixed(const std::vector<std::string>& keys) const {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const auto& k : keys) out.push_back(prefix_ + k);
  return out;
}

void GlooStoreAdapter::set(const std::string& key, const std::vector<char>& data) {
  store_.set(prefix_ + key, data);
}

std::vector<char> GlooStoreAdapter::get(const std::string& key) {
  store_.wait({prefix_ + key}, timeout_);  // the adapter's timeout, not the store's
  return store_.get(prefix_ + key);
}

void GlooStoreAdapter::wait(const std::vector<std::string>& keys) {
  store_.wait(prefixed(keys), timeout_);
}

void GlooStoreAdapter::wait(const std::vector<std::string>& keys,
                            const std::chrono::milliseconds& timeout) {
  store_.wait(prefixed(keys), timeout);
}

}  // namespace replica
#endif  // REPLICA_WITH_GLOO
