"""Folding, integer bit-shift inference and streaming, held against the plain loop reference."""
import copy
import io
import itertools
import warnings

import pytest
import torch
import torch.nn as nn
from spikingjelly.activation_based import functional, layer
from torch.utils._python_dispatch import TorchDispatchMode

from spikingjelly_mfpsn import MulFreeChannelwisePSN, deploy, energy, ops
from spikingjelly_mfpsn import functional as mf_functional
from spikingjelly_mfpsn.deploy import FoldedMulFreePSN

import reference
from nets import Gained, small_inputs_net

GRID = 3  # test inputs and synaptic weights are multiples of 2**-GRID
FRAC_BITS = 8  # enough for every neuron input of the test networks (multiples of 2**-2*GRID)


def on_grid(*shape, bits=GRID, scale=2.0):
    return torch.round(torch.randn(*shape) * scale * 2 ** bits) / 2 ** bits


def randomise(neuron: MulFreeChannelwisePSN) -> MulFreeChannelwisePSN:
    """Random weights and threshold statistics, so fused exponents span left and right shifts."""
    c = neuron.channels
    with torch.no_grad():
        neuron.weight.copy_(torch.randn_like(neuron.weight))
        if neuron.threshold == "bn":
            neuron.gamma.copy_(torch.empty(c).uniform_(0.3, 2.0) * torch.sign(torch.randn(c)))
            neuron.beta.copy_(torch.randn(c) * 0.5 - 0.3)
            neuron.running_mean.copy_(torch.randn(c) * 0.5)
            neuron.running_var.copy_(torch.empty(c).uniform_(0.2, 3.0))
        else:
            neuron.v_threshold.copy_(torch.randn(c) * 0.5 + 0.5)
    return neuron


