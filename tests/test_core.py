"""The functional core, ops.mf_psn and ops.mf_psn_step, against the plain reference (forward and
gradients), its running statistics against torch's batch norm, its argument errors, and the
deprecated entry points it replaces."""
import pytest
import torch
from spikingjelly.activation_based import surrogate

import spikingjelly_mfpsn  # noqa: F401
from spikingjelly_mfpsn import ops

import reference
from test_ops import make_input

LAYOUTS = ("time_first", "time_last")


def methods(layout):
    return [m for m in ops.names(layout=layout) if ops.get(m).supports(
        torch.zeros(2, 2, 3) if layout == "time_first" else torch.zeros(2, 3, 2), torch.zeros(3, 2), 1, layout)]


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def check_close(s, s_ref, h_ref, inputs, inputs_ref, atol=1e-6):
    """Spikes equal where the reference charge is clear of 0; gradients of ``s * g`` equal."""
    clear = h_ref.detach().abs() > 1e-6
    torch.testing.assert_close(s.double()[clear], s_ref.detach()[clear], rtol=0, atol=0)
    g = torch.randn(s.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad((s.double() * g).sum(), inputs)
    want = torch.autograd.grad((s_ref * g).sum(), inputs_ref)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-6, atol=atol)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("quantize", ["whole", "round", None])
def test_param_threshold_matches_the_reference(layout, quantize):
    torch.manual_seed(2)
    x = make_input(7, 3, 4, (2,), layout, torch.float64, False) * 2
    w, vth = torch.rand(4, 3) + 0.1, torch.rand(4) * 0.5
    for method in methods(layout):
        (xa, wa, va), (xr, wr, vr) = leaves(x, w.double(), vth.double()), leaves(x, w.double(), vth.double())
        s = ops.mf_psn(xa, wa, v_threshold=va, dilation=2, layout=layout, method=method, quantize=quantize)
        h_ref, _ = reference.mfpsn_charge(xr, wr, 2, layout, "param", quantize is not None, v_threshold=vr,
                                          ste=quantize or "whole")
        check_close(s, surrogate.ATan()(h_ref), h_ref, [xa, wa, va], [xr, wr, vr])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("training", [True, False])
def test_bn_threshold_matches_the_reference_and_torch_batch_norm(layout, training):
    """The spikes and gradients of the reference's folded BN; the running statistics after the call are
    those torch.nn.functional.batch_norm leaves for the charge (momentum and cumulative average)."""
    torch.manual_seed(3)
    x = make_input(6, 4, 3, (2,), layout, torch.float64, False) * 2 + 0.5
    w = torch.rand(3, 2, dtype=torch.float64) + 0.1
    gamma, beta = torch.rand(3, dtype=torch.float64) + 0.5, torch.rand(3, dtype=torch.float64) - 0.5
    for method in methods(layout):
        for momentum in (0.1, None):
            rm, rv = torch.randn(3, dtype=torch.float64) * 0.1, torch.rand(3, dtype=torch.float64) + 0.5
            tracked = torch.tensor(3)
            (xa, wa, ga, ba), (xr, wr, gr, br) = leaves(x, w, gamma, beta), leaves(x, w, gamma, beta)
            bn = ops.BatchNorm(ga, ba, rm.clone(), rv.clone(), 1e-5, momentum, tracked.clone())
            s = ops.mf_psn(xa, wa, bn=bn, layout=layout, method=method, training=training)
            h_ref, _ = reference.mfpsn_charge(xr, wr, 1, layout, "bn", True, gr, br,
                                              stats=None if training else (rm, rv))
            check_close(s, surrogate.ATan()(h_ref), h_ref, [xa, wa, ga, ba], [xr, wr, gr, br], atol=1e-5)
            h = reference.charge(x, w, None, 1, layout)
            want_rm, want_rv = rm.clone(), rv.clone()
            # (torch's cumulative average counts this batch first, as the module does)
            torch.nn.functional.batch_norm(h.movedim(ops.channel_dim(layout), 1), want_rm, want_rv,
                                           training=training, momentum=momentum if momentum is not None else 1 / 4)
            torch.testing.assert_close(bn.running_mean, want_rm, msg=method)
            torch.testing.assert_close(bn.running_var, want_rv, msg=method)
            assert int(bn.num_batches_tracked) == 3 + training


def strided(t):
    """``t``'s values as a view of stride 2 (every other element of a longer tensor), differentiable."""
    return torch.stack([t, torch.zeros_like(t)], -1)[..., 0]


