"""The Triton kernels against the plain loop reference, run through Triton's interpreter on the CPU.

conftest.py sets TRITON_INTERPRET=1 before anything imports triton (with TRITON_INTERPRET=0 on a
machine with a GPU the same tests run the compiled kernels on CUDA tensors).
"""
import copy
import itertools
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import spikingjelly_mfpsn  # noqa: F401  (registers the neuron)
from spikingjelly.activation_based import neuron, surrogate
from spikingjelly_mfpsn import ops

import reference
from test_ops import make_input

triton_ops = pytest.importorskip("spikingjelly_mfpsn.ops.triton_ops",
                                 reason="triton is not installed (pip install triton)")
if triton_ops.INTERPRETED:
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip("TRITON_INTERPRET is off and there is no CUDA device to run the kernels on",
                allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = ops.LAYOUTS
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5)}


def check_charge(x, weight, bias, dilation, layout, tol, grad_out=None):
    """Forward and every gradient of the triton charge against the reference (run in float64)."""
    x = x.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    bias = None if bias is None else bias.detach().requires_grad_()
    h = ops.charge(x, weight, bias, dilation, layout, "triton")
    assert h.shape == x.shape and h.is_contiguous() and h.dtype == torch.result_type(x, weight)
    args = [t.detach().double().requires_grad_() if t is not None else None for t in (x, weight, bias)]
    h_ref = reference.charge(*args, dilation, layout)
    torch.testing.assert_close(h.double(), h_ref, **tol)
    g = torch.randn(h.shape, dtype=h.dtype, device=h.device) if grad_out is None else grad_out
    wanted = [t for t in (x, weight, bias) if t is not None]
    grads = torch.autograd.grad(h, wanted, g)
    grads_ref = torch.autograd.grad(h_ref, [t for t in args if t is not None], g.double())
    for got, want, inp, what in zip(grads, grads_ref, wanted, ("x", "weight", "bias")):
        assert got.dtype == inp.dtype and got.shape == inp.shape
        torch.testing.assert_close(got.double(), want, **tol, msg=lambda m: f"grad {what}: {m}")


