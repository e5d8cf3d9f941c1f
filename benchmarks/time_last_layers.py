"""Speed of the time-last stateless layers: 'vmap' vs 'highdim' vs SpikingJelly's time-first fusion.

Prints, per layer and input shape, the forward+backward time of each way relative to the time-first
layer of SpikingJelly (T and N fused, a free view) run side by side in this process:

    python benchmarks/time_last_layers.py [--device cpu] [--repeat 20]
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
from spikingjelly.activation_based import functional, layer

import spikingjelly_mfpsn as mf

from _timing import positive_int

CASES = [
    ("Conv1d c64k3", lambda: layer.Conv1d(64, 64, 3, padding=1), (64, 32)),
    ("Conv2d c64k3", lambda: layer.Conv2d(64, 64, 3, padding=1), (64, 16, 16)),
    ("Conv2d c128k3", lambda: layer.Conv2d(128, 128, 3, padding=1), (128, 8, 8)),
    ("AvgPool1d k2", lambda: layer.AvgPool1d(2, 2), (64, 32)),
    ("AvgPool2d k2", lambda: layer.AvgPool2d(2, 2), (64, 16, 16)),
    ("MaxPool2d k2", lambda: layer.MaxPool2d(2, 2), (64, 16, 16)),
    ("AdaptiveAvgPool2d 1", lambda: layer.AdaptiveAvgPool2d(1), (64, 16, 16)),
    ("Linear 1024->256", lambda: layer.Linear(1024, 256), (1024,)),
]


def timed(fn, x, repeat):
    """Mean seconds of forward+backward over the last ``repeat`` of ``2*repeat + 1`` runs."""
    times = []
    for _ in range(2 * repeat + 1):
        xi = x.detach().requires_grad_()
        if x.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(xi).sum().backward()
        if x.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sum(times[-repeat:]) / repeat


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=positive_int, default=20)
    ap.add_argument("-T", type=positive_int, default=8)
    ap.add_argument("-N", type=positive_int, default=16)
    args = ap.parse_args()
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA device here")
    torch.manual_seed(0)
    print(f"T={args.T} N={args.N} device={args.device}; time relative to SpikingJelly time-first (lower is faster)")
    print(f"{'layer':<22}{'time-first ms':>14}{'vmap':>8}{'highdim':>9}")
    for name, make, feat in CASES:
        tf = make().to(args.device)
        functional.set_step_mode(tf, "m")
        x_tf = torch.randn(args.T, args.N, *feat, device=args.device)
        x_tl = x_tf.movedim(0, -1).contiguous()
        base = timed(tf, x_tf, args.repeat)
        row = f"{name:<22}{base * 1e3:>14.3f}"
        for method in mf.layer.METHODS:
            tl = mf.layer.time_last(copy.deepcopy(tf))
            if method in tl.supported_methods:
                tl.method = method
                row += f"{timed(tl, x_tl, args.repeat) / base:>{8 if method == 'vmap' else 9}.2f}"
            else:
                row += f"{'-':>9}"
        print(row)


if __name__ == "__main__":
    main()
