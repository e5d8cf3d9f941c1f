"""Time-last versions of SpikingJelly's stateless layers (paper Appendix B).

SpikingJelly runs a stateless layer on a time-first sequence ``(T, N, ...)`` by fusing T and N into one
batch dimension, which is a free view. In the time-last layout ``(N, C, ..., T)`` that fusion would
copy, so each kind of layer gets its own way of running every time step at once:

* ``'vmap'``: the layer's single-step function vectorised over the last dim (``torch.vmap``, through
  SpikingJelly's ``t_last_seq_to_ann_forward`` where installed);
* ``'highdim'``: an n-d convolution / pooling as an (n+1)-d one whose kernel along T is 1 (stride 1,
  padding 0, dilation 1); adaptive pools keep T; ``Linear`` as a 1x1 ``Conv1d`` over ``(N*, F, T)``;
* batch normalisation needs neither: ``F.batch_norm`` on ``(N, C, ..., T)`` normalises over every dim
  but C, the same elements (so the same statistics) as SpikingJelly's ``(T*N, C, ...)``;
* ``Flatten`` flattens dims 1..-2; ``Dropout`` draws one ``(N, ...)`` mask for all steps.

Each wrapper is a time-last *view* of one time-first module: it shares that module's parameter, buffer
and submodule dictionaries, so its parameters are the module's own tensors and its state_dict has the
same keys and values (a checkpoint loads in either layout). ``wrapper.time_first_module`` gives the
module back. :func:`time_last` picks the wrapper for a module.

Wrappers with two ways (:class:`TimeLastConv`, :class:`TimeLastPool`, :class:`TimeLastLinear`) follow
the neuron's tuning protocol: ``supported_methods`` (a tuple), a settable ``method`` (``'auto'`` or
one of them) and ``resolve_method(x_seq)`` (what ``'auto'`` runs: :func:`default_method`).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules import pooling
from torch.nn.modules.utils import _ntuple
from torch.nn.utils import parametrize

from . import _compat
from ._compat import MemoryModule, MultiStepModule
from ._util import autocasting
from .neuron import FusedBatchNorm

METHODS = ("vmap", "highdim")


def default_method(supported_methods) -> str:
    """What ``method='auto'`` runs before any autoselect pass: ``'highdim'`` where supported.

    Heuristic from ``benchmarks/time_last_layers.py`` on CPUs: for convolutions and max/average pools,
    which dominate a network's time, one (n+1)-d kernel call matches or beats vmap, whose batching rule
    moves T next to N and copies the input and output; global adaptive pools and Linear sometimes
    favour vmap, so an autoselect pass should time both.
    """
    return "highdim" if "highdim" in supported_methods else supported_methods[0]


def _torch_forward(module: nn.Module) -> Callable:
    """The single-step forward of ``module``: the forward of the torch.nn class it derives from.

    SpikingJelly's stateless layers subclass a torch.nn layer and only add the step-mode handling, so
    the torch.nn forward is exactly one time step of them.
    """
    for cls in type(module).__mro__:
        if cls is nn.Module and hasattr(module, "single_step_forward"):  # a SpikingJelly-only layer
            return type(module).single_step_forward
        if cls.__module__.startswith("torch.nn.modules"):
            return cls.forward
    return type(module).forward


def _channels_last(x: torch.Tensor) -> bool:
    return x.dim() in (4, 5) and x.is_contiguous(memory_format=torch.channels_last if x.dim() == 4
                                                 else torch.channels_last_3d)


def _check_tensor(x, owner: nn.Module) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{type(owner).__name__} expects a tensor, got {type(x).__name__}")


def _check_rank(x: torch.Tensor, ranks, what: str, owner: nn.Module) -> None:
    _check_tensor(x, owner)
    if x.dim() not in ranks:
        raise ValueError(f"{type(owner).__name__} expects a time-last sequence {what}, "
                         f"got shape {tuple(x.shape)}")


class _OnWrapped:
    """An attribute of a wrapper that lives on the module it wraps (until the module is attached, on the
    wrapper): one ``training`` flag for both layouts, and the flag a full backward hook registered on
    either one sets."""

    def __set_name__(self, owner, name: str) -> None:
        self.name, self.own = name, f"_own{name}"

    def __get__(self, wrapper, owner=None):
        if wrapper is None:
            return self
        inner = wrapper.__dict__.get("_time_first")
        return wrapper.__dict__[self.own] if inner is None else getattr(inner, self.name)

    def __set__(self, wrapper, value) -> None:
        inner = wrapper.__dict__.get("_time_first")
        if inner is None:  # (nn.Module.__init__, before the module is attached)
            wrapper.__dict__[self.own] = value
        else:
            setattr(inner, self.name, value)


class _View:
    """What every wrapper shares with its module: train/eval mode, the hook dictionaries and flags."""

    training = _OnWrapped()
    _is_full_backward_hook = _OnWrapped()

    @property
    def time_first_module(self) -> nn.Module:
        """The wrapped time-first module (same parameters and buffers, hooks, and train/eval mode)."""
        return self._time_first

    def _replicate_for_data_parallel(self):
        # (torch's replicas set copies of the parameters on the replica, which would reach the shared module)
        raise RuntimeError(f"{type(self).__name__}, a time-last view sharing its layer's parameters, cannot be "
                           f"replicated by nn.DataParallel: convert the network with to_time_first(net) first, or "
                           f"use DistributedDataParallel")


def _attach(wrapper: nn.Module, module: nn.Module) -> None:
    """Make ``wrapper`` a multi-step view of ``module``: it keeps ``module`` (``_time_first``), shares its
    train/eval mode and gets its very hook dictionaries. A wrapper runs ``module``'s forward without
    ``module.__call__``, so hooks registered on either (before or after a conversion) run on the
    wrapper's call, on ``(N, ..., T)``."""
    for name, value in vars(module).items():
        if name.endswith(("_hooks", "_hooks_with_kwargs", "_hooks_always_called")) and isinstance(value, dict):
            object.__setattr__(wrapper, name, value)
    object.__setattr__(wrapper, "_time_first", module)
    wrapper.step_mode = "m"


