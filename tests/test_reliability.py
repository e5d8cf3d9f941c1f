"""No silent wrong answers: non-finite inputs stay in their window, dtypes and checkpoints that do not fit
are refused by name, in every method, against the plain reference in tests/reference.py."""
import itertools

import pytest
import torch
import torch.nn as nn
from spikingjelly.activation_based import functional, surrogate

import spikingjelly_mfpsn
from spikingjelly_mfpsn import MulFreeChannelwisePSN, deploy, ops

import reference

NAN, INF = float("nan"), float("inf")


def methods(layout):
    """Every method that runs CPU tensors here for ``layout``, and 'auto'."""
    return [n for n in ops.names(layout=layout) if ops.get(n).backend != "cupy"] + ["auto"]


def poisoned(t, n, c, feat, layout, dtype, seed):
    """A sequence with a NaN, a +inf and a -inf at steps 2, 4 and 7 of three different lanes."""
    torch.manual_seed(seed)
    x = torch.randn(t, n, c, *feat, dtype=dtype)
    x[4, n - 1, c - 1].view(-1)[0] = NAN
    x[7, 0, 1 % c].view(-1)[-1] = INF
    x[2, 0, 0].view(-1)[-1] = -INF
    return x if layout == "time_first" else x.movedim(0, -1).contiguous()


