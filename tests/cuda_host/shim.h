// A minimal host emulation of the CUDA execution model, enough to run simple kernels on the CPU.
//
// Included before a .cu file, it turns the CUDA qualifiers into plain C++ and provides the
// built-in index variables as globals. shim::launch(kernel, grid, block, args...) runs every
// block in turn; within a block each CUDA thread is a cooperative fiber (POSIX ucontext), so
// __syncthreads() is a real barrier: every thread of the block runs up to it before any goes
// past it. Threads run one at a time, in threadIdx order between barriers, which exposes a
// missing barrier as a wrong result. A barrier reached by some threads of a block while others
// have already returned (undefined behaviour on a GPU) raises shim::Error.
//
// __shared__ variables become function-local statics: one copy shared by the threads of the
// block that is running, which is all a block ever sees since blocks run one after another.
#pragma once

#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <ucontext.h>

struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
};

inline dim3 threadIdx, blockIdx, blockDim, gridDim;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __restrict__ __restrict

inline float __uint_as_float(unsigned int u) {
    float f;
    __builtin_memcpy(&f, &u, sizeof f);
    return f;
}

inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    __builtin_memcpy(&u, &f, sizeof u);
    return u;
}

namespace shim {

struct Error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

struct Fiber {
    ucontext_t context;
    std::vector<char> stack;
    dim3 index;
    bool at_barrier = false;
    bool done = false;
};

inline ucontext_t scheduler;
inline Fiber *current = nullptr;
inline void (*run_body)(void *) = nullptr;  // runs the kernel with its bound arguments
inline void *body_state = nullptr;
inline constexpr size_t kStackBytes = 64 * 1024;

inline void fiber_main() {
    run_body(body_state);
    current->done = true;
}  // returning resumes `scheduler` through uc_link

inline void barrier() {
    current->at_barrier = true;
    swapcontext(&current->context, &scheduler);
}

// Run one block: all its threads up to the next barrier, then all past it, until every one returns.
inline void run_block(std::vector<Fiber> &fibers) {
    for (Fiber &f : fibers) {
        getcontext(&f.context);
        f.context.uc_stack.ss_sp = f.stack.data();
        f.context.uc_stack.ss_size = f.stack.size();
        f.context.uc_link = &scheduler;
        f.at_barrier = f.done = false;
        makecontext(&f.context, fiber_main, 0);
    }
    for (;;) {
        size_t waiting = 0, finished = 0;
        for (Fiber &f : fibers) {
            if (f.done) {
                ++finished;
                continue;
            }
            f.at_barrier = false;
            current = &f;
            threadIdx = f.index;
            swapcontext(&scheduler, &f.context);
            if (f.at_barrier) {
                ++waiting;
            } else {
                ++finished;
            }
        }
        if (waiting == 0) {
            return;
        }
        if (finished != 0) {
            throw Error("__syncthreads() reached by " + std::to_string(waiting) + " threads of a block while " +
                        std::to_string(finished) + " had returned");
        }
    }
}

template <typename Kernel, typename... Args>
void launch(Kernel kernel, dim3 grid, dim3 block, Args... args) {
    struct Bound {
        Kernel kernel;
        std::tuple<Args...> args;
        static void run(void *self) {
            Bound *b = static_cast<Bound *>(self);
            std::apply(b->kernel, b->args);
        }
    } bound{kernel, std::tuple<Args...>(args...)};
    run_body = &Bound::run;
    body_state = &bound;
    gridDim = grid;
    blockDim = block;
    std::vector<Fiber> fibers(size_t(block.x) * block.y * block.z);
    size_t i = 0;
    for (unsigned z = 0; z < block.z; ++z)
        for (unsigned y = 0; y < block.y; ++y)
            for (unsigned x = 0; x < block.x; ++x, ++i) {
                fibers[i].index = dim3{x, y, z};
                fibers[i].stack.resize(kStackBytes);
            }
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                blockIdx = dim3{x, y, z};
                run_block(fibers);
            }
}

}  // namespace shim

inline void __syncthreads() { shim::barrier(); }
