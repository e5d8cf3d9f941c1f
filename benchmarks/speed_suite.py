"""The speed suite: ratio tables measured side by side in one process (never absolute claims).

    python benchmarks/speed_suite.py [--parts neuron,network,overhead,inference,eval] [--quick] [--out DIR]

1. neuron    MF-PSN layer forward+backward (training, BN threshold), every method x layout, over T, k, d,
             at the sequential-CIFAR conv shape (N x 128 x 32 per step) and an FC shape (N x 256): speed-up
             over the vanilla time-first reshape+Conv1d, and time over a memory floor (an out-of-place
             per-channel scale of the same tensor, forward+backward). Plus torch.compile'd neurons.
2. network   one training step of the paper's sequential-CIFAR network: MF-PSN autoselected (batch
             norms apart and fused into the neurons), MF-PSN vanilla, SpikingJelly's PSN / SlidingPSN /
             LIF on the same network, eager and compiled.
3. overhead  autoselect (cold cache and warm cache) as a percent of one epoch of the digits example.
4. inference single-step inference of the sequential network: state memory and time per step, MF-PSN
             (k=4) against SlidingPSN (k=32), paper Table 3.
5. eval      multi-step eval forward (no gradients) of the sequential network: MF-PSN as built, after
             autoselect for training and after autoselect for inference (called under no_grad),
             against SpikingJelly's PSN; and the two autoselect calls' durations.

Writes ``DIR/speed.md`` (tables) and ``DIR/speed.png`` (chart); prints the tables as it goes.
"""
from __future__ import annotations

import argparse
import copy
import itertools
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import interleaved, machine, markdown_table, median, out_folder, positive_int, ratio_cell  # noqa: E402

from spikingjelly.activation_based import base as sj_base, functional  # noqa: E402

import spikingjelly_mfpsn as mf  # noqa: E402
from spikingjelly_mfpsn import MulFreeChannelwisePSN, ops  # noqa: E402
from spikingjelly_mfpsn.paper import models  # noqa: E402

VANILLA = ("time_first", "conv1d")


def step_fn(module, x, layout):
    """One forward+backward of ``module`` on a fresh leaf copy of ``x``."""
    grad = torch.ones_like(x)

    def run():
        xi = x.detach().requires_grad_()
        out = module(xi)
        out.backward(grad)
        functional.reset_net(module)
    return run


def floor_fn(x, channel_axis):
    """The memory floor: an out-of-place per-channel scale, forward and backward."""
    shape = [1] * x.dim()
    shape[channel_axis] = -1
    w = torch.randn(x.shape[channel_axis]).view(shape).requires_grad_()
    grad = torch.ones_like(x)

    def run():
        xi = x.detach().requires_grad_()
        (xi * w).backward(grad)
    return run


# ------------------------------------------------------------------------------------------ part 1
def part_neuron(args, out):
    shapes = {"conv N16xC128xL32": (16, 128, (32,)), "fc N64xC256": (64, 256, ())}
    ts = [8, 32] if args.quick else [2, 4, 8, 16, 32]
    ks = [2, 8] if args.quick else [2, 4, 8]
    ds = [1, 3] if args.quick else [1, 2, 3]
    header = ["shape", "T", "k", "d", "best (layout/method)", "best vs vanilla", "best / floor"]
    rows, per_impl = [], []
    targets = {"speedup": [], "floor": []}
    for (sname, (n, c, feat)), t, k, d in itertools.product(shapes.items(), ts, ks, ds):
        x_first = torch.randn(t, n, c, *feat)
        x_last = x_first.movedim(0, -1).contiguous()
        fns = {}
        for layout in ops.LAYOUTS:
            x = x_first if layout == "time_first" else x_last
            for method in ops.candidate_names(layout):  # every implementation autoselect may pick here
                sn = MulFreeChannelwisePSN(c, k=k, dilation=d, step_mode="m", layout=layout, method=method)
                if ops.get(method).supports(x, sn.weight, d, layout):
                    fns[(layout, method)] = step_fn(sn, x, layout)
        fns["floor"] = floor_fn(x_first, 2)
        times = interleaved(fns, repeats=args.repeats, warmup=1)
        impls = {key: v for key, v in times.items() if key != "floor"}
        best = min(impls, key=lambda key: median(impls[key]))
        speed = median(times[VANILLA]) / median(times[best])
        over_floor = median(times[best]) / median(times["floor"])
        rows.append([sname, t, k, d, "/".join(best), ratio_cell(times[VANILLA], times[best]),
                     ratio_cell(times[best], times["floor"])])
        per_impl.append((sname, t, k, d, {"/".join(key): median(times[VANILLA]) / median(v)
                                          for key, v in impls.items()}))
        if t >= 8:
            targets["speedup"].append(speed)
        targets["floor"].append(over_floor)
        print(" | ".join(str(x) for x in rows[-1]), flush=True)
    text = ["## 1. Neuron layer forward+backward (training, threshold='bn')", "",
            "Speed-up = vanilla time / best time (higher is faster); floor = best time / memory-floor time.",
            "", markdown_table(header, rows), ""]
    names = sorted({name for *_, d_ in per_impl for name in d_})
    text += ["Every implementation, speed-up over vanilla:", "",
             markdown_table(["shape", "T", "k", "d"] + names,
                            [[s, t, k, d] + [f"{r.get(nm, float('nan')):.2f}" for nm in names]
                             for s, t, k, d, r in per_impl]), ""]
    sp, fl = sorted(targets["speedup"]), sorted(targets["floor"])
    text += [f"Target: best >= 3x vanilla at T >= 8. Median over configs {median(sp):.2f}x, "
             f"min {sp[0]:.2f}x, max {sp[-1]:.2f}x.",
             f"Target: best within 2.5x of the memory floor. Median {median(fl):.2f}x, min {fl[0]:.2f}x, "
             f"max {fl[-1]:.2f}x.", ""]
    text += [] if args.no_compile else part_neuron_compiled(args)
    out.append("\n".join(text))
    return per_impl


