"""functional.fuse_batchnorm: a batch norm applied by the MF-PSN after it, with the same results as the two
layers apart (every method, both step modes, training and eval), the same state_dict, and undone by
unfuse_batchnorm, deploy.fold and the layout conversions."""
import copy
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
from spikingjelly.activation_based import functional, layer, neuron

import spikingjelly_mfpsn
from spikingjelly_mfpsn import MulFreeChannelwisePSN, deploy, fuse_batchnorm, ops, replace_neurons, unfuse_batchnorm
from spikingjelly_mfpsn.neuron import FusedBatchNorm

from nets import assert_compiled_trains_as_eager


def conv_net(method="auto", threshold="bn", seed=0):
    """Both places a batch norm comes in front of a neuron in SpikingJelly networks: a multi-step
    ``layer.BatchNorm2d``, and the last layer of a ``SeqToANNContainer``."""
    torch.manual_seed(seed)
    return nn.Sequential(
        layer.Conv2d(3, 6, 3, padding=1, step_mode="m"), layer.BatchNorm2d(6, step_mode="m"),
        MulFreeChannelwisePSN(6, k=2, step_mode="m", method=method, threshold=threshold),
        layer.SeqToANNContainer(nn.Conv2d(6, 6, 3, padding=1), nn.BatchNorm2d(6, momentum=None)),
        MulFreeChannelwisePSN(6, k=3, dilation=2, step_mode="m", method=method, threshold=threshold),
    )


def cpu_methods():
    return [m for m in ops.names(layout="time_first") if ops.get(m).supports(
        torch.zeros(2, 2, 3), torch.zeros(3, 2), 1, "time_first")]


def train_steps(net, x, steps=2):
    """Spikes, every gradient, and the state after each of ``steps`` training steps."""
    out = []
    for i in range(steps):
        xi = (x + i).requires_grad_()
        s = net(xi)
        (s * torch.linspace(-1, 1, s.numel()).view(s.shape)).sum().backward()
        out.append((s.detach(), xi.grad, [p.grad.clone() for p in net.parameters()],
                    {k: v.clone() for k, v in net.state_dict().items()}))
        net.zero_grad()
        functional.reset_net(net)
    return out


def assert_same_steps(got, want, tol):
    for (s, gx, grads, state), (s2, gx2, grads2, state2) in zip(got, want):
        assert torch.equal(s, s2)
        torch.testing.assert_close(gx, gx2, **tol)
        for a, b in zip(grads, grads2):
            torch.testing.assert_close(a, b, **tol)
        assert list(state) == list(state2)
        for k in state:
            torch.testing.assert_close(state[k], state2[k], **tol, msg=k)


@pytest.mark.parametrize("method", cpu_methods())
@pytest.mark.parametrize("threshold", ["bn", "param"])
def test_a_fused_network_trains_and_infers_as_the_layers_apart(method, threshold):
    apart, fused = conv_net(method, threshold), conv_net(method, threshold)
    assert fuse_batchnorm(fused) == [("1", "2"), ("3.1", "4")]
    assert_trains_and_infers_alike(fused, apart, torch.randn(5, 2, 3, 4, 4), method)


def assert_trains_and_infers_alike(fused, apart, x, method):
    tol = dict(rtol=1e-4, atol=1e-4) if method == "triton" else dict(rtol=1e-5, atol=1e-6)
    assert_same_steps(train_steps(fused, x), train_steps(apart, x), tol)
    apart.eval(), fused.eval()
    with torch.no_grad():
        assert torch.equal(fused(x), apart(x))


@pytest.mark.parametrize("method", cpu_methods())
@pytest.mark.parametrize("net_training", [True, False])
def test_a_batch_norm_in_another_mode_than_the_network_normalises_in_its_own(method, net_training):
    """A batch norm frozen in eval while the network trains (fine-tuning), or training in an eval network."""
    apart, fused = conv_net(method), conv_net(method)
    fuse_batchnorm(fused)
    for net in (apart, fused):
        net.train(net_training)
        for m in (net[1], net[3][1]):
            m.train(not net_training)
    x = torch.randn(5, 2, 3, 4, 4)
    tol = dict(rtol=1e-4, atol=1e-4) if method == "triton" else dict(rtol=1e-5, atol=1e-6)
    assert_same_steps(train_steps(fused, x), train_steps(apart, x), tol)