def assert_same_non_finite(got, want, tol, what):
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{what}: NaN at other places than the reference's"
    assert torch.equal(torch.isinf(got), torch.isinf(want)), f"{what}: inf at other places than the reference's"
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], **tol, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------- non-finite inputs stay local
@pytest.mark.parametrize("layout", ops.LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_nan_or_inf_changes_only_the_charge_of_its_window(layout, dtype):
    """Regression: vmap_mm spread one NaN to every step of its lane (a Toeplitz product multiplies it by
    zeros), and the C++ kernels for k = 3, 5, 6, 7 beyond its window (zero-weight padding taps)."""
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    for k, d in itertools.product(range(1, 10), (1, 2)):
        x = poisoned(12, 2, 3, (2,), layout, dtype, seed=k * 10 + d)
        w, b = torch.randn(3, k, dtype=dtype), torch.randn(3, dtype=dtype)
        want = reference.charge(x, w, b, d, layout)
        for name in methods(layout)[:-1]:
            assert_same_non_finite(ops.charge(x, w, b, d, layout, name), want, tol, f"{name} k={k} d={d}")


def eval_neuron(threshold, k, d, layout, step_mode, method, dtype, seed):
    torch.manual_seed(seed)
    sn = MulFreeChannelwisePSN(3, k=k, dilation=d, threshold=threshold, step_mode=step_mode, layout=layout,
                               method=method, exp_init=False).to(dtype).eval()
    with torch.no_grad():
        if threshold == "bn":
            for p in (sn.running_mean, sn.gamma, sn.beta):
                p.normal_()
            sn.running_var.uniform_(0.5, 2.0)
        else:
            sn.v_threshold.normal_()
    return sn


def reference_charge_of(sn, x, layout):
    """The float64 reference H (spikes: H >= 0) of an eval-mode neuron."""
    p = {n: t.detach().double() for n, t in sn.named_parameters()}
    p.update({n: t.double() for n, t in sn.named_buffers() if t.is_floating_point()})
    if sn.threshold == "bn":
        return reference.mfpsn_charge(x.double(), p["weight"], sn.dilation, layout, "bn", gamma=p["gamma"],
                                      beta=p["beta"], stats=(p["running_mean"], p["running_var"]), eps=sn.eps)[0]
    return reference.mfpsn_charge(x.double(), p["weight"], sn.dilation, layout, "param",
                                  v_threshold=p["v_threshold"])[0]


def run(sn, x):
    """The neuron's spikes of a whole sequence, step by step in single-step mode."""
    with torch.no_grad():
        if sn.step_mode == "m":
            return sn(x)
        out = torch.stack([sn(xt) for xt in x])
        functional.reset_net(sn)
        return out


@pytest.mark.parametrize("threshold", ["param", "bn"])
@pytest.mark.parametrize("layout,step_mode", [("time_first", "m"), ("time_last", "m"), ("time_first", "s")])
def test_a_nan_or_inf_changes_only_the_spikes_of_its_window(threshold, layout, step_mode):
    """Eval mode (the BN folds its running statistics) and the parameter threshold, every method."""
    for k, d in itertools.product((1, 2, 3, 5, 6, 7, 9), (1, 2)):
        x = poisoned(12, 2, 3, (2,), layout, torch.float32, seed=k + 20 * d)
        base = eval_neuron(threshold, k, d, layout, step_mode, "auto", torch.float32, seed=k)
        h = reference_charge_of(base, x, layout)
        clear = (h.abs() > 1e-4) | ~torch.isfinite(h)  # (NaN: no spike)
        for method in methods(layout):
            sn = eval_neuron(threshold, k, d, layout, step_mode, method, torch.float32, seed=k)
            s = run(sn, x)
            bad = (s != (h >= 0).float()) & clear
            assert not bad.any(), f"{method} k={k} d={d}: {int(bad.sum())} spikes differ"


@pytest.mark.parametrize("layout", ops.LAYOUTS)
def test_a_nan_in_bn_training_is_refused_by_every_method(layout):
    x = poisoned(8, 2, 3, (2,), layout, torch.float32, seed=1)
    for method in methods(layout):
        sn = MulFreeChannelwisePSN(3, k=2, step_mode="m", layout=layout, method=method)
        with pytest.raises(ValueError, match="batch statistics"):
            sn(x)
        assert torch.equal(sn.running_mean, torch.zeros(3)) and torch.equal(sn.running_var, torch.ones(3))


@pytest.mark.parametrize("layout", ops.LAYOUTS)
def test_input_gradients_stay_in_the_window_too(layout):
    """dL/dX of the parameter threshold with NaN and inf inputs: NaN exactly where the reference's is."""
    for k, d in itertools.product((1, 3, 5, 9), (1, 2)):
        x = poisoned(12, 2, 3, (2,), layout, torch.float64, seed=k + d)
        base = eval_neuron("param", k, d, layout, "m", "auto", torch.float64, seed=k).train()
        g = torch.randn_like(x)
        xr = x.clone().requires_grad_()
        h = reference.mfpsn_charge(xr, base.weight.detach(), d, layout, "param",
                                   v_threshold=base.v_threshold.detach())[0]
        (want,) = torch.autograd.grad((reference.atan_primitive(h) * g).sum(), xr)
        for method in methods(layout):
            sn = eval_neuron("param", k, d, layout, "m", method, torch.float64, seed=k).train()
            xm = x.clone().requires_grad_()
            (got,) = torch.autograd.grad((sn(xm) * g).sum(), xm)
            assert_same_non_finite(got, want, dict(rtol=1e-9, atol=1e-9), f"{method} k={k} d={d}")


# ---------------------------------------------------------------- dtypes
@pytest.mark.parametrize("step_mode", ["m", "s"])
@pytest.mark.parametrize("threshold", ["bn", "param"])
def test_a_higher_precision_input_is_refused_naming_both_dtypes(step_mode, threshold):
    """Regression: a float32 neuron returned float64 spikes for a float64 input (some methods raised
    torch's internal errors instead)."""
    for (x_dtype, n_dtype), method in itertools.product(
            [(torch.float64, torch.float32), (torch.float32, torch.float16), (torch.float32, torch.bfloat16)],
            methods("time_first")):
        sn = MulFreeChannelwisePSN(3, step_mode=step_mode, method=method, threshold=threshold).to(n_dtype)
        x = torch.randn((4, 2, 3) if step_mode == "m" else (2, 3), dtype=x_dtype)
        with pytest.raises(TypeError, match=f"{x_dtype}.*{n_dtype}"):
            sn(x)


@pytest.mark.parametrize("step_mode", ["m", "s"])
def test_an_integer_input_is_refused(step_mode):
    """Regression: an int64 input gave int64 spikes."""
    for dtype, hint in ((torch.int64, "x.float()"), (torch.uint8, "unsigned"), (torch.bool, "spikes as input")):
        for method in methods("time_first"):
            sn = MulFreeChannelwisePSN(3, step_mode=step_mode, method=method)
            x = torch.ones((4, 2, 3) if step_mode == "m" else (2, 3), dtype=dtype)
            with pytest.raises(TypeError, match=f"floating-point.*{dtype}.*{hint}"):
                sn(x)


@pytest.mark.parametrize("step_mode", ["m", "s"])
def test_a_lower_precision_input_runs_in_the_neurons_dtype(step_mode):
    """float16/bfloat16 into a float32 neuron (autocast's case), float32 into a float64 one: computed in
    the neuron's dtype, spikes in the input's dtype, the same in every method and both step modes (a
    single step returned the neuron's dtype before)."""
    torch.manual_seed(3)
    x = torch.randn(6, 2, 3, 4)
    cases = [(torch.float16, torch.float32), (torch.bfloat16, torch.float32), (torch.float32, torch.float64)]
    for (dtype, neuron_dtype), method in itertools.product(cases, methods("time_first")):
        sn = MulFreeChannelwisePSN(3, k=2, step_mode=step_mode, threshold="param", method=method, exp_init=False)
        sn = sn.to(neuron_dtype).eval()
        torch.manual_seed(0)
        with torch.no_grad():
            sn.v_threshold.normal_()
        xl = x.to(dtype)
        s = run(sn, xl)
        h = reference.mfpsn_charge(xl.double(), sn.weight.detach().double(), 1, "time_first", "param",
                                   v_threshold=sn.v_threshold.detach().double())[0]
        clear = h.abs() > 1e-4
        assert s.dtype == dtype and torch.equal(s[clear].double(), (h >= 0).double()[clear]), (method, dtype)


@pytest.mark.parametrize("threshold", ["bn", "param"])
@pytest.mark.parametrize("layout", ops.LAYOUTS)
def test_a_half_precision_input_into_a_float64_neuron_gets_the_references_gradient(threshold, layout):
    """float16/bfloat16 X into a float64 neuron, training: every method's dL/dX is the float64
    reference's, rounded to X's dtype (Triton's was zeros or NaN under its interpreter, whose float64 ->
    bfloat16 conversion is wrong)."""
    torch.manual_seed(5)
    x64 = torch.randn(6, 3, 4, 2, dtype=torch.float64)
    g = torch.randn(6, 3, 4, 2, dtype=torch.float64)
    for dtype, method in itertools.product((torch.float16, torch.bfloat16), methods(layout)):
        sn = MulFreeChannelwisePSN(4, k=2, threshold=threshold, layout=layout, step_mode="m", method=method,
                                   v_threshold=0.3).double()
        xl = x64.to(dtype)
        xr = xl.double().requires_grad_()
        params = dict(v_threshold=sn.v_threshold.detach()) if threshold == "param" else \
            dict(gamma=sn.gamma.detach(), beta=sn.beta.detach())
        xin = lambda t: t if layout == "time_first" else t.movedim(0, -1)  # noqa: E731
        h, _ = reference.mfpsn_charge(xin(xr), sn.weight.detach(), 1, layout, threshold, **params)
        (reference.atan_primitive(h) * xin(g)).sum().backward()
        xm = xin(xl).detach().requires_grad_()
        s = sn(xm)
        (s * xin(g).to(dtype)).sum().backward()
        clear = h.detach().abs() > 1e-2
        assert torch.equal(s.double()[clear], (h.detach() >= 0).double()[clear]), (method, dtype)
        torch.testing.assert_close(xm.grad.double(), xin(xr.grad), rtol=2e-2, atol=2e-2,
                                   msg=lambda m: f"{method} {dtype}: {m}")


def test_the_ops_functions_check_dtypes():
    x, w = torch.randn(4, 2, 3, dtype=torch.float64), torch.randn(3, 2)
    for method in methods("time_first")[:-1]:
        with pytest.raises(TypeError, match="float64.*float32"):
            ops.charge(x, w, None, 1, "time_first", method)
        with pytest.raises(TypeError, match="floating-point"):
            ops.charge(x.long(), w, None, 1, "time_first", method)
        with pytest.raises(TypeError, match="bias"):
            ops.charge(x.float(), w, torch.randn(3, dtype=torch.float64), 1, "time_first", method)
    # A lower precision input runs in the weight's dtype in every method, the C++ one (float32/float64
    # kernels) included: it was refused there alone.
    xh = x.half()
    want = reference.charge(xh.double(), w.double(), None, 1, "time_first")
    for method in methods("time_first")[:-1]:
        got = ops.charge(xh, w, None, 1, "time_first", method)
        assert got.dtype == torch.float32, method
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{method}: {m}")
    # The single step checked the current input only: an earlier float64 tap was rounded silently.
    now, earlier = torch.randn(2, 3), torch.randn(2, 3, dtype=torch.float64)
    for method in methods("time_first"):
        with pytest.raises(TypeError, match=r"taps\[0\] \(an earlier input\): x has dtype torch.float64"):
            ops.mf_psn_step([earlier, now], w, bias=torch.zeros(3), method=method)


# ---------------------------------------------------------------- checkpoints
def net(channels, k, dilation=1, threshold="bn", **kw):
    return nn.Sequential(nn.Linear(5, 4), MulFreeChannelwisePSN(channels, k=k, dilation=dilation,
                                                                 threshold=threshold, step_mode="m", **kw))


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("threshold", ["bn", "param"])
def test_a_checkpoint_of_another_order_dilation_or_width_is_refused_by_name(lazy, threshold):
    """Regression: a lazy k=5 neuron silently loaded a k=3 checkpoint and then ran as k=3; a non-lazy one
    gave torch's "size mismatch for 1.weight", never naming k."""
    saved = net(4, 3, 2, threshold).state_dict()
    for (k, d, c), what in (((5, 2, 4), "k=3.*k=5"), ((3, 1, 4), "dilation=2.*dilation=1"),
                            ((3, 2, 6), "channels=4.*channels=6")):
        if lazy and c != 4:
            continue  # a lazy neuron takes its width from the checkpoint
        target = net(None if lazy else c, k, d, threshold)
        with pytest.raises(RuntimeError, match=f"layer '1'.*{what}"):
            target.load_state_dict(saved)
        if lazy:
            assert target[1].channels is None  # nothing was materialised from the refused checkpoint
    # A damaged (k, dilation) record loaded without a word
    for bad in (torch.tensor([7, 7, 7]), torch.tensor([3])):
        with pytest.raises(RuntimeError, match=r"layer '1' has order_dilation=\[.*\], not \[k, dilation\]"):
            net(None if lazy else 4, 3, 2, threshold).load_state_dict({**saved, "1.order_dilation": bad})


def test_a_folded_checkpoint_of_another_order_dilation_or_width_is_refused_by_name():
    """Regression: a folded network of dilation 1 loaded one of dilation 2 (the same k and width)
    without a word and then ran with dilation 1. One saved before the key still loads."""
    saved = deploy.fold(net(4, 3, 2).eval()).state_dict()
    for (k, d, c), what in (((5, 2, 4), "k=3.*k=5"), ((3, 1, 4), "dilation=2.*dilation=1"),
                            ((3, 2, 6), "channels=4.*channels=6")):
        with pytest.raises(RuntimeError, match=f"layer '1'.*{what}"):
            deploy.fold(net(c, k, d).eval()).load_state_dict(saved)
    torch.manual_seed(0)
    src = deploy.fold(net(4, 3, 2).eval())
    x = torch.randn(7, 2, 5)
    dst = deploy.fold(net(4, 3, 2).eval())
    dst.load_state_dict({key: v for key, v in src.state_dict().items() if not key.endswith("order_dilation")})
    with torch.no_grad():
        assert torch.equal(dst(x), src(x))


def test_checkpoints_load_across_layouts_methods_and_versions():
    """A checkpoint loads into any layout and method (and lazily); one saved before (k, dilation) were
    stored (without the key) still loads, its order checked from the weight."""
    torch.manual_seed(0)
    src = net(4, 3, 2)
    x = torch.randn(7, 2, 5)
    src(x)  # running statistics move
    src.eval()
    want = src(x)
    saved = src.state_dict()
    old = {key: v for key, v in saved.items() if not key.endswith("order_dilation")}
    for layout, method, state in itertools.product(ops.LAYOUTS, ("auto", "cpp", "shift_add"), (saved, old)):
        if method not in ops.names(layout=layout) + ["auto"]:
            continue
        dst = net(None, 3, 2, layout=layout, method=method)
        dst.load_state_dict(state)
        dst.eval()
        y = dst[0](x)
        got = dst[1](y) if layout == "time_first" else dst[1](y.movedim(0, -1)).movedim(-1, 0)
        assert torch.equal(got, want), (layout, method)
        assert dst.state_dict().keys() == saved.keys()
    with pytest.raises(RuntimeError, match="k=3.*k=2"):
        net(4, 2, 2).load_state_dict(old)


@pytest.mark.parametrize("k,surrogate", [(2, "ATan"), (1, "ATan"), (1, "Erf")])
@pytest.mark.parametrize("eps", [1e-30, 1e-45])
def test_a_constant_channel_with_a_tiny_eps_gives_the_same_spikes_and_finite_gradients(eps, k, surrogate):
    """BN training on a channel whose charge is constant (variance 0: with k = 1 over every step), eps down
    to float32's smallest subnormal, with a surrogate inside the fused kernels (ATan) and one outside
    (Erf): every method gives the same spikes and finite gradients; eps = 0 is refused."""
    from spikingjelly.activation_based import surrogate as sg
    torch.manual_seed(2)
    x = torch.randn(6, 4, 3, 2)
    x[:, :, 1] = 0.7
    results = []
    for method in methods("time_first"):
        sn = MulFreeChannelwisePSN(3, k=k, step_mode="m", method=method, eps=eps,
                                   surrogate_function=getattr(sg, surrogate)())
        xr = x.clone().requires_grad_()
        s = sn(xr)
        (s * torch.linspace(-1, 1, s.numel()).view_as(s)).sum().backward()
        grads = (xr.grad, sn.weight.grad, sn.gamma.grad, sn.beta.grad)
        assert all(torch.isfinite(g).all() for g in grads), method
        results.append((method, s))
    for method, s in results[1:]:
        assert torch.equal(s, results[0][1]), method
    with pytest.raises(ValueError, match="eps must be a number > 0"):
        MulFreeChannelwisePSN(3, eps=0.0)


# ---------------------------------------------------------------- charges beyond float32's range
OVERFLOWING = [[3e38, 3e38, -3e38, -3.1e38],   # exact -1e37: a float32 sum in tap order overflows to +inf
               [-3e38, -3e38, 3e38, 3.1e38],   # exact +1e37
               [3e38, 3e38, 3e38, -3e38],      # exact 6e38, beyond float32: fires
               [-3e38, -3e38, -1e38, 2e38]]    # exact -5e38: does not


@pytest.mark.parametrize("threshold", ["param", "bn"])
@pytest.mark.parametrize("layout,step_mode", [("time_first", "m"), ("time_last", "m"), ("time_first", "s")])
def test_a_charge_beyond_float32_fires_by_the_sign_of_the_exact_one(threshold, layout, step_mode):
    """Where the float32 charge overflows (on the way or in the end), every method's spike is that of the
    float64 charge of the same inputs: before, methods summing in other orders gave +inf, -inf or NaN."""
    x = torch.zeros(4, len(OVERFLOWING), 2)
    x[:, :, 0] = torch.tensor(OVERFLOWING).T
    x[:, :, 1] = torch.tensor(OVERFLOWING).T.flip(0)  # (the other order of the same taps)
    want = (torch.tensor(OVERFLOWING, dtype=torch.float64).sum(1) >= 0).float()
    want_flipped = want.clone()
    xin = x if layout == "time_first" else x.movedim(0, -1).contiguous()
    for method in methods(layout):
        sn = MulFreeChannelwisePSN(2, k=4, threshold=threshold, step_mode=step_mode, layout=layout, method=method,
                                   v_threshold=0.0).eval()
        with torch.no_grad():
            sn.weight.fill_(1.0)
            if threshold == "bn":
                sn.beta.zero_()  # folded: Wq = Q(1 / sqrt(1 + eps)) = 1, b = 0
        s = run(sn, xin)
        s = s if layout == "time_first" else s.movedim(-1, 0)
        assert torch.equal(s[-1, :, 0], want) and torch.equal(s[-1, :, 1], want_flipped), method


def next_to_midpoints(dtype, ulps=3):
    """Weights of ``dtype`` within ``ulps`` ulps either side of 2**(e + 1/2), e in -12..3, where a float
    log2 can round to the wrong power of two; ordered by e, then by distance."""
    mids = torch.tensor([2.0 ** (e + 0.5) for e in range(-12, 4)], dtype=torch.float64).to(dtype)
    out, up, down = [mids], mids, mids
    for _ in range(ulps):
        up, down = torch.nextafter(up, torch.full_like(up, INF)), torch.nextafter(down, torch.zeros_like(down))
        out += [up, down]
    return torch.stack(out, 1).flatten()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_the_quantiser_rounds_weights_next_to_a_midpoint_as_the_reference(dtype):
    w = torch.cat([next_to_midpoints(dtype), -next_to_midpoints(dtype)])
    assert torch.equal(spikingjelly_mfpsn.quantize_pow2_(w), reference.pow2(w.double()).to(dtype))


@pytest.mark.parametrize("exponent", [-126, -1, 0, 1, 127, "subnormal"])
def test_the_quantiser_rounds_every_float32_mantissa_exactly(exponent):
    """Every float32 mantissa 1.f (f of 23 bits) at an exponent: it rounds up to the next power of two
    iff (2**23 + f)**2 >= 2**47, i.e. 1.f >= sqrt(2), decided in integers (clamped at 2**127). And every
    subnormal f * 2**-149, f = 1.g * 2**j, rounds up iff f**2 >= 2**(2j + 1)."""
    f = torch.arange(1, 2 ** 23, dtype=torch.int64)
    if exponent == "subnormal":
        j = torch.log2(f.double()).floor().long()
        up = f ** 2 >= 2 ** (2 * j + 1)
        w = (f.double() * 2.0 ** -149).float()
        want = torch.pow(2.0, (j + up.long() - 149).double())
    else:
        up = (2 ** 23 + f) ** 2 >= 2 ** 47
        w = ((f | (127 << 23)).to(torch.int32).view(torch.float32).double() * 2.0 ** exponent).float()
        want = torch.pow(2.0, (up.long() + exponent).double()).clamp(max=2.0 ** 127)
    assert torch.equal(spikingjelly_mfpsn.quantize_pow2_(w).double(), want)


@pytest.mark.parametrize("threshold,layout,step_mode,training", [
    ("param", "time_first", "m", True), ("param", "time_last", "m", True),  # (batch statistics would fold W)
    *itertools.product(["param", "bn"], ["time_first", "time_last"], ["m"], [False]),
    ("param", "time_first", "s", False), ("bn", "time_first", "s", False)])
def test_every_method_quantises_weights_next_to_a_midpoint_as_the_reference(threshold, layout, step_mode, training):
    """One channel per weight near 2**(e + 1/2), X = 1, k = 1, a threshold of 1.5 * 2**(e - 1) halfway
    between the two powers of two it may round to: a channel fires iff its weight rounds up. Before,
    the torch methods took round(log2 |w|) in floats and rounded some of them the wrong way (C++ and
    Triton did not)."""
    w = next_to_midpoints(torch.float64)  # float64: the folding of the BN threshold keeps the weight
    c = w.numel()
    e = torch.floor(torch.log2(w) - 0.25)  # the power below the midpoint: 2**e < w < 2**(e+1)
    v_th = 1.5 * 2.0 ** e
    want = (reference.pow2(w) >= 2.0 ** (e + 1)).double()
    x = torch.ones(2, 1, c, dtype=torch.float64)
    xin = x if layout == "time_first" else x.movedim(0, -1).contiguous()
    for method in methods(layout):
        sn = MulFreeChannelwisePSN(c, k=1, threshold=threshold, step_mode=step_mode, layout=layout, method=method,
                                   eps=1e-300).double().train(training)
        with torch.no_grad():
            sn.weight.copy_(w[:, None])
            if threshold == "param":
                sn.v_threshold.copy_(v_th)
            else:  # folded: Wq = Q(w / sqrt(1 + eps)) = Q(w), b = -V_th
                sn.running_var.fill_(1.0)
                sn.beta.copy_(-v_th)
        s = sn(xin).detach() if training else run(sn, xin)  # (training: through the STE's graph)
        s = s if layout == "time_first" else s.movedim(-1, 0)
        assert torch.equal(s[-1, 0], want), (method, w[s[-1, 0] != want].tolist())


@pytest.mark.parametrize("layout", ops.LAYOUTS)
def test_bn_statistics_beyond_float32_are_refused_by_every_method(layout):
    """A charge so large that its batch variance overflows float32: the same ValueError everywhere."""
    torch.manual_seed(8)
    x = torch.randn(6, 4, 3) * 1e20
    x = x if layout == "time_first" else x.movedim(0, -1).contiguous()
    for method in methods(layout):
        sn = MulFreeChannelwisePSN(3, k=2, step_mode="m", layout=layout, method=method)
        with pytest.raises(ValueError, match="batch statistics of its charge are NaN or inf"):
            sn(x)


def test_a_half_neuron_on_a_backend_without_half_says_so():
    """``.half()`` on a neuron pinned to the C++ backend (float32/float64 kernels): whole sequences and
    single steps alike raise a clear error naming the methods that can (single steps ran the general
    path, against the promise of one answer or one error in both step modes)."""
    if "cpp" not in ops.names():
        pytest.skip("the C++ backend is not available here (no compiler)")
    torch.manual_seed(9)
    x = torch.randn(5, 2, 3).half()
    for pinned in (dict(method="cpp"), dict(backend="cpp")):  # (the backend's 'auto' too: a step ran it)
        sn = MulFreeChannelwisePSN(3, k=2, step_mode="m", threshold="param", **pinned).half().eval()
        with pytest.raises(ValueError, match="cannot run this input.*Methods that can"):
            sn(x)
        sn.step_mode = "s"
        with pytest.raises(ValueError, match="cannot run this input.*Methods that can"):
            run(sn, x)


# ---------------------------------------------------------------- a batch norm in front
def batch_norm_reference(x, gamma, beta, eps=1e-5):
    """A training batch norm of (T, N, C, ...) over every axis but C, written out."""
    dims, shape = [d for d in range(x.dim()) if d != 2], [-1 if d == 2 else 1 for d in range(x.dim())]
    mean = x.mean(dims, keepdim=True)
    var = ((x - mean) ** 2).mean(dims, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * gamma.view(shape) + beta.view(shape)


@pytest.mark.parametrize("shape", [(1, 1, 3, 2, 2), (1, 1, 3, 1, 2), (2, 1, 3, 1, 1), (3, 2, 3, 2, 2)])
def test_a_batch_norm_in_front_gets_the_references_gradients(shape):
    """SpikingJelly's BatchNorm2d + MF-PSN in training, every method: the gradients of X and of both
    layers' parameters are the reference's. With one sample and size-1 dims, torch's CPU batch-norm
    backward misreads a gradient whose channels are its innermost dim; every method hands X's gradient
    back contiguous."""
    from spikingjelly.activation_based import layer, surrogate
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    g = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(12))
    for method in methods("time_first"):
        torch.manual_seed(13)
        bn = layer.BatchNorm2d(3, step_mode="m").double()
        sn = MulFreeChannelwisePSN(3, k=2, step_mode="m", method=method).double()
        with torch.no_grad():
            for p in (bn.weight, bn.bias, sn.gamma, sn.beta):
                p.uniform_(0.5, 1.5)
        params = [bn.weight, bn.bias, sn.weight, sn.gamma, sn.beta]
        xa = x.clone().requires_grad_()
        got = torch.autograd.grad((sn(bn(xa)) * g).sum(), [xa] + params)
        xr, ref = x.clone().requires_grad_(), [p.detach().clone().requires_grad_() for p in params]
        h, _ = reference.mfpsn_charge(batch_norm_reference(xr, ref[0], ref[1]), ref[2], 1, "time_first", "bn", True,
                                      ref[3], ref[4])
        want = torch.autograd.grad((surrogate.ATan()(h) * g).sum(), [xr] + ref)
        for i, (a, b) in enumerate(zip(got, want)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m: f"{method}, gradient {i}: {m}")


# ---------------------------------------------------------------- meta tensors (shapes only)
@pytest.mark.parametrize("layout", ops.LAYOUTS)
@pytest.mark.parametrize("threshold", ["bn", "param"])
@pytest.mark.parametrize("step_mode", ["s", "m"])
def test_meta_tensors_give_shapes_or_a_clear_error(layout, threshold, step_mode):
    """A neuron moved to ``meta`` runs forward and backward (shapes, no values) in every method that can
    run such tensors; the others refuse by a ValueError naming the device, as for any device they do not
    run. 'auto' always runs."""
    ran = []
    for method in [n for n in ops.names(layout=layout)] + ["auto"]:
        sn = MulFreeChannelwisePSN(3, k=3, dilation=2, threshold=threshold, step_mode=step_mode, method=method,
                                   layout=layout).to("meta")
        x = torch.randn((4, 2, 3, 5) if layout == "time_first" else (2, 3, 5, 4), device="meta", requires_grad=True)
        xs = [x[t] if layout == "time_first" else x[..., t] for t in range(4)] if step_mode == "s" else [x]
        if step_mode == "s" and layout == "time_last":  # (a time-last neuron runs whole sequences only)
            with pytest.raises(ValueError, match="layout='time_last' runs whole"):
                sn(xs[0])
            ran.append(method)
            continue
        try:
            ys = [sn(xi) for xi in xs]
        except ValueError as e:
            assert "meta" in str(e), f"{method}: {e}"
            continue
        sum(y.sum() for y in ys).backward()
        assert [(y.shape, y.device.type) for y in ys] == [(xi.shape, "meta") for xi in xs], method
        assert x.grad.shape == x.shape and sn.weight.grad.shape == sn.weight.shape, method
        ran.append(method)
    assert "auto" in ran and "conv1d" in ran


def test_a_network_moved_to_meta_gives_its_output_shape():
    """After replace_neurons (with a fused batch norm) and in the time-last layout, a whole network on
    ``meta`` gives the output shape it gives on the CPU."""
    from spikingjelly.activation_based import layer, neuron
    for fuse, time_last in [(False, False), (True, False), (False, True)]:
        net = nn.Sequential(layer.Conv2d(2, 4, 3, padding=1, step_mode="m"), layer.BatchNorm2d(4, step_mode="m"),
                            neuron.IFNode(step_mode="m"), layer.MaxPool2d(2, step_mode="m"),
                            layer.Flatten(step_mode="m"), layer.Linear(16, 3, step_mode="m"))
        spikingjelly_mfpsn.replace_neurons(net, fuse_bn=fuse)
        if time_last:
            net = spikingjelly_mfpsn.to_time_last(net)
        want = net(torch.randn(3, 2, 2, 4, 4)).shape
        functional.reset_net(net)
        y = net.to("meta")(torch.randn(3, 2, 2, 4, 4, device="meta"))
        y.sum().backward()
        assert y.shape == want and y.device.type == "meta", (fuse, time_last)


@pytest.mark.parametrize("what", ["neuron", "network", "network, fused batch norm"])
def test_a_network_built_on_meta_loads_after_to_empty(what):
    """Built under ``torch.device('meta')`` (no memory), shaped by one meta forward, moved with
    ``to_empty`` and loaded from a checkpoint: a neuron, or a network, gives the checkpoint's outputs.
    (torch's ``to_empty`` passes ``recurse`` to the module it is called on, which SpikingJelly's memory
    modules do not take.)"""
    from spikingjelly.activation_based import layer, neuron

    def build():
        if what == "neuron":
            return MulFreeChannelwisePSN(2, k=3, step_mode="m")
        net = nn.Sequential(layer.Conv2d(2, 4, 3, padding=1, step_mode="m"), layer.BatchNorm2d(4, step_mode="m"),
                            neuron.IFNode(step_mode="m"), layer.Flatten(step_mode="m"),
                            layer.Linear(64, 3, step_mode="m"), neuron.IFNode(step_mode="m"))
        spikingjelly_mfpsn.replace_neurons(net, fuse_bn=what.endswith("fused batch norm"))
        return net

    torch.manual_seed(0)
    x, trained = torch.randn(3, 2, 2, 4, 4), build()
    want = trained(x)
    functional.reset_net(trained)
    with torch.device("meta"):
        net = build()
        net(torch.empty(3, 2, 2, 4, 4))
    functional.reset_net(net)
    net = net.to_empty(device="cpu")
    net.load_state_dict(trained.state_dict())
    assert torch.equal(net(x), want)


def test_lazy_neurons_moved_to_meta_stay_lazy():
    """torch's Module._apply made an uninitialised parameter moved to another device a real one of shape (0,):
    replace_neurons on a network built on meta (called outside the meta context) moved its new lazy neurons
    there, which then had 0 channels (AttributeError at the meta forward, and a load refused as "channels=0").
    They stay lazy now, on the device and dtype they were moved to."""
    from spikingjelly.activation_based import layer, neuron

    def layers():
        return nn.Sequential(layer.Linear(3, 4, step_mode="m"), neuron.IFNode(step_mode="m"))

    torch.manual_seed(0)
    x, trained = torch.randn(5, 2, 3), layers()
    spikingjelly_mfpsn.replace_neurons(trained, k=2, example_input=x)
    want = trained(x)
    functional.reset_net(trained)
    with torch.device("meta"):
        net = layers()
    spikingjelly_mfpsn.replace_neurons(net, k=2)
    assert net[1].channels is None and net[1].weight.device.type == "meta"
    assert net(torch.empty(5, 2, 3, device="meta")).shape == (5, 2, 4)
    functional.reset_net(net)
    net = net.to_empty(device="cpu")
    net.load_state_dict(trained.state_dict())
    assert torch.equal(net(x), want)
    lazy = MulFreeChannelwisePSN(step_mode="m").to("meta").double()
    assert lazy.channels is None and (lazy.weight.device.type, lazy.weight.dtype) == ("meta", torch.float64)


# ---------------------------------------------------------------- one error for one bad call, every method
def _bn(c, **fields):
    torch.manual_seed(1)
    base = dict(gamma=torch.rand(c) + 0.5, beta=torch.randn(c), running_mean=torch.randn(c),
                running_var=torch.rand(c) + 0.5, eps=1e-5, momentum=0.1, num_batches_tracked=torch.tensor(0))
    return ops.BatchNorm(**{**base, **fields})


@pytest.mark.parametrize("training, fields, match", [
    (False, dict(running_mean=None, running_var=None), "bn needs running_mean and running_var"),
    (False, dict(eps=torch.tensor(1e-5)), "bn.eps must be a finite number > 0"),
    (True, dict(eps=True), "bn.eps must be a finite number > 0"),
    (False, dict(eps=INF), "bn.eps must be a finite number > 0"),
    (True, dict(momentum="x"), "bn.momentum must be a number in \\[0, 1\\] or None"),
    (True, dict(momentum=NAN), "bn.momentum must be"),
    (True, dict(momentum=-1), "bn.momentum must be"),
    (True, dict(momentum=2), "bn.momentum must be"),
    (True, dict(gamma=torch.ones(3, dtype=torch.int64)), "bn.gamma must be .* of a floating-point dtype, got \\(3,\\) "
                                                         "torch.int64"),
    (False, dict(running_var=torch.ones(3, dtype=torch.int64)), "bn.running_var must be .* of a floating-point dtype"),
    (True, dict(momentum=None, num_batches_tracked=None), "needs bn.num_batches_tracked"),
    (True, dict(gamma=None), "bn.gamma must be a tensor of shape \\(3,\\)"),
    (True, dict(beta=None), "bn.beta must be a tensor of shape \\(3,\\)"),
    (True, dict(running_mean=torch.zeros(1).expand(3)), "bn.running_mean must not be an expanded tensor")])
def test_a_bad_batch_norm_gets_one_error_from_every_method(training, fields, match):
    """The C++ step ran eval mode without running statistics on batch statistics, and took a tensor eps;
    the torch methods divided by zero for a cumulative average without a counter; Triton wrote every
    channel's running mean to the one element of an expanded tensor; a missing gamma gave raw errors."""
    x, w = torch.randn(4, 2, 3, 2), torch.rand(3, 2) + 0.1
    for method in methods("time_first"):
        bn = _bn(3, **fields)
        before = None if bn.running_mean is None else bn.running_mean.clone()
        with pytest.raises(ValueError, match=match):
            ops.mf_psn(x, w, bn=bn, method=method, training=training)
        if before is not None:
            assert torch.equal(bn.running_mean, before), method
    for backend in ("cpp", "torch"):
        with pytest.raises(ValueError, match=match):
            ops.mf_psn(x, w, bn=_bn(3, **fields), backend=backend, training=training)


@pytest.mark.parametrize("input_bn", [False, True])
@pytest.mark.parametrize("case", ["channels", "dilation 0", "dilation 1.5", "layout", "two dims", "float64 x",
                                  "integer x", "order 0"])
def test_a_bad_input_to_a_bn_step_gets_one_error_from_every_method(case, input_bn):
    """Methods whose BN step checks its inputs itself are tried before the general checks: each such step
    hands every input it cannot take as it is back to them, so every method says the same."""
    x, w, dilation, layout = torch.randn(4, 2, 3, 2), torch.rand(3, 2) + 0.1, 1, "time_first"
    if case == "channels":
        x = torch.randn(4, 2, 5, 2)
    elif case.startswith("dilation"):
        dilation = 0 if case == "dilation 0" else 1.5
    elif case == "layout":
        layout = "time_middle"
    elif case == "two dims":
        x = torch.randn(4, 3)
    elif case.endswith(" x"):
        x = x.double() if case == "float64 x" else x.long()
    else:
        w = torch.rand(3, 0)
    errors = set()
    for method in methods("time_first"):
        extra = {"input_bn": _bn(3)} if input_bn else {}
        with pytest.raises((ValueError, TypeError)) as info:
            ops.mf_psn(x, w, bn=_bn(3), dilation=dilation, layout=layout, method=method, training=True, **extra)
        errors.add((type(info.value), str(info.value)))
    assert len(errors) == 1, errors


@pytest.mark.parametrize("case", ["gamma of 5", "running_var of 2", "expanded running_mean", "given mean of 4",
                                  "layout", "dilation 1.5"])
def test_a_deprecated_direct_bn_step_hands_back_what_it_cannot_check(case):
    """ops.bn_fire_direct runs a self-checking step without the general checks: the Triton step took a gamma of
    another length (reading past it) and wrote every channel's running mean to an expanded one's element; the
    C++ step ran an unknown layout as time-last."""
    x, w = torch.randn(4, 2, 3, 2), torch.rand(3, 2) + 0.1
    gamma, beta, rm, rv = torch.ones(3), torch.zeros(3), torch.zeros(3), torch.ones(3)
    given, layout, dilation = None, "time_first", 1
    if case == "layout":
        layout = "time_middle"
    elif case == "dilation 1.5":
        dilation = 1.5
    elif case == "gamma of 5":
        gamma = torch.ones(5)
    elif case == "running_var of 2":
        rv = torch.ones(2)
    elif case == "expanded running_mean":
        rm = torch.zeros(1).expand(3)
    else:
        given = (torch.zeros(4), torch.ones(3))
    for method in methods("time_first"):
        before = rm.clone(), rv.clone()
        with pytest.warns(DeprecationWarning):
            out = ops.bn_fire_direct(x, w, gamma, beta, 1e-5, "whole", dilation, layout, method,
                                     surrogate.ATan(), running=None if given else (rm, rv, 0.1), given=given)
        assert out is None, method
        assert torch.equal(rm, before[0]) and torch.equal(rv, before[1]), method


def test_a_weight_of_another_shape_is_named_before_the_thresholds():
    """A 1-D weight was reported as a bad bn.gamma or v_threshold "of shape (None,)"."""
    x = torch.randn(4, 2, 3)
    for method in methods("time_first"):
        for threshold in (dict(bn=_bn(3)), dict(v_threshold=torch.ones(3)), {}):
            with pytest.raises(ValueError, match=r"weight must have shape \(C, k\) with k >= 1, got \(3,\)"):
                ops.mf_psn(x, torch.rand(3), method=method, **threshold)


@pytest.mark.parametrize("step", [False, True])
def test_a_sparse_input_is_refused_by_name_in_every_method(step):
    x = torch.randn(4, 2, 3).to_sparse()
    w = torch.rand(3, 2) + 0.1
    for method in methods("time_first"):
        with pytest.raises(TypeError, match="x must be a dense tensor|taps\\[-1\\] must be a dense tensor"):
            if step:
                ops.mf_psn_step([None, x[0]], w, bias=torch.zeros(3), method=method)
            else:
                ops.mf_psn(x, w, bn=_bn(3), method=method, training=True)
    # The neuron names its own argument (a single step named the kernels' taps[-1])
    neuron = MulFreeChannelwisePSN(3, k=2, step_mode="s" if step else "m")
    with pytest.raises(TypeError, match=r"^x must be a dense tensor"):
        neuron(x[0] if step else x)
    neuron(x[0].to_dense() if step else x.to_dense())  # (also after a dense input of that shape was checked)
    with pytest.raises(TypeError, match=r"^x must be a dense tensor"):
        neuron(x[0] if step else x)


@pytest.mark.parametrize("method", ["cpp", "triton"])
def test_a_pinned_method_that_cannot_run_the_input_refuses_single_steps_too(method):
    """Single steps quietly ran the torch path where multi-step calls refused the method."""
    if method == "triton" and not ops.find("triton"):
        pytest.skip("triton is not installed")
    for step_mode in ("m", "s"):
        sn = MulFreeChannelwisePSN(3, k=2, step_mode=step_mode, method=method).to("meta")
        x = torch.empty((4, 2, 3) if step_mode == "m" else (2, 3), device="meta")
        with pytest.raises(ValueError, match=f"method '{method}' cannot run this input: .*meta"):
            sn(x)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_a_non_reentrant_checkpoint_counts_the_batch_it_blends_again(momentum):
    """torch.utils.checkpoint(use_reentrant=False) runs the forward again in backward, blending the batch
    into the running statistics a second time, as it does for torch's BatchNorm (which counts it too). The
    fused C++ and Triton steps blended it without counting it: the counter, and with momentum=None every
    later average, went apart from the other methods'."""
    from torch.utils.checkpoint import checkpoint
    bn = nn.BatchNorm1d(3, momentum=momentum)
    checkpoint(bn, torch.randn(4, 3, requires_grad=True), use_reentrant=False).sum().backward()
    results = {}
    for method in methods("time_first"):
        torch.manual_seed(0)
        sn = MulFreeChannelwisePSN(3, k=2, step_mode="m", method=method, momentum=momentum)
        x1, x2 = torch.randn(6, 4, 3, requires_grad=True), torch.randn(6, 4, 3) * 3
        checkpoint(sn, x1, use_reentrant=False).sum().backward()
        sn(x2)
        results[method] = (int(sn.num_batches_tracked), sn.running_mean.clone(), sn.running_var.clone())
    want_count = int(bn.num_batches_tracked) + 1
    for method, (count, mean, var) in results.items():
        assert count == want_count, method
        torch.testing.assert_close(mean, results["shift_add"][1], rtol=1e-5, atol=1e-6, msg=method)
        torch.testing.assert_close(var, results["shift_add"][2], rtol=1e-5, atol=1e-6, msg=method)


def test_huge_finite_float64_parameters_run_in_every_method():
    """Non-finite parameters were found by a float64 sum, which finite float64 values overflow: a weight of
    1e308 crashed the torch methods with a TypeError, a beta of 1e308 was refused as 'running_var + eps <= 0'
    (the C++ and Triton steps ran)."""
    x = torch.ones(1, 1, 2, dtype=torch.float64)
    for method in methods("time_first"):
        param = MulFreeChannelwisePSN(2, k=1, threshold="param", step_mode="m", method=method, exp_init=False)
        param = param.double().eval()
        bn = MulFreeChannelwisePSN(2, k=1, step_mode="m", method=method).double().eval()
        with torch.no_grad():
            param.weight.fill_(1e308)
            param.v_threshold.fill_(0.5)
            bn.beta.fill_(1e308)
        for sn in (param, bn):
            assert torch.equal(sn(x), torch.ones_like(x)), method


@pytest.mark.parametrize("weights, steps", [([-2.0, 1.0, 1.0], 3), ([1.0, 1.0, -2.0, -2.0], 5)])
@pytest.mark.parametrize("threshold", ["param", "bn_eval"])
def test_input_gradients_where_the_float32_charge_overflows_on_the_way(weights, steps, threshold):
    """The fused C++ and Triton backward recomputed H in float32, where a sum that overflows on the way is
    inf or NaN (inf - inf): their input gradients were 0 or NaN where the float64 charge (the one whose
    sign the forward's spike is) is finite, e.g. H = 3e38 * (-2 + 1 + 1) = 0."""
    x = torch.full((steps, 1, 1), 3e38)
    w = torch.tensor([weights])
    xr = x.double().requires_grad_()
    h = reference.charge(xr, w.double(), None, 1, "time_first")
    (want,) = torch.autograd.grad(reference.atan_primitive(h).sum(), xr)
    for method in methods("time_first"):
        xm = x.clone().requires_grad_()
        if threshold == "param":
            s = ops.mf_psn(xm, w, v_threshold=torch.zeros(1), method=method, quantize=None)
        else:  # (a batch norm that folds to the weight itself and no bias)
            bn = _bn(1, gamma=torch.ones(1), beta=torch.zeros(1), running_mean=torch.zeros(1),
                     running_var=torch.full((1,), 1 - 1e-5))
            s = ops.mf_psn(xm, w, bn=bn, method=method, quantize=None, training=False)
        (got,) = torch.autograd.grad(s.sum(), xm)
        assert torch.equal(s, (h >= 0).float()), method
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-30, msg=lambda m: f"{method}: {m}")


