// Fused CPU kernels of the MF-PSN charge (plain C++ with OpenMP, loaded through ctypes).
//
// A multi-step tensor is seen as N blocks of CF lanes (CF = C * F, F the product of the feature
// dims), each lane a sequence of T steps. Lane o of a block has channel o / F. Element (t, n, o) is at
//   time-first (T, N, C, ...) contiguous:  (t * N + n) * CF + o
//   time-last  (N, C, ..., T) contiguous:  (n * CF + o) * T + t
// Work is split into tiles of up to L lanes of one block x all T steps. Every inner loop runs over
// the lanes of a tile, which are contiguous in time-first tensors (read and written in place) and
// are gathered into a small [T][L] buffer for time-last ones, so the loops vectorise in both layouts.
// Per-lane constants (weights, bias) are laid out once per call as [K][CF] arrays; per-lane sums go
// to per-thread [.][CF] accumulators, reduced to channels in thread order at the end (no atomics:
// the same result for the same thread count).
//
//   charge:  H[t] = sum_i W[c, i] * X[t - (K-1-i) * d] + b[c]          (X[t < 0] = 0)
//   fire:    S[t] = (H[t] >= 0)
//   stats:   per-channel mean and biased variance of Y = charge without bias (Y is not written; float64 sums)
//   backward, one pass per tile, dH formed on the fly (never stored):
//     mode 0  dH = G                         (plain charge)
//     mode 1  dH = G * atan'(H)              (fire with SpikingJelly's ATan surrogate)
//     mode 2  dH = G * sigmoid'(H)           (fire with SpikingJelly's Sigmoid surrogate)
//     mode 3  dH = A[c] * Y + B[c]           (backward of the batch statistics, from dL/dmean and dL/dvar)
//     dX[t] = sum_i W[c, i] * dH[t + (K-1-i) * d];  dW[c, i] = sum dH[t] X[t - (K-1-i) * d];  db[c] = sum dH
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

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

