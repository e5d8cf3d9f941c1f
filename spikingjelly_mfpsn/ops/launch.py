"""Triton launches with the argument binding done once per specialisation, not on every launch.

``kernel[grid](*args)`` has Triton bind and specialise every argument, build its cache key from them
and check the kernel's globals before each launch: about 13 us of Python for a kernel of 40
arguments on a server CPU, more than the launch itself, and a neuron layer's training step makes 4 to
8 of them. :class:`Bound` wraps a kernel (a ``triton.jit`` function or an autotuned one) whose
parameters are its tensors, then its ints, then its floats, then its compile-time constants, and
launches it as ``Bound(kernel)[grid](tensors, ints, floats, **constexprs)``. The first launch of each
specialisation goes through Triton (compiling, autotuning) and keeps the compiled kernel it returns;
later launches with the same key launch that compiled kernel directly, as Triton's ``JITFunction.run``
itself launches it once it has found it (launch hooks included).

The key is finer than Triton's own: for each tensor its dtype and whether its address is a multiple
of 16 (what Triton specialises a pointer on), the ints and compile-time constants by value, the floats
by their types (Triton does not specialise floats), the grid (a callable one as itself: grids equal
as keys must give one launch grid for one specialisation) and the current device. Two launches with one key
are one specialisation to Triton, so the kernel kept is the one it would choose. Only the tensors are
looked at one by one: the ints arrive as one tuple, hashed at once.
Under Triton's interpreter, before Triton 3.6, or with ``BIND`` false (the environment variable
``SPIKINGJELLY_MFPSN_TRITON_BIND=0``), every launch goes through Triton; a Triton whose compiled kernels
cannot be launched this way turns binding off with a warning.
"""
from __future__ import annotations

import inspect
import os
import warnings

import triton
from packaging.version import Version
from triton.runtime import driver

# The launch below is JITFunction.run's own, read in Triton 3.6 and 3.9; older ones launch otherwise.
KNOWN = Version(Version(triton.__version__).base_version) >= Version("3.6")
BIND = KNOWN and os.environ.get("SPIKINGJELLY_MFPSN_TRITON_BIND", "1") != "0"
_MAX_KEYS = 256  # specialisations kept per kernel (a training loop meets a handful)


def _jit_function(kernel):
    """The ``triton.jit`` function (or the interpreter's) under autotuners and heuristics."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    while not isinstance(kernel, (JITFunction, InterpretedFunction)):
        kernel = kernel.fn
    return kernel


class Bound:
    """``Bound(kernel)[grid](tensors, ints, floats, **constexprs)`` launches like
    ``kernel[grid](*tensors, *ints, *floats, **constexprs)``; see the module."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.jit = jit = _jit_function(kernel)
        params = getattr(jit, "params", None)
        self.interpreted = params is None  # Triton's interpreter: no compiled kernels, nothing to bind
        self.names = tuple(p.name for p in params or ())
        self.defaults = {p.name: p.default for p in params or () if p.default is not inspect.Parameter.empty}
        self.compiled = {}
        self.__name__ = jit.__name__

    def __getitem__(self, grid):
        if self.interpreted or not BIND:
            kernel = self.kernel[grid]
            return lambda tensors, ints, floats, **constexprs: kernel(*tensors, *ints, *floats, **constexprs)
        return lambda tensors, ints, floats, **constexprs: self._launch(grid, tensors, ints, floats, constexprs)

    def _launch(self, grid, tensors, ints, floats, constexprs):
        device = driver.active.get_current_device()
        key = (device, grid, ints, tuple(map(type, floats)), tuple(constexprs.items()),
               *[(t.dtype, t.data_ptr() % 16 == 0) for t in tensors])
        hit = self.compiled.get(key)
        if hit is None:
            return self._first(key, grid, tensors + ints + floats, constexprs)
        compiled, tail, grid = hit
        full = tensors + ints + floats + tail
        try:  # as JITFunction.run launches (Triton 3.6 to 3.9), the launch metadata only for launch hooks
            enter = triton.knobs.runtime.launch_enter_hook  # (a chain of hooks, usually empty)
            stream = driver.active.get_current_stream(device)
            hooked = enter is not None and getattr(enter, "calls", True)
            metadata = compiled.launch_metadata(grid, stream, *full) if hooked else None
            compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, metadata, enter,
                         triton.knobs.runtime.launch_exit_hook, *full)
        except (AttributeError, TypeError) as e:  # not the compiled-kernel interface this was written for
            _stop_binding(e)
            return self.kernel[grid](*tensors, *ints, *floats, **constexprs)
        return compiled

    def _first(self, key, grid, args, constexprs):
        """Launch through Triton and keep the compiled kernel, with the arguments after ``args`` that the
        launch took (the constants given by name, an autotuner's chosen config, the defaults) and the grid
        it launched (x, y, z)."""
        compiled = self.kernel[grid](*args, **constexprs)
        config = getattr(self.kernel, "best_config", None)
        given = {**self.defaults, **constexprs, **(config.all_kwargs() if config is not None else {})}
        hooks = self.jit.pre_run_hooks or (config is not None and config.pre_hook is not None)
        if compiled is not None and not hooks and all(n in given for n in self.names[len(args):]):
            if len(self.compiled) >= _MAX_KEYS:
                self.compiled.clear()
            tail = tuple(given[n] for n in self.names[len(args):])
            grid = grid(dict(zip(self.names, args + tail))) if callable(grid) else grid
            self.compiled[key] = (compiled, tail, (*grid, 1, 1)[:3])
        return compiled


def _stop_binding(error: Exception) -> None:
    global BIND
    BIND = False
    warnings.warn(f"spikingjelly_mfpsn: launching Triton's compiled kernels directly failed ({error!r}); every "
                  f"launch now goes through Triton", RuntimeWarning, stacklevel=3)