def grid_synapse(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(on_grid(*p.shape, scale=0.5))
    return module


def random_net(k, d, threshold, channels=4, length=5):
    """Conv1d -> MF-PSN -> Conv1d -> MF-PSN -> Flatten -> Linear -> MF-PSN on (T, N, 2, length)."""
    def sn(c, dil):
        return randomise(MulFreeChannelwisePSN(c, k=k, dilation=dil, threshold=threshold, exp_init=False,
                                               step_mode="m"))
    return nn.Sequential(
        grid_synapse(layer.Conv1d(2, channels, 3, padding=1, step_mode="m")), sn(channels, d),
        grid_synapse(layer.Conv1d(channels, channels, 3, padding=1, step_mode="m")), sn(channels, d % 3 + 1),
        layer.Flatten(step_mode="m"),
        grid_synapse(layer.Linear(channels * length, 6, step_mode="m")), sn(6, 1)).eval()


def reference_spikes(folded: FoldedMulFreePSN, x: torch.Tensor) -> torch.Tensor:
    """Theta of the plain-loop charge in float64 with W = sign * 2**shift built element by element."""
    w = torch.tensor([[s * 2.0 ** e for s, e in zip(srow, erow)]
                      for srow, erow in zip(folded.sign.tolist(), folded.shift.tolist())], dtype=torch.float64)
    return (reference.charge(x.double(), w, folded.bias.double(), folded.dilation, folded.layout) >= 0).double()


def run_capturing(net, x):
    """Run ``net`` and return {neuron name: (input, output)} of its folded neurons."""
    seen = {}
    hooks = [m.register_forward_hook(lambda mod, i, o, n=n: seen.__setitem__(n, (i[0], o)))
             for n, m in deploy.folded_neurons(net)]
    functional.reset_net(net)
    with torch.no_grad():
        out = net(x)
    for h in hooks:
        h.remove()
    return out, seen


CASES = [(k, d, th) for (k, d), th in itertools.product([(1, 1), (2, 1), (3, 2), (5, 3), (4, 1)], ["bn", "param"])]


@pytest.mark.parametrize("k,d,threshold", CASES)
def test_folded_equals_unfolded(k, d, threshold):
    torch.manual_seed(k * 7 + d)
    net = random_net(k, d, threshold)
    x = on_grid(9, 3, 2, 5)
    with torch.no_grad():
        want = net(x)
    deploy.fold(net)
    assert not any(isinstance(m, MulFreeChannelwisePSN) for m in net.modules())
    functional.reset_net(net)
    with torch.no_grad():
        got = net(x)
    assert torch.equal(got, want)


@pytest.mark.parametrize("arithmetic", ["float", "integer"])
def test_a_folded_network_converts_layout_and_takes_an_inference_autoselect(arithmetic, tmp_path):
    """Folded neurons follow the neuron's configuration protocol: ``to_time_last`` converts a folded
    network (float or integer path) with the same spikes, methods are settable (and checked), and
    autoselect under no_grad times them and applies a plan with the same outputs."""
    from spikingjelly_mfpsn import autoselect
    from spikingjelly_mfpsn.convert import to_time_first, to_time_last
    torch.manual_seed(5)
    net = deploy.fold(random_net(3, 2, "bn"))
    if arithmetic == "integer":
        deploy.set_integer(net, FRAC_BITS)
    x = on_grid(9, 3, 2, 5)
    want, _ = run_capturing(net, x)
    to_time_last(net)
    assert all(m.layout == "time_last" for _, m in deploy.folded_neurons(net))
    assert torch.equal(run_capturing(net, x)[0], want)
    to_time_first(net)
    neuron = deploy.folded_neurons(net)[0][1]
    assert "shift_add" in neuron.supported_methods
    neuron.method = "shift_add"
    with pytest.raises(ValueError, match="method must be one of"):
        neuron.method = "no_such_method"
    with torch.no_grad():
        report = autoselect(net, x, m=1, cache=str(tmp_path / "c.json"), progress=False)
    assert report.layout is not None and not report.skipped, report.skipped
    names = [n for n, _ in deploy.folded_neurons(net)]
    assert names and all(report.methods[n] in ops.names() for n in names)  # timed and chosen, not '-'
    assert torch.equal(run_capturing(net, x)[0], want)


def test_a_neuron_used_at_two_places_folds_into_one():
    torch.manual_seed(2)
    sn = randomise(MulFreeChannelwisePSN(4, k=3, exp_init=False, step_mode="m"))
    net = nn.Sequential(grid_synapse(layer.Conv1d(2, 4, 3, padding=1, step_mode="m")), sn,
                        grid_synapse(layer.Conv1d(4, 4, 3, padding=1, step_mode="m")), sn).eval()
    x = on_grid(9, 3, 2, 5)
    with torch.no_grad():
        want = net(x)
    deploy.fold(net)
    assert isinstance(net[1], FoldedMulFreePSN) and net[3] is net[1]  # (it used to fold the first place only)
    assert torch.equal(run_capturing(net, x)[0], want)


def test_folded_neuron_keeps_no_float_weight():
    n = randomise(MulFreeChannelwisePSN(5, k=4, step_mode="m"))
    f = deploy.fold(n)
    assert list(f.parameters()) == []
    assert f.shift.dtype == torch.int8 and f.sign.dtype == torch.int8 and f.shift.shape == (5, 4)
    float_buffers = [name for name, b in f.named_buffers() if b.is_floating_point()]
    assert float_buffers == ["bias"]


@pytest.mark.parametrize("k,d,threshold", CASES)
def test_integer_path_equals_float_path_on_random_networks(k, d, threshold):
    torch.manual_seed(100 + k * 7 + d)
    net = deploy.fold(random_net(k, d, threshold)).double()
    x = on_grid(11, 3, 2, 5).double()
    out_float, float_seen = run_capturing(net, x)
    deploy.set_integer(net, FRAC_BITS)
    out_int, int_seen = run_capturing(net, x)
    modules = dict(deploy.folded_neurons(net))
    assert set(float_seen) == set(int_seen) == set(modules)
    fired = 0
    for name, (inp, spikes) in float_seen.items():
        inp_i, spikes_i = int_seen[name]
        want = reference_spikes(modules[name], inp)
        assert torch.equal(inp_i, inp)  # so upstream spikes agreed too
        assert torch.equal(spikes, want), name
        assert torch.equal(spikes_i, want), name
        fired += int(want.sum())
    assert 0 < fired  # the comparison is not all-silent
    assert torch.equal(out_int, out_float)


@pytest.mark.parametrize("layout", ["time_first", "time_last"])
@pytest.mark.parametrize("k,d", [(1, 1), (3, 1), (4, 2), (6, 3)])
def test_integer_neuron_matches_reference(layout, k, d):
    torch.manual_seed(k + 10 * d)
    f = deploy.fold(randomise(MulFreeChannelwisePSN(3, k=k, dilation=d, exp_init=False, step_mode="m",
                                                    layout=layout)))
    shape = (7, 2, 3, 4) if layout == "time_first" else (2, 3, 4, 7)
    x = on_grid(*shape, bits=5)
    deploy.set_integer(f, 5)
    got = f(x)
    assert got.dtype == x.dtype
    assert torch.equal(got.double(), reference_spikes(f, x))
    # An integer input is taken as already fixed point with frac_bits fractional bits.
    assert torch.equal(f(deploy.to_fixed(x, 5)).double(), reference_spikes(f, x))


def test_int_charge_of_no_channels_is_empty():
    q = torch.zeros(4, 2, 0, dtype=torch.int64)  # (its overflow check read the largest shift of none)
    out = deploy.int_charge(q, torch.zeros(0, 3, dtype=torch.int8), torch.ones(0, 3, dtype=torch.int8), 1)
    assert out.shape == q.shape and not out.is_floating_point()


def test_narrow_accumulator_uses_flooring_right_shifts():
    torch.manual_seed(3)
    shift = torch.tensor([[-3, 1, -1], [2, -2, 0]], dtype=torch.int8)
    sign = torch.tensor([[1, -1, 1], [-1, 1, 0]], dtype=torch.int8)
    q = torch.randint(-50, 50, (6, 2, 2))
    got = deploy.int_charge(q, shift, sign, dilation=2, extra_bits=0)
    for t, n, c in itertools.product(range(6), range(2), range(2)):  # plain Python ints: >> floors
        acc = 0
        for i in range(3):
            src = t - (2 - i) * 2
            if src >= 0:
                v, a = int(q[src, n, c]), int(shift[c, i])
                acc += int(sign[c, i]) * (v << a if a >= 0 else v >> -a)
        assert int(got[t, n, c]) == acc


def test_float32_agreement_is_measured():
    torch.manual_seed(5)
    net = deploy.fold(random_net(4, 2, "bn"))
    x = torch.randn(12, 4, 2, 5)  # off the fixed-point grid: rounded on entry
    rates = deploy.agreement(net, x, frac_bits=16)
    assert set(rates) == {n for n, _ in deploy.folded_neurons(net)}
    for r in rates.values():
        assert 0.99 <= r["local"] <= 1.0 and 0.0 <= r["network"] <= 1.0
    with pytest.warns(UserWarning, match="integer spikes differ from the float path's on .*calibrate"):
        coarse = deploy.agreement(net, x, frac_bits=0)  # rounding inputs to integers does change spikes
    assert min(r["local"] for r in coarse.values()) < 1.0
    assert all(m.frac_bits is None for _, m in deploy.folded_neurons(net))  # left on the float path
    # A network of several inputs takes them as a tuple (as autoselect): the same rates.
    gained = Gained(net)
    assert deploy.agreement(gained, (x / 2, torch.full((1,), 2.0)), frac_bits=16) == \
        {f"body.{name}": r for name, r in rates.items()}


def test_agreement_leaves_an_integer_network_integer():
    """As docs/deployment.rst runs it: set_integer, agreement, then inference, which stays in the integer
    arithmetic and formats set_integer chose (agreement switched the network to float)."""
    torch.manual_seed(5)
    net = deploy.fold(random_net(4, 2, "bn"))
    x = torch.randn(12, 4, 2, 5)
    deploy.set_integer(net, frac_bits=3)  # (coarse: its spikes differ from the float path's)
    with torch.no_grad():
        integer = net(x)
    with pytest.warns(UserWarning, match="integer spikes differ"):
        deploy.agreement(net, x)
    assert [m.frac_bits for _, m in deploy.folded_neurons(net)] == [3, 3, 3]
    with torch.no_grad():
        assert torch.equal(net(x), integer) and not torch.equal(deploy.set_float(net)(x), integer)


def test_agreement_takes_an_accumulator_format_alone():
    """``acc_frac_bits`` without ``frac_bits``: each neuron's own input format with that accumulator (it
    was ignored)."""
    torch.manual_seed(5)
    net = deploy.fold(random_net(4, 2, "bn"))
    x = on_grid(12, 4, 2, 5)
    exact = deploy.agreement(net, x)
    with pytest.warns(UserWarning, match="integer spikes differ"):
        narrow = deploy.agreement(net, x, acc_frac_bits=0)  # products floored to integers
    assert min(r["local"] for r in exact.values()) == 1.0 > min(r["local"] for r in narrow.values())
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="acc_frac_bits must be an int"):
            deploy.agreement(net, x, acc_frac_bits=bad)


