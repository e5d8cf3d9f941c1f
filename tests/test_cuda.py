"""What only a CUDA device can show (run there with ``TRITON_INTERPRET=0 python -m pytest -m cuda``; every
test here is skipped, with its reason, on a machine without one). benchmarks/gpu_check.py runs them."""
import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import spikingjelly_mfpsn  # noqa: F401
from spikingjelly.activation_based import functional, layer, neuron
from spikingjelly_mfpsn import fuse_batchnorm

import reference
from nets import assert_compiled_trains_as_eager

pytestmark = pytest.mark.cuda
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

try:
    from spikingjelly_mfpsn.ops import triton_ops
    COMPILED_TRITON = not triton_ops.INTERPRETED
except ImportError:
    COMPILED_TRITON = False
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_triton = pytest.mark.skipif(not (torch.cuda.is_available() and COMPILED_TRITON),
                                  reason="needs a CUDA device and compiled Triton (TRITON_INTERPRET=0)")


def bn_neuron(**kwargs):
    torch.manual_seed(0)
    sn = neuron.MulFreeChannelwisePSN(16, k=3, dilation=2, step_mode="m", exp_init=False, **kwargs)
    with torch.no_grad():
        if sn.threshold == "bn":
            sn.gamma.uniform_(0.5, 1.5)
            sn.beta.uniform_(-1.0, 0.5)
        else:
            sn.v_threshold.uniform_(-0.5, 1.0)
    return sn


@needs_triton
def test_auto_picks_triton_and_matches_the_reference():
    sn = bn_neuron().cuda()
    x = torch.randn(12, 8, 16, 10, device="cuda").requires_grad_()
    assert sn.resolve_method(x) == "triton"
    s = sn(x)
    x64 = x.detach().double().cpu().requires_grad_()
    w, gamma, beta = (p.detach().double().cpu().requires_grad_() for p in (sn.weight, sn.gamma, sn.beta))
    h, _ = reference.mfpsn_charge(x64, w, 2, "time_first", "bn", gamma=gamma, beta=beta)
    clear = h.detach().abs() > 1e-4
    assert torch.equal(s.double().cpu()[clear], (h.detach() >= 0).double()[clear])
    g = torch.randn(s.shape, dtype=torch.float64)
    s.backward(g.cuda().float())
    sn.surrogate_function(h).backward(g)
    for got, want in ((x.grad, x64.grad), (sn.weight.grad, w.grad), (sn.gamma.grad, gamma.grad)):
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=1e-4)


def fused_pair(**kwargs):
    """A SpikingJelly BatchNorm1d and an MF-PSN after it, the batch norm fused into the neuron."""
    pair = nn.Sequential(layer.BatchNorm1d(16, step_mode="m"), bn_neuron(**kwargs))
    with torch.no_grad():
        pair[0].weight.uniform_(0.5, 1.5)
        pair[0].bias.uniform_(-0.5, 0.5)
    fuse_batchnorm(pair)
    return pair


@needs_triton
def test_a_fused_batch_norm_matches_the_reference():
    """BatchNorm + MF-PSN fused on the compiled kernels: the spikes and every gradient (X, the neuron's
    weight, gamma and beta, the batch norm's weight and bias) against the plain reference in float64."""
    pair = fused_pair().cuda()
    x = (torch.randn(12, 8, 16, 10, device="cuda") * 2 + 1).requires_grad_()
    s = pair(x)
    bn, sn = pair[0], pair[1]
    x64 = x.detach().double().cpu().requires_grad_()
    leaves = [p.detach().double().cpu().requires_grad_() for p in (sn.weight, sn.gamma, sn.beta, bn.weight, bn.bias)]
    y = torch.nn.functional.batch_norm(x64.movedim(2, 1), None, None, leaves[3], leaves[4], True).movedim(1, 2)
    h, _ = reference.mfpsn_charge(y, leaves[0], 2, "time_first", "bn", gamma=leaves[1], beta=leaves[2])
    clear = h.detach().abs() > 1e-4
    assert torch.equal(s.double().cpu()[clear], (h.detach() >= 0).double()[clear])
    g = torch.randn(s.shape, dtype=torch.float64)
    s.backward(g.cuda().float())
    sn.surrogate_function(h).backward(g)
    got = (x.grad, sn.weight.grad, sn.gamma.grad, sn.beta.grad, bn.weight.grad, bn.bias.grad)
    names = ("x", "w", "gamma", "beta", "gamma0", "beta0")
    for got, want, what in zip(got, (x64.grad, *(t.grad for t in leaves)), names):
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{what}: {m}")


