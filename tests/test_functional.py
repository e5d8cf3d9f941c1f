"""replace_neurons, set_backend and set_method on SpikingJelly networks."""
import logging

import pytest
import torch
import torch.nn as nn
from spikingjelly.activation_based import functional, layer, neuron, surrogate

import spikingjelly_mfpsn
from spikingjelly_mfpsn import MulFreeChannelwisePSN, replace_neurons, set_backend, set_method, to_time_last
from spikingjelly_mfpsn.functional import sawtooth, sawtooth_dilation

import reference
import sj


def mlp(step_mode="m"):
    net = nn.Sequential(
        layer.Linear(4, 6), neuron.LIFNode(surrogate_function=surrogate.Sigmoid(alpha=3.0)),
        layer.Linear(6, 5), neuron.IFNode(),
        layer.Linear(5, 3), neuron.ParametricLIFNode(),
        layer.Linear(3, 2), neuron.LIFNode(),
    )
    functional.set_step_mode(net, step_mode)
    return net


class OutOfOrder(nn.Module):
    """Registers its neurons in the opposite order to the one they run in."""

    def __init__(self):
        super().__init__()
        self.late = neuron.LIFNode(step_mode="m")
        self.fc2 = layer.Linear(5, 3, step_mode="m")
        self.early = neuron.IFNode(step_mode="m")
        self.fc1 = layer.Linear(4, 5, step_mode="m")

    def forward(self, x):
        return self.late(self.fc2(self.early(self.fc1(x))))


def test_sawtooth_dilations_and_their_arguments():
    assert sawtooth(7) == [1, 2, 3, 1, 2, 3, 1] and sawtooth(5, period=2) == [1, 2, 1, 2, 1] and sawtooth(0) == []
    assert [sawtooth_dilation(i) for i in range(4)] == [1, 2, 3, 1]
    # a negative count gave [] silently, period 0 a ZeroDivisionError, a negative period negative dilations
    for call, match in ((lambda: sawtooth(-1), "n must be an int >= 0"),
                        (lambda: sawtooth(5, period=0), "period must be an int >= 1"),
                        (lambda: sawtooth(5, period=-2), "period must be an int >= 1"),
                        (lambda: sawtooth(2.5), "n must be an int >= 0"),
                        (lambda: sawtooth_dilation(-1), "index must be an int >= 0")):
        with pytest.raises(ValueError, match=match):
            call()


def test_replaces_every_spiking_neuron_with_sawtooth_dilations():
    net = mlp()
    net, summary = replace_neurons(net, k=3)
    new = [m for m in net.modules() if isinstance(m, MulFreeChannelwisePSN)]
    assert len(new) == 4 and len(summary) == 4
    assert not any(isinstance(m, (neuron.LIFNode, neuron.IFNode)) for m in net.modules())
    assert [m.dilation for m in new] == [1, 2, 3, 1]
    assert all(m.k == 3 and m.step_mode == "m" and m.channels is None for m in new)
    # keeps the surrogate function of the neuron it replaces
    assert isinstance(new[0].surrogate_function, surrogate.Sigmoid) and new[0].surrogate_function.alpha == 3.0
    out = net(torch.rand(5, 2, 4))
    assert out.shape == (5, 2, 2) and [m.channels for m in new] == [6, 5, 3, 2]
    assert "LIFNode" in str(summary) and "IFNode" in str(summary)


def test_sawtooth_follows_forward_order_with_example_input():
    net = OutOfOrder()
    net, summary = replace_neurons(net, k=2, example_input=torch.rand(3, 2, 4))
    assert summary.order == "forward"
    assert (net.early.dilation, net.late.dilation) == (1, 2)
    assert (net.early.channels, net.late.channels) == (5, 3)  # from the example input, not lazy
    assert [r.name for r in summary] == ["early", "late"]
    # registration order without an example input
    net2, s2 = replace_neurons(OutOfOrder(), k=2)
    assert (net2.late.dilation, net2.early.dilation) == (1, 2) and s2.order == "registration"


class TwoInputs(OutOfOrder):
    """OutOfOrder fed a sequence and a gain."""

    def forward(self, x, gain):
        return super().forward(x * gain)