def batch_norms(net):
    """The batch norms as code that picks them by type finds them (weight-decay groups, freezing)."""
    return [name for name, m in net.named_modules() if isinstance(m, (nn.BatchNorm2d, layer.BatchNorm2d))]


def test_fused_batch_norms_keep_their_class_and_freeze_by_type():
    apart, fused = conv_net(), conv_net()
    bns = [fused[1], fused[3][1]]
    fuse_batchnorm(fused)
    assert [fused[1], fused[3][1]] == bns and batch_norms(fused) == batch_norms(apart) == ["1", "3.1"]
    assert isinstance(fused[1], layer.BatchNorm2d) and "applied by the next" in repr(fused[1])
    for net in (apart, fused):  # the usual freezing loop, after net.train()
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()
    x = torch.randn(5, 2, 3, 4, 4)
    assert_same_steps(train_steps(fused, x), train_steps(apart, x), dict(rtol=1e-5, atol=1e-6))


def test_a_fused_batch_norm_is_made_in_place_only():
    bn = layer.BatchNorm2d(6, step_mode="m")
    with pytest.raises(TypeError, match=r"FusedBatchNorm.fuse\(bn\)"):
        spikingjelly_mfpsn.neuron.FusedBatchNorm(bn)
    fused = spikingjelly_mfpsn.neuron.FusedBatchNorm.fuse(bn)
    assert fused is bn and isinstance(bn, layer.BatchNorm2d)
    for bad in (bn, nn.Linear(2, 2)):  # fused already; not a batch norm
        with pytest.raises(TypeError, match="bn must be a batch norm module not fused yet"):
            spikingjelly_mfpsn.neuron.FusedBatchNorm.fuse(bad)


