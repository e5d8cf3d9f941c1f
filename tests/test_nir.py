"""NIR export and import (spikingjelly_mfpsn.nir): round trips on the digits data set, files, the
threshold's boundary, both layouts, and the errors for what NIR 1.0 cannot express."""

import numpy as np
import pytest
import torch
import torch.nn as nn
from spikingjelly.activation_based import functional, layer

from spikingjelly_mfpsn import MulFreeChannelwisePSN, to_time_last
from spikingjelly_mfpsn.paper import models

from nets import (FlattenInForward, Residual, SharedPool, StandardisedConv1d, TwoOutputs, calibrated,
                  digits_sequences, export_error_without, residual_in_sequential, residual_sequential_subclass,
                  run_inference_example, shared_layers_net)

nir = pytest.importorskip("nir", reason="the nir package is not installed (pip install \"spikingjelly_mfpsn[nir]\")")
from spikingjelly_mfpsn.nir import NIRExportError, NIRImportError, export_to_nir, import_from_nir  # noqa: E402


def run(net, x):
    with torch.no_grad():
        out = net(x)
    functional.reset_net(net)
    return out


def sequential_net(k=2, **kwargs):
    torch.manual_seed(0)
    return models.sequential_image_net(1, 8, 10, neuron="mfpsn", k=k, channels=16, hidden=32, **kwargs)


@pytest.mark.parametrize("k", [2, 4])
def test_round_trip_gives_the_same_outputs_on_the_digits(k):
    """Conv1d + BatchNorm + MF-PSN (BN threshold, sawtooth dilations), AvgPool1d, Flatten, Linear: the
    imported graph's logits equal the network's bit for bit, so every spike on the way does too."""
    x = digits_sequences()
    net = calibrated(sequential_net(k), x)
    want = run(net, x)
    spikes = [run(nn.Sequential(*list(net)[:i + 1]), x) for i, m in enumerate(net)
              if isinstance(m, MulFreeChannelwisePSN)]
    assert all(0.02 < float(s.mean()) < 0.98 for s in spikes)  # (real spike trains, not constant ones)
    graph = export_to_nir(net, x[:, :2])
    assert {type(n).__name__ for n in graph.nodes.values()} >= {"Delay", "Scale", "Threshold", "Conv1d", "Affine",
                                                               "Flatten", "Input", "Output"}
    got = run(import_from_nir(graph), x)
    assert got.shape == want.shape and torch.equal(got, want)
    assert torch.equal(run(net, x), want)  # the network itself is left as it was (not folded)


def test_a_file_round_trips(tmp_path):
    x = digits_sequences()[:, :50]
    net = calibrated(sequential_net(), digits_sequences())
    graph = export_to_nir(net, x, dt=1e-3)
    path = tmp_path / "net.nir"
    nir.write(path, graph)
    back = nir.read(path)
    assert sorted(back.nodes) == sorted(graph.nodes)
    assert torch.equal(run(import_from_nir(str(path)), x), run(net, x))


def boundary_neuron():
    """One parameter-threshold neuron, k = 2: H[t] = 0.5 x[t-1] + 1 x[t] - 1."""
    sn = MulFreeChannelwisePSN(1, k=2, threshold="param", step_mode="m", exp_init=False)
    with torch.no_grad():
        sn.weight.copy_(torch.tensor([[0.5, 1.0]]))
        sn.v_threshold.fill_(1.0)
    return nn.Sequential(sn)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_charge_of_exactly_zero_fires_after_the_round_trip(dtype):
    """MF-PSN fires on H >= 0, NIR's Threshold on v > threshold: the exported threshold is the value
    just below, so a charge of exactly 0 fires and one a step below it does not."""
    net = boundary_neuron().to(dtype)
    below = 1 - torch.finfo(dtype).eps / 2
    x = torch.tensor([0.0, 1.0, 0.0, 2.0, below, 0.0], dtype=dtype).reshape(6, 1, 1)
    want = run(net, x)  # H = -1, 0, -0.5, 1.5, 0.5 * 2 + below - 1 > 0, -0.5 * ... ; and 0 exactly at t = 1
    assert want[1].item() == 1.0
    got = run(import_from_nir(export_to_nir(net, x)), x)
    assert got.dtype == dtype and torch.equal(got, want)
    x2 = torch.tensor([0.0, below], dtype=dtype).reshape(2, 1, 1)  # H = below - 1 < 0
    assert run(net, x2)[1].item() == 0.0
    assert torch.equal(run(import_from_nir(export_to_nir(net, x2)), x2), run(net, x2))