@pytest.mark.parametrize("t,k,d", [(10, 3, 1), (2, 5, 1), (9, 4, 3), (4, 3, 2), (1, 2, 1)])
def test_integer_path_counts_its_operations(t, k, d):
    f = deploy.fold(MulFreeChannelwisePSN(3, k=k, dilation=d, step_mode="m"))
    tally = {}
    bias_int = torch.zeros(3, dtype=torch.int64)
    deploy.int_fire(torch.ones(t, 2, 3, 5, dtype=torch.int64), f.shift, f.sign, bias_int, d, tally=tally)
    brute = sum(1 for step in range(t) for j in range(k) if step - j * d >= 0)  # (step, tap) pairs inside
    assert tally == {"shift": brute * 30, "add": (brute + t) * 30}
    assert energy.taps_in_sequence(t, k, d) == brute


class _OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_integer_neuron_runs_no_multiplication():
    f = deploy.fold(randomise(MulFreeChannelwisePSN(4, k=5, dilation=2, exp_init=False, step_mode="m")))
    q = torch.randint(-100, 100, (9, 2, 4, 3))
    extra, bias_int = 4, deploy.int_bias(f.bias, FRAC_BITS + 4)
    with _OpRecorder() as rec:
        deploy.int_fire(q, f.shift, f.sign, bias_int, f.dilation, extra_bits=extra)
    banned = ("mul", "mm", "conv", "div", "matmul", "addcmul", "pow", "ldexp", "exp")
    assert any("bitwise_left_shift" in n for n in rec.names)
    assert [n for n in rec.names if any(b in n.split("::")[-1] for b in banned)] == []


def stream(net, x):
    """Feed ``x`` one step at a time; return the stacked outputs and the neurons' state sizes."""
    functional.set_step_mode(net, "s")
    functional.reset_net(net)
    with torch.no_grad():
        out = torch.stack([net(x_t) for x_t in x])
    queues = [m.x_queue for _, m in deploy.folded_neurons(net)]
    functional.set_step_mode(net, "m")
    functional.reset_net(net)
    return out, [(len(q), sum(t.numel() * t.element_size() for t in q)) for q in queues]


