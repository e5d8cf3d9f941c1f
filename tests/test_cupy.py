"""The CuPy backend, verified without a GPU.

1. nvcc compiles the kernel source for real GPU architectures, with every warning an error.
2. The same source file, compiled for the CPU through a small host shim (tests/cuda_host), runs the
   whole backend (argument packing, launches, partial sums, autograd) against the plain reference.
3. Without cupy (or without a CUDA device) backend='cupy' fails clearly and nothing else changes.
4. On a machine with cupy and a CUDA device, the registered implementation is held against the
   reference too (skipped here).
"""
import ctypes
import importlib.machinery
import importlib.util
import itertools
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spikingjelly_mfpsn import MulFreeChannelwisePSN, ops
from spikingjelly_mfpsn.ops import cupy_ops

import reference
import sj

HOST_DIR = os.path.join(os.path.dirname(__file__), "cuda_host")
KERNELS = [f"mfpsn_{kind}_{sfx}{index}" for kind in ("forward", "grad_x", "grad_wb")
           for sfx, _ in cupy_ops.DTYPES.values() for index in ("", "_i32")]
SHIM_BLOCK = 32  # small blocks: fewer fibers on the CPU, more blocks per test
SHIM_LANES = 8  # channels side by side in a weight-gradient block (4 rows of them)


# ---------------------------------------------------------------- 1. nvcc
@pytest.fixture(scope="session")
def nvcc():
    """(path of nvcc, the virtual architectures it knows)."""
    path = shutil.which("nvcc")
    if path is None:
        pytest.skip("nvcc is not on PATH (install the CUDA toolkit to compile-check the kernels)")
    listed = subprocess.run([path, "--list-gpu-arch"], capture_output=True, text=True)
    return path, set(listed.stdout.split()) if listed.returncode == 0 else None


def test_source_needs_no_headers():
    # CuPy compiles with NVRTC, which has no C/C++ standard headers: the source must stand alone.
    assert "#include" not in cupy_ops.kernel_source()


@pytest.mark.parametrize("arch", ["sm_75", "sm_80", "sm_90"])
def test_nvcc_compiles_without_warnings(nvcc, arch, tmp_path):
    nvcc, known = nvcc
    if known is not None and f"compute_{arch[3:]}" not in known:
        pytest.skip(f"this nvcc does not support {arch}")
    out = tmp_path / "charge.cubin"
    # -std=c++14 is what CuPy's RawModule uses; -cubin also runs ptxas (register allocation).
    cmd = [nvcc, "-cubin", f"-arch={arch}", "-std=c++14", "-Werror", "all-warnings",
           "-Xptxas", "--warning-as-error", f"-DMFPSN_BLOCK={cupy_ops.CupyLauncher.block}",
           "-o", str(out), str(cupy_ops.KERNEL_FILE)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stderr.strip() == "" and run.stdout.strip() == "", run.stderr + run.stdout
    binary = out.read_bytes()
    missing = [k for k in KERNELS if b"\0" + k.encode() + b"\0" not in binary]
    assert not missing, f"kernels the Python side launches but the cubin lacks: {missing}"


# ---------------------------------------------------------------- 2. the CPU shim
class ShimLauncher:
    """Runs the kernels of the compiled host shim; the launcher protocol of :mod:`cupy_ops`."""

    CTYPES = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
              np.dtype(np.uint64): ctypes.c_uint64}

    def __init__(self, lib, max_blocks=1 << 16):
        self.lib = lib
        self.block = lib.shim_block()
        self.lanes = SHIM_LANES
        self.max_blocks = max_blocks
        self.launched = []

    def __call__(self, name, blocks, args, device):
        assert device.type == "cpu"
        values = []
        for a in args:  # every argument must carry an explicit C type, as CuPy needs
            assert isinstance(a, np.generic) and a.dtype in self.CTYPES, f"untyped kernel argument {a!r}"
            values.append(self.CTYPES[a.dtype](a.item()))
        ptrs = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        sizes = (ctypes.c_size_t * len(values))(*[ctypes.sizeof(v) for v in values])
        if self.lib.shim_launch(name.encode(), blocks, self.block, ptrs, sizes, len(values)) != 0:
            raise RuntimeError(f"{name}: {self.lib.shim_last_error().decode()}")
        self.launched.append((name, blocks))


