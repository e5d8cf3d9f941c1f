"""Operation counts and energy: closed forms, counted operations, the paper's Table 5, SpikingJelly's counters."""
import copy
import importlib.util
import itertools
import os

import pytest
import torch
import torch.nn as nn
from spikingjelly.activation_based import functional, layer

import spikingjelly_mfpsn
from spikingjelly_mfpsn import MulFreeChannelwisePSN, deploy, energy

from nets import Gained
import sj

_spec = importlib.util.spec_from_file_location(
    "energy_table5", os.path.join(os.path.dirname(__file__), "..", "examples", "energy_table5.py"))
table5_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(table5_example)

needs_psn = pytest.mark.skipif(sj.PSN is None, reason=f"SpikingJelly {sj.VERSION} has no neuron.PSN")
needs_op_counter = pytest.mark.skipif(sj.op_counter is None,
                                      reason=f"SpikingJelly {sj.VERSION} has no op_counter")


def brute_taps(t, k, d):
    return sum(1 for step in range(t) for j in range(k) if step - j * d >= 0)


def test_taps_in_sequence_closed_form():
    for t, k, d in itertools.product(range(0, 40, 3), range(1, 12), range(1, 5)):
        assert energy.taps_in_sequence(t, k, d) == brute_taps(t, k, d), (t, k, d)
    for t, k in itertools.product(range(1, 40), range(1, 40)):
        if t >= k:  # the paper's (T + (1-k)/2) k holds for d = 1, T >= k
            assert energy.taps_in_sequence(t, k) == energy.table1(t, k)["mfpsn"]["shift"]


def test_table11_closed_forms():
    forms = energy.table11()
    assert "4.6 T^2 + 0.9 T" in forms["psn"]
    assert "1.03 (T+(1-k)/2) k + 0.9 T" in forms["mfpsn"]
    assert "0.515 T^2 + 1.415 T" in forms["mfpsn_max"]
    assert energy.neuron_energy_pj("psn", 10) == pytest.approx(4.6 * 100 + 0.9 * 10)
    assert energy.neuron_energy_pj("mfpsn", 32, 32) == pytest.approx(0.515 * 32 ** 2 + 1.415 * 32)
    assert "2 T^2" in energy.table11({"mul": 1.1})["psn"]  # costs are overridable


def small_seq_net(make_neuron, channels=6, length=8):
    return table5_example.sequential_cifar_net(make_neuron, channels=channels, classes=5, length=length).eval()


@pytest.mark.parametrize("t,k,d", [(12, 4, 1), (5, 8, 1), (12, 3, 3), (7, 4, 2), (1, 3, 1)])
def test_counted_neuron_ops_equal_closed_forms(t, k, d):
    torch.manual_seed(t + k + d)
    net = small_seq_net(lambda i, c: MulFreeChannelwisePSN(c, k=k, dilation=d + i % 2, step_mode="m"))
    x = torch.randn(t, 2, 3, 8)
    report = energy.estimate(net, x, use_spikingjelly=False)
    neurons = [layer_ for layer_ in report.layers if layer_.role == "neuron"]
    assert len(neurons) == 7
    for i, n in enumerate(neurons):
        assert n.counted == n.counts
        per_neuron = energy.neuron_ops("mfpsn", t, k, d + i % 2)
        positions = 6 * (8 if i < 3 else 4) if i < 6 else 256  # channels x length, then FC256
        assert n.counts == {op: v * positions for op, v in per_neuron.items()}
        assert n.counts["mul"] == 0
    # The folded net runs the same operations.
    folded = energy.estimate(deploy.fold(net), x, use_spikingjelly=False)
    assert [n.counts for n in folded.layers if n.role == "neuron"] == [n.counts for n in neurons]