def test_both_layouts_export_the_same_graph():
    x = digits_sequences()[:, :40]
    net = calibrated(sequential_net(), digits_sequences())
    first = export_to_nir(net, x)
    to_time_last(net)
    last = export_to_nir(net, x)
    assert list(last.nodes) == list(first.nodes)
    assert torch.equal(run(import_from_nir(last), x), run(import_from_nir(first), x))


def test_conv2d_and_avgpool2d_networks():
    torch.manual_seed(1)
    net = nn.Sequential(layer.Conv2d(1, 4, 3, padding=1, bias=False, step_mode="m"), layer.BatchNorm2d(4, step_mode="m"),
                        MulFreeChannelwisePSN(4, k=3, step_mode="m"), layer.AvgPool2d(2, 2, step_mode="m"),
                        layer.Conv2d(4, 4, 3, groups=2, step_mode="m"), MulFreeChannelwisePSN(4, k=2, dilation=2,
                                                                                             step_mode="m"),
                        layer.Flatten(step_mode="m"), layer.Linear(4 * 2 * 2, 3, step_mode="m"))
    x = torch.rand(5, 20, 1, 8, 8)
    calibrated(net, x)
    assert torch.equal(run(import_from_nir(export_to_nir(net, x[:, :2])), x), run(net, x))


@pytest.mark.parametrize("bad, what", [(layer.MaxPool1d(2, 2, step_mode="m"), "MaxPool1d"),
                                       (layer.AvgPool1d(3, 3, step_mode="m"), "power-of-two"),
                                       (layer.SeqToANNContainer(StandardisedConv1d(4, 4, 1)),
                                        r"layer '2\.0' \(StandardisedConv1d\) has a forward of its own")])
def test_a_layer_nir_cannot_express_is_named(bad, what):
    """A torch.nn layer's subclass with its own forward was exported as the torch.nn layer."""
    net = nn.Sequential(layer.Conv1d(1, 4, 3, padding=1, step_mode="m"), MulFreeChannelwisePSN(4, k=2, step_mode="m"),
                        bad)
    with pytest.raises(NIRExportError, match=r"layer '2'.*" + what if what == "MaxPool1d" else what):
        export_to_nir(net.eval(), torch.rand(4, 2, 1, 6))


def test_an_unquantised_neuron_is_refused():
    net = nn.Sequential(MulFreeChannelwisePSN(3, k=2, step_mode="m", quantize=False)).eval()
    with pytest.raises(ValueError, match="quantize"):
        export_to_nir(net, torch.rand(4, 2, 3))


@pytest.mark.parametrize("build,readout", [(Residual, "fc"), (residual_in_sequential, "5"),
                                           (residual_sequential_subclass, "5")],
                         ids=["forward", "block-in-Sequential", "Sequential-subclass"])
def test_a_residual_network_round_trips(build, readout):
    """A forward that adds (a residual connection) and calls torch.flatten: NIR adds the edges into
    a node, so the sum needs none; the digits give the same logits after export and import. Also with
    the residual block nested in an nn.Sequential (regression: it was refused as a layer), and written
    as an nn.Sequential subclass (regression: exported as a chain of its children, the addition lost)."""
    torch.manual_seed(2)
    x = digits_sequences()
    net = calibrated(build(), x)
    graph = export_to_nir(net, x[:, :2])
    assert sum(dst == readout for _, dst in graph.edges) == 1
    assert torch.equal(run(import_from_nir(graph), x), run(net, x))