class _MultiStepOnly:
    """``step_mode`` of a layer that only runs whole time-last sequences: ``'m'``, and a clear error for
    ``'s'`` (e.g. ``functional.set_step_mode(net, 's')`` on a converted network)."""

    @property
    def step_mode(self) -> str:
        return "m"

    @step_mode.setter
    def step_mode(self, value: str) -> None:
        if value != "m" and "_time_first" in self.__dict__:  # (not SpikingJelly's MemoryModule.__init__'s 's')
            raise ValueError(f"{type(self).__name__} is a time-last layer and runs whole sequences only "
                             f"(step_mode='m', got {value!r}); convert the network back with "
                             f"spikingjelly_mfpsn.convert.to_time_first(net) before setting step_mode='s'")


class TimeLastModule(_View, _MultiStepOnly, nn.Module, MultiStepModule):
    """Base of the wrappers: a time-last view of the time-first module ``module``.

    Shares ``module``'s parameters, buffers, submodules and hooks (the very dictionaries), saves and loads
    state exactly as ``module`` does, and only runs multi-step (``step_mode='m'``) on ``(N, ..., T)``.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        if not isinstance(module, nn.Module) or isinstance(module, TimeLastModule):
            raise TypeError(f"module must be a time-first torch.nn.Module, got {type(module).__name__}")
        for name in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
            object.__setattr__(self, name, getattr(module, name))
        self._version = getattr(module, "_version", 1)
        _attach(self, module)

    def __getattr__(self, name: str):
        """Parameters, buffers and submodules (the module's own dictionaries), then the module's other
        attributes: a wrapper runs the module's forward on itself, so a tensor a hook sets on the wrapper
        (``torch.nn.utils.spectral_norm``, ``prune``) or a parametrization registered on either is read."""
        d = self.__dict__
        for store in ("_parameters", "_buffers", "_modules"):
            if name in d.get(store, ()):
                return d[store][name]
        inner = d.get("_time_first")
        if inner is None or name.startswith("__"):
            return super().__getattr__(name)
        return getattr(inner, name)

    def _on_module(self, name: str) -> Optional[nn.Module]:
        """The module, where attribute ``name`` is set and deleted on it: all but the wrapper's own
        (declared on its class, e.g. ``step_mode``, or set before the module was attached)."""
        inner = self.__dict__.get("_time_first")
        return None if inner is None or name in self.__dict__ or hasattr(type(self), name) else inner

    def __setattr__(self, name: str, value) -> None:
        """Set on the module (``momentum``, a weight a hook such as ``prune`` sets on the wrapper: every
        method reads the module's), or the wrapper's own (see :meth:`_on_module`)."""
        inner = self._on_module(name)
        if inner is None:
            super().__setattr__(name, value)
        else:
            setattr(inner, name, value)

    def __delattr__(self, name: str) -> None:
        inner = self._on_module(name)
        if inner is None:
            super().__delattr__(name)
        else:
            delattr(inner, name)

    def _step(self, x: torch.Tensor) -> torch.Tensor:
        """One time step ``(N, ...)`` through the wrapped module's forward, run on the wrapper."""
        return _torch_forward(self._time_first)(self, x)

    def _vmap(self, x_seq: torch.Tensor) -> torch.Tensor:
        """Every step at once with ``torch.vmap``.

        A sequence of zero steps ``(N, ..., 0)`` runs as the time-first layer runs it (one batch of
        T*N = 0 samples): vmap over an empty dim and the (n+1)-d kernels refuse it or get its shape wrong.
        ``torch.vmap`` runs its function without autocast, so a reduced-precision input would meet the
        layer's full-precision parameters (an error): under autocast a layer with floating parameters
        gets its input in their dtype and runs in full precision.
        """
        if not x_seq.shape[-1]:
            y = self._step(x_seq.movedim(-1, 0).flatten(0, 1))
            return y.reshape(0, x_seq.shape[0], *y.shape[1:]).movedim(0, -1)
        if autocasting(x_seq):
            x_seq = x_seq.to(next((p.dtype for p in self.parameters() if p.is_floating_point()), x_seq.dtype))
        return _compat.t_last_seq_to_ann_forward(x_seq, self._step)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        self._time_first._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, *args, **kwargs):
        self._time_first._load_from_state_dict(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"{type(self._time_first).__name__}({self._time_first.extra_repr()})"


class _Tunable:
    """The tuning protocol the autoselect pass relies on (the same one the neuron has).

    ``supported_methods``: tuple of method names this instance can run; ``method``: ``'auto'`` or one
    of them (settable; a bad name raises ``ValueError``); ``resolve_method(x_seq)``: the method a
    forward on ``x_seq`` runs. Switching methods never changes parameters or outputs.
    """

    supported_methods: tuple = METHODS
    _method = "auto"

    @property
    def method(self) -> str:
        return self._method

    @method.setter
    def method(self, value: str) -> None:
        if value != "auto" and value not in self.supported_methods:
            raise ValueError(f"method of {type(self).__name__} must be 'auto' or one of "
                             f"{self.supported_methods}, got {value!r}")
        self._method = value

    def resolve_method(self, x_seq: Optional[torch.Tensor] = None) -> str:
        return default_method(self.supported_methods) if self._method == "auto" else self._method

    def forward(self, x_seq: torch.Tensor) -> torch.Tensor:
        self._check_input(x_seq)
        if x_seq.shape[-1] and self.resolve_method(x_seq) == "highdim":
            return self._highdim(x_seq)
        return self._vmap(x_seq)  # (which also runs a sequence of zero steps)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, method={self._method!r}"


def _lookup(module: nn.Module, table: dict):
    """``table[cls]`` for the first ``cls`` in ``table`` that ``module`` is an instance of."""
    for cls, value in table.items():
        if isinstance(module, cls):
            return value
    raise TypeError(f"expected one of {[c.__name__ for c in table]}, got {type(module).__name__}")


class _SpatialLayer(_Tunable, TimeLastModule):
    """Base of the conv and pool wrappers: an n-d layer (looked up in ``_DIMS``) on
    ``(N, C, *spatial, T)``; ``'highdim'`` exists for n <= 2 (there is no 4-d conv or pool)."""

    _DIMS: dict = {}
    dims = 0  # (the wrapper's own: n of an n-d layer)

    def __init__(self, module: nn.Module, method: str = "auto"):
        dims = _lookup(module, self._DIMS)
        super().__init__(module)
        self.dims = dims
        self.supported_methods = METHODS if dims < 3 else ("vmap",)
        self.method = method

    def _check_input(self, x: torch.Tensor) -> None:
        _check_rank(x, (self.dims + 3,), f"of {self.dims + 3} dims (N, C, *spatial, T)", self)


class TimeLastConv(_SpatialLayer):
    """``Conv1d``/``Conv2d``/``Conv3d`` on ``(N, C, *spatial, T)``.

    ``'highdim'`` runs Conv1d as Conv2d and Conv2d as Conv3d (weight viewed with a trailing kernel
    dim of 1); Conv3d has no 4-d counterpart and runs ``'vmap'`` only.
    """

    _DIMS = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}

    def _check_input(self, x: torch.Tensor) -> None:
        super()._check_input(x)
        if x.shape[1] != self._time_first.in_channels:
            raise ValueError(f"{type(self).__name__} expects {self._time_first.in_channels} channels on dim 1, "
                             f"got shape {tuple(x.shape)}")

    def _highdim(self, x: torch.Tensor) -> torch.Tensor:
        conv = self._time_first
        padding = conv.padding if isinstance(conv.padding, str) else (*conv.padding, 0)
        if conv.padding_mode != "zeros":
            x = F.pad(x, [0, 0, *conv._reversed_padding_repeated_twice], mode=conv.padding_mode)
            padding = 0
        conv_fn = F.conv2d if self.dims == 1 else F.conv3d
        # (self.weight: a parametrization's or a weight hook's, see __getattr__; contiguous: torch's CPU
        # grouped conv3d misreads a channels-last weight viewed with a new last dim)
        weight = self.weight.unsqueeze(-1).contiguous()
        return conv_fn(x, weight, self.bias, (*conv.stride, 1), padding, (*conv.dilation, 1), conv.groups)


# Pooling family -> its 2d and 3d functions, which run the 1d and 2d pools with a window of 1 along T.
_POOL_FN = {pooling._MaxPoolNd: (F.max_pool2d, F.max_pool3d), pooling._AvgPoolNd: (F.avg_pool2d, F.avg_pool3d),
            pooling._AdaptiveAvgPoolNd: (F.adaptive_avg_pool2d, F.adaptive_avg_pool3d),
            pooling._AdaptiveMaxPoolNd: (F.adaptive_max_pool2d, F.adaptive_max_pool3d)}


class TimeLastPool(_SpatialLayer):
    """Max/average/adaptive pooling (1d, 2d; 3d with ``'vmap'`` only) on ``(N, C, *spatial, T)``."""

    _DIMS = {nn.MaxPool1d: 1, nn.MaxPool2d: 2, nn.MaxPool3d: 3, nn.AvgPool1d: 1, nn.AvgPool2d: 2,
             nn.AvgPool3d: 3, nn.AdaptiveAvgPool1d: 1, nn.AdaptiveAvgPool2d: 2, nn.AdaptiveAvgPool3d: 3,
             nn.AdaptiveMaxPool1d: 1, nn.AdaptiveMaxPool2d: 2, nn.AdaptiveMaxPool3d: 3}

    def __init__(self, pool: nn.Module, method: str = "auto"):
        if getattr(pool, "return_indices", False):
            raise ValueError(f"{type(pool).__name__}(return_indices=True) has no time-last wrapper: "
                             f"it returns a tuple, not a sequence")
        super().__init__(pool, method)

    def resolve_method(self, x_seq: Optional[torch.Tensor] = None) -> str:
        """As for every wrapper, except where a 2d pool runs ``'vmap'``: on a float16/bfloat16 input, or
        under autocast, on the CPU (torch's CPU 3d average pool has no 16-bit kernel, and CPU autocast
        runs 3d pools in float32 where 2d ones keep the dtype); and an average pool whose window is
        larger than the unpadded input (torch's 3d average pool refuses it, the 2d one pads first)."""
        method = super().resolve_method(x_seq)
        if method != "highdim" or self.dims != 2 or x_seq is None:
            return method
        if x_seq.device.type == "cpu" and (x_seq.dtype in (torch.float16, torch.bfloat16)
                                           or torch.is_autocast_enabled("cpu")):
            return "vmap"
        pool = self._time_first
        if isinstance(pool, pooling._AvgPoolNd) and any(
                size < k for size, k in zip(x_seq.shape[2:4], _ntuple(2)(pool.kernel_size))):
            return "vmap"
        return method

    def _highdim(self, x: torch.Tensor) -> torch.Tensor:
        """The pool as a (d+1)-dimensional one whose window along T is one step."""
        pool, t = self._time_first, _ntuple(self.dims)
        fn = _lookup(pool, _POOL_FN)[self.dims - 1]
        if isinstance(pool, (pooling._AdaptiveAvgPoolNd, pooling._AdaptiveMaxPoolNd)):
            if self.dims == 1 and None in t(pool.output_size):  # (the 1d pools take no None: their error)
                return self._vmap(x)
            return fn(x, (*t(pool.output_size), None))  # output size None along T keeps every step
        window = (*t(pool.kernel_size), 1), (*t(pool.stride), 1), (*t(pool.padding), 0)
        if isinstance(pool, pooling._MaxPoolNd):
            return fn(x, *window, (*t(pool.dilation), 1), pool.ceil_mode)
        return fn(x, *window, pool.ceil_mode, pool.count_include_pad, getattr(pool, "divisor_override", None))


class TimeLastLinear(_Tunable, TimeLastModule):
    """``Linear`` on ``(N, *, F, T)``: features on dim -2.

    ``'highdim'`` is a 1x1 ``Conv1d`` over ``(N*, F, T)``; ``'vmap'`` runs ``Linear`` on each step.
    """

    def __init__(self, linear: nn.Linear, method: str = "auto"):
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"expected a Linear, got {type(linear).__name__}")
        super().__init__(linear)
        self.method = method

    def _check_input(self, x: torch.Tensor) -> None:
        _check_rank(x, range(3, 64), "(N, *, F, T) with the features on dim -2", self)
        if x.shape[-2] != self._time_first.in_features:
            raise ValueError(f"{type(self).__name__} expects in_features={self._time_first.in_features} on dim -2 "
                             f"of (N, *, F, T), got shape {tuple(x.shape)}")

    def _highdim(self, x: torch.Tensor) -> torch.Tensor:
        f, t = x.shape[-2:]
        if not f or not self._time_first.out_features:  # (torch's conv1d refuses zero channels either way;
            return self._vmap(x)                        # a Linear(0, n) gives its bias)
        y = F.conv1d(x.flatten(0, -3), self.weight.unsqueeze(-1), self.bias)  # (self.weight: see __getattr__)
        return y.reshape(*x.shape[:-2], y.shape[1], t)


