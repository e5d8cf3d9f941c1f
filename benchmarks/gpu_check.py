"""One command for a CUDA machine: every method against the float64 reference, determinism, and the training
step timed against SpikingJelly's PSN, LIF and BatchNorm + PSN, side by side in this process.

    python benchmarks/gpu_check.py [--quick] [--out DIR]
    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --dry-run   # no CUDA: the same code on the CPU, tiny

(a) correctness: every method that runs here, both layouts, both thresholds, k in {1, 2, 3, 5}, dilation
    in {1, 2, 3}, float32/bfloat16/float16 inputs, multi-step training (spikes, dL/dX and every parameter
    gradient) and single-step inference, against tests/reference.py in float64;
(b) determinism: the fused training step twice here and once in a fresh process, compared bit for bit;
(c) timing and peak memory of a training step (forward + backward): one neuron layer (BN threshold, k=2)
    against BatchNorm + PSN, PSN and LIF; the paper's Table 10 network (static images repeated T times)
    and the sequential-CIFAR network against the same network with PSN and LIF, eager and compiled with
    mode="reduce-overhead"; with each MF-PSN step's kernel launches and host time;
(d) host: torch.profiler's CPU time per operator and cProfile's Python functions of one BN layer's step
    (alone and fused with its batch norm), next to BatchNorm + PSN's, to show where a host-bound step
    spends its time;
(e) writes DIR/gpu_check.json and DIR/gpu_check.md (DIR: --out, else $OUT, else benchmarks/results/gpu, or
a new temporary folder for --dry-run).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]
import _timing  # noqa: E402
from _timing import (Flat, interleaved, layer_step, markdown_table, median, ratio_cell, through_triton,  # noqa: E402
                     train_step)
import reference  # noqa: E402  (tests/reference.py: plain loops, no package code)

from spikingjelly.activation_based import layer, neuron, surrogate  # noqa: E402

import spikingjelly_mfpsn  # noqa: E402,F401
from spikingjelly_mfpsn import MulFreeChannelwisePSN, fuse_batchnorm, ops, set_method  # noqa: E402
from spikingjelly_mfpsn.paper import models  # noqa: E402

SECTIONS = ("correctness", "determinism", "neuron", "network", "host")
NETWORKS = ("table10", "sequential")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------------------------- (a)
def _neuron(method, layout, threshold, k, d, c, step_mode="m"):
    sn = MulFreeChannelwisePSN(c, k=k, dilation=d, step_mode=step_mode, layout=layout, threshold=threshold,
                               exp_init=False, method=method)
    with torch.no_grad():
        if threshold == "bn":
            sn.gamma.uniform_(0.5, 1.5)
            sn.beta.uniform_(-1.0, 0.5)
            sn.running_mean.uniform_(-1.0, 1.0)
            sn.running_var.uniform_(0.5, 2.0)
        else:
            sn.v_threshold.uniform_(-0.5, 1.0)
    return sn


def _reference(sn, x64, threshold, stats=None):
    """H (float64) and the float64 leaves (weight, gamma, beta or v_threshold) of ``sn``'s forward on ``x64``."""
    leaves = [p.detach().double().cpu().requires_grad_() for p in
              ((sn.weight, sn.gamma, sn.beta) if threshold == "bn" else (sn.weight, sn.v_threshold))]
    if threshold == "bn":
        h, _ = reference.mfpsn_charge(x64, leaves[0], sn.dilation, sn.layout, "bn", gamma=leaves[1], beta=leaves[2],
                                      eps=sn.eps, stats=stats)
    else:
        h, _ = reference.mfpsn_charge(x64, leaves[0], sn.dilation, sn.layout, "param", v_threshold=leaves[1])
    return h, leaves


