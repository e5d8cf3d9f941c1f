"""ONNX export of the folded integer network (spikingjelly_mfpsn.onnx), run by onnxruntime against
spikingjelly_mfpsn.deploy's integer neurons: whole-sequence and streaming, the integer-only neuron
graph, and the errors."""
import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
from spikingjelly.activation_based import functional, layer

from spikingjelly_mfpsn import MulFreeChannelwisePSN, deploy, to_time_last
from spikingjelly_mfpsn.paper import models

from nets import (FlattenInForward, Residual, SharedPool, StandardisedConv1d, TwoOutputs, calibrated,
                  digits_sequences, export_error_without, residual_in_sequential, residual_sequential_subclass,
                  run_inference_example, shared_layers_net, small_inputs_net)

onnx = pytest.importorskip("onnx", reason="the onnx package is not installed (pip install \"spikingjelly_mfpsn[onnx]\")")
ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install \"spikingjelly_mfpsn[onnx]\")")
from spikingjelly_mfpsn.onnx import ONNXExportError, export_onnx  # noqa: E402


def integer_body(k=3):
    """The digits network up to its last neuron (spikes out), BN statistics from the data, folded and
    in calibrated integer arithmetic."""
    torch.manual_seed(0)
    net = models.sequential_image_net(1, 8, 10, neuron="mfpsn", k=k, channels=16, hidden=32)
    x = digits_sequences()
    body = deploy.fold(calibrated(net, x)[:-1])
    with torch.no_grad():
        deploy.set_integer(body, calibrate=x)
    return body, x


def run(net, x):
    with torch.no_grad():
        out = net(x)
    functional.reset_net(net)
    return out


def session(model):
    return ort.InferenceSession(model.SerializeToString())


def stream(model, x):
    """Run the streaming model step by step, its state outputs fed back as the next step's state."""
    sess = session(model)
    state = {i.name: np.zeros(i.shape, dtype=np.int64) for i in sess.get_inputs()[1:]}
    names = [o.name for o in sess.get_outputs()]
    ys = []
    for t in range(x.shape[0]):
        out = sess.run(None, {"x": x[t].numpy(), **state})
        ys.append(torch.from_numpy(out[0]))
        state = {n[:-len("_out")]: v for n, v in zip(names[1:], out[1:])}
    return torch.stack(ys)


@pytest.mark.parametrize("k", [2, 3])
def test_whole_sequence_model_gives_the_integer_networks_spikes(k):
    body, x = integer_body(k)
    want = run(body, x)
    assert 0.02 < float(want.mean()) < 0.98
    y = session(export_onnx(body, x)).run(None, {"x": x.numpy()})[0]
    assert torch.equal(torch.from_numpy(y), want)


def test_streaming_model_gives_the_same_spikes_step_by_step(tmp_path):
    body, x = integer_body(3)
    want = run(body, x)
    path = tmp_path / "net.onnx"
    model = export_onnx(body, x, str(path), streaming=True)
    assert path.is_file()
    states = [i for i in model.graph.input if i.name.endswith(".state")]
    assert states and all(i.type.tensor_type.elem_type == onnx.TensorProto.INT64 for i in states)
    assert torch.equal(stream(onnx.load(str(path)), x), want)


def test_an_unfolded_time_last_network_is_folded_and_calibrated_on_the_example():
    x = digits_sequences()
    torch.manual_seed(1)
    net = nn.Sequential(layer.Conv1d(1, 8, 3, padding=1, step_mode="m"), MulFreeChannelwisePSN(8, k=2, step_mode="m"),
                        layer.AvgPool1d(2, 2, step_mode="m"), layer.Flatten(step_mode="m"),
                        layer.Linear(32, 6, step_mode="m"), MulFreeChannelwisePSN(6, k=3, dilation=2, step_mode="m"))
    net.eval()
    want_net = deploy.fold(copy.deepcopy(net))
    with torch.no_grad():
        deploy.set_integer(want_net, calibrate=x)
    want = run(want_net, x)
    to_time_last(net)
    assert torch.equal(torch.from_numpy(session(export_onnx(net, x)).run(None, {"x": x.numpy()})[0]), want)
    assert isinstance(net[1], MulFreeChannelwisePSN)  # (the network itself is left unfolded)


