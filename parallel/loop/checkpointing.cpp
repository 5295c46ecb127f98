#include "parallel/loop/checkpointing.h"

#include <charconv>
#include <cmath>
#include <cstdint>
#include <filesystem>

#include "engine/checkpoint.h"
#include "engine/error.h"

namespace replica {

namespace {

std::string meta(const Checkpoint& c, const std::string& key, const std::string& path) {
  auto it = c.metadata.find(key);
  REPLICA_USAGE_CHECK(it != c.metadata.end(), "{}: not a replica training checkpoint (no '{}')",
                      path, key);
  return it->second;
}

// A number in the metadata, decimal digits that fit, in [least, most]; `what` names it in the
// error ("a count", "a number in [0, 1]").
template <class T>
T meta_number(const Checkpoint& c, const std::string& key, const std::string& path, T least,
              T most, const std::string& what) {
  const std::string text = meta(c, key, path);
  T v{};
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  REPLICA_USAGE_CHECK(!text.empty() && ec == std::errc() && end == text.data() + text.size() &&
                          v >= least && v <= most,
                      "{}: corrupt checkpoint: metadata '{}' is '{}', not {}", path, key, text,
                      what);
  return v;
}

// A count (a step, an epoch, a batch size, a seed), at least `least`.
uint64_t meta_count(const Checkpoint& c, const std::string& key, const std::string& path,
                    uint64_t least = 0) {
  return meta_number<uint64_t>(c, key, path, least, uint64_t(INT64_MAX),
                               least ? fmt::format("a count of at least {}", least) : "a count");
}

// The primary replica's parameters and buffers as host tensors (names prefixed as given) and the
// model's metadata: what a training checkpoint and a model file both hold. `extra` runs inside
// the same device context, before the one synchronize.
template <class Extra>
Checkpoint model_snapshot(TrainEngine& engine, const std::string& format,
                          const std::string& param_prefix, const std::string& buffer_prefix,
                          Extra&& extra) {
  DeviceContext& ctx = engine.primary();
  Model& model = engine.model();
  Checkpoint c;
  ctx.run([&] {
    for (Param* p : model.params())
      c.tensors.emplace_back(param_prefix + p->name, to_host(ctx, p->value));
    for (Buffer* b : model.buffers())
      c.tensors.emplace_back(buffer_prefix + b->name, to_host(ctx, b->value));
    extra(ctx, c);
    ctx.synchronize();
  });
  c.metadata = {{"format", format},
                {"model", model.spec().name},
                {"input_shape", shape_str(model.spec().input_shape)},
                {"num_classes", std::to_string(model.spec().num_classes)}};
  return c;
}

// The checkpoint was written by this run's model, optimizer, seed, batch and data: otherwise the
// saved position would point into another run.
void check_same_run(const Checkpoint& c, const std::string& path, TrainEngine& engine,
                    const RunIdentity& run) {
  REPLICA_USAGE_CHECK(meta(c, "format", path) == "replica-checkpoint-v1",
                      "{}: unknown checkpoint format '{}'", path, meta(c, "format", path));
  const ModelSpec& spec = engine.model().spec();
  const std::string saved_model = meta(c, "model", path);
  REPLICA_USAGE_CHECK(
      saved_model == spec.name && meta(c, "input_shape", path) == shape_str(spec.input_shape),
      "{}: checkpoint is of model {} {}, this run trains {} {}", path, saved_model,
      meta(c, "input_shape", path), spec.name, shape_str(spec.input_shape));
  REPLICA_USAGE_CHECK(meta(c, "optimizer", path) == engine.optimizer().name(),
                      "{}: checkpoint was trained with {}, this run uses {}", path,
                      meta(c, "optimizer", path), engine.optimizer().name());
  REPLICA_USAGE_CHECK(int64_t(meta_count(c, "batch_size", path, 1)) == run.batch_size,
                      "{}: checkpoint was trained with batch size {}, this run uses {}", path,
                      meta(c, "batch_size", path), run.batch_size);
  if (meta_count(c, "seed", path) != run.seed)
    throw UsageError(fmt::format("{}: checkpoint was trained with --seed {}, this run uses {}",
                                 path, meta(c, "seed", path), run.seed));
  // Another data set, size or drop_last orders the epoch's batches otherwise.
  if (const auto it = c.metadata.find("data"); it != c.metadata.end())
    REPLICA_USAGE_CHECK(it->second == run.data,
                        "{}: checkpoint was trained on '{}', this run reads '{}': its position "
                        "would point into another order of samples",
                        path, it->second, run.data);
}

// The first NaN or infinity in the checkpoint's float tensors, weights and optimizer state
// alike, as "tensor 'NAME' holds nan at element I"; empty if there is none.
std::string first_non_finite(const Checkpoint& c) {
  for (const auto& [name, t] : c.tensors) {
    if (t.dtype() != DType::F32) continue;
    const float* v = t.f32();
    for (int64_t i = 0; i < t.numel(); ++i)
      if (!std::isfinite(v[i]))
        return fmt::format("tensor '{}' holds {} at element {}", name, v[i], i);
  }
  return "";
}

// Loading: a NaN resumed would surface steps later as "training diverged", blaming the learning
// rate.
void check_finite(const Checkpoint& c, const std::string& path) {
  const std::string bad = first_non_finite(c);
  REPLICA_USAGE_CHECK(bad.empty(), "{}: {}: the checkpoint cannot be resumed", path, bad);
}

// Saving: a file of NaNs would be refused on --resume, and would replace the last good one. The
// loss check stops a diverging run at its step (the ReLUs keep NaN); this is the guard behind
// it, for weights that go NaN where no loss shows it. The run stops, the files as they were.
void check_finite_before_saving(const Checkpoint& c, const std::string& path) {
  const std::string bad = first_non_finite(c);
  REPLICA_USAGE_CHECK(bad.empty(), "training diverged: {} (lower --lr?); {} not written", bad,
                      path);
}

// The loop position, read before anything is restored: a corrupt field changes nothing. Each
// field is checked alone and against the others: the step count is the batches before the
// position, the position lies inside an epoch, and the optimizer took one step per batch.
RunPosition read_position(const Checkpoint& c, const std::string& path, const RunIdentity& run) {
  RunPosition pos;
  pos.epoch = int64_t(meta_count(c, "epoch", path));
  pos.batch_in_epoch = int64_t(meta_count(c, "batch_in_epoch", path));
  pos.global_step = int64_t(meta_count(c, "step", path));
  const int64_t per = run.batches_per_epoch;
  REPLICA_USAGE_CHECK(pos.batch_in_epoch < per,
                      "{}: corrupt checkpoint: it stopped after batch {} of an epoch, and this "
                      "run's epochs have {} batches",
                      path, pos.batch_in_epoch, per);
  // epoch * per + batch_in_epoch without overflowing: an epoch past the step count is wrong too.
  const bool adds_up = pos.epoch <= pos.global_step / per &&
                       pos.epoch * per + pos.batch_in_epoch == pos.global_step;
  REPLICA_USAGE_CHECK(adds_up,
                      "{}: corrupt checkpoint: its position does not add up: epoch {} (0-based), "
                      "batch {} of it and step {}, with {} batches an epoch",
                      path, pos.epoch, pos.batch_in_epoch, pos.global_step, per);
  const uint64_t optimizer_steps = meta_count(c, "optimizer_steps", path);
  REPLICA_USAGE_CHECK(optimizer_steps == uint64_t(pos.global_step),
                      "{}: corrupt checkpoint: the optimizer took {} steps, the loop {}", path,
                      optimizer_steps, pos.global_step);
  if (c.metadata.count("best_epoch")) {  // absent: no epoch evaluated (or an older checkpoint)
    pos.best_epoch = int64_t(meta_count(c, "best_epoch", path, 1));
    pos.best_accuracy = meta_number(c, "best_accuracy", path, 0.0, 1.0, "a number in [0, 1]");
  }
  if (c.metadata.count("precision")) {  // absent in checkpoints older than the field
    pos.precision = meta(c, "precision", path);
    REPLICA_USAGE_CHECK(pos.precision == "fp32" || pos.precision == "tf32" ||
                            pos.precision == "bf16",
                        "{}: corrupt checkpoint: metadata 'precision' is '{}', not fp32, tf32 or "
                        "bf16", path, pos.precision);
  }
  return pos;
}

}  // namespace

std::string checkpoint_path(const std::string& dir) {
  return (std::filesystem::path(dir) / "checkpoint.safetensors").string();
}

void save_training_checkpoint(const std::string& dir, TrainEngine& engine, const RunPosition& pos,
                              const RunIdentity& run) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  REPLICA_USAGE_CHECK(!ec, "cannot create checkpoint directory '{}': {}", dir, ec.message());
  Checkpoint c = model_snapshot(engine, "replica-checkpoint-v1", "model.", "buffer.",
                                [&](DeviceContext& ctx, Checkpoint& ck) {
                                  for (auto& [name, t] : engine.optimizer().state())
                                    ck.tensors.emplace_back("optim." + name, to_host(ctx, t));
                                });
  c.metadata.insert({{"optimizer", engine.optimizer().name()},
                     {"optimizer_steps", std::to_string(engine.optimizer().steps())},
                     {"seed", std::to_string(run.seed)},
                     {"batch_size", std::to_string(run.batch_size)},
                     {"data", run.data},
                     {"epoch", std::to_string(pos.epoch)},
                     {"batch_in_epoch", std::to_string(pos.batch_in_epoch)},
                     {"step", std::to_string(pos.global_step)},
                     {"precision", precision_name(engine.primary().precision())}});
  if (pos.best_epoch > 0)
    c.metadata.insert({{"best_accuracy", fmt::format("{}", pos.best_accuracy)},
                       {"best_epoch", std::to_string(pos.best_epoch)}});
  check_finite_before_saving(c, checkpoint_path(dir));
  save_checkpoint(checkpoint_path(dir), c);
}