@pytest.mark.parametrize("arithmetic", ["float", "integer"])
def test_streaming_matches_multi_step_with_constant_memory(arithmetic):
    torch.manual_seed(11)
    net = deploy.fold(random_net(4, 2, "bn"))
    if arithmetic == "integer":
        deploy.set_integer(net, FRAC_BITS)
    sizes = []
    for t in (12, 40):
        x = on_grid(t, 2, 2, 5)
        functional.reset_net(net)
        with torch.no_grad():
            want = net(x)
        got, state = stream(net, x)
        assert torch.equal(got, want)
        sizes.append(state)
    assert sizes[0] == sizes[1]
    assert [n for n, _ in sizes[0]] == [(m.k - 1) * m.dilation for _, m in deploy.folded_neurons(net)]


@pytest.mark.parametrize("arithmetic", ["float", "integer"])
def test_streaming_through_one_refilled_buffer_matches_multi_step(arithmetic):
    """The step history held the caller's tensor itself (a float input, or an int64 fixed-point one in
    integer arithmetic): frames streamed through one preallocated buffer rewrote it, silently."""
    torch.manual_seed(12)
    f = deploy.fold(randomise(MulFreeChannelwisePSN(3, k=3, dilation=2, threshold="bn", exp_init=False,
                                                    step_mode="m")).eval())
    x = on_grid(9, 2, 3)
    if arithmetic == "integer":
        deploy.set_integer(f, FRAC_BITS)
        x = (x * 2 ** FRAC_BITS).long()
    with torch.no_grad():
        want = f(x)
        f.step_mode = "s"
        buffer, got = torch.empty_like(x[0]), []
        for x_t in x:
            buffer.copy_(x_t)
            got.append(f(buffer))
    assert torch.equal(torch.stack(got), want)


@pytest.mark.parametrize("arithmetic", ["float", "integer"])
def test_streaming_state_moves_with_the_network_and_keeps_its_dtype(arithmetic):
    """Mid-stream, ``net.to(device)`` moves every neuron's queued steps (integer ones too, which a dtype
    cast such as ``net.double()`` leaves integer)."""
    torch.manual_seed(12)
    net = deploy.fold(random_net(3, 1, "bn"))
    if arithmetic == "integer":
        deploy.set_integer(net, FRAC_BITS)
    functional.set_step_mode(net, "s")
    functional.reset_net(net)
    with torch.no_grad():
        for x_t in on_grid(3, 2, 2, 5):
            net(x_t)
    dtypes = [[t.dtype for t in m.x_queue] for _, m in deploy.folded_neurons(net)]
    assert all(dtypes) and all(d != torch.float64 for ds in dtypes for d in ds)
    net.double()
    cast = [[t.dtype for t in m.x_queue] for _, m in deploy.folded_neurons(net)]
    assert cast == [[torch.float64 if d.is_floating_point else d for d in ds] for ds in dtypes]
    net.to("meta")
    assert all(t.device.type == "meta" for _, m in deploy.folded_neurons(net) for t in m.x_queue)


@pytest.mark.skipif("cpp" not in ops.names(), reason="backend 'cpp' needs a C++ compiler")
def test_folded_float_streaming_on_cpp_runs_one_kernel_per_step():
    """Folded neurons of a 'cpp' network stream through the fused single-step kernel (their Wq are
    powers of two already: no quantiser) and give the spikes of the same folded net on PyTorch."""
    torch.manual_seed(11)
    base = random_net(4, 2, "bn")
    want_net = deploy.fold(copy.deepcopy(base))
    mf_functional.set_method(base, "cpp")
    net = deploy.fold(base)
    for _, m in deploy.folded_neurons(net):
        assert m.method == "cpp"
    x = on_grid(12, 2, 2, 5)

    class CountMultiplications(torch.overrides.TorchFunctionMode):
        count = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            CountMultiplications.count += "mul" in getattr(func, "__name__", "")
            return func(*args, **(kwargs or {}))

    with CountMultiplications():  # the general path multiplies each tap; the kernel runs outside torch
        got, _ = stream(net, x)
    want, _ = stream(want_net, x)
    assert torch.equal(got, want) and 0 < got.mean() < 1
    assert CountMultiplications.count == 0


def test_folded_checkpoint_round_trip(tmp_path):
    torch.manual_seed(13)
    net = deploy.fold(random_net(3, 2, "bn"))
    x = on_grid(8, 2, 2, 5)
    _, want = run_capturing(net, x)
    path = tmp_path / "folded.pt"
    torch.save(net.state_dict(), path)
    state = torch.load(path)
    assert state["1.shift"].dtype == torch.int8 and "1.weight" not in state
    # A fresh net folded the same way (and with another charge implementation) loads it.
    fresh = random_net(3, 2, "bn")
    for m in fresh.modules():
        if isinstance(m, MulFreeChannelwisePSN):
            m.method = "conv1d"
    fresh = deploy.fold(fresh)
    fresh.load_state_dict(state)
    _, got = run_capturing(fresh, x)
    for name in want:
        assert torch.equal(got[name][1], want[name][1])
    buffer = io.BytesIO()
    torch.save(fresh, buffer)
    buffer.seek(0)
    whole = torch.load(buffer, weights_only=False)
    assert torch.equal(whole[1].shift, net[1].shift)