@pytest.mark.parametrize("nested", ["forward", "block-in-Sequential", "Sequential-subclass"])
@pytest.mark.parametrize("streaming", [False, True])
def test_a_residual_network(streaming, nested):
    """A forward traced with torch.fx: the residual addition is an Add, torch.flatten a Reshape. Also
    with the residual block nested in an nn.Sequential (regression: it was refused as a layer), and
    written as an nn.Sequential subclass (regression: exported as a chain, the addition lost)."""
    torch.manual_seed(3)
    x = digits_sequences()
    tail = MulFreeChannelwisePSN(10, k=2, step_mode="m")
    build = {"forward": lambda: Residual(tail=tail), "block-in-Sequential": lambda: residual_in_sequential((tail,)),
             "Sequential-subclass": lambda: residual_sequential_subclass((tail,))}[nested]
    net = deploy.fold(calibrated(build(), x, steps=20))
    with torch.no_grad():
        deploy.set_integer(net, calibrate=x)
    want = run(net, x)
    assert 0.02 < float(want.mean()) < 0.98
    model = export_onnx(net, x, streaming=streaming)
    got = stream(model, x) if streaming else torch.from_numpy(session(model).run(None, {"x": x.numpy()})[0])
    assert torch.equal(got, want)


def _types(model):
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in list(inferred.graph.value_info) + list(inferred.graph.input)}
    types.update({c.name: c.data_type for c in model.graph.initializer})
    return types, {c.name: onnx.numpy_helper.to_array(c) for c in model.graph.initializer}


@pytest.mark.parametrize("streaming", [False, True])
def test_the_neurons_do_integer_arithmetic_only(streaming):
    """Every node of a neuron's charge reads int64 values; its products are by constants that are 0 or a
    signed power of two; the only float operations of a neuron are its input's conversion."""
    body, x = integer_body(3)
    model = export_onnx(body, x, streaming=streaming)
    types, consts = _types(model)
    core = [n for n in model.graph.node if ".core." in n.name]
    assert {n.op_type for n in core} >= {"Mul", "Add", "GreaterOrEqual"}
    for node in core:
        assert node.op_type in ("Mul", "Add", "GreaterOrEqual", "Pad", "Slice", "Reshape", "Unsqueeze", "Concat",
                                "Gather"), node.op_type
        assert types[node.input[0]] == onnx.TensorProto.INT64, (node.name, node.input[0])
        if node.op_type == "Mul":
            w = consts[node.input[1]]
            assert w.dtype == np.int64
            mags = np.abs(w[w != 0])
            assert np.all(mags & (mags - 1) == 0), node.name  # powers of two
    for node in model.graph.node:
        if node.op_type in ("Conv", "MatMul", "Mul") and ".core." not in node.name:
            assert node.op_type != "Mul" or node.name.endswith(".to_fixed.scaled")


def test_errors():
    body, x = integer_body(2)
    with pytest.raises(ValueError, match="float32"):
        export_onnx(body, x.double())
    with pytest.raises(ValueError, match=r"got a numpy.ndarray \(not a torch.Tensor\)"):  # (it named float32)
        export_onnx(body, x.numpy())
    with pytest.raises(ONNXExportError, match="TwoOutputs's forward returns tuple: .* one output"):  # (a KeyError)
        export_onnx(TwoOutputs().eval(), torch.rand(4, 2, 3))
    net = nn.Sequential(layer.Linear(8, 4, step_mode="m"), MulFreeChannelwisePSN(4, k=2, step_mode="m"),
                        nn.Softplus()).eval()
    with pytest.raises(ONNXExportError, match=r"layer '2' \(Softplus\)"):
        export_onnx(net, torch.rand(3, 2, 8))
    folded = deploy.fold(nn.Sequential(layer.Linear(8, 4, step_mode="m"), MulFreeChannelwisePSN(4, k=2, step_mode="m")))
    deploy.set_integer(folded, frac_bits=8, acc_frac_bits=0)
    with pytest.raises(ONNXExportError, match="right shifts"):
        export_onnx(folded, torch.rand(3, 2, 8))


