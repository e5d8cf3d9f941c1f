"""Sequential image classification with MF-PSN (paper Sec. 5.1, Appendix E-F).

Images are fed column by column (T = width) to the network {{cCk3s1-BN-SN}*3-APk2s2}*2-FC256-SN-FC,
or pixel by pixel with --pixel (T = H*W) to FC128-BN-SN-{RB128}*2-APk4s4-FC256-BN-SN-{RB256}*2-FC.
AdamW with a cosine learning-rate schedule and label smoothing, as in the paper.

    python examples/train_sequential.py                      # bundled 8x8 digits, under a minute on 2 CPU cores
    python examples/train_sequential.py --pixel              # pixel by pixel (T = 64)
    python examples/train_sequential.py --dataset cifar10 --data-dir DIR --channels 128 --epochs 256
    torchrun --nproc_per_node=2 examples/train_sequential.py # DistributedDataParallel

Writes OUT_DIR/metrics.json, OUT_DIR/curves.png and OUT_DIR/checkpoint.pt (every epoch; --resume).
"""
from __future__ import annotations

import argparse

import torch

import common
from spikingjelly_mfpsn.paper import data, models


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=common.HelpFormatter)
    g = p.add_argument_group("data and network")
    g.add_argument("--dataset", default="digits", choices=("digits", "cifar10", "cifar100"),
                   help="digits: scikit-learn's bundled 8x8 digits; cifar10/cifar100: read from --data-dir")
    g.add_argument("--data-dir", default=None,
                   help="folder with the CIFAR python archive or its extracted folder (needed for cifar10/cifar100)")
    g.add_argument("--pixel", action="store_true", help="pixel by pixel (T = H*W) with the residual FC network")
    g.add_argument("--channels", type=int, default=64, help="conv channels, sequential network (paper: 128)")
    g.add_argument("--convs", type=int, default=3, help="conv layers per stage, sequential network (paper: 3)")
    g.add_argument("--stages", type=int, default=2, help="conv stages, each ending in a 2x pool (paper: 2)")
    g.add_argument("--hidden", type=int, default=256, help="FC width before the classifier (paper: 256)")
    g.add_argument("--widths", type=int, nargs="+", default=[128, 256],
                   help="stage widths, pixel network (paper: 128 256)")
    g.add_argument("--blocks", type=int, default=2, help="residual blocks per stage, pixel network (paper: 2)")
    g.add_argument("--time-pool", type=int, default=4, help="pooling along time between pixel stages (paper: 4)")
    common.add_common_args(p, epochs=20, batch_size=64, lr=2e-3, out_dir="runs/sequential")
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    common.check_common_args(p, args)
    for name in ("channels", "convs", "stages", "hidden", "blocks", "time_pool"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.widths) < 1:
        p.error(f"--widths must all be >= 1, got {args.widths}")
    height = 8 if args.dataset == "digits" else 32
    if not args.pixel and height % 2 ** args.stages:
        p.error(f"--stages {args.stages}: {args.dataset} images are {height} pixels high, which {args.stages} "
                f"halvings do not divide (at most {height.bit_length() - 1} stages)")
    common.check_data_dir(p, args.dataset, args.data_dir)
    return args


def build_task(args, env) -> common.Task:
    x_train, y_train, x_test, y_test = data.load_images(args.dataset, args.data_dir)
    x_train, x_test = data.standardize(x_train, x_test)
    _, c, h, w = x_train.shape
    classes = data.num_classes(args.dataset)
    neuron = dict(neuron=args.neuron, k=args.k, sawtooth=args.sawtooth)
    if args.pixel:
        config = dict(pixel=True, widths=list(args.widths), blocks=args.blocks, time_pool=args.time_pool)
        net = models.pixel_image_net(c, classes, T=h * w, widths=args.widths, blocks=args.blocks,
                                     time_pool=args.time_pool, **neuron)
        to_input = data.to_pixels
    else:
        config = dict(pixel=False, channels=args.channels, convs=args.convs, stages=args.stages, hidden=args.hidden)
        net = models.sequential_image_net(c, h, classes, T=w, channels=args.channels, convs_per_stage=args.convs,
                                          stages=args.stages, hidden=args.hidden, **neuron)
        to_input = data.to_columns
    config.update(dataset=args.dataset, **neuron)
    name = f"{'pixel' if args.pixel else 'sequential'} {args.dataset}"
    return common.Task(name, net, torch.utils.data.TensorDataset(x_train, y_train),
                       torch.utils.data.TensorDataset(x_test, y_test), to_input, config)


def main(argv=None) -> dict:
    return common.main(parse_args, build_task, argv)


if __name__ == "__main__":
    main()