def test_unfold_gives_trainable_neurons_with_the_same_eval_output():
    torch.manual_seed(17)
    net = random_net(3, 1, "bn")
    x = on_grid(7, 2, 2, 5)
    with torch.no_grad():
        want = net(x)
    deploy.unfold(deploy.fold(net))
    neurons = [m for m in net.modules() if isinstance(m, MulFreeChannelwisePSN)]
    assert len(neurons) == 3 and all(n.threshold == "param" for n in neurons)
    functional.reset_net(net)
    with torch.no_grad():
        assert torch.equal(net(x), want)
    net.train()
    functional.reset_net(net)
    net(x).sum().backward()
    assert neurons[0].weight.grad is not None


def test_bad_input_gives_clear_errors():
    f = deploy.fold(randomise(MulFreeChannelwisePSN(3, k=2, step_mode="m")))
    with pytest.raises(TypeError, match="integer.*fixed-point.*to_fixed"):
        deploy.int_charge(torch.randn(4, 1, 3), f.shift, f.sign, 1)
    with pytest.raises(TypeError, match="shift must be an integer"):
        deploy.int_charge(torch.ones(4, 1, 3, dtype=torch.int64), f.shift.float(), f.sign, 1)
    with pytest.raises(ValueError, match=r"sign must have shape \(C, k\) = \(3, k\)"):
        deploy.int_charge(torch.ones(4, 1, 3, dtype=torch.int64), f.shift, f.sign[:2], 1)
    with pytest.raises(OverflowError, match="accumulator"):
        deploy.int_charge(torch.full((4, 1, 3), 2 ** 40), f.shift, f.sign, 1, extra_bits=30)
    with pytest.raises(OverflowError, match="frac_bits"):
        deploy.to_fixed(torch.tensor([1e30]), 8)
    with pytest.raises(ValueError, match="frac_bits"):
        deploy.set_integer(f, -1)
    unfolded = nn.Sequential(layer.Linear(3, 3, step_mode="m"), MulFreeChannelwisePSN(3, step_mode="m"))
    with pytest.raises(ValueError, match="not folded.*fold"):
        deploy.set_integer(unfolded)
    with pytest.raises(ValueError, match="not folded"):
        deploy.agreement(unfolded, torch.randn(4, 1, 3))
    with pytest.raises(ValueError, match="no FoldedMulFreePSN"):
        deploy.set_integer(nn.Sequential(nn.Linear(2, 2)))
    f.train()
    with pytest.raises(RuntimeError, match="inference-only.*unfold"):
        f(torch.randn(4, 1, 3))
    with pytest.raises(ValueError, match="channels are not known"):
        deploy.fold(MulFreeChannelwisePSN(None, step_mode="m"))
    with pytest.raises(ValueError, match="quantize=True"):
        deploy.fold(MulFreeChannelwisePSN(3, quantize=False))
    # A refused neuron leaves the network as it was (it was half folded, its batch norms unfused)
    half = nn.Sequential(layer.Linear(3, 4, step_mode="m"), layer.BatchNorm1d(4, step_mode="m"),
                         MulFreeChannelwisePSN(4, k=2, step_mode="m"), layer.Linear(4, 2, step_mode="m"),
                         MulFreeChannelwisePSN(2, k=2, quantize=False, step_mode="m"))
    mf_functional.fuse_batchnorm(half)
    kinds = [type(m) for m in half]
    with pytest.raises(ValueError, match="cannot fold layer '4': its weights are not quantised"):
        deploy.fold(half)
    assert [type(m) for m in half] == kinds and half[2].input_bn is half[1]
    # Calibration runs whole sequences: a streaming net failed in a channel check, or named agreement
    streaming = deploy.fold(nn.Sequential(layer.Linear(8, 3), MulFreeChannelwisePSN(3, k=2)).eval())
    for x in (torch.rand(5, 2, 8), torch.rand(2, 8)):
        with pytest.raises(ValueError, match=r"calibrate=.*whole sequences.*neurons 1 are in step_mode='s'"):
            deploy.set_integer(streaming, calibrate=x)
    assert streaming[1].frac_bits is None


# ---------------------------------------------------------------- no silent wrong answers
def test_the_calibrated_and_default_formats_give_the_float_spikes():
    """Regression: with the old default format (8 fractional bits) a small network's integer spikes
    differed from its float eval spikes. Calibrated per layer on the data, and by default (24 bits),
    they are identical, with no warning; a format too coarse is reported loudly."""
    torch.manual_seed(21)
    net = deploy.fold(random_net(3, 2, "bn"))
    x = torch.randn(16, 8, 2, 5)  # off the fixed-point grid
    functional.reset_net(net)
    with torch.no_grad():
        want = net(x)
    for call in (dict(calibrate=x), {}):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            deploy.set_integer(net, **call)
        assert all(m.frac_bits is not None for _, m in deploy.folded_neurons(net))
        functional.reset_net(net)
        with torch.no_grad():
            assert torch.equal(net(x), want), call
        deploy.set_float(net)
    deploy.set_integer(net, calibrate=x, headroom_bits=0)
    widest = {n: m.frac_bits for n, m in deploy.folded_neurons(net)}
    assert all(20 <= f <= 62 for f in widest.values()), widest
    with pytest.warns(UserWarning, match="integer spikes differ"):
        deploy.set_integer(net, frac_bits=0, calibrate=x)