def rand(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("k,dilation", list(itertools.product([1, 2, 3, 5], [1, 2, 3])))
def test_kd_grid(layout, k, dilation):
    torch.manual_seed(k * 10 + dilation)
    # T shorter than the receptive field (every tap but the last falls before t = 0; T = 1 for
    # k = 1 or k = 2, d = 1), and a T past it.
    for t in sorted({max(1, (k - 1) * dilation), (k - 1) * dilation + 5}):
        x = make_input(t, 2, 3, (2,), layout, torch.float64, True).to(DEVICE)
        check_charge(x, rand(3, k), rand(3), dilation, layout, TOL[torch.float64])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("features", [(), (3,), (3, 2), (2, 2, 3)])
@pytest.mark.parametrize("contiguous", [True, False])
def test_ranks_and_strides(layout, features, contiguous):
    torch.manual_seed(len(features))
    # Non-contiguous = reversed memory order, so the feature dims cannot merge: one explicit copy.
    x = make_input(6, 2, 3, features, layout, torch.float32, contiguous).to(DEVICE)
    w = rand(3, 3, dtype=torch.float32)
    if not contiguous:
        w = rand(3, 3, dtype=torch.float32).t()  # a (C, k) weight with strides (1, C)
    check_charge(x, w, rand(3, dtype=torch.float32), 2, layout, TOL[torch.float32])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("k", [1, 3])
def test_single_step_sequence(layout, k):
    x = make_input(1, 3, 4, (2,), layout, torch.float64, True).to(DEVICE)
    check_charge(x, rand(4, k), rand(4), 2, layout, TOL[torch.float64])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_empty_batch(layout):
    x = make_input(5, 0, 3, (2,), layout, torch.float32, True).to(DEVICE).requires_grad_()
    w, b = rand(3, 2, dtype=torch.float32).requires_grad_(), rand(3, dtype=torch.float32).requires_grad_()
    h = ops.charge(x, w, b, 1, layout, "triton")
    assert h.shape == x.shape
    gx, gw, gb = torch.autograd.grad(h.sum(), (x, w, b))
    assert gx.shape == x.shape and not gw.any() and not gb.any()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_many_tiles_and_splits(layout):
    """Several tiles along rows, channels and time, and a backward split over several programs."""
    torch.manual_seed(1)
    x = make_input(37, 5, 9, (7,), layout, torch.float64, True).to(DEVICE)
    check_charge(x, rand(9, 4), rand(9), 3, layout, TOL[torch.float64])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_bias_and_partial_grads(layout):
    x = make_input(7, 2, 3, (2,), layout, torch.float64, True).to(DEVICE)
    check_charge(x, rand(3, 3), None, 1, layout, TOL[torch.float64])
    # Only some inputs need a gradient: the kernel skips the others and still gets these right.
    w = rand(3, 3).requires_grad_()
    h = ops.charge(x, w, rand(3), 1, layout, "triton")
    g = torch.randn_like(h)
    (gw,) = torch.autograd.grad(h, (w,), g)
    wd = w.detach().requires_grad_()
    (gw_ref,) = torch.autograd.grad(reference.charge(x, wd, None, 1, layout), (wd,), g)
    torch.testing.assert_close(gw, gw_ref)


def test_strided_views_run_in_place():
    """Time-first data stored time-last, and a slice along T: strides passed, nothing copied."""
    base = rand(2, 3, 4, 5, 9)  # (N, C, H, W, T) contiguous
    x_tf = base.permute(4, 0, 1, 2, 3)  # time-first view, T is the contiguous axis
    x_tl = base[..., ::2]  # time-last view with T stride 2
    for x, layout in ((x_tf, "time_first"), (x_tl, "time_last")):
        x4, strides, m = triton_ops._view4(x, layout)
        assert x4.data_ptr() == base.data_ptr() and m == 20, "the kernel should read x in place"
        check_charge(x, rand(3, 3), rand(3), 2, layout, TOL[torch.float64])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_non_contiguous_grad_output(layout):
    x = make_input(6, 2, 3, (4,), layout, torch.float64, True).to(DEVICE)
    g = make_input(6, 2, 3, (4,), layout, torch.float64, False).to(DEVICE)
    check_charge(x, rand(3, 2), rand(3), 2, layout, TOL[torch.float64], grad_out=g)


# Half precision: inputs, weight and output in the low-precision type, accumulation in float32.
# Tolerances: about one unit in the last place of the output type at the O(1)-O(10) magnitudes
# here (float16: 2**-10 ~ 1e-3, bfloat16: 2**-7 ~ 8e-3), against the float64 reference of the same
# rounded inputs. Accumulating in the low-precision type would miss them on the weight gradient,
# which sums ~100 products.
HALF_TOL = {torch.float16: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(layout, dtype):
    torch.manual_seed(3)
    x = make_input(9, 2, 3, (3,), layout, dtype, True).to(DEVICE)
    check_charge(x, rand(3, 3, dtype=dtype), rand(3, dtype=dtype), 2, layout, HALF_TOL[dtype])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_float16_accumulates_in_float32(layout):
    # H = 2048 + 1 + 1 = 2050 is a float16 number, but float16 partial sums lose the ones
    # (2048 + 1 rounds to 2048).
    seq = torch.tensor([2048.0, 1.0, 1.0], dtype=torch.float16, device=DEVICE)
    x = seq.view(3, 1, 1) if layout == "time_first" else seq.view(1, 1, 3)
    h = ops.charge(x, torch.ones(1, 3, dtype=torch.float16, device=DEVICE), None, 1, layout, "triton")
    assert h.flatten()[-1].item() == 2050.0


# ---------------------------------------------------------------- fused charge + fire
def check_fire(sg, layout, dtype=torch.float32, fused=True):
    torch.manual_seed(5)
    x = make_input(8, 2, 3, (2,), layout, dtype, True).to(DEVICE).requires_grad_()
    w = rand(3, 3, dtype=dtype).requires_grad_()
    b = rand(3, dtype=dtype).mul(0.5).requires_grad_()
    s = ops.fire(x, w, b, 2, layout, "triton", sg)
    assert (type(s.grad_fn).__name__ == "_TritonChargeBackward") == fused
    args = [t.detach().double().requires_grad_() for t in (x, w, b)]
    h_ref = reference.charge(*args, 2, layout)
    s_ref = sg(h_ref)
    tol = TOL[torch.float32] if dtype == torch.float32 else HALF_TOL[dtype]
    # Spikes must match away from the threshold (rounding may flip |H| ~ 0); a 0/1 mismatch is 1.
    clear = h_ref.detach().abs() > 1e-3
    torch.testing.assert_close(s.double()[clear], s_ref.detach()[clear], **tol)
    g = torch.randn(s.shape, dtype=dtype, device=DEVICE)
    for got, want, what in zip(torch.autograd.grad(s, (x, w, b), g),
                               torch.autograd.grad(s_ref, args, g.double()), ("x", "weight", "bias")):
        torch.testing.assert_close(got.double(), want, **tol, msg=lambda m: f"grad {what}: {m}")
    return s


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sg", [surrogate.ATan(), surrogate.ATan(alpha=3.5), surrogate.Sigmoid(),
                                surrogate.Sigmoid(alpha=1.5)], ids=lambda sg: repr(sg))