def test_example_input_of_a_network_of_several_inputs_is_a_tuple():
    net, summary = replace_neurons(TwoInputs(), k=2, example_input=(torch.rand(3, 2, 4), torch.full((1,), 2.0)))
    assert summary.order == "forward" and (net.early.dilation, net.late.dilation) == (1, 2)
    assert (net.early.channels, net.late.channels) == (5, 3)


@pytest.mark.parametrize("top", [True, False])
def test_an_example_input_leaves_every_module_in_its_own_mode(top):
    """Finding the run order put every module in the top's mode: a frozen batch norm (eval inside a
    training network) came back training, its running statistics drifting with no error."""
    net = nn.Sequential(layer.Conv1d(4, 5, 1, step_mode="m"), layer.BatchNorm1d(5, step_mode="m"),
                        neuron.IFNode(step_mode="m"), layer.Dropout(0.5, step_mode="m")).train(top)
    net[1].train(not top)
    before = [m.training for m in net]
    net, _ = replace_neurons(net, k=2, example_input=torch.rand(3, 2, 4, 3))
    assert [m.training for m in net] == before


def test_int_dilation_targets_and_kwargs():
    net, summary = replace_neurons(mlp(), k=2, dilation=2, targets=neuron.IFNode, threshold="param",
                                   quantize=False)
    new = [m for m in net.modules() if isinstance(m, MulFreeChannelwisePSN)]
    assert len(new) == 1 and new[0].dilation == 2 and new[0].threshold == "param" and not new[0].quantize
    assert sum(isinstance(m, neuron.LIFNode) for m in net.modules()) == 2
    net, _ = replace_neurons(mlp(), targets=lambda name, m: name == "3")
    assert isinstance(net[3], MulFreeChannelwisePSN) and isinstance(net[1], neuron.LIFNode)
    with pytest.raises(ValueError, match="dilation"):
        replace_neurons(mlp(), dilation=0)
    # A list of classes is taken as a tuple (it raised isinstance's TypeError, not naming targets).
    net, summary = replace_neurons(mlp(), k=2, targets=[neuron.IFNode])
    assert sum(isinstance(m, MulFreeChannelwisePSN) for m in net.modules()) == 1
    for bad in ("IFNode", [neuron.IFNode, "LIFNode"], 3):
        with pytest.raises(TypeError, match="targets must be a neuron class, a tuple or list of them"):
            replace_neurons(mlp(), targets=bad)


def test_keeps_step_mode_dtype_and_single_step_state_resets():
    net = mlp(step_mode="s").double()
    net, _ = replace_neurons(net, k=2, example_input=torch.rand(2, 4, dtype=torch.float64))
    new = [m for m in net.modules() if isinstance(m, MulFreeChannelwisePSN)]
    assert all(m.step_mode == "s" and m.weight.dtype == torch.float64 for m in new)
    for _ in range(3):
        net(torch.rand(2, 4, dtype=torch.float64))
    assert [len(m.x_queue) for m in new] == [min(3, m.dilation) for m in new] == [1, 2, 3, 1]
    functional.reset_net(net)  # SpikingJelly 2's cached reset list must see the new neurons
    assert all(m.x_queue == () for m in new)


def test_replacing_the_net_itself_and_shared_instances():
    new, summary = replace_neurons(neuron.LIFNode(step_mode="m"), k=2)
    assert isinstance(new, MulFreeChannelwisePSN) and new.step_mode == "m"
    shared = neuron.IFNode(step_mode="m")
    net = nn.Sequential(layer.Linear(3, 3, step_mode="m"), shared, layer.Linear(3, 3, step_mode="m"), shared)
    net, summary = replace_neurons(net)
    assert len(summary) == 1 and net[1] is net[3] and isinstance(net[1], MulFreeChannelwisePSN)


def test_a_shared_neuron_at_two_widths_is_refused_before_any_change():
    shared = neuron.IFNode(step_mode="m")
    net = nn.Sequential(layer.Linear(3, 4, step_mode="m"), shared, layer.Linear(4, 6, step_mode="m"), shared)
    x = torch.rand(2, 3, 3)
    with pytest.raises(ValueError, match=r"'1' runs at several places, with 4 and 6 channels"):
        replace_neurons(net, example_input=x)
    assert net[1] is net[3] is shared and not any(isinstance(m, MulFreeChannelwisePSN) for m in net.modules())


