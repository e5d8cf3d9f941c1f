"""The Triton kernels against the plain loop reference, run through Triton's interpreter on the CPU.

conftest.py sets TRITON_INTERPRET=1 before anything imports triton (with TRITON_INTERPRET=0 on a
machine with a GPU the same tests run the compiled kernels on CUDA tensors).
"""
import contextlib
import copy
import dataclasses
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
from spikingjelly_mfpsn.ops import tiles

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

pytestmark = pytest.mark.cuda  # (with TRITON_INTERPRET=0 on a GPU machine these run the compiled kernels)
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


def test_strided_views_run():
    """Time-first data stored time-last, and a slice along T (that nothing is copied: the memory passes)."""
    base = rand(2, 3, 4, 5, 9)  # (N, C, H, W, T) contiguous
    x_tf = base.permute(4, 0, 1, 2, 3)  # time-first view, T is the contiguous axis
    x_tl = base[..., ::2]  # time-last view with T stride 2
    for x, layout in ((x_tf, "time_first"), (x_tl, "time_last")):
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
    s = ops.mf_psn(x, w, bias=b, dilation=2, layout=layout, method="triton", surrogate_function=sg, quantize=None)
    assert bool(ops.surrogate.fused(sg)[0]) == fused  # (fused into the kernel, or the surrogate applied to H)
    args = [t.detach().double().requires_grad_() for t in (x, w, b)]
    h_ref = reference.charge(*args, 2, layout)
    s_ref = sg(h_ref)
    tol = TOL[dtype] if dtype in TOL else HALF_TOL[dtype]
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
        s = ops.mf_psn(x, w, bias=b, method="triton", quantize=None)
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
def covered(tile, r, c, t):
    """Elements an (R, C, T) problem's tiles cover, padding included, counted tile by tile."""
    return len(range(0, r, tile[0])) * tile[0] * len(range(0, c, tile[1])) * tile[1] * len(range(0, t, tile[2])) * tile[2]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_autotune_prunes_wasteful_tiles(layout):
    every = tiles.GPU_TILES[layout]
    # T = 4 (common in SNNs): tiles long in T are not worth benchmarking.
    kept = tiles.worth_trying(every, 4096, 64, 4)
    assert kept and all(bt <= 8 for _, _, bt in kept)
    # Every shape keeps the least wasteful tile, and only tiles within 2x of it.
    for r, c, t in ((1, 1, 1), (3, 1000, 2), (100000, 3, 1000), (4096, 64, 4)):
        kept = tiles.worth_trying(every, r, c, t)
        least = min(covered(tile, r, c, t) for tile in every)
        assert kept and min(covered(tile, r, c, t) for tile in kept) == least
        assert all(covered(tile, r, c, t) <= 2 * least for tile in kept)
        assert all(tile in kept for tile in every if covered(tile, r, c, t) <= 2 * least)


def test_reduction_grid_fills_the_target():
    tile = (16, 1, 64)
    assert tiles.reduction_grid(tile, r=4096, c=8, t=256, target=432) == (8, 54)
    assert tiles.reduction_grid(tile, r=16, c=8, t=64, target=432) == (8, 1)  # one tile each
    assert tiles.reduction_grid(tile, r=4096, c=1000, t=256, target=432) == (1000, 1)


@pytest.mark.parametrize("per_channel", [2, 3, 5, 8, 10, 20, 40, 45, 64, 5000])
def test_fold_blocks_are_powers_of_two_within_the_budget(per_channel):
    """The per-channel kernels' blocks are tl.arange sizes (powers of two) at any count of values per
    channel (e.g. K5's 5 rows of k taps with a fused input batch norm), covering the splits they can."""
    for c, n_split in ((1, 1), (6, 3), (128, 432), (1000, 7), (64, 2048)):
        bc, bs = tiles.fold_blocks(c, n_split, per_channel)
        assert all(b >= 1 and b & (b - 1) == 0 for b in (bc, bs)), (c, n_split, bc, bs)
        assert bc <= max(c, 1) * 2 and bs <= max(n_split, 1) * 2
        assert bc * bs * per_channel <= max(2048, per_channel) and bc <= 64


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
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 0, out.stderr
    assert "backend='triton'" in out.stdout and "pip install triton" in out.stdout, out.stdout