namespace {

struct Geometry {
    int64_t T, N, C, F;
    int K, d;
    bool time_last;
    int64_t CF() const { return C * F; }
    int64_t lag(int i) const { return int64_t(K - 1 - i) * d; }
    // Lanes per tile (see MFPSN_TILE_*).
    int64_t tile() const {
        const int64_t budget = (time_last ? MFPSN_TILE_LAST : MFPSN_TILE_FIRST) / std::max<int64_t>(T, 1);
        return std::min<int64_t>(CF(), std::max<int64_t>(16, std::min<int64_t>(MFPSN_TILE_LANES, budget)));
    }
    int64_t tiles_per_block() const { return (CF() + tile() - 1) / tile(); }
    // Offset of element (t, n, o).
    int64_t at(int64_t t, int64_t n, int64_t o) const {
        return time_last ? (n * CF() + o) * T + t : (t * N + n) * CF() + o;
    }
};

int thread_id() {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

// Rows t = 0..T-1 of a tile: row t at p + t * stride.
template <typename S>
struct Rows {
    S* p;
    int64_t stride;
    S* row(int64_t t) const { return p + t * stride; }
};

// The tile (n, o0 .. o0+L) of a global tensor as rows: in place for time-first, else gathered into buf.
template <typename S>
Rows<const S> rows_of(const Geometry& g, const S* src, int64_t n, int64_t o0, int64_t L, S* buf) {
    if (!g.time_last) return {src + g.at(0, n, o0), g.N * g.CF()};
    for (int64_t l = 0; l < L; ++l) {
        const S* s = src + g.at(0, n, o0 + l);
        for (int64_t t = 0; t < g.T; ++t) buf[t * L + l] = s[t];
    }
    return {buf, L};
}

// Write a [T][L] buffer to the tile (n, o0 .. o0+L) of a global tensor, applying f to each value.
template <typename S, typename Fn>
void write_tile(const Geometry& g, const S* buf, int64_t n, int64_t o0, int64_t L, S* dst, Fn f) {
    if (!g.time_last) {
        for (int64_t t = 0; t < g.T; ++t) {
            S* o = dst + g.at(t, n, o0);
            const S* s = buf + t * L;
            for (int64_t l = 0; l < L; ++l) o[l] = f(s[l]);
        }
    } else {
        for (int64_t l = 0; l < L; ++l) {
            S* o = dst + g.at(0, n, o0 + l);
            for (int64_t t = 0; t < g.T; ++t) o[t] = f(buf[t * L + l]);
        }
    }
}

// h[t][l] = sum_i w[i][l] * x[t - lag_i][l] + b[l]; w rows are CF apart (per-lane constants).
template <typename S>
void charge_tile(const Geometry& g, Rows<const S> x, const S* __restrict w, const S* __restrict b, int64_t L,
                 S* __restrict h) {
    const int64_t cf = g.CF();
    for (int64_t t = 0; t < g.T; ++t) {
        S* __restrict hr = h + t * L;
        for (int64_t l = 0; l < L; ++l) hr[l] = b[l];
        for (int i = 0; i < g.K; ++i) {
            const int64_t lag = g.lag(i);
            if (t < lag) continue;
            const S* __restrict xr = x.row(t - lag);
            const S* __restrict wr = w + i * cf;
            for (int64_t l = 0; l < L; ++l) hr[l] += wr[l] * xr[l];
        }
    }
}

// Per-lane copy of a per-channel vector: out[o] = v[o / F] (zeros for a null v), for count vectors
// v, v + C, ... written to out, out + CF, ...
template <typename S>
std::vector<S> per_lane(const Geometry& g, const S* v, int count, int64_t stride_c = 1, int64_t stride_v = 0) {
    std::vector<S> out(size_t(count) * g.CF(), S(0));
    if (!v) return out;
    for (int j = 0; j < count; ++j)
        for (int64_t o = 0; o < g.CF(); ++o) out[j * g.CF() + o] = v[(o / g.F) * stride_c + j * stride_v];
    return out;
}

// Add per-thread per-lane sums [count][CF] into per-channel doubles out[c * count_stride + j].
void reduce_lanes(const Geometry& g, const std::vector<double>& acc, int threads, int count, double* out,
                  int64_t c_stride, int64_t j_stride) {
    const int64_t cf = g.CF();
    for (int j = 0; j < count; ++j)
        for (int64_t c = 0; c < g.C; ++c) {
            double s = 0.0;
            for (int th = 0; th < threads; ++th) {
                const double* a = acc.data() + (size_t(th) * count + j) * cf + c * g.F;
                for (int64_t f = 0; f < g.F; ++f) s += a[f];
            }
            out[c * c_stride + j * j_stride] = s;
        }
}

template <typename S>
void forward(const Geometry& g, const S* x, const S* w, const S* b, S* out, int spike, S* mean, S* var,
             int threads) {
    const bool sums = mean != nullptr;
    const int64_t L = g.tile(), cf = g.CF(), per = g.tiles_per_block(), tiles = g.N * per;
    const std::vector<S> wl = per_lane(g, w, g.K, g.K, 1), bl = per_lane(g, b, 1);
    std::vector<double> acc(sums ? size_t(threads) * 2 * cf : 0, 0.0);
#pragma omp parallel num_threads(threads)
    {
        std::vector<S> xt(g.time_last ? g.T * L : 0), h(g.T * L), part(2 * L);
        double* s1 = sums ? acc.data() + size_t(thread_id()) * 2 * cf : nullptr;
        double* s2 = s1 ? s1 + cf : nullptr;
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; ++tile) {
            const int64_t n = tile / per, o0 = (tile % per) * L, m = std::min(L, cf - o0);
            Rows<const S> xr = rows_of(g, x, n, o0, m, xt.data());
            charge_tile(g, xr, wl.data() + o0, bl.data() + o0, m, h.data());
            if (out) {
                if (spike)
                    write_tile(g, h.data(), n, o0, m, out, [](S v) { return v >= S(0) ? S(1) : S(0); });
                else
                    write_tile(g, h.data(), n, o0, m, out, [](S v) { return v; });
            }
            if (s1) {  // per-lane sums over this tile's steps in S, then added to the double accumulators
                S* p1 = part.data();
                S* p2 = p1 + m;
                std::fill(p1, p1 + 2 * m, S(0));
                for (int64_t t = 0; t < g.T; ++t) {
                    const S* hr = h.data() + t * m;
                    for (int64_t l = 0; l < m; ++l) {
                        p1[l] += hr[l];
                        p2[l] += hr[l] * hr[l];
                    }
                }
                for (int64_t l = 0; l < m; ++l) {
                    s1[o0 + l] += p1[l];
                    s2[o0 + l] += p2[l];
                }
            }
        }
    }
    if (sums) {  // per-channel mean and biased variance from the float64 sums
        std::vector<double> total(2 * g.C);
        reduce_lanes(g, acc, threads, 2, total.data(), 1, g.C);
        const double n = double(std::max<int64_t>(g.T * g.N * g.F, 1));
        for (int64_t c = 0; c < g.C; ++c) {
            const double m = total[c] / n;
            mean[c] = S(m);
            var[c] = S(std::max(total[g.C + c] / n - m * m, 0.0));
        }
    }
}

template <typename S>
inline S surrogate_grad(int mode, S h, S alpha) {
    if (mode == 1) {  // ATan: alpha / 2 / (1 + (pi / 2 * alpha * h)^2)
        const S a = S(M_PI / 2) * alpha * h;
        return S(0.5) * alpha / (S(1) + a * a);
    }
    const S s = S(1) / (S(1) + std::exp(-alpha * h));  // Sigmoid: alpha * s * (1 - s)
    return alpha * s * (S(1) - s);
}

template <typename S>
void backward(const Geometry& g, const S* x, const S* w, const S* b, const S* grad, int mode, S alpha,
              const S* mean, const S* g_mean, const S* g_var, S* gx, S* gw, S* gb, int threads) {
    const int64_t L = g.tile(), cf = g.CF(), per = g.tiles_per_block(), tiles = g.N * per;
    const int K = g.K;
    const bool sums = gw || gb;
    const std::vector<S> wl = per_lane(g, w, K, K, 1), bl = per_lane(g, mode == 3 ? nullptr : b, 1);
    // Mode 3: dL/dY = a[c] * Y + b[c] with a = 2 dL/dvar / n, b = dL/dmean / n - a * mean.
    std::vector<S> coef_a(mode == 3 ? g.C : 0), coef_b(mode == 3 ? g.C : 0);
    if (mode == 3) {
        const double n = double(std::max<int64_t>(g.T * g.N * g.F, 1));
        for (int64_t c = 0; c < g.C; ++c) {
            const double a = 2.0 * double(g_var[c]) / n;
            coef_a[c] = S(a);
            coef_b[c] = S(double(g_mean[c]) / n - a * double(mean[c]));
        }
    }
    const std::vector<S> al = per_lane(g, mode == 3 ? coef_a.data() : nullptr, 1),
                         cl = per_lane(g, mode == 3 ? coef_b.data() : nullptr, 1);
    std::vector<double> acc(sums ? size_t(threads) * (K + 1) * cf : 0, 0.0);
#pragma omp parallel num_threads(threads)
    {
        std::vector<S> xt(g.time_last ? g.T * L : 0), gt(g.time_last ? g.T * L : 0), dh(g.T * L), gxt(g.T * L),
            part((K + 1) * L);
        double* mine = sums ? acc.data() + size_t(thread_id()) * (K + 1) * cf : nullptr;
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; ++tile) {
            const int64_t n = tile / per, o0 = (tile % per) * L, m = std::min(L, cf - o0);
            Rows<const S> xr = rows_of(g, x, n, o0, m, xt.data());
            S* d = dh.data();
            if (mode == 0) {
                Rows<const S> gr = rows_of(g, grad, n, o0, m, gt.data());
                for (int64_t t = 0; t < g.T; ++t) std::copy(gr.row(t), gr.row(t) + m, d + t * m);
            } else if (mode == 3) {
                charge_tile(g, xr, wl.data() + o0, bl.data() + o0, m, d);
                const S* a = al.data() + o0;
                const S* c = cl.data() + o0;
                for (int64_t t = 0; t < g.T; ++t)
                    for (int64_t l = 0; l < m; ++l) d[t * m + l] = a[l] * d[t * m + l] + c[l];
            } else {
                charge_tile(g, xr, wl.data() + o0, bl.data() + o0, m, d);
                Rows<const S> gr = rows_of(g, grad, n, o0, m, gt.data());
                for (int64_t t = 0; t < g.T; ++t) {
                    const S* gg = gr.row(t);
                    S* dd = d + t * m;
                    for (int64_t l = 0; l < m; ++l) dd[l] = gg[l] * surrogate_grad(mode, dd[l], alpha);
                }
            }
            if (mine) {  // per-lane sums over this tile's steps in S, then added to the double accumulators
                S* pb = part.data();
                S* pw = pb + m;
                std::fill(pb, pb + (K + 1) * m, S(0));
                for (int64_t t = 0; t < g.T; ++t) {
                    const S* dd = d + t * m;
                    for (int64_t l = 0; l < m; ++l) pb[l] += dd[l];
                    for (int i = 0; i < K; ++i) {
                        const int64_t lag = g.lag(i);
                        if (t < lag) continue;
                        const S* xx = xr.row(t - lag);
                        S* pwi = pw + i * m;
                        for (int64_t l = 0; l < m; ++l) pwi[l] += dd[l] * xx[l];
                    }
                }
                double* sb = mine + K * cf + o0;
                for (int64_t l = 0; l < m; ++l) sb[l] += pb[l];
                for (int i = 0; i < K; ++i) {
                    double* sw = mine + i * cf + o0;
                    const S* pwi = pw + i * m;
                    for (int64_t l = 0; l < m; ++l) sw[l] += pwi[l];
                }
            }
            if (gx) {
                S* o = gxt.data();
                for (int64_t t = 0; t < g.T; ++t) {
                    S* orow = o + t * m;
                    for (int64_t l = 0; l < m; ++l) orow[l] = S(0);
                    for (int i = 0; i < K; ++i) {
                        const int64_t lag = g.lag(i);
                        if (t + lag >= g.T) continue;
                        const S* dd = d + (t + lag) * m;
                        const S* wr = wl.data() + i * cf + o0;
                        for (int64_t l = 0; l < m; ++l) orow[l] += wr[l] * dd[l];
                    }
                }
                write_tile(g, o, n, o0, m, gx, [](S v) { return v; });
            }
        }
    }
    if (sums) {
        std::vector<double> total((K + 1) * g.C);
        reduce_lanes(g, acc, threads, K + 1, total.data(), K + 1, 1);
        for (int64_t c = 0; c < g.C; ++c) {
            if (gw)
                for (int i = 0; i < K; ++i) gw[c * K + i] = S(total[c * (K + 1) + i]);
            if (gb) gb[c] = S(total[c * (K + 1) + K]);
        }
    }
}

