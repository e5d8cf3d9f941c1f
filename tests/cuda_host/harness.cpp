// The charge kernels compiled for the CPU: the very same mfpsn_charge.cu, included after the
// host shim, plus a C entry point that launches a kernel by name with CUDA-style argument
// pointers (one pointer per kernel parameter, as cuLaunchKernel takes them).
#include "shim.h"

#include "mfpsn_charge.cu"

#include <functional>
#include <map>
#include <utility>

namespace {

using Launch = std::function<void(dim3, dim3, void **, const size_t *, size_t)>;

template <typename... P, size_t... I>
void call(void (*kernel)(P...), dim3 grid, dim3 block, void **args, std::index_sequence<I...>) {
    shim::launch(kernel, grid, block, *static_cast<P *>(args[I])...);
}

// Checks the caller's argument count and sizes against the kernel's parameters before launching.
template <typename... P> Launch entry(void (*kernel)(P...)) {
    return [kernel](dim3 grid, dim3 block, void **args, const size_t *sizes, size_t nargs) {
        const size_t expected[] = {sizeof(P)...};
        if (nargs != sizeof...(P)) {
            throw shim::Error("kernel takes " + std::to_string(sizeof...(P)) + " arguments, got " +
                              std::to_string(nargs));
        }
        for (size_t i = 0; i < nargs; ++i) {
            if (sizes[i] != expected[i]) {
                throw shim::Error("argument " + std::to_string(i) + " has " + std::to_string(sizes[i]) +
                                  " bytes, the kernel parameter " + std::to_string(expected[i]));
            }
        }
        call(kernel, grid, block, args, std::index_sequence_for<P...>{});
    };
}

// Two kernels that check the shim itself: a block-wide reversal through shared memory, correct
// only if __syncthreads() is a real barrier, and a barrier skipped by thread 0, which must fail.
extern "C" __global__ void shim_check_barrier(int *out) {
    __shared__ int buf[MFPSN_BLOCK];
    buf[threadIdx.x] = (int)threadIdx.x;
    __syncthreads();
    out[blockIdx.x * MFPSN_BLOCK + threadIdx.x] = buf[MFPSN_BLOCK - 1 - threadIdx.x];
}

extern "C" __global__ void shim_check_divergence(int *out) {
    if (threadIdx.x == 0) {
        return;
    }
    __syncthreads();
    out[threadIdx.x] = 1;
}

#define MFPSN_ENTRIES(sfx, scalar_t, acc_t)                                                          \
    {"mfpsn_forward_" #sfx, entry(mfpsn_forward_##sfx)},                                             \
    {"mfpsn_grad_x_" #sfx, entry(mfpsn_grad_x_##sfx)},                                               \
    {"mfpsn_grad_wb_" #sfx, entry(mfpsn_grad_wb_##sfx)},                                             \
    {"mfpsn_forward_" #sfx "_i32", entry(mfpsn_forward_##sfx##_i32)},                                \
    {"mfpsn_grad_x_" #sfx "_i32", entry(mfpsn_grad_x_##sfx##_i32)},                                  \
    {"mfpsn_grad_wb_" #sfx "_i32", entry(mfpsn_grad_wb_##sfx##_i32)},

const std::map<std::string, Launch> kKernels = {
    MFPSN_DTYPES(MFPSN_ENTRIES)
    {"shim_check_barrier", entry(shim_check_barrier)},
    {"shim_check_divergence", entry(shim_check_divergence)},
};

std::string last_error;

}  // namespace

// Launch kernel `name` on a 1-D grid. args[i] points to the value of parameter i, which has
// sizes[i] bytes. Returns 0 on success; otherwise non-zero and shim_last_error() says why.
extern "C" int shim_launch(const char *name, unsigned int blocks, unsigned int threads, void **args,
                           const size_t *sizes, size_t nargs) {
    auto it = kKernels.find(name);
    if (it == kKernels.end()) {
        last_error = std::string("no kernel named ") + name;
        return 1;
    }
    if (threads != MFPSN_BLOCK) {
        last_error = "launched with " + std::to_string(threads) + " threads per block, compiled for " +
                     std::to_string(MFPSN_BLOCK);
        return 1;
    }
    try {
        it->second(dim3{blocks, 1, 1}, dim3{threads, 1, 1}, args, sizes, nargs);
    } catch (const std::exception &e) {
        last_error = e.what();
        return 1;
    }
    return 0;
}

extern "C" const char *shim_last_error() { return last_error.c_str(); }

extern "C" int shim_block() { return MFPSN_BLOCK; }
