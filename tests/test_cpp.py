"""The C++ CPU backend ('cpp') against the plain loop reference: fused spike, fused batch statistics,
the neuron with backend='cpp', the build cache, and what happens without a compiler.

The plain charge of 'cpp' is also held to the reference on the full grid of tests/test_ops.py.
"""
import copy
import dataclasses
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import spikingjelly_mfpsn  # noqa: F401  (registers the neuron)
from spikingjelly.activation_based import neuron, surrogate
from spikingjelly_mfpsn import ops
from spikingjelly_mfpsn.ops import cpp_ops

import reference
from test_ops import make_input
import sj

if cpp_ops.compiler() is None:
    pytest.skip("no C++ compiler (g++/clang++ or $CXX): backend 'cpp' is not registered here "
                "(test_without_compiler covers that case in a subprocess)", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = ops.LAYOUTS
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5)}


@pytest.fixture(params=[1, 2], ids=lambda n: f"threads{n}", autouse=True)
def threads(request):
    """Every test on one and on two threads (per-thread partial sums, tiles split between threads)."""
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


class DispatchedOps(TorchDispatchMode):
    """The names of the operators dispatched while it is on (``'spikingjelly_mfpsn::cpp_bn_forward'``...)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def fused_run(fn, *args):
    """``fn(*args)`` and whether it ran the fused BN-threshold step (its operator
    ``torch.ops.spikingjelly_mfpsn.cpp_bn_forward``), not the general path."""
    with DispatchedOps() as seen:
        out = fn(*args)
    return out, "spikingjelly_mfpsn::cpp_bn_forward" in seen.names


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def check_grads(out, out_ref, inputs, inputs_ref, tol):
    g = torch.randn(out_ref.shape, dtype=out_ref.dtype)
    got = torch.autograd.grad(out, inputs, g.to(out.dtype))
    want = torch.autograd.grad(out_ref, inputs_ref, g)
    for a, b, i in zip(got, want, range(len(got))):
        assert a.dtype == inputs[i].dtype and a.shape == inputs[i].shape
        torch.testing.assert_close(a.double(), b.double(), **tol, msg=lambda m: f"grad of input {i}: {m}")


# Shapes with several tiles per block (C * F above the tile width), N > 1, and feature dims.
SHAPES = [(9, 3, 5, ()), (7, 2, 4, (3,)), (6, 2, 3, (2, 3)), (5, 3, 40, (30,)), (70, 2, 300, ())]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("t,n,c,feat", SHAPES)
# Orders of every kernel width: 1, 2 (unrolled), 3 and 5 (padded to 4 and 8), 11 (the generic
# kernel), with lags that reach past the first step of the short sequences (those taps are dropped).
@pytest.mark.parametrize("k,dilation", [(1, 1), (2, 1), (3, 2), (5, 3), (11, 1)])
def test_batch_stats_match_reference(layout, t, n, c, feat, k, dilation):
    """Fused statistics == mean/biased var of the reference charge (values and grads of x and W)."""
    torch.manual_seed(t + k)
    x = make_input(t, n, c, feat, layout, torch.float64, True) + 3.0  # a mean far from 0
    w = torch.randn(c, k, dtype=torch.float64)
    (xa, wa), (xr, wr) = leaves(x, w), leaves(x, w)
    mean, var = ops.get("cpp").stats(xa, wa, dilation, layout)
    h_ref = reference.charge(xr, wr, None, dilation, layout)
    mean_ref, var_ref = reference.batch_stats(h_ref, ops.channel_dim(layout))
    torch.testing.assert_close(mean, mean_ref, **TOL[torch.float64])
    torch.testing.assert_close(var, var_ref, rtol=1e-9, atol=1e-9)
    check_grads(torch.stack([mean, var]), torch.stack([mean_ref, var_ref]), [xa, wa], [xr, wr],
                dict(rtol=1e-8, atol=1e-9))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_batch_stats_float32_match_two_pass(layout):
    x = make_input(12, 4, 6, (5,), layout, torch.float32, False) * 4 + 10
    w = torch.randn(6, 3)
    (xa, wa), (xr, wr) = leaves(x, w), leaves(x, w)
    got = ops.get("cpp").stats(xa, wa, 2, layout)
    want = reference.batch_stats(reference.charge(xr, wr, None, 2, layout), ops.channel_dim(layout))
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)
    check_grads(torch.stack(got), torch.stack(want), [xa, wa], [xr, wr], dict(rtol=1e-4, atol=1e-4))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sg", [surrogate.ATan(), surrogate.ATan(alpha=3.5), surrogate.Sigmoid(),
                                surrogate.Sigmoid(alpha=1.5)], ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("t,n,c,feat", SHAPES[1:4:2])
def test_fused_fire_matches_surrogate(layout, sg, dtype, t, n, c, feat):
    torch.manual_seed(5)
    x = make_input(t, n, c, feat, layout, dtype, False)
    w, b = torch.randn(c, 3, dtype=dtype), torch.randn(c, dtype=dtype) * 0.5
    args, args_ref = leaves(x, w, b), leaves(*(a.double() for a in (x, w, b)))
    s = ops.get("cpp").fire(*args, 2, layout, *ops.surrogate.fused(sg))  # the fused entry itself
    assert s.dtype == dtype
    h_ref = reference.charge(*args_ref, 2, layout)
    s_ref = sg(h_ref)
    clear = h_ref.detach().abs() > 1e-4  # rounding may flip a spike where |H| ~ 0
    torch.testing.assert_close(s.double()[clear], s_ref.detach()[clear])
    check_grads(s, s_ref, args, args_ref, TOL[dtype])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradients_of_charges_beyond_the_surrogates_range(layout):
    """Regression: where 1 + (pi/2 * alpha * H)^2 overflows float32 (|H| above about 1e19), AVX-512's
    reciprocal estimate of it is 0 and its Newton step gave inf * 0: dL/dX, dL/dW and dL/db were NaN where
    the reference's derivative is about 1e-41. Whole vectors of lanes, with such charges in some."""
    torch.manual_seed(0)
    x = make_input(3, 2, LANES, (), layout, torch.float32, False)
    big = torch.rand(x.shape) < 0.2
    x = torch.where(big, torch.where(torch.rand(x.shape) < 0.5, 1e20, -3e25), x)
    w, b = torch.ones(LANES, 1), torch.zeros(LANES)
    args, args_ref = leaves(x, w, b), leaves(*(a.double() for a in (x, w, b)))
    s = ops.get("cpp").fire(*args, 1, layout, *ops.surrogate.fused(surrogate.ATan()))
    check_grads(s, surrogate.ATan()(reference.charge(*args_ref, 1, layout)), args, args_ref, TOL[torch.float32])


