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


# ---------------------------------------------------------------- training steps
SURROGATES = [("ATan", 2.0), ("ATan", 0.7), ("Sigmoid", 4.0), ("PiecewiseQuadratic", 1.0)]  # (the last unfused)


@st.composite
def training_calls(draw):
    """A float64 training step: threshold, an input batch norm or none, quantiser, surrogate, momentum,
    strides of X and of the parameters; at least two values per channel (batch statistics)."""
    t, n = draw(st.integers(1, 8)), draw(st.integers(1, 3))
    feat = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    return dict(layout=draw(st.sampled_from(ops.LAYOUTS)), k=draw(st.integers(1, 5)), d=draw(st.integers(1, 3)),
                t=t, n=n if t * n * math.prod(feat) > 1 else 2, c=draw(st.integers(1, 4)), feat=feat,
                threshold=draw(st.sampled_from(["bn", "param"])),
                input_bn=draw(st.sampled_from([None, "affine", "plain"])),
                quantize=draw(st.sampled_from(["whole", "round", None])), sg=draw(st.sampled_from(SURROGATES)),
                momentum=draw(st.sampled_from([0.1, None])), offset=draw(st.sampled_from([0.0, 3.0, -50.0])),
                reversed_x=draw(st.booleans()), strided=draw(st.booleans()), seed=draw(st.integers(0, 2 ** 31 - 1)))


def training_tensors(call):
    """X (the layout's shape), the output gradient, and every parameter and statistic, float64."""
    g = torch.Generator().manual_seed(call["seed"])
    c, shape = call["c"], (call["t"], call["n"], call["c"], *call["feat"])
    if call["layout"] == "time_last":
        shape = shape[1:] + shape[:1]

    def draw(*size, lo=None):
        v = torch.rand(size, generator=g, dtype=torch.float64) if lo is not None else \
            torch.randn(size, generator=g, dtype=torch.float64)
        return v + lo if lo is not None else v
    order = shape[::-1] if call["reversed_x"] else shape
    x = draw(*order).permute(*range(len(shape))[::-1]) if call["reversed_x"] else draw(*shape)
    weight = draw(c, call["k"], lo=0.1) * torch.where(draw(c, call["k"]) < -0.5, -1.0, 1.0).double()
    return dict(x=x * 2 + call["offset"], grad=draw(*shape), weight=weight, gamma=draw(c, lo=0.5),
                beta=draw(c, lo=-0.5), gamma0=draw(c, lo=0.5), beta0=draw(c, lo=-0.5), rm=draw(c) * 0.1,
                rv=draw(c, lo=0.5), rm0=draw(c) * 0.1, rv0=draw(c, lo=0.5))


def reference_step(call, ts):
    """Spikes, the charge, the gradients (by name) and the running statistics the reference gives."""
    from spikingjelly.activation_based import surrogate
    cd = ops.channel_dim(call["layout"])
    leaves = {k: ts[k].clone().requires_grad_() for k in ("x", "weight", "gamma", "beta", "gamma0", "beta0")}
    y = leaves["x"]
    momentum = call["momentum"] if call["momentum"] is not None else 1 / 3  # (the third batch)
    stats = {k: ts[k].clone() for k in ("rm", "rv", "rm0", "rv0")}
    if call["input_bn"]:
        dims, shape = [d for d in range(y.dim()) if d != cd], [-1 if d == cd else 1 for d in range(y.dim())]
        mean = y.mean(dims, keepdim=True)
        y = (y - mean) / torch.sqrt(((y - mean) ** 2).mean(dims, keepdim=True) + 1e-5)
        if call["input_bn"] == "affine":
            y = y * leaves["gamma0"].view(shape) + leaves["beta0"].view(shape)
        torch.nn.functional.batch_norm(ts["x"].movedim(cd, 1).contiguous(), stats["rm0"], stats["rv0"], None, None,
                                       True, momentum)
    h, _ = reference.mfpsn_charge(y, leaves["weight"], call["d"], call["layout"], call["threshold"],
                                  call["quantize"] is not None, leaves["gamma"], leaves["beta"],
                                  v_threshold=leaves["beta"], ste=call["quantize"] or "whole")
    if call["threshold"] == "bn":
        charge = reference.charge(y.detach(), ts["weight"], None, call["d"], call["layout"])
        torch.nn.functional.batch_norm(charge.movedim(cd, 1).contiguous(), stats["rm"], stats["rv"], None, None,
                                       True, momentum)
    s = getattr(surrogate, call["sg"][0])(alpha=call["sg"][1])(h)
    names = [k for k in leaves if (k != "gamma" or call["threshold"] == "bn")
             and (not k.endswith("0") or call["input_bn"] == "affine")]
    grads = torch.autograd.grad((s * ts["grad"]).sum(), [leaves[k] for k in names])
    return s.detach(), h.detach(), dict(zip(names, grads)), stats