def test_a_fused_network_pickles_and_loads_in_a_fresh_process(tmp_path):
    apart, fused = conv_net(), conv_net()
    fuse_batchnorm(fused)
    x = torch.randn(5, 2, 3, 4, 4)
    train_steps(apart, x, steps=1)
    train_steps(fused, x, steps=1)
    again = pickle.loads(pickle.dumps(fused))
    assert again[2].input_bn is again[1] and type(again[1]) is type(fused[1])
    torch.save({"net": fused, "x": x, "want": apart.eval()(x)}, tmp_path / "net.pt")
    functional.reset_net(apart)
    code = textwrap.dedent(f"""
        import torch, spikingjelly_mfpsn
        from spikingjelly.activation_based import functional
        saved = torch.load({str(tmp_path / "net.pt")!r}, weights_only=False)
        net = saved["net"].eval()
        assert net[2].input_bn is net[1] and net[4].input_bn is net[3][1], "pairing lost"
        assert torch.equal(net(saved["x"]), saved["want"]), "spikes differ"
        spikingjelly_mfpsn.unfuse_batchnorm(net)
        print(type(net[1]).__name__, type(net[3][1]).__name__)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["BatchNorm2d", "BatchNorm2d"]


def test_state_dicts_load_across_fused_and_apart():
    apart, fused = conv_net(seed=1), conv_net(seed=2)
    fuse_batchnorm(fused)
    assert list(fused.state_dict()) == list(apart.state_dict())
    train_steps(apart, torch.randn(3, 2, 3, 4, 4), steps=1)
    fused.load_state_dict(apart.state_dict())
    apart.eval(), fused.eval()
    x = torch.randn(4, 2, 3, 4, 4)
    assert torch.equal(fused(x), apart(x))
    again = conv_net(seed=3)
    again.load_state_dict(fused.state_dict())
    assert torch.equal(again.eval()(x), apart(x))


@pytest.mark.parametrize("bn_training", [True, False])
def test_single_step_normalises_each_step_as_the_batch_norm_does(bn_training):
    apart, fused = conv_net()[:3], conv_net()[:3]
    fuse_batchnorm(fused)
    for net in (apart, fused):
        functional.set_step_mode(net, "s")
        net[1].train(bn_training)
    x = torch.randn(4, 2, 3, 4, 4)
    for net in (apart, fused):
        functional.reset_net(net)
    for t in range(4):
        assert torch.equal(fused(x[t]), apart(x[t]))
    assert torch.equal(fused.state_dict()["1.running_mean"], apart.state_dict()["1.running_mean"])


def test_copies_keep_the_pairing_and_unfusing_restores_the_layers():
    apart, fused = conv_net(), conv_net()
    fuse_batchnorm(fused)
    twin = copy.deepcopy(fused)
    assert twin[2].input_bn is twin[1] and twin[2].input_bn is not fused[1]
    x = torch.randn(3, 2, 3, 4, 4)
    train_steps(twin, x, steps=1)
    train_steps(apart, x, steps=1)
    unfuse_batchnorm(twin)
    assert type(twin[1]) is layer.BatchNorm2d and type(twin[3][1]) is nn.BatchNorm2d
    assert twin[2].input_bn is None and twin[4].input_bn is None
    twin.eval(), apart.eval()
    assert torch.equal(twin(x), apart(x))


def test_only_a_batch_norm_whose_output_only_the_neuron_reads_is_fused():
    shared = layer.BatchNorm2d(6, step_mode="m")
    sn = lambda: MulFreeChannelwisePSN(6, step_mode="m")  # noqa: E731
    nets = {
        "used twice": nn.Sequential(shared, sn(), shared, sn()),
        "single-step batch norm before a multi-step neuron": nn.Sequential(layer.BatchNorm2d(6), sn()),
        "other channels": nn.Sequential(layer.BatchNorm2d(4, step_mode="m"), sn()),
        "no running statistics": nn.Sequential(layer.BatchNorm2d(6, step_mode="m", track_running_stats=False), sn()),
        "a layer in between": nn.Sequential(layer.BatchNorm2d(6, step_mode="m"), layer.Dropout(0.5), sn()),
        "another neuron": nn.Sequential(layer.BatchNorm2d(6, step_mode="m"), neuron.LIFNode(step_mode="m")),
        # batch norms with a forward of their own (a fused one would apply a plain normalisation instead)
        "a temporal effective batch norm": nn.Sequential(layer.TemporalEffectiveBatchNorm2d(4, 6), sn())
        if hasattr(layer, "TemporalEffectiveBatchNorm2d") else nn.Sequential(),
        "a synchronised batch norm": nn.Sequential(layer.SeqToANNContainer(nn.SyncBatchNorm(6)), sn()),
    }
    for what, net in nets.items():
        assert fuse_batchnorm(net) == [], what


class HandWritten(nn.Module):
    """A forward written by hand, as in SpikingJelly's model zoo: bn1's output goes only to sn1, bn2's to
    sn2 and to the residual sum; ``branch``: the forward branches on the input's rank (no symbolic trace)."""

    def __init__(self, method="auto", branch=False):
        super().__init__()
        torch.manual_seed(0)
        self.branch = branch
        self.conv1 = layer.Conv2d(3, 6, 3, padding=1, step_mode="m")
        self.bn1 = layer.BatchNorm2d(6, step_mode="m")
        self.sn1 = MulFreeChannelwisePSN(6, k=2, step_mode="m", method=method)
        self.conv2 = layer.Conv2d(6, 6, 3, padding=1, step_mode="m")
        self.bn2 = layer.BatchNorm2d(6, step_mode="m")
        self.sn2 = MulFreeChannelwisePSN(6, k=3, dilation=2, step_mode="m", method=method)

    def forward(self, x):
        if self.branch and x.dim() == 4:
            x = x.unsqueeze(0)
        y = self.sn1(self.bn1(self.conv1(x)))
        z = self.bn2(self.conv2(y))
        return self.sn2(z) + z


class Tapped(nn.Module):
    """Iterates its Sequential by hand and also adds the batch norm's output to the result."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(layer.Conv2d(3, 6, 3, padding=1, step_mode="m"),
                                      layer.BatchNorm2d(6, step_mode="m"), MulFreeChannelwisePSN(6, step_mode="m"))

    def forward(self, x):
        x = self.features[1](self.features[0](x))
        return self.features[2](x) + x


def test_consecutive_children_whose_batch_norm_is_read_elsewhere_are_no_pair():
    """Regression: consecutive children of a Sequential were fused though the forward (iterating the
    Sequential by hand) also read the batch norm's output, which then got X unnormalised (training
    outputs off by 2.3)."""
    assert fuse_batchnorm(Tapped()) == []


@pytest.mark.parametrize("method", cpu_methods())
def test_a_forward_written_by_hand_fuses_what_only_the_neuron_reads(method):
    apart, fused = HandWritten(method), HandWritten(method)
    assert fuse_batchnorm(fused) == [("bn1", "sn1")]
    assert isinstance(fused.bn1, spikingjelly_mfpsn.neuron.FusedBatchNorm) and type(fused.bn2) is layer.BatchNorm2d
    assert_trains_and_infers_alike(fused, apart, torch.randn(4, 2, 3, 4, 4), method)


def test_a_forward_that_branches_on_its_input_needs_the_example():
    x = torch.randn(4, 2, 3, 4, 4)
    assert fuse_batchnorm(HandWritten(branch=True)) == []  # (no trace without it: the batch norms stay)
    net = HandWritten(branch=True)
    assert fuse_batchnorm(net, example_input=x) == [("bn1", "sn1")]
    assert_same_steps(train_steps(net, x), train_steps(HandWritten(branch=True), x), dict(rtol=1e-5, atol=1e-6))


class ItemBetween(HandWritten):
    """Between bn1 and sn1 a branch on the data through a Python number: fusing would follow the example's
    branch for every input."""

    def forward(self, x):
        z = self.bn1(self.conv1(x))
        if x.abs().max().item() > 1e3:  # (not on the example)
            z = z + 1
        return self.sn1(z)


def test_a_branch_on_the_data_between_the_batch_norm_and_the_neuron_is_no_pair():
    assert fuse_batchnorm(ItemBetween(), example_input=torch.randn(4, 2, 3, 4, 4)) == []


def test_replace_neurons_fuses_when_asked():
    def lif_net():
        torch.manual_seed(0)
        return nn.Sequential(layer.Conv2d(3, 6, 3, padding=1, step_mode="m"), layer.BatchNorm2d(6, step_mode="m"),
                             neuron.LIFNode(step_mode="m"))
    apart, _ = replace_neurons(lif_net(), k=2)
    fused, summary = replace_neurons(lif_net(), k=2, fuse_bn=True)
    assert summary.fused == [("1", "2")] and "fused 1 batch norm" in str(summary)
    x = torch.randn(4, 2, 3, 4, 4)
    assert_same_steps(train_steps(fused, x), train_steps(apart, x), dict(rtol=1e-5, atol=1e-6))


def test_folding_and_layout_conversion_see_the_batch_norm():
    apart, fused = conv_net(), conv_net()
    fuse_batchnorm(fused)
    x = torch.randn(4, 2, 3, 4, 4)
    train_steps(apart, x, steps=1)
    train_steps(fused, x, steps=1)
    for net in (apart, fused):
        net.eval()
    want = apart(x)
    last = spikingjelly_mfpsn.to_time_last(copy.deepcopy(fused))
    assert last[2].layout == "time_last" and torch.equal(last(x), want)  # (time-first at its boundary)
    assert torch.equal(deploy.fold(copy.deepcopy(fused))(x), deploy.fold(copy.deepcopy(apart))(x))


def test_a_fused_time_last_network_folds_unfuses_and_trains_as_the_one_apart():
    """fuse, then to_time_last (as autoselect may): training steps as apart; deploy.fold and
    unfuse_batchnorm give each batch norm its time-last normalisation back (a fused one sits inside a
    time-last wrapper); to_time_first restores the time-first network."""
    apart, fused = conv_net(), conv_net()
    fuse_batchnorm(fused)
    x = torch.randn(4, 2, 3, 4, 4)
    last_apart, last = spikingjelly_mfpsn.to_time_last(apart), spikingjelly_mfpsn.to_time_last(fused)
    assert_same_steps(train_steps(last, x), train_steps(last_apart, x), dict(rtol=1e-5, atol=1e-6))
    for net in (last_apart, last):
        net.eval()
    want = last_apart(x)
    assert torch.equal(deploy.fold(copy.deepcopy(last))(x), deploy.fold(copy.deepcopy(last_apart))(x))
    unfused = unfuse_batchnorm(copy.deepcopy(last))
    assert not any(isinstance(m, FusedBatchNorm) for m in unfused.modules())
    assert torch.equal(unfused(x), want)
    back = spikingjelly_mfpsn.to_time_first(last)
    assert isinstance(back[1], FusedBatchNorm) and back[2].input_bn is back[1] and torch.equal(back(x), want)


@pytest.mark.parametrize("convert_in,run_in", [("train", "eval"), ("eval", "train"), ("train", "train"),
                                               ("eval", "eval")])
def test_a_fused_time_last_network_follows_train_and_eval(convert_in, run_in):
    """Regression: a batch norm fused into its neuron, inside a time-last wrapper, kept the mode it had
    at the conversion: after net.eval() it normalised with the batch's statistics and updated its
    running ones (autoselect picks time-last, so this hit eval after autoselect), after net.train() it
    used the running ones."""
    apart, fused = conv_net(), conv_net()
    fuse_batchnorm(fused)
    x = 3 * torch.rand(4, 2, 3, 4, 4) + 1  # batch statistics far from the running ones
    for net in (apart, fused):
        net.train(convert_in == "train")
    last_apart, last = spikingjelly_mfpsn.to_time_last(apart), spikingjelly_mfpsn.to_time_last(fused)
    for net in (last_apart, last):
        net.train(run_in == "train")
    with torch.no_grad():
        assert torch.equal(last(x), last_apart(x))
    state, state_apart = last.state_dict(), last_apart.state_dict()
    assert all(torch.equal(state[k], state_apart[k]) for k in state_apart)


def test_fusing_a_time_last_network_says_to_fuse_before_converting():
    """It fused nothing without a word (autoselect may have converted the network already)."""
    net = spikingjelly_mfpsn.to_time_last(conv_net())
    with pytest.warns(UserWarning, match="fuse_batchnorm fused nothing.*Fuse before to_time_last"):
        assert fuse_batchnorm(net) == []


def test_reconfiguring_a_fused_neuron_keeps_its_batch_norm(recwarn):
    apart, fused = conv_net(), conv_net()
    fuse_batchnorm(fused)
    replace_neurons(apart, k=3, dilation=1)
    replace_neurons(fused, k=3, dilation=1)
    assert fused[2].input_bn is fused[1] and fused[4].input_bn is fused[3][1]
    x = torch.randn(4, 2, 3, 4, 4)
    assert torch.equal(fused(x), apart(x))


@pytest.mark.parametrize("method", ["auto"] + (["triton"] if "triton" in ops.names() else []))
def test_a_compiled_fused_network_trains_as_the_eager_one(method):
    """Under torch.compile (on 'triton' the fused step runs as an operator inside the graph): the eager
    network's spikes, gradients and state over two training steps, then its eval spikes."""
    fused = conv_net(method)
    fuse_batchnorm(fused)
    assert_compiled_trains_as_eager(fused, torch.randn(4, 2, 3, 4, 4), backend="aot_eager")