def test_paper_table5_neuron_counts_for_mfpsn():
    torch.manual_seed(0)
    net = table5_example.sequential_cifar_net(table5_example.mfpsn(k=16)).eval()
    report = energy.estimate(net, table5_example.image_to_sequence(torch.randn(1, 3, 32, 32)),
                             use_spikingjelly=False)
    # 18688 neurons x (T + (1-k)/2) k = 392 taps: the paper's 7.32e6 SHIFT, 7.92e6 ADD, 8.08 uJ.
    assert report.neuron_ops == {"shift": 18688 * 392, "add": 18688 * (392 + 32), "mul": 0}
    assert round(report.neuron_energy_uj, 2) == 8.08
    encoding = [n for n in report.layers if n.role == "encoding"]
    assert [n.name for n in encoding] == ["0"]
    assert encoding[0].counts == {"mac": 128 * 3 * 3 * 32 * 32}  # c128k3 on a 3x32 column, 32 steps


@needs_psn
def test_paper_table5_neuron_counts_for_psn_and_ordering():
    torch.manual_seed(0)
    x = table5_example.image_to_sequence(torch.randn(1, 3, 32, 32))
    psn = energy.estimate(table5_example.sequential_cifar_net(lambda i, c: sj.PSN(32)).eval(), x,
                          use_spikingjelly=False)
    assert psn.neuron_ops == {"shift": 0, "mul": 18688 * 32 ** 2, "add": 18688 * (32 ** 2 + 32)}
    assert psn.neuron_energy_uj == pytest.approx(88.56, abs=0.01)  # the paper's 1.91e7 MUL, 1.97e7 ADD
    for layer_ in psn.layers:
        if layer_.role == "neuron":
            assert layer_.counted == layer_.counts


@needs_psn
def test_psn_costs_more_than_mfpsn_on_the_sequential_network():
    torch.manual_seed(1)
    x = torch.randn(16, 2, 3, 8)
    psn = energy.estimate(small_seq_net(lambda i, c: sj.PSN(16)), x)
    ours = energy.estimate(small_seq_net(lambda i, c: MulFreeChannelwisePSN(c, k=8, step_mode="m")), x)
    assert ours.neuron_ops["mul"] == 0 and psn.neuron_ops["shift"] == 0
    assert psn.neuron_energy_uj > ours.neuron_energy_uj
    assert psn.total_energy_uj > ours.total_energy_uj
    assert "PSN" in energy.table5({"PSN": psn, "MF-PSN": ours})


def test_synaptic_counts_against_hand_counts():
    conv = nn.Conv1d(2, 3, 3, padding=1, bias=False)
    x = (torch.rand(4, 2, 5) < 0.3).float()
    out = conv(x)
    assert energy.dense_macs(conv, out) == 4 * 3 * 5 * 2 * 3
    events = 0  # every spike adds a weight to each output position it reaches, for each output channel
    for n, c, pos in x.nonzero().tolist():
        events += 3 * sum(1 for o in range(5) if 0 <= pos - o + 1 < 3)
    assert energy.spike_events(conv, x) == events
    lin = nn.Linear(5, 7)
    assert energy.spike_events(lin, x) == int(x.sum()) * 7


def test_sops_formula_events_and_firing_rate_override():
    torch.manual_seed(2)
    net = small_seq_net(lambda i, c: MulFreeChannelwisePSN(c, k=3, step_mode="m"))
    x = torch.randn(6, 2, 3, 8)
    report = energy.estimate(net, x, use_spikingjelly=False)
    synaptic = [n for n in report.layers if n.role == "synaptic"]
    assert len(synaptic) == 7  # five convs and two linears after the encoding conv
    first = synaptic[0]  # input: the first neuron's spikes, 6 channels x 8 positions x 6 steps
    dense = 6 * 6 * 8 * 6 * 3  # outputs per sample x fan-in
    assert first.counts["sop"] == pytest.approx(first.firing_rate * dense)
    events = energy.estimate(net, x, sops="events", use_spikingjelly=False)
    assert [n.counts for n in events.layers if n.role == "synaptic"] == [n.counted for n in synaptic]
    fixed = energy.estimate(net, x, firing_rate=0.5, use_spikingjelly=False)
    assert [n for n in fixed.layers if n.role == "synaptic"][0].counts["sop"] == pytest.approx(0.5 * dense)
    cheap = energy.estimate(net, x, costs={"shift": 0.0, "add": 0.0}, use_spikingjelly=False)
    assert cheap.neuron_energy_uj == 0 and cheap.synaptic_energy_uj == pytest.approx(report.synaptic_energy_uj)