def test_a_single_step_without_a_threshold_fires_at_zero_in_every_method():
    """mf_psn_step takes at most one of bias, v_threshold and bn: none is threshold 0. The C++ step read
    the missing bias through a null pointer (the process died)."""
    torch.manual_seed(0)
    x0, x1, w = torch.randn(2, 3), torch.randn(2, 3), torch.rand(3, 2) + 0.1
    h = reference.charge(torch.stack([x0, x1]).double(), reference.pow2(w.double()), None, 1, "time_first")[-1]
    for method in methods("time_first"):
        with torch.no_grad():
            assert torch.equal(ops.mf_psn_step([x0, x1], w, method=method), (h >= 0).float()), method


def test_a_stream_after_a_meta_forward_and_to_empty_starts_from_an_empty_history():
    """docs/guarantees.rst's recipe (build on meta, one lazy meta forward, to_empty, load a checkpoint): the
    meta forward left a history of meta tensors, which to_empty turned into uninitialised memory that the
    first (k-1)*d streamed steps read."""
    torch.manual_seed(0)
    src = MulFreeChannelwisePSN(8, k=3, dilation=2, threshold="param", v_threshold=0.5)
    with torch.device("meta"):
        sn = MulFreeChannelwisePSN(None, k=3, dilation=2, threshold="param")
    sn(torch.empty(2, 8, device="meta"))
    sn.to_empty(device="cpu")
    sn.load_state_dict(src.state_dict())
    x = torch.randn(6, 2, 8) * 1e3
    with torch.no_grad():
        assert torch.equal(torch.stack([sn(x[t]) for t in range(6)]), torch.stack([src(x[t]) for t in range(6)]))


