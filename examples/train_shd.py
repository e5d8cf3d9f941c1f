"""Spiking Heidelberg Digits with MF-PSN (paper Appendix E: {Dcls256-BN-SN-DP}*2-Dcls20-LIF(Vth=1e9)).

The hidden layers have learnable synaptic delays (Dcls1d from the dcls package) when dcls is
installed, plain fully connected layers otherwise (--delays on|off|auto). Spikes are binned into
--bins frames and neighbouring input channels summed in groups of --unit-bin.

    python examples/train_shd.py --data-dir DIR      # DIR holds shd_train.h5 and shd_test.h5
    torchrun --nproc_per_node=2 examples/train_shd.py --data-dir DIR

Writes OUT_DIR/metrics.json, OUT_DIR/curves.png and OUT_DIR/checkpoint.pt (every epoch; --resume).
"""
from __future__ import annotations

import argparse
import math

import common
from spikingjelly_mfpsn.paper import data, models


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=common.HelpFormatter)
    g = p.add_argument_group("data and network")
    g.add_argument("--data-dir", default="data/shd", help="folder with shd_train.h5 and shd_test.h5")
    g.add_argument("--bins", type=int, default=100, help="time steps T per sample")
    g.add_argument("--duration", type=float, default=None,
                   help="seconds binned (default: up to the latest spike in the training file)")
    g.add_argument("--unit-bin", type=int, default=5, help="sum this many neighbouring input channels")
    g.add_argument("--hidden", type=int, default=256, help="hidden features (paper: 256)")
    g.add_argument("--layers", type=int, default=2, help="hidden layers (paper: 2)")
    g.add_argument("--dropout", type=float, default=0.4, help="dropout after each hidden layer")
    g.add_argument("--delays", default="auto", choices=("auto", "on", "off"),
                   help="learnable delays (dcls package); auto: when dcls is installed")
    g.add_argument("--max-delay", type=int, default=25,
                   help="delay kernel size in time steps: delays 0 .. max-delay - 1 (an even size is rounded up to "
                        "the next odd one)")
    g.add_argument("--delay-lr", type=float, default=0.05, help="learning rate of the delay positions")
    common.add_common_args(p, epochs=30, batch_size=128, lr=1e-3, out_dir="runs/shd")
    p.set_defaults(weight_decay=1e-5)
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    common.check_common_args(p, args)
    for name in ("bins", "unit_bin", "hidden", "layers", "max_delay"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.dropout < 1:
        p.error(f"--dropout must be in [0, 1), got {args.dropout}")
    if not 0 <= args.delay_lr <= common.FLOAT32_MAX:
        p.error(f"--delay-lr must be a finite number >= 0, got {args.delay_lr}")
    if args.duration is not None and not (math.isfinite(args.duration) and args.duration > 0):
        p.error(f"--duration must be a finite number of seconds > 0, got {args.duration}")
    if args.delays == "on" and not models.dcls_available():
        p.error("--delays on needs the dcls package (pip install dcls); use --delays off")
    common.check_data_dir(p, "shd", args.data_dir)
    return args


def delay_groups(net):
    """Delay positions and widths get their own learning rate and no weight decay."""
    delay = [p for m in net.modules() if isinstance(m, models.DelayedLinear) for p in (m.dcls.P, m.dcls.SIG)]
    ids = {id(p) for p in delay}
    rest = [p for p in net.parameters() if id(p) not in ids]
    return [{"params": rest}] + ([{"params": delay, "weight_decay": 0.0}] if delay else [])


def build_task(args, env) -> common.Task:
    train_set, test_set = data.load_shd(args.data_dir, bins=args.bins, duration=args.duration,
                                        unit_bin=args.unit_bin)
    if train_set.dropped_spikes or test_set.dropped_spikes:
        env.log(f"binning over {train_set.duration:.3f}s drops {train_set.dropped_spikes} training and "
                f"{test_set.dropped_spikes} test spikes outside it")
    classes = max(train_set.num_classes, test_set.num_classes)
    delays = {"auto": None, "on": True, "off": False}[args.delays]
    net = models.shd_net(train_set.features, classes, T=args.bins, neuron=args.neuron, k=args.k,
                         sawtooth=args.sawtooth, hidden=args.hidden, layers=args.layers, dropout=args.dropout,
                         delays=delays, max_delay=args.max_delay)
    has_delays = any(isinstance(m, models.DelayedLinear) for m in net.modules())
    config = dict(dataset="shd", neuron=args.neuron, k=args.k, sawtooth=args.sawtooth, bins=args.bins,
                  unit_bin=args.unit_bin, hidden=args.hidden, layers=args.layers, delays=has_delays,
                  max_delay=args.max_delay, classes=classes)

    def param_groups(model):
        groups = delay_groups(model)
        if len(groups) > 1:
            groups[1]["lr"] = args.delay_lr
        return groups

    def to_input(frames):  # (N, T, F) -> (T, N, F)
        return frames.transpose(0, 1).contiguous()

    name = f"shd ({'learnable delays' if has_delays else 'no delays'})"
    return common.Task(name, net, train_set, test_set, to_input, config, after_step=models.clamp_delays,
                       param_groups=param_groups)


def main(argv=None) -> dict:
    return common.main(parse_args, build_task, argv)


if __name__ == "__main__":
    main()
