// Fused CPU kernels of the MF-PSN charge (plain C++ with OpenMP; torch operators in mfpsn_ops.cpp).
//
// A multi-step tensor is seen as N blocks of CF lanes (CF = C * F, F the product of the feature
// dims), each lane a sequence of T steps. Lane o of a block has channel o / F. Element (t, n, o) is at
//   time-first (T, N, C, ...) contiguous:  (t * N + n) * CF + o
//   time-last  (N, C, ..., T) contiguous:  (n * CF + o) * T + t
// Work is split into tiles of up to L lanes of one block x all T steps. A tile is a table of row
// pointers, one row of L lanes per step. Time-first rows are read and written in place; time-last
// tiles are gathered into a small [T][L] buffer and scattered back.
// Within a tile, every kernel runs column-wise, one dilation phase (steps r, r + d, r + 2d, ...) at a
// time: a vector of lanes (or, for low orders, a cache line's worth of vectors side by side) goes
// through the phase's steps with the taps' weights, the sums and a window of the phase's last K
// inputs in registers (every tap reads within the phase), so each step loads one input row and writes
// at most one output row. The backward goes down in time, with a
// second window of the later steps' dH, so dL/dX comes out of the same sweep. (Phases as the outer
// loop: each pass then walks only T / d rows of the tile; timed side by side on an x86-64 CPU, the
// phases inside each lane's sweep were up to 1.4x slower at d = 3 on large tensors.)
// Orders up to 8 run kernels with the tap loop unrolled, one per order (no zero-weight padding taps: a
// padding tap would multiply a NaN or inf input by zero and spread it beyond the taps' window); taps
// whose lag reaches past the first step are dropped (they only read zeros).
// Per-lane constants (weights, bias) are laid out once per call as [K][CF] arrays; per-lane sums go,
// channel by channel, to per-thread [.][C] float64 accumulators, added in thread order at the end (no
// atomics: the same result for the same thread count).
//
//   charge:  H[t] = sum_i W[c, i] * X[t - (K-1-i) * d] + b[c]          (X[t < 0] = 0)
//   fire:    S[t] = (H[t] >= 0)
//   stats:   per-channel mean and biased variance of Y = charge without bias (Y is not written; float64
//            sums of Y - shift, shift a sample of Y per channel: see output_sample)
//   backward, dH formed on the fly from a recomputed H (kept in registers only):
//     MODE_CHARGE   dH = G                   (plain charge)
//     MODE_ATAN     dH = G * atan'(H)        (fire with SpikingJelly's ATan surrogate)
//     MODE_SIGMOID  dH = G * sigmoid'(H)     (fire with SpikingJelly's Sigmoid surrogate)
//     MODE_STATS    dH = A[c] * Y + B[c]     (backward of the batch statistics, from dL/dmean and dL/dvar)
//     dX[t] = sum_i W[c, i] * dH[t + (K-1-i) * d]  (written, or added to what dX holds: accumulate)
//     dW[c, i] = sum dH[t] X[t - (K-1-i) * d];  db[c] = sum dH
#include "mfpsn_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

