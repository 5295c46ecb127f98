#include "engine/bf16_storage.h"

#include <array>
#include <deque>
#include <tuple>
#include <utility>
#include <vector>

#include "engine/context.h"
#include "engine/error.h"
#include "engine/op_profile.h"

namespace replica {

namespace {

bool is_bf16(const Tensor& t) { return t.defined() && t.dtype() == DType::BF16; }
template <class T>
bool is_bf16(const T&) {
  return false;  // the context, numbers, window parameters
}

// One call's F32 copies of its BF16 tensors, and the BF16 outputs their results go back into.
// An output (a Tensor& argument) is widened too: an op may add into it (+=, backend_ops.inc),
// and which ones do is not said per argument; for one the op overwrites, that is a pass over
// memory not yet written, whose values are then overwritten.
class Widened {
 public:
  Widened(Backend& inner, DeviceContext& ctx) : inner_(inner), ctx_(ctx) {}

  template <class T>
  T& pass(T& arg) {
    return arg;
  }
  const Tensor& pass(const Tensor& t) { return is_bf16(t) ? widen(t) : t; }
  Tensor& pass(Tensor& t) {
    if (!is_bf16(t)) return t;
    Tensor& wide = widen(t);
    outputs_.push_back({&t, &wide});
    return wide;
  }
  void round_outputs() {
    for (auto& [narrow, wide] : outputs_) inner_.copy(ctx_, *narrow, *wide);
  }

 private:
  Tensor& widen(const Tensor& t) {
    copies_.push_back(ctx_.alloc(t.shape(), DType::F32));  // a deque: references stay valid
    inner_.copy(ctx_, copies_.back(), t);
    return copies_.back();
  }

  Backend& inner_;
  DeviceContext& ctx_;
  std::deque<Tensor> copies_;
  std::vector<std::pair<Tensor*, Tensor*>> outputs_;
};

// What an op profile calls the copies (OpProfile's parts): the widening and the rounding back.
constexpr const char* kCopiesPart = "F32 copies of its BF16 tensors";

// Calls `call` with a call's arguments as they are, or with its BF16 tensors widened.
template <class Call>
struct Dispatch {
  Backend& inner;
  bool takes_bf16;
  int64_t& copied_calls;
  Call call;

  template <class... Args>
  void operator()(DeviceContext& ctx, Args&... args) {
    if (takes_bf16 || !(is_bf16(args) || ...)) {
      call(ctx, args...);
      return;
    }
    ++copied_calls;
    Widened widened(inner, ctx);
    auto passed = op_part(ctx, kCopiesPart,
                          [&] { return std::forward_as_tuple(widened.pass(args)...); });
    std::apply([&](auto&... a) { call(ctx, a...); }, passed);
    op_part(ctx, kCopiesPart, [&] { widened.round_outputs(); });
  }
};
template <class Call>
Dispatch<Call> dispatch(Backend& inner, bool takes_bf16, int64_t& copied_calls, Call call) {
  return {inner, takes_bf16, copied_calls, std::move(call)};
}

class Bf16StorageBackend final : public Backend {
 public:
  explicit Bf16StorageBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {
    for (size_t i = 0; i < takes_.size(); ++i) takes_[i] = inner_->takes_bf16(OpId(i));
  }

#define REPLICA_OP(name, params, args)                                                   \
  void name params override {                                                            \
    dispatch(*inner_, takes_[size_t(OpId::name)], copied_calls_,                          \
             [this](DeviceContext& c, auto&... a) { inner_->name(c, a...); }) args;      \
  }
#include "engine/backend_ops.inc"
#undef REPLICA_OP

  bool takes_bf16(OpId) const override { return true; }
  int64_t copied_calls() const { return copied_calls_; }

 private:
  std::unique_ptr<Backend> inner_;
  std::array<bool, size_t(OpId::kCount)> takes_{};
  int64_t copied_calls_ = 0;  // a context, and so its layer, is used by one thread at a time
};

}  // namespace

std::unique_ptr<Backend> make_bf16_storage_backend(std::unique_ptr<Backend> inner) {
  return std::make_unique<Bf16StorageBackend>(std::move(inner));
}

int64_t calls_on_f32_copies(const Backend& ops) {
  const auto* layer = dynamic_cast<const Bf16StorageBackend*>(&ops);
  REPLICA_CHECK(layer, "calls_on_f32_copies: not a context's ops (the bf16 storage layer)");
  return layer->copied_calls();
}

DType activation_dtype(const DeviceContext& ctx) {
  return ctx.precision() == Precision::Bf16 ? DType::BF16 : DType::F32;
}

}  // namespace replica