void save_model_weights(const std::string& path, TrainEngine& engine) {
  // state_dict names: no prefixes, no optimizer state.
  Checkpoint c =
      model_snapshot(engine, "replica-model-v1", "", "", [](DeviceContext&, Checkpoint&) {});
  check_finite_before_saving(c, path);
  save_checkpoint(path, c);
}

RunPosition load_training_checkpoint(const std::string& dir, TrainEngine& engine,
                                     const RunIdentity& run) {
  const std::string path = checkpoint_path(dir);
  REPLICA_USAGE_CHECK(std::filesystem::exists(path), "--resume: no checkpoint at '{}'", path);
  const Checkpoint c = load_checkpoint(path);
  check_same_run(c, path, engine, run);
  check_finite(c, path);
  const RunPosition pos = read_position(c, path, run);
  std::vector<std::pair<std::string, Tensor>> optim_state;
  for (const auto& [name, t] : c.tensors)
    if (name.rfind("optim.", 0) == 0) optim_state.emplace_back(name.substr(6), t);
  DeviceContext& ctx = engine.primary();
  auto restore = [&](const std::string& name, Tensor& dst) {
    const Tensor* src = c.find(name);
    REPLICA_USAGE_CHECK(src != nullptr, "{}: tensor '{}' missing", path, name);
    REPLICA_USAGE_CHECK(src->shape() == dst.shape(), "{}: tensor '{}' has shape {}, expected {}",
                        path, name, shape_str(src->shape()), shape_str(dst.shape()));
    REPLICA_USAGE_CHECK(src->dtype() == dst.dtype(), "{}: tensor '{}' is {}, expected {}", path,
                        name, dtype_name(src->dtype()), dtype_name(dst.dtype()));
    ctx.ops().copy(ctx, dst, *src);
  };
  Model& model = engine.model();
  ctx.run([&] {
    for (Param* p : model.params()) restore("model." + p->name, p->value);
    for (Buffer* b : model.buffers()) restore("buffer." + b->name, b->value);
    try {
      engine.optimizer().load_state(ctx, model.num_params(), pos.global_step, optim_state);
    } catch (const Error& e) {
      throw UsageError(fmt::format("{}: {}", path, e.what()));
    }
    ctx.synchronize();
  });
  engine.state_loaded();
  return pos;
}

}  // namespace replica