def test_calibration_headroom_bounds_the_inputs():
    """Inputs up to 2**headroom_bits times the calibration data's fit; larger ones raise
    OverflowError naming the layer, never wrap."""
    torch.manual_seed(3)
    net = deploy.fold(random_net(2, 1, "param"))
    x = torch.randn(6, 2, 2, 5)
    deploy.set_integer(net, calibrate=x, headroom_bits=2)
    functional.reset_net(net)
    net(x * 3.9)
    functional.reset_net(net)
    with pytest.raises(OverflowError, match="layer '1' .*fractional bits.*calibrate"):
        net(x * 1e6)


@pytest.mark.parametrize("headroom", [0, 2])
def test_the_calibrated_format_holds_its_largest_input_rounded_up(headroom):
    """An input just below a power of two rounds up to it in fixed point, one bit more than the format
    was chosen for: with weights spanning 40 octaves, set_integer failed on its own calibration data
    (headroom 0), or on an input 2**headroom times its largest (the docs say such inputs fit)."""
    sn = MulFreeChannelwisePSN(1, k=2, step_mode="m", threshold="param", exp_init=False)
    with torch.no_grad():
        sn.weight.copy_(torch.tensor([[2.0 ** 20, 2.0 ** -20]]))
        sn.v_threshold.fill_(1.0)
    f = deploy.fold(sn.eval())
    x = torch.tensor([1 - 2.0 ** -24, 0.5, -0.25]).view(3, 1, 1)
    deploy.set_integer(f, calibrate=x, headroom_bits=headroom)
    functional.reset_net(f)
    top = x * 2 ** headroom
    assert torch.equal(f(top), reference_spikes(f, top))


def test_the_most_negative_int64_is_out_of_range():
    """Regression: abs() of int64's most negative value stays negative, so the range check passed
    it and the accumulator wrapped silently."""
    f = deploy.fold(randomise(MulFreeChannelwisePSN(3, k=2, step_mode="m")))
    q = torch.ones(4, 1, 3, dtype=torch.int64)
    q[1, 0, 1] = torch.iinfo(torch.int64).min
    with pytest.raises(OverflowError, match="accumulator"):
        deploy.int_charge(q, f.shift, f.sign, 1)
    deploy.set_integer(f, 0)
    with pytest.raises(OverflowError, match="FoldedMulFreePSN .*accumulator"):
        f(q)


def test_unfolding_a_float64_network_keeps_float64():
    """Regression: unfold gave float32 neurons in a float64 network (and other eval outputs)."""
    torch.manual_seed(4)
    net = random_net(3, 1, "bn").double()
    x = torch.randn(7, 3, 2, 5, dtype=torch.float64)
    with torch.no_grad():
        want = net(x)
    deploy.unfold(deploy.fold(net))
    neurons = [m for m in net.modules() if isinstance(m, MulFreeChannelwisePSN)]
    assert neurons and all(p.dtype == torch.float64 for n in neurons for p in n.parameters())
    functional.reset_net(net)
    with torch.no_grad():
        assert torch.equal(net(x), want)


def test_unfolding_keeps_a_float64_threshold_exactly():
    """Regression: the unfolded neuron was made in float32, given the weight and threshold, then
    converted: V_th = 0.1 became float32's 0.1, and a charge of exactly V_th no longer fired."""
    sn = MulFreeChannelwisePSN(1, k=1, threshold="param", step_mode="m").double().eval()
    with torch.no_grad():
        sn.weight.fill_(1.0)
        sn.v_threshold.fill_(0.1)
    x = torch.full((1, 1, 1), 0.1, dtype=torch.float64)  # charge 0.1 >= V_th: a spike
    neuron = deploy.fold(sn).to_neuron().eval()
    assert neuron.v_threshold.item() == 0.1
    with torch.no_grad():
        assert sn(x).item() == 1.0 and neuron(x).item() == 1.0  # H = 1 * 0.1 - 0.1 = 0 fires


def test_reset_net_of_the_parent_reaches_a_folded_block():
    """Regression: ``deploy.fold(root[0])`` after ``reset_net(root)``, with the old neuron still
    referenced, left SpikingJelly 2.x's cache of ``root`` naming the old neuron: the folded one kept the
    last sequence's input and fired on the first step of the next."""
    sn = MulFreeChannelwisePSN(2, k=2, threshold="param", v_threshold=0.5, step_mode="s", exp_init=False)
    with torch.no_grad():
        sn.weight.fill_(1.0)
    root = nn.Sequential(nn.Sequential(nn.Identity(), sn)).eval()
    functional.reset_net(root)
    deploy.fold(root[0])  # (``sn`` still names the old neuron)
    with torch.no_grad():
        root(torch.ones(1, 2))
        functional.reset_net(root)
        assert root(torch.zeros(1, 2)).sum().item() == 0.0  # no input yet: H = 0 < V_th


def test_unsigned_inputs_are_named_as_such():
    f = deploy.fold(randomise(MulFreeChannelwisePSN(3, k=2, step_mode="m")))
    deploy.set_integer(f)
    with pytest.raises(TypeError, match="unsigned"):
        f(torch.ones(4, 1, 3, dtype=torch.uint16))
    deploy.set_float(f)
    with pytest.raises(TypeError, match="unsigned"):
        f(torch.ones(4, 1, 3, dtype=torch.uint8))