@pytest.mark.parametrize("folded", [False, True])
@pytest.mark.parametrize("use_spikingjelly", [False, True] if sj.op_counter is not None else [False])
def test_a_time_last_network_counts_as_its_time_first_form(folded, use_spikingjelly):
    """Time-last wrappers run their Conv/Linear without its hooks: every layer is still counted, the
    same as in the time-first form (the autoselected form of a network is often time-last)."""
    from spikingjelly_mfpsn.convert import to_time_first, to_time_last
    torch.manual_seed(4)
    net = small_seq_net(lambda i, c: MulFreeChannelwisePSN(c, k=3, dilation=i % 3 + 1, step_mode="m"))
    x = torch.randn(6, 2, 3, 8)
    net.train()
    net(x)  # running statistics, so that the neurons fire
    functional.reset_net(net)
    net.eval()
    if folded:
        deploy.fold(net)
    reports = {}
    for layout, convert in (("time_first", to_time_first), ("time_last", to_time_last), ("back", to_time_first)):
        convert(net)
        reports[layout] = [energy.estimate(net, x, sops=sops, use_spikingjelly=use_spikingjelly)
                           for sops in ("formula", "events")]
    for got in (reports["time_last"], reports["back"]):
        for a, b in zip(got, reports["time_first"]):
            assert [(r.name, r.role, r.kind, r.counts, r.counted) for r in a.layers] == \
                [(r.name, r.role, r.kind, r.counts, r.counted) for r in b.layers]
            assert a.total_energy_uj == pytest.approx(b.total_energy_uj)
    assert sum(r.role == "synaptic" for r in reports["time_last"][0].layers) == 7


@needs_op_counter
def test_spikingjelly_counters_agree_with_the_plugin():
    torch.manual_seed(3)
    # Spikes feed every synaptic layer after the encoding conv (no pooling), so SpikingJelly counts
    # them as synaptic operations too.
    net = nn.Sequential(
        layer.Conv1d(3, 6, 3, padding=1, step_mode="m"), MulFreeChannelwisePSN(6, k=3, step_mode="m"),
        layer.Conv1d(6, 6, 3, padding=1, step_mode="m"), layer.BatchNorm1d(6, step_mode="m"),
        MulFreeChannelwisePSN(6, k=4, dilation=2, step_mode="m"), layer.Flatten(step_mode="m"),
        layer.Linear(48, 10, step_mode="m"), MulFreeChannelwisePSN(10, k=2, step_mode="m"),
        layer.Linear(10, 4, step_mode="m")).eval()
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, MulFreeChannelwisePSN):
                m.beta.fill_(-0.2)  # fire often enough that the counts are not all zero
    x = torch.randn(8, 3, 3, 8)
    report = energy.estimate(net, x, sops="events")
    fired = 0
    for n in report.layers:
        assert n.spikingjelly is not None, n.name
        if n.role == "neuron":
            assert {op: n.spikingjelly[op] for op in n.counted} == n.counted
        elif n.role == "encoding":
            assert n.spikingjelly["mac"] == n.counted["mac"]
        else:
            assert n.spikingjelly["sop"] == n.counted["sop"] == n.counts["sop"]
            fired += n.counted["sop"]
    assert fired > 0