def _compare(name, got, want, rtol, failures, case, scale=0.0):
    """Whether ``got`` is within ``rtol`` of the largest of ``|want|`` and ``scale``."""
    err = float((got.double().cpu() - want).abs().max()) if want.numel() else 0.0
    scale = max(float(want.abs().max()) if want.numel() else 0.0, scale)
    if not err <= rtol * max(scale, 1e-30) + 1e-12:
        failures.append(f"{case}: {name} off by {err:.3g} (max |reference| {scale:.3g})")


def check_training(method, layout, threshold, k, d, dtype, device, shape, failures):
    """One multi-step training step against the reference: spikes away from the threshold, dL/dX and the
    parameters' gradients."""
    case = f"{method} {layout} {threshold} k={k} d={d} {dtype} training"
    torch.manual_seed(k * 100 + d * 10 + len(method))
    sn = _neuron(method, layout, threshold, k, d, shape[ops.channel_dim(layout)]).to(device)
    x = (torch.randn(shape) * 2).to(device, DTYPES[dtype]).requires_grad_()
    x64 = x.detach().double().cpu().requires_grad_()
    h, leaves = _reference(sn, x64, threshold)
    s = sn(x)
    clear = h.detach().abs() > 1e-4 * float(h.detach().pow(2).mean().sqrt()) + 1e-6
    wrong = int((s.double().cpu() != (h.detach() >= 0).double())[clear].sum())
    if s.shape != x.shape or s.dtype != x.dtype or wrong:
        failures.append(f"{case}: {wrong} spikes differ, shape {tuple(s.shape)}, dtype {s.dtype}")
    g = torch.randn(shape, dtype=torch.float64)
    (s * g.to(device, s.dtype)).sum().backward()
    (sn.surrogate_function(h) * g).sum().backward()
    tol = 2e-3 if dtype == "float32" else 2e-2
    grads = [x.grad] + [p.grad for p in ((sn.weight, sn.gamma, sn.beta) if threshold == "bn" else
                                         (sn.weight, sn.v_threshold))]
    # At k = 1 the BN leaves the loss all but invariant to the weight's scale: its gradient is the small
    # difference of two terms of about dL/dgamma's size, which sets its rounding.
    floor = float(leaves[1].grad.abs().max()) if threshold == "bn" and k == 1 else 0.0
    for name, got, want in zip(("dL/dX", "weight", "gamma/v_th", "beta"), grads, [x64.grad] + [t.grad for t in leaves]):
        _compare(name, got, want, tol, failures, case, floor if name == "weight" else 0.0)


def check_single_step(method, layout, threshold, k, d, device, shape, failures):
    """Eval-mode single-step inference, step by step, against the multi-step reference."""
    case = f"{method} {threshold} k={k} d={d} single-step"
    torch.manual_seed(k * 100 + d)
    sn = _neuron(method, "time_first", threshold, k, d, shape[2], step_mode="s").to(device).eval()
    x = torch.randn(shape) * 2
    stats = (sn.running_mean.double().cpu(), sn.running_var.double().cpu()) if threshold == "bn" else None
    h, _ = _reference(sn, x.double(), threshold, stats)
    with torch.no_grad():
        s = torch.stack([sn(x[t].to(device)) for t in range(shape[0])]).cpu()
    clear = h.detach().abs() > 1e-5
    wrong = int((s.double() != (h.detach() >= 0).double())[clear].sum())
    if wrong:
        failures.append(f"{case}: {wrong} spikes differ")


def correctness(device, quick, dry_run):
    ks, ds = ((1, 3), (2,)) if dry_run else ((1, 3), (1, 2)) if quick else ((1, 2, 3, 5), (1, 2, 3))
    dtypes = ("float32", "bfloat16") if dry_run else tuple(DTYPES)
    n, c, m, t = (2, 3, 3, 7) if dry_run else (4, 8, 6, 12)
    failures, cases = [], 0
    for layout in ops.LAYOUTS:
        shape = (t, n, c, m) if layout == "time_first" else (n, c, m, t)
        probe = torch.zeros(shape, device=device)
        methods = ops.supported(probe, probe.new_zeros(c, 2), 1, layout)
        if dry_run:  # the report code, not every method: the fused kernels and one torch method
            methods = [m for m in methods if m in ("triton", "shift_add")]
        for method in methods:
            for threshold in ("bn", "param"):
                for k in ks:
                    for d in ds:
                        for dtype in dtypes:
                            check_training(method, layout, threshold, k, d, dtype, device, shape, failures)
                            cases += 1
                        if layout == "time_first":
                            check_single_step(method, layout, threshold, k, d, device, (t, n, c, m), failures)
                            cases += 1
    return {"cases": cases, "failures": failures}