@pytest.mark.parametrize("call", [dict(dilation=0), dict(dilation=True), dict(dilation=1.0), dict(sign=2),
                                  dict(sign=-3)])
def test_int_charge_refuses_a_bad_dilation_or_sign(call):
    """Regression: dilation 0 summed every tap at lag 0, and a sign of 2 counted as +1, silently."""
    q = torch.ones(3, 1, 2, dtype=torch.int64)
    shift, sign = torch.zeros(2, 2, dtype=torch.int8), torch.ones(2, 2, dtype=torch.int8)
    if "sign" in call:
        sign[1, 0] = call["sign"]
    name = "sign" if "sign" in call else "dilation"
    with pytest.raises(ValueError, match=f"{name} must"):
        deploy.int_charge(q, shift, sign, call.get("dilation", 1))


@pytest.mark.parametrize("headroom", [-5, 2.5, True, 63, "2"])
def test_set_integer_refuses_a_bad_headroom_and_changes_nothing(headroom):
    """Regression: a negative headroom fitted formats too narrow for the calibration data itself; the
    agreement check then raised OverflowError and left the net in that format (every forward raised)."""
    torch.manual_seed(4)
    net = deploy.fold(random_net(2, 1, "param"))
    x = torch.randn(6, 2, 2, 5)
    functional.reset_net(net)
    want = net(x)
    with pytest.raises(ValueError, match="headroom_bits must be an int"):
        deploy.set_integer(net, calibrate=x, headroom_bits=headroom)
    functional.reset_net(net)
    assert torch.equal(net(x), want)


def tiny_weight_net():
    sn = MulFreeChannelwisePSN(2, k=2, threshold="param", step_mode="m", v_threshold=0.3)
    with torch.no_grad():
        sn.weight.copy_(torch.tensor([[2.0 ** -60, 1.0], [0.5, 0.25]]))
    return deploy.fold(nn.Sequential(layer.Linear(2, 2, step_mode="m"), sn))


def test_a_format_that_cannot_hold_the_weights_is_refused_naming_the_layer():
    """Regression: a folded weight of 2**-60 needs 24 + 60 exact accumulator bits; set_integer took the
    default format and every forward then raised 'acc_frac_bits must be an int in [0, 62], got 84',
    an argument the user never passed, naming no layer."""
    torch.manual_seed(5)
    net, x = tiny_weight_net(), torch.randn(6, 3, 2)
    deploy.set_integer(net, frac_bits=8, acc_frac_bits=30)  # rounds the 2**-60 tap down
    functional.reset_net(net)
    in_format_8 = net(x)
    for call in ({}, dict(calibrate=x)):
        with pytest.raises(OverflowError, match=r"layer '1'.*2\*\*-60.*acc_frac_bits"):
            deploy.set_integer(net, **call)
        assert (net[1].frac_bits, net[1].acc_frac_bits) == (8, 30)  # the format it had
        functional.reset_net(net)
        assert torch.equal(net(x), in_format_8)


def test_a_failed_calibration_keeps_the_formats_it_found():
    """Regression: calibration switched every neuron to the float path before running the data, so a
    calibration input the net cannot run left an integer network on the float path."""
    torch.manual_seed(6)
    net = deploy.fold(random_net(2, 1, "param"))
    deploy.set_integer(net, frac_bits=10)
    with pytest.raises(RuntimeError):
        deploy.set_integer(net, calibrate=torch.randn(6, 2, 3, 5))  # 3 input channels, not 2
    assert all(m.frac_bits == 10 for _, m in deploy.folded_neurons(net))


def test_calibration_keeps_the_exact_accumulator_inside_int64():
    """Regression: small inputs and a 2**-3 weight got 60 fractional bits, whose exact accumulator needs
    63; set_integer(calibrate=x) then raised OverflowError on its own calibration data."""
    net, x = deploy.fold(small_inputs_net()), torch.rand(4, 2, 3)
    functional.reset_net(net)
    want = net(x)
    deploy.set_integer(net, calibrate=x)
    assert deploy.exact_acc_frac_bits(net[1].shift, net[1].frac_bits) <= 62
    functional.reset_net(net)
    assert torch.equal(net(x), want)


def test_a_folded_checkpoint_with_a_sign_beyond_one_is_refused():
    """sign = 3 loaded without a word, and the float path then ran Wq = 3 * 2**shift (no power of two)
    where the integer path refused the same neuron."""
    folded = deploy.fold(randomise(MulFreeChannelwisePSN(3, k=2, step_mode="m")).eval())
    state = folded.state_dict()
    state["sign"] = state["sign"].clone()
    state["sign"][1, 0] = 3
    before = folded.state_dict()
    with pytest.raises(RuntimeError, match="sign that is not -1, 0 or \\+1"):
        folded.load_state_dict(state)
    assert all(torch.equal(v, before[k]) for k, v in folded.state_dict().items())


