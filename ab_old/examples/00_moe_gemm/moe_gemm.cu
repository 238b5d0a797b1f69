// One MoE grouped GEMM through the torch-free C++ API (include/cutlass_moe/cutlass_moe.h).
//
// x (T x K) holds T tokens sorted by expert; expert e owns rows [start_e, start_e + tokens_e) of x
// and of out (T x N), and multiplies them by its weights W_e (K x N), stored as (E, K, N) or, with
// --trans-b, as (E, N, K) (nn.Linear). tokens_per_expert lives on the device, as an MoE router
// writes it, and the library never reads it on the host. This example draws the counts from one
// distribution, runs cutlass_moe::moe_gemm once, checks every expert's rows against a plain
// float32 reference GEMM, then times --iterations calls with CUDA events.
//
// The library takes raw device pointers, sizes and a caller-provided workspace (asked for with
// cutlass_moe::workspace_size and allocated once here): it never allocates or synchronizes.
//
// To run this example:
//
//   cmake --preset sm90 && cmake --build --preset sm90   # the preset sets CUTLASS_MOE_BUILD_EXAMPLES=ON
//   ./build/sm90/examples/00_moe_gemm --experts=8 --tokens=4096 --n=1024 --k=1024 --dist=random
//   ./build/sm90/examples/00_moe_gemm --trans-b --dtype=fp16 --backend=grouped --dist=hot
//   ./build/sm90/examples/00_moe_gemm --help
//   ctest --test-dir build/sm90 -R 00_moe_gemm   # the small problems registered with ctest
//
// It prints one line: ms per call, TFLOP/s (2*T*N*K flops), GB/s (x, the weights of experts with
// tokens, and out), the errors against the reference and PASS or FAIL (both < 1e-2). Exit status:
// 0 pass, 1 fail or error, 77 skipped (no CUDA device, or no kernel for it in this build).
#include <cstdio>

#include "example_utils.cuh"

int main(int argc, char** argv) {
  example::Options opts;  // defaults: E=8, T=4096, N=1024, K=1024, random counts
  const char* about = "00_moe_gemm: one cutlass_moe grouped GEMM, checked against a reference and timed.";
  if (!example::parse_options(argc, argv, about, opts)) return opts.help ? 0 : 1;

  return example::run_example([&] {
    const int device = example::print_device();
    const std::vector<int32_t> counts =
        example::make_tokens_per_expert(opts.experts, opts.tokens, opts.dist, opts.seed);

    cudaStream_t stream;
    EXAMPLE_CHECK_CUDA(cudaStreamCreate(&stream));
    example::Workload workload(opts, opts.tokens, stream);
    workload.route(counts);
    example::DeviceBuffer workspace(workload.workspace_size(device));  // throws kNotSupported: skip
    workload.fill_inputs();

    std::printf("%s, workspace %zu B\nT=%lld, %s counts: %s\n", example::describe_options(opts).c_str(),
                workspace.bytes(), static_cast<long long>(opts.tokens), example::distribution_name(opts.dist),
                example::describe_counts(counts).c_str());
    const example::Result r = workload.run(workspace);
    std::printf("moe_gemm: %.4f ms, %.1f TFLOP/s, %.1f GB/s, rel err %.2e, max err %.2e: %s\n", r.ms,
                r.tflops, r.gbps, r.errors.rel, r.errors.max, r.passed ? "PASS" : "FAIL");

    EXAMPLE_CHECK_CUDA(cudaStreamDestroy(stream));
    return r.passed ? 0 : 1;
  });
}
