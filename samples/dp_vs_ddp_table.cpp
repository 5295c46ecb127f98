#include "samples/dp_vs_ddp_table.h"

#include <fmt/format.h>

namespace replica {

namespace {

// The steps the runs took, as the table's header says them: the runs end with their epochs
// (replica-train's --epochs, 1 unless given) when those come before --steps, and the header
// said "99999999999 steps" of a run that took one epoch's 1,875.
std::string steps_run(const RunMetrics& dp, const RunMetrics& ddp, int64_t asked) {
  const auto taken_dp = int64_t(dp.number("steps")), taken_ddp = int64_t(ddp.number("steps"));
  std::string said = taken_dp == taken_ddp
                         ? fmt::format("{} steps", taken_dp)
                         : fmt::format("{} steps (DP), {} (DDP)", taken_dp, taken_ddp);
  if (std::max(taken_dp, taken_ddp) < asked) {
    const auto epochs = int64_t(dp.number("epochs"));
    said += fmt::format(" (all of {} epoch{}, fewer than --steps {}: -- --epochs N trains more)",
                        epochs, epochs == 1 ? "" : "s", asked);
  }
  return said;
}

}  // namespace

// Formatted whole before any of it is printed, so a figure missing from either run is one line,
// not half a table.
std::string comparison(const RunMetrics& dp, const RunMetrics& ddp, int64_t asked_steps) {
  std::string out;
  auto row = [&](const std::string& what, const std::string& a, const std::string& b,
                 const std::string& note = "") {
    out += fmt::format("{:<30} {:>14} {:>14}  {}\n", what, a, b, note);
  };
  auto f = [](const char* spec, double v) { return fmt::format(fmt::runtime(spec), v); };
  auto acc = [](const RunMetrics& r) {
    return r.evaluated() ? fmt::format("{:.4f}", r.number("test_accuracy")) : std::string("-");
  };
  // Peak memory of device / rank 0, and the largest of the others.
  auto mem = [](const RunMetrics& r, bool first) {
    const std::vector<double> p = r.per_device("peak_memory_bytes");
    if (first) return fmt::format("{:.1f} MB", p[0] / 1e6);
    if (p.size() < 2) return std::string("-");
    return fmt::format("{:.1f} MB", *std::max_element(p.begin() + 1, p.end()) / 1e6);
  };
  const double sps_dp = dp.number("samples_per_sec"), sps_ddp = ddp.number("samples_per_sec");
  const int ranks = int(ddp.number("world_size"));
  out += fmt::format("\n{}, global batch {}, {}, seed 0; DP on {}, DDP on {} rank{}\n",
                     dp.text("model"), int64_t(dp.number("batch_size")),
                     steps_run(dp, ddp, asked_steps), dp.text("device_spec"), ranks,
                     ranks == 1 ? "" : "s");
  row("", "DP", "DDP");
  row("samples/s", f("{:.0f}", sps_dp), f("{:.0f}", sps_ddp),
      fmt::format("DDP/DP = {:.2f}x", sps_ddp / sps_dp));
  row("test accuracy", acc(dp), acc(ddp));
  row("final training loss", f("{:.4f}", dp.number("final_loss")),
      f("{:.4f}", ddp.number("final_loss")));
  row("forward, ms/step", f("{:.2f}", dp.phase({"forward"}, true)),
      f("{:.2f}", ddp.phase({"forward"})), "per device (DDP: rank 0's)");
  row("backward, ms/step", f("{:.2f}", dp.phase({"backward"}, true)),
      f("{:.2f}", ddp.phase({"backward"})), "per device");
  row("gradient sync, ms/step", f("{:.2f}", dp.phase({"reduce"})),
      f("{:.2f}", ddp.phase({"allreduce"})),
      "communication thread, overlaps backward: DP reduce, DDP all-reduce");
  row("waiting for it after backward", f("{:.2f}", dp.phase({"wait_reduce"})),
      f("{:.2f}", ddp.phase({"wait_allreduce"})));
  row("scatter/gather/broadcast",
      f("{:.2f}", dp.phase({"prefetch", "scatter", "gather_loss", "scatter_grad", "broadcast"},
                           true)),
      f("{:.2f}", ddp.phase({"prefetch", "h2d", "batch_gather", "broadcast_buffers"})),
      "DP funnels through device 0");
  row("optimizer step, ms/step", f("{:.2f}", dp.phase({"step"})), f("{:.2f}", ddp.phase({"step"})),
      "DP: device 0 only; DDP: every rank");
  row("wall time per step, ms", f("{:.2f}", 1e3 * dp.number("batch_size") / sps_dp),
      f("{:.2f}", 1e3 * ddp.number("batch_size") / sps_ddp));
  row("gradient bytes per step", f("{:.0f}", dp.number("comm_bytes_per_step")),
      f("{:.0f}", ddp.number("comm_bytes_per_step")),
      "DP: into device 0, (N-1) x S; DDP: each rank's all-reduce, S");
  row("peak memory, device 0", mem(dp, true), mem(ddp, true));
  row("peak memory, other devices", mem(dp, false), mem(ddp, false),
      "max over devices (ranks) 1..N-1");
  const bool both_evaluated = dp.evaluated() && ddp.evaluated();
  std::string same;
  if (dp.boolean("has_batchnorm"))
    same = fmt::format(
        "Same model, data, seed and global batch, but BatchNorm normalises each device's share: "
        "DP's contiguous chunks of the batch, DDP's interleaved sampler shares (as in PyTorch), "
        "so the runs differ by more than rounding{}.",
        both_evaluated ? fmt::format(" (accuracies {} vs {})", acc(dp), acc(ddp)) : "");
  else if (both_evaluated)
    same = fmt::format("Same model, data, seed and global batch: the accuracies differ only by "
                       "rounding ({} vs {}).",
                       acc(dp), acc(ddp));
  else
    same = "Same model, data, seed and global batch (no evaluation: --no-eval).";
  out += fmt::format("\n{}\n{}\n", same,
                     sps_ddp > sps_dp * 1.02   ? "DDP is faster here."
                     : sps_dp > sps_ddp * 1.02 ? "DP is faster here."
                                               : "DP and DDP are within 2% of each other here.");
  return out;
}

}  // namespace replica