@pytest.fixture(scope="session")
def shim_lib(tmp_path_factory):
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++/c++ or $CXX) to build the CPU shim of the kernels")
    if not sys.platform.startswith("linux"):
        pytest.skip("the CPU shim runs CUDA threads as ucontext fibers, set up for Linux only")
    out = tmp_path_factory.mktemp("cuda_host") / "charge_shim.so"
    cmd = [cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror",
           f"-DMFPSN_BLOCK={SHIM_BLOCK}", f"-I{cupy_ops.KERNEL_FILE.parent}", f"-I{HOST_DIR}",
           os.path.join(HOST_DIR, "harness.cpp"), "-o", str(out)]
    start = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stderr.strip() == "", run.stderr
    print(f"\nCPU shim of the CUDA kernels built in {time.perf_counter() - start:.1f} s")
    lib = ctypes.CDLL(str(out))
    lib.shim_launch.restype = ctypes.c_int
    lib.shim_launch.argtypes = [ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p,
                                ctypes.c_void_p, ctypes.c_size_t]
    lib.shim_last_error.restype = ctypes.c_char_p
    return lib


def test_shim_barrier_is_real(shim_lib):
    launch = ShimLauncher(shim_lib)
    out = torch.full((3 * SHIM_BLOCK,), -1, dtype=torch.int32)
    launch("shim_check_barrier", 3, (np.uintp(out.data_ptr()),), torch.device("cpu"))
    want = torch.arange(SHIM_BLOCK - 1, -1, -1, dtype=torch.int32).repeat(3)
    assert torch.equal(out, want)
    with pytest.raises(RuntimeError, match="__syncthreads"):
        launch("shim_check_divergence", 1, (np.uintp(out.data_ptr()),), torch.device("cpu"))


def test_shim_checks_the_argument_list(shim_lib):
    launch = ShimLauncher(shim_lib)
    out = torch.zeros(SHIM_BLOCK, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="takes 1 arguments, got 2"):
        launch("shim_check_barrier", 1, (np.uintp(out.data_ptr()), np.int32(0)), torch.device("cpu"))
    with pytest.raises(RuntimeError, match="4 bytes"):
        launch("shim_check_barrier", 1, (np.int32(0),), torch.device("cpu"))


FEATURES = {3: (), 4: (3,), 5: (2, 3)}


def make_input(t, n, c, feat, layout, dtype, memory):
    """``memory``: 'contiguous'; 'strided' (non-contiguous, read in place); 'reversed' (needs a copy)."""
    shape = (t, n, c, *feat) if layout == "time_first" else (n, c, *feat, t)
    if memory == "contiguous":
        return torch.randn(shape, dtype=torch.float64).to(dtype)
    if memory == "strided":  # every other element of a larger tensor along the last axis
        big = torch.randn(*shape[:-1], 2 * shape[-1], dtype=torch.float64).to(dtype)
        return big[..., ::2]
    dims = list(range(len(shape)))[::-1]
    return torch.randn(shape[::-1], dtype=torch.float64).to(dtype).permute(dims)


def check_against_reference(launch, x, w, b, dilation, layout, tol, grad_out=None):
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    b = None if b is None else b.detach().requires_grad_()
    h = cupy_ops.charge_with(launch, x, w, b, dilation, layout)
    # The reference runs in float64 on the same (possibly rounded) values.
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = None if b is None else b.detach().double().requires_grad_()
    h_ref = reference.charge(x64, w64, b64, dilation, layout)
    assert h.shape == x.shape and h.is_contiguous() and h.dtype == torch.result_type(x, w)
    torch.testing.assert_close(h.double(), h_ref, **tol)
    g = (torch.randn(h.shape, dtype=torch.float64) if grad_out is None else grad_out).to(h.dtype)
    inputs, ref_inputs = [x, w], [x64, w64]
    if b is not None:
        inputs.append(b)
        ref_inputs.append(b64)
    grads = torch.autograd.grad(h, inputs, g)
    grads_ref = torch.autograd.grad(h_ref, ref_inputs, g.double())
    for got, want, what in zip(grads, grads_ref, ("x", "weight", "bias")):
        assert got.dtype == {"x": x, "weight": w, "bias": b}[what].dtype
        torch.testing.assert_close(got.double(), want, **tol, msg=lambda m: f"grad {what}: {m}")


TOLERANCES = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-5),
              torch.float16: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


