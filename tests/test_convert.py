"""Whole networks in both layouts: to_time_last gives the time-first network's outputs, gradients and
running statistics; to_time_first undoes it exactly; checkpoints load across layouts; modules without
a time-last version raise a clear error (or run time-first with fallback='time_first')."""
import collections
import pickle
import re
import warnings
import copy

import pytest
import torch
import torch.nn as nn
from spikingjelly.activation_based import base, functional, layer, neuron

import spikingjelly_mfpsn as mf
from spikingjelly_mfpsn import MulFreeChannelwisePSN, to_time_first, to_time_last
from spikingjelly_mfpsn.convert import UnconvertibleModuleError, has_time_last_boundary

import zoo

TOL = dict(rtol=1e-9, atol=1e-9)


def seq_cifar_net(c=8, fc=16, classes=10, height=8, k=2):
    """The paper's sequential-CIFAR network (Appendix E) with small widths:
    {{c<c>k3s1-BN-SN}*3-APk2s2}*2-FC<fc>-SN-FC<classes}; one time step is one image column (3, H).
    SN is MF-PSN with the sawtooth dilations 1, 2, 3, 1, 2, 3, ..."""
    layers, in_c, n_sn = [], 3, 0

    def sn(channels):
        nonlocal n_sn
        n_sn += 1
        return MulFreeChannelwisePSN(channels, k=k, dilation=1 + (n_sn - 1) % 3, step_mode="m")

    for _ in range(2):
        for _ in range(3):
            layers += [layer.Conv1d(in_c, c, 3, 1, padding=1), layer.BatchNorm1d(c), sn(c)]
            in_c = c
        layers.append(layer.AvgPool1d(2, 2))
    layers += [layer.Flatten(), layer.Linear(c * (height // 4), fc), sn(fc), layer.Linear(fc, classes)]
    net = nn.Sequential(*layers)
    functional.set_step_mode(net, "m")
    return net


def structure(net):
    return [(name, type(m), id(m)) for name, m in net.named_modules()]


def run(net, x):
    """Output, and gradients of <output, g> (g random, seeded) w.r.t. the input and every named parameter."""
    x = x.clone().requires_grad_()
    y = net(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    names, params = zip(*net.named_parameters())
    grads = torch.autograd.grad(y, (x,) + params, g, allow_unused=True, materialize_grads=True)
    return y.detach(), dict(zip(("input",) + names, grads))


def assert_same_run(net_a, net_b, x):
    y_a, grads_a = run(net_a, x)
    y_b, grads_b = run(net_b, x)
    functional.reset_net(net_a), functional.reset_net(net_b)
    torch.testing.assert_close(y_b, y_a, **TOL)
    assert grads_b.keys() == grads_a.keys()
    for key in grads_a:
        torch.testing.assert_close(grads_b[key], grads_a[key], **TOL, msg=lambda m: f"{key}: {m}")
    sd_a, sd_b = net_a.state_dict(), net_b.state_dict()
    assert list(sd_a) == list(sd_b)
    for key in sd_a:  # running statistics of BN and of the neurons' fused BN thresholds
        torch.testing.assert_close(sd_b[key], sd_a[key], **TOL, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("method", ["vmap", "highdim"])
def test_sequential_cifar_net_same_in_both_layouts(method):
    torch.manual_seed(0)
    net_tf = seq_cifar_net().double()
    net_tl = to_time_last(copy.deepcopy(net_tf), method=method)
    assert has_time_last_boundary(net_tl)
    assert all(m.layout == "time_last" for m in net_tl.modules() if isinstance(m, MulFreeChannelwisePSN))
    x = torch.randn(6, 3, 3, 8, dtype=torch.float64)  # (T columns, N, RGB, H rows)
    for _ in range(2):  # training: batch statistics, running statistics updated
        assert_same_run(net_tf, net_tl, x)
    net_tf.eval(), net_tl.eval()
    assert_same_run(net_tf, net_tl, x)


def built_zoo_net(name, x):
    torch.manual_seed(0)
    net = zoo.BUILDERS[name](MulFreeChannelwisePSN, k=2).double()
    net.eval()
    net(x)  # materialises the lazy neurons (eval: running statistics untouched)
    functional.reset_net(net)
    return net.train()


@pytest.mark.parametrize("name", list(zoo.BUILDERS))
def test_zoo_net_same_in_both_layouts(name):
    x = torch.randn(2, 2, 3, 8, 8, dtype=torch.float64)
    net_tf = built_zoo_net(name, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net_tl = to_time_last(copy.deepcopy(net_tf), example_input=x)
    assert_same_run(net_tf, net_tl, x)


def test_checkpoints_load_across_layouts():
    torch.manual_seed(0)
    x = torch.randn(5, 2, 3, 8, dtype=torch.float64)
    trained_tl = to_time_last(seq_cifar_net().double())
    trained_tl(x)  # move the running statistics away from their initial values
    fresh_tf = seq_cifar_net().double()
    fresh_tf.load_state_dict(trained_tl.state_dict())
    trained_tl.eval(), fresh_tf.eval()
    torch.testing.assert_close(fresh_tf(x), trained_tl(x), **TOL)
    fresh_tl = to_time_last(seq_cifar_net().double()).eval()
    fresh_tl.load_state_dict(fresh_tf.state_dict())
    torch.testing.assert_close(fresh_tl(x), fresh_tf(x), **TOL)


def test_to_time_first_undoes_to_time_last_exactly():
    x = torch.randn(2, 2, 3, 8, 8, dtype=torch.float64)
    net = built_zoo_net("sew_resnet", x).eval()
    before = structure(net)
    sd = {k: v.clone() for k, v in net.state_dict().items()}
    want = net(x)
    with pytest.warns(UserWarning, match=r"no example_input was given"):  # (converts the modules only)
        net_tl = to_time_last(net)
    assert structure(net_tl) != before
    assert to_time_last(net_tl) is net_tl and structure(net_tl) == structure(to_time_last(net_tl))
    assert has_time_last_boundary(net_tl)
    functional.reset_net(net_tl)
    torch.testing.assert_close(net_tl(x), want, **TOL)  # (the boundary is installed once)
    back = to_time_first(net_tl)
    assert back is net and structure(back) == before and not has_time_last_boundary(back)
    assert all(m.layout == "time_first" for m in back.modules() if isinstance(m, MulFreeChannelwisePSN))
    for k, v in back.state_dict().items():
        assert torch.equal(v, sd[k])
    assert to_time_first(back) is back and structure(back) == before


_Pair = collections.namedtuple("_Pair", "logits spikes")


class _Structured(nn.Module):
    """A network whose output holds its tensors in a container of the kind ``kind``."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.body = nn.Sequential(layer.Linear(3, 4), MulFreeChannelwisePSN(4, k=2, step_mode="m"))
        self.head = layer.Linear(4, 2)
        functional.set_step_mode(self, "m")

    def forward(self, x):
        spikes = self.body(x)
        logits = self.head(spikes)
        if self.kind == "namedtuple":
            return _Pair(logits, spikes)
        if self.kind == "defaultdict":
            out = collections.defaultdict(list, logits=logits)
            out["extra"].append(spikes)
            return out
        out = (collections.OrderedDict if self.kind == "OrderedDict" else dict)(logits=logits, note="a non-tensor value")
        out["nested"] = [spikes, (spikes.sum(),)]
        return out


@pytest.mark.parametrize("kind", ["dict", "OrderedDict", "defaultdict", "namedtuple"])
def test_structured_outputs_leave_the_boundary_time_first(kind):
    """The boundary moves every tensor of the output back to (T, N, ...): dicts came out time-last
    (a wrong answer), and a namedtuple failed to rebuild."""
    torch.manual_seed(0)
    net, x = _Structured(kind), torch.rand(5, 3, 3)
    expected = net(x)
    functional.reset_net(net)
    got = to_time_last(copy.deepcopy(net))(x)
    assert type(got) is type(expected)
    flat_expected, spec = torch.utils._pytree.tree_flatten(expected)
    flat_got, spec_got = torch.utils._pytree.tree_flatten(got)
    assert spec_got == spec
    for a, b in zip(flat_got, flat_expected):
        if isinstance(b, torch.Tensor):
            torch.testing.assert_close(a, b)
        else:
            assert a == b
    if kind == "defaultdict":
        assert got.default_factory is list


def test_plain_torch_modules_and_containers():
    """Plain torch.nn layers: per step inside SeqToANNContainer; a top-level nn.Flatten sees (T, N, ...)."""
    torch.manual_seed(0)
    net = nn.Sequential(
        layer.SeqToANNContainer(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4)),
        MulFreeChannelwisePSN(4, k=3, step_mode="m"),
        nn.Sequential(layer.MaxPool2d(2), nn.Identity()),
        nn.Flatten(2),
        nn.Linear(16, 5),
        nn.ReLU(),
        layer.SeqToANNContainer(nn.Linear(5, 3)),
    ).double()
    functional.set_step_mode(net, "m")
    net_tl = to_time_last(copy.deepcopy(net))
    assert isinstance(net_tl[0], mf.layer.TimeLastSequential) and isinstance(net_tl[3], mf.layer.TimeLastFlatten)
    assert_same_run(net, net_tl, torch.randn(4, 3, 2, 4, 4, dtype=torch.float64))
    net_tl.eval()
    back = to_time_first(net_tl)
    assert type(back[0]) is layer.SeqToANNContainer and type(back[3]) is nn.Flatten
    assert not any(m.training for m in back.modules()), "train/eval mode must carry over"


def test_dropout_and_reset_net_in_a_converted_net():
    torch.manual_seed(0)
    net = nn.Sequential(layer.Linear(6, 8), MulFreeChannelwisePSN(8, step_mode="m"), layer.Dropout(0.5),
                        layer.Linear(8, 4))
    functional.set_step_mode(net, "m")
    net_tl = copy.deepcopy(net)
    functional.reset_net(net_tl)  # SpikingJelly 2.x caches the modules reset_net visits
    net_tl = to_time_last(net_tl)
    x = torch.randn(5, 3, 6)
    for seed in (1, 2):  # two simulations, each with its own dropout mask
        torch.manual_seed(seed)
        y = net(x)
        torch.manual_seed(seed)
        torch.testing.assert_close(net_tl(x), y, rtol=1e-6, atol=1e-6)
        functional.reset_net(net), functional.reset_net(net_tl)
        assert net_tl[2].mask is None, "reset_net must reach the time-last Dropout"


def test_reset_net_of_the_parent_reaches_a_converted_block():
    """Regression: converting a block (``net.features = to_time_last(net.features)``) after
    ``reset_net(net)`` left SpikingJelly 2.x's cache of ``net`` naming the old Dropout (kept alive by
    the wrapper), so the new one's mask survived ``reset_net(net)`` into the next sequence."""
    torch.manual_seed(0)
    net = nn.Sequential()
    net.features = nn.Sequential(layer.Linear(4, 8), layer.Dropout(0.5), MulFreeChannelwisePSN(8, k=2))
    functional.set_step_mode(net, "m")
    x = torch.rand(3, 2, 4)
    functional.reset_net(net)
    net.features = to_time_last(net.features, example_input=x)
    drop = next(m for m in net.modules() if type(m).__name__ == "TimeLastDropout")
    net(x)
    assert drop.mask is not None
    functional.reset_net(net)
    assert drop.mask is None, "reset_net(net) must reach the converted block's Dropout"
    net(x)
    net.features = to_time_first(net.features)
    functional.reset_net(net)
    assert net.features[1].mask is None, "and, converted back, the time-first one"


def test_boundary_false_takes_time_last_tensors():
    torch.manual_seed(0)
    net = seq_cifar_net().double().eval()
    x = torch.randn(5, 2, 3, 8, dtype=torch.float64)
    y = net(x)
    net_tl = to_time_last(copy.deepcopy(net), boundary=False)
    assert not has_time_last_boundary(net_tl)
    torch.testing.assert_close(net_tl(x.movedim(0, -1)), y.movedim(0, -1), **TOL)


@pytest.mark.parametrize("method", ["vmap", "highdim"])
def test_a_layer_used_at_two_places_converts_at_both(method):
    """Shared weights: the same Conv1d and the same SeqToANNContainer at two places of a network (as
    ``named_children`` lists them once, the second place used to stay time-first and break the run)."""
    torch.manual_seed(0)
    conv = layer.Conv1d(4, 4, 3, padding=1, step_mode="m")
    block = layer.SeqToANNContainer(nn.Conv1d(4, 4, 1), nn.BatchNorm1d(4))
    net = nn.Sequential(layer.Conv1d(2, 4, 3, padding=1, step_mode="m"), MulFreeChannelwisePSN(4, k=2, step_mode="m"),
                        conv, block, MulFreeChannelwisePSN(4, k=2, step_mode="m"),
                        conv, block, MulFreeChannelwisePSN(4, k=2, dilation=2, step_mode="m")).double()
    x = torch.rand(6, 3, 2, 8, dtype=torch.float64)
    reference = copy.deepcopy(net)
    to_time_last(net, method=method)
    assert net[2] is net[5] and isinstance(net[2], mf.layer.TimeLastConv)
    assert net[3] is net[6] and isinstance(net[3], mf.layer.TimeLastSequential)
    assert_same_run(reference, net, x)
    to_time_first(net)
    assert net[2] is conv and net[5] is conv and net[3] is block and net[6] is block
    assert_same_run(reference, net, x)


def lif_net():
    net = nn.Sequential(layer.Conv2d(2, 4, 3, padding=1), layer.BatchNorm2d(4), neuron.IFNode(),
                        layer.Flatten(), layer.Linear(4 * 16, 3), neuron.LIFNode())
    functional.set_step_mode(net, "m")
    return net


def test_unconvertible_modules_raise_and_change_nothing():
    net = lif_net()
    before = structure(net)
    with pytest.raises(UnconvertibleModuleError) as info:
        to_time_last(net)
    msg = str(info.value)
    assert "2 (IFNode): a stateful SpikingJelly module" in msg and "5 (LIFNode)" in msg
    assert "fallback='time_first'" in msg
    assert structure(net) == before and not has_time_last_boundary(net)

    class Custom(nn.Module):
        def forward(self, x):
            return x.cumsum(0)
    psn = MulFreeChannelwisePSN(3, step_mode="m")
    net = nn.Sequential(layer.Linear(2, 3), psn, nn.Sequential(Custom()))
    functional.set_step_mode(net, "m")
    with pytest.raises(UnconvertibleModuleError, match=r"2\.0 \(Custom\): not a stateless layer"):
        to_time_last(net)
    assert psn.layout == "time_first" and type(net[0]) is layer.Linear
    with pytest.raises(UnconvertibleModuleError, match=r"0\.0 \(LSTM\)"):
        to_time_last(nn.Sequential(layer.SeqToANNContainer(nn.LSTM(2, 2))))
    with pytest.raises(ValueError, match="fallback must be one of"):
        to_time_last(net, fallback="vmap")


class NeuronStepLoop(nn.Module):
    """A forward that steps a single-step MF-PSN through time itself."""

    def __init__(self):
        super().__init__()
        self.fc, self.sn, self.out = nn.Linear(6, 5), MulFreeChannelwisePSN(5, k=2), nn.Linear(5, 3)

    def forward(self, x):
        return torch.stack([self.out(self.sn(self.fc(x[t]))) for t in range(x.shape[0])]).mean(0)


def test_a_forward_stepping_a_neuron_itself_is_refused_even_while_it_does_not_fire():
    """A fresh MF-PSN does not fire in eval mode, so no output comparison can tell that a trace of such a
    forward holds the example's number of steps; the single-step neuron in the trace is refused."""
    torch.manual_seed(0)
    net, x = NeuronStepLoop().eval(), torch.rand(4, 3, 6)
    before = structure(net)
    with pytest.raises(UnconvertibleModuleError, match="step_mode='m'"):
        to_time_last(net, example_input=x)
    assert structure(net) == before and not has_time_last_boundary(net)


class SecondInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.sn = layer.Linear(6, 3, step_mode="m"), MulFreeChannelwisePSN(3, k=2, step_mode="m")

    def forward(self, x, bias):  # bias: (N, 3), one row per sample
        return self.sn(self.fc(x)).mean(0) + bias


def test_a_network_the_check_cannot_run_is_refused_by_name_and_autoselect_skips_time_last():
    """The check runs the network on two samples of the first input (other inputs as they are): a
    second per-sample input does not fit, which is said (not a broadcasting error), and autoselect
    keeps the time-first layout."""
    torch.manual_seed(0)
    net, x, bias = SecondInput(), torch.rand(4, 3, 6), torch.rand(3, 3)
    with pytest.raises(UnconvertibleModuleError, match="does not run on the inputs made from example_input"):
        to_time_last(net, example_input=(x, bias))
    assert not has_time_last_boundary(net)
    with pytest.warns(UserWarning, match="cannot run in layout 'time_last'"):
        report = mf.autoselect(net, (x, bias), cache=False)
    assert report.layout == "time_first"


def test_single_step_network_is_rejected():
    net = nn.Sequential(layer.Linear(2, 3), MulFreeChannelwisePSN(3))  # step_mode 's'
    with pytest.raises(UnconvertibleModuleError, match=r"0 \(Linear\) has step_mode='s'"):
        to_time_last(net)


def test_fallback_runs_modules_time_first():
    torch.manual_seed(0)
    net = lif_net().double()
    net_tl = to_time_last(copy.deepcopy(net), fallback="time_first")
    assert isinstance(net_tl[0], mf.layer.TimeLastConv) and isinstance(net_tl[2], neuron.IFNode)
    x = torch.rand(4, 2, 2, 4, 4, dtype=torch.float64) * 2
    assert_same_run(net, net_tl, x)
    back = to_time_first(net_tl)
    assert type(back[0]) is layer.Conv2d and type(back[2]) is neuron.IFNode
    assert_same_run(net, back, x)


class Square(nn.Module):
    """A per-step layer this package does not know."""

    def forward(self, x):
        return x * x


def test_fallback_runs_a_container_with_an_unknown_child_time_first():
    torch.manual_seed(0)
    net = nn.Sequential(layer.SeqToANNContainer(nn.Linear(3, 4), Square()),
                        MulFreeChannelwisePSN(4, step_mode="m"), layer.Linear(4, 2)).double()
    functional.set_step_mode(net, "m")
    with pytest.raises(UnconvertibleModuleError, match=r"0\.1 \(Square\)"):
        to_time_last(net)
    net_tl = to_time_last(copy.deepcopy(net), fallback="time_first")
    assert isinstance(net_tl[0], layer.SeqToANNContainer) and net_tl[1].layout == "time_last"
    assert_same_run(net, net_tl, torch.randn(5, 2, 3, dtype=torch.float64))


# ---------------------------------------------------------------------------- functional calls in forward
class CallsNet(nn.Module):
    """Conv-BN-MF-PSN-pool, then the calls in forward that ``kind`` names, which depend on where the
    time axis is (the zoo's VGGs flatten 7x7 maps, the MS-ResNets average over time...)."""

    def __init__(self, kind, c=4, classes=5):
        super().__init__()
        self.kind = kind
        self.conv, self.bn = layer.Conv2d(2, c, 3, padding=1), layer.BatchNorm2d(c)
        self.sn = MulFreeChannelwisePSN(c, k=2, step_mode="m")
        self.pool = layer.AdaptiveAvgPool2d((3, 3))
        self.pos = nn.Parameter(torch.randn(c, 1, 1))  # broadcast against (T, N, c, H, W)
        self.fc, self.fc2 = layer.Linear(c * 9, classes), layer.Linear(2 * c * 9, classes)
        self.sn2 = MulFreeChannelwisePSN(classes, k=2, step_mode="m")
        functional.set_step_mode(self, "m")

    def forward(self, x):
        if self.kind == "branch_on_rank" and x.ndim == 4:  # symbolic tracing fails here: traced concretely
            x = x.unsqueeze(0).repeat(3, 1, 1, 1, 1)
        x = self.pool(self.sn(self.bn(self.conv(x)) + self.pos))
        return getattr(self, self.kind if self.kind != "branch_on_rank" else "flatten_mean")(x)

    def flatten_mean(self, x):
        return self.fc(torch.flatten(x, 2)).mean(0)

    def reshape(self, x):
        T, N, C, H, W = x.shape
        return self.sn2(self.fc(x.reshape(T, N, C * H * W).view(T, N, -1)))

    def cat(self, x):
        return self.fc2(torch.cat([x, x * 2], dim=2).flatten(2)).sum(dim=0)

    def stack(self, x):
        return self.fc(torch.stack([x, 1 - x], dim=2).sum(2).flatten(start_dim=2))

    def index(self, x):
        y = self.fc(x.flatten(2))
        return y[-1] + y[..., None][..., 0] + y[:, 0][:, None]

    def softmax(self, x):
        return torch.softmax(x, dim=2).sum((3, 4)).unsqueeze(-1).squeeze(-1).amax(dim=1)

    def transpose(self, x):
        return self.fc(x.transpose(0, 1).flatten(2).transpose(0, 1).permute(0, 1, 2))

    def matmul(self, x):  # no time-last rule: runs on the original form
        y = x.flatten(3)
        return self.fc(torch.flatten(y @ y.transpose(-2, -1), 2).repeat(1, 1, 3)[..., :36])


CALL_KINDS = ["flatten_mean", "branch_on_rank", "reshape", "cat", "stack", "index", "softmax", "transpose",
              "matmul"]


@pytest.mark.parametrize("kind", CALL_KINDS)
def test_functional_calls_in_forward_are_rewritten(kind):
    torch.manual_seed(0)
    x = torch.rand(3, 4, 2, 6, 6, dtype=torch.float64)
    net_tf = CallsNet(kind).double()
    net_tl = to_time_last(copy.deepcopy(net_tf), example_input=x)
    assert has_time_last_boundary(net_tl)
    assert isinstance(net_tl.conv, mf.layer.TimeLastConv) and net_tl.sn.layout == "time_last"
    assert bool(net_tl.forward.time_first_calls) == (kind == "matmul")
    for _ in range(2):  # training: batch statistics, running statistics updated
        assert_same_run(net_tf, net_tl, x)
    net_tf.eval(), net_tl.eval()
    assert_same_run(net_tf, net_tl, torch.rand(4, 1, 2, 6, 6, dtype=torch.float64))  # other T and N


def test_time_axis_kept_apart_from_batch_with_one_sample():
    """An example with N=1 cannot tell T*N from T: the conversion must not take one for the other."""
    class Merge(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = layer.Linear(3, 2)
            functional.set_step_mode(self, "m")

        def forward(self, x):
            T, N = x.shape[:2]
            return self.fc(x).flatten(0, 1).reshape(T, N, 2).mean(0)

    x = torch.randn(4, 1, 3, dtype=torch.float64)
    net_tf = Merge().double()
    net_tl = to_time_last(copy.deepcopy(net_tf), example_input=x)
    y = torch.randn(4, 3, 3, dtype=torch.float64)
    torch.testing.assert_close(net_tl(y), net_tf(y), **TOL)


def test_layout_dependent_calls_without_example_input_warn_or_raise():
    net = CallsNet("flatten_mean").double()
    before = structure(net)
    with pytest.raises(UnconvertibleModuleError, match=r"flatten .*torch\.flatten\(x, 2\)"):
        to_time_last(net, strict=True)
    assert structure(net) == before and not has_time_last_boundary(net)
    with pytest.warns(UserWarning, match=r"cannot rewrite CallsNet\.forward.*flatten.*pass example_input"):
        to_time_last(net)


class DataBranch(nn.Module):
    """A forward whose control flow follows the data (a trace would record one branch) and ends in a
    mean over time."""

    def __init__(self):
        super().__init__()
        self.fc = layer.Linear(3, 2)
        functional.set_step_mode(self, "m")

    def forward(self, x):
        y = self.fc(x)
        if y.sum() > 0:
            y = -y
        return y.mean(0)


class StepLoop(nn.Module):
    """A forward that loops over the time steps: a trace records the example's number of steps."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return torch.stack([self.fc(x[t]) for t in range(x.shape[0])]).flatten(1)


class TrainingBranch(DataBranch):
    """A forward that branches on ``self.training`` (a trace records the branch of the mode it ran in)."""

    def forward(self, x):
        y = self.fc(x)
        if self.training:
            y = y * 0.5
        return y.mean(0)


class TrainingTimeMean(DataBranch):
    """A mean over time in training mode only: modules-only conversion is right in eval mode alone."""

    def forward(self, x):
        y = self.fc(x)
        return y.mean(0, keepdim=True).expand_as(y) if self.training else y


class NoGradBlock(DataBranch):
    """A forward with a ``torch.no_grad()`` block (a trace records its calls, not the gradient mode)."""

    def forward(self, x):
        y = self.fc(x)
        with torch.no_grad():
            baseline = y.mean(0)
        return (y - baseline).mean(0)


class ItemBranch(DataBranch):
    """A branch on the data through a Python number (``.item()``): a trace would record one branch."""

    def forward(self, x):
        y = self.fc(x)
        if y.mean().item() > 0.0:
            y = -y
        return y.mean(0)


class LengthOfInput(DataBranch):
    """``len(x)`` (T): symbolic tracing fails on it, and a concrete trace holds the example's value."""

    def forward(self, x):
        return self.fc(x) / len(x)


class InPlaceOnSlice(DataBranch):
    """An in-place call no rule rewrites, on a view of a time-last value (it would change a copy)."""

    def forward(self, x):
        y = self.fc(x)
        y[:, 1:].zero_()
        return y


@pytest.mark.parametrize("cls, why", [(DataBranch, "control flow depends on tensor data"),
                                      (ItemBranch, "control flow depends on tensor data"),
                                      (LengthOfInput, "trace fails on an input one step longer"),
                                      (InPlaceOnSlice, "changes a tensor in place"),
                                      (StepLoop, "trace fails on an input one step longer"),
                                      (TrainingBranch, "depends on self.training"),
                                      (TrainingTimeMean, "depends on self.training"),
                                      (NoGradBlock, "switches gradient or autocast mode")])
def test_untraceable_forward_is_never_silently_wrong(cls, why):
    torch.manual_seed(0)
    x = torch.randn(3, 2, 3, dtype=torch.float64)
    net = cls().double()
    expected = net(x)
    before = structure(net)
    with pytest.raises(UnconvertibleModuleError, match="cannot rewrite"):
        to_time_last(net, example_input=x, strict=True)
    with pytest.warns(UserWarning, match=why), pytest.raises(UnconvertibleModuleError, match="left time-first"):
        to_time_last(net, example_input=x)
    assert structure(net) == before and not has_time_last_boundary(net)
    torch.testing.assert_close(net(x), expected, **TOL)


class DataBranchWithDropouts(DataBranch):
    """Untraceable (control flow on the data) but layout-free: its modules convert, dropouts included."""

    def __init__(self):
        super().__init__()
        self.drop, self.elementwise_drop = layer.Dropout(0.5, step_mode="m"), nn.Dropout(0.5)

    def forward(self, x):
        y = self.elementwise_drop(self.drop(self.fc(x)))
        return -y if y.sum() > 0 else y


def test_an_untraceable_forward_with_dropouts_converts_checked_in_both_modes():
    """The modules-only conversion is checked in training mode too, where dropouts draw their masks in
    another order time-last: they do not make it refuse."""
    torch.manual_seed(0)
    x = torch.randn(3, 2, 3, dtype=torch.float64)
    net = DataBranchWithDropouts().double().eval()
    expected = net(x)
    with pytest.warns(UserWarning, match="control flow depends on tensor data"):
        converted = to_time_last(net, example_input=x)
    assert has_time_last_boundary(converted)
    torch.testing.assert_close(converted(x), expected, **TOL)
    assert converted.train()(x).shape == x.shape[:2] + (2,)


class NoisyTraining(DataBranch):
    """Noise added in training mode only, element-wise (valid in either layout), after an untraceable
    branch on the data."""

    def forward(self, x):
        y = self.fc(x)
        if self.training:
            y = y + 0.1 * torch.randn_like(y)
        return -y if y.sum() > 0 else y


def test_a_forward_drawing_random_numbers_in_training_converts_checked_in_eval():
    """The training-mode check compared two runs that draw their noise in another element order: a
    forward adding noise in training was refused (it converted before the check existed)."""
    torch.manual_seed(0)
    x = torch.randn(3, 2, 3, dtype=torch.float64)
    net = NoisyTraining().double()
    expected = net.eval()(x)
    net.train()
    with pytest.warns(UserWarning, match="cannot rewrite"):
        converted = to_time_last(net, example_input=x)
    assert has_time_last_boundary(converted)
    torch.testing.assert_close(converted.eval()(x), expected, **TOL)


@pytest.mark.parametrize("kind, first", [("rewritten", False), ("rewritten", True), ("swapped", False),
                                         ("swapped", True)])
def test_converting_again_with_another_boundary_is_refused(kind, first):
    """A second to_time_last with another ``boundary`` kept the first one (a rewritten forward then read
    its input in the other layout), or added one (a network converted by module swapping then took
    time-first input where its callers gave it time-last)."""
    torch.manual_seed(0)
    net = (CallsNet("reshape") if kind == "rewritten" else seq_cifar_net()).double().eval()
    x = torch.rand(3, 2, 2, 6, 6, dtype=torch.float64) if kind == "rewritten" else torch.randn(5, 2, 3, 8).double()
    reference = net(x)
    functional.reset_net(net)
    converted = to_time_last(copy.deepcopy(net), example_input=x, boundary=first)
    with pytest.raises(ValueError, match=f"with boundary={first}: convert it back first"):
        to_time_last(converted, example_input=x, boundary=not first)
    assert has_time_last_boundary(converted) == first
    out = converted(x if first else x.movedim(0, -1))
    torch.testing.assert_close(out if first else out.movedim(-1, 0), reference, **TOL)
    assert to_time_last(converted, example_input=x, boundary=first) is converted


class ElementwiseTrainingBranch(DataBranch):
    def forward(self, x):
        y = self.fc(x)
        return y * 0.5 if self.training else y


def test_a_training_branch_between_modules_converts_in_both_modes(recwarn):
    """A forward that branches on ``self.training`` but makes no call that depends on the time axis keeps
    its forward: the same outputs in both modes, with no warning."""
    torch.manual_seed(0)
    x = torch.randn(3, 2, 3, dtype=torch.float64)
    net = ElementwiseTrainingBranch().double()
    expected = {mode: net.train(mode)(x) for mode in (True, False)}
    last = to_time_last(copy.deepcopy(net), example_input=x)
    for mode in (True, False):
        torch.testing.assert_close(last.train(mode)(x), expected[mode], **TOL)
    assert not recwarn.list


class FixedSteps(nn.Module):
    """A network for one number of steps (``self.T`` in its forward): the time axes are followed from
    the input, as no input one step longer runs."""

    T = 3

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.sn = MulFreeChannelwisePSN(2, k=2, step_mode="m")
        self.out = layer.Linear(2, 3)
        functional.set_step_mode(self.out, "m")

    def forward(self, x):
        y = self.fc(x.flatten(0, 1)).reshape(self.T, -1, 2)  # per step on (T*N, F)
        return self.out(self.sn(y)).permute(1, 0, 2).mean(1)


def test_network_of_one_number_of_steps_converts():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    net_tf = FixedSteps().double()
    net_tl = to_time_last(copy.deepcopy(net_tf), example_input=x)
    assert net_tl.sn.layout == "time_last" and isinstance(net_tl.out, mf.layer.TimeLastLinear)
    assert_same_run(net_tf, net_tl, x)


def test_rewritten_network_copies_pickles_loads_and_goes_back():
    torch.manual_seed(0)
    x = torch.rand(3, 2, 2, 6, 6, dtype=torch.float64)
    net = CallsNet("reshape").double()
    before, keys = structure(net), list(net.state_dict())
    reference = copy.deepcopy(net).eval()(x)
    net_tl = to_time_last(net, example_input=x).eval()
    assert list(net_tl.state_dict()) == keys
    assert "reshape_time_last" in net_tl.forward.code
    for other in (copy.deepcopy(net_tl), pickle.loads(pickle.dumps(net_tl))):
        torch.testing.assert_close(other(x), reference, **TOL)
        assert other.forward.net is other
    fresh = CallsNet("reshape").double().eval()
    fresh.load_state_dict(net_tl.state_dict())
    torch.testing.assert_close(fresh(x), reference, **TOL)
    assert to_time_last(net_tl, example_input=x) is net_tl
    back = to_time_first(net_tl)
    assert back is net and structure(back) == before and "forward" not in vars(back)
    torch.testing.assert_close(back(x), reference, **TOL)


def test_rewritten_forward_without_boundary_takes_and_gives_time_last():
    torch.manual_seed(0)
    x = torch.rand(3, 2, 2, 6, 6, dtype=torch.float64)
    for kind, time_in_output in (("reshape", True), ("flatten_mean", False)):
        net = CallsNet(kind).double().eval()
        reference = net(x)
        net_tl = to_time_last(net, example_input=x, boundary=False)
        assert not has_time_last_boundary(net_tl)
        out = net_tl(x.movedim(0, -1))
        torch.testing.assert_close(out.movedim(-1, 0) if time_in_output else out, reference, **TOL)


def test_example_input_must_be_a_time_first_tensor():
    net = CallsNet("flatten_mean")
    for bad in ({"x": torch.rand(3, 2, 2, 6, 6)}, torch.tensor(1.0)):
        with pytest.raises(ValueError, match=r"example_input must be a \(T, N, \.\.\.\) tensor"):
            to_time_last(net, example_input=bad)
    assert not has_time_last_boundary(net)


class FirstAndThirdSteps(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = layer.Linear(3, 2, step_mode="m")
        self.sn = MulFreeChannelwisePSN(2, k=2, step_mode="m")

    def forward(self, x):
        return self.sn(self.fc(x)).index_select(0, torch.tensor([0, 2]))


def test_a_forward_with_a_tensor_constant_converts():
    """Regression: a forward that builds a constant tensor was refused as "depends on self.training":
    each trace numbers its tensor constants anew, so the two modes' code differed by a name."""
    torch.manual_seed(0)
    net = FirstAndThirdSteps()
    x = torch.rand(4, 3, 3)
    want = net(x)
    functional.reset_net(net)
    converted = to_time_last(copy.deepcopy(net), example_input=x, strict=True)
    assert torch.equal(converted(x), want)


class StepsAttribute(nn.Module):
    """A forward that reads its number of steps from ``self.T`` (a trace holds it as a constant)."""

    def __init__(self):
        super().__init__()
        self.T = 4
        self.fc = nn.Linear(3, 5)
        self.sn = MulFreeChannelwisePSN(5, k=2, threshold="param", v_threshold=0.1, step_mode="m")

    def forward(self, x):
        return self.sn(self.fc(x.flatten(0, 1)).view(self.T, -1, 5)).mean(0)


@pytest.mark.parametrize("steps, batch", [(8, 1), (8, 2), (2, 4)])
def test_a_converted_forward_refuses_to_run_after_an_attribute_it_read_changed(steps, batch):
    """Regression: the rewritten forward kept ``view(4, -1, 5)`` after ``net.T = 8``: with one sample it
    returned two rows, silently; now it names the attribute, and converting again gives the original's
    outputs."""
    torch.manual_seed(0)
    original = StepsAttribute()
    net = to_time_last(copy.deepcopy(original), example_input=torch.randn(4, 2, 3))
    original.T = net.T = steps
    x = torch.randn(steps, batch, 3)
    with pytest.raises(RuntimeError, match=rf"self\.T: 4 -> {steps}.*to_time_first"):
        net(x)
    net = to_time_last(to_time_first(net), example_input=x)
    functional.reset_net(net)
    torch.testing.assert_close(net(x), original(x))


class CountsCalls(nn.Module):
    """A forward that changes a Python value it reads (a trace would hold the first value)."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.fc = layer.Linear(3, 5, step_mode="m")
        self.sn = MulFreeChannelwisePSN(5, k=2, threshold="param", v_threshold=0.1, step_mode="m")

    def forward(self, x):
        self.calls += 1
        return self.sn(self.fc(x)).flatten(1).mean(1) * (1.0 if self.calls < 3 else 2.0)


def test_a_forward_that_changes_what_it_reads_is_not_rewritten():
    """Regression: the rewritten forward held ``self.calls`` as the trace saw it, so from the third call on
    it gave half the original's outputs, silently; now such a forward is not rewritten (here the modules
    alone do not convert either: refused), and the traces leave the counter as it was."""
    torch.manual_seed(0)
    net, x = CountsCalls(), torch.randn(4, 2, 3)
    with pytest.raises(UnconvertibleModuleError, match=r"changes attributes it reads \(self\.calls: 0 -> "):
        to_time_last(net, example_input=x, strict=True)
    assert net.calls == 0 and not has_time_last_boundary(net)
    with pytest.warns(UserWarning, match=r"changes attributes it reads"), \
            pytest.raises(UnconvertibleModuleError, match="left time-first"):
        to_time_last(net, example_input=x)
    assert not has_time_last_boundary(net)


def test_the_modules_only_warning_does_not_ask_for_the_example_input_it_was_given():
    """With an example input, the modules-only warning must not say ``pass example_input=...``."""
    torch.manual_seed(0)
    x = torch.randn(3, 2, 3, dtype=torch.float64)
    with pytest.warns(UserWarning, match="cannot rewrite") as record, pytest.raises(UnconvertibleModuleError):
        to_time_last(DataBranch().double(), example_input=x)
    messages = [str(w.message) for w in record if "cannot rewrite" in str(w.message)]
    assert messages and not any("pass example_input" in m for m in messages)
    assert all("strict=True raises instead" in m for m in messages)


class LengthBranch(nn.Module):
    """Branches on the number of steps (a rank branch first, as the zoo's do): a concrete trace
    holds the example's branch."""

    def __init__(self):
        super().__init__()
        self.fc, self.sn = layer.Linear(3, 4), MulFreeChannelwisePSN(4, k=2)
        functional.set_step_mode(self, "m")

    def forward(self, x):
        if x.dim() == 2:
            x = x.unsqueeze(0).repeat(5, 1, 1)
        y = self.sn(self.fc(x))
        if y.shape[0] > 4:
            return y.mean(0)
        return y.sum(0)


def test_an_input_that_takes_another_size_branch_than_the_example_is_refused():
    """The converted forward ran the example's branch for every input: the mean over time where the
    network takes the sum (a wrong answer, no error)."""
    torch.manual_seed(0)
    net = LengthBranch().double()
    tl = to_time_last(copy.deepcopy(net), example_input=torch.rand(6, 2, 3, dtype=torch.float64), strict=True)
    for x in (torch.rand(6, 5, 3, dtype=torch.float64), torch.rand(9, 1, 3, dtype=torch.float64)):
        # (the example's branches: the network's outputs)
        functional.reset_net(net), functional.reset_net(tl)
        torch.testing.assert_close(tl(x), net(x), **TOL)
    for x, line in ((torch.rand(4, 2, 3, dtype=torch.float64), "'if y.shape[0] > 4:'"),
                    (torch.rand(3, 3, dtype=torch.float64), "'if x.dim() == 2:'")):
        with pytest.raises(ValueError, match=f"{re.escape(line)} \\(.*test_convert.py:\\d+\\) gives"):
            tl(x)


class SpikesAndInputs(base.MemoryModule):
    """A stateful module of the user's own (a leaf of the trace) that returns a dict."""

    def __init__(self):
        super().__init__()
        self.fc, self.sn = layer.Linear(3, 4), MulFreeChannelwisePSN(4, k=2)
        functional.set_step_mode(self, "m")

    def forward(self, x):
        return {"spikes": self.sn(self.fc(x)), "inputs": x}


class NamedFeatures(nn.Module):
    """Unpacks a dict its block returns into keyword arguments (``**``), after a size branch (so the
    forward is traced concretely, and the dict is a value of the trace)."""

    def __init__(self):
        super().__init__()
        self.features = SpikesAndInputs()

    @staticmethod
    def head(inputs, spikes):
        return spikes.mean(0) - inputs.sum(0).sum(-1, keepdim=True)

    def forward(self, x):
        if x.shape[0] > 1:
            return self.head(**self.features(x))
        return x


def test_a_dict_unpacked_into_keywords_converts():
    torch.manual_seed(0)
    net = NamedFeatures().double()
    tl = to_time_last(copy.deepcopy(net), example_input=torch.rand(4, 2, 3, dtype=torch.float64), strict=True,
                      fallback="time_first")
    for x in (torch.rand(4, 2, 3, dtype=torch.float64), torch.rand(6, 5, 3, dtype=torch.float64)):
        functional.reset_net(net), functional.reset_net(tl)
        torch.testing.assert_close(tl(x), net(x), **TOL)


class SpatialAttention(nn.Module):
    """A per-step block of the user's own with a layout-dependent forward (a softmax over H*W)."""

    def __init__(self, c):
        super().__init__()
        self.score = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        a = self.score(x)
        return x * a.flatten(2).softmax(-1).view_as(a)


def test_a_block_of_its_own_inside_a_seq_to_ann_container_is_not_converted_blind():
    """Regression: its children were swapped for time-last wrappers and its forward kept, which then took
    (N, C, H, W, T): the softmax ran over H*W*T, every output wrong, no error."""
    torch.manual_seed(0)
    net = nn.Sequential(layer.SeqToANNContainer(nn.Conv2d(2, 4, 3, padding=1), SpatialAttention(4)),
                        layer.Linear(8, 3)).double()
    functional.set_step_mode(net, "m")
    x = torch.rand(4, 2, 2, 8, 8, dtype=torch.float64)
    with pytest.raises(UnconvertibleModuleError, match=r"0\.1 \(SpatialAttention\): a module with a forward of its own"):
        to_time_last(copy.deepcopy(net), example_input=x)
    tl = to_time_last(copy.deepcopy(net), example_input=x, fallback="time_first")
    torch.testing.assert_close(tl(x), net(x), **TOL)


class ListOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.sn = layer.Conv2d(2, 4, 3, padding=1), MulFreeChannelwisePSN(4, k=2)
        self.fc = layer.Linear(4 * 16, 3)
        functional.set_step_mode(self, "m")

    def forward(self, x):
        s = self.sn(self.conv(x))
        return [self.fc(s.flatten(2)).mean(0), s]  # (logits and spikes, e.g. for a firing-rate loss)


def test_a_forward_returning_a_list_converts():
    """Regression: refused as giving 'other outputs' (the check compared fx's immutable list by type)."""
    torch.manual_seed(0)
    net = ListOutput().double()
    x = torch.rand(3, 2, 2, 4, 4, dtype=torch.float64)
    tl = to_time_last(copy.deepcopy(net), example_input=x, strict=True)
    functional.reset_net(net)
    got, want = tl(x), net(x)
    assert isinstance(got, list)
    torch.testing.assert_close(got, want, **TOL)


def test_a_network_holding_a_block_converted_on_its_own_is_refused_by_name():
    """Regression: to_time_last swapped its modules without a trace or check (a time-last module was
    inside), and the network failed at its first call inside a conv wrapper."""
    torch.manual_seed(0)
    net = LengthBranch().double()
    net.fc = to_time_last(net.fc)
    with pytest.raises(UnconvertibleModuleError, match=r"blocks converted on their own \(fc\).*to_time_first"):
        to_time_last(net, example_input=torch.rand(6, 2, 3, dtype=torch.float64))


def test_a_dropout_inside_a_seq_to_ann_container_is_not_given_one_mask_for_all_steps():
    """Regression: it became a time-last dropout with one mask for every step, where time-first draws one
    per step and sample (another model, no warning)."""
    net = nn.Sequential(layer.SeqToANNContainer(layer.Dropout(0.5)), layer.Linear(4, 4))
    functional.set_step_mode(net, "m")
    with pytest.raises(UnconvertibleModuleError, match=r"0\.0 \(Dropout\): a dropout inside a SeqToANNContainer"):
        to_time_last(copy.deepcopy(net))
    tl = to_time_last(copy.deepcopy(net), fallback="time_first")  # (the container runs time-first)
    x = torch.randn(6, 3, 4)
    torch.manual_seed(0)
    want = net(x)
    torch.manual_seed(0)
    torch.testing.assert_close(tl(x), want)


def test_method_applies_where_a_wrapper_has_it():
    """Regression: method='highdim' refused a network holding a Conv3d or a 3d pool (no 4-d kernels: they
    run 'vmap' only); it now sets 'highdim' on the layers that have it and runs the rest by vmap."""
    torch.manual_seed(0)
    net = nn.Sequential(layer.Conv3d(2, 3, 3, padding=1), layer.MaxPool3d(2), MulFreeChannelwisePSN(3, k=2),
                        layer.Flatten(2), layer.Conv1d(3, 2, 3, padding=1), MulFreeChannelwisePSN(2, k=2))
    functional.set_step_mode(net, "m")
    net = net.double()
    converted = to_time_last(copy.deepcopy(net), method="highdim")
    spatial = [m for m in converted.modules() if isinstance(m, (mf.layer.TimeLastConv, mf.layer.TimeLastPool))]
    assert [m.resolve_method() for m in spatial] == ["vmap", "vmap", "highdim"]
    assert_same_run(net, converted, torch.randn(3, 2, 2, 4, 4, 2, dtype=torch.float64))


class _WithEmptyContainers(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = layer.Linear(3, 4, step_mode="m")
        self.skip = nn.Sequential()  # (an identity, as configurable blocks build one)
        self.extra = nn.ModuleList()  # (never called)
        self.neuron = MulFreeChannelwisePSN(4, k=2, step_mode="m")

    def forward(self, x):
        for m in self.extra:
            x = m(x)
        return self.neuron(self.skip(self.stem(x)))


@pytest.mark.parametrize("build", [_WithEmptyContainers,
                                   lambda: nn.Sequential(nn.Sequential(), layer.Linear(3, 2, step_mode="m"))])
def test_empty_containers_convert(build):
    """Regression: an empty nn.Sequential (an identity) or nn.ModuleList was refused as 'not a stateless
    layer this package knows'."""
    torch.manual_seed(0)
    net = build().double()
    converted = to_time_last(copy.deepcopy(net))
    assert has_time_last_boundary(converted)
    assert_same_run(net, converted, torch.randn(4, 2, 3, dtype=torch.float64, requires_grad=True))
    x = torch.randn(4, 2, 3)
    torch.testing.assert_close(to_time_last(nn.Sequential())(x), x)


class _TwoSequences(nn.Module):
    def __init__(self, c=4):
        super().__init__()
        self.fa, self.fb = layer.Linear(c, c, step_mode="m"), layer.Linear(c, c, step_mode="m")
        self.sn = MulFreeChannelwisePSN(c, k=2, step_mode="m")

    def forward(self, x, y):
        return self.sn(self.fa(x) + self.fb(y))


def test_a_second_sequence_input_of_a_forward_of_modules_is_refused():
    """Regression: a forward calling only modules was converted without the check, so a second (T, N, C)
    input, which the boundary passes as it is, reached a time-last Linear time-first: with T = N = C the
    outputs were wrong with no error. It is now checked, refused, and left time-first."""
    torch.manual_seed(0)
    net = _TwoSequences()
    x, y = torch.randn(4, 4, 4), torch.randn(4, 4, 4)
    want = net(x, y)
    functional.reset_net(net)
    with pytest.raises(UnconvertibleModuleError, match="left time-first"):
        to_time_last(net, example_input=(x, y))
    assert not has_time_last_boundary(net) and isinstance(net.fb, layer.Linear)
    torch.testing.assert_close(net(x, y), want)


class _SlicedByShape(nn.Module):
    def __init__(self, c=4):
        super().__init__()
        self.conv = layer.Conv1d(2, c, 3, padding=1, step_mode="m")
        self.sn = MulFreeChannelwisePSN(c, k=2, step_mode="m")

    def forward(self, x):
        y = self.sn(self.conv(x))  # (T, N, C, L)
        return y[..., : y.shape[-1] // 2].flatten(2).sum(-1, keepdim=True) + y[:, :, : y.shape[2] - 1, :1].flatten(2)


def test_a_slice_bounded_by_a_computed_size_converts():
    """Regression: a slice whose bound is computed from a shape (x[..., :x.shape[-1] // 2], a common
    pattern) crashed to_time_last with fx's "Argument 'floordiv' ... does not belong to this Graph"."""
    torch.manual_seed(0)
    net = _SlicedByShape().double()
    converted = to_time_last(copy.deepcopy(net), example_input=torch.randn(4, 3, 2, 8, dtype=torch.float64))
    assert not any("getitem" in c for c in converted.forward.time_first_calls)
    assert_same_run(net, converted, torch.randn(5, 2, 2, 8, dtype=torch.float64))


class _InPlaceOnAnAlias(nn.Module):
    def __init__(self, c=4):
        super().__init__()
        self.conv, self.conv3 = layer.Conv1d(2, c, 3, padding=1, step_mode="m"), layer.Conv1d(2, c, 3, padding=1,
                                                                                            step_mode="m")
        self.sn = MulFreeChannelwisePSN(c, k=2, step_mode="m")

    def forward(self, x):
        out = self.conv(x)
        feats = [out]
        out += self.conv3(x)  # (in place: feats[0] is the same tensor)
        feats.append(out)
        return self.sn(torch.stack(feats).mean(0)).flatten(2)


def test_a_forward_whose_trace_loses_an_in_place_change_is_not_rewritten():
    """Regression: fx records `out += v` as `out = out + v`, so a list holding `out` kept the old value in
    the trace, and the rewritten forward (checked against the trace) gave other spikes, with no error. The
    trace is now checked against the forward itself: here neither it nor the modules alone convert."""
    torch.manual_seed(0)
    net = _InPlaceOnAnAlias()
    x = torch.randn(4, 3, 2, 8)
    with pytest.warns(UserWarning, match="change in place a tensor that another name holds"), \
            pytest.raises(UnconvertibleModuleError, match="left time-first"):
        to_time_last(net, example_input=x)
    assert not has_time_last_boundary(net) and "forward" not in net.__dict__


def test_a_network_that_fails_on_the_second_probe_is_refused_by_name():
    """Regression: a forward indexing samples with a tensor (y[:, torch.tensor([1, 0])]) failed on the
    one-sample probe with a bare IndexError from inside to_time_last."""
    class Swapped(_SlicedByShape):
        def forward(self, x):
            return self.sn(self.conv(x))[:, torch.tensor([1, 0])].flatten(2)
    with pytest.raises(UnconvertibleModuleError, match="does not run on the inputs made from example_input.*"
                                                       "IndexError"):
        to_time_last(Swapped(), example_input=torch.randn(4, 3, 2, 8))


class _ChangedAfterACopy(nn.Module):
    def __init__(self, c=4):
        super().__init__()
        self.conv = layer.Conv1d(2, c, 3, padding=1, step_mode="m")
        self.sn = MulFreeChannelwisePSN(c, k=2, step_mode="m")
        self.register_buffer("w", torch.randn(8, 8))  # (a parameter would need y saved, unchanged, for its grad)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.sn(self.conv(x)) - 0.5  # time-last inside
        a = y @ self.w  # (runs time-first, on a copy of y)
        y.add_(1)
        b = y @ self.w  # (a copy of y as it is now)
        self.act(y)
        return a + b + y @ self.w


def test_in_place_changes_after_a_copy_reach_the_next_copy():
    """Regression: the time-first copy of a time-last value was made once and reused after an in-place
    change of the value (y.add_(1), an in-place ReLU), so the conversion was refused as giving other
    outputs (and, with a change in training only, would have given them)."""
    torch.manual_seed(0)
    net = _ChangedAfterACopy().double()
    converted = to_time_last(copy.deepcopy(net), example_input=torch.randn(4, 3, 2, 8, dtype=torch.float64))
    assert "forward" in converted.__dict__
    assert_same_run(net, converted, torch.randn(5, 2, 2, 8, dtype=torch.float64))


class _CalledOnTwoForms(nn.Module):
    def __init__(self, c=4):
        super().__init__()
        self.conv = layer.Conv1d(2, c, 3, padding=1, step_mode="m")
        self.sn = MulFreeChannelwisePSN(c, k=2, step_mode="m")
        self.fc = layer.Linear(8, 8, step_mode="m")

    def forward(self, x):
        y = self.sn(self.conv(x))  # (T, N, C, 8)
        return self.fc(y) + self.fc(y.mean(0))  # (the second call on (N, C, 8), broadcast over T)


def test_a_layer_called_on_a_sequence_and_on_a_value_without_time_converts():
    """Regression: the layer became a time-last wrapper for its call on the sequence, and its call on the
    mean over time (run time-first) got the wrapper too: refused with the wrapper's shape error."""
    torch.manual_seed(0)
    net = _CalledOnTwoForms().double()
    converted = to_time_last(copy.deepcopy(net), example_input=torch.randn(4, 3, 2, 8, dtype=torch.float64))
    assert isinstance(converted.fc, mf.layer.TimeLastLinear)
    assert_same_run(net, converted, torch.randn(5, 2, 2, 8, dtype=torch.float64))
    restored = to_time_first(converted)
    assert isinstance(restored.fc, layer.Linear)
    assert_same_run(net, restored, torch.randn(5, 2, 2, 8, dtype=torch.float64))


def test_round_trips_leave_no_trace_constants_behind():
    """Regression: each to_time_last left the tensor constants of fx's traces (here of the index tensor)
    on the network, and to_time_first none of them removed: they piled up over round trips. The
    rewritten forward keeps those it reads, and runs."""
    class Indexed(_SlicedByShape):
        def forward(self, x):
            return self.sn(self.conv(x))[:, :, torch.tensor([1, 0, 2, 3])].flatten(2)
    torch.manual_seed(0)
    net = Indexed().double()
    reference, attrs = copy.deepcopy(net), set(vars(net))
    x = torch.randn(4, 3, 2, 8, dtype=torch.float64)
    for _ in range(3):
        net = to_time_last(net, example_input=x)
        assert "forward" in net.__dict__
        assert_same_run(reference, net, x)
        net = to_time_first(net)
        assert set(vars(net)) == attrs


@pytest.mark.parametrize("registered", ["before", "after"])
def test_hooks_see_the_tensors_outside_their_module_whenever_registered(registered):
    """The boundary's and the islands' transposes were hooks appended to the module's own: a forward hook
    on the network registered before the conversion saw (and returned into) its time-last output, so a
    readout hook averaged over the batch instead of time; a pre-hook registered after it saw time-last
    input; an island's input and output monitors recorded different layouts. Hooks now see a module's
    tensors as they flow outside it: time-first at the network, time-last at an island inside it."""
    def net0():
        torch.manual_seed(0)
        n = nn.Sequential(layer.Linear(4, 5), neuron.LIFNode(), layer.Linear(5, 6),
                          MulFreeChannelwisePSN(6, threshold="param", v_threshold=0.0))
        functional.set_step_mode(n, "m")
        return n

    x = torch.randn(6, 3, 4)
    want = net0()(x).mean(0)
    net, seen = net0(), []

    def hook_all(m, name):
        m.register_forward_pre_hook(lambda mod, args: seen.append((name, "in", tuple(args[0].shape))))
        m.register_forward_hook(lambda mod, args, out: seen.append((name, "out", tuple(out.shape))))
    if registered == "before":
        hook_all(net, "net"), hook_all(net[1], "island")
    net.register_forward_hook(lambda m, args, out: out.mean(0))  # a readout: the firing rate over time
    net = to_time_last(net, example_input=x, fallback="time_first")
    if registered == "after":
        hook_all(net, "net"), hook_all(net[1], "island")
    assert torch.equal(net(x), want)
    assert sorted(seen) == [("island", "in", (3, 5, 6)), ("island", "out", (3, 5, 6)),
                            ("net", "in", (6, 3, 4)), ("net", "out", (6, 3, 6) if registered == "before" else (3, 6))]


class Gain(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.sn, self.gain = layer.Linear(3, 4, step_mode="m"), MulFreeChannelwisePSN(4, step_mode="m"), 1.0

    def forward(self, x):
        return self.sn(self.fc(x)) * self.gain


def test_a_shallow_copy_of_a_converted_network_runs_itself():
    """The boundary's moves held the module they were installed on: a shallow copy (as nn.DataParallel's
    replicas are made) ran the original, with the original's attributes and children."""
    x = torch.randn(5, 2, 3)
    net = Gain()
    want = net(x)
    net = to_time_last(net)
    twice = copy.copy(net)
    twice.gain = 2.0
    assert torch.equal(net(x), want) and torch.equal(twice(x), 2 * want)
    back = pickle.loads(pickle.dumps(net))
    assert has_time_last_boundary(back) and torch.equal(back(x), want)
    assert not has_time_last_boundary(to_time_first(back)) and torch.equal(back(x), want)


class OwnConv(layer.Conv1d):  # (a forward of its own: it runs time-first inside a time-last network)
    def forward(self, x):
        return super().forward(x)


class Double(nn.Module):
    def forward(self, w):
        return 2 * w


def test_a_parametrization_and_the_moves_of_a_module_run_time_first():
    """Registered after the conversion, a parametrization on such a module turned it into a bare mixin
    object at to_time_first; registered before, the conversion is refused by name (torch undoes a
    parametrization by the class's first base, which would be the moves')."""
    from torch.nn.utils import parametrize
    x = torch.randn(5, 2, 2, 7)
    net = nn.Sequential(OwnConv(2, 4, 3, padding=1, step_mode="m"), MulFreeChannelwisePSN(4, step_mode="m"))
    net = to_time_last(net, fallback="time_first")
    parametrize.register_parametrization(net[0], "weight", Double())
    want = net(x)
    back = to_time_first(net)
    assert isinstance(back[0], OwnConv) and parametrize.is_parametrized(back[0]) and torch.equal(back(x), want)
    with pytest.raises(UnconvertibleModuleError, match="is parametrized .*remove its parametrizations first"):
        to_time_last(back, fallback="time_first")


def test_a_lone_module_run_time_first_behind_its_own_boundary():
    """A module that is both the network (boundary) and run time-first: its hooks see time-first tensors,
    so replace_neurons took N for its channels and energy.estimate read its input as time-last."""
    x = torch.rand(6, 2, 3) * 3
    lif = to_time_last(neuron.LIFNode(step_mode="m"), fallback="time_first")
    new, summary = mf.replace_neurons(lif, example_input=x)
    assert summary.rows[0].channels == 3 and new(x).shape == (6, 2, 3)
    conv = OwnConv(3, 4, 3, padding=1, step_mode="m")
    xs = (torch.rand(6, 2, 3, 7) > 0.5).float()
    want = str(mf.energy.estimate(copy.deepcopy(conv), xs))
    assert str(mf.energy.estimate(to_time_last(conv, fallback="time_first"), xs)) == want


@pytest.mark.parametrize("build", [nn.ReLU, nn.Identity, nn.Sequential])
def test_converting_a_lone_element_wise_module_twice_leaves_it(build):
    """A second to_time_last refused the converted ReLU (its class is the boundary's now), or added moves."""
    x = torch.randn(5, 2, 3)
    m = to_time_last(build())
    for fallback in (None, "time_first"):
        assert to_time_last(m, fallback=fallback) is m and torch.equal(m(x), build()(x))


def test_fusing_a_time_last_network_says_why_once():
    """The moved network's forward is not Sequential's: fuse_batchnorm also warned that it cannot trace it."""
    net = nn.Sequential(layer.Conv1d(2, 4, 3, padding=1), layer.BatchNorm1d(4), MulFreeChannelwisePSN(4))
    functional.set_step_mode(net, "m")
    net = to_time_last(net)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mf.fuse_batchnorm(net) == []
    assert [str(w.message)[:40] for w in caught] == ["fuse_batchnorm fused nothing: it finds i"]
