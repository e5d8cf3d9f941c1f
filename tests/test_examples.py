"""The paper's network builders, the data readers and the example training scripts.

The scripts run as subprocesses at tiny sizes (a few hundred digits, a tiny SHD file written here) and
must learn: the training loss falls and the test accuracy beats chance by a wide margin.
"""
import argparse
import gzip
import io
import json
import os
import pickle
import re
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import torch

from spikingjelly.activation_based import functional, neuron as sj_neuron

from spikingjelly_mfpsn import MulFreeChannelwisePSN
from spikingjelly_mfpsn.paper import data, models

import sj

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
NEURONS = [pytest.param(n, marks=pytest.mark.skipif(
    n in ("psn", "sliding_psn") and not models.psn_available(n),
    reason=f"SpikingJelly {sj.VERSION} has no PSN family (PSN/SlidingPSN exist only in 2.x)"))
    for n in models.NEURONS]

# builder -> (kwargs for a tiny network, input shape (T, N, ...), expected output T)
TINY = {
    "sequential_cifar": (dict(in_channels=3, height=8, num_classes=10, T=6, channels=8, hidden=16), (6, 3, 3, 8), 6),
    "pixel_cifar": (dict(in_channels=3, num_classes=10, T=10, widths=(8, 16), blocks=1), (10, 3, 3), 3),
    "shd": (dict(in_features=12, num_classes=20, T=7, hidden=16, layers=3, delays=False), (7, 3, 12), 7),
    "dvs_lip": (dict(in_channels=2, num_classes=100, T=3, widths=(4, 4, 8, 8)), (3, 2, 2, 8, 8), 3),
}


# ----------------------------------------------------------------------------------------- builders

@pytest.mark.parametrize("script,args,says", [
    ("train_sequential.py", ["--neuron", "lif", "--layout", "time_last", "--method", "conv1d", "--limit-train", "8",
                             "--limit-test", "8", "--epochs", "1"], "--layout time_last: cannot convert"),
    ("mulfree_inference.py", ["--nir", "."], "--nir . is a folder"),
    ("energy_table5.py", ["--batch", "0"], "--batch must be >= 1"),
    ("energy_table5.py", ["--calibrate", "-1"], "--calibrate >= 0"),
    ("energy_table5.py", ["--firing-rate", "-0.5"], "--firing-rate must be in [0, 1]"),
    ("mulfree_inference.py", ["--batch", "0"], "--batch must be >= 1"),
])
def test_the_scripts_refuse_bad_arguments(script, args, says, tmp_path):
    """--batch 0 printed 'equal spikes nan', a negative one a traceback, a negative firing rate a
    negative energy; a time-last layout for a network without a time-last form failed with a traceback
    after building it; --nir naming a folder failed after the run."""
    if script.startswith("train"):
        args = [*args, "--out-dir", str(tmp_path / "run"), "--no-progress"]
    r = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), *args], capture_output=True, text=True,
                       env=_env(), timeout=120)
    assert r.returncode == 2 and says in r.stderr, (r.returncode, r.stdout[-500:], r.stderr[-500:])


@pytest.mark.parametrize("script", ["train_sequential", "train_shd"])
@pytest.mark.parametrize("device", ["bogus", "meta:x", "cuda:one past the last"])
def test_a_device_that_is_not_here_is_refused_by_the_argument_check(script, device, capsys, tmp_path):
    """--device naming no device type, or one this machine has no (or too few) of, exits with the
    option's name and torch's reason instead of a traceback after building the network."""
    if device.startswith("cuda"):
        device = f"cuda:{torch.cuda.device_count()}"  # never here, whatever the machine has
    module = _import_example(script)
    data_dir = _data_argv(script, "shd", "ok", tmp_path) if script == "train_shd" else []  # (checked too)
    with pytest.raises(SystemExit):
        module.parse_args(["--device", device, *data_dir])
    assert f"--device {device}: cannot put a tensor there" in capsys.readouterr().err
    assert module.parse_args(["--device", "cpu", *data_dir]).device == "cpu"


@pytest.mark.parametrize("script", ["train_sequential", "train_shd"])
def test_the_meta_device_is_refused_by_the_argument_check(script, capsys, tmp_path):
    """--device meta passed the check and failed with a raw torch error once the first batch was read."""
    module = _import_example(script)
    data_dir = _data_argv(script, "shd", "ok", tmp_path) if script == "train_shd" else []
    with pytest.raises(SystemExit):
        module.parse_args(["--device", "meta", *data_dir])
    assert "--device meta: a meta tensor holds no data" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(TINY))
@pytest.mark.parametrize("neuron", NEURONS)
def test_builder_forward_backward(name, neuron):
    kwargs, shape, t_out = TINY[name]
    torch.manual_seed(0)
    net = models.build(name, neuron=neuron, **kwargs)
    x = torch.rand(shape)
    y = net(x)
    assert y.shape == (t_out, shape[1], kwargs["num_classes"])
    assert torch.isfinite(y).all()
    y.sum().backward()
    first = next(net[0].parameters())
    assert first.grad is not None and first.grad.abs().sum() > 0  # the gradient reaches the input layer
    functional.reset_net(net)
    assert models.spiking_layers(net), "the network has no spiking layer"
    kinds = {type(m) for m in models.spiking_layers(net)}
    if neuron == "mfpsn":
        assert kinds == {MulFreeChannelwisePSN}


def test_paper_sized_sequential_net_matches_the_table():
    """{{c128k3s1-BN-SN}*3-APk2s2}*2-FC256-SN-FC10 on 32x32 images."""
    net = models.sequential_image_net()
    convs = [m for m in net if isinstance(m, torch.nn.Conv1d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size, c.stride) for c in convs] == \
        [(3, 128, (3,), (1,))] + [(128, 128, (3,), (1,))] * 5
    fcs = [m for m in net if isinstance(m, torch.nn.Linear)]
    assert [(f.in_features, f.out_features) for f in fcs] == [(128 * 8, 256), (256, 10)]
    assert len(models.spiking_layers(net)) == 7


def _run_order(net, x):
    order = []
    hooks = [m.register_forward_hook(lambda m, i, o: order.append(m)) for m in models.spiking_layers(net)]
    net(x)
    for h in hooks:
        h.remove()
    return order


@pytest.mark.parametrize("name", sorted(TINY))
def test_sawtooth_dilations_follow_running_order(name):
    kwargs, shape, _ = TINY[name]
    net = models.build(name, neuron="mfpsn", k=2, **kwargs)
    ran = _run_order(net, torch.rand(shape))
    assert len(ran) == len(models.spiking_layers(net)) >= 3
    assert [m.dilation for m in ran] == [i % 3 + 1 for i in range(len(ran))]
    flat = models.build(name, neuron="mfpsn", k=3, sawtooth=False, **kwargs)
    assert {(m.dilation, m.k) for m in models.spiking_layers(flat)} == {(1, 3)}


@pytest.mark.parametrize("name", sorted(TINY))
def test_one_dilation_everywhere_takes_sawtooth_off(name):
    """dilation=d with sawtooth=False gives every MF-PSN dilation d; with the sawtooth on, and a step mode
    other than the builders' own, a clear error (a duplicate keyword TypeError before)."""
    kwargs, shape, _ = TINY[name]
    net = models.build(name, neuron="mfpsn", k=2, sawtooth=False, dilation=2, **kwargs)
    assert {m.dilation for m in models.spiking_layers(net)} == {2}
    assert net(torch.rand(shape)).isfinite().all()
    with pytest.raises(ValueError, match="sawtooth=False"):
        models.build(name, neuron="mfpsn", dilation=2, **kwargs)
    with pytest.raises(ValueError, match="set_step_mode"):
        models.build(name, neuron="mfpsn", step_mode="s", **kwargs)


