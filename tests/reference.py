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
    return torch.stack(steps, 0)


def charge(x, weight, bias, dilation, layout):
    if layout == "time_first":
        return charge_time_first(x, weight, bias, dilation)
    # time-last (N, C, *, T): bring T to the front, compute, move it back.
    return charge_time_first(x.movedim(-1, 0), weight, bias, dilation).movedim(0, -1)


def pow2(w):
    """Q(w) = sign(w) * 2**round(log2|w|), written element by element in float64."""
    import math
    out = torch.empty_like(w)
    flat_in, flat_out = w.reshape(-1).tolist(), []
    for v in flat_in:
        if v == 0:
            flat_out.append(0.0)
        else:
            flat_out.append(math.copysign(2.0 ** round(math.log2(abs(v))), v))
    out.copy_(torch.tensor(flat_out, dtype=torch.float64).reshape(w.shape))
    return out