def part_neuron_compiled(args):
    """torch.compile'd neurons (inductor) next to eager ones, at a few configurations."""
    rows = []
    configs = [(16, 128, (32,), 8, 2, 1), (16, 128, (32,), 32, 2, 1)] if not args.quick else \
        [(16, 128, (32,), 8, 2, 1)]
    for n, c, feat, t, k, d in configs:
        x = torch.randn(t, n, c, *feat)
        eager = MulFreeChannelwisePSN(c, k=k, dilation=d, step_mode="m")
        vanilla = MulFreeChannelwisePSN(c, k=k, dilation=d, step_mode="m", method="conv1d")
        compiled = torch.compile(copy.deepcopy(eager))
        fns = {"vanilla": step_fn(vanilla, x, "time_first"), "eager": step_fn(eager, x, "time_first"),
               "compiled": step_fn(compiled, x, "time_first"), "floor": floor_fn(x, 2)}
        t0 = time.perf_counter()
        fns["compiled"]()
        compile_s = time.perf_counter() - t0
        times = interleaved(fns, repeats=args.repeats, warmup=1)
        rows.append([f"N{n}xC{c}xL{feat[0] if feat else 1}", t, k, d,
                     ratio_cell(times["vanilla"], times["eager"]), ratio_cell(times["vanilla"], times["compiled"]),
                     ratio_cell(times["compiled"], times["floor"]), f"{compile_s:.0f} s"])
        print(" | ".join(str(x) for x in rows[-1]), flush=True)
    return ["torch.compile (inductor) of the whole neuron, default method:", "",
            markdown_table(["shape", "T", "k", "d", "eager vs vanilla", "compiled vs vanilla",
                            "compiled / floor", "first compile"], rows), ""]


# ------------------------------------------------------------------------------------------ part 2
def _seq_net(kind, T, channels, k=2):
    if kind in ("psn", "sliding_psn") and not models.psn_available(kind):
        return None
    return models.sequential_image_net(3, 32, 100, T=T, neuron=kind, k=k if kind != "sliding_psn" else 32 if T >= 32
                                       else T, channels=channels, hidden=256)


def train_step(net, x, y, opt):
    def run():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x).mean(0), y)
        loss.backward()
        opt.step()
        functional.reset_net(net)
    return run


