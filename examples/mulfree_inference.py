"""Fold the sequential-CIFAR MF-PSN network and run it mul-free: integer bit-shift neurons, streaming.

    python examples/mulfree_inference.py [--batch 2] [--seed 0] [--nir OUT.nir] [--onnx OUT.onnx]

Builds {{c128k3s1-BN-SN}*3-APk2s2}*2-FC256-SN-FC100 with MF-PSN (k = 16, sawtooth dilations), sets
its batch-norm statistics from two random batches (no training), folds it, and prints: whether folded
and unfolded eval agree, the integer path's agreement with the float32 path per neuron in the
calibrated fixed-point formats (set_integer(net, calibrate=x)), and single-step streaming against
multi-step with the neuron state size. Float32
streaming can differ from multi-step where a charge lands within rounding of the threshold (the
multi-step charge sums in another order); the integer neuron is exact, so only its float inputs can.
With --nir it also writes the folded network as a NIR graph (pip install "spikingjelly_mfpsn[nir]"),
reads the file back and runs it; with --onnx it writes the integer network (up to its last neuron) as an
ONNX model, whole-sequence to OUT.onnx and streaming to OUT.stream.onnx (pip install
"spikingjelly_mfpsn[onnx]"), and runs the first with onnxruntime.
"""
import argparse
import importlib.util
import os

import torch
from spikingjelly.activation_based import functional

from common import HelpFormatter  # (first: it makes spikingjelly_mfpsn importable from a source checkout)
from spikingjelly_mfpsn import deploy
from energy_table5 import T, calibrate, image_to_sequence, mfpsn, sequential_cifar_net


def state_bytes(net) -> int:
    return sum(t.numel() * t.element_size() for _, m in deploy.folded_neurons(net) for t in m.x_queue)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    parser.add_argument("--batch", type=int, default=2, help="random images run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and images")
    parser.add_argument("--nir", metavar="OUT.nir", default=None,
                        help="also export the folded network to this NIR file and check it read back")
    parser.add_argument("--onnx", metavar="OUT.onnx", default=None,
                        help="also export the integer network to ONNX (whole-sequence and OUT.stream.onnx)")
    return parser


def export_onnx(body, x, path) -> None:
    """Write ``body`` (integer neurons) as whole-sequence and streaming ONNX models; run the first."""
    from spikingjelly_mfpsn.onnx import export_onnx as export
    export(body, x, path)
    stream = path[:-len(".onnx")] + ".stream.onnx" if path.endswith(".onnx") else path + ".stream.onnx"
    export(body, x, stream, streaming=True)
    functional.reset_net(body)
    want = body(x)
    functional.reset_net(body)
    try:
        import onnxruntime
    except ImportError:
        print(f"\nONNX: wrote {path} and {stream} (install onnxruntime to run them)")
        return
    got = onnxruntime.InferenceSession(path).run(None, {"x": x.numpy()})[0]
    print(f"\nONNX: wrote {path} and {stream}; onnxruntime's spikes equal the integer network's: "
          f"{torch.equal(torch.from_numpy(got), want)}")


def export_nir(net, x, path) -> None:
    """Write ``net`` as a NIR graph to ``path``, read it back and compare the imported network's output."""
    import nir
    from spikingjelly_mfpsn.nir import export_to_nir, import_from_nir
    graph = export_to_nir(net, x)
    nir.write(path, graph)
    functional.reset_net(net)
    same = torch.equal(import_from_nir(path)(x), net(x))
    functional.reset_net(net)
    print(f"\nNIR: {len(graph.nodes)} nodes written to {path}; read back, the same outputs: {same}")


@torch.no_grad()
def main():
    parser = build_parser()
    args = parser.parse_args()
    if args.batch < 1:
        parser.error(f"--batch must be >= 1, got {args.batch}")
    for flag, path, package in (("--nir", args.nir, "nir"), ("--onnx", args.onnx, "onnx")):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder is not None and not os.path.isdir(folder):
            parser.error(f"{flag} {path}: the folder {folder} is not there; create it first")
        if path and os.path.isdir(path):
            parser.error(f"{flag} {path} is a folder: give the file to write")
        if path and importlib.util.find_spec(package) is None:  # (before the run, not after it)
            parser.error(f"{flag} needs the {package} package: pip install \"spikingjelly_mfpsn[{package}]\"")
    torch.manual_seed(args.seed)
    net = sequential_cifar_net(mfpsn(k=16, sawtooth=True))
    calibrate(net, 2)
    x = image_to_sequence(torch.randn(args.batch, 3, 32, T))
    want = net.eval()(x)  # (folding is for inference: the running statistics)
    functional.reset_net(net)
    deploy.fold(net)
    print("folded == unfolded (float eval):", torch.equal(net(x), want))
    if args.nir:
        export_nir(net, x, args.nir)

    print("\nspike agreement, integer vs float32 path (local: same input; network: whole net integer)")
    deploy.set_integer(net, calibrate=x)  # per layer, the widest fixed-point format the data fits
    formats = {name: m.frac_bits for name, m in deploy.folded_neurons(net)}
    rates = deploy.agreement(net, x)  # (warns where they differ)
    local = min(r["local"] for r in rates.values())
    network = min(r["network"] for r in rates.values())
    print(f"  calibrated formats {min(formats.values())}-{max(formats.values())} fractional bits: worst layer "
          f"local {local:.6f}, network {network:.6f}")

    body = net[:-1]  # the classifier's float logits differ in the last bit between batched and per-step
    if args.onnx:  # (the neurons are in their calibrated integer formats here)
        export_onnx(body, x, args.onnx)
    print("\nstreaming (step_mode 's', one column at a time) vs multi-step: spikes of the last SN layer")
    for arithmetic in ("float", "integer"):
        deploy.set_integer(net, calibrate=x) if arithmetic == "integer" else deploy.set_float(net)
        for t in (2 * T, 4 * T):  # both longer than the largest receptive field (k-1)*d+1 = 46
            xs = image_to_sequence(torch.randn(args.batch, 3, 32, t))
            functional.reset_net(net)
            multi = body(xs)
            functional.set_step_mode(net, "s")
            functional.reset_net(net)
            single = torch.stack([body(x_t) for x_t in xs])
            same = (single == multi).double().mean().item()
            print(f"  {arithmetic:7s} T={t}: equal spikes {same:.6f}, neuron state "
                  f"{state_bytes(net)} bytes")
            functional.set_step_mode(net, "m")


if __name__ == "__main__":
    main()