def test_without_onnx_the_error_names_the_extra():
    assert "spikingjelly_mfpsn[onnx]" in export_error_without("onnx", "onnx", "export_onnx")


def test_the_inference_example_writes_onnx_models(tmp_path):
    path = tmp_path / "net.onnx"
    assert "onnxruntime's spikes equal the integer network's: True" in run_inference_example("--onnx", path)
    assert (tmp_path / "net.stream.onnx").is_file()
    onnx.checker.check_model(onnx.load(str(path)))


def test_valid_padding_and_a_torch_flatten_of_the_sequence_export():
    """Regression: Conv1d(padding='valid') was refused, and torch's own nn.Flatten(start_dim=2) in a
    multi-step Sequential (which flattens each step's features of the (T, N, ...) sequence) was applied
    to one step, failing with a shape error."""
    torch.manual_seed(0)
    net = nn.Sequential(layer.Conv1d(1, 2, 3, padding="valid", step_mode="m"),
                        MulFreeChannelwisePSN(2, k=2, threshold="param", v_threshold=0.0, step_mode="m"),
                        nn.Flatten(start_dim=2), layer.Linear(8, 3, step_mode="m"),
                        MulFreeChannelwisePSN(3, k=2, threshold="param", v_threshold=0.0, step_mode="m")).eval()
    x = torch.rand(5, 2, 1, 6)
    y = session(export_onnx(net, x)).run(None, {"x": x.numpy()})[0]
    assert torch.equal(torch.from_numpy(y), run(net, x))


def integer_reference(net, x):
    """``net`` folded and calibrated on ``x`` by deploy (what export_onnx writes), run on ``x``."""
    ref = deploy.fold(copy.deepcopy(net))
    with torch.no_grad():
        deploy.set_integer(ref, calibrate=x)
    return run(ref, x)


@pytest.mark.parametrize("names", [("0", "1", "2", "3"), ("x", "y", "y_2", "sn2")])
def test_a_layer_used_twice_is_exported_at_each_place(names):
    """Regression: a Linear and a neuron used twice in one Sequential were exported once (other outputs),
    layers named like the model's input and output gave invalid models, and SpikingJelly's Dropout failed
    with 'missing forward'."""
    net, x = shared_layers_net(names), torch.randn(5, 3, 4)
    got = session(export_onnx(net, x)).run(None, {"x": x.numpy()})[0]
    assert torch.equal(torch.from_numpy(got), integer_reference(net, x))


def test_a_module_called_twice_in_a_forward_is_exported_at_each_call():
    """Regression: a pooling module called twice gave two nodes of one name (an invalid model)."""
    torch.manual_seed(0)
    net, x = SharedPool().eval(), torch.randn(4, 2, 1, 8, 8)
    got = session(export_onnx(net, x)).run(None, {"x": x.numpy()})[0]
    torch.testing.assert_close(torch.from_numpy(got), integer_reference(net, x))  # (a float readout last)


def test_calibration_keeps_the_exact_accumulator_inside_int64():
    """Regression: calibration took 60 fractional bits for small inputs and a 2**-3 weight, whose exact
    accumulator needs 63 bits: export_onnx (and set_integer(calibrate=x)) raised OverflowError."""
    net, x = small_inputs_net(), torch.rand(4, 2, 3)
    got = session(export_onnx(net, x)).run(None, {"x": x.numpy()})[0]
    assert torch.equal(torch.from_numpy(got), integer_reference(net, x))