_BN_RANKS = {nn.BatchNorm1d: (3, 4), nn.BatchNorm2d: (5,), nn.BatchNorm3d: (6,)}


class TimeLastBatchNorm(TimeLastModule):
    """``BatchNorm1d/2d/3d`` on ``(N, C, ..., T)``.

    Runs ``F.batch_norm`` on the module's own parameters and buffers: the same statistics (and
    running-statistics updates) as time-first. A batch norm fused into the neuron after it
    (:func:`~spikingjelly_mfpsn.functional.fuse_batchnorm`) passes X through, as it does time-first.
    """

    ranks = ()  # (the wrapper's own: the ranks of the time-last sequences it takes)

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm):
        ranks = _lookup(bn, _BN_RANKS)
        super().__init__(bn)
        self.ranks = ranks

    def forward(self, x_seq: torch.Tensor) -> torch.Tensor:
        _check_rank(x_seq, self.ranks, f"of {' or '.join(map(str, self.ranks))} dims (N, C, ..., T)", self)
        bn = self._time_first
        if isinstance(bn, FusedBatchNorm):  # (functional.fuse_batchnorm: the neuron after it normalises)
            return bn.forward(x_seq)
        # The same bookkeeping as torch.nn.modules.batchnorm._BatchNorm.forward.
        factor = 0.0 if bn.momentum is None else bn.momentum
        if self.training and bn.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if bn.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        track = not self.training or bn.track_running_stats
        return _compat.batch_norm(x_seq, self.running_mean if track else None, self.running_var if track else None,
                                  self.weight, self.bias, use_batch_stats, factor, bn.eps)


