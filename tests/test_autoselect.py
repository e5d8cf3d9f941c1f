"""autoselect (paper Algorithm 1): choice, cache, self-check, state, zoo networks, distributed."""
import copy
import io
import json
import math
import multiprocessing as mp
import os
import random
import warnings

import pytest
import torch
import torch.nn as nn
from spikingjelly.activation_based import functional, layer, neuron

import spikingjelly_mfpsn as mf
from spikingjelly_mfpsn import MulFreeChannelwisePSN, ops, tuner
from spikingjelly_mfpsn.convert import current_layout, to_time_last

import zoo
from nets import Gained


def seq_net(c=4):
    """A small version of the paper's sequential network: conv-BN-SN blocks, pooling, FC."""
    net = nn.Sequential(
        layer.Conv1d(2, c, 3, padding=1), layer.BatchNorm1d(c), MulFreeChannelwisePSN(k=2, dilation=1),
        layer.Conv1d(c, c, 3, padding=1), layer.BatchNorm1d(c), MulFreeChannelwisePSN(k=2, dilation=2),
        layer.AvgPool1d(2, 2), layer.Flatten(), layer.Linear(c * 4, 8), MulFreeChannelwisePSN(k=3, dilation=3),
        layer.Linear(8, 3),
    )
    functional.set_step_mode(net, "m")
    return net


def example(t=6, n=5):
    return torch.rand(t, n, 2, 8)


class FakeTimes:
    """measure_fn that invents a time for every (layout, module kind, method) and records the calls."""

    def __init__(self, seed=0, bias=None):
        self.rng = random.Random(seed)
        self.table = {}
        self.calls = 0
        self.bias = bias or {}

    def __call__(self, module, args, m):
        self.calls += 1
        layout = getattr(module, "layout", None) or ("time_last" if "TimeLast" in type(module).__name__
                                                     else "time_first")
        key = (layout, type(module).__name__, getattr(module, "method", "-"), tuple(args[0].shape))
        if key not in self.table:
            self.table[key] = self.rng.uniform(1, 10) * self.bias.get(layout, 1.0)
        return self.table[key]


def state_of(net):
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def eval_out(net, x):
    net.eval()
    with torch.no_grad():
        y = net(x)
    functional.reset_net(net)
    net.train()
    return y


@pytest.mark.parametrize("seed,bias", [(0, None), (1, {"time_last": 0.1}), (2, {"time_first": 0.1})])
def test_choice_is_the_minimum_of_the_recorded_times(seed, bias, tmp_path):
    net = seq_net()
    fake = FakeTimes(seed, bias)
    report = mf.autoselect(net, example(), cache=str(tmp_path / "c.json"), measure_fn=fake, progress=False)
    assert fake.calls > 0
    for layout, rows in report.layouts.items():
        assert rows, layout
        for r in rows:
            assert r.choice == min(r.times, key=r.times.get)
        assert report.totals[layout] == pytest.approx(sum(r.times[r.choice] for r in rows))
    assert report.layout == min(report.totals, key=report.totals.get)
    if bias:
        assert report.layout == next(iter(bias))
    # what was chosen is what the net now runs
    assert current_layout(net) == report.layout
    named = dict(net.named_modules())
    for name, method in report.methods.items():
        if method != "-":
            assert named[name].method == method
    neuron_rows = [r for r in report.layouts[report.layout] if r.kind == "MulFreeChannelwisePSN"]
    assert len(neuron_rows) == 3 and all(len(r.times) >= 3 for r in neuron_rows)
    text = str(report)
    assert "time_first" in text and "time_last" in text and "(chosen)" in text


def test_autoselect_again_after_a_layout_change(tmp_path):
    """A second pass starts from the first one's choice (time-last methods pinned) and may move back."""
    net = seq_net()
    r1 = mf.autoselect(net, example(), cache=False, measure_fn=FakeTimes(0, {"time_last": 0.01}), progress=False)
    assert r1.layout == "time_last" and current_layout(net) == "time_last"
    r2 = mf.autoselect(net, example(), cache=False, measure_fn=FakeTimes(0, {"time_first": 0.01}), progress=False)
    assert r2.layout == "time_first" and current_layout(net) == "time_first"
    for m in net.modules():
        if isinstance(m, MulFreeChannelwisePSN):
            assert m.layout == "time_first" and "time_first" in ops.get(m.resolve_method(example())).layouts \
                if m.method == "auto" else "time_first" in ops.get(m.method).layouts


def test_outputs_and_state_unchanged(tmp_path):
    torch.manual_seed(0)
    net = seq_net()
    x = example()
    net(x)  # some running statistics
    functional.reset_net(net)
    before_out, before_state = eval_out(net, x), state_of(net)
    report = mf.autoselect(net, x, m=1, cache=str(tmp_path / "c.json"), progress=False)
    assert report.timed > 0
    after_state = state_of(net)
    assert before_state.keys() == after_state.keys()
    for k in before_state:
        assert torch.equal(before_state[k], after_state[k]), k
    assert all(p.grad is None for p in net.parameters())
    torch.testing.assert_close(eval_out(net, x), before_out)
    # and the net still trains in the chosen configuration
    net(x).sum().backward()
    assert all(p.grad is not None for p in net.parameters())


def test_cache_hit_times_nothing(tmp_path):
    path = str(tmp_path / "c.json")
    net = seq_net()
    first = FakeTimes(3)
    r1 = mf.autoselect(net, example(), cache=path, measure_fn=first, progress=False)
    assert r1.timed > 0  # (identical layers on identical inputs share one timing even in one call)
    second = FakeTimes(4)  # would give other times: it must not be asked
    net2 = seq_net()
    r2 = mf.autoselect(net2, example(), cache=path, measure_fn=second, progress=False)
    # the whole-network choice is cached: nothing timed, nothing captured
    assert second.calls == 0 and r2.timed == 0 and r2.cache_hits == len(r1.methods) and not r2.layouts
    assert (r2.layout, r2.methods) == (r1.layout, r1.methods)
    # without it, the per-layer timings still answer every layer
    data = json.loads(open(path).read())
    data["plans"] = {}
    open(path, "w").write(json.dumps(data))
    r2b = mf.autoselect(seq_net(), example(), cache=path, measure_fn=second, progress=False)
    assert second.calls == 0 and r2b.timed == 0 and r2b.cache_hits == r1.timed + r1.cache_hits
    assert (r2b.layout, r2b.methods) == (r1.layout, r1.methods)
    # another input shape is timed again
    r3 = mf.autoselect(seq_net(), example(t=9), cache=path, measure_fn=second, progress=False)
    assert second.calls > 0 and r3.timed > 0


@pytest.mark.parametrize("content", [b"\x00\xffgarbage{", b'{"schema": 999, "layers": {}}', b"[1, 2, 3]",
                                     b"[" * 100000 + b"]" * 100000, b'{"schema": 1, "layers": {"k": {"a": 1'])
def test_corrupted_or_foreign_cache_is_rebuilt(tmp_path, content):
    """Garbage, another schema, a list, JSON nested deeper than the parser's recursion (a RecursionError
    escaped), a truncated file."""
    path = tmp_path / "c.json"
    path.write_bytes(content)
    with pytest.warns(UserWarning, match="rebuilt"):
        report = mf.autoselect(seq_net(), example(), cache=str(path), measure_fn=FakeTimes(), progress=False)
    assert report.timed > 0
    data = json.loads(path.read_text())
    assert data["schema"] == tuner.CACHE_SCHEMA and len(data["layers"]) >= report.timed


def _spoil_layers(data, value):
    data["plans"] = {}  # (else the whole network's plan applies, and no layer timing is needed)
    data["layers"] = {k: ({m: value for m in v} if value != "list" else list(v.values())) for k, v in data["layers"].items()}


def _spoil_plans(data, field, value):
    if field is None:
        data["plans"] = list(data["plans"].values())
    for plan in data["plans"].values() if isinstance(data["plans"], dict) else ():
        plan[field] = value


SPOILED = {"a string for a time": lambda d: _spoil_layers(d, "fast"),
           "a boolean for a time": lambda d: _spoil_layers(d, True),
           "only infinite times": lambda d: _spoil_layers(d, math.inf),
           "NaN times": lambda d: _spoil_layers(d, math.nan),
           "a list for a layer's times": lambda d: _spoil_layers(d, "list"),
           "a string for compiled": lambda d: _spoil_plans(d, "compiled", "no"),
           "a string for a total": lambda d: _spoil_plans(d, "totals", {"time_first": "1"}),
           "a list for the methods": lambda d: _spoil_plans(d, "methods", ["conv1d"]),
           "no methods": lambda d: _spoil_plans(d, "methods", {}),  # (taken as applied: nothing chosen)
           "an unknown layout": lambda d: _spoil_plans(d, "layout", "sideways"),
           "a list for the plans": lambda d: _spoil_plans(d, None, None)}