def method_step(call, ts, method):
    """The same step through ops.mf_psn: spikes, gradients by name, running statistics."""
    from spikingjelly.activation_based import surrogate

    def view(t):  # the same values, strided (every other element of a longer tensor) where drawn
        return torch.stack([t, torch.zeros_like(t)], -1)[..., 0] if call["strided"] else t
    leaves = {k: ts[k].clone().requires_grad_() for k in ("x", "weight", "gamma", "beta", "gamma0", "beta0")}
    stats = {k: view(ts[k].clone()).detach() for k in ("rm", "rv", "rm0", "rv0")}
    affine = call["input_bn"] == "affine"
    input_bn = ops.BatchNorm(view(leaves["gamma0"]) if affine else None, view(leaves["beta0"]) if affine else None,
                             stats["rm0"], stats["rv0"], 1e-5, call["momentum"], torch.tensor(2)) \
        if call["input_bn"] else None
    bn = ops.BatchNorm(view(leaves["gamma"]), view(leaves["beta"]), stats["rm"], stats["rv"], 1e-5, call["momentum"],
                       torch.tensor(2))
    threshold = {"bn": bn} if call["threshold"] == "bn" else {"v_threshold": view(leaves["beta"])}
    s = ops.mf_psn(leaves["x"], view(leaves["weight"]), input_bn=input_bn, dilation=call["d"], layout=call["layout"],
                   method=method, training=True, quantize=call["quantize"],
                   surrogate_function=getattr(surrogate, call["sg"][0])(alpha=call["sg"][1]), **threshold)
    names = [k for k in leaves if (k != "gamma" or call["threshold"] == "bn")
             and (not k.endswith("0") or call["input_bn"] == "affine")]
    grads = torch.autograd.grad((s * ts["grad"]).sum(), [leaves[k] for k in names])
    return s.detach(), dict(zip(names, grads)), stats


@given(training_calls())
def test_every_method_gives_the_references_training_step(call):
    """A training step (float64), every method: spikes wherever the reference charge is clear of 0, the
    gradients of X and of every parameter (the input batch norm's included), and the running statistics
    of both batch norms, the reference's."""
    ts = training_tensors(call)
    s_ref, h, grads_ref, stats_ref = reference_step(call, ts)
    clear = h.abs() > 1e-6
    for method in methods(call["layout"]):
        s, grads, stats = method_step(call, ts, method)
        assert s.shape == s_ref.shape and not ((s != s_ref) & clear).any(), f"{method}: spikes"
        for name, want in grads_ref.items():
            torch.testing.assert_close(grads[name], want, rtol=1e-6, atol=1e-5,
                                       msg=lambda m: f"{method}, gradient of {name}: {m}")
        for name in (["rm", "rv"] if call["threshold"] == "bn" else []) + (["rm0", "rv0"] if call["input_bn"] else []):
            torch.testing.assert_close(stats[name], stats_ref[name], msg=lambda m: f"{method}, {name}: {m}")