def test_what_cannot_be_exported_is_named():
    x = torch.randn(4, 2, 3)
    good = nn.Sequential(layer.Linear(3, 4, step_mode="m"), MulFreeChannelwisePSN(4, k=2, step_mode="m")).eval()
    for call, match in ((dict(opset=99), r"opset must be an int in \[13, "), (dict(opset=True), "opset"),
                        (dict(streaming="no"), "streaming must be True or False")):
        with pytest.raises(ValueError, match=match):
            export_onnx(good, x, **call)
    with pytest.raises(ONNXExportError, match="MF-PSN neurons.*and net has none"):
        export_onnx(nn.Sequential(layer.Linear(3, 4, step_mode="m")).eval(), x)
    single = nn.Sequential(layer.Linear(3, 4), MulFreeChannelwisePSN(4, k=2)).eval()
    with pytest.raises(ONNXExportError, match=r"0, 1 are in step_mode='s'.*set_step_mode"):
        export_onnx(single, x)
    contained = nn.Sequential(layer.Linear(3, 4, step_mode="m"),
                              layer.MultiStepContainer(MulFreeChannelwisePSN(4, k=2))).eval()
    with pytest.raises(ONNXExportError, match=r"1\.0 is in step_mode='s'"):
        export_onnx(contained, x)
    no_stats = nn.Sequential(layer.Conv1d(3, 4, 1, step_mode="m"),
                             layer.BatchNorm1d(4, track_running_stats=False, step_mode="m"),
                             MulFreeChannelwisePSN(4, k=2, step_mode="m")).eval()
    with pytest.raises(ONNXExportError, match="layer '1': a BatchNorm without running statistics"):
        export_onnx(no_stats, torch.randn(4, 2, 3, 5))
    with pytest.raises(ONNXExportError, match="float32 layers"):
        export_onnx(copy.deepcopy(good).double(), x)
    with pytest.raises(ValueError, match=r"net does not run on example_input of shape \(4, 2, 5\)"):
        export_onnx(good, torch.randn(4, 2, 5))
    with pytest.raises(ValueError, match=r"example_input must have no empty dim.*\(4, 0, 3\)"):
        export_onnx(good, torch.randn(4, 0, 3))
    whole_bn = nn.Sequential(layer.Linear(8, 4, step_mode="m"), nn.BatchNorm1d(4),
                             MulFreeChannelwisePSN(4, k=2, step_mode="m")).eval()
    with pytest.raises(ONNXExportError, match=r"layer '1': torch.nn.BatchNorm1d .* its batch axis"):
        export_onnx(whole_bn, torch.rand(5, 4, 8))  # (it was folded into the Linear's features)
    own = nn.Sequential(layer.SeqToANNContainer(StandardisedConv1d(3, 4, 1)),
                        MulFreeChannelwisePSN(4, k=2, step_mode="m")).eval()
    with pytest.raises(ONNXExportError, match=r"layer '0\.0' \(StandardisedConv1d\) has a forward of its own"):
        export_onnx(own, torch.randn(4, 2, 3, 5))  # (it was exported as a plain Conv1d)
    flat = nn.Sequential(layer.Linear(3, 4, step_mode="m"), MulFreeChannelwisePSN(4, k=2, step_mode="m"),
                         nn.Flatten(-2)).eval()
    with pytest.raises(ValueError, match=r"layer '2': torch.nn.Flatten\(start_dim=-2.*time or batch"):
        export_onnx(flat, x)


def linear_then_batch_norm(step_shape):
    """A Linear, a BatchNorm1d and a neuron on steps of ``step_shape`` (features last), with batch-norm
    statistics that differ per channel so that folding them into the wrong dim changes the spikes."""
    torch.manual_seed(0)
    c = step_shape[0]
    bn = nn.BatchNorm1d(c)  # (in a SeqToANNContainer: (T, N, C) and (T, N, C, L) steps in every SpikingJelly)
    net = nn.Sequential(layer.Linear(step_shape[-1], step_shape[-1]), layer.SeqToANNContainer(bn),
                        MulFreeChannelwisePSN(c, k=2))
    functional.set_step_mode(net, "m")
    with torch.no_grad():
        bn.running_mean.uniform_(-3, 3), bn.running_var.uniform_(0.2, 9)
        bn.weight.uniform_(-2, 3), bn.bias.uniform_(-1, 2)
    return net.eval()