class TimeLastFlatten(TimeLastModule):
    """``Flatten`` on ``(N, ..., T)``: the per-step dims ``start_dim..end_dim`` (T stays last).

    Args:
        whole_sequence: the module was applied to the whole ``(T, N, ...)`` sequence (a plain
            ``nn.Flatten`` outside SpikingJelly's containers) rather than to each step, so its dims count
            T and N; ``start_dim`` must then be >= 2 or negative (it may not merge T or N away).
    """

    start_dim = end_dim = None  # (the wrapper's own: its module's, renumbered for time-last sequences)

    def __init__(self, flatten: nn.Flatten, whole_sequence: bool = False):
        if not isinstance(flatten, nn.Flatten):
            raise TypeError(f"expected a Flatten, got {type(flatten).__name__}")
        start, end = flatten.start_dim, flatten.end_dim
        if whole_sequence:
            if 0 <= start < 2:
                raise ValueError(f"Flatten(start_dim={start}) on a whole (T, N, ...) sequence merges time or "
                                 f"batch into features; it has no time-last equivalent")
            start, end = (start - 1 if start >= 0 else start), (end - 1 if end >= 0 else end)
        if start == 0:
            raise ValueError("Flatten(start_dim=0) per step merges the batch into features; it has no "
                             "time-last equivalent")
        super().__init__(flatten)
        # Per-step dim i is time-last dim i (i >= 0) or i - 1 (i < 0, since T is appended).
        self.start_dim, self.end_dim = (start if start >= 0 else start - 1), (end if end >= 0 else end - 1)

    def forward(self, x_seq: torch.Tensor) -> torch.Tensor:
        _check_tensor(x_seq, self)
        n = x_seq.dim()
        start, end = self.start_dim % n, self.end_dim % n
        if not (-n <= self.start_dim < n and -n <= self.end_dim < n and 1 <= start <= end <= n - 2):
            raise ValueError(f"{type(self).__name__} cannot flatten dims {self.start_dim}..{self.end_dim} of a "
                             f"time-last sequence of shape {tuple(x_seq.shape)}: only dims 1..-2 may merge")
        return x_seq.flatten(start, end)

    def extra_repr(self) -> str:
        return f"start_dim={self.start_dim}, end_dim={self.end_dim} (time-last)"