@needs_triton
def test_compiled_with_cuda_graphs_the_fused_kernels_train_as_eager():
    """torch.compile(mode="reduce-overhead"), method 'triton': the fused Triton steps run as operators inside
    the CUDA graphs (no graph break) and three training steps give the eager spikes and gradients."""
    pair = fused_pair(method="triton").cuda()
    x = torch.randn(8, 4, 16, 6, device="cuda") * 2 + 1
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(copy.deepcopy(pair))(x.clone().requires_grad_())
    assert explanation.graph_break_count == 0, [b.reason for b in explanation.break_reasons]
    assert_compiled_trains_as_eager(pair, x, steps=3, mode="reduce-overhead")


@needs_triton
def test_a_fused_pair_compiled_with_cuda_graphs_first_trains_as_eager():
    """torch.compile(mode="reduce-overhead") of a fused pair (method 'triton') whose first step ever, in a fresh
    process, is the compiled one: nothing the kernels allocate inside the CUDA graphs' warm-up outlives the
    step (CUDA graph trees refuse a live tensor in their pool), and three steps give the eager twin's spikes
    and gradients. Each step sets the gradients to None, as a training loop's ``zero_grad`` does: under CUDA
    graph trees, gradients accumulated over steps fail for any module (pytorch/pytorch#169545)."""
    code = ("import copy, torch, spikingjelly_mfpsn\n"
            "from spikingjelly.activation_based import functional, layer, neuron\n"
            "torch.manual_seed(0)\n"
            "pair = torch.nn.Sequential(layer.BatchNorm1d(13, step_mode='m'), neuron.MulFreeChannelwisePSN(\n"
            "    13, k=2, step_mode='m', method='triton')).cuda()\n"
            "spikingjelly_mfpsn.fuse_batchnorm(pair); eager = copy.deepcopy(pair)\n"
            "compiled = torch.compile(pair, mode='reduce-overhead'); x = torch.randn(8, 4, 13, 6, device='cuda')\n"
            "def step(net, i):\n"
            "    xi = (x + i).requires_grad_(); s = net(xi)\n"
            "    (s * torch.linspace(-1, 1, s.numel(), device='cuda').view(s.shape)).sum().backward()\n"
            "    functional.reset_net(net)\n"
            "    out = [t.detach().clone() for t in (s, xi.grad, *(p.grad for p in net.parameters()))]\n"
            "    net.zero_grad(set_to_none=True)\n"
            "    return out\n"
            "for i in range(3):\n"
            "    got, want = (step(net, i) for net in (compiled, eager))\n"
            "    close = all(torch.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(got[1:], want[1:]))\n"
            "    print(torch.equal(got[0], want[0]), float(want[0].mean()) not in (0.0, 1.0), close)\n")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["True"] * 9, run.stdout


@needs_triton
def test_gradients_are_the_same_bits_in_another_process():
    code = ("import torch, hashlib, spikingjelly_mfpsn; from spikingjelly.activation_based import neuron\n"
            "torch.manual_seed(0); sn = neuron.MulFreeChannelwisePSN(64, k=3, step_mode='m', method='triton').cuda()\n"
            "x = torch.randn(16, 64, 64, 33, device='cuda').requires_grad_(); s = sn(x)\n"
            "s.backward(torch.randn_like(s)); h = hashlib.sha256()\n"
            "[h.update(t.cpu().numpy().tobytes()) for t in (x.grad, sn.weight.grad, sn.gamma.grad)]; print(h.hexdigest())")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:]
    assert runs[0].stdout == runs[1].stdout


@needs_triton
@pytest.mark.parametrize("threshold", ["bn", "param", "bn, fused batch norm"])
def test_a_training_step_replays_as_a_cuda_graph(threshold):
    """No host synchronisation or data-dependent Python in the neuron: a whole training step captures as a
    CUDA graph, and its replay gives the eager step's results."""
    sn = (fused_pair() if threshold.endswith("norm") else bn_neuron(threshold=threshold, method="triton")).cuda()
    eager = copy.deepcopy(sn)
    x = torch.randn(8, 4, 16, 6, device="cuda")
    g = torch.randn_like(x)
    static_x = x.clone().requires_grad_()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (autotuning) outside the graph
        copy.deepcopy(sn)(static_x).backward(g)
    torch.cuda.current_stream().wait_stream(stream)
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        s = sn(static_x)
        s.backward(g)
    graph.replay()
    xe = x.clone().requires_grad_()
    se = eager(xe)
    se.backward(g)
    torch.cuda.synchronize()
    assert torch.equal(s, se) and torch.equal(static_x.grad, xe.grad)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.skipif(not COMPILED_TRITON, reason="needs compiled Triton (TRITON_INTERPRET=0)")
