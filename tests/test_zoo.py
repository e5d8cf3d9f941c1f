"""SpikingJelly's model zoo, converted as a user would: every family's network (``--zoo=all``: every
constructor) built by the zoo's own constructor with ``IFNode``, its neurons replaced by MF-PSN, then
converted to the time-last layout from one example input. The converted network gives the time-first
network's outputs (float64), keeps its state_dict keys, and autoselect times it in both layouts."""
import copy
import warnings

import torch
from spikingjelly.activation_based import functional

import spikingjelly_mfpsn as mf
from spikingjelly_mfpsn.convert import has_time_last_boundary

import zoo

TOL = dict(rtol=1e-9, atol=1e-9)

# Modules with no time-last version, run time-first inside the time-last network (fallback='time_first'):
# the attention of the attention MS-ResNets and MASNN mixes time steps (MultiDimensionalAttention), the
# OTTT VGGs' weight-standardised layers and Scale modules have their own forward.
NEEDS_FALLBACK = {"att_ms_resnet18", "masnn_dvs128_gesture"} | {name for name in zoo.ZOO if name.startswith("ottt_")}


def eval_out(net, x):
    was_training = net.training
    net.eval()
    with torch.no_grad():
        out = net(x)
    functional.reset_net(net)
    net.train(was_training)
    return out


def test_zoo_net_converts_to_time_last(zoo_name):
    net, x = zoo.ZOO[zoo_name]()
    net, summary = mf.replace_neurons(net, k=2, example_input=x)
    assert len(summary) > 0
    net, x = net.double().eval(), x.double()
    time_first = copy.deepcopy(net)
    keys = list(net.state_dict())
    fallback = "time_first" if zoo_name in NEEDS_FALLBACK else None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no module-only conversion: every call is rewritten
        net = mf.to_time_last(net, example_input=x, fallback=fallback)
    assert has_time_last_boundary(net)
    assert any(m.layout == "time_last" for m in net.modules() if isinstance(m, mf.MulFreeChannelwisePSN))
    assert list(net.state_dict()) == keys
    torch.testing.assert_close(eval_out(net, x), eval_out(time_first, x), **TOL)
    for m in list(net.modules()) + list(time_first.modules()):  # batch statistics; dropout off
        m.train("Dropout" not in type(m).__name__)
    torch.testing.assert_close(net(x), time_first(x), **TOL)


def test_autoselect_times_zoo_net_in_both_layouts(zoo_name):
    net, x = zoo.ZOO[zoo_name]()
    net, _ = mf.replace_neurons(net, k=2, example_input=x)
    before = eval_out(net, x)
    fallback = "time_first" if zoo_name in NEEDS_FALLBACK else None
    report = mf.autoselect(net, x, m=1, cache=False, progress=False, fallback=fallback,
                           measure_fn=lambda module, args, m: 1e-3)
    assert set(report.layouts) == {"time_first", "time_last"} and not report.skipped, report.skipped
    torch.testing.assert_close(eval_out(net, x), before, rtol=1e-4, atol=1e-5)


def test_zoo_net_fuses_its_batch_norms(zoo_name):
    """``fuse_batchnorm`` on the zoo's hand-written forwards (fx-traced from the example input): a training
    step (dropout seeded alike) and eval give the layers apart's outputs, gradients and state."""
    net, x = zoo.ZOO[zoo_name]()
    net, _ = mf.replace_neurons(net, k=2, example_input=x)
    net, x = net.double(), x.double()
    apart = copy.deepcopy(net)
    keys = list(net.state_dict())
    pairs = mf.fuse_batchnorm(net, example_input=x)
    if zoo_name.startswith(("spiking_resnet", "sew_resnet")):
        assert ("layer1.0.bn1", "layer1.0.sn1") in pairs  # in a block's own forward
    assert list(net.state_dict()) == keys
    outs = []
    for model in (net, apart):
        torch.manual_seed(0)
        out = model(x)
        out.sum().backward()
        outs.append((out, {k: p.grad for k, p in model.named_parameters()}, model.state_dict()))
        functional.reset_net(model)
    (out, grads, state), (out2, grads2, state2) = outs
    torch.testing.assert_close(out, out2, **TOL)
    for k in grads:
        torch.testing.assert_close(grads[k], grads2[k], **TOL, msg=k)
    for k in state:
        torch.testing.assert_close(state[k], state2[k], **TOL, msg=k)
    torch.testing.assert_close(eval_out(net, x), eval_out(apart, x), **TOL)
