"""Accuracy vs MF-PSN order k, with and without sawtooth dilations (paper Fig. 6b / Table 9, small scale).

Trains the pixel-by-pixel network (examples/train_sequential.py --pixel) once per order and dilation
choice and prints a table of test accuracies; writes OUT_DIR/ablation.json and OUT_DIR/ablation.png.
With k = 1 the dilation has no effect, so that order is trained once and reported in both columns.

    python examples/ablation_order.py                                  # pixel digits (T = 64)
    python examples/ablation_order.py --dataset cifar10 --data-dir DIR --widths 128 256 --epochs 128

Other options (--epochs, --batch-size, --lr, --seed, --method, ...) are passed to every training run, except
those the sweep sets itself (--k, --neuron, --sawtooth/--no-sawtooth, --pixel) and --resume.
"""
from __future__ import annotations

import argparse
import json
import os

import common  # (also makes spikingjelly_mfpsn importable from a source checkout)
import train_sequential


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=common.HelpFormatter,
                                epilog="Other options go to every run of train_sequential.py (see its --help).")
    p.add_argument("--orders", type=int, nargs="+", default=[1, 2, 3, 4], help="orders k to train")
    p.add_argument("--dataset", default="digits", choices=("digits", "cifar10", "cifar100"),
                   help="digits: scikit-learn's bundled 8x8 digits; cifar10/cifar100: read from --data-dir")
    p.add_argument("--data-dir", default=None,
                   help="folder with the CIFAR python archive or its extracted folder (needed for cifar10/cifar100)")
    p.add_argument("--out-dir", default="runs/ablation_order", help="one folder per run, the table and figure")
    p.add_argument("--widths", type=int, nargs="+", default=[64, 128], help="pixel network stage widths")
    p.add_argument("--blocks", type=int, default=2, help="residual blocks per stage")
    p.add_argument("--epochs", type=int, default=10, help="epochs of every run")
    return p


SWEPT = ("--k", "--neuron", "--sawtooth", "--no-sawtooth", "--pixel", "--resume")  # set by the sweep itself


def passed_options(rest: list[str]) -> set[str]:
    """The train_sequential.py options that ``rest`` names, abbreviations and ``--opt=value`` resolved
    as its parser resolves them."""
    known = [o for a in train_sequential.build_parser()._actions for o in a.option_strings]
    names = set()
    for token in rest:
        name = token.split("=", 1)[0]
        if name.startswith("--"):
            matches = [name] if name in known else [o for o in known if o.startswith(name)]
            names.update(matches if len(matches) == 1 else [])
    return names


def parse_args(argv=None):
    p = build_parser()
    args, rest = p.parse_known_args(argv)
    if not args.orders or min(args.orders) < 1:
        p.error("--orders must list orders >= 1")
    passed = passed_options(rest)
    swept = [o for o in SWEPT if o in passed]
    if swept:
        p.error(f"{', '.join(swept)}: leave out; the sweep sets --k (from --orders), --sawtooth/--no-sawtooth, "
                f"--neuron mfpsn and --pixel itself in every run, and cannot --resume")
    common.check_data_dir(p, args.dataset, args.data_dir)
    if "--overwrite" not in passed:
        held = [d for d in (os.path.join(args.out_dir, tag(k, s)) for k in args.orders for s in (True, False))
                if any(os.path.isfile(os.path.join(d, n)) for n in (common.CHECKPOINT, common.METRICS))]
        held += [f for f in (os.path.join(args.out_dir, "ablation.json"),) if os.path.isfile(f)]  # (another sweep's)
        if held:
            p.error(f"--out-dir {args.out_dir} already holds runs ({', '.join(sorted(set(held)))}): pass "
                    f"--overwrite to replace them, or choose another --out-dir")
    return args, rest


def tag(k: int, sawtooth: bool) -> str:
    return f"k{k}_{'sawtooth' if sawtooth else 'no_sawtooth'}"


def run(k: int, sawtooth: bool, args, rest) -> float:
    name = tag(k, sawtooth)
    argv = ["--pixel", "--neuron", "mfpsn", "--k", str(k), "--sawtooth" if sawtooth else "--no-sawtooth",
            "--widths", *map(str, args.widths), "--blocks", str(args.blocks), "--epochs", str(args.epochs),
            "--dataset", args.dataset, "--out-dir", os.path.join(args.out_dir, name), *rest]
    if args.data_dir:
        argv += ["--data-dir", args.data_dir]
    print(f"--- {name}: train_sequential.py {' '.join(argv)}", flush=True)
    return train_sequential.main(argv)["final_test_acc"]


def plot(results: dict, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for key, label, marker in (("sawtooth", "w/ sawtooth dilations", "o"), ("no_sawtooth", "w/o (d = 1)", "s")):
        ks = sorted(int(k) for k in results[key])
        ax.plot(ks, [100 * results[key][str(k)] for k in ks], marker=marker, label=label)
    ax.set(xlabel="order k", ylabel="test accuracy (%)", title=title)
    ax.set_xticks(sorted(int(k) for k in results["sawtooth"]))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> dict:
    args, rest = parse_args(argv)
    results = {"sawtooth": {}, "no_sawtooth": {}}
    for k in sorted(set(args.orders)):
        acc = run(k, True, args, rest)
        results["sawtooth"][str(k)] = acc
        results["no_sawtooth"][str(k)] = acc if k == 1 else run(k, False, args, rest)
    os.makedirs(args.out_dir, exist_ok=True)
    title = f"pixel {args.dataset}: accuracy vs order"
    with open(os.path.join(args.out_dir, "ablation.json"), "w") as f:
        json.dump(dict(dataset=args.dataset, args=vars(args), extra_args=rest, test_acc=results), f, indent=1)
    plot(results, os.path.join(args.out_dir, "ablation.png"), title)
    print(f"\n{title} (test accuracy, %)")
    print(f"{'k':>3} | {'sawtooth':>9} | {'d = 1':>9}")
    for k in sorted(int(k) for k in results["sawtooth"]):
        print(f"{k:>3} | {100 * results['sawtooth'][str(k)]:9.2f} | {100 * results['no_sawtooth'][str(k)]:9.2f}")
    print(f"-> {os.path.join(args.out_dir, 'ablation.png')}", flush=True)
    return results


if __name__ == "__main__":
    main()