# ---------------------------------------------------------------------------------------- (b)
def determinism_probe(device) -> str:
    """A hash of the spikes and every gradient of one fused training step (Triton where it runs)."""
    torch.manual_seed(3)
    method = "triton" if "triton" in ops.names() else "auto"
    shape = (8, 16, 32, 24)
    sn = _neuron(method, "time_first", "bn", 3, 2, shape[2]).to(device)
    x = torch.randn(shape, device=device).requires_grad_()
    s = sn(x)
    s.backward(torch.randn(shape, device=device))
    h = hashlib.sha256()
    for t in (s, x.grad, sn.weight.grad, sn.gamma.grad, sn.beta.grad, sn.running_mean, sn.running_var):
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def determinism(device):
    here = [determinism_probe(device), determinism_probe(device)]
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--probe", str(device)], capture_output=True,
                         text=True, timeout=600, env=os.environ.copy())
    other = out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else out.stderr[-500:]
    return {"this_process": here, "fresh_process": other, "identical": here[0] == here[1] == other}


# ---------------------------------------------------------------------------------------- (c)
def _psn(T):
    return neuron.PSN(T=T, surrogate_function=surrogate.ATan()) if models.psn_available("psn") else None


def _lif(device):
    lif = neuron.LIFNode(tau=2.0, detach_reset=True, step_mode="m",
                                 surrogate_function=surrogate.ATan())
    if device.type == "cuda" and "cupy" in getattr(lif, "supported_backends", ()):
        try:
            lif.backend = "cupy"
        except Exception:  # noqa: BLE001  (cupy present but unusable: keep torch)
            pass
    return lif


def neuron_candidates(T, c, device, dims=4):
    batch_norm = lambda: (layer.BatchNorm1d if dims == 4 else layer.BatchNorm2d)(c, step_mode="m")  # noqa: E731
    cands = {"MF-PSN (auto)": MulFreeChannelwisePSN(c, k=2, step_mode="m"),
             "BatchNorm + MF-PSN": nn.Sequential(batch_norm(), MulFreeChannelwisePSN(c, k=2, step_mode="m"))}
    cands["BatchNorm + MF-PSN, fused"] = nn.Sequential(batch_norm(), MulFreeChannelwisePSN(c, k=2, step_mode="m"))
    fuse_batchnorm(cands["BatchNorm + MF-PSN, fused"])
    psn = _psn(T)
    if psn is not None:
        cands["BatchNorm + PSN"] = nn.Sequential(batch_norm(), Flat(psn))
        cands["PSN"] = Flat(_psn(T))
    cands["LIF"] = _lif(device)
    return {k: v.to(device) for k, v in cands.items()}


def _peak(fn, device):
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def neuron_timing(device, quick, dry_run, repeats):
    shapes = [(4, 2, 8, 4)] if dry_run else [(8, 128, 128, 32), (32, 128, 128, 32)] if quick else \
        [(8, 128, 128, 32), (16, 128, 128, 32), (32, 128, 128, 32), (8, 128, 128, 16, 16)]
    rows = []
    for shape in shapes:
        x = torch.randn(shape, device=device)
        grad = torch.randn(shape, device=device)
        fns = {name: layer_step(m, x, grad) for name, m in neuron_candidates(shape[0], shape[2], device, len(shape)).items()}
        times = interleaved(fns, repeats=repeats, warmup=2, device=device)
        base = "BatchNorm + PSN" if "BatchNorm + PSN" in times else "LIF"
        for name, ts in times.items():
            rows.append({"shape": list(shape), "candidate": name, "ms": median(ts) * 1e3,
                         "ratio": ratio_cell(ts, times[base]), "baseline": base, "peak_mib": _peak(fns[name], device)})
        print(f"  neuron {shape}: " + ", ".join(f"{n} {median(ts) * 1e3:.2f} ms" for n, ts in times.items()), flush=True)
    return rows


