"""torch.compile and mixed precision with MF-PSN."""
import copy
import operator
import os

import pytest
import torch
import torch.nn as nn
from spikingjelly.activation_based import functional, layer

from spikingjelly_mfpsn import MulFreeChannelwisePSN, ops

from nets import assert_compiled_trains_as_eager

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_net():
    torch.manual_seed(0)
    net = nn.Sequential(layer.Linear(6, 16), MulFreeChannelwisePSN(16, k=3, dilation=2),
                        layer.Linear(16, 16), MulFreeChannelwisePSN(16, k=2, dilation=1, threshold="param"),
                        layer.Linear(16, 4))
    functional.set_step_mode(net, "m")
    return net


# 'cpp' (where a compiler exists) and 'triton' (here through its interpreter) run their kernels as custom ops
# under torch.compile.
@pytest.mark.parametrize("method", ["auto", "conv1d", "vmap_mm"] + [m for m in ("cpp", "triton") if m in ops.names()])
@pytest.mark.parametrize("layout", ["time_first", "time_last"])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_no_graph_break_inside_the_neuron(method, layout, training, grad):
    """Also under no_grad (compiled inference), where eager calls skip the autograd Functions."""
    import torch._dynamo as dynamo
    sn = MulFreeChannelwisePSN(8, k=3, dilation=2, step_mode="m", method=method, layout=layout)
    sn.train(training)
    x = torch.randn(6, 4, 8, 5) if layout == "time_first" else torch.randn(4, 8, 5, 6)
    with torch.set_grad_enabled(grad):
        sn(x)
        dynamo.reset()
        explanation = dynamo.explain(sn)(x)
    assert explanation.graph_break_count == 0, [b.reason for b in explanation.break_reasons]



@pytest.mark.parametrize("backend", [b for b in ops.available_backends() if b != "torch"] or ["none"])
def test_no_graph_break_with_a_kernel_backend(backend):
    """A network switched by ``functional.set_backend``: the neuron checks at every call that its backend runs
    here, and that check (``importlib``'s finder, which dynamo refuses to trace on torch 2.11 with Python
    3.12: a graph break in every neuron, then eager past the recompile limit) stays out of the graph."""
    import torch._dynamo as dynamo
    if backend == "none":
        pytest.skip("no kernel backend installed here (cpp needs a C++ compiler, triton TRITON_INTERPRET=1)")
    net = small_net()
    functional.set_backend(net, backend)
    x = torch.randn(6, 4, 6)
    net(x)
    dynamo.reset()
    explanation = dynamo.explain(net)(x)
    assert explanation.graph_break_count == 0, [b.reason for b in explanation.break_reasons]


