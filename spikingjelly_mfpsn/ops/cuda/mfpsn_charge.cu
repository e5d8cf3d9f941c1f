// CUDA kernels of the MF-PSN charge, a causal dilated channel-wise convolution along time:
//
//     H[t, c] = sum_{i<k} W[c, i] * X[t - (k-1-i)*d, c]  (+ b[c]),   X[t < 0] = 0
//
// and its gradients. Launched by cupy_ops.py through CuPy (NVRTC); the same text also compiles
// for the CPU through a small host shim in the tests, so the source includes no headers.
//
// Geometry. Every tensor is seen through four logical axes (N, C, M, T): N the batch, C the
// channels, M all feature axes merged, T time. Inputs are read through their strides (any
// layout, non-contiguous allowed); outputs are contiguous, in time-first (T, N, C, M) or
// time-last (N, C, M, T) memory order, and threads walk them in that order so that writes
// coalesce. Every kernel comes with 64-bit index arithmetic and, suffixed _i32, with 32-bit
// (the launcher picks it when every element and offset fits: a GPU divides 64-bit integers in
// software, and each thread unravels its index with divisions).
//
// Kernels, for each storage type (suffix f32, f64, f16, bf16; f16/bf16 accumulate in float):
//   mfpsn_forward_<s>   one thread per element of H: bias + k taps looking back in time.
//   mfpsn_grad_x_<s>    one thread per element of dL/dX: the same taps looking forward
//                       (the correlation with the flipped weight).
//   mfpsn_grad_wb_<s>   dL/dW[c, i] and dL/db[c]: one group of blocks per (tap, channel group);
//                       each block reduces its share in shared memory and writes one partial sum
//                       per channel; the host sums the partials. No atomics, so the result is bitwise
//                       reproducible from run to run.
// Weights and bias are passed in the accumulation type, contiguous (C, k) and (C,).

#ifndef MFPSN_BLOCK
#define MFPSN_BLOCK 256  // threads per block; a power of two, the host launches exactly this many
#endif

typedef long long i64;

// ---------------------------------------------------------------- storage types
struct f16_t { unsigned short bits; };   // IEEE binary16, storage only
struct bf16_t { unsigned short bits; };  // bfloat16, storage only

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }

__device__ __forceinline__ float to_acc(bf16_t v) {
    return __uint_as_float(((unsigned int)v.bits) << 16);
}

#ifdef __CUDA_ARCH__
__device__ __forceinline__ float to_acc(f16_t v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
    return f;
}
#else  // host shim: the compiler's own binary16 type does the conversion
__device__ __forceinline__ float to_acc(f16_t v) {
    _Float16 h;
    __builtin_memcpy(&h, &v.bits, sizeof h);
    return (float)h;
}
#endif

template <typename scalar_t, typename acc_t> __device__ __forceinline__ scalar_t from_acc(acc_t v) {
    return (scalar_t)v;
}

template <> __device__ __forceinline__ bf16_t from_acc<bf16_t, float>(float v) {
    unsigned int u = __float_as_uint(v);
    bf16_t r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it a (quiet) NaN
        r.bits = (unsigned short)((u >> 16) | 0x0040u);
    } else {  // round to nearest, ties to even
        r.bits = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    return r;
}

#ifdef __CUDA_ARCH__
template <> __device__ __forceinline__ f16_t from_acc<f16_t, float>(float v) {
    f16_t r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(v));
    return r;
}
#else
template <> __device__ __forceinline__ f16_t from_acc<f16_t, float>(float v) {
    _Float16 h = (_Float16)v;
    f16_t r;
    __builtin_memcpy(&r.bits, &h, sizeof h);
    return r;
}
#endif

// ---------------------------------------------------------------- geometry
// I: the index type, i64 or int (see the header).
template <typename I> struct Geom {
    I n, c, m, t;        // sizes of the logical axes
    int time_last;       // memory order of the contiguous output / of the walk
};

template <typename I> struct Strides {
    I n, c, m, t;
    __device__ __forceinline__ I at(I in, I ic, I im, I it) const {
        return in * n + ic * c + im * m + it * t;
    }
};