def test_a_fused_input_batch_norm_gives_single_step_spikes_in_the_inputs_dtype():
    for fuse in (False, True):
        sn = MulFreeChannelwisePSN(3, k=2)
        net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), sn).eval()
        if fuse:
            spikingjelly_mfpsn.fuse_batchnorm(net)
            assert sn.input_bn is not None
        assert net(torch.randn(2, 4)).dtype == torch.float32
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert net(torch.randn(2, 4)).dtype == torch.bfloat16, fuse


def test_integer_streaming_refuses_a_dilation_changed_mid_stream_as_float_does():
    """The integer single step read the taps before its shorter history as zeros, where the float one
    refuses."""
    x = torch.randn(8, 2, 3)
    for integer in (False, True):
        folded = deploy.fold(MulFreeChannelwisePSN(3, k=3, dilation=1))
        if integer:
            deploy.set_integer(folded, frac_bits=16)
        for t in range(4):
            folded(x[t])
        folded.dilation = 2
        with pytest.raises(ValueError, match="the stored state holds 2 inputs but k=3, dilation=2 take 4"):
            folded(x[4])


def test_running_statistics_of_another_float_dtype_serve_training_and_eval_alike():
    """Float64 running statistics with a float32 weight: training ran, eval failed on a float64 'bias'."""
    x, w = torch.randn(4, 2, 3, 2), torch.rand(3, 2) + 0.1
    for method in methods("time_first"):
        for training in (True, False):
            bn32 = _bn(3)
            bn64 = _bn(3)._replace(running_mean=bn32.running_mean.double(), running_var=bn32.running_var.double())
            want = ops.mf_psn(x, w, bn=bn32, method=method, training=training)
            got = ops.mf_psn(x, w, bn=bn64, method=method, training=training)
            assert got.dtype == torch.float32 and torch.equal(got, want), (method, training)
            torch.testing.assert_close(bn64.running_mean, bn32.running_mean.double(), msg=method)