@pytest.mark.parametrize("spoil", SPOILED, ids=list(SPOILED))
def test_cache_entries_autoselect_did_not_write_are_measured_again(tmp_path, spoil):
    """Every entry is checked against the schema of what autoselect writes: the rest is dropped with a
    warning and measured again, never an exception (an all-inf entry raised "no candidate could run"),
    and never a string "no" that switches torch.compile on."""
    path = tmp_path / "c.json"
    mf.autoselect(seq_net(), example(), cache=str(path), measure_fn=FakeTimes(), progress=False)
    data = json.loads(path.read_text())
    SPOILED[spoil](data)
    path.write_text(json.dumps(data))
    net, fake = seq_net(), FakeTimes()
    with pytest.warns(UserWarning, match="not what autoselect writes; they are dropped and measured again"):
        report = mf.autoselect(net, example(), cache=str(path), measure_fn=fake, progress=False)
    assert report.layout is not None and report.compiled is False
    assert getattr(net, "_compiled_call_impl", None) is None
    assert (fake.calls > 0) == ("time" in spoil or "layer" in spoil)  # (a plan is rebuilt from valid timings)
    assert tuner.TimingCache(str(path)).plans  # rewritten in the schema: read back without a warning


def test_a_cache_path_that_is_not_a_file_is_never_opened(tmp_path):
    """A FIFO (opening it would wait for a writer forever) or a directory: a warning, no cache."""
    import signal

    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    (tmp_path / "dir.json").mkdir()

    def hang(*_):
        raise TimeoutError("autoselect opened the FIFO and waited")
    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(60)
    try:
        for path, what in ((fifo, "a FIFO"), (tmp_path / "dir.json", "a directory")):
            net = seq_net()
            with pytest.warns(UserWarning, match=f"is {what}, not a file: running without the cache"):
                report = mf.autoselect(net, example(), cache=str(path), measure_fn=FakeTimes(), progress=False)
            assert report.layout is not None and current_layout(net) == report.layout
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert fifo.exists() and not (tmp_path / "dir.json" / "c.json").exists()


def _hold_lock(path, held, release):
    import filelock
    with filelock.FileLock(path):
        held.set()
        release.wait(120)


def test_a_stuck_lock_holder_delays_autoselect_a_bounded_time(tmp_path, monkeypatch):
    """Another process holds the cache's lock and never lets go: autoselect waits the configured time,
    then applies its choice without caching it, with a warning."""
    import time

    path = tmp_path / "c.json"
    ctx = mp.get_context("spawn")
    held, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(str(path) + ".lock", held, release))
    holder.start()
    try:
        assert held.wait(60)
        monkeypatch.setenv(tuner.LOCK_TIMEOUT_ENV, "0.5")
        net, t0 = seq_net(), time.perf_counter()
        with pytest.warns(UserWarning, match="lock .*was held by another process for 0.5 s; the choice is applied") as w:
            report = mf.autoselect(net, example(), cache=str(path), measure_fn=FakeTimes(), progress=False)
        assert time.perf_counter() - t0 < 30 and report.layout is not None and not path.exists()
        assert sum("was held" in str(r.message) for r in w) == 1  # (one save: it waited twice, warned twice)
    finally:
        release.set()
        holder.join(60)
    assert tuner.LOCK_TIMEOUT < 60  # the default wait is well under a minute