@pytest.mark.parametrize("backend", ["torch"] + (["cpp"] if "cpp" in ops.available_backends() else []))
@pytest.mark.parametrize("fused", [False, True], ids=["apart", "fused batch norm"])
def test_a_compiled_training_loop_compiles_once(fused, backend):
    """In a fresh process (nothing cached or loaded yet), the first compiled step traces what later steps
    run, in one graph: no global filled inside the trace whose guard fails at the second step (that
    recompiled every network once more, CUDA graphs included), and no graph break where the C++ library
    is loaded at the first call (it broke the graph at every neuron, for good)."""
    import subprocess
    import sys
    code = ("import torch, torch.nn as nn, spikingjelly_mfpsn\n"
            "from spikingjelly.activation_based import functional, layer\n"
            "from spikingjelly_mfpsn import MulFreeChannelwisePSN\n"
            "torch.manual_seed(0)\n"
            "net = nn.Sequential(layer.Conv1d(6, 16, 1), layer.BatchNorm1d(16), MulFreeChannelwisePSN(16, k=3, dilation=2),\n"
            "                    layer.Conv1d(16, 16, 1), MulFreeChannelwisePSN(16, k=2, threshold='param'),\n"
            "                    layer.Conv1d(16, 4, 1))\n"
            "functional.set_step_mode(net, 'm')\n"
            f"{'spikingjelly_mfpsn.fuse_batchnorm(net)' if fused else 'pass'}\n"
            f"spikingjelly_mfpsn.set_backend(net, {backend!r})\n"
            "torch._dynamo.config.error_on_recompile = True\n"
            "compiled = torch.compile(net, backend='aot_eager', fullgraph=True)\n"
            "for i in range(3):\n"
            "    compiled(torch.randn(5, 4, 6, 3) + i).sum().backward(); functional.reset_net(net)\n"
            "print('once')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0 and run.stdout.split() == ["once"], run.stderr[-3000:]


def test_a_new_batch_size_compiles_once_and_then_not_again():
    """Batches of other sizes (a last short batch, evaluation): one more compile, dynamic in the batch, then
    none; a guard on the size the neurons checked last recompiled at every change, and ran the network
    eagerly past dynamo's recompile limit."""
    net = small_net()
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(1)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(net, backend=backend)
    try:
        for n in (4, 3, 5, 7, 3, 4, 6):
            compiled(torch.randn(5, n, 6)).sum().backward()
            functional.reset_net(net)
    finally:
        torch._dynamo.reset()
    assert len(compiles) == 2


@pytest.mark.parametrize("method", ["shift_add", "conv1d", "vmap_mm"])
@pytest.mark.parametrize("threshold", ["bn", "param"])
@pytest.mark.parametrize("layout", ["time_first", "time_last"])
def test_compiled_torch_methods_match_the_reference(method, threshold, layout):
    """Under compile the torch methods trace other code than eagerly (shift_add sums padded products, the
    statistics clamp out of place): spikes and every gradient against the plain float64 reference."""
    import reference
    torch.manual_seed(0)
    sn = MulFreeChannelwisePSN(5, k=3, dilation=2, step_mode="m", method=method, threshold=threshold,
                               layout=layout).double()
    with torch.no_grad():
        (sn.gamma if threshold == "bn" else sn.v_threshold).uniform_(0.5, 1.5)
    x = torch.randn((7, 3, 5, 2) if layout == "time_first" else (3, 5, 2, 7), dtype=torch.float64) + 0.3
    params = [sn.weight] + ([sn.gamma, sn.beta] if threshold == "bn" else [sn.v_threshold])
    leaves = [p.detach().clone().requires_grad_() for p in params]
    x_ref = x.clone().requires_grad_()
    h, _ = reference.mfpsn_charge(x_ref, leaves[0], 2, layout, threshold, gamma=leaves[1] if threshold == "bn" else None,
                                  beta=leaves[2] if threshold == "bn" else None,
                                  v_threshold=leaves[1] if threshold == "param" else None)
    xc = x.clone().requires_grad_()
    torch._dynamo.reset()
    try:
        s = torch.compile(sn, backend="aot_eager")(xc)
    finally:
        torch._dynamo.reset()
    assert torch.equal(s, (h.detach() >= 0).double())
    g = torch.randn(s.shape, dtype=torch.float64)
    s.backward(g)
    sn.surrogate_function(h).backward(g)
    for got, want, name in zip([xc.grad] + [p.grad for p in params], [x_ref.grad] + [t.grad for t in leaves],
                               ["x", "weight", "gamma" if threshold == "bn" else "v_threshold", "beta"]):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=name)


def test_auto_under_compile_takes_an_implementation_the_compiler_traces():
    """An implementation torch.compile cannot trace (``compiles=False``, as CuPy's launches)
    is what ``method='auto'`` runs eagerly, but not inside a compiled graph, where a traceable one gives
    the same spikes."""
    calls = []

    def opaque(x, weight, bias, dilation, layout):
        calls.append(1)
        return ops.get("conv1d").charge(x, weight, bias, dilation, layout)

    ops.register(ops.Implementation("opaque", "torch", ops.LAYOUTS, opaque, "not traceable",
                                    priority=lambda device, k, t: 1000, compiles=False))
    try:
        sn = MulFreeChannelwisePSN(8, k=3, dilation=2, step_mode="m", threshold="param")
        x = torch.randn(6, 4, 8, 5)
        eager = sn(x)
        assert calls and sn.resolve_method(x) == "opaque"
        calls.clear()
        torch._dynamo.reset()
        compiled = torch.compile(sn, backend="aot_eager")(x)
        assert not calls
        assert torch.equal(compiled, eager)
    finally:
        ops.unregister("opaque")
        torch._dynamo.reset()


