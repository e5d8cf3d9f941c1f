"""Every registered charge implementation against the plain loop reference: outputs and gradients."""
import itertools

import pytest
import torch

from spikingjelly_mfpsn import MulFreeChannelwisePSN, ops

import reference

FEATURES = {2: (), 3: (3,), 4: (3, 2), 5: (2, 2, 3)}  # per-step rank -> trailing dims after (N, C)


# Triton runs here through its interpreter, which executes every kernel op in numpy (~0.1 s per
# forward + backward): the 576 calls per layout of test_matches_reference would add about a minute of
# CPU per SpikingJelly version. tests/test_triton.py holds it to the same reference on a reduced grid
# that still covers every axis of this one (ranks, every k/d, T = 1 and T shorter than the receptive
# field, float32/float64, non-contiguous), plus float16/bfloat16 and the fused spike.
FULL_GRID_EXCLUDED = {"triton"}


def cases(full_grid=False):
    for name in ops.names():
        if ops.get(name).backend == "cupy":  # CUDA tensors only: held against the reference in test_cupy.py
            continue
        if full_grid and name in FULL_GRID_EXCLUDED:
            continue
        for layout in ops.get(name).layouts:
            yield name, layout


def make_input(t, n, c, feat, layout, dtype, contiguous):
    shape = (t, n, c, *feat) if layout == "time_first" else (n, c, *feat, t)
    if contiguous:
        return torch.randn(shape, dtype=dtype)
    # Same values, reversed memory order: every stride differs from the contiguous one.
    dims = list(range(len(shape)))[::-1]
    return torch.randn(shape[::-1], dtype=dtype).permute(dims)


@pytest.mark.parametrize("name,layout", list(cases(full_grid=True)))
@pytest.mark.parametrize("rank", [2, 3, 4, 5])
@pytest.mark.parametrize("k,dilation", list(itertools.product([1, 2, 3, 5], [1, 2, 3])))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("contiguous", [True, False])
def test_matches_reference(name, layout, rank, k, dilation, dtype, contiguous):
    impl = ops.get(name)
    torch.manual_seed(k * 10 + dilation)
    c = 3
    # T = 1, a T shorter than the receptive field (k-1)*d+1, and a longer one.
    for t in sorted({1, max(1, (k - 1) * dilation), (k - 1) * dilation + 4}):
        x = make_input(t, 2, c, FEATURES[rank], layout, dtype, contiguous).requires_grad_()
        w = torch.randn(c, k, dtype=dtype, requires_grad=True)
        b = torch.randn(c, dtype=dtype, requires_grad=True)
        assert impl.supports(x, w, dilation, layout), impl.not_supported_reasons(x, w, dilation, layout)
        h = ops.charge(x, w, b, dilation, layout, name)
        h_ref = reference.charge(x, w, b, dilation, layout)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
        assert h.shape == x.shape and h.is_contiguous()
        torch.testing.assert_close(h, h_ref, **tol)
        g = torch.randn_like(h_ref)
        grads = torch.autograd.grad(h, (x, w, b), g)
        grads_ref = torch.autograd.grad(h_ref, (x, w, b), g)
        for got, want, what in zip(grads, grads_ref, ("x", "weight", "bias")):
            torch.testing.assert_close(got, want, **tol, msg=lambda m: f"grad {what}: {m}")