// Coordinates of the i-th element in the output's memory order (time-first (T, N, C, M) or
// time-last (N, C, M, T)) of a tensor whose axes have sizes (n, c, m, t).
template <typename I>
__device__ __forceinline__ void unravel(I i, I n, I c, I m, I t, int time_last, I *in, I *ic, I *im, I *it) {
    if (time_last) {
        *it = i % t; i /= t;
        *im = i % m; i /= m;
        *ic = i % c;
        *in = i / c;
    } else {
        *im = i % m; i /= m;
        *ic = i % c; i /= c;
        *in = i % n;
        *it = i / n;
    }
}

// ---------------------------------------------------------------- forward and grad_X
// dst[t] = bias[c] + sum_i w[c, i] * src[t - dir * lag_i],  lag_i = (k-1-i)*d, out-of-range src = 0.
// dir = +1 is the forward charge, dir = -1 (no bias) is dL/dX from dL/dH.
template <typename scalar_t, typename acc_t, typename I>
__device__ void correlate(const scalar_t *__restrict__ src, Strides<I> s, const acc_t *__restrict__ w,
                          const acc_t *__restrict__ bias, scalar_t *__restrict__ dst, Geom<I> g,
                          int k, I dilation, int dir) {
    const I total = g.n * g.c * g.m * g.t;
    const I step = (I)gridDim.x * (I)blockDim.x;
    for (I i = (I)blockIdx.x * (I)blockDim.x + (I)threadIdx.x; i < total; i += step) {
        I in, ic, im, it;
        unravel(i, g.n, g.c, g.m, g.t, g.time_last, &in, &ic, &im, &it);
        const I base = s.at(in, ic, im, 0);
        acc_t acc = bias ? bias[ic] : (acc_t)0;
        for (int tap = 0; tap < k; ++tap) {
            const I ts = it - dir * (I)(k - 1 - tap) * dilation;
            if (ts >= 0 && ts < g.t) {
                acc += w[ic * k + tap] * to_acc(src[base + ts * s.t]);
            }
        }
        dst[i] = from_acc<scalar_t, acc_t>(acc);
    }
}

// ---------------------------------------------------------------- grad_W and grad_b
// A block sums over (n, m, t >= lag) for `lanes` consecutive channels of one tap: thread (row, lane)
// = divmod(threadIdx.x, lanes) walks elements row, row + rows, ... (rows = MFPSN_BLOCK / lanes) of
// channel group * lanes + lane. lanes = 1 (one channel per block) where the walk itself is along a
// contiguous axis (T of time-last, M of time-first); lanes > 1 where the channels are the contiguous
// axis (time-first (T, N, C)), so that a warp reads consecutive channels, not one cache line per lane.
// Block b handles part b % parts of pair (tap, group) = divmod(b / parts, groups); tap < k: sum of
// gh[t] * x[t - lag]; tap == k: sum of gh (the bias). partial[(tap * C + c) * parts + part] receives
// the sum of channel c, reduced over rows by a fixed tree (deterministic order).
template <typename scalar_t, typename acc_t, typename I>
__device__ void grad_weight_bias(const scalar_t *__restrict__ x, Strides<I> sx,
                                 const scalar_t *__restrict__ gh, Strides<I> sg,
                                 acc_t *__restrict__ partial, Geom<I> g, int k, I dilation,
                                 I parts, int lanes) {
    __shared__ acc_t buf[MFPSN_BLOCK];
    const int rows = MFPSN_BLOCK / lanes;  // (lanes: a power of two <= MFPSN_BLOCK)
    const int lane = (int)threadIdx.x % lanes, row = (int)threadIdx.x / lanes;
    const I part = (I)blockIdx.x % parts;
    const I pair = (I)blockIdx.x / parts;
    const I groups = (g.c + lanes - 1) / lanes;
    const I c = (pair % groups) * lanes + lane;
    const int tap = (int)(pair / groups);
    const I lag = tap < k ? (I)(k - 1 - tap) * dilation : 0;
    const I span = g.t > lag ? g.t - lag : 0;  // time steps t in [lag, T)
    const I total = g.n * g.m * span;

    acc_t acc = (acc_t)0;
    for (I j = part * rows + row; c < g.c && j < total; j += parts * rows) {
        I in, ic, im, it;
        unravel(j, g.n, (I)1, g.m, span, g.time_last, &in, &ic, &im, &it);
        const I t = it + lag;
        acc_t v = to_acc(gh[sg.at(in, c, im, t)]);
        if (tap < k) {
            v *= to_acc(x[sx.at(in, c, im, t - lag)]);
        }
        acc += v;
    }
    buf[threadIdx.x] = acc;
    __syncthreads();
    for (int half = rows / 2; half > 0; half >>= 1) {  // fixed tree over the rows: deterministic order
        if (row < half) {
            buf[threadIdx.x] += buf[threadIdx.x + half * lanes];
        }
        __syncthreads();
    }
    if (row == 0 && c < g.c) {
        partial[((I)tap * g.c + c) * parts + part] = buf[threadIdx.x];
    }
}