def test_kernels_compile_for_a_gpu():
    """The interpreter is lenient: also compile every kernel to GPU code (no GPU needed), for sm_80 and
    sm_90 in turn, each in a variant of its flags."""
    code = textwrap.dedent("""
        import triton, triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from spikingjelly_mfpsn.ops import tiles, triton_ops as T
        FLOATS = ("c1_hi", "c1_lo", "c2_hi", "c2_lo", "eps_hi", "eps_lo", "eps0_hi", "eps0_lo", "f_hi", "f_lo")
        def compile(fn, ptr_types, consts, arch):
            sig = {a: "i32" for a in fn.arg_names}
            sig.update(ptr_types, **{a: "fp32" for a in FLOATS if a in sig})
            sig.update({k: "constexpr" for k in consts})
            sig = {a: sig[a] for a in fn.arg_names}
            triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", arch, 32))
        blocks = lambda per_channel: dict(zip(("BC", "BS"), tiles.fold_blocks(128, 432, per_channel)))
        for layout, dt, acc, arch, k, stats in (("time_first", "fp16", tl.float32, 80, 1, True),
                                                ("time_last", "bf16", tl.float32, 90, 3, False),
                                                ("time_first", "fp64", tl.float64, 90, 2, True)):
            tile = T._configs(layout)[0].kwargs
            p = "*" + dt
            w = "*fp64" if dt == "fp64" else "*fp32"
            part = "*fp64" if dt == "fp64" else "*fp32"
            in_bn = stats  # (with the input batch norm of a fused pair where there are batch statistics)
            compile(T._charge_fwd_kernel, dict(X=p, W=p, B=p, H=p, S=p, P0=w),
                    dict(HAS_BIAS=True, STORE_H=True, SPIKE=True, IN_BN=in_bn, ACC=acc, **tile), arch)
            compile(T._charge_bwd_kernel, dict(G=p, B=p, X=p, W=p, GX=p, PW=part, PB=part),
                    dict(SG={"fp16": 1, "bf16": 2, "fp64": 0}[dt], HAS_BIAS=True, NEED_GX=True,
                         NEED_GW=True, NEED_GB=True, ACC=acc, BK=4, **tile), arch)
            compile(T._bn_moments_kernel, dict(X=p, W=w, P0=w, PART=part), dict(K=k, IN_BN=in_bn, ACC=acc, **tile),
                    arch)
            for pre in (False, True):
                compile(T._bn_fold_kernel, dict(PART=part, X=p, W=w, P0=w, GAMMA=w, BETA=w, RM=w, RV=w, MEAN=w,
                                                VAR=w, WQ=w, B=w, OK="*i8"),
                        dict(K=1 if pre else k, GIVEN=not stats, RUNNING=stats, QUANT=not pre, IN_BN=in_bn and not pre,
                             PRE=pre, ACC=acc, F64=dt == "fp64", **blocks(2)), arch)
            compile(T._bn_grad_moments_kernel, dict(G=p, X=p, W=w, WQ=w, B=w, MEAN=w, P0=w, PART=part),
                    dict(K=k, BK=tiles.pow2_ceil(k), SG=2 if dt == "bf16" else 1, STATS=stats, IN_BN=in_bn,
                         ROWS=4 + in_bn, ACC=acc, **tile), arch)
            compile(T._bn_grad_fold_kernel, dict(PART=part, W=w, GAMMA=w, MEAN=w, VAR=w, WQ=w, P0=w, GW=w, GGAMMA=w,
                                                 GBETA=w, COEF=part, GPRE=w),
                    dict(K=k, BK=tiles.pow2_ceil(k), ROUND=stats, STATS=stats, IN_BN=in_bn, STATS0=in_bn,
                         ROWS=4 + in_bn, F64=dt == "fp64", **blocks((4 + in_bn) * tiles.pow2_ceil(k))), arch)
            compile(T._bn_grad_x_kernel, dict(G=p, X=p, W=w, WQ=w, B=w, MEAN=w, COEF=part, P0=w, GPRE=w, GX=p),
                    dict(K=k, SG=1, STATS=stats, IN_BN=in_bn, ACC=acc, **tile), arch)
        print("compiled")
    """)
    from triton.backends import backends
    if "nvidia" not in backends:
        pytest.skip("this triton build has no CUDA backend to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), TRITON_DEFAULT_FP_FUSION="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]


