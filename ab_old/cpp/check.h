// Error helpers shared by the library's host code. Every failure throws cutlass_moe::Error with
// the file and line, never exits.
#pragma once

#include <sstream>
#include <string>

#include <cuda_runtime_api.h>

#include "cutlass_moe/cutlass_moe.h"

namespace cutlass_moe::detail {

// The message starts with what it is about (for argument errors, the argument's name, e.g.
// "x: K = 60 must be ...") and ends with where it was raised.
[[noreturn]] inline void throw_error(Status status, const char* file, int line, const std::string& msg) {
  std::ostringstream os;
  os << msg << " [cutlass_moe " << file << ":" << line << "]";
  throw Error(status, os.str());
}

}  // namespace cutlass_moe::detail

// CUTLASS_MOE_CHECK(cond, status, "expected ... got " << value)
#define CUTLASS_MOE_CHECK(cond, status, msg)                                            \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      std::ostringstream cutlass_moe_os_;                                               \
      cutlass_moe_os_ << msg;                                                           \
      ::cutlass_moe::detail::throw_error((status), __FILE__, __LINE__, cutlass_moe_os_.str()); \
    }                                                                                   \
  } while (0)

#define CUTLASS_MOE_CHECK_ARG(cond, msg) CUTLASS_MOE_CHECK(cond, ::cutlass_moe::Status::kInvalidArgument, msg)

#define CUTLASS_MOE_CHECK_CUDA(expr)                                                     \
  do {                                                                                  \
    cudaError_t cutlass_moe_err_ = (expr);                                              \
    CUTLASS_MOE_CHECK(cutlass_moe_err_ == cudaSuccess, ::cutlass_moe::Status::kCudaError, \
                      #expr << " failed: " << cudaGetErrorString(cutlass_moe_err_));    \
  } while (0)
