// A decode-like sweep: fixed experts and weights, few tokens per expert.
//
// In MoE decoding each step routes a small batch, so every expert multiplies only a handful of
// rows by its full K x N weight matrix: the GEMMs are thin and the time goes to reading weights.
// This example keeps E, N and K fixed and sweeps tokens per expert over 1, 2, 4, ..., 128
// (T = E * tokens/expert; --dist spreads those T rows, uniform by default), checking each point
// against a float32 reference and timing it with CUDA events. GB/s counts x, the weights of the
// experts that have tokens, and out: at decode sizes it is the number to hold against the GPU's
// memory bandwidth.
//
// To run this example:
//
//   cmake --preset sm90 && cmake --build --preset sm90   # the preset sets CUTLASS_MOE_BUILD_EXAMPLES=ON
//   ./build/sm90/examples/01_decode_sweep --experts=64 --n=2048 --k=2048
//   ./build/sm90/examples/01_decode_sweep --experts=128 --n=1536 --k=2048 --trans-b --dist=decode
//   ./build/sm90/examples/01_decode_sweep --help
//   ctest --test-dir build/sm90 -R 01_decode_sweep   # the small problems registered with ctest
//
// Exit status: 0 if every point passes (errors < 1e-2), 1 if any fails or on error, 77
// skipped (no CUDA device, or no kernel for it in this build).
#include <algorithm>
#include <cstdio>
#include <iterator>

#include "example_utils.cuh"

int main(int argc, char** argv) {
  example::Options opts;
  opts.experts = 64;
  opts.n = 2048;
  opts.k = 2048;
  opts.dist = example::Distribution::kUniform;
  opts.takes_tokens = false;  // T = E * tokens/expert at each point
  const char* about =
      "01_decode_sweep: cutlass_moe grouped GEMM at 1..128 tokens per expert, checked and timed.";
  if (!example::parse_options(argc, argv, about, opts)) return opts.help ? 0 : 1;

  const int tokens_per_expert[] = {1, 2, 4, 8, 16, 32, 64, 128};
  auto counts_at = [&](int tpe) {
    return example::make_tokens_per_expert(opts.experts, opts.experts * tpe, opts.dist, opts.seed);
  };

  return example::run_example([&] {
    const int device = example::print_device();
    cudaStream_t stream;
    EXAMPLE_CHECK_CUDA(cudaStreamCreate(&stream));
    const int max_tpe = tokens_per_expert[std::size(tokens_per_expert) - 1];
    example::Workload workload(opts, opts.experts * max_tpe, stream);

    // One workspace, the largest any point needs, allocated before anything is timed.
    size_t workspace_bytes = 0;
    for (int tpe : tokens_per_expert) {
      workload.route(counts_at(tpe));
      workspace_bytes = std::max(workspace_bytes, workload.workspace_size(device));  // kNotSupported: skip
    }
    example::DeviceBuffer workspace(workspace_bytes);
    workload.fill_inputs();

    std::printf("%s, workspace %zu B\n", example::describe_options(opts).c_str(), workspace_bytes);
    std::printf("T = E x tokens/expert, %s counts\n", example::distribution_name(opts.dist));
    std::printf("%13s %8s %10s %9s %9s %9s %9s  %s\n", "tokens/expert", "T", "ms", "TFLOP/s", "GB/s",
                "rel err", "max err", "check");
    int failures = 0;
    for (int tpe : tokens_per_expert) {
      workload.route(counts_at(tpe));
      const example::Result r = workload.run(workspace);
      failures += r.passed ? 0 : 1;
      std::printf("%13d %8lld %10.4f %9.1f %9.1f %9.2e %9.2e  %s\n", tpe,
                  static_cast<long long>(workload.problem().num_tokens), r.ms, r.tflops, r.gbps, r.errors.rel,
                  r.errors.max, r.passed ? "PASS" : "FAIL");
    }
    std::printf("%s: %d of %zu points failed\n", failures ? "FAIL" : "PASS", failures,
                std::size(tokens_per_expert));

    EXAMPLE_CHECK_CUDA(cudaStreamDestroy(stream));
    return failures == 0 ? 0 : 1;
  });
}