# Layers that also take an unbatched step -> the rank of a batched time-last sequence: one step of another
# rank would run unbatched, reading N as channels (time-first reads T*N, and fails or differs).
_BATCHED_RANKS = {nn.ConvTranspose1d: 4, nn.ConvTranspose2d: 5, nn.ConvTranspose3d: 6}


class TimeLastVmap(TimeLastModule):
    """Any stateless per-step module on ``(N, ..., T)``, vectorised over the last dim."""

    def forward(self, x_seq: torch.Tensor) -> torch.Tensor:
        _check_tensor(x_seq, self)
        rank = next((r for cls, r in _BATCHED_RANKS.items() if isinstance(self._time_first, cls)), None)
        if rank is not None:
            _check_rank(x_seq, (rank,), f"of {rank} dims (N, C, *spatial, T)", self)
        return self._vmap(x_seq)


class TimeLastGroupNorm(TimeLastVmap):
    """``GroupNorm`` on ``(N, C, ..., T)``, each step of each sample normalised on its own, as time-first.

    Through ``torch.group_norm``: ``F.group_norm`` refuses one value per group in a batch of one sample
    (one step of N = 1 here), which time-first passes with its T*N samples. An input in another memory
    format (channels-last) is made contiguous first: group norm under vmap cannot run it.
    """

    def forward(self, x_seq: torch.Tensor) -> torch.Tensor:
        _check_tensor(x_seq, self)  # (a copy in the default format: a channels-last one may also count as contiguous)
        return self._vmap(x_seq if x_seq.is_contiguous() and not _channels_last(x_seq)
                          else x_seq.clone(memory_format=torch.contiguous_format))

    def _step(self, x: torch.Tensor) -> torch.Tensor:
        gn = self._time_first
        return torch.group_norm(x, gn.num_groups, self.weight, self.bias, gn.eps, torch.backends.cudnn.enabled)