def test_a_call_nir_cannot_express_is_named_with_its_line():
    net = Residual(tail=torch.sigmoid).eval()
    with pytest.raises(NIRExportError, match=r"sigmoid .*nets.py\", line \d+, in forward"):
        export_to_nir(net, torch.rand(4, 2, 1, 8))


def test_import_names_a_node_it_cannot_run():
    ones = np.ones(3)
    graph = nir.NIRGraph({"input": nir.Input({"input": np.array([3])}),
                          "lif": nir.LIF(tau=2 * ones, r=ones, v_leak=0 * ones, v_threshold=ones),
                          "output": nir.Output({"output": np.array([3])})}, [("input", "lif"), ("lif", "output")])
    with pytest.raises(NIRImportError, match=r"node 'lif' is a nir\.LIF"):
        import_from_nir(graph)


def test_import_refuses_a_delay_off_the_time_grid():
    graph = nir.NIRGraph({"input": nir.Input({"input": np.array([2])}), "d": nir.Delay(np.array([0.5, 1.0])),
                          "output": nir.Output({"output": np.array([2])})}, [("input", "d"), ("d", "output")])
    with pytest.raises(NIRImportError, match="multiple of dt"):
        import_from_nir(graph)
    out = import_from_nir(graph, dt=0.5)(torch.arange(1.0, 5.0).reshape(4, 1, 1).expand(4, 1, 2))
    assert out[:, 0, 0].tolist() == [0.0, 1.0, 2.0, 3.0] and out[:, 0, 1].tolist() == [0.0, 0.0, 1.0, 2.0]


def test_bad_arguments():
    net = boundary_neuron()
    with pytest.raises(ValueError, match="dt"):
        export_to_nir(net, torch.rand(3, 1, 1), dt=0)
    with pytest.raises(ValueError, match="example_input"):
        export_to_nir(net, torch.rand(3, 1))
    with pytest.raises(ValueError, match=r"got a numpy.ndarray \(not a torch.Tensor\)"):  # (it named its shape)
        export_to_nir(net, torch.rand(3, 1, 1).numpy())
    with pytest.raises(ValueError, match=r"must be float16, float32 or float64.*got torch.bfloat16"):
        export_to_nir(boundary_neuron().bfloat16(), torch.rand(3, 1, 1, dtype=torch.bfloat16))


def test_without_the_nir_package_the_error_names_the_extra():
    assert "spikingjelly_mfpsn[nir]" in export_error_without("nir", "nir", "export_to_nir")


def test_the_inference_example_writes_a_nir_file(tmp_path):
    path = tmp_path / "net.nir"
    assert "read back, the same outputs: True" in run_inference_example("--nir", path)
    assert any(type(n).__name__ == "Threshold" for n in nir.read(path).nodes.values())


def test_stateless_layers_match_spikingjellys_own_converter():
    """Where SpikingJelly 2.0's converter has a layer, our node is the same node with the same values."""
    sj = pytest.importorskip("spikingjelly.activation_based.nir_exchange",
                             reason="SpikingJelly 0.0.0.0.14 has no nir_exchange (2.0 added it)")
    import dataclasses
    torch.manual_seed(0)
    net = nn.Sequential(layer.Conv2d(2, 4, 3, padding=1, step_mode="m"), layer.AvgPool2d(2, 2, step_mode="m"),
                        layer.Flatten(step_mode="m"), layer.Linear(64, 5, step_mode="m"),
                        layer.Linear(5, 3, bias=False, step_mode="m")).eval()
    x = torch.rand(3, 2, 2, 8, 8)
    theirs, ours = sj.export_to_nir(net, x), export_to_nir(net, x)
    pairs = list(zip(list(theirs.nodes.values())[1:-1], list(ours.nodes.values())[1:-1]))
    assert len(pairs) == 5
    for a, b in pairs:
        assert type(a) is type(b)
        for f in dataclasses.fields(a):
            if f.name != "metadata":
                va, vb = getattr(a, f.name), getattr(b, f.name)
                if isinstance(va, dict):
                    va, vb = list(va.values()), list(vb.values())
                va, vb = np.broadcast_arrays(np.asarray(va), np.asarray(vb))  # (a pool size 2 is (2, 2))
                assert np.array_equal(va, vb), (type(a).__name__, f.name)