def test_psn_choice_needs_spikingjelly_2():
    if models.psn_available("psn"):
        net = models.sequential_image_net(1, 8, T=5, neuron="psn", channels=4, hidden=8)
        assert all(isinstance(m, sj_neuron.PSN) for m in models.spiking_layers(net))
        with pytest.raises(ValueError, match="T"):
            models.sequential_image_net(1, 8, neuron="psn", channels=4, hidden=8)  # PSN needs T
    else:
        with pytest.raises(ValueError, match="SpikingJelly >= 2.0"):
            models.sequential_image_net(1, 8, T=5, neuron="psn")


def test_bad_builder_arguments_are_named():
    with pytest.raises(ValueError, match="neuron"):
        models.sequential_image_net(neuron="izhikevich")
    with pytest.raises(ValueError, match="height"):
        models.sequential_image_net(height=30)
    with pytest.raises(ValueError, match="k"):
        models.pixel_image_net(k=0)
    with pytest.raises(ValueError, match="name"):
        models.build("imagenet")


def test_any_spikingjelly_neuron_class():
    net = models.pixel_image_net(1, 10, widths=(8,), blocks=1, neuron=sj_neuron.IFNode)
    assert all(isinstance(m, sj_neuron.IFNode) for m in models.spiking_layers(net))
    assert net(torch.rand(5, 2, 1)).shape == (5, 2, 10)


def test_shd_net_uses_delays_only_when_asked_and_available():
    plain = models.shd_net(12, 20, hidden=8, delays=False)
    assert not any(isinstance(m, models.DelayedLinear) for m in plain.modules())
    if models.dcls_available():
        delayed = models.shd_net(12, 20, hidden=8, delays=True)
        assert sum(isinstance(m, models.DelayedLinear) for m in delayed.modules()) == 3
    else:
        with pytest.raises(ImportError, match="dcls"):
            models.shd_net(12, 20, hidden=8, delays=True)


# ------------------------------------------------------------------------------- time-mixing layers

@pytest.mark.parametrize("make, step", [
    (lambda: models.shd_net(10, 5, hidden=6, delays=False, neuron="lif"), torch.rand(2, 10)),
    (lambda: models.pixel_image_net(3, 5, widths=(4, 6), blocks=1, neuron="lif"), torch.rand(2, 3))])
def test_the_paper_networks_time_mixing_layers_refuse_single_steps(make, step):
    """set_step_mode(net, 's') skipped the layers that mix time steps (no step_mode), which then read the
    batch axis as time: the SHD net was off by 0.17, the pixel net averaged a batch of 2 into 1."""
    net = make().eval()
    functional.set_step_mode(net, "s")
    with pytest.raises(ValueError, match="mixes time steps and runs whole sequences only, but has step_mode='s'"):
        net(step)
    functional.set_step_mode(net, "m")
    functional.reset_net(net)
    assert net(step.unsqueeze(0).expand(8, -1, -1)).shape[1] == 2  # (the batch)


class MyPSN(MulFreeChannelwisePSN):
    pass


@pytest.mark.parametrize("cls", [MulFreeChannelwisePSN, MyPSN])
def test_the_neuron_factory_given_the_mfpsn_class_gives_its_order_and_sawtooth(cls):
    net = models.sequential_image_net(3, 8, 5, neuron=cls, k=4, channels=4, hidden=6)
    assert [(type(m), m.k, m.dilation) for m in net.modules() if isinstance(m, MulFreeChannelwisePSN)][:3] == \
        [(cls, 4, 1), (cls, 4, 2), (cls, 4, 3)]


def _both_layouts(module, x_time_first):
    module.layout = "time_first"
    a = module(x_time_first)
    module.layout = "time_last"
    b = module(x_time_first.movedim(0, -1)).movedim(-1, 0)
    module.layout = "time_first"
    torch.testing.assert_close(a, b)
    return a


def test_temporal_avg_pool_keeps_the_last_partial_window():
    x = torch.randn(10, 2, 3)
    y = _both_layouts(models.TemporalAvgPool(4), x)
    expected = torch.stack([x[0:4].mean(0), x[4:8].mean(0), x[8:10].mean(0)])
    torch.testing.assert_close(y, expected)


def test_membrane_readout_is_a_lif_that_never_fires():
    x = torch.randn(9, 2, 5)
    y = _both_layouts(models.MembraneReadout(tau=3.0), x)
    lif = sj_neuron.LIFNode(tau=3.0, v_threshold=1e9, step_mode="m", store_v_seq=True)
    assert lif(x).sum() == 0
    torch.testing.assert_close(y, lif.v_seq)


def test_temporal_conv3d_matches_conv3d_on_n_c_t_h_w():
    m = models.TemporalConv3d(2, 3, (3, 3, 3), (1, 2, 2), (1, 1, 1))
    x = torch.randn(5, 2, 2, 6, 6)
    y = _both_layouts(m, x)
    torch.testing.assert_close(y, m.conv(x.permute(1, 2, 0, 3, 4)).permute(2, 0, 1, 3, 4))


@pytest.mark.skipif(not models.dcls_available(), reason="the dcls package is not installed")
def test_delayed_linear_is_causal():
    torch.manual_seed(0)
    m = models.DelayedLinear(4, 3, max_delay=5)
    x = torch.randn(12, 2, 4)
    y = _both_layouts(m, x)
    x2 = x.clone()
    x2[7:] = torch.randn(5, 2, 4)  # change only the future of t = 6
    torch.testing.assert_close(m(x2)[:7], y[:7])
    assert not torch.allclose(m(x2)[7:], y[7:])


# ----------------------------------------------------------------------------------------- data

def _import_example(name):
    sys.path.insert(0, EXAMPLES)
    try:
        return __import__(name)
    finally:
        sys.path.remove(EXAMPLES)


def _cifar_batch(n, label_key, seed):
    rng = np.random.default_rng(seed)
    return {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            label_key: rng.integers(0, 10, n).tolist(), b"batch_label": b"test"}


def _write_cifar10(root, archive):
    """The python version of CIFAR-10: cifar-10-batches-py/{data_batch_1..5,test_batch}, pickled dicts."""
    batches = {f"data_batch_{i}": _cifar_batch(3, b"labels", i) for i in range(1, 6)}
    batches["test_batch"] = _cifar_batch(2, b"labels", 9)
    if archive:
        with tarfile.open(os.path.join(root, "cifar-10-python.tar.gz"), "w:gz") as tar:
            for name, batch in batches.items():
                raw = pickle.dumps(batch, protocol=2)
                info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
                info.size = len(raw)
                tar.addfile(info, io.BytesIO(raw))
    else:
        os.makedirs(os.path.join(root, "cifar-10-batches-py"))
        for name, batch in batches.items():
            with open(os.path.join(root, "cifar-10-batches-py", name), "wb") as f:
                pickle.dump(batch, f, protocol=2)
    return batches