_DROPOUT_MASKS = {"Dropout": F.dropout, "Dropout2d": F.dropout2d}


class TimeLastDropout(_View, _MultiStepOnly, MemoryModule):
    """SpikingJelly's multi-step ``Dropout``/``Dropout2d`` on ``(N, ..., T)``.

    One mask, drawn at the first step of a simulation and kept until ``reset_net``, multiplies every step.
    Multi-step only, as the other time-last layers.
    """

    def __init__(self, dropout: nn.Module):
        name = type(dropout).__name__
        if type(dropout) is not _compat.sj_layer(name) or name not in _DROPOUT_MASKS:
            raise TypeError(f"expected SpikingJelly's layer.Dropout or layer.Dropout2d, got {name}")
        super().__init__()
        _attach(self, dropout)
        self._mask_fn = _DROPOUT_MASKS[name]
        self.register_memory("mask", None)

    @property
    def p(self) -> float:
        """The wrapped layer's ``p`` (one setting for both layouts, as every wrapper shares its layer's)."""
        return self._time_first.p

    @p.setter
    def p(self, value: float) -> None:
        self._time_first.p = value

    def _mask_like(self, step: torch.Tensor) -> torch.Tensor:
        if self.mask is None:
            # Same draw as SpikingJelly's create_mask(x_seq[0]): ones in the memory format of the first step
            # (the draw follows memory order: a channels-last step gets the mask SpikingJelly's gets).
            self.mask = self._mask_fn(torch.ones_like(step), self.p, training=True)
        return self.mask

    def multi_step_forward(self, x_seq: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x_seq
        step = x_seq[..., 0] if x_seq.shape[-1] else x_seq.new_empty(x_seq.shape[:-1])  # (no steps: any)
        return x_seq * self._mask_like(step).unsqueeze(-1)

    def extra_repr(self) -> str:
        return f"{type(self._time_first).__name__}, p={self.p}"


class TimeLastSequential(_View, _MultiStepOnly, nn.Sequential, MultiStepModule):
    """SpikingJelly's ``SeqToANNContainer`` (per-step stateless modules) in the time-last layout.

    Its children, each replaced by its time-last wrapper, are applied in order.
    """

    def __init__(self, container: nn.Sequential, children: dict):
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)
        _attach(self, container)


