// The tables of a scaling report (report.md): one function per section, each Markdown over the
// rows replica-bench measured and, for the side-by-side section, rows of other engines.
// report_md.cpp puts them on the page between the prose that says how to read them.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace replica::bench {

// Throughput, speed-up and efficiency per engine, mode, precision and device count.
std::string throughput_section(const std::vector<nlohmann::json>& rows);
// Milliseconds per step in each phase of the step's own track.
std::string phase_section(const std::vector<nlohmann::json>& rows);
// Bytes moved per step, bus bandwidth, the alpha-beta fit and how much backward hid.
std::string comm_section(const std::vector<nlohmann::json>& rows, const nlohmann::json& alpha_beta);
// Peak memory per device.
std::string memory_section(const std::vector<nlohmann::json>& rows);
// The projection's inputs and its rows (build_projection()).
std::string projection_section(const nlohmann::json& projection);
// replica's rows beside another engine's at equal model, batch, precision and devices.
std::string compare_section(const std::vector<nlohmann::json>& rows,
                            const std::vector<nlohmann::json>& compare);

// "444 B" / "1.2 MB" / "3.4 GB" (decimal units), for tables.
std::string format_bytes(double bytes);
// j[key] as a number, or fallback when j has no number there.
double num(const nlohmann::json& j, const char* key, double fallback = 0);
// j[key] where it is a string, else `fallback`: other engines' rows write null (Python's None)
// for what they have not, such as a DP row's backend.
std::string text(const nlohmann::json& j, const char* key, const std::string& fallback = "");
// Device 0's entry of a row's per-device bytes (peak_memory_bytes, peak_held_bytes) as
// format_bytes() writes it, or "-" where the row has none (PyTorch's CPU rows, older rows).
std::string device0_bytes(const nlohmann::json& row, const char* key);
// Whether s names a trace file (.json).
bool is_trace(const std::string& s);

}  // namespace replica::bench