FLATTENS = [layer.Flatten(start_dim=-2, step_mode="m"), layer.Flatten(start_dim=-3, step_mode="m"),
            layer.Flatten(1, 2, step_mode="m"), layer.Flatten(1, -2, step_mode="m"), nn.Flatten(start_dim=2),
            nn.Flatten(3, -1)]


@pytest.mark.parametrize("flatten", FLATTENS, ids=repr)
def test_every_flatten_round_trips(flatten):
    """Regression: negative dims were shifted as if positive (start_dim=-2 failed, -3 wrote -4, out of
    range), and torch's own nn.Flatten, which sees the whole (T, N, ...) sequence in a multi-step
    Sequential, was exported as if it saw one step."""
    net = nn.Sequential(layer.Conv2d(1, 2, 1, step_mode="m"),
                        MulFreeChannelwisePSN(2, k=2, threshold="param", v_threshold=0.0, step_mode="m"), flatten).eval()
    x = torch.rand(3, 2, 1, 3, 4)
    graph = export_to_nir(net, x)
    flat = next(n for n in graph.nodes.values() if isinstance(n, nir.Flatten))
    assert all(-3 <= d <= 2 for d in (flat.start_dim, flat.end_dim))  # dims of the per-sample (C, H, W)
    assert torch.equal(run(import_from_nir(graph), x), run(net, x))


def test_a_torch_flatten_of_the_time_or_batch_axis_is_named():
    net = nn.Sequential(layer.Linear(4, 2, step_mode="m"), MulFreeChannelwisePSN(2, k=2, step_mode="m"), nn.Flatten())
    with pytest.raises(ValueError, match=r"layer '2': torch.nn.Flatten\(start_dim=1, end_dim=-1\).*time or batch"):
        export_to_nir(net.eval(), torch.rand(3, 2, 4))


def test_a_float64_network_with_valid_padding_round_trips_in_float64():
    """Regression: import built float32 Linear and Conv layers for a float64 graph (weights rounded; a
    dtype error on float64 input), and Conv1d(padding='valid') failed to export."""
    torch.manual_seed(0)
    net = nn.Sequential(layer.Conv1d(1, 2, 3, padding="valid", step_mode="m"),
                        MulFreeChannelwisePSN(2, k=2, threshold="param", step_mode="m"), layer.Flatten(step_mode="m"),
                        layer.Linear(2 * 4, 3, step_mode="m"), MulFreeChannelwisePSN(3, k=2, threshold="param",
                                                                                  step_mode="m")).double().eval()
    x = torch.rand(5, 4, 1, 6, dtype=torch.float64)
    back = import_from_nir(export_to_nir(net, x))
    assert {p.dtype for p in back.parameters()} == {torch.float64}
    got = run(back, x)
    assert got.dtype == torch.float64 and torch.equal(got, run(net, x))


@pytest.mark.parametrize("names", [("0", "1", "2", "3"), ("input", "sn", "output", "sn2")])
def test_a_layer_used_twice_is_exported_at_each_place(names):
    """Regression: a Linear and a neuron used twice in one Sequential were exported once (the graph had one
    Affine, and other outputs), layers named 'input' or 'output' overwrote the graph's own nodes, and
    SpikingJelly's Dropout failed with 'missing forward'."""
    net, x = shared_layers_net(names), torch.randn(5, 3, 4)
    graph = export_to_nir(net, x)
    assert sum(isinstance(n, nir.Affine) for n in graph.nodes.values()) == 2
    assert torch.equal(run(import_from_nir(graph), x), run(net, x))