def test_trains_after_replacement():
    torch.manual_seed(0)
    net, _ = replace_neurons(mlp(), k=2, example_input=torch.rand(4, 8, 4))
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    x = torch.rand(4, 8, 4)
    before = [p.detach().clone() for p in net.parameters()]
    loss = net(x).mean(0).sum()
    loss.backward()
    opt.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, net.parameters()))


def test_set_backend_and_set_method(caplog):
    net, _ = replace_neurons(mlp(), k=2, example_input=torch.rand(3, 2, 4))
    new = [m for m in net.modules() if isinstance(m, MulFreeChannelwisePSN)]
    set_method(net, "conv1d")
    assert all(m.method == "conv1d" for m in new)
    with caplog.at_level(logging.WARNING, logger="spikingjelly_mfpsn"):
        set_method(net, "conv2d")  # time-last only: every time-first neuron skips it
    assert all(m.method == "conv1d" for m in new) and "does not support method" in caplog.text
    set_backend(net, "torch")
    assert all(m.backend == "torch" for m in new)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="spikingjelly_mfpsn"):
        set_backend(net, "no_such_backend")
    assert all(m.backend == "torch" for m in new) and "does not support backend" in caplog.text
    assert caplog.text.count("does not support backend") == 1 and f"({len(new)} modules)" in caplog.text  # (a class)
    set_method(net, "auto")
    assert all(m.method == "auto" for m in new)


def test_set_method_warns_once_per_class_and_not_for_another_kind(caplog):
    """Regression: a neuron method set on a time-last network warned once per layer wrapper ("TimeLastConv
    does not support method='conv2d'"), wrappers being no neurons; and once per neuron where none runs it."""
    net = nn.Sequential(layer.Conv1d(2, 3, 3, step_mode="m"), MulFreeChannelwisePSN(3, k=2, step_mode="m"),
                        layer.Conv1d(3, 3, 3, step_mode="m"), MulFreeChannelwisePSN(3, k=2, step_mode="m"),
                        layer.Conv3d(3, 3, 1, step_mode="m"))
    with caplog.at_level(logging.WARNING, logger="spikingjelly_mfpsn"):
        net = set_method(net, "conv2d", layout="time_last")
    assert [m.method for m in net.modules() if isinstance(m, MulFreeChannelwisePSN)] == ["conv2d"] * 2
    assert "TimeLast" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="spikingjelly_mfpsn"):
        set_method(net, "highdim")  # the Conv3d's wrapper runs 'vmap' only
    assert [m.resolve_method() for m in net.modules() if isinstance(m, spikingjelly_mfpsn.layer.TimeLastConv)] == \
        ["highdim", "highdim", "vmap"]
    assert caplog.text.count("does not support") == 1 and "TimeLastConv does not support method='highdim' (1 of" \
        in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="spikingjelly_mfpsn"):
        set_method(spikingjelly_mfpsn.to_time_first(net), "conv2d")  # (time-last only): no module runs it
    assert caplog.text.count("does not support") == 1 and "MulFreeChannelwisePSN does not support method='conv2d'" \
        " (2 of its modules" in caplog.text


def test_added_to_spikingjelly_functional_without_overriding():
    assert functional.replace_neurons is spikingjelly_mfpsn.replace_neurons
    assert functional.set_method is spikingjelly_mfpsn.set_method
    # (the docs call them on SpikingJelly's functional: an AttributeError there)
    assert functional.fuse_batchnorm is spikingjelly_mfpsn.fuse_batchnorm
    assert functional.unfuse_batchnorm is spikingjelly_mfpsn.unfuse_batchnorm
    if sj.HAS_SET_BACKEND:  # 0.0.0.0.14 keeps its own, which works on MF-PSN
        assert functional.set_backend is not spikingjelly_mfpsn.set_backend
        sn = MulFreeChannelwisePSN(channels=2)
        functional.set_backend(nn.Sequential(sn), "torch")
        assert sn.backend == "torch"
    else:
        assert functional.set_backend is spikingjelly_mfpsn.set_backend