def test_fused_fire_matches_surrogate(layout, sg):
    check_fire(sg, layout)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_fire_half(dtype):
    check_fire(surrogate.ATan(), "time_last", dtype)


class MyATan(surrogate.ATan):
    """A subclass may change the gradient: the fused path must not assume it is ATan's."""

    @staticmethod
    def spiking_function(x, alpha):
        return surrogate.sigmoid.apply(x, alpha)


def test_fire_falls_back_for_other_surrogates():
    check_fire(surrogate.PiecewiseQuadratic(), "time_first", fused=False)
    check_fire(MyATan(), "time_first", fused=False)
    # Non-spiking mode: the surrogate's primitive function, not a Heaviside.
    s = check_fire(surrogate.ATan(spiking=False), "time_last", fused=False)
    assert ((s > 0) & (s < 1)).any()
    # A forward hook on the surrogate (e.g. a monitor) still sees the call.
    sg = surrogate.Sigmoid()
    seen = []
    sg.register_forward_hook(lambda mod, inp, out: seen.append(out))
    check_fire(sg, "time_first", fused=False)
    assert seen


def test_fire_without_grad():
    x = rand(6, 2, 3, dtype=torch.float32)
    w, b = rand(3, 2, dtype=torch.float32), rand(3, dtype=torch.float32)
    with torch.no_grad():
        s = ops.fire(x, w, b, 1, "time_first", "triton", surrogate.ATan())
    assert torch.equal(s, (reference.charge(x, w, b, 1, "time_first") >= 0).float())