def test_a_module_called_twice_in_a_forward_is_exported_at_each_call():
    """Regression: a pooling module called twice gave two nodes of one name (a type inference error)."""
    torch.manual_seed(0)
    net, x = SharedPool().eval(), torch.randn(4, 2, 1, 8, 8)
    graph = export_to_nir(net, x)
    assert sum(isinstance(n, nir.AvgPool2d) for n in graph.nodes.values()) == 2
    assert torch.equal(run(import_from_nir(graph), x), run(net, x))


def test_a_float64_average_pool_keeps_float64():
    """Regression: AvgPool1d was written as a float32 Conv1d into a float64 graph (a dtype error on import)."""
    torch.manual_seed(0)
    net = nn.Sequential(layer.Conv1d(1, 2, 3, padding=1, step_mode="m"), MulFreeChannelwisePSN(2, k=2, step_mode="m"),
                        layer.AvgPool1d(2, step_mode="m"), MulFreeChannelwisePSN(2, k=2, step_mode="m")).eval().double()
    x = torch.randn(4, 2, 1, 8, dtype=torch.float64)
    graph = export_to_nir(net, x)
    assert graph.nodes["2"].weight.dtype == np.float64
    assert torch.equal(run(import_from_nir(graph), x), run(net, x))


@pytest.mark.parametrize("start", [-2, -3])
def test_a_negative_torch_flatten_reaching_the_batch_axis_is_named(start):
    """Regression: nn.Flatten(-2) of a (T, N, C) sequence flattens N and C; only dims 0 and 1 were refused."""
    net = nn.Sequential(layer.Linear(4, 2, step_mode="m"), MulFreeChannelwisePSN(2, k=2, step_mode="m"), nn.Flatten(start))
    with pytest.raises(ValueError, match=rf"layer '2': torch.nn.Flatten\(start_dim={start}, end_dim=-1\).*time or batch"):
        export_to_nir(net.eval(), torch.rand(3, 2, 4))


def test_dt_arguments():
    """A NumPy number is a number; a negative dt on import is refused (it was accepted)."""
    net = boundary_neuron()
    graph = export_to_nir(net, torch.rand(3, 1, 1), dt=np.float32(0.5))
    assert graph.metadata["dt"] == 0.5
    for bad in (-1, 0, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="dt must be a positive number"):
            import_from_nir(graph, dt=bad)


def test_a_batch_norm_without_running_statistics_is_named():
    net = nn.Sequential(layer.Conv1d(3, 4, 1, step_mode="m"),
                        layer.BatchNorm1d(4, track_running_stats=False, step_mode="m"),
                        MulFreeChannelwisePSN(4, k=2, step_mode="m")).eval()
    with pytest.raises(NIRExportError, match="layer '1': a BatchNorm without running statistics"):
        export_to_nir(net, torch.randn(4, 2, 3, 5))


def test_an_example_input_the_network_cannot_run_is_named():
    """Regression: a mismatch gave a raw matmul, NumPy broadcasting or deepcopy error naming no argument."""
    net = nn.Sequential(layer.Linear(3, 4, step_mode="m"), MulFreeChannelwisePSN(4, k=2, step_mode="m")).eval()
    for bad, match in ((torch.randn(4, 2, 5), r"net does not run on example_input of shape \(4, 2, 5\)"),
                       (torch.randn(4, 2, 1, 3), "net does not run on example_input"),
                       (torch.randn(4, 2, 3, dtype=torch.float64), "example_input is torch.float64 but net's")):
        with pytest.raises(ValueError, match=match):
            export_to_nir(net, bad)
    lazy = nn.Sequential(layer.Linear(3, 4, step_mode="m"), MulFreeChannelwisePSN(k=2, step_mode="m")).eval()
    with pytest.raises(ValueError, match="uninitialised \\(lazy\\) parameters"):
        export_to_nir(lazy, torch.randn(4, 2, 3))