def test_a_batch_norm_is_folded_into_a_linear_only_where_it_normalises_its_features():
    """Regression: a BatchNorm1d(C) after a Linear on (N, C, L) steps was folded into the Linear's output
    features (the last dim), where it normalises dim 1: 68 of 72 spikes differed, with no error."""
    x = torch.randn(6, 3, 4)
    net = linear_then_batch_norm((4,))
    y = session(export_onnx(net, x)).run(None, {"x": x.numpy()})[0]
    assert torch.equal(torch.from_numpy(y), integer_reference(net, x))
    with pytest.raises(ONNXExportError, match=r"layer '1\.0': a BatchNorm after the Linear '0' on steps of shape "
                                              r"\(N, 4, 4\) normalises dim 1"):
        export_onnx(linear_then_batch_norm((4, 4)), torch.randn(6, 3, 4, 4))


def test_a_torch_batch_norm_on_the_whole_sequence_in_a_forward_by_hand_is_named():
    """torch's own BatchNorm1d called on the whole (T, N, C) sequence in a hand-written forward (where
    N == C, it runs) normalises the batch axis; it was folded into the Linear's features: 51% of spikes
    differed. A Sequential of the same layers was refused already."""
    class ByHand(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.bn = layer.Linear(3, 4, step_mode="m"), nn.BatchNorm1d(4)
            self.sn = MulFreeChannelwisePSN(4, k=2, threshold="param", step_mode="m")

        def forward(self, x):
            return self.sn(self.bn(self.fc(x)))
    with pytest.raises(ONNXExportError, match=r"layer 'bn': torch.nn.BatchNorm1d .* its batch axis"):
        export_onnx(ByHand().eval(), torch.rand(5, 4, 3))


def test_a_format_set_on_one_neuron_is_kept_while_the_others_are_calibrated():
    """export_onnx recalibrated every neuron where one had no format, overwriting the formats the
    user set (15 of 512 spikes differed from the integer network asked for, with no error)."""
    torch.manual_seed(0)
    x = torch.rand(8, 16, 8)
    net = nn.Sequential(layer.Linear(8, 6, step_mode="m"), MulFreeChannelwisePSN(6, k=2, step_mode="m"),
                        layer.Linear(6, 4, step_mode="m"), MulFreeChannelwisePSN(4, k=2, step_mode="m"))
    folded = deploy.fold(calibrated(net, x))
    deploy.set_integer(folded[1], frac_bits=0)  # (a coarse format, which calibration would not pick)
    want = copy.deepcopy(folded)
    with torch.no_grad():
        deploy.set_integer(want, calibrate=x)
    deploy.set_integer(want[1], frac_bits=0)
    got = torch.from_numpy(session(export_onnx(folded, x)).run(None, {"x": x.numpy()})[0])
    assert torch.equal(got, run(want, x)) and folded[3].frac_bits is None


@pytest.mark.parametrize("start", [2, -2, -3])
def test_a_torch_flatten_in_a_forward_to_the_end_exports(start):
    """A negative start (a flatten of each step's features, counted from the end) was refused."""
    torch.manual_seed(0)
    net = FlattenInForward(start).eval()
    x = torch.rand(3, 2, 1, 3, 4)
    y = session(export_onnx(net, x)).run(None, {"x": x.numpy()})[0]
    assert torch.equal(torch.from_numpy(y), integer_reference(net, x))


def test_a_float32_network_exports_under_a_float64_default_dtype():
    """A probe took torch's default dtype: a float32 network failed with "mat1 and mat2 must have the
    same dtype"."""
    torch.manual_seed(0)
    net = nn.Sequential(layer.Linear(8, 6, step_mode="m"), MulFreeChannelwisePSN(6, k=2, step_mode="m"),
                        layer.Linear(6, 4, step_mode="m"), MulFreeChannelwisePSN(4, k=2, step_mode="m"))
    x = torch.rand(8, 4, 8)
    net = calibrated(net, x)
    want = integer_reference(net, x)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = export_onnx(net, x)
    finally:
        torch.set_default_dtype(default)
    assert torch.equal(torch.from_numpy(session(model).run(None, {"x": x.numpy()})[0]), want)