def test_an_unwritable_cache_warns_and_the_choice_still_applies(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a regular file where the cache's directory should be
    net, x = seq_net(), example()
    with pytest.warns(UserWarning) as caught:
        report = mf.autoselect(net, x, cache=str(blocker / "c.json"), measure_fn=FakeTimes(), progress=False)
    said = " ".join(str(w.message) for w in caught)
    assert "cannot be read" in said and "cannot be written" in said and "the choice is applied but not cached" in said
    assert "rebuilt" not in said  # nothing to rebuild: the file is not corrupted, it cannot be reached
    assert report.layout is not None and current_layout(net) == report.layout and blocker.read_text() == ""


def _writer(path, i, barrier):
    cache = tuner.TimingCache(path)
    for j in range(20):
        cache.put(f"writer{i}-{j}", {"m": float(j)})
    barrier.wait()
    for _ in range(5):
        cache.save()


def test_concurrent_writers_leave_a_whole_file(tmp_path):
    path = str(tmp_path / "c.json")
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(4)
    procs = [ctx.Process(target=_writer, args=(path, i, barrier)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    data = json.loads(open(path).read())
    assert len(data["layers"]) == 80  # nothing torn, nothing lost
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".autoselect-")]


def test_the_cache_keeps_the_entries_written_last(tmp_path, monkeypatch):
    """The file kept every key ever written (each library upgrade and shape adds some, and every call
    reads the whole file); it now keeps the newest, by when they were written, in any process."""
    monkeypatch.setattr(tuner, "MAX_LAYER_ENTRIES", 3)
    monkeypatch.setattr(tuner, "MAX_PLANS", 2)
    path = tmp_path / "c.json"
    first = tuner.TimingCache(str(path))
    for i in range(4):
        first.put(f"k{i}", {"m": float(i)})
        first.put_plan(f"p{i}", {"layout": "time_first", "methods": {}, "totals": {}})
    first.save()
    data = json.loads(path.read_text())
    assert list(data["layers"]) == ["k1", "k2", "k3"] and list(data["plans"]) == ["p2", "p3"]
    other = tuner.TimingCache(str(path))  # another process: writes k4, then rewrites k1 with a new time
    other.put("k4", {"m": 4.0})
    other.put("k1", {"m": 10.0})
    other.save()
    assert list(json.loads(path.read_text())["layers"]) == ["k3", "k4", "k1"]
    third = tuner.TimingCache(str(path))
    assert third.get("k1") == {"m": 10.0} and third.get("k2") is None
    first.put("k5", {"m": 5.0})  # an object that read the file earlier adds one: it does not bring back
    first.save()                 # what it read then, nor its older times of entries others rewrote
    data = json.loads(path.read_text())
    assert list(data["layers"]) == ["k4", "k1", "k5"] and data["layers"]["k1"] == {"m": 10.0}


def test_a_configuration_that_fails_the_self_check_is_skipped(tmp_path, monkeypatch):
    def broken(x, weight, bias, dilation, layout):
        return torch.zeros(x.shape, dtype=x.dtype) + 0 * weight.sum()  # wrong, but runs

    ops.register(ops.Implementation("broken", "torch", ("time_first",), broken, "a wrong implementation"))
    try:
        def fake(module, args, m):
            if getattr(module, "method", None) == "broken":
                return 1e-9  # the fastest by far: autoselect must still refuse it
            return 1.0 if getattr(module, "layout", "time_first") == "time_first" else 2.0
        net = seq_net()
        x = example()
        ref = eval_out(net, x)
        with pytest.warns(UserWarning, match="does not reproduce"):
            report = mf.autoselect(net, x, cache=False, measure_fn=fake, progress=False)
        assert report.layout == "time_last"  # the time-first plan used 'broken'
        assert not any(m.method == "broken" for m in net.modules() if isinstance(m, MulFreeChannelwisePSN))
        torch.testing.assert_close(eval_out(net, x), ref)
    finally:
        ops.unregister("broken")


def test_unconvertible_layout_is_skipped(tmp_path):
    net = nn.Sequential(layer.Linear(2, 4), neuron.LIFNode(), layer.Linear(4, 2), MulFreeChannelwisePSN(k=2))
    functional.set_step_mode(net, "m")
    with pytest.warns(UserWarning, match="time_last"):
        report = mf.autoselect(net, torch.rand(4, 3, 2), cache=False, measure_fn=FakeTimes(), progress=False)
    assert report.layout == "time_first" and "time_last" not in report.totals


class _WithExtras(nn.Module):
    """A network whose output is a tuple with a dict in it (layout-independent extras)."""

    def __init__(self):
        super().__init__()
        self.body = seq_net()

    def forward(self, x):
        y = self.body(x)
        return y, {"total": y.sum(), "steps": 6}


def test_a_network_with_structured_outputs_gets_a_plan(tmp_path):
    """The self-check compares tuples, lists and dicts of tensors part by part (it took any output that
    is not a tensor for a mismatch, so such a network got no plan at all)."""
    torch.manual_seed(0)
    net, x = _WithExtras(), example()
    net(x)
    functional.reset_net(net)
    before = eval_out(net, x)
    report = mf.autoselect(net, x, cache=str(tmp_path / "c.json"), measure_fn=FakeTimes(1), progress=False)
    assert report.layout is not None and not report.skipped, report.skipped
    after = eval_out(net, x)
    torch.testing.assert_close(after[0], before[0])
    assert after[1].keys() == before[1].keys() and after[1]["steps"] == 6


class _Reconfigured(nn.Module):
    """_WithExtras whose output changes in one ``part`` once its neurons run a method other than the one
    they were built with ('auto'), as every configuration autoselect applies sets one ('few_samples':
    the tensor, on a batch of at most ``tuner.PROBE`` samples only)."""

    def __init__(self, part):
        super().__init__()
        self.body, self.part = seq_net(), part

    def forward(self, x):
        changed = any(m.method != "auto" for m in self.modules() if isinstance(m, MulFreeChannelwisePSN))
        y = self.body(x) + (changed and self.part == "few_samples" and x.shape[1] <= tuner.PROBE)
        extras = {"total": y.sum() + (changed and self.part == "tensor"), "steps": 6}
        if changed and self.part in ("value", "keys"):
            extras.update({"steps": 7} if self.part == "value" else {"more": 6})
        return [y, extras] if changed and self.part == "container" else (y, extras)


@pytest.mark.parametrize("part", ["tensor", "value", "keys", "container"])
def test_the_self_check_compares_structured_outputs_part_by_part(part):
    """A configuration that changes one part of a structured output (a tensor in a dict, another value,
    the dict's keys, a list for a tuple) does not reproduce the outputs: it is not applied."""
    net, x = _Reconfigured(part), example()
    with pytest.warns(UserWarning, match="does not reproduce the network's outputs"):
        report = mf.autoselect(net, x, cache=False, measure_fn=FakeTimes(1), progress=False)
    assert report.layouts and report.layout is None and current_layout(net) == "time_first"
    assert all(m.method == "auto" for m in net.modules() if isinstance(m, MulFreeChannelwisePSN))  # as it came


@pytest.mark.parametrize("second", ["gain", "mask"])
def test_a_network_with_several_inputs_takes_them_as_a_tuple(second, tmp_path):
    """x_example as a tuple holds the positional inputs (as torch.jit.trace takes them); autoselect
    called net(x_example) with the tuple as one input. A layout the network cannot run in (its input
    capture raised) is skipped with a warning instead of ending the whole call."""
    torch.manual_seed(0)
    net, x = Gained(seq_net()), example()  # a gain is the same in both layouts; a mask shaped like x
    # is left time-first by the time-last boundary (it moves the first input only): that layout cannot run
    scale = torch.full((1,), 0.7) if second == "gain" else (torch.rand_like(x) > 0.3).float()
    net(x, scale)
    functional.reset_net(net)
    net.eval()
    with torch.no_grad():
        before = net(x, scale)
    functional.reset_net(net)
    net.train()
    fake = FakeTimes(3)
    if second == "gain":
        report = mf.autoselect(net, (x, scale), cache=str(tmp_path / "c.json"), measure_fn=fake, progress=False)
        assert set(report.layouts) == {"time_first", "time_last"} and not report.skipped
    else:
        with pytest.warns(UserWarning, match="(cannot|does not) run in layout 'time_last'"):  # (conversion refuses)
            report = mf.autoselect(net, (x, scale), cache=str(tmp_path / "c.json"), measure_fn=fake,
                                   progress=False)
        assert list(report.layouts) == ["time_first"] and report.layout == "time_first"
        assert current_layout(net) == "time_first"
    assert fake.calls > 0 and report.layout is not None
    net.eval()
    with torch.no_grad():
        torch.testing.assert_close(net(x, scale), before)
    functional.reset_net(net)
    net.train()
    again = FakeTimes(4)
    mf.autoselect(net, (x, scale), cache=str(tmp_path / "c.json"), measure_fn=again, progress=False)
    assert again.calls == 0  # the plan was stored under the two inputs' key, and found again


def _mixed_net(c=4):
    """MF-PSN with one SpikingJelly LIF neuron left, which has no time-last version."""
    net = nn.Sequential(
        layer.Conv1d(2, c, 3, padding=1), layer.BatchNorm1d(c), MulFreeChannelwisePSN(k=2, dilation=1),
        layer.Conv1d(c, c, 3, padding=1), layer.BatchNorm1d(c), neuron.LIFNode(),
        layer.Flatten(), layer.Linear(c * 8, 3),
    )
    functional.set_step_mode(net, "m")
    return net


def test_fallback_lets_a_network_with_other_neurons_run_time_last(tmp_path):
    path = str(tmp_path / "c.json")
    torch.manual_seed(0)
    net, x = _mixed_net(), example()
    net(x)
    functional.reset_net(net)
    before = eval_out(net, x)
    with pytest.warns(UserWarning, match="cannot run in layout 'time_last'"):
        plain = mf.autoselect(copy.deepcopy(net), x, cache=path, measure_fn=FakeTimes(2), progress=False)
    assert plain.layout == "time_first" and list(plain.layouts) == ["time_first"]
    faster_last = FakeTimes(2, bias={"time_last": 0.01})
    report = mf.autoselect(net, x, cache=path, measure_fn=faster_last, progress=False, fallback="time_first")
    assert set(report.layouts) == {"time_first", "time_last"} and report.layout == "time_last"
    assert current_layout(net) == "time_last" and not report.skipped
    torch.testing.assert_close(eval_out(net, x), before)
    again = FakeTimes(3)
    hit = mf.autoselect(copy.deepcopy(net), x, cache=path, measure_fn=again, progress=False, fallback="time_first")
    assert hit.layout == "time_last" and again.calls == 0  # the fallback's plan, found again
    with pytest.raises(ValueError, match="fallback must be one of"):
        mf.autoselect(net, x, cache=False, fallback="sideways")
    # Timed for real: the LIF island's input is captured as the island receives it, time-last.
    timed = copy.deepcopy(net)
    lif, shapes = timed[5], []
    run = lif.multi_step_forward  # what the LIF itself gets, inside its island: always (T, N, C, L)
    lif.multi_step_forward = lambda x_seq: shapes.append(tuple(x_seq.shape)) or run(x_seq)
    real = mf.autoselect(timed, x, m=1, cache=False, progress=False, fallback="time_first")
    assert set(real.layouts) == {"time_first", "time_last"} and not real.skipped, real.skipped
    assert shapes and all(s[0] == x.shape[0] and s[2:] == (4, 8) for s in shapes), set(shapes)
    del lif.multi_step_forward
    assert all(math.isfinite(t) for rows in real.layouts.values() for r in rows for t in r.times.values())
    torch.testing.assert_close(eval_out(timed, x), before)


def test_a_network_that_is_one_neuron_gets_its_method_timed_and_pinned():
    """Regression: the root module was never timed, so a bare neuron stayed on 'auto' and the report
    listed its surrogate function as the layer."""
    sn = MulFreeChannelwisePSN(3, k=2, step_mode="m")
    timer = FakeTimes(3)
    report = mf.autoselect(sn, torch.rand(6, 4, 3, 5), cache=False, measure_fn=timer, progress=False)
    methods = {key[2] for key in timer.table if key[1] == "MulFreeChannelwisePSN"}
    assert len(methods) > 1 and sn.method in methods, (methods, sn.method)
    assert {r.kind for rows in report.layouts.values() for r in rows} == {"MulFreeChannelwisePSN"}


def test_bad_arguments():
    for m in (0, True, 1.5, "2"):  # (True and 1.5 were taken as counts, "2" failed on a comparison)
        with pytest.raises(ValueError, match="m must be an int >= 1"):
            mf.autoselect(seq_net(), example(), m=m, cache=False)
    with pytest.raises(TypeError, match="cache must be True, False or a path"):
        mf.autoselect(seq_net(), example(), cache=123)
    # Flags took any value ('no' printed the table, as True would)
    for flags in (dict(progress="yes"), dict(verbose="no")):
        with pytest.raises(TypeError, match="progress must be None, True or False and verbose True or False"):
            mf.autoselect(seq_net(), example(), cache=False, **flags)
    for flags in (dict(boundary="no"), dict(strict="yes")):
        with pytest.raises(TypeError, match=f"{next(iter(flags))} must be True or False"):
            to_time_last(seq_net(), **flags)
    with pytest.raises(ValueError, match="layout"):
        mf.autoselect(seq_net(), example(), layouts=("sideways",), cache=False)
    headless = seq_net()
    headless(example())
    to_time_last(headless, boundary=False)  # takes (N, ..., T) from now on
    with pytest.raises(ValueError, match=r"without the boundary.*to_time_first\(net\)"):
        mf.autoselect(headless, example().movedim(0, -1), cache=False)
    for empty in (example(n=0), example(t=0), (example(), torch.rand(3, 0))):
        with pytest.raises(ValueError, match=r"x_example has an empty tensor \(shape"):
            mf.autoselect(seq_net(), empty, cache=False)


@pytest.mark.parametrize("arch", ["spiking_vgg", "spiking_resnet"])
def test_model_zoo_after_replace_neurons(arch, tmp_path):
    torch.manual_seed(0)
    net = zoo.BUILDERS[arch](neuron.LIFNode, num_classes=4)
    x = torch.rand(2, 2, 3, 16, 16)
    net, summary = mf.replace_neurons(net, k=2, example_input=x)
    assert len(summary) >= 2 and [r.dilation for r in summary][:2] == [1, 2]
    before = eval_out(net, x)
    report = mf.autoselect(net, x, m=1, cache=str(tmp_path / "c.json"), progress=False)
    assert report.layout in ("time_first", "time_last")
    torch.testing.assert_close(eval_out(net, x), before)
    assert net(x).shape == before.shape


def _dist_worker(rank, path, init_file, results, faster):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        net = seq_net()  # (lazy neurons: their channels come with the first forward)
        if rank == 0:
            fake = FakeTimes(7, {faster: 0.1})
        else:
            def fake(*a):
                raise AssertionError("only rank 0 measures")
        with pytest.raises(ValueError, match="net is wrapped in DistributedDataParallel.*before wrapping"):
            mf.autoselect(nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(2, 2))), torch.rand(3, 2))
        report = mf.autoselect(net, example(), cache=path, measure_fn=fake, progress=False)
        methods = {n: m.method for n, m in net.named_modules() if isinstance(m, MulFreeChannelwisePSN)}
        lazy = any(map(nn.parameter.is_lazy, net.parameters()))
        nn.parallel.DistributedDataParallel(net)(example()).sum().backward()  # (refuses lazy parameters)
        results.put((rank, report.layout, current_layout(net), methods, lazy))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("faster", ["time_last", "time_first"])