def table10_net(neuron, T, c, hidden, classes, size):
    """{[Conv 3x3 c, BN, neuron] x 3, MaxPool 2} x 2, Flatten, Linear hidden, neuron, Linear classes."""
    sn = models.NeuronFactory(neuron, k=2)
    layers, c_in = [], 3
    for _ in range(2):
        for _ in range(3):
            layers += [layer.Conv2d(c_in, c, 3, padding=1, bias=False, step_mode="m"),
                       layer.BatchNorm2d(c, step_mode="m"), sn(c, T)]
            c_in = c
        layers.append(layer.MaxPool2d(2, 2, step_mode="m"))
    layers += [layer.Flatten(step_mode="m"), layer.Linear(c * (size // 4) ** 2, hidden, step_mode="m"),
               sn(hidden, T), layer.Linear(hidden, classes, step_mode="m")]
    return nn.Sequential(*layers)


def _host_and_launches(fn, device):
    """(host ms of one step, launches in it): the step's Python time without waiting for the GPU, and the
    PyTorch operators that run a kernel plus Triton launches (benchmarks/memory_passes.py's counter)."""
    import memory_passes
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    host = (time.perf_counter() - t0) * 1e3
    if device.type == "cuda":
        torch.cuda.synchronize()
    with memory_passes.Traffic() as mode, memory_passes.count_triton(mode):
        fn()
    return host, mode.launches


def network_timing(device, quick, dry_run, repeats, compile_ts, progress=lambda rows: None,
                   networks=NETWORKS, eager=True):
    """The ``networks``' training step, eager (unless not ``eager``); then compiled (mode="reduce-overhead")
    at the time steps in ``compile_ts`` (None: every one), last, since compiling takes long; ``progress(rows)``
    after each."""
    N, c, hidden, size = (2, 8, 16, 8) if dry_run else (128, 128, 256, 32)
    Ts = (2,) if dry_run else (2, 8, 32) if quick else (2, 4, 8, 16, 32)
    nets = [("Table 10", T, lambda kind, T=T: table10_net(kind, T, c, hidden, 100, size),
             (T, N, 3, size, size)) for T in Ts if "table10" in networks]
    nets += [("sequential CIFAR", size, lambda kind: models.sequential_image_net(
        3, size, 100, T=size, neuron=kind, channels=c, hidden=hidden), (size, N, 3, size))] * ("sequential" in networks)
    kinds = ["mfpsn", "mfpsn, fused BN"] + (["psn"] if models.psn_available("psn") else []) + ["lif"]
    # eager, also with every Triton launch through Triton's JITFunction.run (the package's binding off)
    jobs = [(net, kinds + ["mfpsn, fused BN, through Triton"], False) for net in nets if eager]
    # compiled, method 'auto' takes what inductor fuses; the Triton operators inside the graph, for comparison
    compiled_kinds = [k for k in kinds if k != "lif"] + ["mfpsn, fused BN, triton"]
    compiled = [(net, compiled_kinds, True) for net in nets if compile_ts is None or net[1] in compile_ts]
    jobs += sorted(compiled, key=lambda job: job[0][0] != "sequential CIFAR")  # the short one first
    rows = []
    for (label, T, build, shape), job_kinds, compiled in jobs:
        if compiled:  # each network compiled afresh, as in its own training script
            torch._dynamo.reset()
        torch.manual_seed(0)
        x, y = torch.rand(shape, device=device), torch.randint(0, 100, (N,), device=device)
        fns = {}
        for kind in job_kinds:
            torch.manual_seed(0)
            net = build(kind.split(",")[0]).to(device)
            if "fused BN" in kind:  # each batch norm applied by the neuron after it
                fuse_batchnorm(net)
            if kind.endswith("triton"):
                set_method(net, "triton")
            name = kind + (", compiled" if compiled else "")
            fns[name] = train_step(torch.compile(net, mode="reduce-overhead") if compiled else net, x, y)
            if kind.endswith("through Triton"):
                fns[name] = through_triton(fns[name])
        host = {} if compiled else {k: _host_and_launches(fns[k], device) for k in fns if k.startswith("mfpsn")}
        graphs, failed = _compiled_graphs_of(fns) if compiled else ({}, {})
        rows += [{"network": label, "T": T, "candidate": name, "error": error} for name, error in failed.items()]
        times = interleaved(fns, repeats=repeats, warmup=3, device=device) if fns else {}
        base = "psn, compiled" if compiled else "psn" if "psn" in times else "lif"
        base = base if base in times else next(iter(times), None)
        for name, ts in times.items():
            rows.append({"network": label, "T": T, "candidate": name, "ms": median(ts) * 1e3,
                         "ratio": ratio_cell(ts, times[base]), "baseline": base,
                         "peak_mib": None if compiled else _peak(fns[name], device),  # (graphs: pool at warm-up)
                         "host_ms": host.get(name, (None, None))[0], "launches": host.get(name, (None, None))[1],
                         "graphs": graphs.get(name)})
        print(f"  {label} T={T}: " + ", ".join(f"{n} {median(ts) * 1e3:.1f} ms" for n, ts in times.items()), flush=True)
        progress(rows)
    return rows


def _compiled_graphs_of(fns) -> tuple[dict, dict]:
    """``({name: _compiled_graphs(step)}, {name: error})`` of the compiled steps ``fns``; a step that fails
    to compile or run is reported and taken out of ``fns``, so that the others are still timed."""
    graphs, failed = {}, {}
    for name in list(fns):
        try:
            graphs[name] = _compiled_graphs(fns[name])
        except Exception as e:  # noqa: BLE001 (e.g. inductor's own compiler failing on this machine)
            failed[name] = f"{type(e).__name__}: {str(e)[-400:]}"
            print(f"  {name} failed: {failed[name]}", flush=True)
            del fns[name]
    return graphs, failed


def _compiled_graphs(step) -> str:
    """Its first two steps (compiling, then recording the CUDA graphs) as ``"graphs/breaks/cudagraph
    skips"``: one graph, no break and no skip is a whole step in CUDA graphs (inductor logs its skips
    only where ``TORCH_LOGS=cudagraphs`` is set)."""
    from torch._dynamo.utils import counters
    counters.clear()
    step(), step()
    return (f"{counters['stats']['unique_graphs']}/{sum(counters['graph_break'].values())}/"
            f"{counters['inductor']['cudagraph_skips']}")


def host_profile(device, dry_run, rows=15):
    """Where a BN neuron layer's training step spends host time: torch.profiler's CPU time per operator,
    largest self time first, and cProfile's Python functions (self time), for MF-PSN alone, the fused
    BatchNorm + MF-PSN pair and BatchNorm + PSN."""
    from torch.profiler import ProfilerActivity, profile
    shape = (4, 2, 8, 4) if dry_run else (8, 128, 128, 32)
    x, grad = torch.randn(shape, device=device), torch.randn(shape, device=device)
    out = {"shape": list(shape)}
    names = ("MF-PSN (auto)", "BatchNorm + MF-PSN, fused", "BatchNorm + PSN")
    for name, m in ((n, m) for n, m in neuron_candidates(shape[0], shape[2], device).items() if n in names):
        step = layer_step(m, x, grad)
        for _ in range(3):
            step()
        _timing.sync(device)
        with profile(activities=[ProfilerActivity.CPU], with_stack=False) as prof:
            for _ in range(10):
                step()
            _timing.sync(device)
        events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        out[name] = {"total_us_per_step": sum(e.self_cpu_time_total for e in events) / 10,
                     "top": [{"op": e.key, "self_us_per_step": e.self_cpu_time_total / 10, "calls_per_step": e.count / 10}
                             for e in events[:rows]],
                     "python": _python_profile(step, device, 20, rows * 2)}
    return out


def _python_profile(step, device, n, rows):
    """cProfile of ``n`` steps: the functions with the most self time, per step (us), with calls per step."""
    import cProfile
    import pstats
    _timing.sync(device)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.runcall(lambda: [step() for _ in range(n)])
    wall = (time.perf_counter() - t0) / n * 1e6
    _timing.sync(device)
    stats = pstats.Stats(prof).stats
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:rows]
    return {"wall_us_per_step_profiled": wall,
            "top": [{"fn": f"{os.path.basename(f)}:{line}:{fn}", "calls_per_step": nc / n,
                     "self_us_per_step": tt / n * 1e6, "cum_us_per_step": ct / n * 1e6}
                    for (f, line, fn), (_, nc, tt, ct, _) in top]}


# ---------------------------------------------------------------------------------------- (d)
def versions(device):
    v = {"torch": torch.__version__, "python": platform.python_version(), "spikingjelly": importlib.metadata.version("spikingjelly"),
         "device": str(device)}
    try:
        import triton
        v["triton"] = triton.__version__
    except ImportError:
        v["triton"] = None
    if device.type == "cuda":
        v["card"] = torch.cuda.get_device_name(device)
        v["cuda"] = torch.version.cuda
        try:
            v["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                         capture_output=True, text=True, timeout=30).stdout.strip()
        except OSError:
            v["driver"] = None
    return v


def markdown(result) -> str:
    v = result["versions"]
    lines = [f"# GPU check: {v.get('card', v['device'])}", "", ", ".join(f"{k} {val}" for k, val in v.items()), ""]
    if "correctness" in result:
        failures = result["correctness"]["failures"]
        lines += [f"## (a) correctness: {result['correctness']['cases']} cases, {len(failures)} failures", ""]
        lines += [f"- {f}" for f in failures[:50]] + [""]
    if "determinism" in result:
        lines += [f"## (b) determinism: {'bit-identical' if result['determinism']['identical'] else 'DIFFERENT'}", ""]
    if "neuron" in result:
        lines += ["## (c) one neuron layer, training step (ratio to the baseline; <= 1.0 is as fast or faster)", ""]
        lines.append(markdown_table(["shape", "candidate", "median", "ratio", "baseline", "peak MiB"],
                                    [[tuple(r["shape"]), r["candidate"], f"{r['ms']:.3f} ms", r["ratio"], r["baseline"],
                                      _cell(r["peak_mib"], "{:.0f}")] for r in result["neuron"]]))
    if "host" in result:
        lines += ["", f"## host time of one layer's step, {tuple(result['host']['shape'])} (torch.profiler, CPU)", ""]
        for name, r in result["host"].items():
            if name != "shape":
                lines += [f"- {name}: {r['total_us_per_step']:.0f} us a step; most: " + ", ".join(
                    f"{t['op']} {t['self_us_per_step']:.0f}" for t in r["top"][:8])]
                lines += ["  Python (cProfile, self us a step): " + ", ".join(
                    f"{t['fn']} {t['self_us_per_step']:.0f}" for t in r["python"]["top"][:12])]
    if "network" in result:
        lines += ["", "## (c) networks, training step", ""]
        lines.append(markdown_table(
            ["network", "T", "candidate", "median", "ratio", "baseline", "peak MiB", "host ms", "launches",
             "graphs/breaks/skips"],
            [[r["network"], r["T"], r["candidate"], f"{r['ms']:.2f} ms", r["ratio"], r["baseline"],
              _cell(r["peak_mib"], "{:.0f}"), _cell(r["host_ms"], "{:.1f}"), _cell(r["launches"], "{}"),
              _cell(r.get("graphs"), "{}")] if "error" not in r else
             [r["network"], r["T"], r["candidate"], "failed: " + r["error"].strip().splitlines()[-1][:120]] + ["-"] * 6
             for r in result["network"]]))
    return "\n".join(lines) + "\n"


def _cell(value, fmt):
    return "-" if value is None else fmt.format(value)


def save(result, out) -> str:
    """Write ``out``/gpu_check.json and gpu_check.md; returns the markdown."""
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = markdown(result)
    with open(os.path.join(out, "gpu_check.md"), "w") as f:
        f.write(text)
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a correctness subset and fewer shapes (about a minute)")
    parser.add_argument("--dry-run", action="store_true", help="no CUDA needed: the same code on the CPU, tiny shapes")
    parser.add_argument("--out", type=_timing.out_folder, default=None, help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--repeats", type=_timing.positive_int, default=None,
                        help="timed rounds (default 10; 1 with --dry-run)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd networks")
    parser.add_argument("--compile-t", type=_timing.positive_int, nargs="+", default=None,
                        help="time steps at which the networks are also compiled (default: all; 8 with --quick)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=SECTIONS,
                        help="which parts to run (default: all)")
    parser.add_argument("--networks", nargs="+", choices=NETWORKS, default=NETWORKS,
                        help="which networks the network section times (default: both)")
    parser.add_argument("--no-eager", action="store_true", help="time the networks compiled only")
    parser.add_argument("--probe", default=None, help=argparse.SUPPRESS)  # (b)'s fresh process
    args = parser.parse_args(argv)
    if args.probe:
        print(determinism_probe(torch.device(args.probe)))
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device here: run with --dry-run (TRITON_INTERPRET=1 to include Triton)")
    device = torch.device("cpu" if args.dry_run else "cuda")
    repeats = args.repeats or (1 if args.dry_run else 10)
    out = args.out or os.environ.get("OUT") or \
        (tempfile.mkdtemp(prefix="gpu_check-dry-run-") if args.dry_run else os.path.join(HERE, "results", "gpu"))
    os.makedirs(out, exist_ok=True)  # (a dry run's tiny CPU figures never go into the GPU results by default)
    t0 = time.perf_counter()
    result = {"versions": versions(device), "quick": args.quick, "dry_run": args.dry_run}
    compile_ts = () if args.no_compile or args.dry_run else args.compile_t or ((8,) if args.quick else None)
    sections = (("correctness", lambda: correctness(device, args.quick, args.dry_run)),
                ("determinism", lambda: determinism(device)),
                ("neuron", lambda: neuron_timing(device, args.quick, args.dry_run, repeats)),
                ("host", lambda: host_profile(device, args.dry_run)),
                ("network", lambda: network_timing(device, args.quick, args.dry_run, repeats, compile_ts,
                                                   lambda rows: save({**result, "network": rows}, out),
                                                   args.networks, not args.no_eager)))
    for name, run in (s for s in sections if s[0] in args.sections):  # saved after each, so a run stopped part-way still leaves its figures
        result[name] = run()
        if name == "correctness":
            print(f"(a) {result[name]['cases']} cases, {len(result[name]['failures'])} failures",
                  *result[name]["failures"][:20], sep="\n", flush=True)
        result["seconds"] = time.perf_counter() - t0
        text = save(result, out)
        print(f"[{result['seconds']:.0f} s] {name} done", flush=True)
    print(text)
    print(f"written to {out}")
    return 1 if result.get("correctness", {}).get("failures") or not result.get("determinism", {}).get("identical", 1) \
        else 0


if __name__ == "__main__":
    sys.exit(main())