class _TLastSeqToANNContainer(nn.Sequential, MultiStepModule):
    """Stand-in for SpikingJelly 2.x's ``layer.TLastSeqToANNContainer`` where it is missing.

    Single-step stateless modules applied to a time-last ``(N, ..., T)`` sequence with ``torch.vmap``.
    """

    def __init__(self, *args):
        super().__init__(*args)
        for m in self:
            if getattr(m, "step_mode", "s") != "s":
                raise ValueError(f"{type(m).__name__}.step_mode must be 's' inside TLastSeqToANNContainer")

    def forward(self, x_seq: torch.Tensor) -> torch.Tensor:
        return _compat.t_last_seq_to_ann_forward(x_seq, super().forward)


TLastSeqToANNContainer = _compat.TLastSeqToANNContainer or _TLastSeqToANNContainer

# Per-step stateless torch.nn layers (and SpikingJelly's same-named subclasses) -> wrapper.
_WRAPPERS = {
    **{cls: TimeLastConv for cls in TimeLastConv._DIMS},
    **{cls: TimeLastPool for cls in TimeLastPool._DIMS},
    **{cls: TimeLastBatchNorm for cls in _BN_RANKS},
    nn.Linear: TimeLastLinear,
    nn.Flatten: TimeLastFlatten,
    **{cls: TimeLastVmap for cls in (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d, nn.LayerNorm,
                                     nn.Upsample)},
    nn.GroupNorm: TimeLastGroupNorm,
}