def test_a_dilation_beyond_the_sequence_reads_the_causal_zeros_in_every_method():
    """Tap lags of 2**31 and more overflowed the Triton and CuPy kernels' 32-bit index arithmetic (the
    interpreter crashed), and 'conv1d' padded by (k-1)*dilation (64 GB for 2**29)."""
    torch.manual_seed(0)
    x, w = torch.randn(3, 2, 2, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
    for dilation in (2 ** 29, 2 ** 30, 2 ** 31 + 1):
        want = reference.charge(x, w, None, dilation, "time_first")
        for method in methods("time_first")[:-1]:
            torch.testing.assert_close(ops.charge(x, w, None, dilation, "time_first", method), want, msg=method)
            s = ops.mf_psn(x, w, v_threshold=torch.zeros(2, dtype=torch.float64), dilation=dilation, method=method,
                           quantize=None)
            assert torch.equal(s, (want >= 0).double()), method


def test_a_float64_eps_below_float32s_range_gives_the_same_spikes_in_every_method():
    """The Triton BN step passed eps as two float32 halves, which lose an eps below float32's normal range
    (3e-45 became 2.8e-45, 1e-300 became 0): other spikes than every other method's."""
    dt = torch.float64
    x = torch.full((4, 3, 1), 0.3, dtype=dt)
    for eps in (3e-45, 1e-300):
        for w in (1.0256410837173462, 0.97, 1.5):
            weight = torch.tensor([[w]], dtype=dt)
            h, _ = reference.mfpsn_charge(x, weight, 1, "time_first", "bn", quantize=True, gamma=torch.ones(1, dtype=dt),
                                          beta=torch.zeros(1, dtype=dt), eps=eps)
            for method in methods("time_first"):
                bn = ops.BatchNorm(torch.ones(1, dtype=dt), torch.zeros(1, dtype=dt), torch.zeros(1, dtype=dt),
                                   torch.ones(1, dtype=dt), eps, 0.1, torch.tensor(0))
                s = ops.mf_psn(x, weight, bn=bn, method=method, training=True)
                assert torch.equal(s, (h >= 0).to(dt)), (method, eps, w)


@pytest.mark.parametrize("arithmetic", ["neuron", "folded", "integer"])
def test_single_steps_of_a_huge_dilation_stream_as_multi_step_does(arithmetic):
    """A multi-step call takes a dilation beyond the sequence as the sequence's length; single steps padded
    a history of (k-1)*dilation zeros first (the process was killed for memory at 2**31), and the integer
    step stacked its whole history every step."""
    torch.manual_seed(0)
    x = torch.randn(6, 2, 3)
    sn = MulFreeChannelwisePSN(3, k=3, dilation=2 ** 31, step_mode="m", threshold="param", v_threshold=0.1).eval()
    net = nn.Sequential(sn)
    if arithmetic != "neuron":
        net = deploy.fold(net)
    if arithmetic == "integer":
        deploy.set_integer(net, frac_bits=8)
    want = net(x)
    functional.reset_net(net)
    functional.set_step_mode(net, "s")
    with torch.no_grad():
        assert torch.equal(torch.stack([net(x[t]) for t in range(6)]), want)


def test_tensors_on_another_device_than_the_weight_are_named_in_every_method():
    """The torch methods failed with torch's "Tensor on device cpu is not on the expected device meta!",
    naming no argument; the C++ and Triton steps named the devices."""
    x, w = torch.randn(4, 2, 3), torch.rand(3, 2) + 0.1
    for method in methods("time_first"):
        with pytest.raises(ValueError, match="x is on meta but the weight on cpu"):
            ops.mf_psn(x.to("meta"), w, bn=_bn(3), method=method, training=True)
        with pytest.raises(ValueError, match="bn.running_mean is on meta but the weight on cpu"):
            ops.mf_psn(x, w, bn=_bn(3, running_mean=torch.zeros(3, device="meta")), method=method)
        with pytest.raises(ValueError, match="v_threshold is on meta but the weight on cpu"):
            ops.mf_psn(x, w, v_threshold=torch.ones(3, device="meta"), method=method)


@pytest.mark.parametrize("layout", ops.LAYOUTS)
def test_bn_statistics_whose_sums_overflow_float32_match_the_float64_reference(layout):
    """A batch variance within float32's range whose sum of squares (n * var) is not: the torch and
    Triton methods refused it (float32 sums) while the C++ ones ran it (float64 accumulation) or refused it
    at another size (float32 lane partials). Every method now gives the float64 reference's statistics and
    spikes, and finite gradients."""
    torch.manual_seed(3)
    x = torch.randn(6, 4, 3, 5) * 3e18
    x = x if layout == "time_first" else x.movedim(0, -1).contiguous()
    weight = torch.tensor([[0.5, 1.0], [-0.25, 1.0], [1.0, 0.5]])
    h, (mean, var) = reference.mfpsn_charge(x.double(), weight.double(), 1, layout, "bn",
                                            gamma=torch.ones(3).double(), beta=torch.full((3,), -1.0).double())
    assert float(var.min()) < 3e38 < float(var.max()) * 120  # (in range; n * var is not)
    for method in methods(layout):
        sn = MulFreeChannelwisePSN(3, k=2, step_mode="m", layout=layout, method=method)
        with torch.no_grad():
            sn.weight.copy_(weight)
        xm = x.clone().requires_grad_()
        s = sn(xm)
        assert torch.equal(s, (h >= 0).float()), method
        torch.testing.assert_close(sn.running_mean.double(), 0.1 * mean, rtol=1e-5, atol=0)
        torch.testing.assert_close(sn.running_var.double(), 0.9 + 0.1 * var * 120 / 119, rtol=1e-5, atol=0)
        got = torch.autograd.grad(s.sum(), (xm, sn.weight))
        assert all(bool(g.isfinite().all()) for g in got), method


@pytest.mark.parametrize("threshold", ["param", "bn"])
@pytest.mark.parametrize("hook", ["own", "global"])
def test_backward_hooks_on_the_surrogate_run_in_every_method(threshold, hook):
    """A full backward (pre-)hook on the surrogate, or torch's global module hooks, ran on the torch
    methods only: the fused C++ and Triton kernels skipped the surrogate module, so a hook gating the
    surrogate's gradient changed nothing there and every method gave other gradients."""
    from torch.nn.modules import module as torch_module
    x = torch.randn(5, 2, 3, generator=torch.Generator().manual_seed(3))
    for method in methods("time_first"):
        sn = MulFreeChannelwisePSN(3, step_mode="m", method=method, threshold=threshold)
        calls = []
        if hook == "own":
            handle = sn.surrogate_function.register_full_backward_pre_hook(lambda m, g: (torch.zeros_like(g[0]),))
        else:
            def gate(m, g):
                calls.append(type(m).__name__)
                return (torch.zeros_like(g[0]),) if m is sn.surrogate_function else None
            handle = torch_module.register_module_full_backward_pre_hook(gate)
        try:
            xm = x.clone().requires_grad_()
            sn(xm).sum().backward()
        finally:
            handle.remove()
        assert not xm.grad.any() and not sn.weight.grad.any(), method
        assert hook == "own" or "ATan" in calls, (method, calls)


@pytest.mark.parametrize("integer", [False, True])
def test_a_growing_history_refuses_a_dilation_changed_mid_stream(integer):
    """A history beyond the padded length grows step by step, and only a longer one than the new dilation
    takes was refused: raising the dilation mid-stream (10 -> 5000, or 4100 -> 4200 after 4150 steps) read
    the far tap as zeros, where a fresh neuron reads the inputs."""
    for old, new, steps in ((10, 5000, 12), (4100, 4200, 4150)):
        sn = MulFreeChannelwisePSN(2, k=2, dilation=old, threshold="param").eval()
        if integer:
            sn = deploy.fold(sn)
            deploy.set_integer(sn, frac_bits=16)
        with torch.no_grad():
            for _ in range(steps):
                sn(torch.randn(1, 2))
            sn.dilation = new
            with pytest.raises(ValueError, match=f"k=2, dilation={new} take {new}: call functional.reset_net"):
                sn(torch.randn(1, 2))
            functional.reset_net(sn)
            sn(torch.randn(1, 2))  # fine after a reset


@pytest.mark.parametrize("layout", ops.LAYOUTS)
def test_a_half_precision_input_into_a_float32_bn_neuron_gets_a_gradient_rounded_once(layout):
    """bfloat16/float16 X into a float32 neuron in BN training (the autocast case): the torch methods cast X
    up once for the statistics and once for the spikes, so autograd rounded each branch's gradient to X's
    dtype before adding them, and they cancel much: dL/dX was off by up to 217% (bfloat16). Now it is the
    float64 reference's within one unit of X's dtype (the C++ kernels' already was)."""
    torch.manual_seed(0)
    x32, g32 = torch.randn(8, 16, 4, 3), torch.randn(8, 16, 4, 3)
    xin = (lambda t: t.clone()) if layout == "time_first" else (lambda t: t.movedim(0, -1).contiguous())
    for dtype, ulp in ((torch.bfloat16, 2.0 ** -7), (torch.float16, 2.0 ** -10)):
        x, g = x32.to(dtype), g32.to(dtype)
        for method in methods(layout):
            sn = MulFreeChannelwisePSN(4, k=2, step_mode="m", layout=layout, method=method)
            xr = x.double().requires_grad_()
            h, _ = reference.mfpsn_charge(xin(xr), sn.weight.detach().double(), 1, layout, "bn",
                                          gamma=sn.gamma.detach().double(), beta=sn.beta.detach().double())
            (want,) = torch.autograd.grad((reference.atan_primitive(h) * xin(g).double()).sum(), xr)
            xm = xin(x).requires_grad_()
            (sn(xm) * xin(g)).sum().backward()
            got = xm.grad if layout == "time_first" else xm.grad.movedim(-1, 0)
            torch.testing.assert_close(got.double(), want, rtol=ulp, atol=1e-30, msg=lambda m: f"{method} {dtype}: {m}")


@pytest.mark.parametrize("case", ["float16, 64k values per channel", "float32 beyond n * var"])
def test_single_step_bn_training_takes_the_statistics_multi_step_does(case):
    """The float64 recomputation of overflowed statistics was multi-step only: a float16 neuron's step of
    65536 values per channel (a sum of squares beyond 65504) and a float32 step whose n * var overflows
    ran in multi-step and raised in single-step. Both modes now give the float64 reference's statistics."""
    torch.manual_seed(0)
    if case.startswith("float16"):
        dtype, x = torch.float16, (torch.randn(1024, 2, 8, 8) * 1.2).half()
    else:
        dtype, x = torch.float32, torch.randn(4, 2, 5) * 8e18
    h, (mean, var) = reference.mfpsn_charge(x[None].double(), torch.tensor([[0.5, 1.0]] * 2).double(), 1,
                                            "time_first", "bn", gamma=torch.ones(2).double(),
                                            beta=torch.full((2,), -1.0).double())
    n = x.numel() // 2
    for method in methods("time_first"):
        if method == "cpp" and dtype == torch.float16:
            continue  # (C++ runs float32 and float64 only: refused by name, tested elsewhere)
        for step_mode in ("s", "m"):
            sn = MulFreeChannelwisePSN(2, k=2, step_mode=step_mode, method=method).to(dtype)
            s = sn(x) if step_mode == "s" else sn(x[None])[0]
            clear = h[0].abs() > 1e-2
            assert torch.equal(s.double()[clear], (h[0] >= 0).double()[clear]), (method, step_mode)
            torch.testing.assert_close(sn.running_var.double(), 0.9 + 0.1 * var * n / (n - 1), rtol=2e-3, atol=0,
                                       msg=lambda m: f"{method} {step_mode}: {m}")