# ---------------------------------------------------------------- the fused BN-threshold training step
def bn_neuron(layout, k, dilation, dtype, ste="whole", sg=None, channels=6, **kwargs):
    """A BN-threshold neuron on 'triton' with random weights, gamma and beta."""
    sn = neuron.MulFreeChannelwisePSN(channels, k=k, dilation=dilation, step_mode="m", layout=layout,
                                      quantize=ste is not None, ste=ste or "whole", exp_init=False, method="triton",
                                      surrogate_function=sg or surrogate.ATan(), **kwargs).to(DEVICE, dtype)
    with torch.no_grad():
        sn.gamma.uniform_(0.5, 1.5)
        sn.beta.uniform_(-1.0, 0.5)
    return sn


FUSED_ONLY = "triton_fused_only"


@pytest.fixture(autouse=True)
def unregister_fused_only():
    yield
    ops.unregister(FUSED_ONLY)


def no_general_path(sn):
    """Run ``sn`` on 'triton' registered once more with its general path's entries (the charge, its
    spikes and its statistics) failing, as 'triton_fused_only': only a fused step can run."""
    def refuse(*args, **kwargs):
        raise AssertionError("the general path ran")
    ops.register(dataclasses.replace(ops.get("triton"), name=FUSED_ONLY, charge=refuse, fire=refuse, stats=refuse,
                                     autoselect=False))
    sn.method = FUSED_ONLY


def bn_step_against_reference(sn, x, ste, sg, tol, margin):
    """One training step of ``sn`` against the plain reference in float64: spikes where the reference's
    |H| > margin, dL/dX and the gradients of weight, gamma and beta, and the running statistics."""
    leaves = [t.detach().double().requires_grad_() for t in (x, sn.weight, sn.gamma, sn.beta)]
    running = (sn.running_mean.double().clone(), sn.running_var.double().clone())
    h, (mean, var) = reference.mfpsn_charge(leaves[0], leaves[1], sn.dilation, sn.layout, "bn",
                                            quantize=ste is not None, gamma=leaves[2], beta=leaves[3],
                                            eps=sn.eps, ste=ste or "whole")
    s_ref = sg(h)
    xt = x.detach().clone().requires_grad_()
    s = sn(xt)
    assert s.shape == x.shape and s.dtype == x.dtype
    clear = h.detach().abs() > margin
    assert torch.equal(s.double()[clear], s_ref.detach()[clear])
    g = torch.randn(s.shape, dtype=torch.float64, device=DEVICE)
    (s * g.to(s.dtype)).sum().backward()
    (s_ref * g).sum().backward()
    for got, want, what in zip((xt.grad, sn.weight.grad, sn.gamma.grad, sn.beta.grad), [t.grad for t in leaves],
                               ("x", "weight", "gamma", "beta")):
        torch.testing.assert_close(got.double(), want, **tol, msg=lambda m: f"grad {what}: {m}")
    n = x.numel() // sn.channels
    want_mean = 0.9 * running[0] + 0.1 * mean.detach()
    want_var = 0.9 * running[1] + 0.1 * var.detach() * n / (n - 1)
    torch.testing.assert_close(sn.running_mean.double(), want_mean, **tol)
    torch.testing.assert_close(sn.running_var.double(), want_var, **tol)
    sn.zero_grad()