@pytest.mark.parametrize("where", ["folder", "tar.gz", "the folder itself"])
def test_cifar10_reader(tmp_path, where):
    batches = _write_cifar10(str(tmp_path), archive=where == "tar.gz")
    data_dir = tmp_path / "cifar-10-batches-py" if where == "the folder itself" else tmp_path
    x_train, y_train, x_test, y_test = data.load_cifar(str(data_dir), "cifar10")
    assert x_train.shape == (15, 3, 32, 32) and x_test.shape == (2, 3, 32, 32)
    raw = batches["data_batch_2"][b"data"][1]  # sample 4 of the training set
    n, c, h, w = 4, 2, 5, 17
    assert x_train[n, c, h, w] == pytest.approx(raw[c * 1024 + h * 32 + w] / 255.0)
    assert y_train[3:6].tolist() == batches["data_batch_2"][b"labels"]
    assert y_test.tolist() == batches["test_batch"][b"labels"]


def test_cifar100_reader_uses_fine_labels(tmp_path):
    os.makedirs(tmp_path / "cifar-100-python")
    for name, n in (("train", 4), ("test", 2)):
        batch = _cifar_batch(n, b"fine_labels", n)
        batch[b"coarse_labels"] = [0] * n
        with open(tmp_path / "cifar-100-python" / name, "wb") as f:
            pickle.dump(batch, f)
    x_train, y_train, x_test, y_test = data.load_cifar(str(tmp_path), "cifar100")
    assert x_train.shape == (4, 3, 32, 32)
    assert y_test.tolist() == _cifar_batch(2, b"fine_labels", 2)[b"fine_labels"]


def test_missing_cifar_says_what_to_put_where(tmp_path, capsys):
    with pytest.raises(FileNotFoundError) as e:
        data.load_cifar(str(tmp_path), "cifar10")
    for words in ("cifar-10-python.tar.gz", "cifar-10-batches-py", str(tmp_path), "data_batch_1"):
        assert words in str(e.value)
    train_sequential = _import_example("train_sequential")
    with pytest.raises(SystemExit) as e:  # the script exits with a usage error, not a traceback
        train_sequential.main(["--dataset", "cifar100", "--data-dir", str(tmp_path), "--no-progress"])
    assert e.value.code == 2 and "cifar-100-python.tar.gz" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["garbage", "truncated", "not a dict", "truncated archive"])