def test_nir_export_of_a_fused_network_is_that_of_the_layers_apart():
    pytest.importorskip("nir", reason="the nir package is not installed (pip install \"spikingjelly_mfpsn[nir]\")")
    from spikingjelly_mfpsn.nir import export_to_nir
    apart, fused = conv_net(), conv_net()
    fuse_batchnorm(fused)
    x = torch.randn(4, 2, 3, 4, 4)
    train_steps(apart, x, steps=1)
    train_steps(fused, x, steps=1)
    graphs = [export_to_nir(net, x) for net in (apart, fused)]
    assert list(graphs[0].nodes) == list(graphs[1].nodes) and graphs[0].edges == graphs[1].edges
    for name, node in graphs[0].nodes.items():
        other = graphs[1].nodes[name]
        for key, value in vars(node).items():
            if hasattr(value, "shape"):
                assert abs(value - vars(other)[key]).max() < 1e-5, (name, key)
    assert isinstance(fused[1], spikingjelly_mfpsn.neuron.FusedBatchNorm)  # (the network itself left as it is)


class IteratesItsSequential(nn.Module):
    """Runs its Sequential's children by hand and reads the batch norm's output again, behind a branch on
    the data (so the forward does not trace)."""

    def __init__(self):
        super().__init__()
        self.seq = nn.Sequential(layer.Linear(3, 4), layer.BatchNorm1d(4), MulFreeChannelwisePSN(4, k=2))
        functional.set_step_mode(self, "m")

    def forward(self, x):
        outputs = []
        for m in self.seq:
            x = m(x)
            outputs.append(x)
        return x + outputs[1] if x.sum() > -1e9 else x


