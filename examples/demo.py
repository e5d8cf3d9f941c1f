"""A short demo: a SpikingJelly LIF network, its neurons switched to MF-PSN in one call, trained a few
epochs on scikit-learn's bundled handwritten digits (8x8 images fed column by column, T = 8).

    python examples/demo.py [--epochs 3]
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from spikingjelly.activation_based import functional, layer, neuron

from common import HelpFormatter  # the examples' --help policy (and spikingjelly_mfpsn from a source checkout)
import spikingjelly_mfpsn  # noqa: F401  (adds MulFreeChannelwisePSN and functional.replace_neurons)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--epochs", type=int, default=3, help="passes over the training digits")
    p.add_argument("--k", type=int, default=2, help="order of the MF-PSN neurons")
    p.add_argument("--seed", type=int, default=0, help="seed of the network and the data split")
    return p


def main():
    parser = build_parser()
    args = parser.parse_args()
    for name in ("epochs", "k"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    torch.manual_seed(args.seed)

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32) / 16.0  # (N, 8, 8)
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(x))
    x, y = x[perm], y[perm]
    n_test = len(x) // 5
    x_train, y_train, x_test, y_test = x[n_test:], y[n_test:], x[:n_test], y[:n_test]

    # A plain SpikingJelly network with LIF neurons; each column of the image is one time step.
    net = nn.Sequential(
        layer.Linear(8, 64), neuron.LIFNode(),
        layer.Linear(64, 64), neuron.LIFNode(),
        layer.Linear(64, 10),
    )
    functional.set_step_mode(net, "m")
    example = x_train[:4].permute(2, 0, 1)  # (T=8 columns, N, 8 rows)
    net, summary = functional.replace_neurons(net, k=args.k, example_input=example)
    print(summary)

    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    t0 = time.time()
    for epoch in range(args.epochs):
        net.train()
        order = torch.randperm(len(x_train))
        for i in range(0, len(order), 64):
            idx = order[i:i + 64]
            out = net(x_train[idx].permute(2, 0, 1)).mean(0)
            loss = F.cross_entropy(out, y_train[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            functional.reset_net(net)
        net.eval()
        with torch.no_grad():
            acc = (net(x_test.permute(2, 0, 1)).mean(0).argmax(1) == y_test).float().mean().item()
        functional.reset_net(net)
        print(f"epoch {epoch + 1}: loss {loss.item():.3f}  test accuracy {acc:.3f}")
    print(f"done in {time.time() - t0:.1f}s: test accuracy {acc:.3f} on {len(x_test)} held-out digits")


if __name__ == "__main__":
    main()