@pytest.mark.skipif("triton" not in ops.names(), reason="triton is not installed")
@pytest.mark.parametrize("threshold", ["bn", "param"])
@pytest.mark.parametrize("layout", ["time_first", "time_last"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_method_triton_compiles_to_its_fused_kernels(threshold, layout, backend):
    """method='triton' under torch.compile runs the fused kernels as operators inside the graph: the
    eager step's spikes and gradients over two training steps, the running statistics within rounding
    (blended in by the graph rather than by the kernel), and eval after them."""
    torch.manual_seed(3)
    sn = MulFreeChannelwisePSN(8, k=2, step_mode="m", method="triton", threshold=threshold, exp_init=False,
                               layout=layout)
    x = (torch.randn(6, 4, 8, 5) if layout == "time_first" else torch.randn(4, 8, 5, 6)) * 2 + 0.5
    assert_compiled_trains_as_eager(sn, x, backend=backend)


def test_compiled_training_matches_eager():
    eager = small_net()
    compiled_net = copy.deepcopy(eager)
    compiled = torch.compile(compiled_net, backend="aot_eager")
    x = torch.rand(5, 3, 6)
    out_e, out_c = eager(x), compiled(x)
    torch.testing.assert_close(out_c, out_e)
    out_e.square().sum().backward()
    out_c.square().sum().backward()
    for (name, pe), pc in zip(eager.named_parameters(), compiled_net.parameters()):
        torch.testing.assert_close(pc.grad, pe.grad, msg=name)
    for be, bc in zip(eager.buffers(), compiled_net.buffers()):
        torch.testing.assert_close(bc, be)  # running statistics updated the same way


def test_inductor_compiles_a_training_step():
    """A real code-generating backend on the CPU (needs a C++ compiler, as inductor always does)."""
    net = small_net()
    ref = copy.deepcopy(net)
    compiled = torch.compile(net)  # inductor
    x = torch.rand(5, 3, 6)
    out = compiled(x)
    out.sum().backward()
    out_ref = ref(x)
    out_ref.sum().backward()
    torch.testing.assert_close(out, out_ref, rtol=1e-4, atol=1e-4)
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-4)


def test_bf16_autocast_training_tracks_fp32():
    """A few AdamW steps under CPU bf16 autocast stay within 5 % of the fp32 run's loss; the charge
    itself runs in fp32 (the neuron promotes bf16 inputs)."""
    dtypes = []

    def recording_charge(x, weight, bias, dilation, layout):  # an implementation registered from outside
        dtypes.append(x.dtype)
        return ops.get("shift_add").charge(x, weight, bias, dilation, layout)

    ops.register(ops.Implementation("recording", "torch", ops.LAYOUTS, recording_charge, "records x's dtype"))
    torch.manual_seed(1)
    x = torch.rand(8, 32, 6)
    y = torch.randint(0, 4, (32,))
    losses = {}
    try:
        for mode in ("fp32", "bf16"):
            net = small_net()
            for m in net.modules():
                if isinstance(m, MulFreeChannelwisePSN):
                    m.method = "recording"
            opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
            losses[mode] = []
            for _ in range(5):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
                    out = net(x).mean(0)
                    loss = nn.functional.cross_entropy(out.float(), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses[mode].append(loss.item())
    finally:
        ops.unregister("recording")
    assert out.dtype == torch.bfloat16  # the layers did run in bf16
    assert dtypes and all(d == torch.float32 for d in dtypes)
    for a, b in zip(losses["bf16"], losses["fp32"]):
        assert abs(a - b) <= 0.05 * abs(b), (losses["bf16"], losses["fp32"])
    assert losses["bf16"][-1] < losses["bf16"][0]


def _compiled_wins(module, args, m):
    """measure_fn under which every candidate ties and the whole compiled network "wins"."""
    return 0.5 if getattr(module, "_compiled_call_impl", None) is not None else 1.0


@pytest.mark.parametrize("layout", ["time_first", "time_last"])
def test_autoselect_compile_traces_the_whole_network_once(layout):
    """``autoselect(compile=...)`` compiles the network as one graph, and repeated training steps
    (AdamW, ``reset_net`` between steps) never recompile it.

    The sequential-CIFAR network in an ``nn.Sequential``: with ``nn.Module.compile`` dynamo skipped the
    container's frame and compiled every layer as its own frame, all MF-PSN layers sharing one
    code object whose cache (8 entries) the sawtooth dilations x shapes x train/eval overflowed.
    """
    import torch._dynamo as dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    import spikingjelly_mfpsn as mf
    from spikingjelly_mfpsn import models

    dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    net = models.sequential_image_net(2, 8, 5, T=6, channels=8, hidden=8)  # 7 neurons, dilations 1,2,3,...
    x, y = torch.rand(6, 4, 2, 8), torch.randint(0, 5, (4,))

    counter = CompileCounterWithBackend("eager")
    report = mf.autoselect(net, x, layouts=(layout,), cache=False, measure_fn=_compiled_wins, progress=False,
                           compile=counter)
    assert report.compiled and report.layout == layout
    checked = counter.frame_count  # autoselect checked the compiled network's outputs in eval mode
    assert checked <= 1
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    graphs = []
    for _ in range(4):
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(net(x).mean(0), y).backward()
        opt.step()
        functional.reset_net(net)
        graphs.append(counter.frame_count)
    assert graphs == [checked + 1] * 4, graphs  # one training graph, compiled once
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_each_compiled_network_has_its_own_compile_cache():
    """Networks compiled by autoselect do not share dynamo's per-code cache (8 versions): nine different
    networks are each compiled (its check in eval mode, then a training step), none falls back to eager."""
    import torch._dynamo as dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    import spikingjelly_mfpsn as mf

    dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    for width in range(2, 11):
        net = nn.Sequential(layer.Linear(3, width, step_mode="m"), nn.ReLU(), layer.Linear(width, 2, step_mode="m"))
        x, before = torch.rand(4, 2, 3), counter.frame_count
        report = mf.autoselect(net, x, layouts=("time_first",), cache=False, measure_fn=_compiled_wins,
                               progress=False, compile=counter)
        net(x)
        assert report.compiled and counter.frame_count == before + 2, (width, before, counter.frame_count)


def test_whole_network_timing_compiles_the_graph_training_runs():
    """autoselect times the compiled network fed data (no input gradient), so the first real training
    step reuses that graph instead of compiling another."""
    import torch._dynamo as dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    import spikingjelly_mfpsn as mf
    from spikingjelly_mfpsn import tuner

    dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    net, x = small_net(), torch.rand(5, 3, 6)
    report = mf.autoselect(net, x, layouts=("time_first",), cache=False, measure_fn=_compiled_wins, progress=False,
                           compile=counter)
    checked = counter.frame_count  # the self-check's graph, in eval mode
    tuner.measure(net, (x,), 1, input_grad=False)  # how autoselect times the whole network
    timed = counter.frame_count
    net(x).sum().backward()
    functional.reset_net(net)
    assert report.compiled and timed == checked + 1 and counter.frame_count == timed


class _Double(nn.Module):
    def forward(self, x):
        return x * 2


def test_module_compile_still_skips_a_sequential():
    """What autoselect's compile works around (pytorch/pytorch#150915): ``nn.Module.compile`` on an
    ``nn.Sequential`` lets dynamo skip the container's frame (it lives in torch.nn), so the layers are
    not traced as one graph: torch.nn's own run eager, others are compiled one frame each. Once this
    fails, the bug is fixed: ``net.compile(backend=...)`` would do, without the workaround."""
    import torch._dynamo as dynamo

    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append([node.target for node in gm.graph.nodes if node.op == "call_function"])
        return gm.forward

    dynamo.reset()
    net = nn.Sequential(nn.Linear(3, 4), _Double(), nn.Linear(4, 2), _Double())
    net.compile(backend=counting_backend)
    net(torch.rand(5, 3))
    whole = len(graphs) == 1 and [graphs[0].count(op) for op in (nn.functional.linear, operator.mul)] == [2, 2]
    assert not whole, ("pytorch/pytorch#150915 looks fixed: drop the workaround in "
                       "spikingjelly_mfpsn.tuner._compile (use net.compile(backend=backend))")


@pytest.mark.parametrize("strict", [True, False])
def test_torch_export_of_a_rewritten_forward(strict):
    """A forward that to_time_last rewrote (a callable, not a function) had no __code__, which
    torch.export's non-strict mode reads: an AttributeError. Both modes now export what eager runs."""
    import spikingjelly_mfpsn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.sn = layer.Linear(4, 4), MulFreeChannelwisePSN(4, k=2)

        def forward(self, x):
            return self.sn(self.fc(x)).mean(0)

    torch.manual_seed(0)
    net = Net()
    functional.set_step_mode(net, "m")
    x = torch.rand(4, 2, 4)
    net = spikingjelly_mfpsn.to_time_last(net, example_input=x).eval()
    exported = torch.export.export(net, (x,), strict=strict).module()
    assert torch.equal(exported(x), net(x))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_neurons_refuse_nan(backend):
    """Compiled, the finiteness checks were skipped: a NaN input in BN training went into the running
    statistics, and a NaN weight silenced its channel, with no error. A compiled graph cannot branch on
    values; it now asserts (torch's RuntimeError, naming what it checks), and the running statistics keep
    no NaN."""
    torch._dynamo.reset()
    x = torch.randn(6, 3, 4)
    x[2, 0, 1] = float("nan")
    sn = MulFreeChannelwisePSN(4, k=2, threshold="bn", step_mode="m")
    with pytest.raises(RuntimeError, match="MF-PSN: NaN or inf .* the batch statistics of its charge"):
        torch.compile(sn, backend=backend, fullgraph=True)(x)
    assert torch.isfinite(sn.running_mean).all() and torch.isfinite(sn.running_var).all()
    sn = MulFreeChannelwisePSN(4, k=2, threshold="param", step_mode="m")
    with torch.no_grad():
        sn.weight[1, 0] = float("nan")
    with pytest.raises(RuntimeError, match="MF-PSN: NaN or inf .* in weight, v_threshold"):
        torch.compile(sn, backend=backend, fullgraph=True)(torch.randn(6, 3, 4))
    assert torch.is_grad_enabled()  # (the assertion raised inside a no_grad block left gradients disabled)