def part_network(args, out):
    T, N = 32, args.batch
    channels = 64 if args.quick else 128
    x = torch.rand(T, N, 3, 32)
    y = torch.randint(0, 100, (N,))
    torch.manual_seed(0)
    configs = {}
    mfn = _seq_net("mfpsn", T, channels)
    vanilla = copy.deepcopy(mfn)
    mf.set_method(vanilla, "conv1d")
    auto = copy.deepcopy(mfn)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        report = mf.autoselect(auto, x, cache=os.path.join(d, "c.json"), progress=False)
        select_s = time.perf_counter() - t0
    fused = copy.deepcopy(mfn)
    mf.fuse_batchnorm(fused)  # each batch norm applied by the neuron after it
    with tempfile.TemporaryDirectory() as d:
        mf.autoselect(fused, x, cache=os.path.join(d, "c.json"), progress=False)
    configs["MF-PSN autoselected"] = auto
    configs["MF-PSN autoselected, fused BN"] = fused
    configs["MF-PSN vanilla"] = vanilla
    for kind, label in (("psn", "PSN"), ("sliding_psn", "SlidingPSN (k=32)"), ("lif", "LIF")):
        net = _seq_net(kind, T, channels)
        if net is not None:
            configs[label] = net
    compile_s = {}
    if not args.no_compile:
        # The one-call path: autoselect(compile=True) times the chosen configuration compiled too.
        auto_c = copy.deepcopy(mfn)
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            rc = mf.autoselect(auto_c, x, cache=os.path.join(d, "c.json"), progress=False, compile=True)
            compile_s["autoselect(compile=True)"] = time.perf_counter() - t0
        configs[f"MF-PSN autoselect(compile=True) -> {'compiled' if rc.compiled else 'eager'}"] = auto_c
        if "PSN" in configs:
            configs["PSN, compiled"] = torch.compile(copy.deepcopy(configs["PSN"]))
    fns = {}
    for label, net in configs.items():
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        fns[label] = train_step(net, x, y, opt)
    if "PSN, compiled" in fns:
        t0 = time.perf_counter()
        fns["PSN, compiled"]()
        compile_s["PSN, compiled"] = time.perf_counter() - t0
    times = interleaved(fns, repeats=args.repeats, warmup=1)
    base = "PSN" if "PSN" in times else "LIF"
    rows = [[label, f"{median(ts) * 1e3:.0f} ms", ratio_cell(ts, times[base])] for label, ts in times.items()]
    text = [f"## 2. Training step, sequential-CIFAR network (T={T}, N={N}, {channels} channels, k=2, CIFAR-100 head)",
            "", f"Ratio = time / {base} eager time (<= 1.0 is as fast or faster). Autoselect chose layout "
            f"{report.layout!r} in {select_s:.1f} s; with compilation: "
            + ", ".join(f"{k} {v:.0f} s" for k, v in compile_s.items()), "",
            markdown_table(["configuration", "median step", f"ratio to {base}"], rows), ""]
    for r in rows:
        print(" | ".join(r), flush=True)
    out.append("\n".join(text))
    return {label: median(ts) / median(times[base]) for label, ts in times.items()}