def test_an_untraceable_forward_fuses_no_pair_it_runs_itself():
    """Regression: where the forward did not trace, consecutive children of any Sequential were fused,
    here changing what the forward reads as the batch norm's output (other outputs, no warning)."""
    torch.manual_seed(0)
    net, x = IteratesItsSequential(), torch.randn(4, 2, 4, 3)  # ((T, N, C, L): SpikingJelly 0.0.0.0.14's BN1d)
    apart = copy.deepcopy(net)
    with pytest.warns(UserWarning, match="cannot trace IteratesItsSequential.forward"):
        assert fuse_batchnorm(net, example_input=x) == []
    torch.testing.assert_close(net(x), apart(x))
    outer = nn.Sequential(nn.Sequential(layer.Linear(3, 4), layer.BatchNorm1d(4), MulFreeChannelwisePSN(4, k=2)),
                          IteratesItsSequential())  # (the forward of the outer nest is Sequential's own)
    functional.set_step_mode(outer, "m")
    assert fuse_batchnorm(outer, example_input=x) == [("0.1", "0.2")]


def test_a_parametrization_registered_after_fusing_survives_unfusing():
    """torch.nn.utils.parametrize gives the fused batch norm a class made over the fused one: finding the
    batch norm's class raised IndexError (in repr, unfuse_batchnorm, deploy.fold and to_time_last)."""
    import torch.nn.utils.parametrize as parametrize

    class Positive(nn.Module):
        def forward(self, w):
            return w.abs() + 0.5
    torch.manual_seed(0)
    net = nn.Sequential(layer.Conv1d(2, 3, 1, step_mode="m"), layer.BatchNorm1d(3, step_mode="m"),
                        MulFreeChannelwisePSN(3, k=2, step_mode="m"))
    apart = copy.deepcopy(net)
    parametrize.register_parametrization(apart[1], "weight", Positive())
    fuse_batchnorm(net)
    parametrize.register_parametrization(net[1], "weight", Positive())
    x = torch.randn(4, 2, 2, 5)
    assert "input_bn=BatchNorm1d" in repr(net)
    assert torch.equal(net(x), apart(x))
    with pytest.raises(RuntimeError, match="Serialization of parametrized modules"):
        pickle.dumps(net)  # (as torch refuses a parametrized module; a fused one pickled without its property)
    unfuse_batchnorm(net)
    assert isinstance(net[1], layer.BatchNorm1d) and not isinstance(net[1], FusedBatchNorm)
    assert parametrize.is_parametrized(net[1], "weight") and torch.equal(net[1].weight, apart[1].weight)
    assert torch.equal(net(x), apart(x))