@needs_op_counter
def test_spikingjelly_profiler_counts_mfpsn_as_shift_and_add():
    torch.manual_seed(4)
    oc = sj.op_counter
    x = torch.randn(6, 2, 3, 8)
    results = {}
    for method in ("conv1d", "shift_add"):
        torch.manual_seed(4)
        net = small_seq_net(lambda i, c: MulFreeChannelwisePSN(c, k=3, step_mode="m", method=method))
        profiler = energy.MulFreeEnergyProfiler()
        profiler.bind_model(net)
        with profiler, torch.no_grad():
            net(x)
        results[method] = profiler.get_report()
        functional.reset_net(net)
        if method == "conv1d":  # SpikingJelly alone counts the neuron's own convolution as MACs
            plain = oc.estimate_simple_energy(net, x)
            functional.reset_net(net)
    ours = energy.estimate(net, x)
    a, b = results["conv1d"], results["shift_add"]
    # The neuron's internal convolution is not counted as MACs: both implementations count alike.
    assert a.counts["mac"] == b.counts["mac"] < plain.counts["mac"]
    assert a.counts["neuron_shift"] == ours.neuron_ops["shift"] * 2 and a.counts["neuron_mul"] == 0
    assert a.counts["neuron_add"] == ours.neuron_ops["add"] * 2
    assert a.breakdown_pj["neuron_pj"] == pytest.approx(ours.neuron_energy_uj * 2e6)


@pytest.mark.skipif(sj.op_counter is not None, reason="SpikingJelly 2.x has op_counter")
def test_profiler_needs_spikingjelly2():
    with pytest.raises(ImportError, match="op_counter"):
        energy.MulFreeEnergyProfiler()


def test_a_network_of_several_inputs_takes_them_as_a_tuple():
    """As autoselect's x_example: the counts equal the one-input network's on the same sequence."""
    torch.manual_seed(0)
    body = small_seq_net(lambda i, c: MulFreeChannelwisePSN(c, k=2, step_mode="m"))
    x = torch.rand(4, 2, 3, 8)
    one = energy.estimate(body, x * 0.5, sops="events", use_spikingjelly=False)
    two = energy.estimate(Gained(body), (x, torch.full((1,), 0.5)), sops="events", use_spikingjelly=False)
    assert two.batch_size == 2 and [(r.name, r.counts) for r in two.layers] == \
        [("body." + r.name, r.counts) for r in one.layers]
    with pytest.raises(TypeError, match="the first a tensor"):
        energy.estimate(Gained(body), ([x], torch.ones(1)))


def test_bad_arguments():
    net = small_seq_net(lambda i, c: MulFreeChannelwisePSN(c, k=2, step_mode="m"))
    x = torch.randn(4, 2, 3, 8)
    with pytest.raises(ValueError, match="sops"):
        energy.estimate(net, x, sops="some")
    with pytest.raises(ValueError, match="costs: unknown operation 'div'"):
        energy.estimate(net, x, costs={"div": 1.0})
    for cost in (-1, float("inf")):  # (an infinite one gave an infinite energy)
        with pytest.raises(ValueError, match=r"costs\['add'\] must be a finite number >= 0"):
            energy.estimate(net, x, costs={"add": cost})
    with pytest.raises(ValueError, match="batch_size"):
        energy.estimate(net, x, batch_size=0)
    # A bool is no count nor a cost (True was taken as 1), and a sequence of no steps has nothing to count
    # (it divided by zero).
    with pytest.raises(ValueError, match="batch_size must be a positive int, got True"):
        energy.estimate(net, x, batch_size=True)
    with pytest.raises(ValueError, match=r"costs\['shift'\] must be a finite number >= 0"):
        energy.estimate(net, x, costs={"shift": True})
    with pytest.raises(ValueError, match="no time steps"):
        energy.estimate(net, x[:0])
    for args, name in (((5, -2), "k"), ((5, 2, 0), "dilation"), ((-1, 2), "t"), ((5, True), "k")):
        with pytest.raises(ValueError, match=f"{name} must be an int >= "):
            energy.taps_in_sequence(*args)
    # A firing rate is a fraction: a negative one gave negative synaptic energy, one above 1 more SOPs
    # than dense MACs, and a name of no synaptic layer was ignored.
    for rate in (-0.5, 1.5, float("nan"), True, "0.5"):
        with pytest.raises(ValueError, match=r"firing_rate must be a number in \[0, 1\]"):
            energy.estimate(net, x, firing_rate=rate)
    with pytest.raises(ValueError, match=r"firing_rate\['0'\] must be a number in \[0, 1\]"):
        energy.estimate(net, x, firing_rate={"0": -1.0})
    synaptic = [r.name for r in energy.estimate(net, x, use_spikingjelly=False).layers if r.role == "synaptic"]
    with pytest.raises(ValueError, match="firing_rate names no synaptic layer \\['nope'\\]"):
        energy.estimate(net, x, firing_rate={synaptic[0]: 0.5, "nope": 0.5})
    assert energy.estimate(net, x, firing_rate={synaptic[0]: 0.0}, use_spikingjelly=False).layers
    functional.set_step_mode(net, "s")
    with pytest.raises(ValueError, match="whole sequences"):
        energy.estimate(net, x[0])
    with pytest.raises(ValueError, match="nothing to count"):
        energy.estimate(nn.Sequential(nn.ReLU()), x)