# Non-spiking readouts, by name (a class this SpikingJelly lacks skips its cases), and how to build one.
READOUTS = {
    "NonSpikingLIFNode": lambda cls: cls(tau=2.0, decode="last_mem"),
    "NonSpikingIFNode": lambda cls: cls(decode="last_mem"),
    "LIAFNode": lambda cls: cls(act=torch.tanh, threshold_related=False, step_mode="m"),
}


PATCHED = {}  # name -> a subclass of the readout that builds where SpikingJelly's does not


def readout_class(name):
    cls = getattr(neuron, name, None)
    if cls is None:
        pytest.skip(f"SpikingJelly {sj.VERSION} has no neuron.{name}")
    try:
        READOUTS[name](cls)
    except AttributeError:  # 0.0.0.0.14's LIAFNode.__init__ checks an attribute its LIFNode never sets
        cls = PATCHED.setdefault(name, type(name, (cls,), {"single_step_cupy_fp32_inference": False}))
    return cls


def readout(name):
    return READOUTS[name](readout_class(name))


def with_readout(name):
    return nn.Sequential(layer.Linear(4, 6, step_mode="m"), neuron.LIFNode(step_mode="m"),
                         layer.Linear(6, 3, step_mode="m"), readout(name))


@pytest.mark.parametrize("name", sorted(READOUTS))
def test_readout_is_kept_by_default_and_listed_as_skipped(name):
    net = with_readout(name)
    head = net[3]
    net, summary = replace_neurons(net, k=2)
    assert net[3] is head and isinstance(net[1], MulFreeChannelwisePSN)
    assert [r.name for r in summary] == ["1"]
    assert [(s.name, s.old, s.reason) for s in summary.skipped] == [
        ("3", name, "non-spiking readout (outputs membrane potential)")]
    assert "non-spiking readout" in str(summary) and name in str(summary)


@pytest.mark.parametrize("name", sorted(READOUTS))
def test_readout_is_replaced_when_asked(name):
    net, summary = replace_neurons(with_readout(name), k=2, include_readouts=True)
    assert isinstance(net[3], MulFreeChannelwisePSN) and len(summary) == 2 and not summary.skipped
    assert [r.old for r in summary] == ["LIFNode", name]
    # naming the readout's class in targets includes it too
    net, summary = replace_neurons(with_readout(name), k=2, targets=readout_class(name))
    assert isinstance(net[3], MulFreeChannelwisePSN) and isinstance(net[1], neuron.LIFNode)
    assert [r.old for r in summary] == [name] and not summary.skipped


def test_liaf_is_kept_when_targets_names_its_spiking_base_class():
    net, summary = replace_neurons(with_readout("LIAFNode"), k=2, targets=neuron.LIFNode)
    assert isinstance(net[3], neuron.LIAFNode) and isinstance(net[1], MulFreeChannelwisePSN)
    assert [s.name for s in summary.skipped] == ["3"]


def mf_psn_net(k=2, dtype=torch.float64):
    return nn.Sequential(
        layer.Linear(4, 6, step_mode="m"),
        MulFreeChannelwisePSN(6, k=k, dilation=1, step_mode="m", threshold="param", quantize=False,
                              v_threshold=0.5, surrogate_function=surrogate.Sigmoid(alpha=3.0)),
        layer.Linear(6, 5, step_mode="m"),
        MulFreeChannelwisePSN(5, k=k, dilation=2, step_mode="m"),
    ).to(dtype)


def test_mf_psn_layers_are_reconfigured_with_a_warning():
    net = mf_psn_net(k=2)
    olds = [net[1], net[3]]
    with pytest.warns(UserWarning, match="re-configured 2 MulFreeChannelwisePSN layer.*re-initialised"):
        net, summary = replace_neurons(net, k=4)
    new = [net[1], net[3]]
    assert all(n is not o for n, o in zip(new, olds))
    assert [(m.k, m.dilation, m.channels, m.step_mode) for m in new] == [
        (4, o.dilation, o.channels, o.step_mode) for o in olds]
    assert (new[0].threshold, new[0].quantize, new[0].v_threshold_init) == ("param", False, 0.5)
    assert isinstance(new[0].surrogate_function, surrogate.Sigmoid) and new[0].surrogate_function.alpha == 3.0
    assert new[1].threshold == "bn" and all(m.weight.dtype == torch.float64 for m in new)
    assert [(r.old, r.k) for r in summary] == [("MulFreeChannelwisePSN", 4)] * 2 and not summary.skipped
    assert net(torch.rand(5, 2, 4, dtype=torch.float64)).shape == (5, 2, 5)