def test_distributed_rank0_decides_every_rank_applies(tmp_path, faster):
    """Every rank leaves with rank 0's choice and its neurons built (rank 0's timing built them there; a
    choice of time-first ran no forward elsewhere, and DistributedDataParallel refused the lazy rest),
    and a network already wrapped is refused by name before any collective."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_dist_worker, args=(r, str(tmp_path / f"c{r}.json"), str(tmp_path / "init"),
                                                    results, faster)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    (_, layout0, applied0, methods0, lazy0), (_, layout1, applied1, methods1, lazy1) = got
    assert layout0 == layout1 == applied0 == applied1 == faster
    assert methods0 == methods1
    assert not lazy0 and not lazy1


def test_stale_whole_network_plan_is_measured_again(tmp_path):
    path = tmp_path / "c.json"
    net, x = seq_net(), example()
    eval_out(net, x)  # materialise the lazy channels, as autoselect does before computing the key
    key = tuner.net_key(net, x, ("time_first", "time_last"))
    path.write_text(json.dumps({"schema": tuner.CACHE_SCHEMA, "layers": {},
                                "plans": {key: {"layout": "time_first", "methods": {"no.such.layer": "conv1d"},
                                                "totals": {"time_first": 1.0}}}}))
    fake = FakeTimes(5)
    report = mf.autoselect(net, x, cache=str(path), measure_fn=fake, progress=False)
    assert fake.calls > 0 and report.timed > 0
    plan = json.loads(path.read_text())["plans"][key]
    assert plan["methods"] == report.methods and plan["layout"] == report.layout


@pytest.mark.parametrize("compiled_faster", [True, False])
def test_compile_option_keeps_torch_compile_only_when_faster(tmp_path, compiled_faster):
    net, x = seq_net(), example()
    ref = eval_out(net, x)
    layer_times = FakeTimes(6)

    def fake(module, args, m):
        if module is net:  # a whole training step, eager or compiled
            is_compiled = getattr(net, "_compiled_call_impl", None) is not None
            return (0.5 if compiled_faster else 2.0) if is_compiled else 1.0
        return layer_times(module, args, m)

    path = str(tmp_path / "c.json")
    report = mf.autoselect(net, x, cache=path, measure_fn=fake, progress=False, compile="aot_eager")
    assert report.compiled is compiled_faster and report.compile_times["eager"] == 1.0
    assert (net._compiled_call_impl is not None) is compiled_faster
    torch.testing.assert_close(eval_out(net, x), ref)
    assert "compiled" in str(report) or "eager" in str(report)
    # the decision is cached with the plan: a new net of the same shape is compiled (or not) untimed
    net2 = seq_net()
    r2 = mf.autoselect(net2, x, cache=path, measure_fn=lambda *a: pytest.fail("timed again"), progress=False,
                       compile="aot_eager")
    assert r2.compiled is compiled_faster and (net2._compiled_call_impl is not None) is compiled_faster


# ------------------------------------------------------------------ the cached plan (warm path)
def _stored_plan(path):
    plans = json.loads(open(path).read())["plans"]
    assert len(plans) == 1
    return next(iter(plans.items()))


def _count_forwards(net):
    """A list that every forward call of any module of ``net`` appends to."""
    calls = []
    for m in net.modules():
        m.register_forward_pre_hook(lambda mod, args: calls.append(mod))
    return calls


def _no_timing(*args):
    pytest.fail("a cached plan should have been applied without timing")


def test_second_call_on_the_converted_net_applies_the_cached_plan(tmp_path):
    path = str(tmp_path / "c.json")
    net, x = seq_net(), example()
    r1 = mf.autoselect(net, x, cache=path, measure_fn=FakeTimes(0, {"time_last": 0.1}), progress=False)
    assert r1.layout == current_layout(net) == "time_last"
    r2 = mf.autoselect(net, x, cache=path, measure_fn=_no_timing, progress=False)
    assert not r2.layouts and r2.timed == 0 and (r2.layout, r2.methods) == (r1.layout, r1.methods)
    assert len(json.loads(open(path).read())["plans"]) == 1  # one key for either layout of the net


def test_cached_plan_is_checked_on_a_few_samples(tmp_path):
    path = str(tmp_path / "c.json")
    x = example(n=9)
    mf.autoselect(seq_net(), x, cache=path, measure_fn=FakeTimes(1), progress=False)
    net = seq_net()
    batches = []
    net.register_forward_pre_hook(lambda mod, args: batches.append(args[0].shape[1]))
    before = eval_out(net, x)
    batches.clear()
    report = mf.autoselect(net, x, cache=path, measure_fn=_no_timing, progress=False)
    assert not report.layouts and batches and max(batches) == tuner.PROBE < x.shape[1]
    torch.testing.assert_close(eval_out(net, x), before)


@pytest.mark.parametrize("second", ["gain", "mask"])
def test_a_cached_plan_of_several_inputs_is_checked_on_a_few_samples(tmp_path, second):
    """Of a tuple of inputs, every tensor with the batch on dim 1 is cut to the first samples (a mask),
    the others passed whole (a gain)."""
    path = str(tmp_path / "c.json")
    x = example(n=9)
    extra = torch.full((1,), 0.5) if second == "gain" else (torch.rand_like(x) > 0.3).float()
    layouts = ("time_first",)  # a mask cannot run time-last (see above)
    mf.autoselect(Gained(seq_net()), (x, extra), cache=path, measure_fn=FakeTimes(1), progress=False,
                  layouts=layouts)
    net = Gained(seq_net())
    seen = []
    net.register_forward_pre_hook(lambda mod, args: seen.append((args[0].shape, args[1].shape)))
    before = net.eval()(x, extra)
    net.train()
    seen.clear()
    report = mf.autoselect(net, (x, extra), cache=path, measure_fn=_no_timing, progress=False, layouts=layouts)
    assert not report.layouts and seen
    probe_x = x[:, :tuner.PROBE].shape
    assert all(s == (probe_x, extra.shape if second == "gain" else probe_x) for s in seen), seen
    torch.testing.assert_close(net.eval()(x, extra), before)


class _DictInput(nn.Module):
    """A network fed a dict (a batch as a data loader may give it)."""

    def __init__(self):
        super().__init__()
        self.body = seq_net()

    def forward(self, batch):
        return self.body(batch["x"])


def test_a_dict_input_keys_its_tensors(tmp_path):
    """The tensors inside a dict input are part of the keys (they were not: a plan timed on one batch
    shape was taken for any other), and an empty one is refused."""
    path = str(tmp_path / "c.json")
    net = _DictInput()
    first = FakeTimes(1)
    with pytest.warns(UserWarning, match="run in layout 'time_last'"):  # the boundary needs a tensor
        mf.autoselect(net, {"x": example(n=5)}, cache=path, measure_fn=first, progress=False)
    again = FakeTimes(2)
    mf.autoselect(net, {"x": example(n=5)}, cache=path, measure_fn=again, progress=False)
    assert first.calls > 0 and again.calls == 0
    other = FakeTimes(3)
    with pytest.warns(UserWarning, match="run in layout 'time_last'"):
        mf.autoselect(net, {"x": example(n=7)}, cache=path, measure_fn=other, progress=False)
    assert other.calls > 0  # another shape: timed, not taken from the first
    with pytest.raises(ValueError, match="empty tensor"):
        mf.autoselect(net, {"x": example(n=0)}, cache=False, measure_fn=FakeTimes(), progress=False)


def test_cached_plan_is_checked_on_the_whole_batch_when_the_samples_disagree(tmp_path):
    path = str(tmp_path / "c.json")
    x = example(n=9)
    time_first = dict(layouts=("time_first",), cache=path, progress=False)  # (N on dim 1)
    r1 = mf.autoselect(_Reconfigured("few_samples"), x, measure_fn=FakeTimes(2), **time_first)
    assert r1.layout is not None
    net = _Reconfigured("few_samples")  # other weights: its state was never checked
    batches = []
    net.register_forward_pre_hook(lambda mod, args: batches.append(args[0].shape[1]))
    report = mf.autoselect(net, x, measure_fn=_no_timing, **time_first)
    assert not report.layouts and (report.layout, report.methods) == (r1.layout, r1.methods)
    assert tuner.PROBE in batches and x.shape[1] in batches


def _register_broken():
    def broken(x, weight, bias, dilation, layout):
        return torch.zeros(x.shape, dtype=x.dtype) + 0 * weight.sum()  # wrong, but runs
    ops.register(ops.Implementation("broken", "torch", ("time_first",), broken, "a wrong implementation"))


def test_cached_plan_that_does_not_reproduce_the_outputs_is_measured_again(tmp_path):
    _register_broken()
    try:
        path = str(tmp_path / "c.json")
        net, x = seq_net(), example()
        ref = eval_out(net, x)
        slow_broken = FakeTimes(3)

        def fake(module, args, m):
            return 1e3 if getattr(module, "method", None) == "broken" else slow_broken(module, args, m)
        mf.autoselect(seq_net(), x, cache=path, measure_fn=fake, progress=False, layouts=("time_first",))
        key, plan = _stored_plan(path)
        neurons = [n for n, m in net.named_modules() if isinstance(m, MulFreeChannelwisePSN)]
        assert all(plan["methods"][n] != "broken" for n in neurons)
        plan["methods"].update(dict.fromkeys(neurons, "broken"))  # as if the stored choice had gone wrong
        data = json.loads(open(path).read())
        data["plans"][key] = plan
        open(path, "w").write(json.dumps(data))
        calls = slow_broken.calls
        report = mf.autoselect(net, x, cache=path, measure_fn=fake, progress=False, layouts=("time_first",))
        assert report.layouts and slow_broken.calls == calls  # measured again (from the per-layer cache)
        assert not any(m.method == "broken" for m in net.modules() if isinstance(m, MulFreeChannelwisePSN))
        torch.testing.assert_close(eval_out(net, x), ref)
    finally:
        ops.unregister("broken")


@pytest.mark.parametrize("damage", ["layout", "method", "plain_layer", "totals"])
def test_damaged_cached_plan_is_measured_again(tmp_path, damage):
    path = str(tmp_path / "c.json")
    net, x = seq_net(), example()
    ref = eval_out(net, x)
    mf.autoselect(seq_net(), x, cache=path, measure_fn=FakeTimes(4), progress=False)
    key, plan = _stored_plan(path)
    neuron_name = next(n for n, m in net.named_modules() if isinstance(m, MulFreeChannelwisePSN))
    plain_name = next(n for n, m in net.named_modules() if isinstance(m, nn.Linear))
    if damage == "layout":
        plan["layout"] = "sideways"
    elif damage == "method":
        plan["methods"][neuron_name] = "no_such_method"
    elif damage == "plain_layer":
        plan["methods"][plain_name] = "conv1d"
    else:
        plan["totals"] = {"time_first": "fast"}
    data = json.loads(open(path).read())
    data["plans"][key] = plan
    open(path, "w").write(json.dumps(data))
    report = mf.autoselect(net, x, cache=path, measure_fn=FakeTimes(4), progress=False)
    assert report.layouts and report.layout in ("time_first", "time_last")
    assert not hasattr(dict(net.named_modules())[plain_name], "method")
    torch.testing.assert_close(eval_out(net, x), ref)


def test_plan_stored_under_other_library_versions_is_not_used(tmp_path, monkeypatch):
    path = str(tmp_path / "c.json")
    mf.autoselect(seq_net(), example(), cache=path, measure_fn=FakeTimes(5), progress=False)
    monkeypatch.setattr(mf, "__version__", mf.__version__ + "+other")  # this plugin upgraded
    fake = FakeTimes(5)
    report = mf.autoselect(seq_net(), example(), cache=path, measure_fn=fake, progress=False)
    assert report.layouts and fake.calls > 0  # neither the plan nor the per-layer timings were reused


# ------------------------------------------------------------------ measure
class ScriptedClock:
    """A timer under which the timed sections of ``measure`` (each a forward, or a backward, read as a start
    and an end) take ``sections[i]`` seconds in turn; ``reads`` counts the clock reads."""

    def __init__(self, sections):
        self.sections, self.reads = list(sections), 0

    def __call__(self):
        section, end = divmod(self.reads, 2)
        self.reads += 1
        return 1000.0 * section + (self.sections[section] if end else 0.0)


def test_measure_is_the_mean_of_the_last_m_and_ignores_a_single_slow_run():
    # a warm-up slow in its backward (one-off costs), then four timed runs, one slowed down by noise
    clock = ScriptedClock([0.5, 8.5, 0.5, 0.5, 5.0, 5.0, 0.5, 0.5, 1.0, 1.0])
    t = tuner.measure(nn.Linear(3, 2), (torch.rand(4, 3),), m=2, timer=clock, abandon_above=3.0)
    assert t == pytest.approx(1.5) and clock.reads == 20


def test_measure_abandons_a_candidate_whose_timed_runs_all_lose():
    m = dict(m=2, abandon_above=3.0)
    # the warm-up's forward alone loses, and the next forward too: abandoned after two forwards, no backward
    clock = ScriptedClock([9.0, 4.0, 1.0, 1.0])
    t = tuner.measure(nn.Linear(3, 2), (torch.rand(4, 3),), timer=clock, **m)
    assert t == 4.0 and clock.reads == 4
    # a warm-up within the threshold, then a first timed forward that loses alone: no backward for it
    clock = ScriptedClock([1.0, 8.0, 4.0, 1.0])
    t = tuner.measure(nn.Linear(3, 2), (torch.rand(4, 3),), timer=clock, **m)
    assert t == 4.0 and clock.reads == 6
    # its forward alone does not lose, the run does
    clock = ScriptedClock([1.0, 8.0, 2.0, 2.0, 1.0, 1.0])
    t = tuner.measure(nn.Linear(3, 2), (torch.rand(4, 3),), timer=clock, **m)
    assert t == 4.0 and clock.reads == 8
    # a warm-up forward slowed by one-off costs alone: the next run warms up the backward, then it is timed
    clock = ScriptedClock([9.0, 1.0, 1.0] + [0.5, 0.5, 2.0, 3.0, 0.5, 0.5, 0.5, 0.5])
    t = tuner.measure(nn.Linear(3, 2), (torch.rand(4, 3),), timer=clock, **m)
    assert t == 1.0 and clock.reads == 22
    # a single slow timed run later on does not end it
    clock = ScriptedClock([1.0, 1.0, 1.0, 1.0, 5.0, 5.0, 0.5, 0.5, 0.5, 0.5])
    assert tuner.measure(nn.Linear(3, 2), (torch.rand(4, 3),), timer=clock, **m) == 1.0


class _RecordBackward(torch.autograd.Function):
    """Identity that records the gradients its backward gets."""
    grads = []

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _RecordBackward.grads.append(g.clone())
        return g


class _StructuredOut(nn.Module):
    """Returns (y, {"spikes": s, "steps": 6}): a backward must be seeded from both tensors."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x), {"spikes": _RecordBackward.apply(x), "steps": 6}