@pytest.mark.parametrize("use_spikingjelly", [False, True] if sj.op_counter is not None else [False])
@pytest.mark.parametrize("sops", ["formula", "events"])
def test_a_layer_called_twice_counts_as_two_copies(use_spikingjelly, sops):
    """Regression: SpikingJelly's counters total a module's calls in its scope, and each call was given
    that total: a Linear called twice counted its events (and an encoding one its MACs) twice over."""
    torch.manual_seed(0)
    x = torch.rand(4, 2, 8)

    def net(*modules):
        n = nn.Sequential(*modules)
        functional.set_step_mode(n, "m")
        return n.eval()

    def neurons():
        ns = [MulFreeChannelwisePSN(8, k=2) for _ in range(3)]
        for n in ns:
            n.beta.data.fill_(0.5)  # (they fire)
        return ns
    enc, lin = layer.Linear(8, 8), layer.Linear(8, 8)
    a = neurons()
    b = [copy.deepcopy(n) for n in a]
    pairs = ((net(enc, a[0], lin, a[1], lin, a[2]), net(enc, b[0], lin, b[1], copy.deepcopy(lin), b[2])),
             (net(enc, enc, MulFreeChannelwisePSN(8, k=2)), net(enc, copy.deepcopy(enc), MulFreeChannelwisePSN(8, k=2))))
    for shared, copies in pairs:
        counts = [energy.estimate(m, x, sops=sops, use_spikingjelly=use_spikingjelly).synaptic_ops
                  for m in (shared, copies)]
        assert counts[0] == counts[1] and counts[0]["mac"] > 0


@pytest.mark.parametrize("sops", ["formula", "events"])
def test_a_layer_on_values_that_are_not_spikes_costs_dense_macs_after_a_neuron_too(sops):
    """A Linear fed by another Linear after a neuron was costed as SOPs with the mean of its input as
    the firing rate: -2562 SOP, and a negative energy, for an input of mean -5."""
    torch.manual_seed(0)
    net = nn.Sequential(layer.Linear(8, 16), MulFreeChannelwisePSN(16, k=2), layer.Linear(16, 16),
                        layer.Linear(16, 4), MulFreeChannelwisePSN(4, k=2))
    with torch.no_grad():
        net[2].bias.fill_(-5.0)
    functional.set_step_mode(net, "m")
    t, n = 8, 4
    report = energy.estimate(net, torch.rand(t, n, 8), sops=sops)
    roles = {row.name: (row.role, row.counts) for row in report.layers}
    assert roles["3"] == ("dense", {"mac": t * 4 * 16})  # (per sample: T steps x 4 outputs x 16 inputs)
    assert roles["2"][0] == "synaptic" and report.synaptic_ops["mac"] == t * 16 * 8 + t * 4 * 16
    assert all(v >= 0 for row in report.layers for v in row.counts.values()) and report.total_energy_uj > 0