# Lanes per step for the kernel-width tests: whole cache lines of vectors side by side (16 floats or 8
# doubles), a whole vector after them, and single lanes, at every vector width (16, 32 or 64 bytes).
LANES = 29


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("k,dilation,t", [(2, 1, 9), (4, 1, 9), (8, 1, 9), (8, 2, 5), (12, 1, 20), (12, 1, 7),
                                          (3, 4, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_charge_and_fire_every_kernel_width(layout, k, dilation, t, dtype):
    """Plain charge and fused ATan fire on each order the kernels specialise (2, 4, 8), the generic
    kernel (12), and orders whose oldest taps never reach the sequence (their dW must be 0)."""
    torch.manual_seed(k * 10 + t)
    x = make_input(t, 3, LANES, (), layout, dtype, False)
    w, b = torch.randn(LANES, k, dtype=dtype), torch.randn(LANES, dtype=dtype) * 0.5
    args, args_ref = leaves(x, w, b), leaves(*(a.double() for a in (x, w, b)))
    h = ops.charge(*args, dilation, layout, "cpp")
    h_ref = reference.charge(*args_ref, dilation, layout)
    torch.testing.assert_close(h.double(), h_ref, **TOL[dtype])
    check_grads(h, h_ref, args, args_ref, TOL[dtype])
    args, args_ref = leaves(x, w, b), leaves(*(a.double() for a in (x, w, b)))
    s = ops.get("cpp").fire(*args, dilation, layout, *ops.surrogate.fused(surrogate.ATan()))
    s_ref = surrogate.ATan()(reference.charge(*args_ref, dilation, layout))
    check_grads(s, s_ref, args, args_ref, TOL[dtype])
    unreached = [i for i in range(k) if (k - 1 - i) * dilation >= t]
    if unreached:
        w_leaf = w.detach().clone().requires_grad_()
        ops.charge(x, w_leaf, b, dilation, layout, "cpp").pow(2).sum().backward()
        assert torch.equal(w_leaf.grad[:, unreached], torch.zeros_like(w_leaf.grad[:, unreached]))


def _vec_bytes():
    cpp_ops.load()
    return torch.ops.spikingjelly_mfpsn.cpp_vec_bytes()


def test_the_default_vector_width_is_one_register_of_the_target():
    """The kernels' vectors are as wide as one register of the target they are compiled for (-march=native,
    as the compiler itself reports it): wider ones spill the tap loops' registers (several times slower),
    narrower ones leave lanes idle."""
    run = subprocess.run([cpp_ops.compiler(), "-march=native", "-dM", "-E", "-x", "c++", "-"], input="",
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    macros = {line.split()[1] for line in run.stdout.splitlines() if line.startswith("#define ")}
    want = 64 if "__AVX512F__" in macros else 32 if "__AVX__" in macros else 16
    assert _vec_bytes() == want


def check_kernels_at_this_width(layout):
    """The reference's charge, spikes and gradients, lines of vectors side by side, whole vectors and single
    lanes (LANES), every kernel order (2, 3 padded to 4, 8, 11 generic); the fused BN training step equals
    the general path built from the same kernels."""
    tol = TOL[torch.float32]
    for k, dilation in [(2, 1), (3, 2), (8, 1), (11, 1)]:
        torch.manual_seed(k)
        x = make_input(9, 3, LANES, (), layout, torch.float32, False)
        w, b = torch.randn(LANES, k), torch.randn(LANES) * 0.5
        args, args_ref = leaves(x, w, b), leaves(*(a.double() for a in (x, w, b)))
        h = ops.charge(*args, dilation, layout, "cpp")
        h_ref = reference.charge(*args_ref, dilation, layout)
        torch.testing.assert_close(h.double(), h_ref, **tol)
        check_grads(h, h_ref, args, args_ref, tol)
        args, args_ref = leaves(x, w, b), leaves(*(a.double() for a in (x, w, b)))
        s = ops.get("cpp").fire(*args, dilation, layout, *ops.surrogate.fused(surrogate.ATan()))
        check_grads(s, surrogate.ATan()(reference.charge(*args_ref, dilation, layout)), args, args_ref, tol)
    for k in (1, 2, 5):  # the BN step's sweeps: lines of vectors at orders 1 and 2, single vectors at 5 (as 8)
        ref, fast, shape, tol = _fused_and_general(layout, True, "whole", surrogate.ATan(), torch.float32, k=k)
        for _ in range(2):
            _same_step(ref, fast, torch.randn(shape) * 2, tol)


@pytest.mark.parametrize("nbytes", [16, 32, 64])
def test_every_vector_width_matches_the_reference(nbytes, threads, tmp_path_factory):
    """Kernels built for another CPU's vector width (AVX-512's 64 bytes, AVX's 32, SSE's and NEON's 16,
    through $SPIKINGJELLY_MFPSN_CXXFLAGS) give the reference's results on this one: in this process at
    the default width, in a fresh process with its own build at the others."""
    if nbytes == _vec_bytes():
        for layout in LAYOUTS:
            check_kernels_at_this_width(layout)
        return
    out = run_python(f"""
        import torch, test_cpp
        assert test_cpp._vec_bytes() == {nbytes}
        torch.set_num_threads({threads})
        for layout in test_cpp.LAYOUTS:
            test_cpp.check_kernels_at_this_width(layout)
        print("ok")
    """, SPIKINGJELLY_MFPSN_CXXFLAGS=f"-DMFPSN_VEC_BYTES={nbytes}",  # (built once, for both thread counts)
                     SPIKINGJELLY_MFPSN_BUILD=str(tmp_path_factory.getbasetemp() / "builds"))
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def test_fire_falls_back_for_other_surrogates():
    x = torch.randn(6, 2, 3, dtype=torch.float64)
    w, b = torch.randn(3, 2, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    for sg in (surrogate.PiecewiseQuadratic(), surrogate.ATan(spiking=False)):
        args, args_ref = leaves(x, w, b), leaves(x, w, b)
        s = ops.mf_psn(args[0], args[1], bias=args[2], method="cpp", surrogate_function=sg, quantize=None)
        s_ref = sg(reference.charge(*args_ref, 1, "time_first"))
        torch.testing.assert_close(s, s_ref)
        check_grads(s, s_ref, args, args_ref, TOL[torch.float64])


def test_fire_without_grad_and_empty_batch():
    x = torch.randn(6, 2, 3)
    w, b = torch.randn(3, 2), torch.randn(3)
    with torch.no_grad():
        s = ops.mf_psn(x, w, bias=b, method="cpp", quantize=None)
    assert torch.equal(s, (reference.charge(x, w, b, 1, "time_first") >= 0).float())
    empty = torch.randn(6, 0, 3, requires_grad=True)
    h = ops.charge(empty, w, b, 1, "time_first", "cpp")
    h.sum().backward()
    assert h.shape == empty.shape and empty.grad.shape == empty.shape


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("threshold", ["bn", "param"])
def test_neuron_backend_cpp(layout, threshold):
    """backend='cpp' trains the same neuron as the torch implementation: spikes, every gradient,
    running statistics, over two steps (the second with updated running stats)."""
    torch.manual_seed(7)
    ref = neuron.MulFreeChannelwisePSN(4, k=3, dilation=2, step_mode="m", layout=layout, threshold=threshold,
                                       exp_init=False, method="shift_add").double()
    fast = copy.deepcopy(ref)
    fast.backend = "cpp"
    assert "cpp" in fast.supported_backends and fast.resolve_method(torch.zeros(3, 2, 4)) == "cpp"
    shape = (9, 3, 4, 2) if layout == "time_first" else (3, 4, 2, 9)
    for _ in range(2):
        x = torch.randn(shape, dtype=torch.float64) * 2
        xr, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
        sr, sf = ref(xr), fast(xf)
        torch.testing.assert_close(sf, sr)
        g = torch.randn_like(sr)
        (sr * g).sum().backward()
        (sf * g).sum().backward()
        torch.testing.assert_close(xf.grad, xr.grad)
        for (name, p), q in zip(ref.named_parameters(), fast.parameters()):
            torch.testing.assert_close(q.grad, p.grad, msg=lambda m: f"grad {name}: {m}")
        for a, b in zip(ref.buffers(), fast.buffers()):
            torch.testing.assert_close(a, b)
    ref.eval()
    fast.eval()
    x = torch.randn(shape, dtype=torch.float64)
    torch.testing.assert_close(fast(x), ref(x))


def register_unfused():
    """'cpp' registered once more without its fused steps, as 'cpp_unfused': its general path (the
    charge, statistics and spike kernels, folded in Python) on the same kernels."""
    ops.register(dataclasses.replace(ops.get("cpp"), name="cpp_unfused", bn_fire=None, step_fire=None,
                                     checks_inputs=False, autoselect=False))


@pytest.fixture(autouse=True)
def cpp_unfused():
    register_unfused()
    yield
    ops.unregister("cpp_unfused")


def _fused_and_general(layout, quantize, ste, sg, dtype, k=5, dilation=2):
    """A BN-threshold neuron on 'cpp' (fused) and its reference taking the general path: in float64 the
    torch neuron, in float32 the general path of 'cpp' itself (the same kernels, so no spike flips where
    float32 rounding differs); the input shape and the gradient tolerance."""
    torch.manual_seed(11)
    ref = neuron.MulFreeChannelwisePSN(6, k=k, dilation=dilation, step_mode="m", layout=layout, quantize=quantize,
                                       ste=ste, surrogate_function=sg, exp_init=False, method="shift_add").to(dtype)
    with torch.no_grad():
        ref.gamma.uniform_(0.5, 1.5)
        ref.beta.uniform_(-1.0, 0.5)
    fast = copy.deepcopy(ref)
    fast.method = "cpp"
    if dtype == torch.float32:
        register_unfused()
        ref.method = "cpp_unfused"
    shape = (11, 3, 6, 5) if layout == "time_first" else (3, 6, 5, 11)
    # At order 1 the BN leaves the loss all but invariant to the weight's scale: its gradient is the small
    # difference of two much larger terms (the folding's and the statistics'; without the quantiser they
    # cancel to 1e-3 of each or less), so float32 rounds it to about 1e-4 relative (1e-5 at higher orders).
    f32 = 1e-4 if k == 1 else 1e-5
    return ref, fast, shape, TOL[dtype] if dtype == torch.float64 else dict(rtol=f32, atol=f32)


def _same_step(ref, fast, x, tol):
    """One forward + backward of each on copies of ``x``: spikes, dL/dX, every parameter's gradient and
    the buffers agree; the fused one ran as one node, the reference not."""
    xr, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    (sr, ref_fused), (sf, fast_fused) = fused_run(ref, xr), fused_run(fast, xf)
    assert fast_fused and not ref_fused
    torch.testing.assert_close(sf, sr)
    g = torch.randn_like(sr)
    (sr * g).sum().backward()
    (sf * g).sum().backward()
    torch.testing.assert_close(xf.grad, xr.grad, **tol)
    for (name, p), q in zip(ref.named_parameters(), fast.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **tol, msg=lambda m: f"grad {name}: {m}")
    for a, b in zip(ref.buffers(), fast.buffers()):
        torch.testing.assert_close(a, b, **tol)


BN_CASES = [pytest.mark.parametrize("layout", LAYOUTS),
            pytest.mark.parametrize("quantize,ste", [(True, "whole"), (True, "round"), (False, "whole")]),
            pytest.mark.parametrize("sg", [surrogate.ATan(), surrogate.Sigmoid(alpha=1.5)], ids=repr),
            pytest.mark.parametrize("dtype", [torch.float64, torch.float32])]


def _bn_cases(fn):
    for mark in reversed(BN_CASES):
        fn = mark(fn)
    return fn


@_bn_cases
def test_fused_bn_training_matches_the_general_path(layout, quantize, ste, sg, dtype, monkeypatch):
    """BN-threshold training on 'cpp' runs as one autograd node (statistics, folding, quantiser and
    spikes; the statistics' dL/dX added in place) and equals a graph autograd builds op by op. Spikes,
    dL/dX, every parameter's gradient and the running statistics, over two steps."""
    ref, fast, shape, tol = _fused_and_general(layout, quantize, ste, sg, dtype)
    for _ in range(2):
        _same_step(ref, fast, torch.randn(shape, dtype=dtype) * 2, tol)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("k,dilation", [(1, 1), (2, 1), (3, 2), (8, 1), (11, 1)])
@pytest.mark.parametrize("sg", [surrogate.ATan(), surrogate.Sigmoid(alpha=1.5)], ids=repr)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_bn_training_every_kernel_width(layout, k, dilation, sg, dtype, monkeypatch):
    """The BN training step (one node: statistics, folding, spikes; the spike and statistics backward
    sweeps) at every order the kernels specialise (1, 2, 3 padded to 4, 8) and the generic kernel (11),
    30 lanes per step (lines of vectors side by side, whole vectors and single lanes), equals the
    general path."""
    ref, fast, shape, tol = _fused_and_general(layout, True, "whole", sg, dtype, k=k, dilation=dilation)
    for _ in range(2):
        _same_step(ref, fast, torch.randn(shape, dtype=dtype) * 2, tol)


@_bn_cases
def test_fused_bn_eval_matches_the_general_path(layout, quantize, ste, sg, dtype, monkeypatch):
    """In eval mode the fused node folds the running statistics (constants: no gradient through them,
    nothing updated) and equals the general path, with gradients (e.g. an attack on the input), under
    no_grad and under inference_mode; after two training steps, so the running statistics are not
    their initial values."""
    ref, fast, shape, tol = _fused_and_general(layout, quantize, ste, sg, dtype)
    for _ in range(2):
        _same_step(ref, fast, torch.randn(shape, dtype=dtype) * 2, tol)
    ref.eval()
    fast.eval()
    for mod in (ref, fast):
        for p in mod.parameters():
            p.grad = None
    _same_step(ref, fast, torch.randn(shape, dtype=dtype) * 2, tol)
    assert fast.num_batches_tracked.item() == 2
    x = torch.randn(shape, dtype=dtype) * 2
    with torch.no_grad():
        torch.testing.assert_close(fast(x), ref(x))
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), ref(x))


def test_fused_bn_statistics_changed_in_place_are_caught():
    """The fused node returns the batch mean and variance and its backward reads them: an in-place change
    before the backward must raise, as for any saved tensor, not give wrong gradients."""
    x = torch.randn(5, 3, 4, requires_grad=True)
    w, gamma, beta = torch.rand(4, 2, requires_grad=True), torch.ones(4, requires_grad=True), -torch.ones(4)
    spikes, mean, var = ops.get("cpp").bn_fire(x, w, gamma, beta, 1e-5, "whole", 1, "time_first",
                                        *ops.surrogate.fused(surrogate.ATan()))
    spikes.sum().backward(retain_graph=True)  # untouched: fine
    mean.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        spikes.sum().backward()


def test_fused_bn_eval_statistics_changed_in_place_are_caught():
    """In eval mode the node folds the running statistics and its backward reads them: a training step
    in between (which blends new statistics into them in place) must make the backward raise."""
    sn = neuron.MulFreeChannelwisePSN(4, k=2, step_mode="m", method="cpp").eval()
    x = torch.randn(5, 3, 4, requires_grad=True)
    spikes, ran = fused_run(sn, x)
    assert ran
    spikes.sum().backward(retain_graph=True)  # untouched: fine
    sn.train()
    sn(torch.randn(5, 3, 4))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        spikes.sum().backward()


class CountMultiplications(torch.overrides.TorchFunctionMode):
    """Counts the multiplications torch runs inside it: the general single-step path multiplies each
    tap, a fused kernel runs outside torch."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += "mul" in getattr(func, "__name__", "")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("threshold", ["bn", "param"])
@pytest.mark.parametrize("quantize", [True, False])
@pytest.mark.parametrize("k,d", [(1, 1), (2, 1), (3, 2), (9, 1)])
@pytest.mark.parametrize("features", [(), (5,), (2, 3)], ids=lambda f: f"F{f}")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_single_step_inference_runs_one_kernel_and_matches(threshold, quantize, k, d, features, dtype, monkeypatch):
    """Single-step calls without gradients on 'cpp' (streaming inference) run one kernel each (eval
    folding, quantiser, taps and spikes) and give the spikes of the PyTorch single-step path and of
    the multi-step neuron, from the first step (taps before t = 0 read nothing) on."""
    torch.manual_seed(5)
    m = neuron.MulFreeChannelwisePSN(6, k=k, dilation=d, step_mode="m", threshold=threshold, quantize=quantize,
                                     exp_init=False).to(dtype)
    with torch.no_grad():
        m.weight.uniform_(-1.0, 1.0)
    for _ in range(2):
        m(torch.randn(7, 4, 6, *features, dtype=dtype))
    m.eval()
    ref = neuron.MulFreeChannelwisePSN(6, k=k, dilation=d, step_mode="s", threshold=threshold, quantize=quantize,
                                       exp_init=False).to(dtype).eval()
    ref.load_state_dict(m.state_dict())
    fast = copy.deepcopy(ref)
    fast.method = "cpp"
    t = (k - 1) * d + 4
    x = torch.randn(t, 4, 6, *features, dtype=dtype) * 2
    with torch.no_grad():
        with CountMultiplications() as count:
            out_fast = torch.stack([fast(x[i]) for i in range(t)])
        assert count.n == 0, "the general path ran"
        out_ref = torch.stack([ref(x[i]) for i in range(t)])
        out_m = m(x)
    assert len(fast.x_queue) == (k - 1) * d
    torch.testing.assert_close(out_fast, out_ref, rtol=0, atol=0)
    torch.testing.assert_close(out_fast, out_m, rtol=0, atol=0)
    assert 0 < out_fast.mean() < 1  # both kinds of spike happen


def test_step_fire_refuses_arguments_that_do_not_fit():
    """The single-step kernel reads raw pointers: shapes that do not fit are a clear error, not a read out
    of bounds."""
    x, w = torch.randn(3, 4, 5), torch.randn(4, 2)
    bias, ones = torch.zeros(4), torch.ones(4)
    with torch.no_grad():
        ok = ops.mf_psn_step([x, x], w, bias=bias, method="cpp")
        assert ok.shape == x.shape
        bad = [([x], w, bias, None), ([x, None], w, bias, None), ([x, x], w[:3], bias, None),
               ([torch.randn(3, 4, 6), x], w, bias, None), ([x, x], w, torch.zeros(3), None),
               ([x, x], w, bias, ops.BatchNorm(ones, ones, ones, ones)),
               ([x, x], w, None, ops.BatchNorm(ones, ones, ones[:3], ones))]
        for taps, weight, b, bn in bad:
            with pytest.raises(ValueError):
                ops.mf_psn_step(taps, weight, bias=b, bn=bn, method="cpp")


def test_single_step_takes_the_general_path_where_the_kernel_does_not_apply(monkeypatch):
    """With a gradient to compute, BN statistics to take in training, another surrogate or strided
    inputs the single step runs the general path; NaN weights are reported there."""
    sn = neuron.MulFreeChannelwisePSN(4, k=2, step_mode="s", method="cpp", threshold="param")
    x = torch.randn(3, 4, 5)
    assert sn(x).grad_fn is not None  # the weight requires grad
    functional_reset = sj.functional.reset_net
    bn = neuron.MulFreeChannelwisePSN(4, k=2, step_mode="s", method="cpp")
    with torch.no_grad():
        with CountMultiplications() as count:
            bn(x)  # training: this step's batch statistics
        assert count.n > 0
        bn.eval()
        with CountMultiplications() as count:
            bn(x)
        assert count.n == 0  # the kernel
        functional_reset(bn)
        bn.surrogate_function = surrogate.PiecewiseQuadratic()
        with CountMultiplications() as count:
            bn(x)
        assert count.n > 0
        bn.surrogate_function = surrogate.ATan()
        functional_reset(bn)
        with CountMultiplications() as count:
            bn(torch.randn(3, 5, 4).transpose(1, 2))  # not contiguous
        assert count.n > 0
    sn.weight.data[0, 0] = float("nan")
    with torch.no_grad(), pytest.raises(ValueError, match="NaN or inf"):
        sn(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_bn_quantiser_rounds_the_exponent_exactly(dtype):
    """The fused node quantises in C++ (exponent and mantissa, no log2): it must give Q's powers of two,
    including next to the rounding point 2**(e + 1/2), for zero, subnormal and huge (clamped) weights,
    and a folded weight that overflows to inf. With X = 0 and eps = 0.25 the folding scale is exactly
    2 * gamma, so the node's quantised weight is Q(2 * gamma * weight). The reference rounds exactly
    (a float log2 cannot always: float64's sqrt(2) * 2**-100 has log2 -99.5 after rounding, though it
    lies above the rounding point)."""
    info = torch.finfo(dtype)
    top = math.frexp(info.max)[1] - 1
    subnormal = info.tiny * info.eps  # the smallest positive value
    values = [0.0, 1.0, -1.0, 0.75, -1.5, 3.0, 1e-3, -7e4, info.tiny / 8, subnormal, -3 * subnormal, info.max,
              -info.max / 3, 2.0 ** -100 * 2.0 ** 0.5]
    mid = torch.tensor(2.0 ** 0.5, dtype=dtype)  # the rounding point between 2**0 and 2**1, and either side
    below, above = torch.nextafter(mid, mid.new_tensor(0.0)), torch.nextafter(mid, mid.new_tensor(2.0))
    w = torch.cat([torch.tensor(values, dtype=dtype), below.view(1), above.view(1), -above.view(1) * 8])
    w = torch.cat([w, w[-6:-4]]).view(-1, 1).contiguous()  # the last two: +-max and -max/3 scaled by 2
    c = w.shape[0]
    gamma = torch.full((c,), 0.5, dtype=dtype)
    gamma[-2:] = 1.0
    x = torch.zeros(3, 2, c, dtype=dtype, requires_grad=True)
    cpp_ops.load()  # the node's forward operator returns the folded weight too
    spikes, mean, var, wq, _ = torch.ops.spikingjelly_mfpsn.cpp_bn_forward(
        x.detach(), w, gamma, torch.zeros(c, dtype=dtype), None, None, None, None, 0.25, True, 1, False, 0.0)
    assert torch.equal(var, torch.zeros_like(var))
    torch.testing.assert_close(wq[:-2], reference.pow2(w[:-2], top), rtol=0, atol=0)
    assert wq[-5].item() == 1.0 and wq[-4].item() == 2.0 and wq[-3].item() == -16.0  # either side of 2**(1/2)
    assert wq[-2].item() == 2.0 ** top and wq[-1].item() == -(2.0 ** top)  # inf (clamped), then -2/3 max


def test_fused_bn_training_falls_back_where_it_does_not_apply():
    """Other surrogates and running statistics the kernel cannot read raw take the general path (two
    kernels, autograd between). Autocast is fused: the kernels compute in the parameters' dtype, as the
    general path does under autocast, and give its spikes."""
    x = torch.randn(7, 2, 4, requires_grad=True)
    sn = neuron.MulFreeChannelwisePSN(4, k=2, step_mode="m", method="cpp", surrogate_function=surrogate.PiecewiseQuadratic())
    assert not fused_run(sn, x)[1]
    sn = neuron.MulFreeChannelwisePSN(4, k=2, step_mode="m", method="cpp")
    ref = copy.deepcopy(sn)
    ref.method = "shift_add"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (s, ran), s_ref = fused_run(sn, x), ref(x)
    assert ran
    torch.testing.assert_close(s, s_ref)
    assert fused_run(sn, x)[1]
    sn.eval()  # eval is fused too, but not with running statistics the kernel cannot read raw
    fused_out, ran = fused_run(sn, x)
    assert ran
    sn.running_var = torch.stack([sn.running_var, sn.running_var], 1)[:, 0]  # the same values, strided
    assert not sn.running_var.is_contiguous()
    general, ran = fused_run(sn, x)
    assert not ran
    torch.testing.assert_close(general, fused_out)
    sn.running_var = sn.running_var.contiguous()
    sn.train()
    sn.gamma.data = sn.gamma.data.double()  # a BN parameter of another dtype: not read as float32 by the
    ref = copy.deepcopy(sn)                  # fused kernel; the general path runs as every method does
    ref.method = "shift_add"
    (s, ran), s_ref = fused_run(sn, x), ref(x)
    assert not ran
    torch.testing.assert_close(s, s_ref)
    sn.gamma.data = sn.gamma.data.float()
    x_nan = torch.randn(7, 2, 4)
    with torch.no_grad():
        sn.weight[0, 0] = float("nan")
    sn.train()
    with pytest.raises(ValueError, match="NaN or inf"):
        sn(x_nan)
    with torch.no_grad():
        sn.weight[0, 0] = 1.0
        sn.weight[-1, -1] = -float("inf")  # the last weight: the kernel's check reads every one
    with pytest.raises(ValueError, match="NaN or inf"):
        sn(x_nan)


def test_requirements_name_the_problem():
    impl = ops.get("cpp")
    x = torch.randn(4, 2, 3)
    assert impl.supports(x, torch.randn(3, 2), 1, "time_first")
    reasons = impl.not_supported_reasons(x.half(), torch.randn(3, 2).half(), 1, "time_first")
    assert any("float32" in r and "float64" in r and "float16" in r for r in reasons)
    reasons = impl.not_supported_reasons(x, torch.randn(3, 2).double(), 1, "time_first")
    assert any("the weight's dtype torch.float64" in r for r in reasons)
    with pytest.raises(ValueError, match="cannot run this input"):
        ops.charge(x.half(), torch.randn(3, 2).half(), None, 1, "time_first", "cpp")


def run_python(code, **env):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]), **env}, timeout=300)


def test_autoselect_candidates_and_method_switch_backend():
    """'cpp' is an autoselect candidate of a torch-backend neuron; choosing it switches the backend;
    an emulated backend (Triton's interpreter) is never a candidate."""
    from spikingjelly.activation_based import functional
    import spikingjelly_mfpsn as mf
    sn = neuron.MulFreeChannelwisePSN(3, step_mode="m")
    assert sn.backend == "torch" and "cpp" in sn.candidate_methods and "cpp" not in sn.supported_methods
    assert set(sn.supported_methods) <= set(sn.candidate_methods)
    if "triton" in ops.names():
        from spikingjelly_mfpsn.ops import triton_ops
        assert ("triton" in sn.candidate_methods) == (not triton_ops.INTERPRETED and torch.cuda.is_available())
    net = torch.nn.Sequential(sn)
    mf.set_method(net, "cpp")
    assert sn.method == "cpp" and sn.backend == "cpp"
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    ref = neuron.MulFreeChannelwisePSN(3, step_mode="m", method="shift_add").double()
    torch.testing.assert_close(net.double()(x), ref(x))
    functional.reset_net(net)
    sn.method = "shift_add"
    assert sn.backend == "torch"


def test_compiled_training_matches_eager():
    """A compiled (aot_eager) network of 'cpp' neurons: outputs, every gradient and the running
    statistics equal the eager torch implementation's."""
    from spikingjelly.activation_based import functional, layer
    torch.manual_seed(0)
    ref = torch.nn.Sequential(layer.Linear(6, 16), neuron.MulFreeChannelwisePSN(16, k=3, dilation=2),
                              layer.Linear(16, 16),
                              neuron.MulFreeChannelwisePSN(16, k=2, threshold="param", surrogate_function=surrogate.Sigmoid()),
                              layer.Linear(16, 4)).double()
    functional.set_step_mode(ref, "m")
    fast = copy.deepcopy(ref)
    spikingjelly_mfpsn.set_method(fast, "cpp")
    compiled = torch.compile(fast, backend="aot_eager")
    x = torch.rand(5, 3, 6, dtype=torch.float64)
    out_r, out_c = ref(x), compiled(x)
    torch.testing.assert_close(out_c, out_r)
    out_r.square().sum().backward()
    out_c.square().sum().backward()
    for (name, p), q in zip(ref.named_parameters(), fast.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=lambda m: f"{name}: {m}")
    for a, b in zip(ref.buffers(), fast.buffers()):
        torch.testing.assert_close(b, a)


@pytest.mark.parametrize("time_last", [False, True])
def test_custom_ops_pass_opcheck(time_last):
    """The operators' schemas, fake kernels and autograd registrations are consistent."""
    cpp_ops.load()
    lib = torch.ops.spikingjelly_mfpsn
    shape = (2, 3, 4, 5) if time_last else (5, 2, 3, 4)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(lib.cpp_charge, (x, w, b, 1, time_last, 1, 2.0))
    torch.library.opcheck(lib.cpp_charge, (x, w, None, 2, time_last, 0, 0.0))
    torch.library.opcheck(lib.cpp_stats, (x, w, 1, time_last))
    g, m = torch.randn(shape, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    for need_gx in (True, False):
        torch.library.opcheck(lib.cpp_charge_backward, (x.detach(), w.detach(), None, g, 2, time_last, 1, 2.0, need_gx))
        torch.library.opcheck(lib.cpp_stats_backward, (x.detach(), w.detach(), m, m, m.abs(), 1, time_last, need_gx))


@pytest.mark.parametrize("threshold,expected", [("param", (2.0, 3.0)), ("bn", (3.0, 6.0))])
def test_memory_pass_count_sees_every_cpp_kernel(threshold, expected):
    """benchmarks/memory_passes.py counts the C++ kernels from their Python entry points; a kernel call
    it does not see (e.g. after a refactor) would make the count drop below what the kernels do:
    param, spikes forward (read X, write S) and backward (read X and dL/dS, write dL/dX); bn, the fused
    node (statistics and spikes forward, both backwards, the second adding to dL/dX)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import memory_passes
    finally:
        sys.path.pop(0)
    for layout, shape in (("time_first", (8, 4, 16, 64)), ("time_last", (4, 16, 64, 8))):
        fwd, bwd, *_ = memory_passes.step_passes("cpp", layout, threshold, shape)
        # parameter-sized tensors add a few hundredths of a pass
        assert fwd == pytest.approx(expected[0], abs=0.1) and bwd == pytest.approx(expected[1], abs=0.1)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_bn_training_without_input_gradient(layout):
    """A first layer fed data that needs no gradient: the fused node's backward skips dL/dX (the spike
    and the statistics' backward both) and still gives every parameter's gradient of the torch path."""
    torch.manual_seed(5)
    fast = neuron.MulFreeChannelwisePSN(6, k=3, dilation=2, step_mode="m", layout=layout, method="cpp").double()
    with torch.no_grad():
        fast.weight.uniform_(-1.0, 1.0)
        fast.gamma.uniform_(0.5, 1.5)
    ref = copy.deepcopy(fast)
    ref.method = "shift_add"
    x = torch.randn((9, 3, 6, 5) if layout == "time_first" else (3, 6, 5, 9), dtype=torch.float64) * 2
    (sf, ran), sr = fused_run(fast, x), ref(x)
    assert ran
    g = torch.randn_like(sf)
    (sf * g).sum().backward()
    (sr * g).sum().backward()
    for (name, p), q in zip(ref.named_parameters(), fast.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **TOL[torch.float64], msg=lambda m: f"grad {name}: {m}")


@pytest.mark.parametrize("momentum", [0.3, None], ids=["momentum0.3", "cumulative"])
@pytest.mark.parametrize("buffers", ["same_dtype", "float64"])
def test_fused_bn_training_updates_running_statistics(momentum, buffers):
    """The fused node blends the batch mean and unbiased variance into the running statistics in its
    kernel call as the torch path does, with a momentum or a cumulative average, over three steps;
    num_batches_tracked counts them; eval then uses them. Buffers of another dtype than x are left to
    the general path (before, its lerp_ failed on them)."""
    torch.manual_seed(3)
    ref = neuron.MulFreeChannelwisePSN(5, k=2, dilation=1, step_mode="m", momentum=momentum, exp_init=False,
                                       method="shift_add")
    fast = copy.deepcopy(ref)
    fast.method = "cpp"
    if buffers == "float64":
        for m in (ref, fast):
            m.running_mean.data, m.running_var.data = m.running_mean.double(), m.running_var.double()
    for step in range(3):
        x = torch.randn(7, 4, 5) * 2 + step
        xf = x.clone().requires_grad_()
        assert fused_run(fast, xf)[1] == (buffers == "same_dtype")
        ref(x)
        version = fast.running_mean._version
        torch.testing.assert_close(fast.running_mean, ref.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fast.running_var, ref.running_var, rtol=1e-5, atol=1e-6)
        assert int(fast.num_batches_tracked) == int(ref.num_batches_tracked) == step + 1
        assert version > 0  # written in place: autograd sees a new version
    if buffers == "same_dtype":  # (float64 statistics would make float64 eval weights, which 'cpp' refuses)
        ref.eval()
        fast.eval()
        x = torch.randn(7, 4, 5)
        torch.testing.assert_close(fast(x), ref(x))


def test_the_direct_bn_fire_refuses_what_it_cannot_run():
    """The fused BN step runs with no check in Python (a neuron's hot path): the C++ operator checks every
    tensor and runs nothing it cannot take. Each argument that does not fit returns None, with nothing
    written (the running statistics as they were) and no read out of bounds; a fitting one equals
    ops.mf_psn."""
    x = torch.randn(6, 3, 4, requires_grad=True)
    w, gamma, beta = leaves(torch.rand(4, 2), torch.rand(4) + 0.5, torch.rand(4) - 1)
    rm, rv = torch.zeros(4), torch.ones(4)
    sg = surrogate.ATan()

    def call(x=x, w=w, gamma=gamma, beta=beta, running=(rm, rv, 0.1), given=None, dilation=1, eps=1e-5,
             layout="time_first", sg=sg):
        return ops.get("cpp").bn_fire(x, w, gamma, beta, eps, "whole", dilation, layout, *ops.surrogate.fused(sg),
                                      running, given)

    got_rm, got_rv, want_rm, want_rv = rm.clone(), rv.clone(), rm.clone(), rv.clone()
    got = call(running=(got_rm, got_rv, 0.1))
    want = ops.mf_psn(x, w, bn=ops.BatchNorm(gamma, beta, want_rm, want_rv, 1e-5, 0.1), method="cpp", training=True)
    assert got is not None and got[0].grad_fn is not None
    assert torch.equal(got[0], want) and torch.equal(got_rm, want_rm) and torch.equal(got_rv, want_rv)
    want = (want, *got[1:])
    with torch.no_grad():  # no graph to record: the node runs without one
        plain = call(running=(rm.clone(), rv.clone(), 0.1))
    assert plain[0].grad_fn is None
    for a, b in zip(plain, want):
        assert torch.equal(a, b)
    strided = torch.randn(4, 6, 3).permute(1, 2, 0).requires_grad_()  # (6, 3, 4), not contiguous: runs
    torch.testing.assert_close(call(x=strided, running=None)[0], call(x=strided.contiguous(), running=None)[0])
    bad = {"2 dims": dict(x=torch.randn(6, 4, requires_grad=True)),
           "7 dims": dict(x=torch.randn(2, 3, 4, 1, 1, 1, 1, requires_grad=True)),
           "other channels": dict(x=torch.randn(6, 3, 5, requires_grad=True)),
           "channels on the time-last dim": dict(layout="time_last"),
           "empty": dict(x=torch.randn(0, 3, 4, requires_grad=True)),
           "float64 x": dict(x=x.detach().double().requires_grad_()),
           "meta x": dict(x=torch.empty(6, 3, 4, device="meta", requires_grad=True)),
           "1-dim weight": dict(w=leaves(torch.rand(4))[0]),
           "order 0": dict(w=leaves(torch.rand(4, 0))[0]),
           "weight of other channels": dict(w=leaves(torch.rand(5, 2))[0]),
           "short gamma": dict(gamma=leaves(torch.rand(3))[0]),
           "strided gamma": dict(gamma=leaves(torch.rand(8))[0][::2]),
           "float64 beta": dict(beta=leaves(torch.rand(4).double())[0]),
           "2-dim beta": dict(beta=leaves(torch.rand(4, 1))[0]),
           "short running mean": dict(running=(torch.zeros(3), rv, 0.1)),
           "strided running var": dict(running=(rm, torch.ones(8)[::2], 0.1)),
           "short given mean": dict(running=None, given=(torch.zeros(3), rv)),
           "dilation 0": dict(dilation=0),
           "eps 0": dict(eps=0.0),
           "eps NaN": dict(eps=float("nan")),
           "another surrogate": dict(sg=surrogate.PiecewiseQuadratic()),
           "NaN weight": dict(w=leaves(torch.tensor([[float("nan"), 1.0]] * 4))[0])}
    for name, kwargs in bad.items():
        before = (rm.clone(), rv.clone(), rm._version, rv._version)
        assert call(**kwargs) is None, name
        assert torch.equal(rm, before[0]) and torch.equal(rv, before[1]), name
        assert (rm._version, rv._version) == before[2:], name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_neuron_on_cpp_skips_its_python_checks_and_falls_back_on_what_the_node_refuses(layout, monkeypatch):
    """A training step of a BN neuron on 'cpp' goes straight to the C++ node (which checks the input),
    past the neuron's and the registry's checks; whatever the node refuses (another dtype, a strided
    gamma, channels that do not match, NaN weights) takes the checked path as before: the same spikes,
    gradients, statistics and errors as the torch neuron, num_batches_tracked counted once per step."""
    torch.manual_seed(5)
    ref = neuron.MulFreeChannelwisePSN(4, k=3, step_mode="m", layout=layout, exp_init=False,
                                       method="shift_add").double()
    fast = copy.deepcopy(ref)
    fast.method = "cpp"
    x = torch.randn((7, 3, 4) if layout == "time_first" else (3, 4, 7), dtype=torch.float64)
    _same_step(ref, fast, x, TOL[torch.float64])
    for xs in (x.float(), x.half()):  # refused by the node, promoted on the checked path
        torch.testing.assert_close(fast(xs), ref(xs))
    wrong = torch.randn((7, 3, 5) if layout == "time_first" else (3, 5, 7), dtype=torch.float64)
    for bad in (wrong, torch.randn(7, 4, dtype=torch.float64)):
        with pytest.raises(ValueError) as want:
            ref(bad)
        with pytest.raises(ValueError) as got:
            fast(bad)
        assert str(got.value) == str(want.value)
    fast.gamma = torch.nn.Parameter(torch.ones(8, dtype=torch.float64)[::2])  # not contiguous: refused
    ref.gamma = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
    xr, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    sr, (sf, ran) = ref(xr), fused_run(fast, xf)
    assert not ran
    torch.testing.assert_close(sf, sr)
    g = torch.randn_like(sr)
    (sr * g).sum().backward()
    (sf * g).sum().backward()
    torch.testing.assert_close(xf.grad, xr.grad, **TOL[torch.float64])
    for a, b in zip(ref.buffers(), fast.buffers()):
        torch.testing.assert_close(a, b, **TOL[torch.float64])
    assert int(fast.num_batches_tracked) == int(ref.num_batches_tracked) == 4
    with torch.no_grad():
        fast.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        fast(x.requires_grad_())
    assert int(fast.num_batches_tracked) == 4  # nothing counted


def test_the_cpp_node_refuses_a_double_backward_and_in_place_changes():
    x = torch.randn(6, 2, 4, dtype=torch.float64, requires_grad=True)
    w, gamma, beta = leaves(torch.rand(4, 2).double(), torch.ones(4).double(), -torch.ones(4).double())
    spikes, mean, var = ops.get("cpp").bn_fire(x, w, gamma, beta, 1e-5, "whole", 1, "time_first",
                                        *ops.surrogate.fused(surrogate.ATan()))
    with pytest.raises(RuntimeError, match="first-order gradients only.*create_graph=True"):
        torch.autograd.grad(spikes.sum(), x, create_graph=True)
    spikes, mean, var = ops.get("cpp").bn_fire(x, w, gamma, beta, 1e-5, "whole", 1, "time_first",
                                        *ops.surrogate.fused(surrogate.ATan()))
    var.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        spikes.sum().backward()