def test_measure_seeds_the_backward_of_every_tensor_of_a_structured_output():
    """A whole network's output may be a tuple or a dict (autoselect's compile timing measures the
    network): its backward ran for none of them, so only forward passes were timed. Each tensor's
    backward gets a gradient of ones."""
    module, x = _StructuredOut(), torch.rand(4, 3)
    _RecordBackward.grads = []
    reads = iter(range(100))
    tuner.measure(module, (x,), m=1, timer=lambda: float(next(reads)), input_grad=True)
    assert len(_RecordBackward.grads) == 3  # one backward per run, each reaching the dict's tensor too
    assert next(reads) == 12  # four clock reads per run: forward and backward timed
    assert all(torch.equal(g, torch.ones(4, 3)) for g in _RecordBackward.grads)
    torch.testing.assert_close(module.lin.weight.grad, 3 * torch.ones(2, 4) @ x)  # ones, three times


class _NoBackward(torch.autograd.Function):
    """Identity whose backward fails: a measurement that runs a backward shows."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise AssertionError("a backward ran")


class _Flat(nn.Module):
    def forward(self, x):
        return _NoBackward.apply(x).flatten(1)  # under no_grad a view of an input that requires grad


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_measure_without_gradients_times_the_forward_alone(mode):
    module, x = _Flat(), (torch.rand(4, 3, 2),)
    with pytest.raises(AssertionError, match="a backward ran"):
        tuner.measure(module, x, m=1)
    reads = iter([0.0, 1.0, 10.0, 12.0, 20.0, 23.0])  # two per run (forward only); a seventh read raises
    with getattr(torch, mode)():
        t = tuner.measure(module, x, m=1, timer=reads.__next__)
        t_view = tuner.measure(nn.Flatten(), x, m=1)  # its output a view of the cloned input
    assert t == 3.0 and next(reads, None) is None and t_view > 0


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_autoselect_without_gradients_times_forward_passes_apart_from_training(tmp_path, mode):
    path = str(tmp_path / "c.json")
    torch.manual_seed(0)
    net = seq_net()
    x = example()
    net(x)  # some running statistics
    functional.reset_net(net)
    net.eval()
    train_copy, before_out, before_state = copy.deepcopy(net).train(), eval_out(net, x), state_of(net)
    seeded = []  # a backward reaching any parameter
    hooks = [p.register_hook(lambda g: seeded.append(1)) for p in net.parameters()]
    with getattr(torch, mode)():
        report = mf.autoselect(net, x, m=1, cache=path, progress=False)
    for h in hooks:
        h.remove()
    assert report.forward_only and report.layout is not None and report.timed > 0 and not seeded
    assert "forward passes only" in str(report)
    after_state = state_of(net)
    for k in before_state:
        assert torch.equal(before_state[k], after_state[k]), k
    torch.testing.assert_close(eval_out(net, x), before_out)
    # Training's timings and plan are not the forward-only ones (nor the other way round).
    trained = mf.autoselect(train_copy, x, m=1, cache=path, progress=False)
    assert not trained.forward_only and trained.timed == report.timed and trained.cache_hits == report.cache_hits
    again = copy.deepcopy(net)
    with getattr(torch, mode)():
        hit = mf.autoselect(again, x, m=1, cache=path, progress=False)
    assert hit.timed == 0 and hit.layout == report.layout


def test_autoselect_under_autocast_checks_in_full_precision_and_keeps_its_timings_apart(tmp_path):
    path = str(tmp_path / "c.json")
    torch.manual_seed(0)
    net = seq_net()
    x = example()
    eval_out(net, x)  # (materialises the lazy neurons)
    selected, calls = copy.deepcopy(net), []  # (training, autocast) of every call of the network
    selected.register_forward_pre_hook(lambda mod, args: calls.append((mod.training, torch.is_autocast_enabled("cpu"))))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = mf.autoselect(selected, x, m=1, cache=path, progress=False)
    # The self-check (eval-mode calls) compares configurations in float32; the timings ran under autocast.
    assert set(calls) == {(True, True), (False, False)}
    assert report.layout is not None and report.timed > 0 and not report.skipped
    fp32 = mf.autoselect(copy.deepcopy(net), x, m=1, cache=path, progress=False)
    assert fp32.timed == report.timed  # bf16 timings are not float32's
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hit = mf.autoselect(copy.deepcopy(net), x, m=1, cache=path, progress=False)
    assert hit.timed == 0 and hit.layout == report.layout


class PreferMethod(FakeTimes):
    """FakeTimes where one method is ten times faster than anything else."""

    def __init__(self, method):
        super().__init__(0)
        self.method = method

    def __call__(self, module, args, m):
        t = super().__call__(module, args, m)
        return t / 10 if getattr(module, "method", None) == self.method else t


@pytest.mark.skipif("cpp" not in ops.names(), reason="backend 'cpp' needs a C++ compiler")
def test_second_call_after_another_backend_was_chosen_applies_the_cached_plan(tmp_path):
    """Choosing a method of another backend ('cpp') changes the neurons' backend; the next call on the
    same network still finds the stored plan."""
    path = str(tmp_path / "c.json")
    net, x = seq_net(), example()
    r1 = mf.autoselect(net, x, cache=path, measure_fn=PreferMethod("cpp"), progress=False)
    neurons = [m for m in net.modules() if isinstance(m, MulFreeChannelwisePSN)]
    assert neurons and all(m.method == "cpp" and m.backend == "cpp" for m in neurons)
    r2 = mf.autoselect(net, x, cache=path, measure_fn=_no_timing, progress=False)
    assert r2.timed == 0 and (r2.layout, r2.methods) == (r1.layout, r1.methods)


def test_second_call_on_a_net_already_running_the_plan_runs_no_forward(tmp_path):
    """The same network, already configured by the stored plan: applied again without any forward
    pass; a copy of it left in another configuration is checked (forward passes) before it is trusted."""
    path = str(tmp_path / "c.json")
    net, x = seq_net(), example()
    r1 = mf.autoselect(net, x, cache=path, measure_fn=FakeTimes(0, {"time_last": 0.1}), progress=False)
    calls = _count_forwards(net)
    r2 = mf.autoselect(net, x, cache=path, measure_fn=_no_timing, progress=False)
    assert not calls and (r2.layout, r2.methods) == (r1.layout, r1.methods) and r2.cache_hits
    other = seq_net()
    calls = _count_forwards(other)
    r3 = mf.autoselect(other, x, cache=path, measure_fn=_no_timing, progress=False)
    assert calls and (r3.layout, r3.methods) == (r1.layout, r1.methods)


def test_a_copy_in_a_state_the_plan_was_checked_on_runs_no_forward(tmp_path):
    """A new copy of a network whose parameters and buffers are bit for bit those the stored plan was
    checked on (the next run of a seeded script) gets the plan without a forward pass; a copy with other
    weights is checked first, and then a copy of that one needs no check either."""
    import copy
    path = str(tmp_path / "c.json")
    net, x = seq_net(), example()
    eval_out(net, x)  # materialise the lazy neurons
    same, other = copy.deepcopy(net), copy.deepcopy(net)
    with torch.no_grad():
        next(other.parameters()).add_(0.01)
    other_copy = copy.deepcopy(other)
    r1 = mf.autoselect(net, x, cache=path, measure_fn=FakeTimes(0, {"time_last": 0.1}), progress=False)
    calls = _count_forwards(same)
    r2 = mf.autoselect(same, x, cache=path, measure_fn=_no_timing, progress=False)
    assert not calls and (r2.layout, r2.methods) == (r1.layout, r1.methods) and r2.cache_hits
    assert current_layout(same) == r1.layout
    torch.testing.assert_close(eval_out(same, x), eval_out(net, x))

    calls = _count_forwards(other)
    r3 = mf.autoselect(other, x, cache=path, measure_fn=_no_timing, progress=False)
    assert calls and (r3.layout, r3.methods) == (r1.layout, r1.methods)  # checked: forward passes
    calls = _count_forwards(other_copy)
    r4 = mf.autoselect(other_copy, x, cache=path, measure_fn=_no_timing, progress=False)
    assert not calls and (r4.layout, r4.methods) == (r1.layout, r1.methods)  # that state is on record now


@pytest.mark.parametrize("edit", ["plan", "record", "garbage"])
def test_an_edited_plan_or_record_is_checked_again(tmp_path, edit):
    """The record of a checked state binds the plan's own choice: an edited plan, a record that is not
    this state's, or a damaged record list all take the checked path (forward passes), never a blind one."""
    import copy
    path = str(tmp_path / "c.json")
    net, x = seq_net(), example()
    eval_out(net, x)  # materialise the lazy neurons
    same = copy.deepcopy(net)
    mf.autoselect(net, x, cache=path, measure_fn=FakeTimes(0, {"time_last": 0.1}), progress=False)
    key, plan = _stored_plan(path)
    assert isinstance(plan["checked"], list) and len(plan["checked"]) == 1
    if edit == "plan":
        neuron_name = next(n for n, m in same.named_modules() if isinstance(m, MulFreeChannelwisePSN))
        others = [c for c in ops.candidate_names(plan["layout"]) if c != plan["methods"][neuron_name]]
        plan["methods"][neuron_name] = others[0]
    elif edit == "record":
        plan["checked"] = ["0" * 64]
    else:
        plan["checked"] = [3, None, {"a": 1}]
    data = json.loads(open(path).read())
    data["plans"][key] = plan
    open(path, "w").write(json.dumps(data))
    calls = _count_forwards(same)
    report = mf.autoselect(same, x, cache=path, measure_fn=FakeTimes(0, {"time_last": 0.1}), progress=False)
    assert calls and report.layout in ("time_first", "time_last")
    torch.testing.assert_close(eval_out(same, x), eval_out(net, x))


