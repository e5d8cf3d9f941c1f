"""Operation counts and energy of the sequential-CIFAR100 network (paper Table 5) with untrained weights.

Network (paper Appendix E): {{c128k3s1-BN-SN}*3-APk2s2}*2-FC256-SN-FC100, T = 32 (one image column
per step), MF-PSN order k = 16. Run::

    python examples/energy_table5.py [--batch 8] [--seed 0] [--calibrate 0] [--firing-rate 0.0143]

Prints a table like the paper's Table 5 for PSN (SpikingJelly 2.x only) and MF-PSN (d = 1 as the
paper's Table 1 assumes, and the sawtooth dilations 1, 2, 3, ...), then each network's per-layer counts
and measured firing rates. Weights are never trained: ``--calibrate N`` only runs N random batches in
train mode to set the batch-norm statistics (as-initialised statistics silence the deeper layers);
``--firing-rate`` replaces the measured rates in the SOP formula (e.g. the paper's implied ~1.4%).
"""
import argparse

import torch
import torch.nn as nn
from spikingjelly.activation_based import layer, neuron

import spikingjelly_mfpsn  # noqa: F401
from spikingjelly_mfpsn import MulFreeChannelwisePSN, energy, update_bn

T = 32
PAPER_TABLE5 = """Paper Table 5 (trained network, per CIFAR100 image):
PSN     | 1.91e7 MUL, 1.97e7 ADD     | 88.56 | 0.041e6 FLOPs, 3.194e6 SOPs | 3.06 | 91.62
MF-PSN  | 7.32e6 SHIFT, 7.92e6 ADD   |  8.08 | 0.041e6 FLOPs, 2.660e6 SOPs | 2.58 | 10.66"""


def sequential_cifar_net(make_neuron, channels: int = 128, classes: int = 100, length: int = 32) -> nn.Sequential:
    """{{c{channels}k3s1-BN-SN}*3-APk2s2}*2-FC256-SN-FC{classes} on (T, N, 3, length) sequences.

    ``make_neuron(index, features)`` returns the index-th spiking neuron layer (multi-step).
    """
    layers, c_in, index = [], 3, 0
    for _ in range(2):
        for _ in range(3):
            layers += [layer.Conv1d(c_in, channels, 3, 1, 1, bias=False, step_mode="m"),
                       layer.BatchNorm1d(channels, step_mode="m"), make_neuron(index, channels)]
            c_in, index = channels, index + 1
        layers.append(layer.AvgPool1d(2, 2, step_mode="m"))
    layers += [layer.Flatten(step_mode="m"), layer.Linear(channels * length // 4, 256, step_mode="m"),
               make_neuron(index, 256), layer.Linear(256, classes, step_mode="m")]
    return nn.Sequential(*layers)


def mfpsn(k: int = 16, sawtooth: bool = False):
    return lambda i, c: MulFreeChannelwisePSN(c, k=k, dilation=(i % 3 + 1) if sawtooth else 1, step_mode="m")


def image_to_sequence(images: torch.Tensor) -> torch.Tensor:
    """(N, 3, H, W) images -> (T = W, N, 3, H): one column per time step."""
    return images.permute(3, 0, 1, 2).contiguous()


@torch.no_grad()
def calibrate(net: nn.Module, batches: int, batch_size: int = 16) -> None:
    """Set batch-norm statistics (SpikingJelly BN layers and MF-PSN thresholds) from random images of torch's
    generator, as a cumulative average (``spikingjelly_mfpsn.update_bn``); weights stay untouched."""
    if batches:
        update_bn([image_to_sequence(torch.randn(batch_size, 3, 32, T)) for _ in range(batches)], net)


def build_parser() -> argparse.ArgumentParser:
    from common import HelpFormatter  # here: tests load this file as a module without examples/ on the path
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="random images measured")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and images")
    parser.add_argument("--calibrate", type=int, default=0, metavar="N",
                        help="random batches run in train mode to set batch-norm statistics (no weight update)")
    parser.add_argument("--firing-rate", type=float, default=None,
                        help="firing rate used in the SOP formula (default: the measured rates)")
    return parser


def main():
    parser = build_parser()
    args = parser.parse_args()
    if args.batch < 1 or args.calibrate < 0:
        parser.error(f"--batch must be >= 1 and --calibrate >= 0, got {args.batch} and {args.calibrate}")
    if args.firing_rate is not None and not 0.0 <= args.firing_rate <= 1.0:
        parser.error(f"--firing-rate must be in [0, 1], got {args.firing_rate}")
    torch.manual_seed(args.seed)
    x = image_to_sequence(torch.randn(args.batch, 3, 32, T))  # normalised-image statistics
    builders = {"MF-PSN (d=1)": mfpsn(), "MF-PSN (sawtooth d)": mfpsn(sawtooth=True)}
    if hasattr(neuron, "PSN"):  # (SpikingJelly 2.x)
        builders = {"PSN": lambda i, c: neuron.PSN(T), **builders}
    nets = {}
    for name, build in builders.items():  # (each from the seed: the same weights on every SpikingJelly version)
        torch.manual_seed(args.seed)
        nets[name] = sequential_cifar_net(build)
    reports = {}
    for name, net in nets.items():
        torch.manual_seed(args.seed + 1)  # (the same images for every network, on every SpikingJelly version)
        calibrate(net, args.calibrate)
        reports[name] = energy.estimate(net.eval(), x, firing_rate=args.firing_rate)
    print(energy.table5(reports))
    print()
    print(PAPER_TABLE5)
    for name, report in reports.items():
        print(f"\n{name}: per-layer counts per sample")
        print(report.layer_table())


if __name__ == "__main__":
    main()