@needs_op_counter
@pytest.mark.parametrize("training", [False, True])
def test_the_profiler_counts_a_fused_batch_norm_as_the_batch_norm_it_was(training):
    """After fuse_batchnorm the normalisation runs inside the neuron, whose ops the profiler ignores: the
    same network was reported cheaper (mac 11520 against 12800), and its state must not change."""
    torch.manual_seed(5)
    net = nn.Sequential(layer.Conv2d(2, 4, 3, padding=1), layer.BatchNorm2d(4), MulFreeChannelwisePSN(4, k=3),
                        layer.Flatten(), layer.Linear(64, 3), MulFreeChannelwisePSN(3))
    functional.set_step_mode(net, "m")
    x = torch.randn(5, 2, 2, 4, 4)
    net(x)
    functional.reset_net(net)
    net.train(training)
    fused = copy.deepcopy(net)
    spikingjelly_mfpsn.fuse_batchnorm(fused)
    reports = []
    for n in (net, fused):
        before = {k: v.clone() for k, v in n.state_dict().items()}
        profiler = energy.MulFreeEnergyProfiler()
        profiler.bind_model(n)
        with profiler, torch.no_grad():
            n(x)
        functional.reset_net(n)
        reports.append(profiler.get_report())
        assert all(torch.equal(v, before[k]) for k, v in n.state_dict().items()) or training
    assert reports[0].counts == reports[1].counts and reports[0].counts["mac"] > 0
    assert reports[0].energy_total_pj == pytest.approx(reports[1].energy_total_pj)


def test_event_counts_of_pooled_spikes_are_not_rounded():
    """sops='events' rounded a layer's total: pooled spikes of 0.5 into a Linear of fan-out 1 gave 0 SOPs (the
    exact count is 0.5), and a larger network 13 for 12.75."""
    net = nn.Sequential(layer.Conv1d(1, 1, 1, bias=False), MulFreeChannelwisePSN(1, k=1, threshold="param",
                                                                               v_threshold=0.0),
                        layer.AvgPool1d(4), layer.Flatten(), layer.Linear(1, 1))
    functional.set_step_mode(net, "m")
    with torch.no_grad():
        net[0].weight.fill_(1.0)
    x = torch.tensor([[[[1.0, 1.0, -1.0, -1.0]]]])  # spikes 1, 1, 0, 0: pooled 0.5
    synaptic = [r for r in energy.estimate(net.eval(), x, sops="events").layers if r.role == "synaptic"]
    assert [(r.name, r.counts) for r in synaptic] == [("4", {"sop": 0.5})]


def test_a_time_last_network_with_synaptic_islands_counts_as_time_first():
    """A Conv subclass with a forward of its own runs time-first inside a time-last network
    (fallback='time_first'); its input was read as time-first where hooks see the time-last one (a crash)."""
    class MyConv(layer.Conv1d):
        def forward(self, x):
            return super().forward(x)
    net = nn.Sequential(layer.Conv1d(2, 4, 3, padding=1, step_mode="m"), MulFreeChannelwisePSN(4, step_mode="m"),
                        MyConv(4, 6, 3, padding=1, step_mode="m"), MulFreeChannelwisePSN(6, step_mode="m")).eval()
    x = torch.rand(5, 2, 2, 7)
    want = energy.estimate(copy.deepcopy(net), x)
    got = energy.estimate(spikingjelly_mfpsn.to_time_last(copy.deepcopy(net), fallback="time_first"), x)
    assert str(got) == str(want)
