"""The Triton method through the code that launches it on a GPU, without a GPU.

The suite's other Triton tests run the kernels under Triton's interpreter, which has no compiled
kernels and so never takes the launch path a GPU does (each specialisation compiled once, later launches
bound to it). Here a stand-in CUDA driver (benchmarks/_fake_cuda.py) makes Triton specialise and compile
every launch for sm_90 for real; each launch is then checked to use the compiled kernel that Triton's own
specialisation of its arguments selects, and runs through the interpreter from the arguments the
launcher got, so the results are compared with the plain reference. It runs in a subprocess: Triton's
interpreter, which the rest of the suite uses, is chosen when triton is first imported.
"""
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("triton", reason="the Triton method needs triton")

PRELUDE = """
    import hashlib, sys
    sys.path[:0] = [{bench!r}, {tests!r}]
    import _fake_cuda
    _fake_cuda.install(execute=True, verify=True)
    import torch, torch.nn as nn
    import spikingjelly_mfpsn
    from spikingjelly.activation_based import layer, neuron, surrogate
    from spikingjelly_mfpsn import fuse_batchnorm
    import reference

    digest = hashlib.sha256()
    launches = lambda: (_fake_cuda.LAUNCHES["n"], _fake_cuda.THROUGH_TRITON["n"])

    def reference_step(sn, x, thr):
        xs, w = x.detach().double().requires_grad_(), sn.weight.detach().double().requires_grad_()
        if thr == "bn":
            g, b = sn.gamma.detach().double().requires_grad_(), sn.beta.detach().double().requires_grad_()
            h, _ = reference.mfpsn_charge(xs, w, sn.dilation, sn.layout, "bn", gamma=g, beta=b, eps=sn.eps)
            leaves = (xs, w, g, b)
        else:
            v = sn.v_threshold.detach().double().requires_grad_()
            h, _ = reference.mfpsn_charge(xs, w, sn.dilation, sn.layout, "param", v_threshold=v)
            leaves = (xs, w, v)
        return h, surrogate.ATan()(h), leaves

    def step(net, x, g):
        xt = x.detach().requires_grad_()  # (a view of the same storage, alignment kept)
        s = net(xt)
        (s * g).sum().backward()
        grads = [xt.grad] + [p.grad for p in net.parameters()]
        for t in [s, *grads]:
            digest.update(t.detach().contiguous().numpy().tobytes())
        net.zero_grad(set_to_none=True)
        return s, grads

    def against_reference(sn, x, thr):
        h, s_ref, leaves = reference_step(sn, x, thr)
        g = torch.randn(x.shape)
        s, grads = step(sn, x, g)
        clear = h.detach().abs() > 1e-4
        assert torch.equal(s.double()[clear], s_ref.detach()[clear])
        (s_ref * g.double()).sum().backward()
        for got, want in zip(grads, [t.grad for t in leaves]):
            torch.testing.assert_close(got.double(), want, rtol=2e-4, atol=2e-4)

    def misaligned(shape):  # a view 4 bytes into its storage: another specialisation of the pointer
        n = torch.Size(shape).numel()
        return torch.randn(n + 1)[1:].view(shape)
"""

# Binding: a repeated step, a misaligned input, other sizes, and a fused batch norm against the pair apart.
BINDING = """
    torch.manual_seed(0)
    for layout, thr in (("time_first", "bn"), ("time_last", "param")):
        sn = neuron.MulFreeChannelwisePSN(6, k=2, dilation=2, step_mode="m", layout=layout, threshold=thr,
                                          exp_init=False, method="triton")
        shape = (9, 3, 6, 5) if layout == "time_first" else (3, 6, 5, 9)
        against_reference(sn, torch.randn(shape), thr)  # compiles, through Triton
        n0, t0 = launches()
        against_reference(sn, torch.randn(shape), thr)
        n1, t1 = launches()
        print("repeat", layout, thr, n1 - n0, t1 - t0)
        against_reference(sn, misaligned(shape), thr)
        n2, t2 = launches()
        print("misaligned", layout, thr, n2 - n1, t2 - t1)
        # sizes and strides that are multiples of 16 (Triton specialises integers on that) or 1
        against_reference(sn, torch.randn((8, 1, 6, 16) if layout == "time_first" else (1, 6, 16, 32)), thr)
        n3, t3 = launches()
        print("resized", layout, thr, n3 - n2, t3 - t2)

    # a launch hook (a profiler's) sees every launch, bound or not, with its kernel's name
    import triton
    seen = []
    hook = lambda metadata: seen.append(metadata.get()["name"])
    triton.knobs.runtime.launch_enter_hook.add(hook)
    n0 = launches()[0]
    against_reference(sn, torch.randn(shape), thr)
    triton.knobs.runtime.launch_enter_hook.remove(hook)
    print("hooked", len(seen), launches()[0] - n0, len(set(seen)))

    # a batch norm fused into the neuron (two more kernels forward), against the same pair unfused
    pair = nn.Sequential(layer.BatchNorm1d(6, step_mode="m"),
                         neuron.MulFreeChannelwisePSN(6, k=3, step_mode="m", method="triton"))
    apart = __import__("copy").deepcopy(pair)
    fuse_batchnorm(pair)
    for _ in range(2):
        x, g = torch.randn(7, 4, 6, 3), torch.randn(7, 4, 6, 3)
        (s, grads), (s2, grads2) = step(pair, x, g), step(apart, x, g)
        torch.testing.assert_close(s, s2, rtol=0, atol=0)
        for a, b in zip(grads, grads2):
            torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4)
    print("digest", digest.hexdigest())
    print("launches", *launches())
"""