def test_a_damaged_cifar_file_says_so(tmp_path, damage):
    """A damaged, truncated or foreign batch (or archive) raises DataError naming the file, and the
    script exits with that message (not an UnpicklingError traceback)."""
    _write_cifar10(str(tmp_path), archive=damage == "truncated archive")
    if damage == "truncated archive":
        path = tmp_path / "cifar-10-python.tar.gz"
        path.write_bytes(path.read_bytes()[:300])
        match = "cifar-10-python.tar.gz cannot be read as a .tar.gz archive"
    else:
        path = tmp_path / "cifar-10-batches-py" / "data_batch_3"
        raw = path.read_bytes()
        path.write_bytes({"garbage": b"\x00\x01garbage" * 10, "truncated": raw[:len(raw) // 2],
                          "not a dict": pickle.dumps([1, 2, 3])}[damage])
        match = "data_batch_3 is not a" + (" CIFAR python batch: it holds a list" if damage == "not a dict"
                                           else " readable CIFAR python batch")
    with pytest.raises(data.DataError, match=match):
        data.load_cifar(str(tmp_path), "cifar10")
    train_sequential = _import_example("train_sequential")
    with pytest.raises(SystemExit) as e:
        train_sequential.main(["--dataset", "cifar10", "--data-dir", str(tmp_path), "--no-progress"])
    assert match.split(" is not")[0].split(" cannot")[0] in str(e.value.code)


def _write_shd(path, times, units, labels):
    """The SHD .h5 layout: spikes/times and spikes/units are variable-length arrays, labels uint16."""
    import h5py
    with h5py.File(path, "w") as f:
        t = f.create_dataset("spikes/times", (len(times),), dtype=h5py.vlen_dtype(np.float32))
        u = f.create_dataset("spikes/units", (len(units),), dtype=h5py.vlen_dtype(np.uint16))
        for i, (ti, ui) in enumerate(zip(times, units)):
            t[i] = np.asarray(ti, np.float32)
            u[i] = np.asarray(ui, np.uint16)
        f.create_dataset("labels", data=np.asarray(labels, np.uint16))
        f.create_dataset("extra/speaker", data=np.zeros(len(labels), np.uint16))


def test_shd_reader_bins_spikes(tmp_path):
    path = str(tmp_path / "shd_train.h5")
    _write_shd(path, [[0.0, 0.05, 0.26, 0.99], [0.5]], [[3, 4, 699, 10], [0]], [7, 2])
    ds = data.SHD(path, bins=4, duration=1.0, unit_bin=5)
    assert len(ds) == 2 and ds.features == 140 and ds.dropped_spikes == 0
    frames, label = ds[0]
    assert label.item() == 7 and frames.shape == (4, 140)
    expected = np.zeros((4, 140), np.float32)
    expected[0, 0] = 2  # units 3 and 4 share channel 0, both in [0, 0.25)
    expected[1, 139] = 1
    expected[3, 2] = 1
    np.testing.assert_array_equal(frames.numpy(), expected)
    short = data.SHD(path, bins=4, duration=0.5, unit_bin=5)
    assert short.dropped_spikes == 2 and short[0][0].sum() == 3  # 0.99 s and 0.5 s are outside [0, 0.5)
    assert data.SHD(path, bins=4, unit_bin=5).duration > 0.99  # default duration keeps every spike


def test_missing_shd_says_what_to_put_where(tmp_path):
    with pytest.raises(FileNotFoundError, match="shd_train.h5 and shd_test.h5"):
        data.load_shd(str(tmp_path))


@pytest.mark.parametrize("damage", ["truncated", "gzipped", "another layout"])
def test_a_damaged_shd_file_says_so(tmp_path, damage):
    path = tmp_path / "shd_train.h5"
    _write_shd(str(path), [[0.1, 0.2]], [[3, 4]], [1])
    raw = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(raw[:len(raw) // 3])
    elif damage == "gzipped":
        path.write_bytes(gzip.compress(raw))
    else:
        import h5py
        with h5py.File(path, "w") as f:
            f.create_dataset("labels", data=np.zeros(3, np.uint16))
    match = "is not an SHD file" if damage == "another layout" else "cannot be read as HDF5 .* gunzip"
    with pytest.raises(data.DataError, match=match):
        data.SHD(str(path))


# ----------------------------------------------------------------------------------------- examples

def _env():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    return env


def run_example(script, *args, procs=1, cwd=None):
    cmd = [sys.executable, os.path.join(EXAMPLES, script), *map(str, args), "--no-progress"]
    if procs > 1:
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        launcher = [torchrun] if os.path.exists(torchrun) else [sys.executable, "-m", "torch.distributed.run"]
        cmd = launcher + ["--standalone", f"--nproc_per_node={procs}"] + cmd[1:]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=cwd, timeout=600)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.json")) as f:
        return json.load(f)


def assert_learns(metrics, chance):
    h = metrics["history"]
    assert h[-1]["train_loss"] < h[0]["train_loss"], h
    assert metrics["final_test_acc"] > chance + 0.25, h


TINY_DIGITS = ["--limit-train", 320, "--limit-test", 150, "--channels", 32, "--hidden", 32, "--convs", 1,
               "--epochs", 3, "--lr", 1e-2]


def test_train_sequential_learns_and_resumes_exactly(tmp_path):
    # A fixed implementation: a timed autoselect could pick differently in each run, and implementations
    # agree only to float tolerance.
    args = [*TINY_DIGITS, "--batch-size", 16, "--method", "shift_add"]
    a = str(tmp_path / "a")
    out = run_example("train_sequential.py", *args, "--out-dir", a)
    metrics = read_metrics(a)
    assert_learns(metrics, chance=0.1)
    assert "summary: sequential digits" in out.splitlines()[-1]
    # The rate each epoch starts with, down the cosine (it recorded the rate after the epoch: 0.0 last)
    rates = [h["lr"] for h in metrics["history"]]
    assert rates[0] == pytest.approx(1e-2) and rates[0] > rates[1] > rates[2] > 0
    for name in ("checkpoint.pt", "curves.png", "metrics.json"):
        assert os.path.getsize(os.path.join(a, name)) > 0
    # Two epochs, stop, resume for the third: the same numbers as the uninterrupted run.
    b = str(tmp_path / "b")
    run_example("train_sequential.py", *args, "--out-dir", b, "--stop-after", 2)
    assert len(read_metrics(b)["history"]) == 2
    out = run_example("train_sequential.py", *args, "--out-dir", b, "--resume")
    assert "resumed" in out
    keys = ("train_loss", "train_acc", "test_loss", "test_acc", "lr")
    assert [[h[k] for k in keys] for h in read_metrics(b)["history"]] == \
        [[h[k] for k in keys] for h in metrics["history"]]
    # Mixed precision: the same run under autocast learns too, and its numbers are its own (the
    # reduced-precision forward rounds differently), so the option is in effect.
    for amp in ("bf16", "fp16"):
        c = str(tmp_path / amp)
        run_example("train_sequential.py", *args, "--out-dir", c, "--amp", amp)
        mixed = read_metrics(c)
        assert_learns(mixed, chance=0.1)
        assert [h["train_loss"] for h in mixed["history"]] != [h["train_loss"] for h in metrics["history"]]


class _Payload:
    """An object a checkpoint must not bring in: loading it would run code from the file."""


@pytest.mark.parametrize("content", ["garbage", "truncated", "a plain state_dict", "an object"])
def test_a_damaged_or_foreign_checkpoint_is_refused_by_name(tmp_path, content):
    common = _import_example("common")
    env = common.Env(0, 1, torch.device("cpu"))
    file = tmp_path / "checkpoint.pt"
    path = str(file)
    good = {"model": {"w": torch.ones(2)}, "optimizer": {}, "scheduler": {}, "epoch": 1, "history": [],
            "config": {"c": 1}}
    if content == "garbage":
        file.write_bytes(b"\x00not a checkpoint" * 20)
    elif content == "truncated":
        common.save_checkpoint(path, good)
        raw = file.read_bytes()
        file.write_bytes(raw[:len(raw) // 2])
    elif content == "a plain state_dict":
        torch.save({"w": torch.ones(2)}, path)
    else:
        torch.save({**good, "extra": _Payload()}, path)
    with pytest.raises(SystemExit, match="cannot be read as a checkpoint of these scripts"):
        common.load_checkpoint(path, {"c": 1}, env)
    common.save_checkpoint(path, good)  # the real thing loads
    assert common.load_checkpoint(path, {"c": 1}, env)["epoch"] == 1
    with pytest.raises(SystemExit, match="different network"):
        common.load_checkpoint(path, {"c": 2}, env)


def test_train_sequential_torchrun_two_processes(tmp_path):
    out_dir = str(tmp_path / "ddp")
    out = run_example("train_sequential.py", *TINY_DIGITS, "--batch-size", 8, "--method", "shift_add",
                      "--out-dir", out_dir, procs=2)  # 8 per process: the same 16 per step as above
    metrics = read_metrics(out_dir)
    assert metrics["processes"] == 2 and metrics["method"] == "shift_add (time_first)"
    assert out.count("summary:") == 1  # rank 0 logs
    assert_learns(metrics, chance=0.1)


def test_train_shd_on_a_tiny_synthetic_file(tmp_path):
    rng = np.random.default_rng(0)
    for split, n in (("train", 160), ("test", 80)):
        labels = rng.integers(0, 4, n)
        times, units = [], []
        for c in labels:  # class c: a burst in its own band of 175 units at a class-specific time, plus noise
            t_sig = rng.normal(0.1 + 0.2 * c, 0.03, 40).clip(0, 0.95)
            u_sig = rng.integers(175 * c, 175 * (c + 1), 40)
            t_noise, u_noise = rng.uniform(0, 0.95, 20), rng.integers(0, 700, 20)
            times.append(np.concatenate([t_sig, t_noise]))
            units.append(np.concatenate([u_sig, u_noise]))
        _write_shd(str(tmp_path / f"shd_{split}.h5"), times, units, labels)
    out_dir = str(tmp_path / "run")
    run_example("train_shd.py", "--data-dir", tmp_path, "--bins", 20, "--unit-bin", 35, "--hidden", 32,
                "--batch-size", 16, "--epochs", 3, "--lr", 5e-3, "--max-delay", 5, "--out-dir", out_dir)
    metrics = read_metrics(out_dir)
    assert metrics["config"]["delays"] == models.dcls_available()
    assert_learns(metrics, chance=0.25)


def test_ablation_order_table_and_figure(tmp_path):
    out_dir = str(tmp_path / "abl")
    out = run_example("ablation_order.py", "--orders", 1, 2, "--epochs", 1, "--widths", 8, 8, "--limit-train", 64,
                      "--limit-test", 32, "--batch-size", 32, "--out-dir", out_dir)
    with open(os.path.join(out_dir, "ablation.json")) as f:
        acc = json.load(f)["test_acc"]
    assert set(acc["sawtooth"]) == set(acc["no_sawtooth"]) == {"1", "2"}
    assert acc["sawtooth"]["1"] == acc["no_sawtooth"]["1"]  # k = 1 is trained once
    runs = {d for d in os.listdir(out_dir) if os.path.isdir(os.path.join(out_dir, d))}
    assert runs == {"k1_sawtooth", "k2_sawtooth", "k2_no_sawtooth"}
    assert os.path.getsize(os.path.join(out_dir, "ablation.png")) > 0
    table = out[out.index("accuracy vs order"):]
    assert f"{100 * acc['no_sawtooth']['2']:9.2f}" in table


def test_psn_choice_on_the_command_line(capsys):
    train_sequential = _import_example("train_sequential")
    if models.psn_available("psn"):
        assert train_sequential.parse_args(["--neuron", "psn"]).neuron == "psn"
    else:
        with pytest.raises(SystemExit):
            train_sequential.parse_args(["--neuron", "psn"])
        assert "SpikingJelly >= 2.0" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(TINY))
def test_paper_networks_run_time_last_with_the_same_outputs(name):
    """The builders' networks (layers that mix time steps included) convert to the time-last layout
    and back, with the same outputs and gradients in float64."""
    from spikingjelly_mfpsn import to_time_first, to_time_last
    kwargs, shape, _ = TINY[name]
    if name in ("dvs_lip", "shd"):
        kwargs = dict(kwargs, dropout=0.0)  # one forward each way: no random masks to compare
    torch.manual_seed(0)
    net = models.build(name, neuron="mfpsn", **kwargs).double()
    x = torch.rand(shape, dtype=torch.float64)
    want = net(x)
    g = torch.randn_like(want)
    grads_want = torch.autograd.grad(want, list(net.parameters()), g, allow_unused=True)
    functional.reset_net(net)
    net = to_time_last(net)
    got = net(x)
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got, list(net.parameters()), g, allow_unused=True)
    for a, b in zip(grads, grads_want):
        if b is not None:
            torch.testing.assert_close(a, b)
    functional.reset_net(net)
    net = to_time_first(net)
    torch.testing.assert_close(net(x), want)


def test_the_paper_nets_and_readers_live_outside_the_library():
    """The library never imports the paper's networks and data readers; their old names still work."""
    import subprocess
    import sys
    code = ("import sys, spikingjelly_mfpsn, spikingjelly_mfpsn.ops; "
            "from spikingjelly_mfpsn import functional, deploy, energy, convert, layer, tuner; "
            "print(sorted(m for m in sys.modules if m.startswith('spikingjelly_mfpsn.paper')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    from spikingjelly_mfpsn import data as old_data, models as old_models
    assert old_models.BUILDERS is models.BUILDERS and old_data.load_digits is data.load_digits


# ------------------------------------------------------------------------------- a quiet first run

QUICK = [*TINY_DIGITS, "--batch-size", 64, "--method", "shift_add"]  # 320 samples: 5 steps an epoch


def _example_command(script, *args):
    return [sys.executable, os.path.join(EXAMPLES, script), *map(str, args)]


def test_a_log_file_gets_one_line_per_epoch_and_no_bar(tmp_path):
    """With stdout and stderr sent to a file, each epoch writes its one summary line; the progress
    bars (which redrew their postfix every step, a 57 KB log for a short run) write nothing."""
    log = tmp_path / "run.log"
    with open(log, "w") as f:
        r = subprocess.run(_example_command("train_sequential.py", *QUICK, "--out-dir", tmp_path / "run"),
                           stdout=f, stderr=subprocess.STDOUT, env=_env(), timeout=600)
    text = log.read_text()
    assert r.returncode == 0, text[-3000:]
    lines = re.split(r"[\r\n]+", text.strip())
    epochs = len(read_metrics(str(tmp_path / "run"))["history"])
    assert [line for line in lines if re.match(r"epoch \d+/\d+:", line)] == \
        [line for line in lines if line.startswith("epoch ")]  # no bar lines ("epoch 1/3 train: ...")
    assert sum(bool(re.match(r"epoch \d+/\d+:", line)) for line in lines) == epochs
    assert "\r" not in text and len(lines) <= epochs + 3, text  # + the run's first line, summary, slack
    assert lines[-1].startswith("summary:")


def _run_on_a_terminal(cmd, columns=120):
    """``cmd``'s output with stdout and stderr on a pseudo-terminal ``columns`` wide."""
    pty = pytest.importorskip("pty")
    import fcntl
    import struct
    import termios
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=_env())
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    assert proc.wait(timeout=600) == 0, b"".join(chunks)[-3000:]
    return b"".join(chunks).decode(errors="replace")


def test_on_a_terminal_the_bar_advances_once_per_step(tmp_path):
    """The bar showed "0/N" all epoch long: iterated, tqdm kept its count to itself between redraws
    while the postfix redrew the bar every step. Now each step draws the next count, in order."""
    out = _run_on_a_terminal(_example_command("train_sequential.py", *QUICK, "--epochs", 1,
                                              "--out-dir", tmp_path / "run"))
    steps = -(-320 // 64)
    counts = [int(c) for c in re.findall(rf"epoch 1/1 train:[^\r\n]*?(\d+)/{steps} \[", out)]
    assert counts == list(range(steps + 1)), out[-3000:]
    assert re.search(r"epoch 1/1: train loss", out)


def _configure(monkeypatch, tmp_path, verbose, capsys):
    """``common.configure_method`` with ``--method auto`` on a tiny MF-PSN network and an empty cache;
    returns (what it printed, the network, autoselect's seconds)."""
    from spikingjelly.activation_based import layer
    common = _import_example("common")
    monkeypatch.setenv("SPIKINGJELLY_MFPSN_CACHE", str(tmp_path / f"cache_{verbose}.json"))
    torch.manual_seed(0)
    net = torch.nn.Sequential(layer.Linear(4, 8, step_mode="m"), MulFreeChannelwisePSN(8, k=2, step_mode="m"))
    args = argparse.Namespace(method="auto", layout="time_first", amp="off", verbose=verbose)
    capsys.readouterr()
    env = common.Env(0, 1, torch.device("cpu"))
    net, method, seconds = common.configure_method(net, args, torch.rand(6, 3, 4), env)
    assert method == "auto (time_first)"
    return capsys.readouterr().out, net, seconds


def test_autoselect_prints_one_line_unless_verbose(monkeypatch, tmp_path, capsys):
    out, net, seconds = _configure(monkeypatch, tmp_path, False, capsys)
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    line = lines[0]
    assert line.startswith("autoselect: layout time_first") and f"{seconds:.2f} s" in line
    assert f"methods {net[1].method} x1;" in line, line  # the MF-PSN layer's choice, the one layer with one
    assert "candidates (ms)" not in out and "--verbose" in line
    out, net, _ = _configure(monkeypatch, tmp_path, True, capsys)
    assert "candidates (ms)" in out and len(out.strip().splitlines()) > 2, out
    assert re.search(rf"MulFreeChannelwisePSN +{net[1].method} ", out), out


SCRIPTS = ["train_sequential", "train_shd", "ablation_order", "demo", "energy_table5", "mulfree_inference"]


def _help_entries(text):
    """``--help`` text -> {option string: its entry's text, lines joined}."""
    entries, current = {}, None
    for line in text.splitlines():
        if re.match(r"  -", line):
            current = [line.strip()]
            for option in re.findall(r"(?:^|[ ,])(--?[A-Za-z][\w-]*)", line.strip().split("  ")[0]):
                entries[option] = current
        elif current is not None and line.startswith("   ") and line.strip():
            current.append(line.strip())
        else:
            current = None
    return {option: " ".join(lines) for option, lines in entries.items()}


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_shows_every_default_once(script):
    """One --help policy for every script: an option shows "(default: X)" once; one whose default is
    not None always shows it (some said "(default: mfpsn) (default: mfpsn)", others nothing)."""
    sys.path.insert(0, EXAMPLES)
    try:
        parser = __import__(script).build_parser()  # (energy_table5 imports common only here)
    finally:
        sys.path.remove(EXAMPLES)
    r = subprocess.run(_example_command(f"{script}.py", "--help"), capture_output=True, text=True,
                       env=dict(_env(), COLUMNS="100"), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    entries = _help_entries(r.stdout)
    options = [a for a in parser._actions if a.option_strings and a.default is not argparse.SUPPRESS]
    assert len(options) >= 2
    for action in options:
        entry = entries.get(action.option_strings[0])
        assert entry is not None, (action.option_strings, r.stdout)
        assert entry.count("(default:") <= 1, entry
        if action.default is not None:
            assert f"(default: {action.default})" in entry, entry


# (script, data set, what --data-dir is) -> the files the message must name
DATA_DIRS = {
    "cifar10": ("cifar-10-python.tar.gz", "cifar-10-batches-py/", "data_batch_1", "test_batch"),
    "cifar100": ("cifar-100-python.tar.gz", "cifar-100-python/", "train", "test"),
    "shd": ("shd_train.h5", "shd_test.h5"),
}


def _data_argv(script, dataset, where, tmp_path):
    """Arguments for ``script`` that point --data-dir at ``where`` ('none', 'missing', 'empty',
    'gzipped', 'partial', or 'ok': the files are there)."""
    folder = tmp_path / "data"
    if where != "missing" and where != "none":
        folder.mkdir()
    if where == "gzipped":
        for name in DATA_DIRS["shd"]:
            (folder / f"{name}.gz").write_bytes(b"")
    elif where in ("partial", "ok") and dataset == "shd":
        for name in DATA_DIRS["shd"][:1 if where == "partial" else 2]:
            (folder / name).write_bytes(b"")  # (the contents are read, and checked, later)
    elif where in ("partial", "ok"):
        _write_cifar10(str(folder), archive=False)
        if where == "partial":
            os.remove(folder / "cifar-10-batches-py" / "data_batch_3")
    argv = [] if dataset == "shd" else ["--dataset", dataset]
    return argv + ([] if where == "none" else ["--data-dir", str(folder)])


@pytest.mark.parametrize("script,dataset,where", [
    ("train_sequential", "cifar10", "none"), ("train_sequential", "cifar100", "none"),
    ("train_sequential", "cifar10", "missing"), ("train_sequential", "cifar100", "empty"),
    ("train_sequential", "cifar10", "partial"), ("ablation_order", "cifar10", "none"),
    ("ablation_order", "cifar100", "empty"), ("train_shd", "shd", "none"), ("train_shd", "shd", "missing"),
    ("train_shd", "shd", "gzipped"), ("train_shd", "shd", "partial"),
])
def test_a_missing_data_folder_is_one_line_naming_the_flag_and_files(script, dataset, where, tmp_path,
                                                                    monkeypatch, capsys):
    """Without --data-dir (SHD: its default data/shd, not here), with a folder that is not there or
    lacks the files: exit status 2 and one line naming --data-dir and the files expected in it, before
    anything is built (was: a ValueError traceback, or exit status 1)."""
    monkeypatch.chdir(tmp_path)  # (data/shd is relative)
    argv = _data_argv(script, dataset, where, tmp_path)
    module = _import_example(script)
    with pytest.raises(SystemExit) as e:
        module.parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--data-dir" in err and ": error: " in err, err  # (prog: error: message, as argparse's errors)
    for name in DATA_DIRS[dataset]:
        assert name in err, (name, err)
    if where == "partial":
        assert ("data_batch_3" if dataset == "cifar10" else "shd_test.h5") + " missing" in err, err


@pytest.mark.parametrize("script,dataset", [("train_sequential", "cifar10"), ("ablation_order", "cifar10"),
                                            ("train_shd", "shd")])
def test_a_data_folder_with_the_files_passes_the_check(script, dataset, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    module = _import_example(script)
    args = module.parse_args(_data_argv(script, dataset, "ok", tmp_path))
    assert (args[0] if isinstance(args, tuple) else args).data_dir == str(tmp_path / "data")


def test_cifar_without_data_dir_exits_2_without_a_traceback():
    r = subprocess.run(_example_command("train_sequential.py", "--dataset", "cifar10"), capture_output=True,
                       text=True, env=_env(), timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "--data-dir" in r.stderr


# ------------------------------------------------------------------------------- refused inputs

MINI = [str(a) for a in ("--limit-train", 32, "--limit-test", 16, "--channels", 4, "--hidden", 8, "--convs", 1,
                         "--epochs", 2, "--batch-size", 16, "--method", "shift_add", "--no-progress")]


@pytest.mark.parametrize("extra,named", [(["--k", "3"], "--k"), (["--neuron=lif"], "--neuron"),
                                         (["--no-saw"], "--no-sawtooth"), (["--sawtooth"], "--sawtooth"),
                                         (["--pixel"], "--pixel"), (["--resume"], "--resume")])
def test_ablation_order_refuses_the_options_it_sweeps(extra, named, capsys):
    """An extra --k / --neuron / --no-sawtooth came after the sweep's own and won: every run trained the
    same network under the sweep's labels."""
    ablation_order = _import_example("ablation_order")
    with pytest.raises(SystemExit) as e:
        ablation_order.parse_args(["--epochs", "1", *extra])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"error: {named}: leave out" in err, err


def test_resume_refuses_other_training_options(tmp_path, capsys):
    """--resume with another --batch-size trained at lr 0; another --lr was ignored (metrics said otherwise)."""
    train_sequential = _import_example("train_sequential")
    out = str(tmp_path / "run")
    train_sequential.main([*MINI, "--out-dir", out, "--stop-after", "1"])
    with pytest.raises(SystemExit) as e:
        train_sequential.main([*MINI, "--out-dir", out, "--resume", "--batch-size", "8", "--lr", "0.5"])
    msg = str(e.value.code)
    assert "--batch-size 16 (now 8)" in msg and "--lr 0.002 (now 0.5)" in msg and "another --out-dir" in msg, msg
    path = os.path.join(out, "checkpoint.pt")  # a checkpoint from before the options were saved still resumes
    torch.save({k: v for k, v in torch.load(path, weights_only=True).items() if k != "options"}, path)
    assert len(train_sequential.main([*MINI, "--out-dir", out, "--resume", "--threads", "1"])["history"]) == 2


def test_a_new_run_does_not_replace_the_one_in_its_out_dir(tmp_path, capsys):
    train_sequential = _import_example("train_sequential")
    out = str(tmp_path / "run")
    train_sequential.main([*MINI, "--out-dir", out, "--epochs", "1"])
    with pytest.raises(SystemExit) as e:
        train_sequential.main([*MINI, "--out-dir", out])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "already holds a run" in err and "--resume" in err and "--overwrite" in err, err
    assert len(train_sequential.main([*MINI, "--out-dir", out, "--overwrite"])["history"]) == 2
    ablation_order = _import_example("ablation_order")
    os.makedirs(tmp_path / "abl" / "k2_no_sawtooth")
    (tmp_path / "abl" / "k2_no_sawtooth" / "metrics.json").write_text("{}")
    with pytest.raises(SystemExit):
        ablation_order.parse_args(["--orders", "2", "--out-dir", str(tmp_path / "abl")])
    assert "k2_no_sawtooth" in capsys.readouterr().err
    ablation_order.parse_args(["--orders", "2", "--out-dir", str(tmp_path / "abl"), "--overwrite"])


@pytest.mark.parametrize("split", ["test", "train"])
def test_an_empty_split_is_refused_by_name(tmp_path, split):
    """An empty test split was reported as a measured 0 % accuracy; an empty training split as torch's
    'num_samples should be a positive integer'."""
    _write_cifar10(str(tmp_path), archive=False)
    empty = {b"data": np.zeros((0, 3072), np.uint8), b"labels": []}
    for name in ["test_batch"] if split == "test" else [f"data_batch_{i}" for i in range(1, 6)]:
        with open(tmp_path / "cifar-10-batches-py" / name, "wb") as f:
            pickle.dump(empty, f)
    train_sequential = _import_example("train_sequential")
    with pytest.raises(SystemExit) as e:
        train_sequential.main([*MINI, "--dataset", "cifar10", "--data-dir", str(tmp_path),
                               "--out-dir", str(tmp_path / "run")])
    assert ("test_batch: the test batch holds no images" if split == "test" else "training batches") \
        in str(e.value.code)
    _write_shd(str(tmp_path / "shd_train.h5"), [[0.1]], [[3]], [1])
    _write_shd(str(tmp_path / "shd_test.h5"), [], [], [])
    with pytest.raises(data.DataError, match="shd_test.h5 holds no samples"):
        data.load_shd(str(tmp_path))


@pytest.mark.parametrize("key,value,says", [
    (b"data", lambda b: b / 255.0, "b'data' must hold integers in 0..255, got dtype float64"),
    (b"data", lambda b: b.astype(np.int64) + 256, "b'data' must hold integers in 0..255, got values"),
    (b"data", lambda b: "not an array", "b'data' must hold integers"),
    (b"labels", lambda b: [1.9, 2.5, 3.99], "must hold integers in 0..9, got dtype float64"),
    (b"labels", lambda b: [0, 10, 1], "must hold integers in 0..9, got values 0..10"),
    (b"labels", lambda b: [0, -1, 1], "must hold integers in 0..9, got values -1..1"),
    (b"labels", lambda b: 3, "must be a list of 3 labels, one per image, got shape ()"),
    (b"labels", lambda b: [1, [2, 3], 4], "is not an array of integers"),
    (b"labels", lambda b: ["cat", "dog", "cat"], "must hold integers in 0..9, got dtype <U3"),
    (b"labels", lambda b: [[1], [2], [3]], "got shape (3, 1)"),
])
def test_the_cifar_reader_refuses_what_it_would_cast(tmp_path, key, value, says):
    """Float pixels became black images, pixels over 255 wrapped, float labels were truncated, labels
    out of range or of the wrong shape crashed later (or inside the error message)."""
    _write_cifar10(str(tmp_path), archive=False)
    path = tmp_path / "cifar-10-batches-py" / "data_batch_2"
    batch = _cifar_batch(3, b"labels", 2)
    batch[key] = value(batch[key])
    path.write_bytes(pickle.dumps(batch))
    with pytest.raises(data.DataError) as e:
        data.load_cifar(str(tmp_path), "cifar10")
    assert "data_batch_2" in str(e.value) and says in str(e.value), str(e.value)


@pytest.mark.parametrize("times,labels,says", [
    ([[0.1, float("inf")]], [1], "sample 0 has a spike time that is not a finite number"),
    ([[0.1, float("nan")]], [1], "sample 0 has a spike time that is not a finite number"),
    ([[0.1, 0.2]], np.array([-1], np.int16), "labels must hold integers in 0..")
])
def test_the_shd_reader_refuses_non_finite_times_and_bad_labels(tmp_path, times, labels, says):
    import h5py
    path = str(tmp_path / "shd_train.h5")
    _write_shd(path, times, [[3, 4]], [1])
    with h5py.File(path, "r+") as f:
        del f["labels"]
        f.create_dataset("labels", data=np.asarray(labels))
    with pytest.raises(data.DataError, match=re.escape(says)):
        data.SHD(path)


@pytest.mark.parametrize("units, says", [([1.7, -0.5], "spikes/units of sample 0 must hold integers in 0..699, got "
                                                         "dtype float64"),
                                         ([3, 700], "spikes/units of sample 0 must hold integers in 0..699, got values")])
def test_the_shd_reader_refuses_units_that_are_not_channels(tmp_path, units, says):
    """Float units were truncated to channels (-0.5 became 0, passing the range check)."""
    import h5py
    path = str(tmp_path / "shd_train.h5")
    with h5py.File(path, "w") as f:
        t = f.create_dataset("spikes/times", (1,), dtype=h5py.vlen_dtype(np.float32))
        t[0] = [0.1, 0.2]
        u = f.create_dataset("spikes/units", (1,), dtype=h5py.vlen_dtype(np.asarray(units).dtype))
        u[0] = np.asarray(units)
        f.create_dataset("labels", data=np.asarray([0], np.uint16))
    with pytest.raises(data.DataError, match=re.escape(says)):
        data.SHD(path)


def test_the_shd_reader_refuses_labels_of_another_shape_and_a_non_finite_duration(tmp_path):
    import h5py
    path = str(tmp_path / "shd_train.h5")
    _write_shd(path, [[0.1], [0.2]], [[3], [4]], [1, 2])
    for duration in (float("inf"), float("nan"), 0.0):
        with pytest.raises(ValueError, match="duration must be a finite number"):
            data.SHD(path, duration=duration)
    with h5py.File(path, "r+") as f:
        del f["labels"]
        f.create_dataset("labels", data=np.array([[1], [2]], np.uint16))
    with pytest.raises(data.DataError, match=re.escape("labels must be one label per sample (shape (N,)), got "
                                                       "shape (2, 1)")):
        data.SHD(path)


@pytest.mark.parametrize("script,argv,says", [
    ("train_shd", ["--delay-lr", "-1"], "--delay-lr must be a finite number >= 0"),
    ("train_shd", ["--delay-lr", "inf"], "--delay-lr must be a finite number >= 0"),  # (it failed in training)
    ("train_sequential", ["--lr", "inf"], "--lr must be a finite number > 0"),
    ("train_sequential", ["--weight-decay", "inf"], "--weight-decay must be a finite number >= 0"),
    ("train_sequential", ["--seed", str(10 ** 17)], "--seed must be in"),  # (the per-epoch seed overflowed)
    ("train_shd", ["--dropout", "1"], "--dropout must be in [0, 1)"),
    ("train_shd", ["--duration", "inf"], "--duration must be a finite number of seconds > 0"),
    ("train_shd", ["--duration", "0"], "--duration must be a finite number of seconds > 0"),
    ("train_sequential", ["--label-smoothing", "-1"], "--label-smoothing must be in [0, 1)"),
    ("train_sequential", ["--label-smoothing", "1.5"], "--label-smoothing must be in [0, 1)"),
    ("train_sequential", ["--weight-decay", "-1"], "--weight-decay must be a finite number >= 0"),
    ("train_sequential", ["--threads", "100000"], "--threads must be at most"),
    ("train_sequential", ["--channels", "0"], "--channels must be >= 1"),
    ("train_sequential", ["--pixel", "--time-pool", "0"], "--time-pool must be >= 1"),
    ("train_sequential", ["--widths", "8", "0"], "--widths must all be >= 1"),
    ("train_sequential", ["--stages", "4"], "--stages 4: digits images are 8 pixels high"),
    ("train_sequential", ["--data-dir", "somewhere"], "--dataset digits is bundled"),
    ("ablation_order", ["--data-dir", "somewhere"], "--dataset digits is bundled"),
])
def test_out_of_range_options_are_usage_errors(script, argv, says, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data_dir = _data_argv(script, "shd", "ok", tmp_path) if script == "train_shd" else []
    with pytest.raises(SystemExit) as e:
        _import_example(script).parse_args([*argv, *data_dir])
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err, err


@pytest.mark.parametrize("script,args,says", [
    ("demo.py", ["--epochs", "0"], "--epochs must be >= 1"),
    ("mulfree_inference.py", ["--onnx", "/nonexistent_folder_mfpsn/x.onnx"], "the folder /nonexistent_folder_mfpsn"),
    ("mulfree_inference.py", ["--nir", "/nonexistent_folder_mfpsn/x.nir"], "the folder /nonexistent_folder_mfpsn"),
])
def test_demo_and_inference_refuse_bad_arguments_before_computing(script, args, says):
    r = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), *args], capture_output=True, text=True,
                       env=_env(), timeout=120)
    assert r.returncode == 2 and says in r.stderr, (r.returncode, r.stdout[-500:], r.stderr[-500:])


def test_a_damaged_shd_file_that_opens_is_refused_by_name(tmp_path):
    """Bytes overwritten inside the file (not truncated): the reads after h5py.File() raised h5py's
    own errors."""
    rng = np.random.default_rng(0)
    good = tmp_path / "good.h5"
    _write_shd(str(good), [rng.random(20) for _ in range(20)], [rng.integers(0, 700, 20) for _ in range(20)],
               rng.integers(0, 20, 20))
    raw, path = good.read_bytes(), tmp_path / "shd_train.h5"
    for _ in range(40):
        damaged = bytearray(raw)
        for i in rng.integers(0, len(raw), 8):
            damaged[i] = int(rng.integers(0, 256))
        path.write_bytes(bytes(damaged))
        try:
            data.SHD(str(path), bins=10)
        except data.DataError as e:
            assert str(path) in str(e)


def test_a_cifar_archive_member_that_is_a_folder_is_refused_by_name(tmp_path):
    with tarfile.open(tmp_path / "cifar-10-python.tar.gz", "w:gz") as tar:
        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            if name == "data_batch_3":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
                continue
            raw = pickle.dumps(_cifar_batch(2, b"labels", 0))
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    with pytest.raises(data.DataError, match="cifar-10-batches-py/data_batch_3 is not a file"):
        data.load_cifar(str(tmp_path), "cifar10")


def test_a_broken_scikit_learn_is_not_reported_as_missing(monkeypatch):
    """Any ImportError (e.g. a shared object that failed to load) said 'needs scikit-learn: pip install'."""
    monkeypatch.setitem(sys.modules, "sklearn.model_selection", None)  # importing it fails; sklearn is there
    with pytest.raises(ImportError) as e:
        data.load_digits()
    assert "pip install scikit-learn" not in str(e.value), str(e.value)


def test_a_method_the_layout_does_not_have_is_a_usage_error(tmp_path):
    """Regression: --method conv2d (time-last only) was logged per layer and skipped, and the run trained
    with 'auto' under a summary and metrics that named conv2d."""
    out = str(tmp_path / "run")
    r = subprocess.run([sys.executable, os.path.join(EXAMPLES, "train_sequential.py"), *map(str, TINY_DIGITS),
                        "--method", "conv2d", "--out-dir", out, "--no-progress"], capture_output=True, text=True,
                       env=_env(), timeout=300)
    assert r.returncode == 2 and "--method conv2d: " in r.stderr and "time_first layout" in r.stderr, r.stderr[-800:]
    assert "Traceback" not in r.stderr and not os.path.exists(os.path.join(out, "metrics.json"))
    assert "does not support method" not in r.stderr + r.stdout  # (one message: set_method's warning said it first)


def test_an_incomplete_cifar_folder_names_what_it_lacks_and_batches_name_their_file(tmp_path):
    """A folder lacking a batch was reported as the whole data set not found; a batch with bad content was
    named cifar10/<member>, not by its path."""
    _write_cifar10(str(tmp_path), archive=False)
    folder = tmp_path / "cifar-10-batches-py"
    (folder / "data_batch_5").unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(f"{folder} lacks data_batch_5: extract the whole")):
        data.load_cifar(str(tmp_path))
    _write_cifar10(str(tmp_path / "again"), archive=False)
    bad = tmp_path / "again" / "cifar-10-batches-py" / "data_batch_2"
    bad.write_bytes(pickle.dumps({b"data": np.zeros((1, 3072), np.float32), b"labels": [1]}))
    with pytest.raises(data.DataError, match=re.escape(f"{bad}: b'data' must hold integers")):
        data.load_cifar(str(tmp_path / "again"))
    with pytest.raises(ValueError, match="name must be 'digits' or one of"):
        data.num_classes("mnist")


def test_the_readers_and_readout_name_a_bool_or_a_string_argument(tmp_path):
    _write_shd(str(tmp_path / "shd_train.h5"), [[0.1, 0.2]], [[3, 4]], [1])
    for kwargs, says in ((dict(bins=True), "bins must be a positive int, got True"),
                         (dict(duration="1"), "duration must be a finite number of seconds > 0 or None, got '1'")):
        with pytest.raises(ValueError, match=re.escape(says)):
            data.SHD(str(tmp_path / "shd_train.h5"), **kwargs)
    with pytest.raises(ValueError, match="tau must be a number >= 1, got '2'"):
        models.MembraneReadout("2")


def test_a_resumed_run_with_more_epochs_starts_on_the_new_schedule(tmp_path):
    """Resumed with a larger --epochs, the first resumed step ran at the old schedule's last rate (0.0, and
    so recorded): the optimizer kept it until the scheduler's next step."""
    import math
    train_sequential = _import_example("train_sequential")
    out = str(tmp_path / "run")
    train_sequential.main([*MINI, "--out-dir", out, "--epochs", "1"])  # 2 steps of 2
    history = train_sequential.main([*MINI, "--out-dir", out, "--resume"])["history"]  # then 2 more of 4
    assert [h["lr"] for h in history] == pytest.approx([0.002, 0.002 * 0.5 * (1 + math.cos(math.pi * 2 / 4))])


def test_an_out_dir_below_a_file_is_a_usage_error(tmp_path, capsys):
    """It ended in a NotADirectoryError traceback, after the data was loaded and the methods timed."""
    train_sequential = _import_example("train_sequential")
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as e:
        train_sequential.main([*MINI, "--out-dir", str(tmp_path / "file" / "run")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--out-dir" in err and "is a file, not a folder" in err, err


def test_a_second_sweep_does_not_replace_the_first_ones_table(tmp_path, capsys):
    """A sweep of other orders into the same --out-dir replaced ablation.json and ablation.png silently."""
    ablation_order = _import_example("ablation_order")
    (tmp_path / "ablation.json").write_text("{}")
    with pytest.raises(SystemExit):
        ablation_order.parse_args(["--orders", "3", "--out-dir", str(tmp_path)])
    assert "ablation.json" in capsys.readouterr().err
    ablation_order.parse_args(["--orders", "3", "--out-dir", str(tmp_path), "--overwrite"])


def test_energy_table5_calibrates_every_network_on_the_same_images(monkeypatch, capsys):
    """--calibrate drew each network's images from one generator in turn: the MF-PSN rows depended on
    whether a PSN network (SpikingJelly 2.x only) was calibrated before them."""
    energy_table5 = _import_example("energy_table5")

    def rows():
        monkeypatch.setattr(sys, "argv", ["energy_table5.py", "--batch", "1", "--calibrate", "1"])
        energy_table5.main()
        return [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("MF-PSN")][:2]

    first = rows()
    monkeypatch.delattr(energy_table5.neuron, "PSN", raising=False)
    assert len(first) == 2 and rows() == first


def test_resume_with_fewer_epochs_than_trained_is_refused(tmp_path):
    """It trained nothing and reported the checkpoint's epochs, more than --epochs asked for."""
    train_sequential = _import_example("train_sequential")
    out = str(tmp_path / "run")
    train_sequential.main([*MINI, "--out-dir", out])
    with pytest.raises(SystemExit) as e:
        train_sequential.main([*MINI, "--out-dir", out, "--resume", "--epochs", "1"])
    assert "has trained 2 epochs, more than --epochs 1" in str(e.value.code), e.value.code