namespace mfpsn {
namespace {

int thread_id() {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

// dst[c * dst_stride + r] = src[r * src_stride + c] for r < rows, c < cols: the gather (lanes x steps
// -> steps x lanes) and scatter of time-last tiles. Blocks of 8 x 8 are transposed in registers
// (three rounds of two-vector shuffles) where the compiler has __builtin_shufflevector; the edges,
// and everything elsewhere, element by element.
template <typename S>
struct Eight {
    typedef S type __attribute__((vector_size(8 * sizeof(S))));
};

template <typename S>
void transpose(const S* __restrict src, int64_t src_stride, S* __restrict dst, int64_t dst_stride, int64_t rows,
               int64_t cols) {
    int64_t r0 = 0, c0 = 0;
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
    using V = typename Eight<S>::type;
    const int64_t rows8 = rows - rows % 8, cols8 = cols - cols % 8;
    for (int64_t r = 0; r < rows8; r += 8)
        for (int64_t c = 0; c < cols8; c += 8) {
            V a[8], b[8];
            for (int i = 0; i < 8; ++i) std::memcpy(&a[i], src + (r + i) * src_stride + c, sizeof(V));
            for (int i = 0; i < 8; i += 2) {  // interleave pairs of rows
                b[i] = __builtin_shufflevector(a[i], a[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
                b[i + 1] = __builtin_shufflevector(a[i], a[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
            }
            for (int i = 0; i < 8; i += 4) {  // then pairs of pairs
                a[i] = __builtin_shufflevector(b[i], b[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
                a[i + 1] = __builtin_shufflevector(b[i], b[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
                a[i + 2] = __builtin_shufflevector(b[i + 1], b[i + 3], 0, 1, 8, 9, 4, 5, 12, 13);
                a[i + 3] = __builtin_shufflevector(b[i + 1], b[i + 3], 2, 3, 10, 11, 6, 7, 14, 15);
            }
            for (int i = 0; i < 4; ++i) {  // then halves: column i and i + 4 of the block
                b[i] = __builtin_shufflevector(a[i], a[i + 4], 0, 1, 2, 3, 8, 9, 10, 11);
                b[i + 4] = __builtin_shufflevector(a[i], a[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
            }
            for (int i = 0; i < 8; ++i) std::memcpy(dst + (c + i) * dst_stride + r, &b[i], sizeof(V));
        }
    r0 = rows8;
    c0 = cols8;
    for (int64_t r = 0; r < rows8; ++r)  // the columns past the last whole block
        for (int64_t c = c0; c < cols; ++c) dst[c * dst_stride + r] = src[r * src_stride + c];
#endif
    // The rows past the last whole block (or every row), the outer loop over the longer side: runs
    // of the shorter side are written (or read) with a stride, whole rows of the longer one are not.
    if (rows - r0 >= cols) {
        for (int64_t r = r0; r < rows; ++r)
            for (int64_t c = 0; c < cols; ++c) dst[c * dst_stride + r] = src[r * src_stride + c];
    } else {
        for (int64_t c = 0; c < cols; ++c)
            for (int64_t r = r0; r < rows; ++r) dst[c * dst_stride + r] = src[r * src_stride + c];
    }
}

// One thread's view of a tile of a global tensor: rows()[t] is step t's L lanes. Time-first rows point
// into the tensor; time-last rows into a buffer.
template <typename S>
class Tile {
  public:
    Tile(const Geometry& g, int64_t L) : g_(g), ptr_(g.T), buf_(g.time_last ? g.T * L : 0) {}
    // Point the rows at tile (n, o0 .. o0+m) of src (read: gathered for time-last).
    void read(const S* src, int64_t n, int64_t o0, int64_t m) {
        if (!g_.time_last) {
            for (int64_t t = 0; t < g_.T; ++t) ptr_[t] = const_cast<S*>(src) + g_.at(t, n, o0);
            return;
        }
        transpose(src + g_.at(0, n, o0), g_.T, buf_.data(), m, m, g_.T);  // lanes x steps -> steps x lanes
        point_at_buffer(m);
    }
    // Point the rows at tile (n, o0 .. o0+m) of dst for writing (a buffer for time-last: see flush).
    void write(S* dst, int64_t n, int64_t o0, int64_t m) {
        if (!g_.time_last) {
            for (int64_t t = 0; t < g_.T; ++t) ptr_[t] = dst + g_.at(t, n, o0);
            return;
        }
        point_at_buffer(m);
    }
    // Scatter a time-last buffer written through the rows to tile (n, o0 .. o0+m) of dst.
    void flush(S* dst, int64_t n, int64_t o0, int64_t m) const {
        if (!g_.time_last) return;
        transpose(buf_.data(), m, dst + g_.at(0, n, o0), g_.T, g_.T, m);
    }
    S* const* rows() const { return ptr_.data(); }

  private:
    void point_at_buffer(int64_t m) {
        for (int64_t t = 0; t < g_.T; ++t) ptr_[t] = buf_.data() + t * m;
    }
    const Geometry& g_;
    std::vector<S*> ptr_;
    std::vector<S> buf_;
};

// Zeros for n lanes, kept between calls (one table per calling thread).
template <typename S>
const S* zeros(int64_t n) {
    thread_local std::vector<S> z;
    if (int64_t(z.size()) < n) z.assign(n, S(0));
    return z.data();
}

// A per-lane table (rows of CF lanes) a call reads: its own memory, or the shared zeros.
template <typename S>
struct Table {
    std::unique_ptr<S[]> own;
    const S* ptr;
    const S* data() const { return ptr; }
};

// Per-lane copy of a per-channel vector: out[o] = v[o / F] (the zeros for a null v).
template <typename S>
Table<S> per_lane(const Geometry& g, const S* v) {
    if (!v) return {nullptr, zeros<S>(g.CF())};
    std::unique_ptr<S[]> out(new S[g.CF()]);  // every entry written below
    for (int64_t c = 0; c < g.C; ++c) std::fill_n(out.get() + c * g.F, g.F, v[c]);
    const S* ptr = out.get();
    return {std::move(out), ptr};
}

// Add per-thread per-channel sums [threads][count][C] into out[c * c_stride + j * j_stride], in thread order.
void reduce_threads(const Geometry& g, const std::vector<double>& acc, int threads, int count, double* out,
                    int64_t c_stride, int64_t j_stride) {
    for (int j = 0; j < count; ++j)
        for (int64_t c = 0; c < g.C; ++c) {
            double s = 0.0;
            for (int th = 0; th < threads; ++th) s += acc[(size_t(th) * count + j) * g.C + c];
            out[c * c_stride + j * j_stride] = s;
        }
}

// Add a tile's per-lane partial sums (count rows of m lanes from lane o0, in S) to per-channel float64
// accumulators acc[j * C + c]: each channel's run of lanes is summed in float64, then added.
template <typename S>
void add_partials(const Geometry& g, const S* part, int count, int64_t o0, int64_t m, double* acc) {
    for (int j = 0; j < count; ++j) {
        const S* row = part + j * m;
        if (g.F == 1) {  // a lane per channel
            double* a = acc + j * g.C + o0;
#pragma omp simd
            for (int64_t l = 0; l < m; ++l) a[l] += row[l];
            continue;
        }
        int64_t c = o0 / g.F, l = 0;
        for (int64_t end = std::min(m, (c + 1) * g.F - o0); l < m; l = end, end = std::min(m, end + g.F), ++c) {
            double s = 0.0;
#pragma omp simd reduction(+ : s)  // vector partial sums: a fixed order for a given build
            for (int64_t i = l; i < end; ++i) s += row[i];
            acc[j * g.C + c] += s;
        }
    }
}

// A thread's per-lane partial sums of the current tile's lanes (count rows of m, in S). Tiles are
// numbered lanes-major, so a thread's consecutive tiles are mostly the same lanes of consecutive
// blocks: they keep adding to the same partial sums, which go to the thread's float64 accumulators
// (acc, [count][C]) only when the lanes change or after MFPSN_PARTIAL_STEPS steps (short float
// sums). At small T that saves most of the float64 passes, which would otherwise cost as much as the
// sweep itself.
template <typename S>
class Partials {
  public:
    Partials(const Geometry& g, int count, int64_t L, double* acc)
        : g_(g), count_(count), acc_(acc), part_(count * L, S(0)) {}
    // The sums a tile of m lanes from o0 over T steps adds to.
    S* take(int64_t o0, int64_t m, int64_t T) {
        if (o0 != o0_ || steps_ + T > MFPSN_PARTIAL_STEPS) {
            flush();
            o0_ = o0;
            m_ = m;
        }
        steps_ += T;
        return part_.data();
    }
    void flush() {
        if (steps_ == 0) return;
        add_partials(g_, part_.data(), count_, o0_, m_, acc_);
        std::fill(part_.begin(), part_.begin() + count_ * m_, S(0));
        steps_ = 0;
    }

  private:
    const Geometry& g_;
    int count_;
    int64_t o0_ = -1, m_ = 0, steps_ = 0;
    double* acc_;
    std::vector<S> part_;
};

// The per-lane weights [KP][CF] of the KP = g.taps() taps a kernel runs, those that matter (see
// Geometry::first_tap). Tap j reads X[t - (KP-1-j) * d].
template <typename S>
Table<S> tap_weights(const Geometry& g, const S* weight, int KP) {
    std::unique_ptr<S[]> out(new S[size_t(KP) * g.CF()]);
    const int first = g.first_tap();
    for (int j = 0; j < KP; ++j)
        for (int64_t c = 0; c < g.C; ++c)
            std::fill_n(out.get() + j * g.CF() + c * g.F, g.F, weight[c * g.K + first + j]);
    const S* ptr = out.get();
    return {std::move(out), ptr};
}

// W lanes at a time: V is a GCC/Clang vector of MFPSN_VEC_BYTES bytes of S, or S itself for the last
// lanes of a row. By default one vector register of the target: AVX-512's 64 bytes, AVX's 32, else 16
// (SSE, NEON). A vector wider than the registers is split by the compiler into several, and the
// unrolled tap loops' windows and weights then no longer fit in the 16 AVX registers. Timed side by
// side on an AVX2 x86-64 CPU (a training step of the neuron, k 2-8, T 4 and 16): 64-byte vectors
// 1.5-2.8x slower than 32-byte ones, 16-byte ones 1.1-1.5x. tests/test_cpp.py checks every width.
#ifndef MFPSN_VEC_BYTES
#if defined(__AVX512F__)
#define MFPSN_VEC_BYTES 64
#elif defined(__AVX__)
#define MFPSN_VEC_BYTES 32
#else
#define MFPSN_VEC_BYTES 16
#endif
#endif
template <typename S>
struct VecOf {
    typedef S type __attribute__((vector_size(MFPSN_VEC_BYTES)));
};
template <typename S>
using Vec = typename VecOf<S>::type;

template <typename V>
inline V load(const void* p) {
    V v;
    std::memcpy(&v, p, sizeof(V));
    return v;
}
template <typename V>
inline void store(void* p, V v) {
    std::memcpy(p, &v, sizeof(V));
}

// Theta(h) as 0/1 in h's type (a vector or a scalar of S).
template <typename S, typename V>
inline V heaviside(V h) {
    if constexpr (std::is_same_v<V, S>)
        return h >= S(0) ? S(1) : S(0);
    else
        return __builtin_convertvector(-(h >= S(0)), V);
}

// Whether every lane of v is 0.
template <typename S, typename V>
inline bool all_zero(V v) {
    if constexpr (std::is_same_v<V, S>) {
        return v == S(0);
    } else {
        bool all = true;
        for (int i = 0; i < int(sizeof(V) / sizeof(S)); ++i) all &= v[i] == S(0);
        return all;
    }
}

// Where a float charge h is not finite (a sum that overflowed on the way, or a NaN or inf input), h
// recomputed in double from the same K weights w[j] and inputs x[j] and the bias b, in the same order:
// the spike of a charge beyond float's range is then the sign of the exact sum, as in every method
// (a NaN or inf input gives what it gives in double). A double h is returned as it is. It runs in a
// second sweep of the lanes where the first found such a charge (see forward_lanes).
template <typename S, typename V>
inline V exact_if_overflowed(V h, const V* w, const V* x, int K, V b) {
    if constexpr (std::is_same_v<S, double>) {
        return h;
    } else if constexpr (std::is_same_v<V, S>) {
        if (h - h == S(0)) return h;
        double acc = double(b);
        for (int j = 0; j < K; ++j) acc += double(w[j]) * double(x[j]);
        return S(acc);
    } else {
        constexpr int W = sizeof(V) / sizeof(S);
        const auto finite = (h - h) == S(0);  // lanes of -1 (finite) or 0
        for (int i = 0; i < W; ++i) {
            if (finite[i]) continue;
            double acc = double(b[i]);
            for (int j = 0; j < K; ++j) acc += double(w[j][i]) * double(x[j][i]);
            h[i] = S(acc);
        }
        return h;
    }
}

// x / y. Where the compiler targets AVX-512, float vectors multiply by the 14-bit reciprocal estimate
// after one Newton step (relative error about 2^-27, a few times cheaper than a division); everything
// else divides. Where y is infinite the estimate is 0 and the step's y * r is NaN: those lanes keep
// the estimate (x / inf = 0, as a division gives).
template <typename S, typename V>
inline V divide(S x, V y) {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<S, float> && sizeof(V) == 64) {
        const V r = reinterpret_cast<V>(_mm512_maskz_rcp14_ps(0xFFFF, reinterpret_cast<__m512>(y)));
        const V yr = y * r;
        return x * (yr == yr ? r * (S(2) - yr) : r);
    }
#endif
    return x / y;
}

// The surrogate's derivative at h, with c = pi / 2 * alpha and half = alpha / 2 precomputed:
// ATan half / (1 + (c * h)^2), Sigmoid alpha * s * (1 - s) with s = sigmoid(alpha * h)
// (lane by lane: no vector exp).
template <typename S, typename V, int MODE>
inline V surrogate_grad(V h, S alpha, S c, S half) {
    if constexpr (MODE == MODE_ATAN) {
        const V a = c * h;
        return divide<S, V>(half, S(1) + a * a);
    } else if constexpr (std::is_same_v<V, S>) {
        const S s = S(1) / (S(1) + std::exp(-alpha * h));
        return alpha * s * (S(1) - s);
    } else {
        V r;
        for (size_t i = 0; i < sizeof(V) / sizeof(S); ++i) r[i] = surrogate_grad<S, S, MODE>(S(h[i]), alpha, c, half);
        return r;
    }
}

// What one tile's kernels read and write, rows as in Tile; per-lane constants start at the tile's
// first lane. K taps (KT of them when KT > 0, so that the tap loops unroll and the per-tap values
// stay in registers), tap j reading X[t - (K-1-j) * d].
template <typename S>
struct TileArgs {
    const Tile<S>* x;      // input rows
    const Tile<S>* grad;   // dL/dout rows (every backward mode but MODE_STATS), or null
    Tile<S>* out;          // output rows: H or S (forward), dL/dX (backward); or null
    const S* const* w;     // [K] per-lane weights
    const S *b, *a, *c;    // per-lane bias; MODE_STATS coefficients
    S* part;               // [count][m] per-lane partial sums of this tile
    Vec<S>* vec;           // [2 forward, 4 backward][K] scratch for KT == 0: vectors
    S* one;                // the same for single lanes
    int64_t T, m, d;
    int K;
    bool sums, accumulate;  // sums to part; dL/dX added to what out holds
    S alpha;
    bool ahead;  // prefetch the rows (Geometry::prefetch)
};

// Vectors a column sweep can run side by side: a 64-byte cache line of lanes (one vector with AVX-512,
// two with AVX, four with 16-byte vectors). A sweep of one vector narrower than a line leaves the rest
// of each line it reads and writes to the next sweep, and the rows of a time-first tensor, a multiple
// of a large power of two bytes apart (64 x 256 floats per step: 64 KiB), fall in the same cache sets,
// so by then the lines are gone and are read again. Timed on an AVX2 x86-64 CPU, each kernel alone
// against single vectors (32-byte vectors, 2 threads, T = 16 and 32, 64 x 256, 63 x 260 and
// 16 x 4096 lanes per step): two side by side took 0.53-0.96x the time in the statistics passes
// (orders 2 and 4), 0.56-0.95x in the spike passes on the FC shapes but 0.81-1.21x on the conv one,
// and 0.83-1.05x in the order-2 backward passes. Side by side, a sweep keeps every vector's weights,
// windows and sums in registers; where that is more than the 16 AVX registers hold, the spills cost
// more than the lines save, so lines are swept only by kernels of orders up to side_by_side's bound
// (side by side, the order-4 backward and the order-8 sweeps took 0.85-1.64x the time).
#ifndef MFPSN_LINE_VECS
#define MFPSN_LINE_VECS (MFPSN_VEC_BYTES >= 64 ? 1 : 64 / MFPSN_VEC_BYTES)
#endif
// Vectors side by side for a kernel of KT unrolled taps (0: the generic kernel) that keeps about
// `per_tap` vectors per tap in registers (forward: weight and window; backward: those, dH's window
// and dW's sums).
constexpr int side_by_side(int KT, int per_tap) { return KT >= 1 && KT * per_tap <= 8 ? MFPSN_LINE_VECS : 1; }

// Run a column-wise kernel over a tile, phase by phase (steps r, r + d, ...; the phases read and write
// disjoint rows): for each, over the m lanes, whole lines of vectors, whole vectors, then the last
// lanes one by one. Kernel::lanes<V, U>(p, l, r) runs U vectors V (or U = 1 single lanes, V = S) from
// lane l.
template <typename S, typename Kernel>
void columns(const TileArgs<S>& p) {
    using V = Vec<S>;
    constexpr int64_t W = sizeof(V) / sizeof(S);
    constexpr int U = Kernel::line;
    for (int64_t r = 0; r < std::min(p.d, p.T); ++r) {
        int64_t l = 0;
        if constexpr (U > 1)
            for (; l + U * W <= p.m; l += U * W) Kernel::template lanes<V, U>(p, l, r);
        for (; l + W <= p.m; l += W) Kernel::template lanes<V, 1>(p, l, r);
        for (; l < p.m; ++l) Kernel::template lanes<S, 1>(p, l, r);
    }
}

// Column-wise kernels: lanes l .. l + U * W (U vectors V of W lanes, or one lane, V = S) over the steps
// of phase r, with the per-tap values, the windows and the sums in registers (KT > 0), or in the
// tile's scratch (KT == 0, one vector at a time: side_by_side(0, .) is 1). Vector u's values of tap j
// are at [u * K + j] (separate vectors, not one wide type: GCC keeps arrays of a wider struct or
// vector type in memory, 2-4x slower).
template <typename S, typename V>
inline V* scratch(const TileArgs<S>& p, int which) {
    if constexpr (std::is_same_v<V, S>)
        return p.one + which * p.K;
    else
        return p.vec + which * p.K;
}

// Ask for the line MFPSN_PREFETCH bytes past p (RW 1: to be written). A time-first tile's sweep reads
// and writes one line in each of T rows, rows a step's whole tensor apart, and the next sweep the next
// line of each: T streams at once, which the hardware prefetcher follows at T = 4 but not at T >= 8
// once the tensors are in memory rather than in the cache. Timed on an AVX2 x86-64 CPU (2 threads,
// 64 x 256 and 16 x 4096 lanes per step, orders 2 and 8): each sweep alone with the caches flushed
// before it took 0.62-0.90x the time at T = 16 and 32, 0.85-1.06x at T = 8 and 0.93-1.09x at T = 4; with
// the tensors in the cache 0.69-1.07x at T = 16 but 0.98-1.18x at T = 4; a training step of the neuron
// (tensors in the cache) 0.63-0.93x at T = 16 and 32, 0.97-1.04x at T = 8, 1.01-1.07x at T = 4.
// Time-last tiles run from a buffer in the cache (no gain measured there). The address is formed as an
// integer: it may lie past the tensor, which a prefetch never faults on.
template <int RW, typename S>
inline void ahead(const S* p) {
    __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + MFPSN_PREFETCH), RW, 3);
}

// Forward, in ascending time, by OUT (a compile-time choice: no branch in the sweep): SUMS adds sum H
// and sum H^2 to part and writes nothing; CHARGE writes H to out; SPIKES writes S. win[u * K + j] holds
// vector u's X[t - (K-1-j) * d] (zero before step 0).
enum Out { SUMS, CHARGE, SPIKES };

template <typename S, typename V, int KT, int OUT, int U>
void forward_lanes(const TileArgs<S>& p, int64_t l, int64_t r) {
    static_assert(KT > 0 || U == 1, "the generic kernel's scratch holds one vector's values");
    constexpr int64_t W = sizeof(V) / sizeof(S);
    const int K = KT > 0 ? KT : p.K;
    V w_[KT > 0 ? U * KT : 1], win_[KT > 0 ? U * KT : 1];
    V* w = KT > 0 ? w_ : scratch<S, V>(p, 0);
    V* win = KT > 0 ? win_ : scratch<S, V>(p, 1);
    const V zero = V{} * S(0);
    V b[U], s1[U], s2[U];
    for (int u = 0; u < U; ++u) {
        for (int j = 0; j < K; ++j) w[u * K + j] = load<V>(p.w[j] + l + u * W);
        b[u] = load<V>(p.b + l + u * W);
        s1[u] = s2[u] = zero;
    }
    S* const* xr = p.x->rows();
    S* const* outs = p.out ? p.out->rows() : nullptr;
    const int64_t T = p.T, d = p.d;
    // The sweep; for spikes, CHECK (a second sweep, only where a float charge of the first was not finite:
    // s1 adds up h - h, 0 while every h is) recomputes such charges in double (exact_if_overflowed).
    auto sweep = [&](auto check) {
        for (int u = 0; u < U; ++u)
            for (int j = 0; j < K; ++j) win[u * K + j] = zero;
        for (int64_t t = r; t < T; t += d) {
            if (p.ahead) {
                ahead<0>(xr[t] + l);
                if constexpr (OUT != SUMS) ahead<1>(outs[t] + l);
            }
            for (int u = 0; u < U; ++u) {
                V* x = win + u * K;
                for (int j = 0; j + 1 < K; ++j) x[j] = x[j + 1];
                x[K - 1] = load<V>(xr[t] + l + u * W);
                V h = b[u];
                for (int j = 0; j < K; ++j) h += w[u * K + j] * x[j];
                if constexpr (OUT == CHARGE) store(outs[t] + l + u * W, h);
                if constexpr (OUT == SPIKES) {
                    if constexpr (decltype(check)::value)
                        h = exact_if_overflowed<S, V>(h, w + u * K, x, K, b[u]);
                    else
                        s1[u] += h - h;
                    store(outs[t] + l + u * W, heaviside<S, V>(h));
                }
                if constexpr (OUT == SUMS) {
                    s1[u] += h;
                    s2[u] += h * h;
                }
            }
        }
    };
    sweep(std::false_type{});
    if constexpr (OUT == SPIKES && !std::is_same_v<S, double>) {
        bool finite = true;
        for (int u = 0; u < U; ++u) finite &= all_zero<S, V>(s1[u]);
        if (!finite) sweep(std::true_type{});
    }
    if constexpr (OUT == SUMS)
        for (int u = 0; u < U; ++u) {
            S* part = p.part + l + u * W;
            store(part, load<V>(part) + s1[u]);
            store(part + p.m, load<V>(part + p.m) + s2[u]);
        }
}

// Backward, in descending time: dH[t] from the recomputed H (where a float one is not finite, the double one
// of exact_if_overflowed, as the forward's spike; MODE_CHARGE: dH = dL/dH itself), the db and
// dW sums to part, and with out, dL/dX[t] = sum_j W[j] * dH[t + (K-1-j) * d] written to out (or added
// to what it holds). For vector u, xw[u * K + j] holds X[t - (K-1-j) * d], dw[u * K + j]
// dH[t + (K-1-j) * d] (zero past step T-1).
template <typename S, typename V, int KT, int MODE, int U>
void backward_lanes(const TileArgs<S>& p, int64_t l, int64_t r) {
    static_assert(KT > 0 || U == 1, "the generic kernel's scratch holds one vector's values");
    constexpr int64_t W = sizeof(V) / sizeof(S);
    const int K = KT > 0 ? KT : p.K;
    V w_[KT > 0 ? U * KT : 1], sw_[KT > 0 ? U * KT : 1], xw_[KT > 0 ? U * KT : 1], dw_[KT > 0 ? U * KT : 1];
    V* w = KT > 0 ? w_ : scratch<S, V>(p, 0);
    V* sw = KT > 0 ? sw_ : scratch<S, V>(p, 1);
    V* xw = KT > 0 ? xw_ : scratch<S, V>(p, 2);
    V* dw = KT > 0 ? dw_ : scratch<S, V>(p, 3);
    const V zero = V{} * S(0);
    const S sg_c = S(M_PI / 2) * p.alpha, sg_half = S(0.5) * p.alpha;
    S* const* xr = p.x->rows();
    S* const* gr = p.grad ? p.grad->rows() : nullptr;
    S* const* outs = p.out ? p.out->rows() : nullptr;
    const int64_t T = p.T, d = p.d;
    int64_t t = r + (T - 1 - r) / d * d;  // the phase's last step
    V sb[U], b[U], a[U], c[U];
    for (int u = 0; u < U; ++u) {
        b[u] = load<V>(p.b + l + u * W);
        a[u] = load<V>(p.a + l + u * W);
        c[u] = load<V>(p.c + l + u * W);
        for (int j = 0; j < K; ++j) {
            const int64_t s = t - (K - 1 - j) * d;
            w[u * K + j] = load<V>(p.w[j] + l + u * W);
            sw[u * K + j] = dw[u * K + j] = zero;
            xw[u * K + j] = s >= 0 ? load<V>(xr[s] + l + u * W) : zero;
        }
        sb[u] = zero;
    }
    for (;;) {
        if (p.ahead) {  // this step's dL/dout and output rows, and the next step's X row
            if (gr) ahead<0>(gr[t] + l);
            if (outs) ahead<1>(outs[t] + l);
            if (t - K * d >= 0) ahead<0>(xr[t - K * d] + l);
        }
        for (int u = 0; u < U; ++u) {
            const int64_t o = l + u * W;
            const V* wu = w + u * K;
            V* x = xw + u * K;
            V* dhw = dw + u * K;
            V dh;
            if constexpr (MODE == MODE_CHARGE) {
                dh = load<V>(gr[t] + o);
            } else {
                V h = b[u];
                for (int j = 0; j < K; ++j) h += wu[j] * x[j];
                if constexpr (MODE == MODE_STATS) {
                    dh = a[u] * h + c[u];
                } else {
                    if constexpr (!std::is_same_v<S, double>)  // the charge the spike is the sign of
                        if (!all_zero<S, V>(h - h)) h = exact_if_overflowed<S, V>(h, wu, x, K, b[u]);
                    dh = load<V>(gr[t] + o) * surrogate_grad<S, V, MODE>(h, p.alpha, sg_c, sg_half);
                }
            }
            sb[u] += dh;
            for (int j = 0; j < K; ++j) sw[u * K + j] += dh * x[j];
            for (int j = 0; j + 1 < K; ++j) dhw[j] = dhw[j + 1];
            dhw[K - 1] = dh;
            if (outs) {
                V gx = p.accumulate ? load<V>(outs[t] + o) : zero;
                for (int j = 0; j < K; ++j) gx += wu[j] * dhw[j];
                store(outs[t] + o, gx);
            }
        }
        t -= d;
        if (t < 0) break;
        const int64_t s = t - (K - 1) * d;
        for (int u = 0; u < U; ++u) {
            V* x = xw + u * K;
            for (int j = K - 1; j > 0; --j) x[j] = x[j - 1];
            x[0] = s >= 0 ? load<V>(xr[s] + l + u * W) : zero;
        }
    }
    if (!p.sums) return;
    for (int u = 0; u < U; ++u) {
        S* part = p.part + l + u * W;
        store(part, load<V>(part) + sb[u]);
        for (int j = 0; j < K; ++j) store(part + (j + 1) * p.m, load<V>(part + (j + 1) * p.m) + sw[u * K + j]);
    }
}

template <typename S, int KT, int OUT>
struct Forward {
    static constexpr int line = side_by_side(KT, 2);
    template <typename V, int U>
    static void lanes(const TileArgs<S>& p, int64_t l, int64_t r) { forward_lanes<S, V, KT, OUT, U>(p, l, r); }
};
template <typename S, int KT, int MODE>
struct Backward {
    static constexpr int line = side_by_side(KT, 4);
    template <typename V, int U>
    static void lanes(const TileArgs<S>& p, int64_t l, int64_t r) { backward_lanes<S, V, KT, MODE, U>(p, l, r); }
};

// Per channel, the output of the first block's first lane of that channel at the last step (0 for an
// empty tensor): the statistics' sums are taken about it, so that a charge far from 0 that hardly varies
// does not cancel in E[H^2] - E[H]^2 (X = 1000.3 everywhere and k = 1 gave a variance of 0.24).
template <typename S>
std::vector<S> output_sample(const Geometry& g, const S* x, const S* w, const S* b) {
    std::vector<S> h(g.C, S(0));
    if (g.T * g.N * g.F == 0) return h;
    for (int64_t c = 0; c < g.C; ++c) {
        S acc = b ? b[c] : S(0);
        for (int j = 0; j < g.K; ++j) {
            const int64_t t = g.T - 1 - int64_t(g.K - 1 - j) * g.d;
            if (t >= 0) acc += w[c * g.K + j] * x[g.at(t, 0, c * g.F)];
        }
        h[c] = acc;
    }
    return h;
}

template <typename S, int KT>
void forward(const Geometry& g, int KP, const S* x, const S* w, const S* b, S* out, int spike, S* mean, S* var,
             int threads) {
    const bool sums = mean != nullptr;
    const int64_t L = g.tile(), cf = g.CF(), per = g.tiles_per_block(), tiles = g.N * per;
    const Table<S> wl = tap_weights(g, w, KP), bl = per_lane(g, b);
    // The statistics' sweep adds up H - shift: its bias is b - shift.
    const std::vector<S> shift = sums ? output_sample(g, x, w, b) : std::vector<S>();
    std::vector<S> centred(shift.size());
    for (size_t c = 0; c < shift.size(); ++c) centred[c] = (b ? b[c] : S(0)) - shift[c];
    const Table<S> sl = per_lane(g, sums ? centred.data() : b);
    std::vector<double> acc(sums ? size_t(threads) * 2 * g.C : 0, 0.0);
#pragma omp parallel num_threads(threads)
    {
        Tile<S> xs(g, L), os(g, L);
        Partials<S> part(g, 2, sums ? L : 0, sums ? acc.data() + size_t(thread_id()) * 2 * g.C : nullptr);
        std::vector<Vec<S>> vec(2 * KP);
        std::vector<S> one(2 * KP);
        std::vector<const S*> wj(KP);
        TileArgs<S> p{&xs, nullptr, out ? &os : nullptr, wj.data(), nullptr, nullptr, nullptr, nullptr,
                      vec.data(), one.data(), g.T, 0, g.d, KP, sums, false, S(0), g.prefetch()};
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; ++tile) {
            int64_t n, o0;
            const int64_t m = g.tile_at(tile, n, o0);
            xs.read(x, n, o0, m);
            if (out) os.write(out, n, o0, m);
            if (sums) p.part = part.take(o0, m, g.T);
            for (int j = 0; j < KP; ++j) wj[j] = wl.data() + j * cf + o0;
            p.m = m;
            p.b = sl.data() + o0;
            if (sums) columns<S, Forward<S, KT, SUMS>>(p);
            p.b = bl.data() + o0;
            if (out && spike)
                columns<S, Forward<S, KT, SPIKES>>(p);
            else if (out)
                columns<S, Forward<S, KT, CHARGE>>(p);
            if (out) os.flush(out, n, o0, m);
        }
        if (sums) part.flush();
    }
    if (sums) {  // per-channel mean and biased variance from the float64 sums about the shift
        std::vector<double> total(2 * g.C);
        reduce_threads(g, acc, threads, 2, total.data(), 1, g.C);
        const double n = double(std::max<int64_t>(g.T * g.N * g.F, 1));
        for (int64_t c = 0; c < g.C; ++c) {
            const double m = total[c] / n;
            mean[c] = S(double(shift[c]) + m);
            var[c] = S(std::max(total[g.C + c] / n - m * m, 0.0));
        }
    }
}

template <typename S, int KT>
void backward(const Geometry& g, int KP, const S* x, const S* w, const S* b, const S* grad, int mode, S alpha,
              const S* mean, const S* g_mean, const S* g_var, S* gx, int accumulate, S* gw, S* gb, int threads) {
    const int64_t L = g.tile(), cf = g.CF(), per = g.tiles_per_block(), tiles = g.N * per;
    const bool sums = gw || gb;
    const Table<S> wl = tap_weights(g, w, KP), bl = per_lane(g, mode == MODE_STATS ? nullptr : b);
    // Mode 3: dL/dY = a[c] * Y + b[c] with a = 2 dL/dvar / n, b = dL/dmean / n - a * mean.
    std::vector<S> coef_a(mode == MODE_STATS ? g.C : 0), coef_b(mode == MODE_STATS ? g.C : 0);
    if (mode == MODE_STATS) {
        const double n = double(std::max<int64_t>(g.T * g.N * g.F, 1));
        for (int64_t c = 0; c < g.C; ++c) {
            const double a = 2.0 * double(g_var[c]) / n;
            coef_a[c] = S(a);
            coef_b[c] = S(double(g_mean[c]) / n - a * double(mean[c]));
        }
    }
    const Table<S> al = per_lane(g, mode == MODE_STATS ? coef_a.data() : nullptr),
                   cl = per_lane(g, mode == MODE_STATS ? coef_b.data() : nullptr);
    std::vector<double> acc(sums ? size_t(threads) * (KP + 1) * g.C : 0, 0.0);
#pragma omp parallel num_threads(threads)
    {
        Tile<S> xs(g, L), gs(g, L), os(g, L);
        Partials<S> part(g, KP + 1, sums ? L : 0, sums ? acc.data() + size_t(thread_id()) * (KP + 1) * g.C : nullptr);
        std::vector<Vec<S>> vec(4 * KP);
        std::vector<S> one(4 * KP);
        std::vector<const S*> wj(KP);
        TileArgs<S> p{&xs, mode != MODE_STATS ? &gs : nullptr, gx ? &os : nullptr, wj.data(), nullptr, nullptr, nullptr,
                      nullptr, vec.data(), one.data(), g.T, 0, g.d, KP, sums, accumulate != 0, alpha, g.prefetch()};
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; ++tile) {
            int64_t n, o0;
            const int64_t m = g.tile_at(tile, n, o0);
            xs.read(x, n, o0, m);
            if (mode != MODE_STATS) gs.read(grad, n, o0, m);
            if (gx && accumulate)
                os.read(gx, n, o0, m);  // dL/dX is added to what gx holds
            else if (gx)
                os.write(gx, n, o0, m);
            if (sums) p.part = part.take(o0, m, g.T);
            for (int j = 0; j < KP; ++j) wj[j] = wl.data() + j * cf + o0;
            p.b = bl.data() + o0;
            p.a = al.data() + o0;
            p.c = cl.data() + o0;
            p.m = m;
            switch (mode) {  // the mode a compile-time constant: no branches in the sweep
                case MODE_CHARGE: columns<S, Backward<S, KT, MODE_CHARGE>>(p); break;
                case MODE_ATAN: columns<S, Backward<S, KT, MODE_ATAN>>(p); break;
                case MODE_SIGMOID: columns<S, Backward<S, KT, MODE_SIGMOID>>(p); break;
                default: columns<S, Backward<S, KT, MODE_STATS>>(p);
            }
            if (gx) os.flush(gx, n, o0, m);
        }
        if (sums) part.flush();
    }
    if (sums) {  // per-channel sums; the dropped taps (i < first) read only zeros
        std::vector<double> total((KP + 1) * g.C);
        reduce_threads(g, acc, threads, KP + 1, total.data(), KP + 1, 1);
        const int first = g.first_tap();  // tap i sums in row 1 + i - first
        for (int64_t c = 0; c < g.C; ++c) {
            if (gw)
                for (int i = 0; i < g.K; ++i) gw[c * g.K + i] = i < first ? S(0) : S(total[c * (KP + 1) + 1 + i - first]);
            if (gb) gb[c] = S(total[c * (KP + 1)]);
        }
    }
}

// Q(w) = sign(w) * 2^round(log2 |w|), the rounding decided exactly: |w| = m * 2^e with m in [0.5, 1)
// rounds to 2^e when m >= 1/sqrt(2) (never a tie: 1/sqrt(2) is irrational; M_SQRT1_2 is the double just
// above it) and to 2^(e-1) below, as quantize.py decides it (not by a float log2, which can round
// across the midpoint 2^(e+1/2)). Exponents are clamped to the largest finite power of two (inf too),
// too small ones underflow to zero, NaN stays NaN.
template <typename S>
S quantize_pow2_frexp(S w) {
    constexpr int top = std::numeric_limits<S>::max_exponent - 1;
    if (w == S(0) || std::isnan(w)) return w == S(0) ? S(0) : w;
    if (std::isinf(w)) return std::copysign(std::ldexp(S(1), top), w);
    int e;
    const S m = std::frexp(std::abs(w), &e);
    if (double(m) < M_SQRT1_2) --e;
    return std::copysign(std::ldexp(S(1), std::min(e, top)), w);
}

// The IEEE-754 fields of S: its bits as U, M mantissa bits, the biased exponent of inf and NaN, and UP,
// the smallest mantissa with 1.mantissa >= sqrt(2) (in integers: (2^M + UP)^2 >= 2^(2M+1)).
template <typename S>
struct Ieee;
template <>
struct Ieee<float> {
    using U = uint32_t;
    static constexpr int M = 23;
    static constexpr U E_INF = 0xFF, UP = 0x3504F4;
};
template <>
struct Ieee<double> {
    using U = uint64_t;
    static constexpr int M = 52;
    static constexpr U E_INF = 0x7FF, UP = 0x6A09E667F3BCDull;
};

// Q in place over n values, on their bits where every value is normal: 1.mantissa * 2^e rounds up to
// 2^(e+1) when the mantissa is >= UP, else down to 2^e, clamped below inf. A few integer operations
// per value in a loop the compiler vectorises (frexp and ldexp per weight cost as much as a small
// layer's sweep). Where one value is zero, subnormal, inf or NaN, those take quantize_pow2_frexp.
template <typename S>
void quantize_pow2_(S* w, int64_t n) {
    using I = Ieee<S>;
    using U = typename I::U;
    constexpr U sign = U(1) << (8 * sizeof(U) - 1), mantissa = (U(1) << I::M) - 1;
    const auto exponent = [](const S* v) {
        U u;
        std::memcpy(&u, v, sizeof u);
        return (u & ~sign) >> I::M;
    };
    const auto bits = [](S* v) {
        U u;
        std::memcpy(&u, v, sizeof u);
        const U e = (u & ~sign) >> I::M;
        u = (u & sign) | (std::min<U>(e + ((u & mantissa) >= I::UP), I::E_INF - 1) << I::M);
        std::memcpy(v, &u, sizeof u);
    };
    U special = 0;
    for (int64_t j = 0; j < n; ++j) special |= U(exponent(w + j) - 1 >= I::E_INF - 1);  // exponent 0 or all ones
    if (!special) {
        for (int64_t j = 0; j < n; ++j) bits(w + j);
        return;
    }
    for (int64_t j = 0; j < n; ++j) {
        const U e = exponent(w + j);
        if (e == 0 || e == I::E_INF)
            w[j] = quantize_pow2_frexp(w[j]);
        else
            bits(w + j);
    }
}

// The BN folded into the weight and a bias (in S, as the reference computes them):
// Whether no value is NaN or inf (one vectorised pass: no early exit).
template <typename S>
bool all_finite(const S* v, int64_t n) {
    int bad = 0;
    for (int64_t j = 0; j < n; ++j) bad |= !(std::abs(v[j]) <= std::numeric_limits<S>::max());  // NaN too
    return !bad;
}

// Whether W can be folded with (gamma, beta, mean, var): all of them finite and var + eps > 0 (a NaN there
// would silence a channel; the caller's general path, which checks the same, names what is wrong). A
// folding that overflows is not refused: the quantiser clamps it to the largest power of two.
template <typename S>
bool finite_folding(int64_t C, int K, const S* w, const S* gamma, const S* beta, const S* mean, const S* var,
                    double eps) {
    bool ok = all_finite(w, C * K) && all_finite(gamma, C) && all_finite(beta, C) && all_finite(mean, C) &&
              all_finite(var, C);
    for (int64_t c = 0; c < C; ++c) ok &= var[c] + S(eps) > S(0);  // in S, as fold_bn adds them
    return ok;
}

// Wf = gamma / sqrt(var + eps) * W, b = beta - gamma * mean / sqrt(var + eps); wq = Q(Wf) when quantising.
template <typename S>
void fold_bn(int64_t C, int K, const S* w, const S* gamma, const S* beta, const S* mean, const S* var, double eps,
             int quantize, S* wq, S* b) {
    for (int64_t c = 0; c < C; ++c) {
        const S scale = gamma[c] * (S(1) / std::sqrt(var[c] + S(eps)));
        for (int i = 0; i < K; ++i) wq[c * K + i] = w[c * K + i] * scale;
        b[c] = beta[c] - mean[c] * scale;
    }
    if (quantize) quantize_pow2_(wq, C * K);
}

// BN-threshold neuron, forward (the whole step of the autograd node): the batch statistics of the
// bias-free charge (given: mean and var are read instead, e.g. the running ones in eval mode), the BN
// folded into the weight and a bias (fold_bn), then S = Theta(charge(X, Wq) + b) into out. With
// running_mean (and running_var), the batch mean and unbiased variance are blended into them:
// r += factor * (stat - r). Returns 1, with nothing but mean and var written, where the folding is not
// finite (see finite_folding).
template <typename S, int KT>
int bn_forward(const Geometry& g, int KP, const S* x, const S* w, const S* gamma, const S* beta, double eps,
               int quantize, int given, S* out, S* mean, S* var, S* wq, S* b, S* running_mean, S* running_var,
               double factor, int threads) {
    if (!given) forward<S, KT>(g, KP, x, w, nullptr, nullptr, 0, mean, var, threads);
    if (!finite_folding(g.C, g.K, w, gamma, beta, mean, var, eps)) return 1;
    if (running_mean) {
        const int64_t n = g.T * g.N * g.F;
        const S f = S(factor), unbias = S(double(n) / double(std::max<int64_t>(n - 1, 1)));
        for (int64_t c = 0; c < g.C; ++c) {
            running_mean[c] += f * (mean[c] - running_mean[c]);
            running_var[c] += f * (var[c] * unbias - running_var[c]);
        }
    }
    fold_bn(g.C, g.K, w, gamma, beta, mean, var, eps, quantize, wq, b);
    forward<S, KT>(g, KP, x, wq, b, out, 1, nullptr, nullptr, threads);
    return 0;
}

// One step of an eval-mode neuron (no gradient): out = Theta(sum_i Wq[c, i] * xs[i] + b[c]) over
// (N, C, F) inputs, xs[i] the input (K-1-i)*d steps back (null: before the first step, adds nothing).
// With gamma, Wq and b are folded from mean and var as in bn_forward; without, Wq = Q(w) (or w) and
// b = bias. The taps are added in order i = 0..K-1, then b, as the PyTorch single-step path does (the
// compiler may fuse a multiply and an add: a float32 spike may differ where h is within rounding of 0).
// Returns 1, with nothing written, where the weights (or the folding) are not finite.
template <typename S>
int step_fire(const S* const* xs, const S* w, const S* gamma, const S* beta, const S* mean, const S* var,
              double eps, int quantize, const S* bias, S* out, int64_t N, int64_t C, int64_t F, int K,
              int threads) {
    if (gamma ? !finite_folding(C, K, w, gamma, beta, mean, var, eps)
              : !(all_finite(w, C * K) && (!bias || all_finite(bias, C))))
        return 1;
    std::vector<S> wq(C * K), b(C);  // (no bias and no batch norm: threshold 0, b stays 0)
    if (gamma) {
        fold_bn(C, K, w, gamma, beta, mean, var, eps, quantize, wq.data(), b.data());
    } else {
        std::copy_n(w, C * K, wq.data());
        if (bias) std::copy_n(bias, C, b.data());
        if (quantize) quantize_pow2_(wq.data(), C * K);
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t row = 0; row < N * C; ++row) {
        const int64_t c = row % C, o = row * F;
        S* h = out + o;
        bool first = true;
        for (int i = 0; i < K; ++i) {
            if (!xs[i]) continue;
            const S wi = wq[c * K + i];
            const S* xi = xs[i] + o;
            if (first) {
                for (int64_t f = 0; f < F; ++f) h[f] = xi[f] * wi;
            } else {
                for (int64_t f = 0; f < F; ++f) h[f] += xi[f] * wi;
            }
            first = false;
        }
        const S bc = b[c];
        if (first) {
            for (int64_t f = 0; f < F; ++f) h[f] = S(bc >= S(0));
        } else {
            for (int64_t f = 0; f < F; ++f) {
                S v = h[f] + bc;
                if (!(v - v == S(0)) && sizeof(S) < sizeof(double)) {  // beyond float's range: in double
                    double acc = 0.0;
                    for (int i = 0; i < K; ++i)
                        if (xs[i]) acc += double(wq[c * K + i]) * double(xs[i][o + f]);
                    v = S(acc + double(bc));
                }
                h[f] = S(v >= S(0));
            }
        }
    }
    return 0;
}

// Its backward: the spike kernel's dL/dX, dL/dWq, dL/db; dL/dWf through the quantiser (ste 1 whole:
// identity, 2 round: |Wq| / |Wf|, 0 at Wf = 0); the folding's gradients in closed form (in double),
// dL/dgamma, dL/dbeta, the weight's direct part and dL/dmean, dL/dvar; then, unless the statistics
// were given (constants), the statistics' kernel adds its dL/dX to gx in place and its dL/dW to
// dL/dweight.
template <typename S, int KT>
void bn_backward(const Geometry& g, int KP, const S* x, const S* w, const S* gamma, const S* mean, const S* var,
                 const S* wq, const S* b, const S* grad, int mode, S alpha, double eps, int ste, int given, S* gx,
                 S* g_w, S* g_gamma, S* g_beta, int threads) {
    const int64_t C = g.C, K = g.K;
    std::vector<S> g_wq(C * K), g_b(C), g_mean(C), g_var(C), g_w_stats(C * K);
    backward<S, KT>(g, KP, x, wq, b, grad, mode, alpha, nullptr, nullptr, nullptr, gx, 0, g_wq.data(), g_b.data(),
                    threads);
    for (int64_t c = 0; c < C; ++c) {
        const double rstd = 1.0 / std::sqrt(double(var[c]) + eps), scale = double(gamma[c]) * rstd;
        double g_scale = -double(g_b[c]) * double(mean[c]);
        for (int64_t i = 0; i < K; ++i) {
            double gf = g_wq[c * K + i];
            if (ste == 2) {
                const double wf = double(w[c * K + i]) * scale;
                gf = wf == 0.0 ? 0.0 : gf * std::abs(double(wq[c * K + i])) / std::abs(wf);
            }
            g_scale += gf * double(w[c * K + i]);
            g_w[c * K + i] = S(gf * scale);
        }
        g_gamma[c] = S(g_scale * rstd);
        g_beta[c] = g_b[c];
        g_mean[c] = S(-double(g_b[c]) * scale);
        // (none through a variance of 0: a constant channel's deviations, its derivative, are all 0)
        g_var[c] = var[c] > S(0) ? S(-0.5 * g_scale * double(gamma[c]) * rstd * rstd * rstd) : S(0);
    }
    if (given) return;
    backward<S, KT>(g, KP, x, w, nullptr, nullptr, MODE_STATS, S(0), mean, g_mean.data(), g_var.data(), gx, 1,
                    g_w_stats.data(), nullptr, threads);
    for (int64_t j = 0; j < C * K; ++j) g_w[j] += g_w_stats[j];
}

// Run CALL(KT, KP) with the kernel unrolled for the K taps (KT = KP = K) up to 8, or with the generic
// kernel (KT = 0, KP = K) above that.
#define MFPSN_DISPATCH_K(K, CALL)             \
    switch (K) {                              \
        case 1: CALL(1, 1); break;            \
        case 2: CALL(2, 2); break;            \
        case 3: CALL(3, 3); break;            \
        case 4: CALL(4, 4); break;            \
        case 5: CALL(5, 5); break;            \
        case 6: CALL(6, 6); break;            \
        case 7: CALL(7, 7); break;            \
        case 8: CALL(8, 8); break;            \
        default: CALL(0, K);                  \
    }

}  // namespace

#define MFPSN_RUN_FORWARD(KT, KP) forward<S, KT>(g, KP, x, w, b, out, spike, mean, var, threads)
template <typename S>
void run_forward(const Geometry& g, const S* x, const S* w, const S* b, S* out, int spike, S* mean, S* var,
                 int threads) {
    MFPSN_DISPATCH_K(g.taps(), MFPSN_RUN_FORWARD)
}

#define MFPSN_RUN_BACKWARD(KT, KP) \
    backward<S, KT>(g, KP, x, w, b, grad, mode, alpha, mean, g_mean, g_var, gx, accumulate, gw, gb, threads)
template <typename S>
void run_backward(const Geometry& g, const S* x, const S* w, const S* b, const S* grad, int mode, S alpha,
                  const S* mean, const S* g_mean, const S* g_var, S* gx, int accumulate, S* gw, S* gb, int threads) {
    MFPSN_DISPATCH_K(g.taps(), MFPSN_RUN_BACKWARD)
}

#define MFPSN_RUN_BN_FORWARD(KT, KP)                                                                          \
    return bn_forward<S, KT>(g, KP, x, w, gamma, beta, eps, quantize, given, out, mean, var, wq, b, running_mean, \
                             running_var, factor, threads)
template <typename S>
int run_bn_forward(const Geometry& g, const S* x, const S* w, const S* gamma, const S* beta, double eps, int quantize,
                   int given, S* out, S* mean, S* var, S* wq, S* b, S* running_mean, S* running_var, double factor,
                   int threads) {
    if (!all_finite(w, g.C * g.K)) return 1;  // nothing computed: the caller reports the weights
    MFPSN_DISPATCH_K(g.taps(), MFPSN_RUN_BN_FORWARD)
}

#define MFPSN_RUN_BN_BACKWARD(KT, KP)                                                                     \
    bn_backward<S, KT>(g, KP, x, w, gamma, mean, var, wq, b, grad, mode, alpha, eps, ste, given, gx, g_w, \
                       g_gamma, g_beta, threads)
template <typename S>
void run_bn_backward(const Geometry& g, const S* x, const S* w, const S* gamma, const S* mean, const S* var,
                     const S* wq, const S* b, const S* grad, int mode, S alpha, double eps, int ste, int given, S* gx,
                     S* g_w, S* g_gamma, S* g_beta, int threads) {
    MFPSN_DISPATCH_K(g.taps(), MFPSN_RUN_BN_BACKWARD)
}

template <typename S>
int run_step(const S* const* xs, const S* w, const S* gamma, const S* beta, const S* mean, const S* var, double eps,
             int quantize, const S* bias, S* out, int64_t N, int64_t C, int64_t F, int K, int threads) {
    return step_fire<S>(xs, w, gamma, beta, mean, var, eps, quantize, bias, out, N, C, F, K, threads);
}

template <typename S>
int vec_bytes() {
    return MFPSN_VEC_BYTES;
}

}  // namespace mfpsn

// Every entry of mfpsn_cpu.h for scalar type S (each dtype in its own file: compiled side by side).
#define MFPSN_INSTANTIATE(S)                                                                                      \
    namespace mfpsn {                                                                                            \
    template void run_forward<S>(const Geometry&, const S*, const S*, const S*, S*, int, S*, S*, int);           \
    template void run_backward<S>(const Geometry&, const S*, const S*, const S*, const S*, int, S, const S*,     \
                                  const S*, const S*, S*, int, S*, S*, int);                                     \
    template int run_bn_forward<S>(const Geometry&, const S*, const S*, const S*, const S*, double, int, int, S*,  \
                                   S*, S*, S*, S*, S*, S*, double, int);                                           \
    template void run_bn_backward<S>(const Geometry&, const S*, const S*, const S*, const S*, const S*, const S*, \
                                     const S*, const S*, int, S, double, int, int, S*, S*, S*, S*, int);          \
    template int run_step<S>(const S* const*, const S*, const S*, const S*, const S*, const S*, double, int,      \
                             const S*, S*, int64_t, int64_t, int64_t, int, int);                                 \
    template int vec_bytes<S>();                                                                                 \
    }