@pytest.mark.parametrize("layout", ops.LAYOUTS)
@pytest.mark.parametrize("k,dilation", list(itertools.product([1, 2, 3, 5], [1, 2, 3])))
@pytest.mark.parametrize("dtype,memory,rank", [(torch.float64, "contiguous", 4), (torch.float64, "strided", 5),
                                               (torch.float64, "reversed", 5), (torch.float32, "contiguous", 3)])
def test_shim_matches_reference(shim_lib, layout, k, dilation, dtype, memory, rank):
    # max_blocks=2: every kernel's grid-stride loop goes round more than once.
    launch = ShimLauncher(shim_lib, max_blocks=2)
    torch.manual_seed(100 * k + dilation)
    c = 3
    # T = 1, a T shorter than the receptive field (k-1)*d+1, and a longer one.
    for t in sorted({1, max(1, (k - 1) * dilation), (k - 1) * dilation + 4}):
        x = make_input(t, 2, c, FEATURES[rank], layout, dtype, memory)
        w, b = torch.randn(c, k, dtype=dtype), torch.randn(c, dtype=dtype)
        check_against_reference(launch, x, w, b, dilation, layout, TOLERANCES[dtype])
    assert {name for name, _ in launch.launched} == {f"mfpsn_{kind}_{cupy_ops.DTYPES[dtype][0]}_i32"
                                                     for kind in ("forward", "grad_x", "grad_wb")}