def test_a_linear_nir_cannot_type_is_named():
    """A Linear on (N, C, L) steps (NIR's Affine takes one dim of features), with or without a batch norm
    after it (which normalises dim 1: it was folded into the Linear's outputs, the last dim)."""
    for net in (nn.Sequential(layer.Linear(4, 4, step_mode="m"), layer.BatchNorm1d(3, step_mode="m"),
                              MulFreeChannelwisePSN(3, k=2, step_mode="m")),
                nn.Sequential(layer.Linear(4, 5, step_mode="m"), MulFreeChannelwisePSN(3, k=2, step_mode="m"))):
        with pytest.raises(NIRExportError, match=r"layer '[01]': .*on steps of shape \(N, 3, [45]\)"):
            export_to_nir(net.eval(), torch.randn(6, 2, 3, 4))
    bn = nn.BatchNorm1d(3)  # (in a SeqToANNContainer: (T, N, C) steps in every SpikingJelly)
    net = nn.Sequential(layer.Linear(4, 3, step_mode="m"), layer.SeqToANNContainer(bn),
                        MulFreeChannelwisePSN(3, k=2, step_mode="m")).eval()
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1), bn.running_var.uniform_(0.5, 2)
    x = torch.randn(6, 5, 4)
    assert torch.equal(run(import_from_nir(export_to_nir(net, x)), x), run(net, x))


def test_a_float16_network_keeps_a_tap_lag_float16_cannot_hold():
    """Regression: the Delay took the weights' dtype, and float16 holds 2048, not 2049 (a spike one step early)."""
    net = nn.Sequential(MulFreeChannelwisePSN(1, k=2, dilation=2049, threshold="param", step_mode="m"))
    with torch.no_grad():
        net[0].weight.copy_(torch.tensor([[1.0, 0.0]]))
        net[0].v_threshold.fill_(0.5)  # (a spike where x, 2049 steps back, is 1)
    net = net.half().eval()
    x = torch.zeros(2052, 1, 1, dtype=torch.float16)
    x[0] = 1
    want = run(net, x)
    assert want.flatten().nonzero().flatten().tolist() == [2049]
    assert torch.equal(run(import_from_nir(export_to_nir(net, x)), x), want)


class AddsAValueTwice(nn.Module):
    def __init__(self, twice_first: bool):
        super().__init__()
        self.twice_first = twice_first
        self.fc1, self.n1 = layer.Linear(4, 4), MulFreeChannelwisePSN(4, k=2)
        self.fc2, self.n2 = layer.Linear(4, 4), MulFreeChannelwisePSN(4, k=2)
        self.out = layer.Linear(4, 2)
        functional.set_step_mode(self, "m")

    def forward(self, x):
        a = self.n1(self.fc1(x))
        b = self.n2(self.fc2(a))
        return self.out(a + a + b + a) if self.twice_first else self.out((a + b) + a)


@pytest.mark.parametrize("twice_first", [True, False])
def test_a_value_added_to_a_sum_that_holds_it_round_trips(twice_first):
    """Regression: ``a + a`` (or ``(a + b) + a``) gave two edges between the same nodes, which NIR refuses
    ("Duplicate edge")."""
    torch.manual_seed(0)
    net = AddsAValueTwice(twice_first).eval()
    x = torch.rand(5, 3, 4)
    torch.testing.assert_close(run(import_from_nir(export_to_nir(net, x[:, :2])), x), run(net, x))


def test_a_graph_of_mixed_dtypes_names_them_and_runs_once_made_one():
    """A hand-built graph with NumPy's default float64 next to float32 arrays failed on any input with
    torch's "mat1 and mat2 must have the same dtype"."""
    nir = pytest.importorskip("nir")
    weight = np.array([[1.0, -2.0], [0.5, 1.0]], dtype=np.float32)
    graph = nir.NIRGraph({"input": nir.Input({"input": np.array([2])}), "scale": nir.Scale(np.array([2.0, 3.0])),
                          "affine": nir.Affine(weight, np.zeros(2, dtype=np.float32)),
                          "output": nir.Output({"output": np.array([2])})},
                         [("input", "scale"), ("scale", "affine"), ("affine", "output")])
    net = import_from_nir(graph)
    x = torch.rand(3, 4, 2)
    for dtype in (torch.float32, torch.float64):
        with pytest.raises(ValueError, match=r"float32, torch.float64 and x is torch.float"):
            net(x.to(dtype))
    want = (x * torch.tensor([2.0, 3.0])) @ torch.from_numpy(weight).t()
    torch.testing.assert_close(net.float()(x), want)


