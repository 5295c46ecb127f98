#include "tools/bench/report_md.h"

#include <algorithm>
#include <ctime>
#include <filesystem>
#include <set>

#include <fmt/format.h>

#include "engine/error.h"
#include "engine/output_files.h"
#include "tools/bench/environment.h"
#include "tools/bench/report_tables.h"

namespace replica::bench {

namespace {

using json = nlohmann::json;

// Title, when and how it was made, the machine, the caveats that change how every number
// below reads, and the method.
std::string intro_section(const ReportInputs& in) {
  const json& r0 = in.rows[0];
  std::set<std::string> models;
  bool shared = false;
  for (const auto& r : in.rows) {
    models.insert(fmt::format("{} ({})", r.value("model", "?"), r.value("input_shape", "?")));
    shared |= r.value("devices_share_gpu", false);
  }
  std::string titles;
  for (const auto& m : models) titles += (titles.empty() ? "" : ", ") + m;
  std::string md = fmt::format("# DP vs DDP scaling report: {}\n\n", titles);
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%d %H:%M", std::localtime(&now));
  md += fmt::format("Written {} by `{}`{}.\n\n", date, in.command,
                    in.elapsed_s > 0 ? fmt::format(" in {:.0f} s", in.elapsed_s)
                                     : std::string(" from saved results"));
  const json env = in.env.is_object() ? in.env : r0.value("env", json());
  md += "Environment: " + environment_line(env);
  std::string largest = "?";
  int most = 0;
  for (const auto& r : in.rows)
    if (r.value("devices", 0) > most && r.contains("device_list")) {
      most = r["devices"].get<int>();
      largest = r["device_list"].dump();
    }
  md += fmt::format(". Devices: {}; {} CPU thread(s) per device.\n\n", largest,
                    r0.value("threads_per_device", 0));
  if (shared)
    md += "> **Logical devices of one GPU**: the devices share one GPU's compute and memory, so "
          "these rows are a correctness and teaching run, not a scaling measurement. DDP over "
          "NCCL on them (`nccl-sockets`) gives each rank an NCCL host id of its own and talks "
          "over sockets: it measures no interconnect.\n\n";
  for (const json& r : in.rows)
    if (text(r, "backend") == "gloo-shm") {
      md += "> **DDP over Gloo on one machine** (`gloo-shm`): the ranks all-reduce through shared "
            "memory, not over TCP (`REPLICA_SHM_ALLREDUCE=0` measures Gloo's TCP over "
            "loopback instead).\n\n";
      break;
    }
  if (num(env, "others_cpu_share") >= 0.05)
    md += fmt::format(
        "> **The machine was not idle**: other processes used {:.0f}% of its CPU time while this "
        "ran, taking cores from the devices: expect lower efficiency and larger model errors "
        "than on a quiet machine.\n\n",
        100 * num(env, "others_cpu_share"));
  md += fmt::format(
      "**Weak scaling**: every device trains {} samples per step, so the global batch is {} x "
      "the device count (what users compare). Speed-up = samples/s on n devices / samples/s on "
      "one device of the same mode; efficiency = speed-up / n (100% is perfect). Data are "
      "synthetic and preloaded (the loader is not timed); Adam. Measured in {} rounds: in each "
      "round every configuration in turn builds its engine(s), runs {} warm-up steps and one "
      "timed window of {} steps, so load from outside the run hits all configurations alike; "
      "samples/s is the median over the rounds.\n\n",
      r0.value("batch_per_device", int64_t(0)), r0.value("batch_per_device", int64_t(0)),
      r0.value("repeats", 0), r0.value("warmup_steps", int64_t(0)),
      r0.value("timed_steps", int64_t(0)));
  return md;
}

// The model behind the dashed lines, in words, then its numbers.
std::string projection_part(const json& projection) {
  const bool any = projection.is_array() && !projection.empty();
  const bool declared_link = any && projection[0].contains("link");
  std::string md = declared_link
                       ? fmt::format("\n## Projection to 2-64 GPUs joined by {}\n\n",
                                     projection[0]["link"].value("name", "?"))
                       : "\n## Projection to 8, 16 and 64 devices\n\n";
  if (!any)
    return md + "No projection: it needs a 1-device row and a communication measurement per "
                "mode.\n";
  md += "An explicit alpha-beta model, drawn **dashed and labelled projection** in the plots. "
        "Compute per device is the measured 1-device step T1 (weak scaling keeps it constant "
        "as if every device had its own cores or GPU); communication is the alpha-beta fit of "
        "the primitive each strategy uses. DDP: a ring all-reduce of the K gradient buckets, of "
        "which all but the last bucket (fraction w of the bytes) may overlap the backward pass "
        "Tb. DP: ";
  md += declared_link
            ? "on separate GPUs, NCCL's reduce into device 0 and broadcast out of it pipeline "
              "chunks along a chain, so every link carries the S gradient bytes once "
              "(overlapping backward the same way). "
            : "everything passes through device 0: it adds the n-1 replicas' gradients in "
              "turn (overlapping backward the same way), then its parameters are copied to the "
              "n-1 replicas one after another. ";
  md += "Not modelled: contention for shared cores or memory "
        "bandwidth, DP's gather and loss over the global batch, stragglers. Every number "
        "needed to redo it by hand follows.\n";
  return md + projection_section(projection);
}

// Links to the multi-device traces and what each holds.
std::string traces_section(const std::vector<json>& rows) {
  std::string md = "\n## Traces\n\n";
  bool any_trace = false;
  for (const auto& r : rows)
    if (r.contains("trace") && r["trace"].is_string() && is_trace(r["trace"])) {
      if (r["devices"].get<int>() < 2) continue;
      any_trace = true;
      md += fmt::format("- [{} on {} devices]({}): {}\n", r["mode"] == "dp" ? "DP" : "DDP",
                        r["devices"].get<int>(), r["trace"].get<std::string>(),
                        r["mode"] == "dp"
                            ? "one process; a row per device, `comm` (the reduction thread), "
                              "`host`"
                            : "a process per rank; each with its device row, `comm` (the "
                              "all-reduce thread) and `host`");
    }
  md += any_trace ? "\nOpen them in `chrome://tracing` (Load) or https://ui.perfetto.dev (Open "
                    "trace file): backward on the device rows overlaps reduce/allreduce on the "
                    "`comm` rows.\n"
                  : "No traces in this report (run with --trace-dir or --report).\n";
  return md;
}

}  // namespace

void write_report(const ReportInputs& in) {
  REPLICA_CHECK(!in.rows.empty(), "no rows to report");
  std::string md = intro_section(in);

  std::vector<json> all = in.rows;
  all.insert(all.end(), in.compare.begin(), in.compare.end());
  auto image = [&](const std::string& name, const std::string& alt) {
    return std::find(in.plots.begin(), in.plots.end(), name) != in.plots.end()
               ? fmt::format("![{}]({})\n", alt, name)
               : std::string();
  };
  md += "## Throughput and scaling efficiency\n\n";
  if (!in.plot_note.empty()) md += "> No plots: " + in.plot_note + "\n\n";
  md += image("throughput.png", "samples/s against devices") +
        image("efficiency.png", "scaling efficiency against devices") + "\n";
  md += throughput_section(all);
  if (in.projection.is_array() && !in.projection.empty() && !in.plots.empty())
    md += "\nDashed lines in the plots are the **projection** (below), not measurements.\n";

  md += "\n## Where a step's time goes\n\n" + image("phases.png", "time per step by phase");
  md += "\nMilliseconds per step in each phase of the step's own track: DP's device 0, DDP's "
        "rank 0. `other` is the step time not inside those phases (for DP mostly device 0 "
        "waiting while the other replicas copy the new parameters: `broadcast`). Communication "
        "runs on its own thread during backward, so it is not a column here; see below.\n\n";
  md += phase_section(in.rows);

  md += "\n## Communication\n\n" + comm_section(in.rows, in.alpha_beta);
  md += "\n## Memory per device\n\n" + image("memory.png", "peak memory per device") + "\n" +
        memory_section(in.rows);
  md += projection_part(in.projection);

  if (!in.compare.empty()) {
    md += "\n## Side by side with PyTorch\n\nRows from ";
    for (size_t i = 0; i < in.compare_files.size(); ++i)
      md += (i ? ", " : "") + fmt::format("`{}`", in.compare_files[i]);
    md += " (same model, batch per device and synthetic data; see tools/pytorch_bench.py):\n\n";
    md += compare_section(in.rows, in.compare);
  }
  md += traces_section(in.rows);

  md += "\n## Files\n\n`results.jsonl` (one JSON object per configuration: every number above, "
        "per-track phase times, the environment), `results.csv`, `alpha_beta.json` (the "
        "communication measurements), `projection.json`.\n";
  const std::string path = (std::filesystem::path(in.dir) / "report.md").string();
  write_file_atomically(path, md);
}

}  // namespace replica::bench