def test_neuron_kwargs_override_the_settings_of_a_reconfigured_mf_psn():
    with pytest.warns(UserWarning, match="re-configured 2"):
        net, _ = replace_neurons(mf_psn_net(k=2), k=3, threshold="bn", quantize=True)
    assert all(m.k == 3 and m.threshold == "bn" and m.quantize for m in (net[1], net[3]))
    # same k and dilation: only the neuron a setting of neuron_kwargs changes is re-configured
    net = mf_psn_net(k=2)
    kept = net[1]
    with pytest.warns(UserWarning, match="re-configured 1 MulFreeChannelwisePSN"):
        net, summary = replace_neurons(net, k=2, threshold="param")
    assert net[1] is kept and net[3].threshold == "param" and [r.name for r in summary] == ["3"]


@pytest.mark.parametrize("kwargs", [dict(surrogate_function=surrogate.Sigmoid(alpha=2.0)),
                                    dict(method="conv1d"), dict(backend="torch", layout="time_first"),
                                    dict(step_mode="s", method="auto")])
def test_a_second_replace_neurons_takes_run_time_settings_without_new_weights(kwargs, recwarn):
    """Same k and dilation, settings a neuron can take as it is (its surrogate, method, backend, layout or
    step mode; e.g. the same replace_neurons call run again after autoselect picked other methods): the
    trained weights stay and the neuron takes the settings; before, it was rebuilt with new weights."""
    net = mf_psn_net(k=2)
    with torch.no_grad():
        for m in (net[1], net[3]):
            m.weight.mul_(3.0)
    trained = [m.weight.clone() for m in (net[1], net[3])]
    set_method(net, "shift_add")
    net, summary = replace_neurons(net, k=2, **kwargs)
    assert [torch.equal(m.weight, w) for m, w in zip((net[1], net[3]), trained)] == [True, True]
    assert len(summary) == 0 and not [w for w in recwarn if issubclass(w.category, UserWarning)]
    for m in (net[1], net[3]):
        for name, value in kwargs.items():
            assert getattr(m, name) is value or getattr(m, name) == value, name
    with pytest.raises(ValueError, match="method 'conv2d' runs the layouts"):
        replace_neurons(net, k=2, method="conv2d", layout="time_first")
    with pytest.raises(ValueError, match="surrogate_function must be"):
        replace_neurons(net, k=2, surrogate_function=surrogate.ATan)


def test_mf_psn_of_the_requested_k_and_dilation_is_kept_without_warning(recwarn):
    net = mf_psn_net(k=2)
    olds = [net[1], net[3]]
    net, summary = replace_neurons(net, k=2)  # sawtooth: 1, 2, as they have
    assert net[1] is olds[0] and net[3] is olds[1] and len(summary) == 0
    assert [s.reason for s in summary.skipped] == ["already k=2, dilation=1", "already k=2, dilation=2"]
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]
    # only the one whose dilation differs is re-configured
    with pytest.warns(UserWarning, match="re-configured 1 MulFreeChannelwisePSN"):
        net, summary = replace_neurons(net, k=2, dilation=2)
    assert net[1] is not olds[0] and net[3] is olds[1] and [r.name for r in summary] == ["1"]


def test_replace_neurons_in_a_time_last_network_with_a_time_first_island():
    """A LIF left time-first inside a time-last network (fallback='time_first') became a time-first MF-PSN
    without the island's transposes: it read (N, C, L, T) as (T, N, C, L), silently wrong where L == C."""
    import copy

    from spikingjelly_mfpsn.convert import to_time_last

    torch.manual_seed(0)
    net = nn.Sequential(layer.Conv1d(2, 5, 3, padding=1), layer.BatchNorm1d(5), neuron.LIFNode(),
                        layer.Flatten(), layer.Linear(25, 3))
    functional.set_step_mode(net, "m")
    x = torch.rand(4, 3, 2, 5)
    ref, _ = replace_neurons(copy.deepcopy(net), k=2, example_input=x)
    tl, _ = replace_neurons(to_time_last(net, fallback="time_first", example_input=x), k=2, example_input=x)
    tl.load_state_dict(ref.state_dict())
    x = torch.randn(4, 3, 2, 5) * 3
    torch.testing.assert_close(tl(x), ref(x))
    with pytest.raises(ValueError, match="to_time_first\\(net\\) first"):
        replace_neurons(tl, k=3, layout="time_first")


