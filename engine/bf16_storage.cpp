#include "engine/bf16_storage.h"

#include <algorithm>
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
// A tensor whose memory is NHWC and differs from NCHW's (engine/tensor.h), or one that is not.
bool is_nhwc(const Tensor& t) { return t.nhwc_memory(); }
template <class T>
bool is_nhwc(const T&) {
  return false;
}
// The channels of a call's channels_last tensors (0: none; they share one count).
int64_t nhwc_channels(const Tensor& t) { return is_nhwc(t) ? t.dim(1) : 0; }
template <class T>
int64_t nhwc_channels(const T&) {
  return 0;
}
// A tensor of an op's operands that is laid out NCHW-wise (its elements in NCHW's order) beside
// channels_last tensors of C channels: any of two or more dimensions but a channels_last one
// (1-D ones are per-channel parameters), and but a 4-D one of C channels that both layouts lay
// out alike (layout_free: a max-pool's 1x1 output), which fits the call in either layout.
// Other shapes ([N, C*H*W], flat or as [N, C*H*W, 1, 1]) keep NCHW's order.
bool is_nchw(const Tensor& t, int64_t C) {
  return t.defined() && t.ndim() >= 2 && !is_nhwc(t) &&
         !(t.ndim() == 4 && t.layout_free() && t.dim(1) == C);
}
template <class T>
bool is_nchw(const T&, int64_t) {
  return false;
}

// What an op profile calls the copies (OpProfile's parts): the conversions and those back.
const char* copies_part(bool wide, bool nchw) {
  return wide && nchw ? "F32 NCHW copies of BF16 channels_last tensors"
         : wide       ? "F32 copies of BF16 tensors"
                      : "NCHW copies of channels_last tensors";
}

// One call's copies of its tensors in the form its kernel takes (F32 for BF16 ones where
// `wide`, NCHW for channels_last ones where `nchw`), and the outputs their results go back
// into. An output (a Tensor& argument) is copied in too: an op may add into it (+=,
// backend_ops.inc), and which ones do is not said per argument; for one the op overwrites,
// that is a pass over memory not yet written, whose values are then overwritten.
class Converted {
 public:
  Converted(Backend& inner, DeviceContext& ctx, bool wide, bool nchw)
      : inner_(inner), ctx_(ctx), wide_(wide), nchw_(nchw) {}

  template <class T>
  T& pass(T& arg) {
    return arg;
  }
  const Tensor& pass(const Tensor& t) { return converts(t) ? convert(t) : t; }
  Tensor& pass(Tensor& t) {
    if (!converts(t)) return t;
    Tensor& copy = convert(t);
    outputs_.push_back({&t, &copy});
    return copy;
  }
  void copy_back() {
    for (auto& [out, copy] : outputs_) inner_.copy(ctx_, *out, *copy);
  }

 private:
  bool converts(const Tensor& t) const { return (wide_ && is_bf16(t)) || (nchw_ && is_nhwc(t)); }
  Tensor& convert(const Tensor& t) {
    const DType dtype = wide_ && is_bf16(t) ? DType::F32 : t.dtype();
    const bool channels_last = t.channels_last() && !nchw_;
    // a deque: references stay valid
    copies_.push_back(ctx_.alloc(t.shape(), dtype, channels_last));
    inner_.copy(ctx_, copies_.back(), t);
    return copies_.back();
  }

  Backend& inner_;
  DeviceContext& ctx_;
  const bool wide_, nchw_;
  std::deque<Tensor> copies_;
  std::vector<std::pair<Tensor*, Tensor*>> outputs_;
};

// Calls `call` with a call's arguments as they are, or with copies of those its kernel does not
// take (takes_bf16, layouts: engine/ops.h).
template <class Call>
struct Dispatch {
  Backend& inner;
  bool takes_bf16;
  Backend::Layouts layouts;
  int64_t& copied_calls;
  Call call;

  template <class... Args>
  void operator()(DeviceContext& ctx, Args&... args) {
    const bool wide = !takes_bf16 && (is_bf16(args) || ...);
    const bool any_nhwc = (is_nhwc(args) || ...);
    int64_t channels = 0;
    ((channels = std::max(channels, nhwc_channels(args))), ...);
    const bool mixed = any_nhwc && (is_nchw(args, channels) || ...);
    const bool nchw = any_nhwc && (layouts == Backend::Layouts::None ||
                                   (layouts == Backend::Layouts::Uniform && mixed));
    if (!wide && !nchw) {
      call(ctx, args...);
      return;
    }
    if (wide) ++copied_calls;
    Converted converted(inner, ctx, wide, nchw);
    const char* part = copies_part(wide, nchw);
    auto passed =
        op_part(ctx, part, [&] { return std::forward_as_tuple(converted.pass(args)...); });
    std::apply([&](auto&... a) { call(ctx, a...); }, passed);
    op_part(ctx, part, [&] { converted.copy_back(); });
  }
};
template <class Call>
Dispatch<Call> dispatch(Backend& inner, bool takes_bf16, Backend::Layouts layouts,
                        int64_t& copied_calls, Call call) {
  return {inner, takes_bf16, layouts, copied_calls, std::move(call)};
}

class Bf16StorageBackend final : public Backend {
 public:
  explicit Bf16StorageBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {
    for (size_t i = 0; i < takes_.size(); ++i) {
      takes_[i] = inner_->takes_bf16(OpId(i));
      layouts_[i] = inner_->layouts(OpId(i));
    }
    REPLICA_CHECK(layouts_[size_t(OpId::copy)] == Layouts::Any,
                  "a backend's copy must convert layouts (Backend::layouts)");
  }

#define REPLICA_OP(name, params, args)                                                      \
  void name params override {                                                               \
    dispatch(*inner_, takes_[size_t(OpId::name)], layouts_[size_t(OpId::name)],              \
             copied_calls_, [this](DeviceContext& c, auto&... a) { inner_->name(c, a...); }) \
    args;                                                                                   \
  }
#include "engine/backend_ops.inc"
#undef REPLICA_OP

  bool takes_bf16(OpId) const override { return true; }
  Layouts layouts(OpId) const override { return Layouts::Any; }
  int64_t copied_calls() const { return copied_calls_; }

 private:
  std::unique_ptr<Backend> inner_;
  std::array<bool, size_t(OpId::kCount)> takes_{};
  std::array<Layouts, size_t(OpId::kCount)> layouts_{};
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