def test_a_non_square_convolution_round_trips_or_is_named_where_nir_cannot_type_it():
    """NIR 1.0.8 gives a Conv2d the output size of a square kernel of its height: export_to_nir raised
    NIR's bare "Type inference error". Where the installed NIR types it right, it must round trip."""
    from nir.ir.conv import calculate_conv_output
    torch.manual_seed(0)
    x = torch.rand(4, 2, 1, 8, 8)
    net = nn.Sequential(layer.Conv2d(1, 2, (3, 2), step_mode="m"), MulFreeChannelwisePSN(2, k=2, step_mode="m")).eval()
    probe = nir.Conv2d((8, 8), np.zeros((2, 1, 3, 2), dtype=np.float32), 1, 0, 1, 1, np.zeros(2, dtype=np.float32))
    if list(probe.output_type["output"][1:]) == list(calculate_conv_output((8, 8), 0, 1, (3, 2), 1)):
        assert torch.equal(run(import_from_nir(export_to_nir(net, x)), x), run(net, x))
    else:
        with pytest.raises(NIRExportError, match=r"layer '0'.*kernel_size=\(3, 2\) is not"):
            export_to_nir(net, x)


def test_a_forward_with_several_outputs_is_named():
    """It raised a bare KeyError."""
    with pytest.raises(NIRExportError, match="TwoOutputs's forward returns tuple: .* one output"):
        export_to_nir(TwoOutputs().eval(), torch.rand(4, 2, 3))


def test_a_torch_batch_norm_on_the_whole_sequence_is_named():
    """torch's own BatchNorm1d in a multi-step Sequential normalises dim 1 of (T, N, C), the batch (the
    network runs where N == C); it was folded into the Linear's features: every output differed."""
    net = nn.Sequential(layer.Linear(8, 4, step_mode="m"), nn.BatchNorm1d(4),
                        MulFreeChannelwisePSN(4, k=2, step_mode="m")).eval()
    with pytest.raises(NIRExportError, match=r"layer '1': torch.nn.BatchNorm1d .* its batch axis"):
        export_to_nir(net, torch.rand(5, 4, 8))

    class ByHand(nn.Module):  # the same in a forward written by hand: folded into the Linear, 51% differed
        def __init__(self):
            super().__init__()
            self.fc, self.bn, self.sn = net[0], net[1], net[2]

        def forward(self, x):
            return self.sn(self.bn(self.fc(x)))
    with pytest.raises(NIRExportError, match=r"layer 'bn': torch.nn.BatchNorm1d .* its batch axis"):
        export_to_nir(ByHand().eval(), torch.rand(5, 4, 8))


@pytest.mark.parametrize("start", [2, -2, -3])
def test_a_torch_flatten_in_a_forward_to_the_end_round_trips(start):
    """A negative start (a flatten of each step's features, counted from the end) was refused."""
    net = FlattenInForward(start).eval()
    x = torch.rand(3, 2, 1, 3, 4)
    assert torch.equal(run(import_from_nir(export_to_nir(net, x)), x), run(net, x))


def test_integer_formats_are_left_out_with_a_warning():
    """A folded network set to integer arithmetic was exported as the float network without a word."""
    from spikingjelly_mfpsn import deploy
    torch.manual_seed(0)
    net = nn.Sequential(layer.Linear(3, 4), MulFreeChannelwisePSN(4, k=2, threshold="param", v_threshold=0.1))
    functional.set_step_mode(net, "m")
    deploy.fold(net)
    x = torch.rand(6, 8, 3)
    with torch.no_grad():
        want = net(x)
    deploy.set_integer(net, frac_bits=2)
    with pytest.warns(UserWarning, match=r"writes the float network: the integer formats .* gave 1 are not part"):
        graph = export_to_nir(net, x)
    assert torch.equal(run(import_from_nir(graph), x), want)
