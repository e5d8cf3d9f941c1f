"""torch.compile and mixed precision with MF-PSN."""
import copy

import pytest
import torch
import torch.nn as nn
from spikingjelly.activation_based import functional, layer

from spikingjelly_mfpsn import MulFreeChannelwisePSN, ops


def small_net():
    torch.manual_seed(0)
    net = nn.Sequential(layer.Linear(6, 16), MulFreeChannelwisePSN(16, k=3, dilation=2),
                        layer.Linear(16, 16), MulFreeChannelwisePSN(16, k=2, dilation=1, threshold="param"),
                        layer.Linear(16, 4))
    functional.set_step_mode(net, "m")
    return net


# 'cpp' (where a compiler exists) runs its kernels as custom ops under torch.compile.
@pytest.mark.parametrize("method", ["auto", "conv1d", "vmap_mm"] + (["cpp"] if "cpp" in ops.names() else []))
@pytest.mark.parametrize("layout", ["time_first", "time_last"])
@pytest.mark.parametrize("training", [True, False])
def test_no_graph_break_inside_the_neuron(method, layout, training):
    import torch._dynamo as dynamo
    sn = MulFreeChannelwisePSN(8, k=3, dilation=2, step_mode="m", method=method, layout=layout)
    sn.train(training)
    x = torch.randn(6, 4, 8, 5) if layout == "time_first" else torch.randn(4, 8, 5, 6)
    sn(x)
    dynamo.reset()
    explanation = dynamo.explain(sn)(x)
    assert explanation.graph_break_count == 0, [b.reason for b in explanation.break_reasons]


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
    real = {name: getattr(ops, name) for name in ("charge", "fire", "batch_stats")}

    def recording(name):
        def run(x, *a, **kw):
            dtypes.append(x.dtype)
            return real[name](x, *a, **kw)
        return run

    torch.manual_seed(1)
    x = torch.rand(8, 32, 6)
    y = torch.randint(0, 4, (32,))
    losses = {}
    for mode in ("fp32", "bf16"):
        net = small_net()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        losses[mode] = []
        for _ in range(5):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
                for name in real:
                    setattr(ops, name, recording(name))
                try:
                    out = net(x).mean(0)
                finally:
                    for name, fn in real.items():
                        setattr(ops, name, fn)
                loss = nn.functional.cross_entropy(out.float(), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[mode].append(loss.item())
        if mode == "bf16":
            assert out.dtype == torch.bfloat16  # the layers did run in bf16
    assert dtypes and all(d == torch.float32 for d in dtypes)
    for a, b in zip(losses["bf16"], losses["fp32"]):
        assert abs(a - b) <= 0.05 * abs(b), (losses["bf16"], losses["fp32"])
    assert losses["bf16"][-1] < losses["bf16"][0]
