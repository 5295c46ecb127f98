#include "engine/op_profile.h"

#include <chrono>

#include "engine/context.h"

namespace replica {

void OpProfile::add(const char* op, double seconds) {
  std::lock_guard<std::mutex> lock(mutex_);
  OpStats& s = ops_[op];
  ++s.calls;
  s.seconds += seconds;
}

std::map<std::string, OpStats> OpProfile::ops() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return ops_;
}

void OpProfile::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  ops_.clear();
}

namespace {

// Each override: synchronise, call the inner backend, synchronise, record.
#define REPLICA_TIMED_OP(op, params, args) \
  void op params override { timed(ctx, #op, [&] { inner_.op args; }); }

class ProfilingBackend final : public Backend {
 public:
  ProfilingBackend(Backend& inner, OpProfile& profile) : inner_(inner), profile_(profile) {}

  REPLICA_TIMED_OP(fill, (DeviceContext & ctx, Tensor& t, float value), (ctx, t, value))
  REPLICA_TIMED_OP(copy, (DeviceContext & ctx, Tensor& dst, const Tensor& src), (ctx, dst, src))
  REPLICA_TIMED_OP(add, (DeviceContext & ctx, Tensor& dst, const Tensor& src, float alpha),
                   (ctx, dst, src, alpha))
  REPLICA_TIMED_OP(scale, (DeviceContext & ctx, Tensor& t, float alpha), (ctx, t, alpha))
  REPLICA_TIMED_OP(gather_rows,
                   (DeviceContext & ctx, Tensor& dst, const Tensor& table, const Tensor& rows),
                   (ctx, dst, table, rows))
  REPLICA_TIMED_OP(linear_forward,
                   (DeviceContext & ctx, const Tensor& x, const Tensor& w, const Tensor& b,
                    Tensor& y),
                   (ctx, x, w, b, y))
  REPLICA_TIMED_OP(linear_backward,
                   (DeviceContext & ctx, const Tensor& x, const Tensor& w, const Tensor& dy,
                    Tensor& dx, Tensor& dw, Tensor& db),
                   (ctx, x, w, dy, dx, dw, db))
  REPLICA_TIMED_OP(conv2d_forward,
                   (DeviceContext & ctx, const Tensor& x, const Tensor& w, const Tensor& b,
                    Tensor& y, const Conv2dParams& p),
                   (ctx, x, w, b, y, p))
  REPLICA_TIMED_OP(conv2d_backward,
                   (DeviceContext & ctx, const Tensor& x, const Tensor& w, const Tensor& dy,
                    Tensor& dx, Tensor& dw, Tensor& db, const Conv2dParams& p),
                   (ctx, x, w, dy, dx, dw, db, p))
  REPLICA_TIMED_OP(batchnorm_forward_train,
                   (DeviceContext & ctx, const Tensor& x, const Tensor& gamma, const Tensor& beta,
                    Tensor& running_mean, Tensor& running_var, float momentum, float eps,
                    Tensor& y, Tensor& save_mean, Tensor& save_invstd),
                   (ctx, x, gamma, beta, running_mean, running_var, momentum, eps, y, save_mean,
                    save_invstd))
  REPLICA_TIMED_OP(batchnorm_forward_eval,
                   (DeviceContext & ctx, const Tensor& x, const Tensor& gamma, const Tensor& beta,
                    const Tensor& running_mean, const Tensor& running_var, float eps, Tensor& y),
                   (ctx, x, gamma, beta, running_mean, running_var, eps, y))
  REPLICA_TIMED_OP(batchnorm_backward,
                   (DeviceContext & ctx, const Tensor& x, const Tensor& gamma,
                    const Tensor& save_mean, const Tensor& save_invstd, const Tensor& dy,
                    Tensor& dx, Tensor& dgamma, Tensor& dbeta),
                   (ctx, x, gamma, save_mean, save_invstd, dy, dx, dgamma, dbeta))
  REPLICA_TIMED_OP(relu_forward, (DeviceContext & ctx, const Tensor& x, Tensor& y), (ctx, x, y))
  REPLICA_TIMED_OP(relu_backward,
                   (DeviceContext & ctx, const Tensor& y, const Tensor& dy, Tensor& dx),
                   (ctx, y, dy, dx))
  REPLICA_TIMED_OP(maxpool2d_forward,
                   (DeviceContext & ctx, const Tensor& x, Tensor& y, const Pool2dParams& p),
                   (ctx, x, y, p))
  REPLICA_TIMED_OP(maxpool2d_backward,
                   (DeviceContext & ctx, const Tensor& x, const Tensor& y, const Tensor& dy,
                    Tensor& dx, const Pool2dParams& p),
                   (ctx, x, y, dy, dx, p))
  REPLICA_TIMED_OP(adaptive_avgpool2d_forward, (DeviceContext & ctx, const Tensor& x, Tensor& y),
                   (ctx, x, y))
  REPLICA_TIMED_OP(adaptive_avgpool2d_backward,
                   (DeviceContext & ctx, const Tensor& dy, Tensor& dx), (ctx, dy, dx))
  REPLICA_TIMED_OP(dropout_forward,
                   (DeviceContext & ctx, const Tensor& x, Tensor& y, Tensor& mask, float p,
                    uint64_t seed),
                   (ctx, x, y, mask, p, seed))
  REPLICA_TIMED_OP(mul, (DeviceContext & ctx, const Tensor& a, const Tensor& b, Tensor& out),
                   (ctx, a, b, out))
  REPLICA_TIMED_OP(cross_entropy_forward,
                   (DeviceContext & ctx, const Tensor& logits, const Tensor& labels,
                    Tensor& probs, Tensor& loss),
                   (ctx, logits, labels, probs, loss))
  REPLICA_TIMED_OP(cross_entropy_backward,
                   (DeviceContext & ctx, const Tensor& probs, const Tensor& labels, float scale,
                    Tensor& dlogits),
                   (ctx, probs, labels, scale, dlogits))
  REPLICA_TIMED_OP(count_correct,
                   (DeviceContext & ctx, const Tensor& logits, const Tensor& labels,
                    Tensor& correct),
                   (ctx, logits, labels, correct))
  REPLICA_TIMED_OP(sgd_step,
                   (DeviceContext & ctx, Tensor& params, const Tensor& grads, Tensor& momentum,
                    const SgdConfig& c, bool first_step),
                   (ctx, params, grads, momentum, c, first_step))
  REPLICA_TIMED_OP(adam_step,
                   (DeviceContext & ctx, Tensor& params, const Tensor& grads, Tensor& m,
                    Tensor& v, const AdamConfig& c, int64_t step),
                   (ctx, params, grads, m, v, c, step))

 private:
  template <class F>
  void timed(DeviceContext& ctx, const char* op, F&& call) {
    ctx.synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    call();
    ctx.synchronize();
    profile_.add(op, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }

  Backend& inner_;
  OpProfile& profile_;
};

#undef REPLICA_TIMED_OP

}  // namespace

std::unique_ptr<Backend> make_profiling_backend(Backend& inner, OpProfile& profile) {
  return std::make_unique<ProfilingBackend>(inner, profile);
}

}  // namespace replica
