// Key-value stores for DDP rendezvous: rank 0 hosts a small TCP store (env://, tcp://), or the
// ranks share a directory (file://). The store carries the NCCL unique id, backs Gloo's store
// interface (parallel/comm/gloo_group.cpp) and implements the join barrier of rendezvous().
//
// Every blocking operation has a timeout; a timeout throws replica::Error naming the operation,
// the keys and how long it waited. Keys are at most kMaxKeyBytes, values at most kMaxValueBytes.
// add() counters are stored as decimal text, so get() of a counter returns e.g. "3".
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace replica {

using Bytes = std::vector<char>;

inline Bytes to_bytes(std::string_view s) { return Bytes(s.begin(), s.end()); }
inline std::string to_string(const Bytes& b) { return std::string(b.begin(), b.end()); }

class Store {
 public:
  static constexpr size_t kMaxKeyBytes = 4096;
  static constexpr size_t kMaxValueBytes = size_t(64) << 20;
  static constexpr size_t kMaxKeysPerRequest = 65536;

  explicit Store(std::chrono::milliseconds timeout) : timeout_(timeout) {}
  virtual ~Store() = default;
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  virtual void set(const std::string& key, const Bytes& value) = 0;
  // Waits for the key up to timeout().
  virtual Bytes get(const std::string& key) = 0;
  // Waits until every key is set or the timeout passes; returns the keys still missing then
  // (empty: all set). Throws replica::Error when the store fails (e.g. its server went away).
  virtual std::vector<std::string> wait_for(const std::vector<std::string>& keys,
                                            std::chrono::milliseconds timeout) = 0;
  // wait_for() that throws replica::Error naming the missing keys and the time waited.
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }
  // Atomically adds delta to the counter at key (absent: 0) and returns the new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // True when every key is set (does not wait).
  virtual bool check(const std::vector<std::string>& keys) {
    return wait_for(keys, std::chrono::milliseconds(0)).empty();
  }
  // Where the store lives, for messages: "127.0.0.1:29500", "file:///tmp/x".
  virtual std::string describe() const = 0;
  // A new connection to the same store with its own timeout, for a thread that must not queue
  // behind another thread's blocking wait (the peer monitor's heartbeat).
  virtual std::unique_ptr<Store> connect_again(std::chrono::milliseconds timeout) const = 0;
  // Removes every key, once no rank uses the store any more (the end of a job): a file store's
  // directory can then serve the next run. A TCP store ends with its server instead.
  virtual void remove_keys() {}

  void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }

 protected:
  std::chrono::milliseconds timeout_;
};

// Throws replica::Error when a key or value breaks the size limits (op names the operation).
void check_key(const std::string& key, const char* op);
void check_value(const std::string& key, const Bytes& value);
// add()'s arithmetic, the same in every store: a counter is an int64 as decimal text (absent:
// 0). Returns why `old` + `delta` cannot be stored (not a counter, or an overflow), else "".
std::string add_to_counter(const std::string* old, int64_t delta, int64_t* sum);
// FNV-1a of `text`: the same on every machine and build (std::hash promises neither). File
// names of keys; settings compared across ranks (parallel/comm/rank_agreement.h).
uint64_t text_hash(const std::string& text, uint64_t seed = 14695981039346656037ull);
// "'a', 'b'" (at most 8 keys, then "and N more").
std::string format_keys(const std::vector<std::string>& keys);
// "1.5 s"
std::string format_duration(std::chrono::milliseconds d);

// A TCP key-value server: one thread, poll()-based, waits resolved server-side. Binds host:port
// (host "": every interface; port 0: any free port, see port()); throws UsageError when the port is
// in use. A malformed or oversized message closes that connection only. The destructor stops the
// thread promptly: it answers pending waits with "shut down" (naming their missing keys) and
// delivers the replies already decided (for up to a second), so a rank waiting on rank 0 learns
// what was missing.
class TcpStoreServer {
 public:
  TcpStoreServer(const std::string& host, int port);
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  int port() const { return port_; }

 private:
  void loop();

  int port_ = 0;
  int listen_fd_ = -1;
  int wake_pipe_[2] = {-1, -1};
  std::thread thread_;
};

// A client of TcpStoreServer. Connects with retries until timeout (the server may start later);
// reconnects on the next operation after an I/O error. Operations are serialised by a mutex: a
// thread blocked in wait()/get() holds the connection, so use one client per thread when
// threads wait on each other. Optionally owns the server (rank 0), so both live as long as the
// store (the server goes after the client's connection).
class TcpStoreClient : public Store {
 public:
  TcpStoreClient(const std::string& host, int port,
                 std::chrono::milliseconds timeout = std::chrono::seconds(120),
                 std::unique_ptr<TcpStoreServer> server = nullptr);
  ~TcpStoreClient() override;

  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  std::vector<std::string> wait_for(const std::vector<std::string>& keys,
                                    std::chrono::milliseconds timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  // A message of its own, answered within this connection's timeout (a wait's reply may take
  // 10 s more): the peer monitor asks it of a rank that may have stopped.
  bool check(const std::vector<std::string>& keys) override;
  std::string describe() const override;
  std::unique_ptr<Store> connect_again(std::chrono::milliseconds timeout) const override;

 private:
  struct Impl;
  std::unique_ptr<TcpStoreServer> server_;
  std::unique_ptr<Impl> impl_;
};

// Keys as files in a shared directory (created if missing), written atomically (temp file +
// rename); reads poll until the timeout; add() holds flock() on a per-key lock file. A job that
// ends in order removes its keys (ProcessGroup::leave); one that failed leaves them, and the
// next run's rendezvous says the directory is left from an earlier run.
class FileStore : public Store {
 public:
  explicit FileStore(const std::string& dir,
                     std::chrono::milliseconds timeout = std::chrono::seconds(120));

  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  std::vector<std::string> wait_for(const std::vector<std::string>& keys,
                                    std::chrono::milliseconds timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  std::string describe() const override { return "file://" + dir_; }
  std::unique_ptr<Store> connect_again(std::chrono::milliseconds timeout) const override {
    return std::make_unique<FileStore>(dir_, timeout);
  }
  void remove_keys() override;

 private:
  std::string path_for(const std::string& key) const;  // the file that holds key
  std::string dir_;
};

}  // namespace replica
