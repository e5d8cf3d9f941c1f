"""Property tests: every method against the float64 reference in tests/reference.py on drawn calls.

Drawn: layout, step mode, order k, dilation, threshold mode, shapes (empty and length-1 dims included),
dtype, and inputs with NaN, inf and extreme finite values. A spike is compared wherever the reference
charge is farther from 0 than the computation's rounding can reach (a bound from the magnitudes of
its terms), beyond float32's range too; charges compare by their NaN/inf pattern and finite values
where float32 does not overflow.

CI runs the "ci" profile (a fixed number of examples, derandomised); HYPOTHESIS_PROFILE=long runs many
more: ``HYPOTHESIS_PROFILE=long python -m pytest tests/test_properties.py``.
"""
import math
import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from spikingjelly.activation_based import functional

from spikingjelly_mfpsn import MulFreeChannelwisePSN, ops

import reference

settings.register_profile("ci", max_examples=40, derandomize=True, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("long", max_examples=2000, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

F32_MAX = torch.finfo(torch.float32).max
SPECIAL = [math.nan, math.inf, -math.inf, 3e38, -3e38, 1e37, -2e37, 1e-40, 0.0, -0.0]


def methods(layout):
    return [n for n in ops.names(layout=layout) if ops.get(n).backend != "cupy"] + ["auto"]


@st.composite
def calls(draw, thresholds=("charge", "param", "bn_eval")):
    layout = draw(st.sampled_from(ops.LAYOUTS))
    step_mode = "m" if layout == "time_last" else draw(st.sampled_from(["m", "s"]))
    k, d = draw(st.integers(1, 9)), draw(st.integers(1, 3))
    threshold = draw(st.sampled_from(thresholds))
    if threshold == "charge":
        step_mode = "m"
    t = draw(st.integers(0 if step_mode == "m" else 1, 10))
    n, c = draw(st.integers(0, 3)), draw(st.integers(1, 4))
    feat = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((t, n, c, *feat), generator=g, dtype=torch.float64)
    specials = draw(st.lists(st.tuples(st.integers(0, 10 ** 6), st.sampled_from(SPECIAL)), max_size=4))
    flat = x.view(-1)
    for where, value in specials:
        if flat.numel():
            flat[where % flat.numel()] = value
    x = x.to(dtype)
    if layout == "time_last":
        x = x.movedim(0, -1).contiguous()
    return dict(layout=layout, step_mode=step_mode, k=k, d=d, threshold=threshold, x=x, c=c, seed=seed)


def make_neuron(call, method):
    torch.manual_seed(call["seed"])
    sn = MulFreeChannelwisePSN(call["c"], k=call["k"], dilation=call["d"], threshold="bn" if call["threshold"].startswith("bn") else "param",
                               step_mode=call["step_mode"], layout=call["layout"], method=method,
                               exp_init=False).to(call["x"].dtype)
    with torch.no_grad():
        if sn.threshold == "bn":
            for p in (sn.running_mean, sn.gamma, sn.beta):
                p.normal_()
            sn.running_var.uniform_(0.25, 4.0)
        else:
            sn.v_threshold.normal_()
    return sn.eval()


def folded(sn):
    """(Wq, b) of the eval-mode neuron, folded in float64 from its parameters (the reference's math)."""
    w = sn.weight.detach().double()
    if sn.threshold == "param":
        return reference.pow2(w), -sn.v_threshold.detach().double()
    scale = sn.gamma.detach().double() / torch.sqrt(sn.running_var.double() + sn.eps)
    return reference.pow2(scale[:, None] * w), sn.beta.detach().double() - sn.running_mean.double() * scale


def spikes(sn, x):
    with torch.no_grad():
        if sn.step_mode == "m":
            return sn(x)
        out = torch.stack([sn(xt) for xt in x]) if len(x) else x.clone()
        functional.reset_net(sn)
        return out


def check_spikes(call):
    x, layout = call["x"], call["layout"]
    sn0 = make_neuron(call, "auto")
    wq, b = folded(sn0)
    xd = x.double()
    h = reference.charge(xd, wq, b, call["d"], layout)
    terms = reference.charge(torch.nan_to_num(xd.abs(), posinf=0.0), wq.abs(), b.abs(), call["d"], layout)
    eps = torch.finfo(x.dtype).eps
    clear = (h.abs() > 4 * call["k"] * eps * terms) | torch.isnan(h)  # (beyond float32's range too)
    want = (h >= 0).to(x.dtype)
    for method in methods(layout):
        got = spikes(make_neuron(call, method), x)
        assert got.shape == x.shape and got.dtype == x.dtype, method
        bad = (got != want) & clear
        assert not bad.any(), f"{method}: {int(bad.sum())} spikes differ from the reference"


def check_charge(call):
    x, layout, k = call["x"], call["layout"], call["k"]
    g = torch.Generator().manual_seed(call["seed"])
    w = torch.randn(call["c"], k, generator=g, dtype=torch.float64).to(x.dtype)
    b = torch.randn(call["c"], generator=g, dtype=torch.float64).to(x.dtype)
    want = reference.charge(x.double(), w.double(), b.double(), call["d"], layout)
    scale = reference.charge(torch.nan_to_num(x.double().abs(), posinf=0.0), w.double().abs(), b.double().abs(),
                             call["d"], layout)
    eps = torch.finfo(x.dtype).eps
    in_range = want.abs() <= F32_MAX * 0.5  # (where float32 does not overflow along the way)
    for method in methods(layout)[:-1]:
        got = ops.charge(x, w, b, call["d"], layout, method).double()
        assert got.shape == x.shape, method
        assert torch.equal(torch.isnan(got) & in_range, torch.isnan(want) & in_range), f"{method}: NaN pattern"
        fin = torch.isfinite(want) & in_range
        err = (got[fin] - want[fin]).abs()
        assert (err <= 4 * k * eps * scale[fin] + 1e-300).all(), f"{method}: max error {err.max()}"


@given(calls())
def test_every_method_matches_the_reference(call):
    if call["threshold"] == "charge":
        check_charge(call)
    else:
        check_spikes(call)


@given(calls(thresholds=("param",)))
def test_every_method_gives_the_references_input_gradient(call):
    """dL/dX of the parameter threshold (ATan surrogate): equal where the reference's is finite, NaN
    where it is NaN."""
    if call["step_mode"] == "s" or not call["x"].numel():
        return
    x, layout = call["x"], call["layout"]
    sn0 = make_neuron(call, "auto").train()
    wq, b = folded(sn0)
    xr = x.double().clone().requires_grad_()
    h = reference.charge(xr, wq, b, call["d"], layout)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(call["seed"]), dtype=torch.float64)
    (want,) = torch.autograd.grad((reference.atan_primitive(h) * g).sum(), xr)
    tol = 1e-3 if x.dtype == torch.float32 else 1e-9
    for method in methods(layout):
        sn = make_neuron(call, method).train()
        xm = x.clone().requires_grad_()
        (got,) = torch.autograd.grad((sn(xm) * g.to(x.dtype)).sum(), xm)
        got = got.double()
        fin = torch.isfinite(want) & (h.detach().abs() <= F32_MAX)
        assert torch.equal(torch.isnan(got)[fin], torch.isnan(want)[fin]), method
        torch.testing.assert_close(got[fin], want[fin], rtol=tol, atol=tol, msg=lambda m: f"{method}: {m}")
