// The flags that say how a device does its math, declared once for the programs that train
// (replica-train, replica-bench), so each means the same in both: --precision, --cudnn-benchmark
// and --memory-format (engine/context.h resolves them), and --cuda-graphs, which says how the
// step is issued. Header-only: programs link CLI11.
#pragma once
#include <string>

#include <CLI/CLI.hpp>

namespace replica {

// `scope` starts each help text with where the flag applies in that program ("" for all of it).
inline void add_math_flags(CLI::App& app, const std::string& scope, std::string& precision,
                           bool& cudnn_benchmark, std::string& memory_format) {
  app.add_option("--precision", precision,
                 scope + "GEMM and convolution math: fp32 (strict), tf32 (GPU tensor cores), "
                         "bf16 (mixed precision as PyTorch's autocast; rounded alike on CPUs), "
                         "auto (tf32 where every device has it, else fp32)")
      ->capture_default_str();
  app.add_flag("--cudnn-benchmark", cudnn_benchmark,
               scope + "GPUs: pick each convolution's algorithms by timing them, once per shape "
                       "(torch.backends.cudnn.benchmark; pytorch_bench.py --cudnn-benchmark)");
  app.add_option("--memory-format", memory_format,
                 scope + "GPUs: convolutions' operand layout: channels_last (NHWC copies, "
                         "cuDNN's tensor-core layout), nchw (in place), auto (channels_last in "
                         "bf16, else nchw; pytorch_bench.py --memory-format)")
      ->capture_default_str();
}

// --cuda-graphs (parallel/engines/captured_step.h).
inline void add_cuda_graphs_flag(CLI::App& app, const std::string& scope, bool& cuda_graphs) {
  app.add_flag("--cuda-graphs", cuda_graphs,
               scope + "one GPU: capture the training step once as a CUDA Graph and replay it "
                       "(one launch a step instead of one per kernel; after 2 eager steps)");
}

}  // namespace replica