def normalized_reference(x, layout, gamma0, beta0, rm0, rv0, training, momentum, eps=1e-5):
    """X through a batch norm over every axis but the channels, written out (torch's CPU batch norm
    misreads the gradients of some strided inputs); the running statistics are updated in place by
    torch's, without gradients."""
    cd = ops.channel_dim(layout)
    dims, shape = [d for d in range(x.dim()) if d != cd], [-1 if d == cd else 1 for d in range(x.dim())]
    with torch.no_grad():
        torch.nn.functional.batch_norm(x.movedim(cd, 1).contiguous(), rm0, rv0, None, None, training, momentum)
    mean = x.mean(dims, keepdim=True) if training else rm0.view(shape)
    var = ((x - mean) ** 2).mean(dims, keepdim=True) if training else rv0.view(shape)
    y = (x - mean) / torch.sqrt(var + eps)
    return y if gamma0 is None else y * gamma0.view(shape) + beta0.view(shape)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("threshold", ["bn", "param"])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("t,n,feat", [(6, 4, (2,)), (1, 1, (2,)), (2, 1, (1, 1)), (4, 2, ())])
def test_an_input_batch_norm_is_torch_batch_norm_then_the_neuron(layout, threshold, training, t, n, feat):
    """input_bn: every method gives the reference neuron on torch's batch norm of X: spikes, gradients
    (the input batch norm's gamma and beta included) and both batch norms' running statistics; without
    an affine too. X in reversed memory order, the batch norms' gamma and beta strided views; with one
    sample and size-1 dims, and with no feature dims, which torch's CPU batch-norm backward gets wrong
    at these strides."""
    torch.manual_seed(6)
    x = make_input(t, n, 3, feat, layout, torch.float64, False) * 2 + 1.5
    w = torch.rand(3, 2, dtype=torch.float64) + 0.1
    gamma, beta, g0, b0 = (torch.rand(3, dtype=torch.float64) + 0.5 for _ in range(4))
    for method in methods(layout):
        for affine, momentum in ((True, 0.1), (False, None)):
            rm0, rv0 = torch.randn(3, dtype=torch.float64) * 0.1, torch.rand(3, dtype=torch.float64) + 0.5
            (xa, wa, ga, ba, ga0, ba0), ref = leaves(x, w, gamma, beta, g0, b0), leaves(x, w, gamma, beta, g0, b0)
            tracked = torch.tensor(2)
            input_bn = ops.BatchNorm(strided(ga0) if affine else None, strided(ba0) if affine else None, rm0.clone(),
                                     rv0.clone(), 1e-5, momentum, tracked)
            rm, rv = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
            args = {"bn": ops.BatchNorm(strided(ga), strided(ba), rm.clone(), rv.clone())} if threshold == "bn" \
                else {"v_threshold": strided(ba)}
            s = ops.mf_psn(xa, wa, input_bn=input_bn, dilation=2, layout=layout, method=method, training=training,
                           **args)
            want_rm0, want_rv0 = rm0.clone(), rv0.clone()
            y = normalized_reference(ref[0], layout, ref[4] if affine else None, ref[5] if affine else None, want_rm0,
                                     want_rv0, training, momentum if momentum is not None else 1 / 3)
            h_ref, _ = reference.mfpsn_charge(y, ref[1], 2, layout, threshold, True, ref[2], ref[3],
                                              v_threshold=ref[3], stats=None if training else (rm, rv))
            inputs = [xa, wa] + ([ga, ba] if threshold == "bn" else [ba]) + ([ga0, ba0] if affine else [])
            inputs_ref = ref[:2] + (ref[2:4] if threshold == "bn" else [ref[3]]) + (ref[4:] if affine else [])
            check_close(s, surrogate.ATan()(h_ref), h_ref, inputs, inputs_ref, atol=1e-5)
            torch.testing.assert_close(input_bn.running_mean, want_rm0, msg=method)
            torch.testing.assert_close(input_bn.running_var, want_rv0, msg=method)
            assert int(tracked) == 2 + training