Geometry geometry(int64_t T, int64_t N, int64_t C, int64_t F, int K, int d, int time_last) {
    return Geometry{T, N, C, F, K, d, time_last != 0};
}

}  // namespace

#define MFPSN_EXPORT(S, suffix)                                                                              \
    extern "C" void mfpsn_forward_##suffix(const S* x, const S* w, const S* b, S* out, int spike, S* mean,       \
                                            S* var, int64_t T, int64_t N, int64_t C, int64_t F, int K, int d,   \
                                            int time_last, int threads) {                                       \
        forward<S>(geometry(T, N, C, F, K, d, time_last), x, w, b, out, spike, mean, var, threads);            \
    }                                                                                                          \
    extern "C" void mfpsn_backward_##suffix(const S* x, const S* w, const S* b, const S* grad, int mode,        \
                                             double alpha, const S* mean, const S* g_mean, const S* g_var,      \
                                             S* gx, S* gw, S* gb, int64_t T, int64_t N, int64_t C, int64_t F, int K, \
                                             int d, int time_last, int threads) {                               \
        backward<S>(geometry(T, N, C, F, K, d, time_last), x, w, b, grad, mode, S(alpha), mean, g_mean, g_var, gx, \
                    gw, gb, threads);                                                                          \
    }

MFPSN_EXPORT(float, f32)
MFPSN_EXPORT(double, f64)