def test_a_network_without_a_digest_still_stores_and_checks_its_plan(tmp_path, monkeypatch):
    """Where no digest is taken (e.g. CUDA tensors), the plan is stored as before and every new copy is
    checked with forward passes."""
    import copy
    monkeypatch.setattr(tuner, "state_digest", lambda net: None)
    path = str(tmp_path / "c.json")
    net, x = seq_net(), example()
    eval_out(net, x)  # materialise the lazy neurons
    same = copy.deepcopy(net)
    r1 = mf.autoselect(net, x, cache=path, measure_fn=FakeTimes(0, {"time_last": 0.1}), progress=False)
    _, plan = _stored_plan(path)
    assert "checked" not in plan
    calls = _count_forwards(same)
    r2 = mf.autoselect(same, x, cache=path, measure_fn=_no_timing, progress=False)
    assert calls and (r2.layout, r2.methods) == (r1.layout, r1.methods)


def test_state_digest_sees_every_parameter_and_buffer():
    import copy
    net = seq_net()
    eval_out(net, example())
    d0 = tuner.state_digest(net)
    assert tuner.state_digest(copy.deepcopy(net)) == d0
    for name, t in list(net.named_parameters()) + list(net.named_buffers()):
        if not t.numel() or not t.dtype.is_floating_point:
            continue
        with torch.no_grad():
            old = t.view(-1)[-1].item()
            t.view(-1)[-1] = old + 1.0
            assert tuner.state_digest(net) != d0, name
            t.view(-1)[-1] = old
        assert tuner.state_digest(net) == d0
    assert tuner.state_digest(nn.Linear(2, 2, device="meta")) is None