@pytest.mark.skipif(sj.PSN is None, reason=f"SpikingJelly {sj.VERSION} has no PSN")
@pytest.mark.parametrize("with_example", [False, True])
def test_a_multi_step_only_psn_becomes_a_multi_step_mf_psn(with_example):
    """Regression: SpikingJelly's PSN has no step_mode (it runs sequences only); its replacement became
    single-step, read (T, N, C) as one step of N = T samples of N channels, and ran with no error."""
    torch.manual_seed(0)
    net = nn.Sequential(layer.Linear(3, 4), sj.PSN(T=5), layer.Linear(4, 2))
    functional.set_step_mode(net, "m")
    x = torch.rand(5, 2, 3)
    net, _ = replace_neurons(net, k=2, example_input=x if with_example else None)
    assert net[1].step_mode == "m"
    want = nn.Sequential(layer.Linear(3, 4), MulFreeChannelwisePSN(4, k=2), layer.Linear(4, 2))
    functional.set_step_mode(want, "m")
    net(x)  # (a lazy neuron takes its width)
    want.load_state_dict(net.state_dict())
    functional.reset_net(net), functional.reset_net(want)
    torch.testing.assert_close(net(x), want(x))


def two_lif_net():
    torch.manual_seed(0)
    net = nn.Sequential(layer.Linear(4, 4), neuron.LIFNode(), layer.Linear(4, 4), neuron.IFNode())
    functional.set_step_mode(net, "m")
    return net


def test_a_layout_the_layers_around_do_not_hand_over_is_refused():
    """layout='time_first' was refused on a network converted with its boundary only: one converted with
    boundary=False switched its neurons and read (N, C, T) as (T, N, C) (12 of 64 spikes off); and
    layout='time_last' on a time-first network (or step_mode='s' on a time-last one) gave neurons that
    read the other axis, silently where N == C."""
    x = torch.randn(4, 4, 4)
    headless = to_time_last(replace_neurons(two_lif_net(), k=2, example_input=x)[0], boundary=False)
    for net, kwargs, match in ((headless, dict(layout="time_first"), "with or without its boundary"),
                               (two_lif_net(), dict(layout="time_last"), "convert the network instead"),
                               (replace_neurons(two_lif_net(), k=2, example_input=x)[0], dict(layout="time_last"),
                                "convert the network"),
                               (to_time_last(two_lif_net(), fallback="time_first"), dict(step_mode="s"),
                                "runs time-last")):
        before = {k: v.clone() for k, v in net.state_dict().items()}
        with pytest.raises(ValueError, match=match):
            replace_neurons(net, k=2, **kwargs)
        assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())


def test_a_lone_neuron_behind_a_boundary_is_replaced_by_one_that_takes_the_same_input():
    """The new neuron copied layout='time_last' but not the boundary: it read (T, N, C) as (N, C, T)."""
    sn = to_time_last(MulFreeChannelwisePSN(4, k=2, step_mode="m", threshold="param", v_threshold=0.0).double())
    new, _ = replace_neurons(sn, k=3, threshold="param", v_threshold=0.0)
    x = torch.randn(5, 4, 4, dtype=torch.float64)
    h, _ = reference.mfpsn_charge(x, new.weight.detach(), 1, "time_first", "param", v_threshold=new.v_threshold.detach())
    assert torch.equal(new(x), (h >= 0).double())


