// GlooStoreAdapter: our Store (TCP or file) behind Gloo's gloo::rendezvous::Store interface, so
// gloo::rendezvous::Context::connectFullMesh() can exchange transport addresses through the
// same rendezvous as everything else. Built only with REPLICA_WITH_GLOO (Gloo found).
//
// The Gloo found here (libgloo 0.5.0, git 2022-05-18) declares set(key, vector<char>),
// get(key), wait(keys) and wait(keys, timeout); no add/has/multi-get. get() and wait(keys) use
// the adapter's timeout; wait(keys, timeout) uses the one Gloo passes (its context timeout).
// Failures surface as replica::Error (naming the keys and the time waited), not gloo exceptions.
// The adapter does not own the store: keep the store alive while Gloo uses the adapter (it is
// only needed during connectFullMesh()).
#pragma once
#ifdef REPLICA_WITH_GLOO
#include <chrono>
#include <string>
#include <vector>

#include <gloo/rendezvous/store.h>

#include "parallel/rendezvous/store.h"

namespace replica {

class GlooStoreAdapter : public ::gloo::rendezvous::Store {
 public:
  // prefix namespaces Gloo's keys, so they never collide with our own rendezvous keys; give
  // each further Gloo context on the same store its own prefix (e.g. "gloo/1/").
  GlooStoreAdapter(replica::Store& store, std::chrono::milliseconds timeout,
                   std::string prefix = "gloo/");

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

  replica::Store& store() { return store_; }

 private:
  std::vector<std::string> prefixed(const std::vector<std::string>& keys) const;

  replica::Store& store_;
  std::chrono::milliseconds timeout_;
  std::string prefix_;
};

}  // namespace replica
#endif  // REPLICA_WITH_GLOO