def test_bad_input_batch_norms_are_named():
    x, w = torch.randn(5, 2, 3), torch.rand(3, 2)
    bn = ops.BatchNorm(torch.ones(3), torch.zeros(3), torch.zeros(3), torch.ones(3))
    cases = [
        (dict(input_bn=bn._replace(gamma=torch.ones(4))), r"input_bn.gamma must be a tensor of shape \(3,\)"),
        (dict(input_bn=bn._replace(running_var=torch.ones(3, dtype=torch.float64))), "in the weight's dtype"),
        (dict(input_bn=bn._replace(eps=-1.0)), "input_bn.eps must be a finite number > 0"),
        (dict(input_bn=bn._replace(running_mean=None)), "input_bn needs running_mean and running_var"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            ops.mf_psn(x, w, bn=bn, **kwargs)


@pytest.mark.parametrize("threshold", ["param", "bn"])
def test_one_step_equals_the_step_of_the_sequence(threshold):
    """mf_psn_step fed the inputs its taps read gives step t of mf_psn on the whole sequence (eval)."""
    torch.manual_seed(4)
    k, d, t = 3, 2, 7
    x = torch.randn(t, 2, 4, 3) * 2
    w = torch.rand(4, k) + 0.1
    args = {"v_threshold": torch.rand(4)} if threshold == "param" else \
        {"bn": ops.BatchNorm(torch.rand(4) + 0.5, torch.rand(4) - 0.5, torch.randn(4) * 0.1, torch.rand(4) + 0.5)}
    for method in ("auto", "shift_add", *(["cpp"] if "cpp" in ops.names() else [])):
        with torch.no_grad():
            want = ops.mf_psn(x, w, dilation=d, method=method, **args)
            got = torch.stack([ops.mf_psn_step(ops.step_taps(tuple(x[:i + 1]), k, d), w, method=method, **args)
                               for i in range(t)])
        assert torch.equal(got, want), method


def test_bad_arguments_are_named():
    x, w = torch.randn(5, 2, 3), torch.rand(3, 2)
    cases = [
        (dict(bias=torch.zeros(3), v_threshold=torch.zeros(3)), "at most one of bias, v_threshold and bn"),
        (dict(v_threshold=torch.zeros(4)), r"v_threshold must be a tensor of shape \(3,\)"),
        (dict(bn=ops.BatchNorm(torch.ones(3), torch.zeros(3))), "running_mean and running_var when training=False"),
        (dict(bn=ops.BatchNorm(torch.ones(3), torch.zeros(2)), training=True), r"bn.beta must be a tensor of shape"),
        (dict(bn=ops.BatchNorm(torch.ones(3), torch.zeros(3), eps=0.0), training=True), "bn.eps must be a finite number > 0"),
        (dict(quantize="floor"), "quantize must be one of"),
        (dict(method="nope"), "method must be one of"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            ops.mf_psn(x, w, **kwargs)
    with pytest.raises(ValueError, match="weight has 3 channels but x has 4"):
        ops.mf_psn(torch.randn(5, 2, 4), w)
    with pytest.raises(TypeError, match="floating-point"):
        ops.mf_psn(x.int(), w)
    with pytest.raises(ValueError, match="weight contains NaN or inf"):
        ops.mf_psn(x, torch.full((3, 2), float("nan")), v_threshold=torch.zeros(3))
    with pytest.raises(ValueError, match="one entry of taps per tap"):
        ops.mf_psn_step([x[0]], w)


def test_the_old_entry_points_warn_and_agree():
    torch.manual_seed(5)
    x, w, b = torch.randn(6, 2, 3), torch.rand(3, 2), torch.randn(3)
    sg = surrogate.ATan()
    with pytest.deprecated_call():
        s = ops.fire(x, w, b, 1, "time_first", "shift_add", sg)
    assert torch.equal(s, ops.mf_psn(x, w, bias=b, quantize=None, method="shift_add"))
    with pytest.deprecated_call():
        mean, var = ops.batch_stats(x, w, 1, "time_first", "shift_add")
    h = reference.charge(x.double(), w.double(), None, 1, "time_first")
    torch.testing.assert_close(mean.double(), h.mean((0, 1)))
    torch.testing.assert_close(var.double(), h.var((0, 1), unbiased=False))
    for name in ("bn_fire", "bn_fire_direct", "param_fire", "step_fire"):
        with pytest.deprecated_call():
            args = ([x[-1], x[-1]], w, b, None, True) if name == "step_fire" else \
                (x, w, b, "whole", 1, "time_first") if name == "param_fire" else \
                (x, w, torch.ones(3), torch.zeros(3), 1e-5, "whole", 1, "time_first")
            assert getattr(ops, name)(*args, "shift_add", sg) is None  # (shift_add has no fused step)
