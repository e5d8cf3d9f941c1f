// What the kernels of mfpsn_cpu.cpp offer the torch operators of mfpsn_ops.cpp: the geometry of a tensor
// and one entry per kernel, instantiated for float and double in mfpsn_cpu_f32.cpp and mfpsn_cpu_f64.cpp
// (compiled side by side, without torch's headers). See mfpsn_cpu.cpp for what they compute.
#pragma once
#include <algorithm>
#include <cstdint>

// The surrogates' codes come from the package's surrogate table (ops/surrogate.py), given by the build
// as MFPSN_SG_<NAME>; the plain charge and the statistics' backward take codes no surrogate has.
#if !defined(MFPSN_SG_ATAN) || !defined(MFPSN_SG_SIGMOID)
#error "build with the surrogate codes of spikingjelly_mfpsn.ops.surrogate.cpp_defines()"
#endif
enum : int { MODE_CHARGE = 0, MODE_ATAN = MFPSN_SG_ATAN, MODE_SIGMOID = MFPSN_SG_SIGMOID, MODE_STATS = -1 };

// Steps x lanes of one tile, and the most lanes a tile has. Time-first tiles read long contiguous
// rows in place (wide tiles prefetch well); time-last tiles are gathered into buffers that should
// stay in the L1/L2 cache (benchmarked on an x86-64 CPU).
#ifndef MFPSN_TILE_FIRST
#define MFPSN_TILE_FIRST 16384
#endif
#ifndef MFPSN_TILE_LAST
#define MFPSN_TILE_LAST 4096
#endif
#ifndef MFPSN_TILE_LANES
#define MFPSN_TILE_LANES 512
#endif
// Time-first sweeps of sequences of at least MFPSN_PREFETCH_STEPS steps ask for each row's data
// MFPSN_PREFETCH bytes ahead of the lanes they read and write (0: never; see ahead()).
#ifndef MFPSN_PREFETCH
#define MFPSN_PREFETCH 512
#endif
#ifndef MFPSN_PREFETCH_STEPS
#define MFPSN_PREFETCH_STEPS 8
#endif
// Steps a thread's float partial sums run over before they go to float64 (see Partials).
#ifndef MFPSN_PARTIAL_STEPS
#define MFPSN_PARTIAL_STEPS 64
#endif

namespace mfpsn {

struct Geometry {
    int64_t T, N, C, F;
    int K, d;
    bool time_last;
    int64_t CF() const { return C * F; }
    // Taps i < first_tap() only ever read X before step 0 (their lag is >= T): they add nothing.
    int first_tap() const { return int(std::max<int64_t>(0, K - 1 - (T - 1) / d)); }
    int taps() const { return K - first_tap(); }
    // Lanes per tile (see MFPSN_TILE_*).
    int64_t tile() const {
        const int64_t budget = (time_last ? MFPSN_TILE_LAST : MFPSN_TILE_FIRST) / std::max<int64_t>(T, 1);
        return std::min<int64_t>(CF(), std::max<int64_t>(16, std::min<int64_t>(MFPSN_TILE_LANES, budget)));
    }
    int64_t tiles_per_block() const { return (CF() + tile() - 1) / tile(); }
    // Whether the sweeps prefetch (see ahead()).
    bool prefetch() const { return MFPSN_PREFETCH > 0 && !time_last && T >= MFPSN_PREFETCH_STEPS; }
    // Tile number -> (block n, first lane o0); returns its number of lanes. Lanes-major (the same lanes of consecutive blocks in turn)
    // for short sequences, where a thread's partial sums then run over many blocks (see Partials);
    // block-major otherwise, which reads whole rows in turn (timed side by side on an x86-64 CPU:
    // lanes-major 1.1-1.15x faster at T <= 4, 2-5 % slower from T = 8).
    int64_t tile_at(int64_t i, int64_t& n, int64_t& o0) const {
        const bool lanes_major = T <= 4;
        n = lanes_major ? i % N : i / tiles_per_block();
        o0 = (lanes_major ? i / N : i % tiles_per_block()) * tile();
        return std::min(tile(), CF() - o0);
    }
    // Offset of element (t, n, o).
    int64_t at(int64_t t, int64_t n, int64_t o) const {
        return time_last ? (n * CF() + o) * T + t : (t * N + n) * CF() + o;
    }
};

// H (spike 0) or the spikes into out; with mean and var (out null) the per-channel batch statistics instead.
template <typename S>
void run_forward(const Geometry& g, const S* x, const S* w, const S* b, S* out, int spike, S* mean, S* var, int threads);
// dL/dX into gx (added to it with accumulate), dL/dW and dL/db into gw and gb, each where not null.
template <typename S>
void run_backward(const Geometry& g, const S* x, const S* w, const S* b, const S* grad, int mode, S alpha,
                  const S* mean, const S* g_mean, const S* g_var, S* gx, int accumulate, S* gw, S* gb, int threads);
// A BN-threshold step; 1 (nothing written or updated) where the weights or their folding are not finite.
template <typename S>
int run_bn_forward(const Geometry& g, const S* x, const S* w, const S* gamma, const S* beta, double eps, int quantize,
                   int given, S* out, S* mean, S* var, S* wq, S* b, S* running_mean, S* running_var, double factor,
                   int threads);
template <typename S>
void run_bn_backward(const Geometry& g, const S* x, const S* w, const S* gamma, const S* mean, const S* var,
                     const S* wq, const S* b, const S* grad, int mode, S alpha, double eps, int ste, int given, S* gx,
                     S* g_w, S* g_gamma, S* g_beta, int threads);
// One single step without gradient; 1 (nothing written) where the weights or their folding are not finite.
template <typename S>
int run_step(const S* const* xs, const S* w, const S* gamma, const S* beta, const S* mean, const S* var, double eps,
             int quantize, const S* bias, S* out, int64_t N, int64_t C, int64_t F, int K, int threads);
// The width of the kernels' vectors, in bytes (see Vec).
template <typename S>
int vec_bytes();

}  // namespace mfpsn