// ---------------------------------------------------------------- entry points
// Plain scalar arguments only (64-bit sizes and strides, 32-bit flags), so that any launcher
// can pass them; the _i32 kernels narrow them to int (the launcher checks that they fit).
#define MFPSN_DEFINE_KERNELS_IDX(sfx, scalar_t, acc_t, I)                                            \
    extern "C" __global__ void mfpsn_forward_##sfx(                                                  \
        const scalar_t *x, const acc_t *w, const acc_t *bias, scalar_t *h,                           \
        i64 n, i64 c, i64 m, i64 t, i64 xsn, i64 xsc, i64 xsm, i64 xst,                             \
        int time_last, int k, i64 dilation, int has_bias) {                                          \
        Geom<I> g = {(I)n, (I)c, (I)m, (I)t, time_last};                                             \
        Strides<I> s = {(I)xsn, (I)xsc, (I)xsm, (I)xst};                                             \
        correlate<scalar_t, acc_t, I>(x, s, w, has_bias ? bias : 0, h, g, k, (I)dilation, 1);        \
    }                                                                                                \
    extern "C" __global__ void mfpsn_grad_x_##sfx(                                                   \
        const scalar_t *gh, const acc_t *w, scalar_t *gx,                                            \
        i64 n, i64 c, i64 m, i64 t, i64 gsn, i64 gsc, i64 gsm, i64 gst,                             \
        int time_last, int k, i64 dilation) {                                                        \
        Geom<I> g = {(I)n, (I)c, (I)m, (I)t, time_last};                                             \
        Strides<I> s = {(I)gsn, (I)gsc, (I)gsm, (I)gst};                                             \
        correlate<scalar_t, acc_t, I>(gh, s, w, 0, gx, g, k, (I)dilation, -1);                       \
    }                                                                                                \
    extern "C" __global__ void mfpsn_grad_wb_##sfx(                                                  \
        const scalar_t *x, const scalar_t *gh, acc_t *partial,                                       \
        i64 n, i64 c, i64 m, i64 t, i64 xsn, i64 xsc, i64 xsm, i64 xst,                             \
        i64 gsn, i64 gsc, i64 gsm, i64 gst, int time_last, int k, i64 dilation, i64 parts,           \
        int lanes) {                                                                                 \
        Geom<I> g = {(I)n, (I)c, (I)m, (I)t, time_last};                                             \
        Strides<I> sx = {(I)xsn, (I)xsc, (I)xsm, (I)xst};                                            \
        Strides<I> sg = {(I)gsn, (I)gsc, (I)gsm, (I)gst};                                            \
        grad_weight_bias<scalar_t, acc_t, I>(x, sx, gh, sg, partial, g, k, (I)dilation, (I)parts,    \
                                             lanes);                                                 \
    }
#define MFPSN_DEFINE_KERNELS(sfx, scalar_t, acc_t)                                                   \
    MFPSN_DEFINE_KERNELS_IDX(sfx, scalar_t, acc_t, i64)                                              \
    MFPSN_DEFINE_KERNELS_IDX(sfx##_i32, scalar_t, acc_t, int)

// The storage types and their accumulation types; a launcher can expand this list too.
#define MFPSN_DTYPES(X) X(f32, float, float) X(f64, double, double) X(f16, f16_t, float) X(bf16, bf16_t, float)

MFPSN_DTYPES(MFPSN_DEFINE_KERNELS)