def test_neurons_the_forward_reaches_outside_the_module_tree_are_named():
    """Neurons a forward calls through a plain list were reported replaced, while the old ones kept running."""
    class Staged(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.sn1, self.fc2, self.sn2 = layer.Linear(3, 4), neuron.LIFNode(), layer.Linear(4, 2), \
                neuron.LIFNode()
            self.stages = [(self.fc1, self.sn1), (self.fc2, self.sn2)]

        def forward(self, x):
            for fc, sn in self.stages:
                x = sn(fc(x))
            return x
    net = Staged()
    functional.set_step_mode(net, "m")
    with pytest.warns(UserWarning, match="swapped sn1, sn2 in the network, but its forward still runs the old"):
        replace_neurons(net, k=2, example_input=torch.rand(5, 2, 3))


def test_bad_networks_instances_and_channels_are_named():
    for call in (lambda: replace_neurons(None), lambda: spikingjelly_mfpsn.fuse_batchnorm(None),
                 lambda: spikingjelly_mfpsn.unfuse_batchnorm(None)):
        with pytest.raises(TypeError, match="net must be a torch.nn.Module, got NoneType"):
            call()
    for call in (set_backend, set_method):
        with pytest.raises(TypeError, match="instance must be a module class or a tuple of them, got 3"):
            call(two_lif_net(), "torch" if call is set_backend else "auto", instance=3)
    with pytest.raises(ValueError, match="channels cannot be given"):
        replace_neurons(two_lif_net(), channels=3)


@pytest.mark.parametrize("name", ["TernaryIFNode", "TernaryLIFNode"])
def test_ternary_neurons_are_kept_and_listed_as_skipped(name):
    """Ternary nodes spike -1, 0 or +1: they were replaced by 0/1 MF-PSNs without a word."""
    cls = getattr(neuron, name, None)
    if cls is None:
        pytest.skip(f"SpikingJelly {sj.VERSION} has no neuron.{name}")
    net = nn.Sequential(layer.Linear(4, 6, step_mode="m"), cls(step_mode="m"))
    head = net[1]
    net, summary = replace_neurons(net, k=2)
    assert net[1] is head and not summary.rows
    assert [(s.name, s.reason) for s in summary.skipped] == [("1", "ternary spikes (-1, 0, +1), which a 0/1 "
                                                                   "MF-PSN cannot give")]
    net, summary = replace_neurons(net, k=2, include_readouts=True)
    assert isinstance(net[1], MulFreeChannelwisePSN)


def test_update_bn_recomputes_the_neurons_statistics():
    """torch.optim.swa_utils.update_bn resets and recomputes batch norms only: an AveragedModel's BN-threshold
    neurons kept statistics of other weights (15 of 160 eval spikes off). spikingjelly_mfpsn.update_bn
    recomputes both, as cumulative averages of each batch's statistics of the charge (reference), keeping
    momenta and each module's mode."""
    from torch.optim.swa_utils import AveragedModel
    torch.manual_seed(0)
    net = nn.Sequential(layer.Linear(3, 4, step_mode="m"), layer.SeqToANNContainer(nn.BatchNorm1d(4)),
                        MulFreeChannelwisePSN(4, k=2, dilation=2, step_mode="m"), layer.Linear(4, 4, step_mode="m"),
                        neuron.LIFNode(step_mode="m"))
    data = [torch.randn(5, 8 - i, 3) * 3 + 1 for i in range(4)]
    swa = AveragedModel(net)
    for _ in range(3):
        with torch.no_grad():
            net[0].weight.mul_(1.5)
        swa.update_parameters(net)
    model = swa.module
    model[3].eval()  # (modes are put back)
    spikingjelly_mfpsn.update_bn([(x, 0) for x in data], swa)
    lin, bn, sn = model[0], model[1][0], model[2]
    means, variances = [], []
    for x in data:
        z = lin(x).detach().double()
        mean, var = reference.batch_stats(z, 2)
        h = (z - mean) / torch.sqrt(var + bn.eps) * bn.weight.double() + bn.bias.double()
        y = reference.charge(h, sn.weight.double(), None, 2, "time_first")
        mean, var = reference.batch_stats(y, 2)
        n = y.numel() // y.shape[2]
        means.append(mean)
        variances.append(var * n / (n - 1))
    torch.testing.assert_close(sn.running_mean.double(), torch.stack(means).mean(0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sn.running_var.double(), torch.stack(variances).mean(0), rtol=1e-5, atol=1e-6)
    assert sn.num_batches_tracked == len(data) and sn.momentum == 0.1 and not model[3].training and model.training


OTHER_OUTPUTS = {  # neurons whose outputs a 0/1 MF-PSN cannot give (SpikingJelly 2.x)
    "STBIFNode": (lambda cls: cls(q_threshold=0.5, level=4, sym=True, step_mode="m"), "signed, multi-level"),
    "ILIFNode": (lambda cls: cls(step_mode="m"), "signed, multi-level"),
    "FewSpikeNode": (lambda cls: cls(neuron.FewSpikeTable(theta=[1.0, 0.5], h=[1.0, 0.5], d=[1.0, 0.5]),
                                     step_mode="m"), "weighted spikes"),
    "OTTTLIFNode": (lambda cls: cls(), "[spikes, traces]"),
    "DSRIFNode": (lambda cls: cls(step_mode="m"), "weighted spikes"),
    "DSRLIFNode": (lambda cls: cls(step_mode="m"), "weighted spikes"),
}


@pytest.mark.parametrize("name", sorted(OTHER_OUTPUTS))
def test_neurons_of_other_outputs_are_left_alone(name):
    """STBIF's signed levels, I-LIF's spike counts, the few-spike family's weighted spikes and OTTT's
    [spikes, traces] were swapped for 0/1 MF-PSNs without a word; they are skipped as the ternary nodes are."""
    cls = getattr(neuron, name, None)
    if cls is None:
        pytest.skip(f"SpikingJelly {spikingjelly_mfpsn._compat.SJ_VERSION} has no {name}")
    build, reason = OTHER_OUTPUTS[name]
    net = nn.Sequential(layer.Linear(4, 6, step_mode="m"), neuron.LIFNode(step_mode="m"),
                        layer.Linear(6, 6, step_mode="m"), build(cls))
    kept = net[3]
    net, summary = replace_neurons(net, k=2)
    assert net[3] is kept and isinstance(net[1], MulFreeChannelwisePSN)
    assert [(s.name, s.old) for s in summary.skipped] == [("3", name)] and reason in summary.skipped[0].reason


def _bn_net(fuse=False):
    torch.manual_seed(0)
    net = nn.Sequential(layer.Linear(3, 4, step_mode="m"), layer.SeqToANNContainer(nn.BatchNorm1d(4)),
                        MulFreeChannelwisePSN(4, step_mode="m"))
    if fuse:
        spikingjelly_mfpsn.fuse_batchnorm(net)
    return net


@pytest.mark.parametrize("fuse", [False, True])
def test_update_bn_of_a_time_last_network(fuse):
    """The batch norms of a to_time_last network (wrapped, so not torch batch norms) were neither reset nor
    averaged: blended with momentum 0.1 instead, and eval outputs differed from the time-first network's."""
    data = [torch.randn(5, 2, 3) * 2 + 1 for _ in range(3)]
    nets = [_bn_net(fuse), to_time_last(_bn_net(fuse), example_input=data[0])]
    for net in nets:
        net(torch.randn(5, 2, 3) * 9 - 4)  # (statistics of earlier training)
        spikingjelly_mfpsn.update_bn(data, net)
    first, last = (n.state_dict() for n in nets)
    for key in ("1.0.running_mean", "1.0.running_var", "2.running_mean", "2.running_var"):
        torch.testing.assert_close(first[key], last[key])
    first, last = nets
    with torch.no_grad():
        assert torch.equal(first.eval()(data[0]), last.eval()(data[0]))


def test_update_bn_keeps_the_statistics_when_a_batch_fails_and_skips_folded_neurons():
    """A batch that failed left every statistic reset (trained ones lost); a folded network failed with
    advice to call net.eval(), which update_bn itself undid."""
    net = _bn_net()
    for _ in range(5):
        net(torch.randn(5, 8, 3) * 3 + 1)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(RuntimeError, match="same dtype"):  # (the Linear's error, at the second batch)
        spikingjelly_mfpsn.update_bn([torch.randn(5, 8, 3), torch.randn(5, 8, 3, dtype=torch.float64)], net)
    for key, value in net.state_dict().items():
        assert torch.equal(value, before[key]), key
    folded = spikingjelly_mfpsn.deploy.fold(net.eval())
    spikingjelly_mfpsn.update_bn([torch.randn(5, 8, 3)], folded)
    assert not folded.training and folded.state_dict()["1.0.num_batches_tracked"] == 1