def test_fused_kernels_are_timed_first_then_the_layers_default():
    """The order candidates are timed in: a fast first time lets the slow ones be abandoned early."""
    x = torch.rand(6, 3, 4)
    sn, lin = MulFreeChannelwisePSN(4, k=2, step_mode="m"), layer.Linear(4, 2, step_mode="m")
    default = sn.resolve_method(x)  # (method 'auto')
    timed = []

    def record(module, args, m):
        timed.append((module, getattr(module, "method", "-")))
        return 1.0

    mf.autoselect(nn.Sequential(sn, lin), x, layouts=("time_first",), cache=False, measure_fn=record, progress=False)
    order = [method for module, method in timed if module is sn]
    assert sorted(order) == sorted(sn.candidate_methods)
    fused = [c for c in order if ops.get(c).backend != "torch"]
    assert order[:len(fused)] == fused  # every non-torch backend's kernel first ('cpp' here when built)
    assert order[len(fused)] == default  # then the layer's own default ('shift_add')
    if "cpp" in ops.names():
        assert order[0] == "cpp"
    assert [method for module, method in timed if module is lin] == ["-"]


@pytest.mark.parametrize("progress,bar", [(None, False), (True, True), (False, False)])
def test_progress_bar_only_on_a_terminal_by_default(progress, bar, tmp_path):
    """stderr here is not a terminal (a log file, CI): the default shows no bar; progress=True does."""
    import subprocess
    import sys
    import textwrap
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = textwrap.dedent(f"""
        import torch, torch.nn as nn
        import spikingjelly_mfpsn as mf
        from spikingjelly.activation_based import functional, layer
        net = nn.Sequential(layer.Linear(4, 4), mf.MulFreeChannelwisePSN(4, k=2), layer.Linear(4, 2))
        functional.set_step_mode(net, 'm')
        mf.autoselect(net, torch.rand(4, 3, 4), cache=False, progress={progress!r}, layouts=('time_first',))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert ("autoselect time_first" in out.stderr) is bar, out.stderr[-2000:]


def test_autoselect_leaves_accumulated_gradients_as_they_were():
    """Regression: the first restore handed the saved gradient itself back to ``.grad``; the next timed
    backward accumulated into it in place, so every later restore put back a sum of timing runs (a
    bias gradient went from 2e-7 to 450), silently, in the middle of a gradient accumulation."""
    torch.manual_seed(0)
    net = nn.Sequential(layer.Conv1d(2, 4, 3, padding=1), layer.BatchNorm1d(4), MulFreeChannelwisePSN(4, k=3),
                        layer.Flatten(), layer.Linear(4 * 5, 3))
    functional.set_step_mode(net, "m")
    x = torch.randn(6, 3, 2, 5)
    net(x).sum().backward()
    functional.reset_net(net)
    before = {n: p.grad.clone() for n, p in net.named_parameters()}
    mf.autoselect(net, x, cache=False, progress=False, layouts=("time_first",))
    assert all(torch.equal(p.grad, before[n]) for n, p in net.named_parameters())


# ------------------------------------------------------------------ what autoselect leaves as it was

def _fast(net, x, **kw):
    return mf.autoselect(net, x, m=1, progress=False, layouts=("time_first",), measure_fn=lambda *a: 1.0,
                         **{"cache": False, **kw})


def _with_dropout():
    net = nn.Sequential(layer.Conv1d(2, 4, 3, padding=1), layer.BatchNorm1d(4), MulFreeChannelwisePSN(k=2),
                        layer.Dropout(0.5), layer.Flatten(), layer.Linear(20, 3))
    functional.set_step_mode(net, "m")
    return net


@pytest.mark.parametrize("top", [True, False])
def test_autoselect_keeps_every_module_in_its_own_mode(top):
    """A frozen batch norm (eval inside a training network) came back training, and an eval network's
    dropout kept in training came back in eval: the output check put every module in the top's mode."""
    net = _with_dropout().train(top)
    net[1 if top else 3].train(not top)
    before = [m.training for m in net.modules()]
    _fast(net, torch.rand(6, 5, 2, 5))
    assert [m.training for m in net.modules()] == before


def test_a_first_and_a_cached_autoselect_leave_the_random_state_alike(tmp_path):
    """A seeded script drew other numbers after a first (timing, dropout drawing) autoselect than after a
    cached one, which times nothing."""
    draws = []
    for _ in range(2):
        torch.manual_seed(0)
        net = _with_dropout()
        x = torch.rand(6, 5, 2, 5)
        _fast(net, x, cache=str(tmp_path / "c.json"))
        draws.append(torch.rand(3))
    torch.manual_seed(0)
    _with_dropout(), torch.rand(6, 5, 2, 5)
    assert torch.equal(draws[0], draws[1]) and torch.equal(draws[0], torch.rand(3))


class _RunningInputMean(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(8), persistent=False)
        self.register_buffer("one", torch.ones(1).expand(8), persistent=False)  # (a constant, stride 0)

    def forward(self, x):
        if self.training:
            self.mean.mul_(0.9).add_(0.1 * x.detach().mean((0, 1)))
        return x * self.one


def test_autoselect_puts_back_non_persistent_buffers_and_leaves_expanded_ones():
    """A non-persistent buffer (left out of the state dict) kept the values of the timing runs, and an
    expanded constant buffer made the restore fail ("more than one element of the written-to tensor")."""
    net = nn.Sequential(_RunningInputMean(), layer.Linear(8, 4), MulFreeChannelwisePSN(k=2))
    functional.set_step_mode(net, "m")
    _fast(net, torch.rand(6, 5, 8))
    assert torch.equal(net[0].mean, torch.zeros(8))


def test_an_inference_autoselect_leaves_gradients_training_can_accumulate_into():
    """Under torch.inference_mode the gradients put back were inference tensors: the next backward of a
    gradient accumulation failed with "Inplace update to inference tensor outside InferenceMode"."""
    net = _with_dropout()
    x = torch.rand(6, 5, 2, 5)
    net(x).sum().backward()
    functional.reset_net(net)
    before = {n: p.grad.clone() for n, p in net.named_parameters()}
    with torch.inference_mode():
        _fast(net, x)
    net(x).sum().backward()
    assert all(not p.grad.is_inference() and not torch.equal(p.grad, before[n]) for n, p in net.named_parameters())


def test_autoselect_keeps_the_users_own_compile():
    """net.compile() was undone (the network ran eager afterwards) by every autoselect."""
    net = _with_dropout()
    net.compile(backend="eager")
    compiled = net._compiled_call_impl
    _fast(net, torch.rand(6, 5, 2, 5))
    assert net._compiled_call_impl is compiled


def test_a_network_whose_outputs_hold_nan_gets_a_plan():
    """NaN outputs never matched themselves: every configuration "did not reproduce the outputs"."""
    class NanHead(nn.Module):
        def forward(self, x):
            return torch.cat([x, torch.full_like(x[..., :1], math.nan)], -1)

    net = nn.Sequential(layer.Linear(8, 4), MulFreeChannelwisePSN(k=2), NanHead())
    functional.set_step_mode(net, "m")
    assert _fast(net, torch.rand(6, 5, 8)).layout == "time_first"


def test_the_cache_takes_a_path_object_a_symlink_and_keeps_the_files_mode(tmp_path):
    """cache=pathlib.Path(...) failed when saving, after all the timing; a symlinked cache was replaced by
    a file, and a shared (0664) cache became 0600."""
    target = tmp_path / "shared" / "c.json"
    target.parent.mkdir()
    target.write_text("{}")
    target.chmod(0o664)
    link = tmp_path / "c.json"
    link.symlink_to(target)
    with pytest.warns(UserWarning, match="rebuilt|not what autoselect writes|cannot be read"):
        _fast(_with_dropout(), torch.rand(6, 5, 2, 5), cache=link)
    assert link.is_symlink() and json.loads(target.read_text())["plans"]
    assert target.stat().st_mode & 0o777 == 0o664


def test_a_huge_integer_in_the_cache_is_dropped_with_a_warning(tmp_path):
    """A valid JSON integer beyond a float's range raised OverflowError instead of being dropped."""
    path = tmp_path / "c.json"
    _fast(_with_dropout(), torch.rand(6, 5, 2, 5), cache=str(path))
    data = json.loads(path.read_text())
    key = next(iter(data["layers"]))
    method = next(iter(data["layers"][key]))
    path.write_text(json.dumps(data).replace(f'"{method}": ', f'"{method}": 1{"0" * 400}, "x": ', 1))
    with pytest.warns(UserWarning, match="not what autoselect writes"):
        _fast(_with_dropout(), torch.rand(6, 5, 2, 5), cache=str(path))


def test_an_empty_xdg_cache_home_means_the_default(monkeypatch):
    """XDG_CACHE_HOME='' put the autoselect cache and the C++ build in the current directory."""
    monkeypatch.delenv(tuner.CACHE_ENV, raising=False)
    monkeypatch.delenv("SPIKINGJELLY_MFPSN_BUILD", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    home = os.path.expanduser("~/.cache")
    assert tuner.default_cache_path() == os.path.join(home, "spikingjelly_mfpsn", "autoselect.json")
    assert str(ops.cpp_ops.build_dir()).startswith(os.path.join(home, "spikingjelly_mfpsn"))


def test_bad_arguments_are_refused_before_any_timing(monkeypatch):
    """Each of these failed with an unrelated error, or only after every layer was timed."""
    timed = []

    def count(*args):
        timed.append(1)
        return 1.0

    for kwargs, error, match in [(dict(layouts="time_first"), ValueError, "layouts must be a tuple or list"),
                                 (dict(layouts=None), ValueError, "layouts must be a tuple or list"),
                                 (dict(compile="nope"), ValueError, "compile must be True, False or a torch.compile"),
                                 (dict(x_example=example().to("meta")), ValueError, "x_example is on the meta device"),
                                 (dict(net=lambda x: x), TypeError, "net must be a torch.nn.Module")]:
        kwargs = {"net": seq_net(), "x_example": example(), **kwargs}
        with pytest.raises(error, match=match):
            mf.autoselect(cache=False, measure_fn=count, progress=False, **kwargs)
    # (inf waited for ever for a stuck lock; nan and negative values were taken as 0; '' turned the cache off,
    # and a NUL in the path failed unnamed)
    for value in ("10s", "inf", "nan", "-3"):
        monkeypatch.setenv(tuner.LOCK_TIMEOUT_ENV, value)
        with pytest.raises(ValueError, match="LOCK_TIMEOUT must be a finite number of seconds >= 0"):
            mf.autoselect(seq_net(), example(), measure_fn=count, progress=False)
    monkeypatch.delenv(tuner.LOCK_TIMEOUT_ENV)
    for cache in ("", "a\0b.json"):
        with pytest.raises(ValueError, match="cache must be True, False or a path, got"):
            mf.autoselect(seq_net(), example(), measure_fn=count, progress=False, cache=cache)
    assert not timed


def test_a_read_only_cache_is_kept_and_killed_saves_leave_no_files(tmp_path, monkeypatch):
    """A cache frozen with chmod a-w was replaced (renamed over) without a word; temporary files of saves
    killed midway stayed for ever; a '~' in the path made a folder named '~'."""
    path = tmp_path / "c.json"
    _fast(_with_dropout(), torch.rand(6, 5, 2, 5), cache=str(path))
    frozen = path.read_bytes()
    path.chmod(0o444)
    with pytest.warns(UserWarning, match="cannot be written .*read-only"):
        _fast(seq_net(), example(), cache=str(path))
    assert path.read_bytes() == frozen
    path.chmod(0o644)
    (tmp_path / ".c.json.123-abc.tmp").write_text("{")  # (a save killed before its rename)
    _fast(seq_net(), example(), cache=str(path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json", "c.json.lock"]
    monkeypatch.setenv("HOME", str(tmp_path))
    _fast(seq_net(), example(), cache="~/tilde.json")
    assert (tmp_path / "tilde.json").is_file()


class _KeywordGain(nn.Module):
    def forward(self, x, *, gain):
        return x * gain


class _InPlaceAndKeyword(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.relu = layer.Linear(8, 6, step_mode="m"), nn.ReLU(inplace=True)
        self.gain, self.sn = _KeywordGain(), MulFreeChannelwisePSN(6, k=2, step_mode="m")

    def forward(self, x):
        return self.sn(self.gain(self.relu(self.fc(x)), gain=torch.full((6,), 2.0)))


def test_layers_timed_as_the_network_calls_them_in_place_or_with_keywords():
    """A valid network made the whole autoselect fail ("no candidate of layer ... could run"): an
    in-place layer was timed on a leaf input that requires grad, and a layer called with a keyword
    argument was timed without it."""
    net = _InPlaceAndKeyword()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = mf.autoselect(net, torch.rand(4, 3, 8), m=1, cache=False, progress=False, layouts=("time_first",))
    rows = {r.name: r for r in report.layouts["time_first"]}
    assert set(rows) == {"fc", "relu", "gain", "sn"} and not report.skipped
    assert all(math.isfinite(t) for r in rows.values() for t in r.times.values())


class _ThroughNumpy(nn.Module):
    """Runs on data, not on a tensor that requires grad (as the network's first layer it gets data)."""

    def forward(self, x):
        return torch.from_numpy(x.numpy() * 2)


def test_a_layer_that_cannot_be_timed_alone_is_left_out_of_the_total_with_a_warning():
    """Such a layer (no choice of method to make) made the whole autoselect fail."""
    net = nn.Sequential(_ThroughNumpy(), layer.Linear(8, 6, step_mode="m"), MulFreeChannelwisePSN(6, k=2, step_mode="m"))
    x = torch.rand(4, 3, 8)
    with pytest.warns(UserWarning, match=r"layer '0' \(_ThroughNumpy\) cannot be timed on its own"):
        report = mf.autoselect(net, x, m=1, cache=False, progress=False, layouts=("time_first",))
    rows = report.layouts["time_first"]
    assert report.totals["time_first"] == sum(r.times[r.choice] for r in rows[1:]) > 0
    assert any("numpy" in s for s in report.skipped) and report.methods["2"] != "-"


def test_timings_are_kept_per_cpu_model(tmp_path, monkeypatch):
    """The CPU's key was its architecture alone (Linux's ``platform.processor()`` is empty): a cache on a
    shared home directory gave one machine another model's timings."""
    import builtins
    real_open = builtins.open

    def cpuinfo_of(model):
        def fake_open(path, *args, **kwargs):
            if str(path) == "/proc/cpuinfo":
                return io.StringIO(f"processor\t: 0\nmodel name\t: {model}\n\n")
            return real_open(path, *args, **kwargs)
        return fake_open

    path, x = str(tmp_path / "c.json"), example()
    counts = []
    for model in ("CPU model one", "CPU model two", "CPU model one"):
        monkeypatch.setattr(builtins, "open", cpuinfo_of(model))
        fake = FakeTimes()
        mf.autoselect(seq_net(), x, cache=path, measure_fn=fake, progress=False)
        counts.append(fake.calls)
    assert counts[0] > 0 and counts[1] > 0 and counts[2] == 0


def test_a_neuron_that_normalises_its_input_gets_timings_of_its_own(tmp_path):
    """The layer key did not see a fused input batch norm: the fused neuron (more work; on CUDA triton
    fuses it and the others do not) took the plain neuron's cached timings."""
    path, x = str(tmp_path / "c.json"), torch.rand(6, 3, 2, 5)
    plain, fused = _with_dropout(), _with_dropout()
    mf.fuse_batchnorm(fused)
    mf.autoselect(plain, x, cache=path, measure_fn=FakeTimes(), progress=False, layouts=("time_first",))
    report = mf.autoselect(fused, x, cache=path, measure_fn=FakeTimes(), progress=False, layouts=("time_first",))
    row = next(r for r in report.layouts["time_first"] if r.kind == "MulFreeChannelwisePSN")
    assert not row.cached and "input_bn=BatchNorm1d" in repr(fused[2])
