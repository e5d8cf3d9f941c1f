"""Plain, independent references the tests hold the package against.

Written with explicit loops over time and taps, sharing no code with the package.
"""
import torch


def charge_time_first(x, weight, bias, dilation):
    """H[t, :, c] = sum_i W[c, i] * X[t - (k-1-i)*d, :, c] (+ b[c]) for x of shape (T, N, C, *)."""
    T = x.shape[0]
    C, k = weight.shape
    bshape = [1, C] + [1] * (x.dim() - 3)  # broadcast over (N, C, *) of one step
    steps = []
    for t in range(T):
        acc = torch.zeros_like(x[0])
        for i in range(k):
            src = t - (k - 1 - i) * dilation
            if src >= 0:
                acc = acc + weight[:, i].reshape(bshape) * x[src]
        if bias is not None:
            acc = acc + bias.reshape(bshape)
        steps.append(acc)
    return torch.stack(steps, 0) if steps else torch.zeros_like(x)


def charge(x, weight, bias, dilation, layout):
    if layout == "time_first":
        return charge_time_first(x, weight, bias, dilation)
    # time-last (N, C, *, T): bring T to the front, compute, move it back.
    return charge_time_first(x.movedim(-1, 0), weight, bias, dilation).movedim(0, -1)


def batch_stats(h, channel_dim):
    """Per-channel mean and biased variance of ``h`` over every other axis, two passes."""
    dims = [d for d in range(h.dim()) if d != channel_dim]
    mean = h.mean(dims)
    shape = [-1 if d == channel_dim else 1 for d in range(h.dim())]
    return mean, ((h - mean.reshape(shape)) ** 2).mean(dims)


def pow2(w, max_exponent=1023):
    """Q(w) = sign(w) * 2**round(log2|w|), element by element in float64, the rounding decided exactly
    with rationals: |w| = m * 2**e (m in [1/2, 1)) rounds up to 2**e iff m**2 >= 1/2. Exponents above
    ``max_exponent`` are clamped."""
    import math
    from fractions import Fraction

    def q(v):
        if v == 0:
            return 0.0
        m, e = math.frexp(abs(v))
        e = min(e if Fraction(m) ** 2 >= Fraction(1, 2) else e - 1, max_exponent)
        return math.copysign(math.ldexp(1.0, e), v)
    flat = [q(v) for v in w.reshape(-1).tolist()]
    return torch.tensor(flat, dtype=torch.float64).reshape(w.shape).to(w.device, w.dtype)


class Pow2WholeSTE(torch.autograd.Function):
    """Q(w) forward, identity backward."""

    @staticmethod
    def forward(ctx, w):
        return pow2(w)

    @staticmethod
    def backward(ctx, g):
        return g


class Pow2RoundSTE(torch.autograd.Function):
    """Q(w) forward; backward as if only the rounding were the identity: g * |Q(w)| / |w| (0 at w = 0)."""

    @staticmethod
    def forward(ctx, w):
        ctx.save_for_backward(w)
        return pow2(w)

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        ratio = [abs(q) / abs(v) if v != 0 else 0.0 for q, v in zip(pow2(w).reshape(-1).tolist(), w.reshape(-1).tolist())]
        return g * torch.tensor(ratio, dtype=g.dtype, device=g.device).reshape(w.shape)


def atan_primitive(h, alpha=2.0):
    """SpikingJelly's ATan surrogate primitive: arctan(pi/2 * alpha * h) / pi + 1/2."""
    import math
    return torch.atan(math.pi / 2 * alpha * h) / math.pi + 0.5


def mfpsn_charge(x, weight, dilation, layout, threshold, quantize=True, gamma=None, beta=None,
                 v_threshold=None, stats=None, eps=1e-5, ste="whole"):
    """The neuron's H (threshold 0) written straight from the paper's equations.

    threshold 'bn': stats=None means batch statistics of conv(X, W) (training); otherwise (mean, var).
    ste: the quantiser's gradient, 'whole' (identity) or 'round' (Pow2RoundSTE).
    Returns (H, (mean, var) used).
    """
    q = (Pow2WholeSTE.apply if ste == "whole" else Pow2RoundSTE.apply) if quantize else (lambda w: w)
    if threshold == "param":
        return charge(x, q(weight), -v_threshold, dilation, layout), None
    if stats is None:
        y = charge(x, weight, None, dilation, layout)
        cdim = 2 if layout == "time_first" else 1
        yc = y.movedim(cdim, 0).reshape(y.shape[cdim], -1)
        mean = yc.mean(1)
        var = ((yc - mean[:, None]) ** 2).mean(1)
    else:
        mean, var = stats
    wf = gamma[:, None] / torch.sqrt(var[:, None] + eps) * weight
    bf = beta - gamma * mean / torch.sqrt(var + eps)
    return charge(x, q(wf), bf, dilation, layout), (mean, var)