def test_a_folded_neuron_with_the_smallest_int8_shift_unfolds_and_folds_again():
    """shift = -128 (a valid int8) ran, but after unfold the neuron could not be folded again ("a shift
    amount does not fit in int8")."""
    folded = deploy.fold(MulFreeChannelwisePSN(2, k=2, step_mode="m").eval())
    with torch.no_grad():
        folded.shift[0, 0] = -128
    x = on_grid(5, 3, 2).double()
    again = deploy.fold(deploy.unfold(copy.deepcopy(folded)).double())
    assert torch.equal(again.shift, folded.shift) and torch.equal(again(x), folded.double()(x))


def test_a_bias_that_fits_no_format_is_named_by_the_calibration():
    """The error blamed the inputs and the weights' span and advised acc_frac_bits, which cannot help."""
    sn = MulFreeChannelwisePSN(1, k=2, step_mode="m").eval()
    with torch.no_grad():
        sn.running_mean.fill_(1e21)
    folded = deploy.fold(sn)
    for kwargs in ({}, {"acc_frac_bits": 10}):
        with pytest.raises(OverflowError, match="its folded bias \\(up to 9.9999"):
            deploy.set_integer(folded, calibrate=torch.rand(4, 1, 1), **kwargs)


def test_a_weight_too_small_for_exact_taps_is_named_by_the_calibration():
    """A weight of 2**-70 needs more fractional accumulator bits than int64 holds: the calibration blamed a
    folded bias "up to 0 in magnitude"; it names the weight and acc_frac_bits, as frac_bits= does."""
    net = nn.Sequential(layer.Linear(3, 2), MulFreeChannelwisePSN(2, k=2, threshold="param", v_threshold=0.0))
    functional.set_step_mode(net, "m")
    with torch.no_grad():
        net[1].weight.fill_(2.0 ** -70)
    deploy.fold(net.eval())
    with pytest.raises(OverflowError, match=r"layer '1': its smallest weight, 2\*\*-70, needs .* pass acc_frac_bits"):
        deploy.set_integer(net, calibrate=torch.rand(4, 2, 3))
    deploy.set_integer(net, calibrate=torch.rand(4, 2, 3), acc_frac_bits=40)  # (as the message says)


@pytest.mark.parametrize("call, match", [
    (lambda q, sh, sg: deploy.int_charge(q, sh, sg, 1, last=-1), "last must be an int >= 1"),
    (lambda q, sh, sg: deploy.int_charge(q, sh, sg, 1, extra_bits=1.5), "extra_bits must be an int"),
    (lambda q, sh, sg: deploy.int_fire(q, sh, sg, torch.zeros(5, dtype=torch.int64), 1),
     "bias_int must have shape \\(C,\\) = \\(3,\\)"),
    (lambda q, sh, sg: energy.neuron_ops("psn", -3), "t must be an int >= 0"),
    (lambda q, sh, sg: energy.neuron_energy_pj("psn", 2.5), "t must be an int >= 0")])
def test_the_integer_and_energy_functions_name_a_bad_argument(call, match):
    """Each gave a raw torch error, or (psn) counts for a negative or fractional number of steps."""
    q = torch.randint(-8, 8, (4, 2, 3))
    shift, sign = torch.zeros(3, 2, dtype=torch.int8), torch.ones(3, 2, dtype=torch.int8)
    with pytest.raises(ValueError, match=match):
        call(q, shift, sign)


def test_int_fire_refuses_a_bias_whose_addition_could_wrap_around():
    """A bias near int64's limits wrapped around in the accumulator: a channel with a huge positive bias
    never fired."""
    q = torch.full((3, 1, 2), 1 << 40, dtype=torch.int64)
    shift, sign = torch.zeros(2, 2, dtype=torch.int64), torch.ones(2, 2, dtype=torch.int64)
    assert deploy.int_fire(q, shift, sign, torch.tensor([(1 << 62) - 1, -(1 << 62) + 1]), 1)[:, :, 0].all()
    for big in (2 ** 63 - 1, -2 ** 63, 1 << 62):
        with pytest.raises(OverflowError, match="bias_int holds values up to"):
            deploy.int_fire(q, shift, sign, torch.tensor([big, 0]), 1)


def test_from_fixed_gives_a_float16_value_whose_integer_it_cannot_hold():
    """Regression: from_fixed(2**20, 24, float16) was inf (the integer cast to float16 before scaling)."""
    q = torch.tensor([2 ** 20, -(2 ** 30) - 1, 3])
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        want = torch.tensor([2.0 ** -4, -(2.0 ** 6) - 2.0 ** -24, 3 * 2.0 ** -24], dtype=torch.float64).to(dtype)
        assert torch.equal(deploy.from_fixed(q, 24, dtype), want)


def test_calibrating_on_zeros_warns():
    """An all-zero 'shape' example (as torch.onnx.export users pass) fit the formats to no range, silently:
    larger inputs then overflow, and an exported model wraps around."""
    f = deploy.fold(randomise(MulFreeChannelwisePSN(3, k=2, threshold="param", exp_init=False, step_mode="m")).eval())
    with pytest.warns(UserWarning, match="neurons .* only zero inputs.*calibrate on real data"):
        deploy.set_integer(f, calibrate=torch.zeros(4, 2, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        deploy.set_integer(f, calibrate=on_grid(4, 2, 3))