@pytest.mark.parametrize("name,layout", list(cases()))
def test_without_bias(name, layout):
    x = make_input(6, 2, 4, (3,), layout, torch.float64, True).requires_grad_()
    w = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    h = ops.charge(x, w, None, 2, layout, name)
    h_ref = reference.charge(x, w, None, 2, layout)
    torch.testing.assert_close(h, h_ref)
    g = torch.randn_like(h)
    for got, want in zip(torch.autograd.grad(h, (x, w), g), torch.autograd.grad(h_ref, (x, w), g)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name,layout", list(cases()))
@pytest.mark.parametrize("empty", ["batch", "features", "steps"])
def test_empty_tensors(name, layout, empty):
    """An empty batch (e.g. a rank's share of a small last batch), empty feature dims or no time steps:
    an empty charge like the reference's, and gradients (the weight's and bias's zero)."""
    n, feat, t = (0, (3,), 4) if empty == "batch" else (2, (0,), 4) if empty == "features" else (2, (3,), 0)
    x = make_input(t, n, 4, feat, layout, torch.float64, True).requires_grad_()
    w = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    h = ops.charge(x, w, b, 2, layout, name)
    assert h.shape == x.shape
    gx, gw, gb = torch.autograd.grad(h, (x, w, b), torch.ones_like(h), allow_unused=True)
    assert gx is None or gx.shape == x.shape
    for g in (gw, gb):
        assert g is None or not g.any()


@pytest.mark.parametrize("name,layout", list(cases()))
def test_double_backward(name, layout):
    """create_graph=True (a gradient penalty): the torch methods give the reference's second-order
    gradients; a kernel backend raises a clear error (its gradients would enter the graph as constants
    and the second-order gradients would silently miss them)."""
    torch.manual_seed(0)
    x = make_input(6, 2, 3, (2,), layout, torch.float64, True).requires_grad_()
    w = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    r = torch.randn_like(x)

    def penalty_grads(charge):
        h = charge(x, w, b, 2, layout)
        gx, = torch.autograd.grad((torch.tanh(h) * r).sum(), x, create_graph=True)
        return torch.autograd.grad((gx ** 2).sum(), (x, w, b))

    if ops.get(name).backend != "torch":
        with pytest.raises(RuntimeError, match="first-order gradients only.*create_graph=True"):
            penalty_grads(lambda *a: ops.charge(*a, name))
        return
    for got, want in zip(penalty_grads(lambda *a: ops.charge(*a, name)), penalty_grads(reference.charge)):
        torch.testing.assert_close(got, want)


def test_every_implementation_describes_itself():
    for impl in ops.implementations():
        assert impl.description and impl.layouts and impl.backend


def test_bad_arguments_name_the_argument():
    x = torch.randn(4, 2, 3)
    w = torch.randn(3, 2)
    with pytest.raises(ValueError, match="channels"):
        ops.charge(x, torch.randn(5, 2), None, 1, "time_first", "conv1d")
    with pytest.raises(ValueError, match="dilation"):
        ops.charge(x, w, None, 0, "time_first", "conv1d")
    with pytest.raises(ValueError, match="layout"):
        ops.charge(x, w, None, 1, "time_middle", "conv1d")
    with pytest.raises(ValueError, match="method"):
        ops.charge(x, w, None, 1, "time_first", "no_such_method")
    with pytest.raises(ValueError, match="at least 3 dims"):
        ops.charge(torch.randn(4, 3), w, None, 1, "time_first", "conv1d")
    with pytest.raises(ValueError, match="bias"):
        ops.charge(x, w, torch.randn(2), 1, "time_first", "conv1d")
    # A method that does not support the layout: the error lists the ones that do.
    with pytest.raises(ValueError, match=r"conv2d.*Methods that can: \[.*shift_add"):
        ops.charge(x, w, None, 1, "time_first", "conv2d")


def test_vmap_mm_refuses_huge_t():
    x = torch.empty(1, 1, 1, 1 << 15, device="meta")
    reasons = ops.get("vmap_mm").not_supported_reasons(x, torch.empty(1, 2), 1, "time_last")
    assert reasons and "T, T" in reasons[0]


def test_a_registered_implementation_of_a_new_backend_is_a_backend_everywhere():
    """ops.register said the implementation's backend becomes available, but a new backend name was
    unknown to backend_available, available_backends and the neuron (refused), while ops.mf_psn ran it."""
    def charge(x, w, b, d, layout):
        return reference.charge(x, w, b, d, layout)
    ops.register(ops.Implementation("mine", "mybackend", ops.LAYOUTS, charge, "the reference",
                                    priority=lambda *a: -1.0))
    try:
        assert ops.backend_available("mybackend") and "mybackend" in ops.available_backends()
        sn = MulFreeChannelwisePSN(4, k=2, step_mode="m", backend="mybackend", threshold="param").double()
        x = torch.randn(6, 2, 4, dtype=torch.float64)
        assert sn.resolve_method(x) == "mine"
        h, _ = reference.mfpsn_charge(x, sn.weight.detach(), 1, "time_first", "param",
                                      v_threshold=sn.v_threshold.detach())
        assert torch.equal(sn(x), (h >= 0).double())
    finally:
        ops.unregister("mine")
    assert not ops.backend_available("mybackend")


def test_bad_backend_and_method_names_are_named_as_such():
    """ops.mf_psn and mf_psn_step blamed the method ("method 'bogus' cannot run here") for a bad backend,
    and ops.get('auto') listed 'auto' among the names it took while refusing it."""
    x, w = torch.randn(6, 2, 4), torch.rand(4, 2)
    for bad in ("bogus", None):
        with pytest.raises(ValueError, match=f"backend must be one of .*, got {bad!r}"):
            ops.mf_psn(x, w, bias=torch.zeros(4), backend=bad)
        with pytest.raises(ValueError, match=f"backend must be one of .*, got {bad!r}"):
            ops.mf_psn_step([x[0], x[1]], w, bias=torch.zeros(4), backend=bad)
    with pytest.raises(ValueError, match="'auto' is not an implementation: ops.choose"):
        ops.get("auto")


def test_the_deprecated_batch_stats_recompute_overflowed_sums_in_float64():
    """ops.batch_stats gave inf where the float64 statistics are in range (n * var beyond float32), and the
    C++ method another mean than the others."""
    torch.manual_seed(0)
    x, w = torch.randn(6, 4, 2) * 1.5e19, torch.ones(2, 2)
    want = reference.batch_stats(reference.charge(x.double(), w.double(), None, 1, "time_first"), 2)
    for method in [n for n in ops.names(layout="time_first") if ops.get(n).backend != "cupy"]:
        with pytest.warns(DeprecationWarning):
            mean, var = ops.batch_stats(x, w, 1, "time_first", method)
        assert torch.equal(mean, want[0].float()) and torch.equal(var, want[1].float()), method


def test_a_backend_that_does_not_run_here_is_refused_with_a_pinned_method_too():
    x, w = torch.randn(6, 2, 4), torch.rand(4, 2)
    if not ops.backend_available("cupy"):
        with pytest.raises(ops.BackendUnavailableError, match="'cupy' cannot run here"):
            ops.mf_psn(x, w, bias=torch.zeros(4), backend="cupy", method="shift_add")
    else:
        pytest.skip("cupy runs here")