# The GPU's tiles (the interpreter runs on tiles of its own): channel, row and time blocks past one
# tile, 3-dim inputs whose channels are contiguous, a strided input, other orders and dilations.
GPU_TILES = """
    torch.manual_seed(1)
    cases = [("time_first", "bn", 1, 1, (6, 4, 130)),       # channels contiguous: two blocks of 128
             ("time_first", "bn", 3, 2, (7, 20, 3, 15)),    # 300 rows: two blocks of 256
             ("time_last", "bn", 2, 1, (3, 4, 5, 70)),      # T = 70: two blocks of 64, 20 rows
             ("time_first", "param", 5, 3, (19, 2, 6, 4)),
             ("time_last", "param", 2, 2, (2, 130, 33))]
    for layout, thr, k, d, shape in cases:
        sn = neuron.MulFreeChannelwisePSN(shape[2] if layout == "time_first" else shape[1], k=k, dilation=d,
                                          step_mode="m", layout=layout, threshold=thr, exp_init=False,
                                          method="triton")
        with torch.no_grad():
            sn.weight.uniform_(-1.5, 1.5)
        for strided in (False, True):
            x = torch.randn(shape) * 2
            if strided:  # the same values stored in the other order of the first two axes
                x = x.transpose(0, 1).contiguous().transpose(0, 1)
            against_reference(sn, x, thr)
        print("case", layout, thr, k, d, "ok")
    # a batch norm fused into the neuron, past one tile, against the pair apart
    for shape in ((6, 4, 130, 1), (7, 20, 3, 15)):  # (M = 1: channels contiguous, as a 3-dim input)
        pair = nn.Sequential(layer.BatchNorm1d(shape[2], step_mode="m"),
                             neuron.MulFreeChannelwisePSN(shape[2], k=2, step_mode="m", method="triton"))
        apart = __import__("copy").deepcopy(pair)
        fuse_batchnorm(pair)
        x, g = torch.randn(shape) * 3 + 1, torch.randn(shape)
        (s, grads), (s2, grads2) = step(pair, x, g), step(apart, x, g)
        assert torch.equal(s, s2)
        for a, b in zip(grads, grads2):
            torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4)
    print("tiles ok")
"""


def compiled_env(**more) -> dict:
    """The environment of a subprocess that compiles Triton kernels for a GPU (none needed)."""
    from triton.backends import backends
    if "nvidia" not in backends:
        pytest.skip("this triton build has no CUDA backend to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), TRITON_DEFAULT_FP_FUSION="1",
               **more)
    return env


def script(part: str) -> str:
    return textwrap.dedent(PRELUDE.format(bench=os.path.join(ROOT, "benchmarks"), tests=os.path.join(ROOT, "tests"))
                           + part)


def run(bind: bool) -> dict:
    env = compiled_env(SPIKINGJELLY_MFPSN_TRITON_BIND="1" if bind else "0")
    code = script(BINDING)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    lines = {}
    for line in out.stdout.splitlines():
        words = line.split()
        cased = words[0] in ("repeat", "misaligned", "resized")
        lines[" ".join(words[:3]) if cased else words[0]] = words[3:] if cased else words[1:]
    return lines


@pytest.fixture(scope="module")
def runs():
    return run(bind=True), run(bind=False)


def test_launches_after_the_first_skip_tritons_binding(runs):
    """A repeated step launches the compiled kernels directly: none of its launches goes through
    Triton's JITFunction.run; a misaligned input or other sizes (other specialisations) go through it
    again."""
    bound, _ = runs
    for case in ("time_first bn", "time_last param"):
        n, through = map(int, bound["repeat " + case])
        assert n >= 4 and through == 0, (case, n, through)
        for other in ("misaligned ", "resized "):
            n, through = map(int, bound[other + case])
            assert through > 0, (other + case, n, through)


def test_launch_hooks_see_bound_launches(runs):
    """A hook in Triton's launch_enter_hook chain (as profilers register) gets the metadata of every
    launch, the bound ones included."""
    for result in runs:
        seen, launched, kernels = map(int, result["hooked"])
        assert seen == launched >= 4 and kernels >= 3, result["hooked"]


def test_bound_launches_give_the_same_bits_as_tritons_own(runs):
    """Every step's spikes and gradients, against the reference in both runs, and bit for bit the same
    with binding off (SPIKINGJELLY_MFPSN_TRITON_BIND=0), where every launch goes through Triton."""
    bound, unbound = runs
    assert bound["digest"] == unbound["digest"]
    n, through = map(int, unbound["launches"])
    assert n == through > 0
    n, through = map(int, bound["launches"])
    assert through < n


def test_host_cost_times_tritons_launch_path_without_a_gpu():
    """``benchmarks/host_cost.py --launch compiled`` times each Triton layer bound and through Triton."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "host_cost.py"), "--launch=compiled",
                          "--repeats", "3"], capture_output=True, text=True, timeout=900, env=compiled_env())
    assert out.returncode == 0, out.stderr[-4000:]
    for layer in ("MF-PSN triton, bn", "MF-PSN triton, param", "BatchNorm + MF-PSN triton, fused"):
        for how in ("(compiled, bound)", "(compiled, through Triton)"):
            assert f"| {layer} {how} | " in out.stdout, out.stdout


def test_the_kernels_on_the_gpus_tiles_match_the_reference():
    """The kernels as compiled for a GPU run on its tiles (the interpreter's tiles are others): several
    channel, row and time blocks, contiguous channels, strided inputs, orders 1-5 and dilations 1-3,
    both thresholds and layouts; spikes and every gradient against the reference, each launch checked
    to use the compiled kernel Triton's specialisation selects."""
    out = subprocess.run([sys.executable, "-c", script(GPU_TILES)], capture_output=True, text=True, timeout=900,
                         env=compiled_env())
    assert out.returncode == 0 and "tiles ok" in out.stdout, out.stderr[-4000:]