# SpikingJelly's own layers, not torch.nn's of the same name: its Dropouts (one mask for all steps) and
# per-step stateless layers only SpikingJelly has (their single_step_forward is one step).
_SJ_WRAPPERS = {**dict.fromkeys(_DROPOUT_MASKS, TimeLastDropout), "VotingLayer": TimeLastVmap}


def wrapper_class(module: nn.Module):
    """The time-last wrapper class for ``module``, or None.

    Matches exact types only (the torch.nn layer, SpikingJelly's subclass of the same name, or the
    compatibility module's stand-in for it), so a subclass with its own forward (e.g. a
    weight-standardised conv) is never silently mis-run.
    """
    kind = type(module)
    if parametrize.is_parametrized(module):  # a class made by torch.nn.utils.parametrize: the layer's own
        kind = kind.__bases__[0]  # (it only adds the parametrized tensors as properties)
    if isinstance(module, FusedBatchNorm):  # (fused into the next neuron, which it passes X to)
        kind = module.batch_norm_class
    name = kind.__name__
    if name in _SJ_WRAPPERS and kind is _compat.sj_layer(name):
        return _SJ_WRAPPERS[name]
    torch_cls = getattr(nn, name, None)
    if kind in (torch_cls, _compat.sj_layer(name), getattr(_compat, name, None)):
        return _WRAPPERS.get(torch_cls)
    return None


def time_last(module: nn.Module, method: str = "auto", whole_sequence: bool = False) -> nn.Module:
    """The time-last wrapper of one per-step stateless layer (raises ``TypeError`` if there is none).

    Args:
        method: for two-way wrappers, ``'auto'``, ``'vmap'`` or ``'highdim'``
        whole_sequence: see :class:`TimeLastFlatten` (only used for ``nn.Flatten``)
    """
    cls = wrapper_class(module)
    if cls is None:
        raise TypeError(f"{type(module).__module__}.{type(module).__name__} has no time-last wrapper")
    if issubclass(cls, _Tunable):
        return cls(module, method=method)
    if cls is TimeLastFlatten:
        return cls(module, whole_sequence=whole_sequence)
    return cls(module)


__all__ = ["METHODS", "TLastSeqToANNContainer", "TimeLastBatchNorm", "TimeLastConv", "TimeLastDropout",
           "TimeLastFlatten", "TimeLastGroupNorm", "TimeLastLinear", "TimeLastModule", "TimeLastPool",
           "TimeLastSequential", "TimeLastVmap", "default_method", "time_last", "wrapper_class"]