# ------------------------------------------------------------------------------------------ part 3
def part_overhead(args, out):
    """Autoselect on the digits example's network and batch vs one epoch of that example."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    import train_sequential  # the example itself: its defaults, network and data
    ex = train_sequential.parse_args([])
    task = train_sequential.build_task(ex, None)
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(task.train_set, ex.batch_size, shuffle=True)
    net = task.net
    # The same network in later runs of a script: time-first, nothing chosen yet; with the same weights
    # (a seeded script: the stored plan was checked on this very state) and with other weights (e.g. a
    # checkpoint: the plan is checked on a few samples first), each copy different from the others.
    fresh = [copy.deepcopy(net) for _ in range(args.repeats)]
    fresh_other = [copy.deepcopy(net) for _ in range(args.repeats)]
    with torch.no_grad():
        for i, f in enumerate(fresh_other):
            next(f.parameters()).add_(1e-3 * (i + 1))
    x_example = task.to_input(next(iter(loader))[0])

    def seconds(fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as d:
        cache = os.path.join(d, "c.json")
        cold = seconds(lambda: mf.autoselect(net, x_example, cache=cache, progress=False))
        # Warm calls: medians over repeats (each fast enough for one noisy sample to mislead).
        warm = median([seconds(lambda: mf.autoselect(net, x_example, cache=cache, progress=False))
                       for _ in range(args.repeats)])
        warm_fresh = median([seconds(lambda f=f: mf.autoselect(f, x_example, cache=cache, progress=False))
                             for f in fresh])
        warm_other = median([seconds(lambda f=f: mf.autoselect(f, x_example, cache=cache, progress=False))
                             for f in fresh_other])
    opt = torch.optim.AdamW(net.parameters(), lr=ex.lr)
    t0 = time.perf_counter()
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(net(task.to_input(x)).mean(0), y).backward()
        opt.step()
        functional.reset_net(net)
    epoch = time.perf_counter() - t0
    rows = [["cold cache (times every layer)", f"{cold:.2f} s", f"{100 * cold / epoch:.1f}%"],
            ["warm cache (second call, same network)", f"{warm:.3f} s", f"{100 * warm / epoch:.1f}%"],
            ["warm cache (a new copy of the network, same weights)", f"{warm_fresh:.3f} s",
             f"{100 * warm_fresh / epoch:.1f}%"],
            ["warm cache (a new copy with other weights: checked on 2 samples)", f"{warm_other:.3f} s",
             f"{100 * warm_other / epoch:.1f}%"]]
    text = ["## 3. Autoselect overhead vs one epoch of the digits example", "",
            f"One training epoch of `examples/train_sequential.py` with its defaults ({len(loader)} steps of "
            f"{ex.batch_size}, {torch.get_num_threads()} torch thread(s)): {epoch:.2f} s. The cold call is the "
            f"first autoselect of a fresh process (the suite runs this part in one of its own); warm times are "
            f"medians of {args.repeats} calls.", "",
            markdown_table(["autoselect", "time", "percent of an epoch"], rows), ""]
    for r in rows:
        print(" | ".join(r), flush=True)
    out.append("\n".join(text))
    return {"cold": 100 * cold / epoch, "warm": 100 * warm / epoch, "warm_fresh": 100 * warm_fresh / epoch,
            "warm_other": 100 * warm_other / epoch}


# ------------------------------------------------------------------------------------------ part 4
def part_inference(args, out):
    if not models.psn_available("sliding_psn"):
        out.append("## 4. Single-step inference\n\nSkipped: SlidingPSN needs SpikingJelly 2.x.\n")
        return
    T, N = 32, args.batch
    channels = 64 if args.quick else 128
    x = torch.rand(T, N, 3, 32)
    configs = [("MF-PSN k=4", "mfpsn", 4, None), ("SlidingPSN k=32", "sliding_psn", 32, None)]
    if ops.backend_available("cpp"):  # single steps without gradients: one kernel call per neuron
        configs.insert(1, ("MF-PSN k=4, backend cpp", "mfpsn", 4, "cpp"))
    nets, state = {}, {}
    for label, kind, k, backend in configs:
        net = models.sequential_image_net(3, 32, 100, T=T, neuron=kind, k=k, channels=channels, hidden=256).eval()
        functional.set_step_mode(net, "s")
        if backend:
            mf.functional.set_backend(net, backend)
        with torch.no_grad():
            for t in range(T):  # materialise, and the state after T steps
                net(x[t])
        state[label] = sum(v.numel() * v.element_size() for m in net.modules()
                           if isinstance(m, sj_base.MemoryModule) for v in _tensors(m))
        nets[label] = net

    def sequence(net):
        def run():
            functional.reset_net(net)
            with torch.no_grad():
                for t in range(T):
                    net(x[t])
        return run
    times = interleaved({label: sequence(net) for label, net in nets.items()}, repeats=args.repeats, warmup=1)
    per_step = {label: median(v) / T for label, v in times.items()}
    rows = [[label, f"{state[label] / 2 ** 20:.1f} MiB", f"{per_step[label] * 1e3:.1f} ms"] for label in nets]
    base = "SlidingPSN k=32"
    text = [f"## 4. Single-step inference, sequential-CIFAR network (N={N}, {channels} channels), after {T} steps", "",
            f"Time per step: medians of {args.repeats} interleaved runs of the {T} steps, no gradients.", "",
            "State = the inputs the neurons keep (paper Table 3 reports process memory on a GPU).", "",
            markdown_table(["neuron", "state memory", "time per step"], rows), ""]
    text += [f"Time per step, {label} / SlidingPSN: {ratio_cell(times[label], times[base])}"
             for label in per_step if label != base] + [""]
    for r in rows:
        print(" | ".join(r), flush=True)
    out.append("\n".join(text))


def part_eval(args, out):
    """Multi-step eval forwards without gradients: what autoselect under no_grad chooses, side by side."""
    T, N = 32, args.batch
    channels = 64 if args.quick else 128
    x = torch.rand(T, N, 3, 32)
    torch.manual_seed(0)
    built = _seq_net("mfpsn", T, channels).eval()
    nets, select_s = {"MF-PSN as built": built}, {}
    with tempfile.TemporaryDirectory() as d:
        for label, grad in (("MF-PSN autoselected for training", True), ("MF-PSN autoselected under no_grad", False)):
            net = copy.deepcopy(built).train(grad)
            t0 = time.perf_counter()
            with torch.set_grad_enabled(grad):
                report = mf.autoselect(net, x, cache=os.path.join(d, "c.json"), progress=False)
            select_s[label] = (time.perf_counter() - t0, report.layout)
            nets[label] = net.eval()
    psn = _seq_net("psn", T, channels)
    if psn is not None:
        nets["PSN"] = psn.eval()

    def forward(net):
        def run():
            with torch.no_grad():
                net(x)
            functional.reset_net(net)
        return run
    times = interleaved({label: forward(net) for label, net in nets.items()}, repeats=args.repeats, warmup=1)
    base = "PSN" if "PSN" in times else "MF-PSN as built"
    rows = [[label, f"{median(ts) * 1e3:.1f} ms", ratio_cell(ts, times[base])] for label, ts in times.items()]
    text = [f"## 5. Eval forward without gradients, sequential-CIFAR network (T={T}, N={N}, {channels} channels)", "",
            markdown_table(["configuration", "median forward", f"ratio to {base}"], rows), "",
            "Autoselect: " + "; ".join(f"{label.removeprefix('MF-PSN autoselected ')} {sec:.1f} s (layout {layout!r})"
                                       for label, (sec, layout) in select_s.items()), ""]
    for r in rows:
        print(" | ".join(r), flush=True)
    print(text[-2], flush=True)
    out.append("\n".join(text))


def _tensors(m):
    for v in m._memories.values():
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (t for t in v if isinstance(t, torch.Tensor))


# ------------------------------------------------------------------------------------------ main
def chart(per_impl, network, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    if per_impl:
        conv = [(t, r) for s, t, k, d, r in per_impl if s.startswith("conv") and k == 2 and d == 1]
        for name in sorted({n for _, r in conv for n in r}):
            axes[0].plot([t for t, _ in conv], [r.get(name, float("nan")) for _, r in conv], marker="o", label=name)
        axes[0].set_xscale("log", base=2)
        axes[0].set_xlabel("T")
        axes[0].set_ylabel("speed-up over vanilla")
        axes[0].set_title("neuron layer fwd+bwd, conv shape, k=2, d=1")
        axes[0].legend(fontsize=7)
    if network:
        labels = list(network)
        axes[1].barh(labels, [network[k] for k in labels])
        axes[1].axvline(1.0, color="k", lw=0.8)
        axes[1].set_xlabel("training step time / PSN")
        axes[1].set_title("sequential-CIFAR network")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def overhead_in_fresh_process(args) -> str:
    """Part 3 run by this script in a new process; its markdown section."""
    cmd = [sys.executable, os.path.abspath(__file__), "--parts", "overhead", "--repeats", str(args.repeats)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    with tempfile.TemporaryDirectory() as d:
        subprocess.run(cmd + ["--out", d], check=True)
        with open(os.path.join(d, "speed.md")) as f:
            text = f.read()
    return text[text.index("## 3."):]


PARTS = ("neuron", "network", "overhead", "inference", "eval")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"a comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--quick", action="store_true", help="a smaller grid (minutes instead of tens of minutes)")
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument("--batch", type=positive_int, default=16)
    ap.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile configurations")
    ap.add_argument("--out", type=out_folder, default=RESULTS,
                    help="folder for speed.md and speed.png (default: benchmarks/results, which only a run of "
                         "every part without --quick may write)")
    args = ap.parse_args()
    parts = [p.strip() for p in args.parts.split(",")]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"--parts: unknown {', '.join(map(repr, unknown))}; choose from {','.join(PARTS)}")
    if os.path.abspath(args.out) == RESULTS and (set(parts) != set(PARTS) or args.quick):
        ap.error("--out: the committed results in benchmarks/results are written by a full run only (every "
                 "part, no --quick); give another folder")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    out = [f"# Speed suite\n\nMachine: {machine()}. Every ratio is a median over {args.repeats} interleaved "
           f"repeats in one process; ± is the larger relative spread (max-min)/median of the two.\n"]
    per_impl = part_neuron(args, out) if "neuron" in parts else None
    network = part_network(args, out) if "network" in parts else None
    if "overhead" in parts:
        if parts == ["overhead"]:
            part_overhead(args, out)
        else:  # as a script meets it: the first autoselect of a fresh process, not after the other parts
            out.append(overhead_in_fresh_process(args))
    if "inference" in parts:
        part_inference(args, out)
    if "eval" in parts:
        part_eval(args, out)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "speed.md"), "w") as f:
        f.write("\n".join(out))
    chart(per_impl, network, os.path.join(args.out, "speed.png"))
    print(f"wrote {os.path.join(args.out, 'speed.md')} and speed.png")


if __name__ == "__main__":
    main()