@pytest.mark.parametrize("layout", ops.LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_shim_half_types(shim_lib, layout, dtype):
    launch = ShimLauncher(shim_lib)
    torch.manual_seed(7)
    for k, dilation, t in [(1, 1, 5), (3, 2, 3), (4, 1, 9)]:
        x = make_input(t, 2, 4, (3,), layout, dtype, "contiguous")
        w, b = (torch.rand(4, k, dtype=torch.float64) * 0.5).to(dtype), torch.randn(4).to(dtype)
        check_against_reference(launch, x, w, b, dilation, layout, TOLERANCES[dtype])


def rounding_cases(dtype):
    """float32 values whose rounding to ``dtype`` is delicate: exact ties, overflow, tiny, NaN."""
    info = torch.finfo(dtype)
    bits = {torch.float16: 11, torch.bfloat16: 8}[dtype]  # significand bits
    emin = {torch.float16: -14, torch.bfloat16: -126}[dtype]
    torch.manual_seed(3)
    grid = (torch.randn(400, dtype=torch.float64) * 4.0 ** torch.randint(-8, 8, (400,))).to(dtype).double()
    _, exp = torch.frexp(grid)  # |grid| in [2**(exp-1), 2**exp)
    half_ulp = torch.pow(2.0, torch.clamp(exp - 1, min=emin).double() - bits)
    ties = torch.cat([grid + half_ulp, grid - half_ulp])  # exactly halfway between neighbours
    special = torch.tensor([info.max, info.max + 2 * half_ulp.max(), 3.4e38, float(info.tiny) / 3, 1e-30,
                            float("inf"), float("-inf"), float("nan")], dtype=torch.float64)
    values = torch.cat([torch.randn(200, dtype=torch.float64) * 100, ties, special]).float()
    return values[values != 0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_shim_half_rounding_is_exact(shim_lib, dtype):
    # With x = 0 the charge is the float32 bias rounded once to the storage type: it must round
    # as torch does (to nearest, ties to even, overflow to inf, NaN stays NaN).
    launch = ShimLauncher(shim_lib)
    bias = rounding_cases(dtype)
    x = torch.zeros(1, 1, bias.numel(), dtype=dtype)
    h = cupy_ops.charge_with(launch, x, torch.ones(bias.numel(), 1, dtype=dtype), bias, 1, "time_first")[0, 0]
    want = bias.to(dtype)
    assert h.dtype == dtype
    nan = want.isnan()
    assert torch.equal(h.isnan(), nan)
    assert torch.equal(h[~nan].view(torch.int16), want[~nan].view(torch.int16))


@pytest.mark.parametrize("layout", ops.LAYOUTS)
def test_shim_many_partial_sums(shim_lib, layout, monkeypatch):
    # One element per thread: the weight gradient of each channel comes from several blocks.
    monkeypatch.setattr(cupy_ops, "ITEMS_PER_THREAD", 1)
    launch = ShimLauncher(shim_lib)
    torch.manual_seed(11)
    x = make_input(40, 3, 2, (5,), layout, torch.float64, "contiguous")
    w, b = torch.randn(2, 3, dtype=torch.float64), torch.randn(2, dtype=torch.float64)
    check_against_reference(launch, x, w, b, 2, layout, TOLERANCES[torch.float64])
    blocks = dict(launch.launched)["mfpsn_grad_wb_f64_i32"]
    assert blocks > 4 * 2, "every (tap, channel) pair should have been split over several blocks"


@pytest.mark.parametrize("items", [1, 8])
def test_shim_channels_side_by_side(shim_lib, items, monkeypatch):
    """Time-first (T, N, C) features, channels the contiguous axis: a weight-gradient block sums SHIM_LANES
    channels side by side (a warp reads consecutive channels), over several channel groups (the last one
    partial) and, with one item per thread, several blocks per group."""
    monkeypatch.setattr(cupy_ops, "ITEMS_PER_THREAD", items)
    launch = ShimLauncher(shim_lib)
    torch.manual_seed(17)
    c = 2 * SHIM_LANES + 3
    x = make_input(23, 5, c, (), "time_first", torch.float64, "contiguous")
    w, b = torch.randn(c, 3, dtype=torch.float64), torch.randn(c, dtype=torch.float64)
    check_against_reference(launch, x, w, b, 2, "time_first", TOLERANCES[torch.float64])
    groups = -(-c // SHIM_LANES)
    blocks = dict(launch.launched)["mfpsn_grad_wb_f64_i32"]
    assert blocks % (4 * groups) == 0 and (blocks > 4 * groups or items > 1)


@pytest.mark.parametrize("layout", ops.LAYOUTS)
def test_shim_without_bias_and_expanded_grad(shim_lib, layout):
    # h.sum() hands backward an expanded (stride 0) gradient; no bias means no bias blocks.
    launch = ShimLauncher(shim_lib)
    x = make_input(6, 2, 3, (2,), layout, torch.float64, "contiguous")
    w = torch.randn(3, 2, dtype=torch.float64)
    ones = torch.ones((), dtype=torch.float64).expand(x.shape)
    check_against_reference(launch, x, w, None, 3, layout, TOLERANCES[torch.float64], grad_out=ones)
    assert dict(launch.launched)["mfpsn_grad_wb_f64_i32"] == 2 * 3  # k * C pairs, one block each


def test_shim_mixed_dtypes_and_frozen_weight(shim_lib):
    # float16 x with float32 weight computes in float32 (torch's promotion); no grad for a frozen W.
    launch = ShimLauncher(shim_lib)
    x = torch.randn(5, 2, 3, dtype=torch.float16).requires_grad_()
    w = torch.randn(3, 2)
    h = cupy_ops.charge_with(launch, x, w, None, 1, "time_first")
    assert h.dtype == torch.float32
    torch.testing.assert_close(h, reference.charge(x.float(), w, None, 1, "time_first"))
    (gx,) = torch.autograd.grad(h.sum(), x)
    assert gx.dtype == torch.float16
    assert not any(name.startswith("mfpsn_grad_wb") for name in dict(launch.launched))


@pytest.mark.parametrize("layout", ops.LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_shim_64_bit_indices(shim_lib, layout, dtype, monkeypatch):
    """The 64-bit kernels, which a launch whose indices or offsets pass 2**31 - 1 runs, give the same
    results (forced here by a limit of 0)."""
    monkeypatch.setattr(cupy_ops, "INDEX32_LIMIT", 0)
    launch = ShimLauncher(shim_lib, max_blocks=2)
    torch.manual_seed(13)
    x = make_input(9, 2, 3, (2,), layout, dtype, "strided")
    w, b = torch.randn(3, 3, dtype=dtype), torch.randn(3, dtype=dtype)
    check_against_reference(launch, x, w, b, 2, layout, TOLERANCES[dtype])
    assert {name for name, _ in launch.launched} == {f"mfpsn_{kind}_{cupy_ops.DTYPES[dtype][0]}"
                                                     for kind in ("forward", "grad_x", "grad_wb")}


def test_index_width_follows_what_a_launch_reaches(shim_lib, monkeypatch):
    """32-bit index kernels where every element index (plus a grid's stride) and every offset a launch
    reaches fits in ``INDEX32_LIMIT``, else the 64-bit ones; the same answers either way. (The limit is
    lowered here so that small tensors cross it.)"""
    limit = 4096
    monkeypatch.setattr(cupy_ops, "INDEX32_LIMIT", limit)
    block = ShimLauncher(shim_lib).block
    assert block < limit - 200
    small = torch.randn(4, 2, 3, 5)                                   # 120 elements, small strides
    big = torch.randn(4, 2, 3, (limit - block) // 24 + 1)             # elements + a grid's stride > limit
    sliced = torch.randn(4, 2, 3, 400)[..., :5]                       # 120 elements, offsets up to ~9200
    for x, wide_kernels in ((small, set()), (big, {"forward", "grad_x", "grad_wb"}), (sliced, {"forward", "grad_wb"})):
        launch = ShimLauncher(shim_lib, max_blocks=1)
        check_against_reference(launch, x, torch.randn(3, 2), torch.randn(3), 2, "time_first",
                                TOLERANCES[torch.float32])
        narrow = {name.removeprefix("mfpsn_").removesuffix("_i32").rsplit("_", 1)[0]: name.endswith("_i32")
                  for name, _ in launch.launched}  # kernel -> launched with 32-bit indices
        assert narrow == {kind: kind not in wide_kernels for kind in ("forward", "grad_x", "grad_wb")}, x.stride()


def test_shim_is_deterministic(shim_lib):
    launch = ShimLauncher(shim_lib)
    x = torch.randn(30, 4, 3, 5).requires_grad_()
    w = torch.randn(3, 4).requires_grad_()
    g = torch.randn(x.shape)
    runs = [torch.autograd.grad(cupy_ops.charge_with(launch, x, w, None, 2, "time_first"), w, g)[0]
            for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


class Copies(TorchDispatchMode):
    """Records the PyTorch operators (neither views nor allocations) that write a tensor of ``numel``
    elements: what a launch copies of its input before the kernels read it."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (not func.is_view and not func.overloadpacket.__name__.startswith(("empty", "new_empty"))
                and isinstance(out, torch.Tensor) and out.numel() == self.numel):
            self.ops.append(func.overloadpacket.__name__)
        return out


def test_strided_inputs_are_read_in_place(shim_lib):
    """A permuted time-first input is read through its strides, never copied; one whose feature axes do
    not merge into one stride is copied once (the documented fallback). Both give the reference's answer."""
    base = torch.randn(2, 7, 3, 4)  # (N, T, C, M) in memory, seen as time-first (T, N, C, M)
    permuted = base.transpose(0, 1)
    reversed_ = torch.randn(3, 2, 4, 2, 7).permute(4, 3, 2, 1, 0)  # (T, N, C, 2, 3) with features reversed
    for x, copies in ((permuted, []), (reversed_, ["clone"])):
        w = torch.randn(x.shape[2], 2)
        with Copies(x.numel()) as seen:
            h = cupy_ops.charge_with(ShimLauncher(shim_lib), x, w, None, 1, "time_first")
        assert seen.ops == copies
        torch.testing.assert_close(h, reference.charge(x.double(), w.double(), None, 1, "time_first").float(),
                                   rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- 3. availability
@pytest.fixture
def without_cupy_registered(monkeypatch):
    """No 'cupy' in the registry during the test; afterwards, the test's patches undone, the machine's
    real availability is found again, as at import."""
    ops.unregister("cupy")
    yield
    monkeypatch.undo()
    ops.unregister("cupy")
    cupy_ops.register_if_available()


def _find_spec_where(monkeypatch, cupy_installed):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "cupy":
            return importlib.machinery.ModuleSpec("cupy", None) if cupy_installed else None
        return real(name, *args, **kwargs)
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_without_cupy_backend_cupy_is_a_clear_error(monkeypatch, without_cupy_registered):
    _find_spec_where(monkeypatch, cupy_installed=False)
    assert "not installed" in cupy_ops.register_if_available()
    assert "cupy" not in ops.available_backends() and "cupy" not in ops.names()
    with pytest.raises(ImportError, match=r"backend='cupy' needs the cupy package.*pip install cupy"):
        MulFreeChannelwisePSN(4, backend="cupy")
    # asked for as a method: the same kind of error (it was a ValueError) with the install hint, and still
    # a ValueError for code that caught that
    with pytest.raises(ImportError, match=r"method 'cupy' cannot run here: .*not installed \(pip install cupy"):
        MulFreeChannelwisePSN(4, method="cupy")
    with pytest.raises(ValueError, match="method 'cupy' cannot run here"):
        MulFreeChannelwisePSN(4, method="cupy")
    sn = MulFreeChannelwisePSN(4, step_mode="m")
    with pytest.raises(ImportError, match="cupy"):
        sn.backend = "cupy"
    if sj.HAS_SET_BACKEND:  # SpikingJelly's own set_backend warns and leaves the neuron alone
        sj.functional.set_backend(torch.nn.Sequential(sn), "cupy")
    assert sn.backend == "torch" and sn(torch.randn(3, 2, 4)).shape == (3, 2, 4)


def test_cupy_without_cuda_device_is_not_available(monkeypatch, without_cupy_registered):
    _find_spec_where(monkeypatch, cupy_installed=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no CUDA device" in cupy_ops.register_if_available()
    assert "cupy" not in ops.available_backends() and "cupy" not in ops.names()
    with pytest.raises(ImportError, match="backend='cupy' cannot run here: .*no CUDA device"):
        MulFreeChannelwisePSN(4, backend="cupy")


def test_cupy_with_cuda_device_registers(monkeypatch, without_cupy_registered):
    _find_spec_where(monkeypatch, cupy_installed=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cupy_ops.register_if_available() is None
    assert "cupy" in ops.available_backends() and ops.names(backend="cupy") == ["cupy"]
    sn = MulFreeChannelwisePSN(4, backend="cupy", step_mode="m")
    assert sn.supported_methods == ["cupy"]
    if sj.HAS_SET_BACKEND:  # SpikingJelly's own set_backend switches the neuron to cupy
        other = MulFreeChannelwisePSN(4, step_mode="m")
        sj.functional.set_backend(torch.nn.Sequential(other), "cupy")
        assert other.backend == "cupy"
    # CPU tensors are refused with a reason, not run.
    reasons = ops.get("cupy").not_supported_reasons(torch.randn(3, 2, 4), torch.randn(4, 2), 1, "time_first")
    assert any("CUDA device" in r for r in reasons)
    with pytest.raises(ValueError, match="CUDA device"):
        sn(torch.randn(3, 2, 4))


def test_requirements_name_dtype():
    x = torch.zeros(3, 2, 4, dtype=torch.int32, device="meta")
    reasons = cupy_ops.IMPLEMENTATION.not_supported_reasons(x, torch.zeros(4, 2, dtype=torch.int32), 1,
                                                             "time_first")
    assert any("dtype" in r for r in reasons) and any("CUDA" in r for r in reasons)


# ---------------------------------------------------------------- 4. a real GPU
@pytest.mark.skipif(cupy_ops.unavailable_reason() is not None,
                    reason=f"needs cupy and a CUDA device: {cupy_ops.unavailable_reason()}")
@pytest.mark.parametrize("layout", ops.LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_gpu_matches_reference(layout, dtype):
    torch.manual_seed(0)
    for k, dilation, t in [(1, 1, 4), (2, 1, 16), (3, 2, 3), (5, 3, 40)]:
        x = make_input(t, 4, 6, (3, 2), layout, dtype, "contiguous").cuda()
        w, b = torch.randn(6, k, dtype=dtype, device="cuda"), torch.randn(6, dtype=dtype, device="cuda")
        h = ops.charge(x, w, b, dilation, layout, "cupy")
        torch.testing.assert_close(h.double().cpu(), reference.charge(x.double().cpu(), w.double().cpu(),
                                                                      b.double().cpu(), dilation, layout),
                                   **TOLERANCES[dtype])
        g = torch.randn_like(h)
        xs, ws, bs = (v.detach().requires_grad_() for v in (x, w, b))
        grads = torch.autograd.grad(ops.charge(xs, ws, bs, dilation, layout, "cupy"), (xs, ws, bs), g)
        xr, wr, br = (v.detach().double().cpu().requires_grad_() for v in (x, w, b))
        grads_ref = torch.autograd.grad(reference.charge(xr, wr, br, dilation, layout), (xr, wr, br),
                                        g.double().cpu())
        for got, want in zip(grads, grads_ref):
            torch.testing.assert_close(got.double().cpu(), want, **TOLERANCES[dtype])
