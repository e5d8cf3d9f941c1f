"""Triton's compiled launch path on a machine without a GPU: a stand-in for its CUDA driver.

Kernels are specialised and compiled for real (CUDA code for sm_90, which needs no GPU); each launch is
handed, with the arguments and grid the launcher got, to ``on_launch``, and is not run on a device.
:func:`install` (before the package is imported, without ``TRITON_INTERPRET``) makes it the active driver,
serving CPU tensors, so that the package's Triton method runs on CPU tensors through the very code that
launches on a GPU:

* ``execute=True``: each launch runs through Triton's interpreter from the launcher's arguments, so
  the results are real and a test can compare them with the reference;
* ``verify=True``: each launch checks that its compiled kernel is the one Triton's own specialisation
  of those arguments selects (``JITFunction.run(..., warmup=True)``);
* neither (timing the host): a kernel's ``OK`` flag, where it has one, is set to finite; nothing runs.

``LAUNCHES`` counts the launches; ``THROUGH_TRITON`` those that went through ``JITFunction.run``.
"""
from __future__ import annotations

import contextlib
import types

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

LAUNCHES = {"n": 0}
THROUGH_TRITON = {"n": 0}
_MODE = {"execute": False, "verify": False}
_INTERPRETED = {}


def _interpreted(fn) -> InterpretedFunction:
    return _INTERPRETED.setdefault(fn, InterpretedFunction(fn))


@contextlib.contextmanager
def _language_restored():
    """Put back what the interpreter patched in triton.language: a helper that a kernel calls (``tl.cdiv``)
    patches it for good, which breaks every later compilation."""
    spaces = (tl, tl.core, tl.math, tl.standard, tl.core.tensor, tl.core.tensor_descriptor_base)
    saved = [(space, dict(vars(space))) for space in spaces]
    try:
        yield
    finally:
        for space, before in saved:
            for name, value in list(vars(space).items()):
                if name in before and value is not before[name]:  # (names it adds are its helpers: kept)
                    setattr(space, name, before[name])


class _Launcher:
    """Triton's ``launcher_cls``: one per compiled kernel, called with the grid, the stream, the kernel's
    handles and every parameter's argument in order."""

    def __init__(self, src, metadata):
        self.jit, self.metadata = src.fn, metadata

    def __call__(self, gx, gy, gz, stream, function, packed, launch_metadata, enter_hook, exit_hook, *args):
        LAUNCHES["n"] += 1
        grid = (gx, gy, gz)
        if enter_hook is not None:  # (as the CUDA launcher: each hook with the launch metadata)
            enter_hook(launch_metadata)
        if _MODE["verify"]:
            md = self.metadata
            chosen = self.jit.run(*args, grid=grid, warmup=True, num_warps=md.num_warps, num_stages=md.num_stages)
            if chosen.hash != md.hash:
                raise AssertionError(f"{self.jit.__name__}: launched the compiled kernel {md.hash}, Triton "
                                     f"specialises these arguments as {chosen.hash}")
        if _MODE["execute"]:
            with _language_restored():
                _interpreted(self.jit.fn)[grid](*args)
        elif "OK" in self.jit.arg_names:
            args[self.jit.arg_names.index("OK")].fill_(1)
        if exit_hook is not None:
            exit_hook(launch_metadata)


class FakeCudaDriver(DriverBase):
    """Compiles for an sm_90 GPU; launches go to :class:`_Launcher`; the tensors are the CPU's."""

    def __init__(self):
        properties = {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536,
                      "warpSize": 32}
        self.utils = types.SimpleNamespace(load_binary=lambda name, kernel, shared, device: (1, 1, 32, 0, 1024),
                                           get_device_properties=lambda device: properties)
        self.launcher_cls = _Launcher

    @classmethod
    def is_active(cls):
        return True

    def map_python_to_cpp_type(self, ty):
        return ty

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch
        return torch.device("cpu")

    def get_benchmarker(self):
        def bench(fn, quantiles=None, **kwargs):  # every config as fast: the autotuner keeps the first
            fn()
            return [1.0] * len(quantiles) if quantiles else 1.0
        return bench


def install(execute: bool = False, verify: bool = False) -> None:
    """Make :class:`FakeCudaDriver` Triton's active driver (see the module)."""
    _MODE.update(execute=execute, verify=verify)
    triton.runtime.driver.set_active(FakeCudaDriver())
    real_run = JITFunction.run

    def run(self, *args, **kwargs):
        if not kwargs.get("warmup"):
            THROUGH_TRITON["n"] += 1
        return real_run(self, *args, **kwargs)
    JITFunction.run = run
    # A kernel run by the interpreter calls its helpers (JIT functions) as the interpreter does, inside the
    # kernel's patch of triton.language (the interpreter's own call would patch it again, for good).
    JITFunction.__call__ = lambda self, *args, **kwargs: _interpreted(self.fn)(*args, **kwargs)