def bn_shape(layout, t=19, n=3, c=6, m=13):
    # Several tiles along rows (n * m = 39), channels and time, and several splits per channel block.
    return (t, n, c, m) if layout == "time_first" else (n, c, m, t)


F32_BN_TOL = dict(rtol=2e-4, atol=2e-4)  # order 1: a weight gradient that is the small difference of two
# large terms (the folding's and the statistics'), see tests/test_cpp.py


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("k,dilation", [(1, 1), (2, 1), (3, 2), (5, 3)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_bn_step_matches_reference(layout, k, dilation, dtype):
    """BN-threshold training on 'triton' runs the fused step (batch statistics, folding, quantiser and
    spikes in three kernels; three backward) and equals the plain reference: spikes, every gradient and
    the running statistics, over two steps."""
    torch.manual_seed(k * 10 + dilation)
    sn = bn_neuron(layout, k, dilation, dtype)
    no_general_path(sn)
    tol = TOL[torch.float64] if dtype == torch.float64 else F32_BN_TOL
    for _ in range(2):
        x = torch.randn(bn_shape(layout), dtype=dtype, device=DEVICE) * 2
        bn_step_against_reference(sn, x, "whole", sn.surrogate_function, tol, 1e-4)
    assert int(sn.num_batches_tracked) == 2


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("ste", ["round", None])
@pytest.mark.parametrize("sg", [surrogate.ATan(alpha=3.5), surrogate.Sigmoid(alpha=1.5)], ids=repr)
def test_fused_bn_step_quantiser_and_surrogates(layout, ste, sg):
    torch.manual_seed(2)
    sn = bn_neuron(layout, 3, 2, torch.float64, ste=ste, sg=sg)
    no_general_path(sn)
    x = torch.randn(bn_shape(layout, t=9, m=5), dtype=torch.float64, device=DEVICE) * 2
    bn_step_against_reference(sn, x, ste, sg, TOL[torch.float64], 1e-8)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("no_grad", [False, True])
def test_fused_bn_eval_and_no_grad(layout, no_grad):
    """Eval folds the running statistics (constants: gradients through the folding only); training
    under torch.no_grad() still updates the running statistics."""
    torch.manual_seed(4)
    sn = bn_neuron(layout, 2, 2, torch.float64)
    with torch.no_grad():
        sn.running_mean.uniform_(-1, 1)
        sn.running_var.uniform_(0.5, 2)
    no_general_path(sn)
    x = torch.randn(bn_shape(layout, t=9, m=5), dtype=torch.float64, device=DEVICE).requires_grad_(not no_grad)
    xr, w, gamma, beta = [t.detach().double().requires_grad_() for t in (x, sn.weight, sn.gamma, sn.beta)]
    stats = (sn.running_mean.clone(), sn.running_var.clone())
    h, _ = reference.mfpsn_charge(xr, w, 2, layout, "bn", gamma=gamma, beta=beta, stats=stats)
    sn.eval()
    with torch.no_grad() if no_grad else contextlib.nullcontext():
        s = sn(x)
    assert torch.equal(s, (h >= 0).double())
    if not no_grad:
        g = torch.randn_like(s)
        (s * g).sum().backward()
        (surrogate.ATan()(h) * g).sum().backward()
        for got, want in zip((x.grad, sn.weight.grad, sn.gamma.grad, sn.beta.grad), (xr, w, gamma, beta)):
            torch.testing.assert_close(got, want.grad)
    assert torch.equal(sn.running_mean, stats[0]) and torch.equal(sn.running_var, stats[1])
    sn.train()
    with torch.no_grad():
        sn(x)
    n = x.numel() // sn.channels
    _, (mean, var) = reference.mfpsn_charge(xr, w, 2, layout, "bn", gamma=gamma, beta=beta)
    torch.testing.assert_close(sn.running_mean, 0.9 * stats[0] + 0.1 * mean)
    torch.testing.assert_close(sn.running_var, 0.9 * stats[1] + 0.1 * var * n / (n - 1))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("eps", [1e-5, 1e-12])
def test_fused_bn_constant_channel(layout, eps):
    """A charge that is the same at every sample and step (|mean| >> std): its variance is 0 to within
    rounding, not the cancellation of E[H^2] - E[H]^2, so that even a tiny eps gives the reference's
    spikes. (X = 1000.3 everywhere, k = 1: the variance of the charge is exactly 0.)"""
    sn = bn_neuron(layout, 1, 1, torch.float32, eps=eps)
    x = torch.full(bn_shape(layout), 1000.3, device=DEVICE)
    s = sn(x)
    assert float(sn.running_var.max()) <= 0.9 + 1e-6  # 0.9 * 1 + 0.1 * (a variance of about 0)
    xr = x.double()
    w, gamma, beta = (t.detach().double() for t in (sn.weight, sn.gamma, sn.beta))
    h, (mean, var) = reference.mfpsn_charge(xr, w, 1, layout, "bn", gamma=gamma, beta=beta, eps=eps,
                                            stats=(w[:, 0] * xr.flatten()[0], torch.zeros(6, dtype=torch.float64, device=DEVICE)))
    assert torch.equal(s.double(), (h >= 0).double())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("autocast", [False, True])
def test_fused_bn_input_dtypes(layout, autocast):
    """float16 and bfloat16 inputs to a float32 neuron, also under autocast: the fused step runs, reading
    them as they are, and gives spikes in the input's dtype, computed in float32."""
    torch.manual_seed(6)
    for dtype in (torch.float16, torch.bfloat16):
        sn = bn_neuron(layout, 2, 1, torch.float32)
        ref = copy.deepcopy(sn)
        no_general_path(sn)
        x = torch.randn(bn_shape(layout, t=9, m=5), device=DEVICE).to(dtype)
        with torch.autocast(DEVICE, dtype=dtype) if autocast else contextlib.nullcontext():
            s = sn(x)
        assert s.dtype == dtype
        ref.method = "shift_add"
        h, _ = reference.mfpsn_charge(x.double(), ref.weight.detach().double(), 1, layout, "bn",
                                      gamma=ref.gamma.detach().double(), beta=ref.beta.detach().double())
        clear = h.abs() > 1e-3
        assert torch.equal(s.double()[clear], (h >= 0).double()[clear])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_strided_bias_and_fp64_fire(layout):
    """A bias that is a strided view is read through its stride (it was read as if contiguous), and the
    fused spike runs in float64 too."""
    torch.manual_seed(8)
    x = make_input(7, 2, 3, (2,), layout, torch.float64, True).to(DEVICE)
    bias = rand(3, 2)[:, 1]  # stride 2
    check_charge(x, rand(3, 2), bias, 1, layout, TOL[torch.float64])
    assert not bias.is_contiguous()
    xr, w, b = [t.detach().clone().requires_grad_() for t in (x, rand(3, 2), bias)]
    s = ops.mf_psn(xr, w, bias=b, layout=layout, method="triton", quantize=None)
    h_ref = reference.charge(*[t.detach().requires_grad_() for t in (x, w, b)], 1, layout)
    assert torch.equal(s, (h_ref >= 0).double())
    check_fire(surrogate.Sigmoid(alpha=1.5), layout, dtype=torch.float64)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("ste", ["whole", "round", None])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_param_step_matches_reference(layout, ste, dtype):
    """Parameter-threshold training on 'triton' runs fused (quantiser and threshold in one kernel, spikes
    in another; two backward) and equals the plain reference: spikes and the gradients of x, weight and
    v_threshold."""
    torch.manual_seed(12)
    sn = neuron.MulFreeChannelwisePSN(6, k=3, dilation=2, step_mode="m", layout=layout, threshold="param",
                                      quantize=ste is not None, ste=ste or "whole", exp_init=False,
                                      method="triton").to(DEVICE, dtype)
    with torch.no_grad():
        sn.v_threshold.uniform_(-0.5, 1.0)
    no_general_path(sn)
    x = torch.randn(bn_shape(layout, t=9, m=5), dtype=dtype, device=DEVICE) * 2
    leaves = [t.detach().double().requires_grad_() for t in (x, sn.weight, sn.v_threshold)]
    h, _ = reference.mfpsn_charge(leaves[0], leaves[1], 2, layout, "param", quantize=ste is not None,
                                  v_threshold=leaves[2], ste=ste or "whole")
    xt = x.clone().requires_grad_()
    s = sn(xt)
    clear = h.detach().abs() > 1e-4
    assert torch.equal(s.double()[clear], (h.detach() >= 0).double()[clear])
    g = torch.randn(s.shape, dtype=torch.float64, device=DEVICE)
    (s * g.to(dtype)).sum().backward()
    (surrogate.ATan()(h) * g).sum().backward()
    tol = TOL[dtype]
    for got, want, what in zip((xt.grad, sn.weight.grad, sn.v_threshold.grad), leaves, ("x", "weight", "v_th")):
        torch.testing.assert_close(got.double(), want.grad, **tol, msg=lambda m: f"grad {what}: {m}")


@pytest.mark.skipif(not triton_ops.INTERPRETED, reason="counted on the CPU, through Triton's interpreter")
@pytest.mark.parametrize("threshold,passes,launches", [("param", (2.0, 3.0), 8), ("bn", (3.0, 5.0), 12)])
def test_training_step_at_the_memory_floor(threshold, passes, launches):
    """A training step's traffic and launches as benchmarks/memory_passes.py counts them (every Triton
    launch by what its kernel declares; an undeclared kernel is an error; PyTorch operators as they
    run): the parameter threshold reads X and writes S forward, reads X and dL/dS and writes dL/dX
    backward (5 passes, the floor); the BN threshold adds the statistics' read of X forward (8, the
    floor); and a handful of launches per layer (PyTorch operators that run a kernel, and kernels)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import memory_passes
    finally:
        sys.path.pop(0)
    cases = (("time_first", (8, 4, 16, 64), 2), ("time_last", (4, 16, 64, 8), 3))
    for (layout, shape, k), strided in itertools.product(cases, (False, True)):  # strided: read in place
        fwd, bwd, fwd_launches, bwd_launches = memory_passes.step_passes("triton", layout, threshold, shape, k=k,
                                                                         strided=strided)
        # parameter-sized tensors add a few hundredths of a pass
        assert fwd == pytest.approx(passes[0], abs=0.1) and bwd == pytest.approx(passes[1], abs=0.1)
        assert fwd_launches + bwd_launches <= launches


# ---------------------------------------------------------------- a batch norm in front, fused
@pytest.mark.skipif(not triton_ops.INTERPRETED, reason="counted on the CPU, through Triton's interpreter")
def test_a_fused_input_batch_norm_costs_one_more_read_of_x():
    """functional.fuse_batchnorm on 'triton': the batch norm in front of the neuron costs its statistics'
    read of X (forward 4 passes, backward 5 as without it), where the batch norm as a layer writes and
    reads the normalised copy and reads X and its gradient again (13 passes as counted)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import memory_passes
    finally:
        sys.path.pop(0)
    for layout, shape, k in (("time_first", (8, 4, 16, 64), 2), ("time_last", (4, 16, 64, 8), 3)):
        fwd, bwd, fwd_launches, bwd_launches = memory_passes.step_passes("triton", layout, "bn", shape, k=k,
                                                                         input_bn="fused")
        assert fwd == pytest.approx(4.0, abs=0.1) and bwd == pytest.approx(5.0, abs=0.1)
        apart = memory_passes.step_passes("triton", layout, "bn", shape, k=k, input_bn="layer")
        assert apart[0] + apart[1] >= fwd + bwd + 3.9
        assert fwd_launches + bwd_launches <= 16  # (2 of them the CPU's copies to restore a refused step)


def input_bn_step(x, w, bn, input_bn, method, layout):
    """Spikes and the gradients of x, w, gamma, beta, gamma0, beta0 of one ``ops.mf_psn`` training step."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, bn.gamma, bn.beta, input_bn.gamma, input_bn.beta)]
    s = ops.mf_psn(leaves[0], leaves[1], bn=bn._replace(gamma=leaves[2], beta=leaves[3]),
                   input_bn=input_bn._replace(gamma=leaves[4], beta=leaves[5]), dilation=2, layout=layout,
                   method=method, training=True)
    g = torch.linspace(-1, 1, s.numel(), dtype=torch.float64, device=s.device).view(s.shape)
    return s, torch.autograd.grad((s.double() * g).sum(), leaves)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_input_batch_norm_in_low_precision(layout, dtype):
    """float32 parameters, X in float32 or bfloat16 (read as it is): the spikes where the float64 general
    path's charge is clear of 0, and the gradients within the precision of X."""
    torch.manual_seed(8)
    x = make_input(9, 3, 4, (5,), layout, torch.float32, False).mul(2).add(1).to(DEVICE, dtype)
    w = torch.rand(4, 3, device=DEVICE) + 0.1
    vectors = [torch.rand(4, device=DEVICE) + 0.5, torch.rand(4, device=DEVICE) - 0.5, torch.zeros(4, device=DEVICE),
               torch.ones(4, device=DEVICE)]
    bn, input_bn = ops.BatchNorm(*vectors), ops.BatchNorm(*(v.clone() for v in vectors))
    s, grads = input_bn_step(x, w, bn, input_bn, "triton", layout)
    d = [t.double() for t in (w, *bn[:4], *input_bn[:4])]
    bn64, in64 = ops.BatchNorm(*d[1:5]), ops.BatchNorm(*d[5:9])
    s64, grads64 = input_bn_step(x.double(), d[0], bn64, in64, "shift_add", layout)
    assert s.dtype == dtype
    y = torch.nn.functional.batch_norm(x.double().movedim(ops.channel_dim(layout), 1), None, None, d[5], d[6], True)
    h = reference.mfpsn_charge(y.movedim(1, ops.channel_dim(layout)), d[0], 2, layout, "bn", gamma=d[1], beta=d[2])[0]
    clear = h.abs() > 1e-3
    assert torch.equal(s.double()[clear], s64[clear])
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-3, atol=1e-3)
    for got, want, what in zip(grads, grads64, ("x", "weight", "gamma", "beta", "gamma0", "beta0")):
        assert got.dtype == (dtype if what == "x" else torch.float32), what
        torch.testing.assert_close(got.double(), want, **tol, msg=lambda m: f"grad {what}: {m}")


@pytest.mark.skipif(DEVICE == "cuda", reason="on CUDA a non-finite folding is an asynchronous device assert, "
                    "which ends the process's CUDA context (no host synchronisation in the step)")
def test_a_refused_fused_step_leaves_the_error_to_the_general_path():
    """NaN in the input batch norm's gamma: 'triton' gives the general path's error, with both batch norms'
    running statistics as that path leaves them."""
    x, w = torch.randn(6, 2, 3, 4, dtype=torch.float64), torch.rand(3, 2, dtype=torch.float64)
    outcomes = []
    for method in ("triton", "shift_add"):
        stats = [torch.full((3,), float(i % 2), dtype=torch.float64) for i in range(4)]  # means 0, variances 1
        bn = ops.BatchNorm(torch.ones(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64), *stats[:2])
        gamma0 = torch.tensor([1.0, float("nan"), 1.0], dtype=torch.float64)
        input_bn = ops.BatchNorm(gamma0, torch.zeros(3, dtype=torch.float64), *stats[2:])
        with pytest.raises(ValueError) as err:
            ops.mf_psn(x, w, bn=bn, input_bn=input_bn, method=method, training=True)
        outcomes.append((str(err.value), torch.stack(stats)))
    assert outcomes[0][0] == outcomes[1][0]
    torch.testing.assert_close(outcomes[0][1], outcomes[1][1], equal_nan=True)