def test_a_tensor_on_another_device_than_the_current_one():
    torch.cuda.set_device(0)
    sn = bn_neuron(method="triton")
    ref = copy.deepcopy(sn).to("cuda:0")
    x = torch.randn(8, 4, 16, 6)
    s1 = sn.to("cuda:1")(x.to("cuda:1"))
    s0 = ref(x.to("cuda:0"))
    assert torch.equal(s1.cpu(), s0.cpu())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_data_parallel_over_two_devices():
    """nn.DataParallel replicates every module; torch's lazy-module mixin refused every MF-PSN."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 16), bn_neuron()).cuda().eval()  # (batch statistics per device)
    x = torch.randn(8, 4, 16, device="cuda")
    want = net(x)
    functional.reset_net(net)
    torch.testing.assert_close(torch.nn.DataParallel(net, device_ids=[0, 1], dim=1)(x), want)
    # A time-last network: the wrappers' replicas set their parameters on the shared layer (a TypeError deep in
    # torch); refused by name
    from spikingjelly_mfpsn import to_time_last
    with pytest.raises(RuntimeError, match="cannot be replicated by nn.DataParallel: convert the network"):
        torch.nn.DataParallel(to_time_last(copy.deepcopy(net)), device_ids=[0, 1], dim=1)(x)


@needs_cuda
@pytest.mark.parametrize("method", ["conv1d", "shift_add"])
def test_a_half_neuron_trains_on_a_batch_of_64k_values_per_channel(method):
    """The torch methods summed float16 statistics in float16: 65536 values of about 1 per channel overflow
    65504, and the CUDA path (no host check) raised the device assert. They now accumulate in float32."""
    torch.manual_seed(0)
    x = (torch.randn(1, 1024, 2, 8, 8) * 1.2).half().cuda()
    sn = neuron.MulFreeChannelwisePSN(2, k=2, step_mode="m", method=method).half().cuda()
    sn(x)
    _, (_, var) = reference.mfpsn_charge(x.double(), torch.tensor([[0.5, 1.0]] * 2).double().cuda(), 1, "time_first",
                                         "bn", gamma=torch.ones(2).double().cuda(), beta=-torch.ones(2).double().cuda())
    n = x.numel() // 2
    torch.testing.assert_close(sn.running_var.double(), 0.9 + 0.1 * var * n / (n - 1), rtol=2e-3, atol=0)


@needs_cuda
@pytest.mark.parametrize("fused", [False, True], ids=["apart", "fused batch norm"])
def test_method_auto_compiled_trains_as_eager_on_cuda(fused):
    """Under compile ``method='auto'`` traces the torch path; on torch 2.11 dynamo lost the gradients of its
    Functions' outputs built in place (0 through every neuron): three compiled steps give eager's spikes,
    gradients and running statistics, with and without a fused batch norm in front."""
    torch.manual_seed(0)
    net = nn.Sequential(layer.Conv1d(3, 16, 1), layer.BatchNorm1d(16), neuron.MulFreeChannelwisePSN(16, k=3, dilation=2),
                        layer.Conv1d(16, 16, 1), neuron.MulFreeChannelwisePSN(16, k=2, threshold="param"),
                        layer.Conv1d(16, 4, 1))
    functional.set_step_mode(net, "m")
    if fused:
        fuse_batchnorm(net)
    assert_compiled_trains_as_eager(net.cuda(), torch.randn(8, 4, 3, 6, device="cuda"), steps=3, backend="aot_eager")


@needs_cuda
def test_a_network_compiled_by_inductor_with_method_auto_trains_on_cuda():
    """Inductor's own kernels for the traced path (the tests above compile with aot_eager): on torch 2.11
    with Triton 3.6, its fusion of the batch statistics with the running statistics' blend stopped
    Triton's compiler ("operand does not dominate this use") at this network's shapes. Two compiled
    steps: a finite loss, a gradient in the first layer and running statistics that moved."""
    from spikingjelly_mfpsn.paper import models
    torch.manual_seed(0)
    net = models.sequential_image_net(3, 32, 100, T=32, neuron="mfpsn", channels=128, hidden=256).cuda()
    x, y = torch.rand(32, 128, 3, 32, device="cuda"), torch.randint(0, 100, (128,), device="cuda")
    stats = [m.running_var for m in net.modules() if isinstance(m, neuron.MulFreeChannelwisePSN)]
    before = [s.clone() for s in stats]
    torch._dynamo.reset()
    compiled = torch.compile(net)
    try:
        for _ in range(2):
            net.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(compiled(x).mean(0), y)
            loss.backward()
            functional.reset_net(net)
    finally:
        torch._dynamo.reset()
    first = next(p for p in net.parameters() if p.grad is not None)
    assert torch.isfinite(loss) and stats and first is next(net.parameters()) and first.grad.abs().sum() > 0
    assert all(not torch.equal(a, b) for a, b in zip(stats, before))