# ---------------------------------------------------------------- the neuron with backend='triton'
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("threshold", ["bn", "param"])
def test_neuron_backend_triton(layout, threshold):
    torch.manual_seed(7)
    ref = neuron.MulFreeChannelwisePSN(4, k=3, dilation=2, step_mode="m", layout=layout, threshold=threshold,
                                       exp_init=False, method="shift_add").to(DEVICE)
    tri = copy.deepcopy(ref)
    tri.backend = "triton"
    assert "triton" in tri.supported_backends and tri.method == "auto"
    shape = (9, 3, 4, 2) if layout == "time_first" else (3, 4, 2, 9)
    x = torch.randn(shape, device=DEVICE) * 2
    xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    sr, st = ref(xr), tri(xt)
    assert tri.resolve_method(xt) == "triton"
    torch.testing.assert_close(st, sr)
    g = torch.randn_like(sr)
    (sr * g).sum().backward()
    (st * g).sum().backward()
    torch.testing.assert_close(xt.grad, xr.grad, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(ref.named_parameters(), tri.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"grad {name}: {m}")
    if threshold == "bn":
        torch.testing.assert_close(tri.running_var, ref.running_var)


# ---------------------------------------------------------------- GPU autotuning choices (plain Python)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_autotune_prunes_wasteful_tiles(layout):
    configs = triton_ops._configs(layout, triton_ops.GPU_TILES)
    # T = 4 (common in SNNs): tiles long in T are not worth benchmarking.
    kept = triton_ops._prune(configs, dict(R=4096, C=64, T=4))
    assert kept and all(cf.kwargs["BT"] <= 8 for cf in kept)
    # Every shape keeps at least one config, the least wasteful one among them.
    for r, c, t in ((1, 1, 1), (3, 1000, 2), (100000, 3, 1000)):
        kept = triton_ops._prune(configs, dict(R=r, C=c, T=t))
        least = min(triton_ops._padded_work(cf, r, c, t) for cf in configs)
        assert kept and min(triton_ops._padded_work(cf, r, c, t) for cf in kept) == least


def test_backward_grid_fills_the_target():
    tile = dict(BR=16, BC=1, BT=64)
    assert triton_ops._backward_grid(tile, r=4096, c=8, t=256, target=432) == (8, 54)
    assert triton_ops._backward_grid(tile, r=16, c=8, t=64, target=432) == (8, 1)  # one tile each
    assert triton_ops._backward_grid(tile, r=4096, c=1000, t=256, target=432) == (1000, 1)


# ---------------------------------------------------------------- what the implementation refuses
def test_requirements_name_the_problem(monkeypatch):
    impl = ops.get("triton")
    x = torch.randn(4, 2, 3)
    reasons = impl.not_supported_reasons(x.int(), torch.randn(3, 2), 1, "time_first")
    assert any("dtype" in r and "torch.int32" in r for r in reasons)
    monkeypatch.setattr(triton_ops, "INTERPRETED", False)
    reasons = impl.not_supported_reasons(x, torch.randn(3, 2), 1, "time_first")
    assert any("CUDA" in r and "TRITON_INTERPRET=1" in r for r in reasons)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1.*Methods that can: .*shift_add"):
        ops.charge(x, torch.randn(3, 2), None, 1, "time_first", "triton")


def test_without_triton_nothing_else_breaks():
    """Simulate a machine without triton: backend='triton' explains how to install it."""
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # makes `import triton` raise ImportError
        import torch, spikingjelly_mfpsn
        from spikingjelly.activation_based import neuron
        from spikingjelly_mfpsn import ops
        assert "triton" not in ops.names() and "triton" not in ops.available_backends(), ops.names()
        sn = neuron.MulFreeChannelwisePSN(3, step_mode="m")
        assert sn(torch.randn(5, 2, 3)).shape == (5, 2, 3)
        try:
            neuron.MulFreeChannelwisePSN(3, backend="triton")
        except ImportError as e:
            print(e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    assert "backend='triton'" in out.stdout and "pip install triton" in out.stdout, out.stdout


def test_kernels_compile_for_a_gpu():
    """The interpreter is lenient: also compile every kernel variant to GPU code (no GPU needed)."""
    code = textwrap.dedent("""
        import triton, triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from spikingjelly_mfpsn.ops import triton_ops as T
        def compile(fn, ptr_types, consts):
            sig = {a: "i32" for a in fn.arg_names}
            sig.update(ptr_types, alpha="fp32")
            sig.update({k: "constexpr" for k in consts})
            sig = {a: sig[a] for a in fn.arg_names}
            triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 80, 32))
        for layout, dt, acc in (("time_first", "fp16", tl.float32), ("time_last", "bf16", tl.float32),
                                ("time_first", "fp64", tl.float64)):
            tile = T._configs(layout)[0].kwargs
            p = "*" + dt
            compile(T._charge_fwd_kernel, dict(X=p, W=p, B=p, H=p, S=p),
                    dict(HAS_BIAS=True, STORE_H=True, SPIKE=dt != "fp64", ACC=acc, **tile))
            part = "*fp64" if dt == "fp64" else "*fp32"
            compile(T._charge_bwd_kernel, dict(G=p, H=p, X=p, W=p, GX=p, PW=part, PB=part),
                    dict(SG={"fp16": 1, "bf16": 2, "fp64": 0}[dt], NEED_GX=True, NEED_GW=True,
                         NEED_GB=dt != "fp64", ACC=acc, BK=4, **tile))
        print("compiled")
    """)
    from triton.backends import backends
    if "nvidia" not in backends:
        pytest.skip("this triton build has no CUDA backend to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=ROOT, TRITON_DEFAULT_FP_FUSION="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]