def test_a_batch_norm_unfused_on_its_own_is_applied_by_itself_again():
    """unfuse_batchnorm(block) of the block holding the batch norm (or bn.unfused()) left the neuron
    outside it applying a batch norm that was not a fused one any more: AttributeError at its forward."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(layer.Conv2d(2, 3, 3, padding=1, step_mode="m"), layer.BatchNorm2d(3, step_mode="m"))
            self.sn = MulFreeChannelwisePSN(3, k=2, step_mode="m")

        def forward(self, x):
            return self.sn(self.stem(x))
    torch.manual_seed(0)
    x = torch.randn(4, 2, 2, 4, 4)
    for unfuse in (lambda net: unfuse_batchnorm(net.stem), lambda net: net.stem[1].unfused()):
        net = Net()
        want = net(x)
        assert fuse_batchnorm(net) == [("stem.1", "sn")]
        unfuse(net)
        assert torch.equal(net(x), want) and net.sn.input_bn is None
        assert fuse_batchnorm(net) == [("stem.1", "sn")] and torch.equal(net(x), want)


def test_data_parallel_refuses_a_fused_network_by_name():
    """DataParallel's replicas of a neuron kept the first device's fused batch norm (not a submodule)."""
    net = conv_net()
    fuse_batchnorm(net)
    with pytest.raises(RuntimeError, match="fused batch norm cannot be replicated by nn.DataParallel"):
        net[2]._replicate_for_data_parallel()
    unfuse_batchnorm(net)
    net[2](torch.randn(2, 2, 6, 4, 4))
    assert type(net[2]._replicate_for_data_parallel()) is MulFreeChannelwisePSN


def test_a_neuron_copied_apart_from_its_network_refuses_its_hidden_batch_norm():
    """Copying a fused network's layers one by one (or saving the neuron alone) gave the neuron a hidden copy
    of its batch norm, outside parameters() and state_dict(): the copied network's own batch norm did
    nothing and never trained. That neuron now refuses to run; whole copies run as the original."""
    x = torch.randn(5, 2, 3, 4, 4)
    net = conv_net()
    fuse_batchnorm(net)
    with torch.no_grad():
        want = net(x)
    functional.reset_net(net)
    layers = nn.Sequential(*[copy.deepcopy(m) for m in net])
    with pytest.raises(RuntimeError, match="fused batch norm .* that has not run since the neuron last ran, "
                                           "or since it was copied or loaded"):
        layers(x)
    alone = pickle.loads(pickle.dumps(net[2]))
    with pytest.raises(RuntimeError, match="copy or save the whole network"):
        alone(torch.randn(5, 2, 6, 4, 4))
    for whole in (copy.deepcopy(net), pickle.loads(pickle.dumps(net)),
                  spikingjelly_mfpsn.to_time_last(copy.deepcopy(net), example_input=x),
                  nn.Sequential(*[copy.deepcopy(m) for m in unfuse_batchnorm(copy.deepcopy(net))])):
        with torch.no_grad():
            assert torch.equal(whole(x), want)


@pytest.mark.parametrize("where", ["batch norm forward hook", "neuron forward pre-hook"])
def test_a_hook_between_the_batch_norm_and_the_neuron_keeps_the_pair_apart(where):
    """A hook that changes the tensor between a batch norm and its neuron (clamping the batch norm's output,
    noise at the neuron's input) was fused over: the neuron normalised the hook's output instead, and the
    spikes changed silently. Such a pair is left unfused, with a warning naming it."""
    x = torch.randn(5, 2, 3, 4, 4)
    nets = [conv_net(seed=1), conv_net(seed=1)]
    for n in nets:
        if where.startswith("batch"):
            n[1].register_forward_hook(lambda m, args, out: out.clamp(max=0.1))
        else:
            n[2].register_forward_pre_hook(lambda m, args: (args[0] + 0.7,))
    with pytest.warns(UserWarning, match=r"left 1 -> 2 unfused: a forward hook"):
        assert fuse_batchnorm(nets[0]) == [("3.1", "4")]
    with torch.no_grad():
        assert torch.equal(nets[0](x), nets[1](x))


def test_a_fused_batch_norm_replaced_in_the_network_is_refused_not_applied_twice():
    """nn.SyncBatchNorm.convert_sync_batchnorm (as one does before DistributedDataParallel) puts a new,
    normalising module where a fused batch norm was; the neuron went on applying the old one too: X was
    normalised twice, the shared running statistics updated twice (46 of 192 eval spikes off). Before and
    after the network ran, the neuron now refuses, naming the cause; unfused first, the conversion runs."""
    def net():
        torch.manual_seed(0)
        return nn.Sequential(layer.SeqToANNContainer(nn.BatchNorm1d(4)), MulFreeChannelwisePSN(4, step_mode="m"))

    x = torch.randn(6, 8, 4) * 3 + 2
    for warm in (False, True):
        fused = net()
        fuse_batchnorm(fused)
        if warm:
            fused(x)
        converted = nn.SyncBatchNorm.convert_sync_batchnorm(fused)
        with pytest.raises(RuntimeError, match="convert_sync_batchnorm"):
            converted(x)
    fused = net()
    fuse_batchnorm(fused)
    got = nn.SyncBatchNorm.convert_sync_batchnorm(unfuse_batchnorm(fused))
    want = nn.SyncBatchNorm.convert_sync_batchnorm(net())
    for _ in range(3):
        assert torch.equal(got(x), want(x))
    assert torch.equal(got[0][0].running_mean, want[0][0].running_mean)


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_checkpointed_fused_neuron_recomputes_with_its_batch_norm(reentrant):
    """torch.utils.checkpoint around the neuron alone runs it again in backward, without its batch norm:
    that is no replacement, and the gradients are those of the unfused network."""
    x = torch.randn(5, 2, 3, 4, 4)
    grads = []
    for fuse in (False, True):
        net = conv_net()
        if fuse:
            fuse_batchnorm(net)
        xx = x.clone().requires_grad_()
        y = net[1](net[0](xx))
        y = torch.utils.checkpoint.checkpoint(net[2], y, use_reentrant=reentrant)
        torch.utils.checkpoint.checkpoint(lambda z: net[4](net[3](z)), y, use_reentrant=reentrant).sum().backward()
        grads.append([xx.grad] + [p.grad for p in net.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_a_measure_fn_of_your_own_gets_the_fused_neuron_itself():
    """autoselect gave a caller's measure_fn an anonymous Sequential(batch norm, neuron) for a fused neuron,
    so a measure_fn reading the module's method timed every candidate alike (an arbitrary pick) or failed."""
    def fake(module, args, m):
        assert isinstance(module, MulFreeChannelwisePSN) or not isinstance(module, nn.Sequential)
        module(*args)  # (runs as often as it likes: its batch norm runs before it)
        module(*args)
        return 1.0 if getattr(module, "method", None) == "conv1d" else 2.0

    for fuse in (False, True):
        torch.manual_seed(0)
        net = nn.Sequential(layer.Linear(3, 4, step_mode="m"), layer.SeqToANNContainer(nn.BatchNorm1d(4)),
                            MulFreeChannelwisePSN(4, step_mode="m"))
        if fuse:
            fuse_batchnorm(net)
        spikingjelly_mfpsn.autoselect(net, torch.randn(5, 2, 3), cache=False, measure_fn=fake,
                                      layouts=("time_first",), progress=False)
        assert net[2].method == "conv1d"
