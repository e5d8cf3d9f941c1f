"""The multiplication-free channel-wise Parallel Spiking Neuron (MF-PSN).

Per channel ``c``, order ``k``, dilation ``d`` (paper Eq. 8-10, Appendix C)::

    H[t, c] = sum_{i<k} Wq[c, i] * X[t - (k-1-i)*d, c] + b[c]      (X[t < 0] = 0)
    S[t, c] = Theta(H[t, c])                                         (surrogate gradient backwards)
    Wq      = Q(W_f),  Q(w) = sign(w) * 2**round(log2|w|)           (whole straight-through estimator)

With ``threshold='bn'`` (default) the threshold is a batch normalisation fused into the weight:
``W_f = gamma / sqrt(var + eps) * W`` and ``b = beta - gamma * mean / sqrt(var + eps)``, where mean and
var are the batch statistics of ``conv(X, W)`` in training and the running statistics in eval.
With ``threshold='param'``, ``W_f = W`` and ``b = -V_th`` with a learnable per-channel ``V_th``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
from torch.nn.modules.lazy import LazyModuleMixin

from . import ops
from . import _compat
from ._compat import MemoryModule, default_surrogate
from .ops.core import check_finite, fold_checked, normalize_input
from .quantize import STE_MODES, quantize, shift_amounts

THRESHOLDS = ("bn", "param")


def exp_init_weight(channels: int, k: int) -> torch.Tensor:
    """``(C, k)`` weights ``(..., 1/4, 1/2, 1)`` per channel, like SpikingJelly's SlidingPSN exp_init.

    Every value is already a power of two, so quantisation leaves the initial neuron unchanged (in float32,
    taps older than 149 steps are 0).
    """
    if not (_is_int(channels) and channels >= 0):
        raise ValueError(f"channels must be an int >= 0, got {channels!r}")
    _check_settings(k=k)
    row = torch.pow(2.0, -torch.arange(k - 1, -1, -1, dtype=torch.float32))
    return row.repeat(channels, 1)


def default_method(x: torch.Tensor, k: int, dilation: int, layout: str, backend: str = "torch",
                   step_mode: str = "m") -> str:
    """The implementation ``method='auto'`` uses before any autoselect pass.

    See ``ops.choose``: the supported implementation of the highest declared priority; on CUDA tensors the
    fused kernels. ``x``: the neuron's input, a sequence in ``layout`` (``step_mode='m'``, at least
    ``(T, N, C)``) or one step ``(N, C, ...)`` (``step_mode='s'``).
    """
    if step_mode not in ("m", "s"):
        raise ValueError(f"step_mode must be 'm' or 's', got {step_mode!r}")
    if not isinstance(x, torch.Tensor) or x.dim() < (3 if step_mode == "m" else 2):
        what = "sequence (T, N, C, ...) or (N, C, ..., T)" if step_mode == "m" else "step (N, C, ...)"
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a {what} for step_mode={step_mode!r}, got {got}")
    _check_settings(k=k, dilation=dilation)
    ops.check_layout(layout)
    ops.check_backend(backend)
    channels = x.shape[ops.channel_dim(layout) if step_mode == "m" else 1]
    return ops.choose(x, x.new_empty(channels, k), dilation, layout, backend)


class LazyBuffer(nn.UninitializedBuffer):
    """torch's ``UninitializedBuffer``, which ``copy.deepcopy`` copies as it does an ``UninitializedParameter``
    (pytorch/pytorch#83168 fixed it for parameters only): a network right after ``replace_neurons``
    holds lazy neurons. tests/test_neuron.py tells when torch's own copies."""

    def __deepcopy__(self, memo):
        if id(self) not in memo:  # (a cast, e.g. .double(), gives one without the persistent flag)
            memo[id(self)] = type(self)(self.requires_grad, self.data.device, self.data.dtype,
                                        getattr(self, "persistent", True))
        return memo[id(self)]


class FusedBatchNorm(nn.Module):
    """A batch norm whose normalisation the MF-PSN after it applies (``functional.fuse_batchnorm``).

    :meth:`fuse` turns a batch norm into one in place, as ``torch.nn.utils.parametrize`` does, by giving
    it a subclass of its own class (``layer.BatchNorm2d`` becomes ``FusedBatchNorm2d``): it stays an
    instance of that class, with the same parameters, buffers, ``state_dict`` keys and training mode, so
    code that picks batch norms by type (weight-decay groups, freezing) still finds it. Its forward passes
    its input through unchanged: the neuron reads the statistics and the affine from here and, on
    ``'triton'``, normalises X in its own kernels (forward and backward) instead of writing and reading a
    normalised copy. :meth:`unfused` gives the batch norm its class back.
    """

    def __init__(self, *args, **kwargs):
        raise TypeError("a FusedBatchNorm is made from a batch norm in place: FusedBatchNorm.fuse(bn), or "
                        "functional.fuse_batchnorm(net) for every batch norm -> MF-PSN pair")

    @staticmethod
    def fuse(bn: nn.modules.batchnorm._BatchNorm) -> "FusedBatchNorm":
        """``bn`` itself, turned into a fused batch norm of its class."""
        if not isinstance(bn, nn.modules.batchnorm._BatchNorm) or isinstance(bn, FusedBatchNorm):
            raise TypeError(f"bn must be a batch norm module not fused yet, got {type(bn).__name__}")
        bn.__class__ = _fused_class(type(bn))
        bn.__dict__["_ran"] = False  # (see ChargeNeuronBase._normalised)
        return bn

    def forward(self, x):
        """``x`` itself: the neuron after this module normalises it."""
        self.__dict__["_ran"] = True  # (it runs where it is: see ChargeNeuronBase._normalised; compiled too)
        return x

    def batch_norm(self) -> ops.BatchNorm:
        """The normalisation as ``ops.mf_psn``'s ``input_bn``."""
        return ops.BatchNorm(self.weight, self.bias, self.running_mean, self.running_var, self.eps, self.momentum,
                             self.num_batches_tracked)

    @property
    def batch_norm_class(self) -> type:
        """The batch norm's own class (``layer.BatchNorm2d`` for a ``FusedBatchNorm2d``, also under a
        parametrization registered after fusing)."""
        return next(c for c in type(self).__mro__
                    if issubclass(c, nn.modules.batchnorm._BatchNorm) and not issubclass(c, FusedBatchNorm))

    def _made_over(self) -> bool:
        """Whether this module's class was made over its fused class (``torch.nn.utils.parametrize`` does)."""
        return type(self).__bases__ != (FusedBatchNorm, self.batch_norm_class)

    def unfused(self) -> nn.Module:
        """This module, a batch norm of its own class again (a class made over the fused one, as by
        ``torch.nn.utils.parametrize``, is made again over the batch norm's)."""
        cls, base = type(self), self.batch_norm_class
        if self._made_over():
            base = type(cls.__name__.replace("Fused", "", 1), (base,),
                        {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")})
        self.__class__ = base
        return self

    def extra_repr(self) -> str:
        return super().extra_repr() + ", applied by the next MulFreeChannelwisePSN"

    def __reduce_ex__(self, protocol):
        # Pickled as the batch norm's class, fused again on loading: the fused class is made at run time
        # (a parametrized one refuses, as torch's parametrized modules do).
        # A copy has not run: a neuron copied or saved apart from its network holds a copy of its batch norm
        # that nothing runs (the network's own is another copy), and refuses to apply it.
        if self._made_over():
            return super().__reduce_ex__(protocol)
        return _new_fused, (self.batch_norm_class,), {**self.__dict__, "_ran": False}


_FUSED_CLASSES: dict[type, type] = {}


def _fused_class(cls: type) -> type:
    if cls not in _FUSED_CLASSES:
        _FUSED_CLASSES[cls] = type(f"Fused{cls.__name__}", (FusedBatchNorm, cls), {"__module__": __name__})
    return _FUSED_CLASSES[cls]


def _new_fused(cls: type) -> FusedBatchNorm:
    fused = _fused_class(cls)
    return fused.__new__(fused)


class ChargeNeuronBase(MemoryModule):
    """What every MF-PSN variant shares: input checks, method resolution, the multi-step and
    single-step forward through ``ops.mf_psn`` / ``ops.mf_psn_step``, and the single-step state.

    A subclass provides ``k``, ``dilation``, ``surrogate_function``, ``_layout``, ``_method``,
    ``_backend``, ``channels``, ``_compute_dtype()`` and ``_mf_psn_args()`` (the weight, threshold,
    quantiser and training arguments of ``ops.mf_psn`` for this forward). The configuration protocol
    (settable ``layout``, ``backend`` and ``method``, ``supported_methods``, ``candidate_methods``) lives
    here, so that conversion and autoselect treat every variant alike.
    """

    #: Settings a built neuron keeps, because its parameters' shapes or kinds follow them: name -> why.
    FIXED = {"k": "its taps have one column each", "channels": "its parameters have one entry per channel"}
    #: Those of :attr:`FIXED` that ``functional.replace_neurons`` rebuilds a network's neurons with.
    REBUILT = ()

    def __setattr__(self, name, value):
        """A setting assigned to a built neuron is checked as the constructor checks it; one of
        :attr:`FIXED` is refused (it would leave the parameters computing another neuron)."""
        if name in self.FIXED and hasattr(self, name):
            if getattr(self, name) == value:
                return
            rebuild = f", or a network's with functional.replace_neurons(net, {name}=...)" if name in self.REBUILT else ""
            raise AttributeError(f"{name} of a built {type(self).__name__} cannot change ({self.FIXED[name]}): "
                                 f"build a new neuron{rebuild}")
        if name in _SETTINGS:
            _check_settings(**{name: value})
        if name == "surrogate_function" and not isinstance(value, nn.Module):
            self._modules.pop(name, None)  # (a plain function, as SpikingJelly's neurons take: an attribute)
        super().__setattr__(name, value)

    def _replicate_for_data_parallel(self):
        """``torch.nn.DataParallel``'s copy; refused with a fused batch norm, which is not a submodule: each
        copy would apply the first device's."""
        if self.input_bn is not None:
            raise RuntimeError(f"a {type(self).__name__} that applies a fused batch norm cannot be replicated by "
                               f"nn.DataParallel (each replica would apply the first device's batch norm): "
                               f"functional.unfuse_batchnorm(net) first, or use DistributedDataParallel")
        return super()._replicate_for_data_parallel()

    def resolve_method(self, x_seq: torch.Tensor, layout: Optional[str] = None) -> str:
        """The implementation that will run ``x_seq`` (``'auto'`` resolved by ``ops.choose``)."""
        layout = layout or self._layout
        if self._method != "auto":
            return self._method
        return ops.choose(x_seq, self._mf_psn_args()["weight"], self.dilation, layout, self._backend)

    # ------------------------------------------------------------------ configuration
    @property
    def layout(self) -> str:
        return self._layout

    @layout.setter
    def layout(self, value: str) -> None:
        self._layout = ops.check_layout(value)
        self._keep_method_if(lambda impl: value in impl.layouts)

    @property
    def step_mode(self) -> str:
        return self._step_mode

    @step_mode.setter
    def step_mode(self, value: str) -> None:
        """SpikingJelly's, refusing a switch to ``'s'`` of a time-last neuron (as the time-last layers do)
        rather than failing at its next forward (one built time-last in SpikingJelly's default ``'s'``
        runs once ``set_step_mode(net, 'm')`` is called)."""
        if value == "s" and self.__dict__.get("_layout") == "time_last":
            self._refuse_time_last_step()
        MemoryModule.step_mode.fset(self, value)

    def _keep_method_if(self, fits) -> None:
        """Back to ``method='auto'`` unless the pinned method is registered here and ``fits(impl)``: one
        pinned for another layout or backend, or one that does not run here (e.g. in a network saved
        where it ran), cannot run the new configuration."""
        impl = ops.find(self._method)
        if self._method != "auto" and (impl is None or not fits(impl)):
            self._method = "auto"

    @property
    def supported_backends(self) -> tuple[str, ...]:
        return ops.available_backends()

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, value: str) -> None:
        self._backend = ops.check_backend(value)
        self._keep_method_if(lambda impl: impl.backend == value)

    @property
    def method(self) -> str:
        return self._method

    @method.setter
    def method(self, value: str) -> None:
        """A method of another backend switches the backend too (method names are unique); one of another
        layout is refused (``configure(layout=..., method=...)`` switches both)."""
        if value != "auto":
            impl = ops.get(value)
            _check_method_layout(value, self._layout)
            if impl.backend != self._backend:
                ops.check_backend(impl.backend)
                self._backend = impl.backend
        self._method = value

    def configure(self, *, layout=None, backend=None, method=None, step_mode=None, surrogate_function=None):
        """Set the run-time settings given (the rest stay), checked as the constructor checks them; the
        weights and state stay. ``method`` must run ``layout`` (the new or the current one). On an error
        nothing changes."""
        saved = {name: self.__dict__[name] for name in ("_layout", "_backend", "_method", "_step_mode")
                 if name in self.__dict__}
        surrogate_before = self.__dict__.get("surrogate_function", self._modules.get("surrogate_function"))
        try:
            return self._configure(layout, backend, method, step_mode, surrogate_function)
        except BaseException:
            self.__dict__.update(saved)
            if surrogate_before is not None:
                self.surrogate_function = surrogate_before
            raise

    def _configure(self, layout, backend, method, step_mode, surrogate_function):
        if not _surrogate_ok(surrogate_function):
            raise ValueError(_SURROGATE_EXPECTED + f"{surrogate_function!r}")
        layout = ops.check_layout(layout if layout is not None else self._layout)
        if method is not None and method != "auto":
            _check_method_layout(method, layout)
        if surrogate_function is not None:
            self.surrogate_function = surrogate_function
        if layout == "time_first":  # (in the order that never pairs step_mode='s' with layout='time_last')
            self.layout = layout
        if step_mode is not None:
            self.step_mode = step_mode
        self.layout = layout
        if backend is not None:
            self.backend = backend
        if method is not None:
            self.method = method
        return self

    @property
    def supported_methods(self) -> list[str]:
        """Names of the charge implementations of this neuron's backend and layout."""
        return ops.names(layout=self._layout, backend=self._backend)

    @property
    def candidate_methods(self) -> list[str]:
        """What an autoselect pass times: the implementations of every backend available here for
        this neuron's layout (setting one as ``method`` also sets its backend)."""
        return ops.candidate_names(self._layout)

    def _member(self, name: str):
        """``getattr(self, name)`` for a parameter, buffer or submodule, read from the module's dicts: an
        attribute lookup goes through two ``__getattr__`` (SpikingJelly's and torch's),
        which shows at small layers. Anything not in them (e.g. a weight under
        ``torch.nn.utils.parametrize``, which becomes a property) through ``getattr``."""
        t = self._parameters.get(name)
        if t is None:
            t = self._buffers.get(name)
            if t is None:
                t = self._modules.get(name)
        return t if t is not None else getattr(self, name)

    # ------------------------------------------------------------------ forward
    def _channel_axis(self, x: torch.Tensor) -> int:
        return 1 if self.step_mode == "s" else ops.channel_dim(self._layout)

    def _check_rank(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        ops.registry.check_dense(x)
        if self.step_mode == "s":
            if not 2 <= x.dim() <= 5:
                raise ValueError(f"single-step x must be (N, C), (N, C, L), (N, C, H, W) or (N, C, D, H, W); "
                                 f"got shape {tuple(x.shape)}")
        elif not 3 <= x.dim() <= 6:
            want = "(T, N, C, ...)" if self._layout == "time_first" else "(N, C, ..., T)"
            raise ValueError(f"multi-step x must be {want} with 0-3 feature dims for layout={self._layout!r}; "
                             f"got shape {tuple(x.shape)}")

    def _check_dtype(self, x: torch.Tensor) -> None:
        """A floating-point input of at most the parameters' precision (see ``ops.input_dtype_error``)."""
        bad_dtype = ops.input_dtype_error(x.dtype, self._compute_dtype(), "this neuron's weight")
        if bad_dtype is not None:
            raise bad_dtype

    def _check_input(self, x: torch.Tensor) -> None:
        self._check_rank(x)
        self._check_dtype(x)
        axis = self._channel_axis(x)
        if x.shape[axis] != self.channels:
            where = "dim 1" if self.step_mode == "s" else f"dim {axis} of a {self._layout} sequence"
            raise ValueError(f"x has {x.shape[axis]} channels on {where} (shape {tuple(x.shape)}), "
                             f"but this neuron has channels={self.channels}{self._shape_hint(x)}")

    def _shape_hint(self, x: torch.Tensor) -> str:
        """Which other input form has the channels where ``x`` has them: the likely mix-up."""
        def fits(axis: int) -> bool:
            return x.dim() > axis and x.shape[axis] == self.channels

        if self.step_mode == "s" and fits(2):
            return ("; it looks like a time-first sequence (T, N, C, ...), and a single-step neuron takes one "
                    "step (N, C, ...): functional.set_step_mode(net, 'm') runs whole sequences, and "
                    "layer.MultiStepContainer(neuron) runs them step by step (e.g. in chunk_multi_step_forward)")
        if self.step_mode == "m" and self._layout == "time_first" and fits(1):
            return ("; it looks like one step (N, C, ...) or a time-last sequence (N, C, ..., T), and this "
                    "neuron takes time-first sequences (T, N, C, ...)")
        if self.step_mode == "m" and self._layout == "time_last" and fits(2):
            return ("; it looks like a time-first sequence (T, N, C, ...), and this neuron runs time-last "
                    "(N, C, ..., T): feed it through the network's time-last boundary (to_time_last(net)), "
                    "or to_time_first(net)")
        return ""

    def _checked_args(self, x: torch.Tensor) -> dict:
        """The arguments of ``ops.mf_psn`` for this forward, after :meth:`_check_input`, which is skipped
        while inputs keep the shape and dtype last checked, and the neuron its configuration. Under
        torch.compile it checks every trace and keeps no key: a guard on the last call's shape recompiled
        the network at each change of batch size (then ran it eagerly past dynamo's recompile limit)."""
        args = self._mf_psn_args()
        w = args["weight"]
        compiling = torch.compiler.is_compiling()
        key = (x.shape, x.dtype, x.layout, w.shape, w.dtype, self._layout, self.step_mode) \
            if isinstance(x, torch.Tensor) and not compiling else None
        if key is None or key != self.__dict__.get("_checked_key"):
            self._check_input(x)
            if w.dim() != 2 or w.shape[1] != self.k:  # (a weight assigned, or tied to another neuron's)
                raise ValueError(f"weight must have shape (channels, k) with k={self.k}, got {tuple(w.shape)}: "
                                 f"a weight of another order needs a neuron built with that k")
            if not compiling:
                self.__dict__["_checked_key"] = key
        args["method"], args["backend"] = self._method, self._backend
        args["surrogate_function"] = self._member("surrogate_function")
        return args

    def _promoted(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, self._compute_dtype())
        return x if x.dtype == dtype else x.to(dtype)

    @property
    def input_bn(self) -> Optional[FusedBatchNorm]:
        """The batch norm in front of this neuron that it applies itself (``functional.fuse_batchnorm``), or
        None. Not a submodule: the batch norm stays where it was in the network."""
        bn = self.__dict__.get("_input_bn")
        if bn is not None and not isinstance(bn, FusedBatchNorm):  # unfused by itself (bn.unfused(), a block's
            self.__dict__["_input_bn"] = bn = None                 # unfuse_batchnorm): it normalises again
        return bn

    def set_input_bn(self, bn: Optional[FusedBatchNorm]) -> None:
        """Apply ``bn`` to the input from now on (None: stop); see :attr:`input_bn`."""
        if bn is not None and not isinstance(bn, FusedBatchNorm):
            raise TypeError(f"input_bn must be a FusedBatchNorm or None, got {type(bn).__name__}")
        self.__dict__["_input_bn"] = bn  # (an attribute assignment would register it as a submodule)

    def _normalised(self, x: torch.Tensor, args: dict, multi_step: bool) -> torch.Tensor:
        """``x`` through the fused input batch norm in that batch norm's own mode (one frozen in eval while
        the neuron trains, or the reverse, normalises as the layer would); a multi-step call in the
        neuron's mode leaves it to ``ops.mf_psn`` (``args['input_bn']``), which may fuse it."""
        bn = self.input_bn
        if bn is None:
            return x
        if not (torch.compiler.is_compiling() or _compat.in_backward()):  # (checkpointing runs it again there)
            self._check_ran(bn)
        if multi_step and bn.training == args["training"]:
            args["input_bn"] = bn.batch_norm()
            return x
        layout = self._layout if multi_step else "time_last"  # (one step: that step's batch statistics)
        return normalize_input(self._promoted(x), bn.batch_norm(), layout, bn.training)

    def _check_ran(self, bn: FusedBatchNorm) -> None:
        """Refuse a fused batch norm that has not run (passing X on) since this neuron last applied it: one
        replaced in the network, e.g. by ``nn.SyncBatchNorm.convert_sync_batchnorm``, whose module would
        normalise X first, or a hidden copy (see ``FusedBatchNorm.__reduce_ex__``)."""
        if not bn.__dict__.get("_ran", True):
            raise RuntimeError(
                f"this {type(self).__name__} applies a fused batch norm (functional.fuse_batchnorm) that has not run "
                f"since the neuron last ran, or since it was copied or loaded: the batch norm in front of it was "
                f"replaced (e.g. by nn.SyncBatchNorm.convert_sync_batchnorm, whose new module would normalise a "
                f"second time), or the neuron runs without it, or it was copied or saved apart from its network "
                f"(then it holds a copy of the batch norm that the network does not run). Run the network as "
                f"fused: copy or save the whole network, or functional.unfuse_batchnorm(net) before replacing "
                f"its batch norms or running the neuron alone")
        bn.__dict__["_ran"] = False

    def multi_step_forward(self, x_seq: torch.Tensor) -> torch.Tensor:
        args = self._checked_args(x_seq)
        x_seq = self._normalised(x_seq, args, True)
        return ops.mf_psn(x_seq, dilation=self.dilation, layout=self._layout, **args)

    def _refuse_time_last_step(self) -> None:
        """A time-last neuron (e.g. in a converted network half switched by ``set_step_mode(net, 's')``, whose
        time-last layers refuse it) would read a whole ``(N, C, ..., T)`` sequence as one step."""
        if self._layout == "time_last":
            raise ValueError("a neuron with layout='time_last' runs whole (N, C, ..., T) sequences: step_mode must "
                             "be 'm' (to run single steps, set layout='time_first', or convert the network with "
                             "spikingjelly_mfpsn.convert.to_time_first(net))")

    def single_step_forward(self, x: torch.Tensor) -> torch.Tensor:
        self._refuse_time_last_step()
        args = self._checked_args(x)
        given, x = x, self._normalised(x, args, False)
        queue = self.x_queue
        if queue and not torch.compiler.is_compiling() and queue[-1].is_inference() \
                and not torch.is_inference_mode_enabled():
            queue = tuple(t.clone() for t in queue)  # (stored under inference_mode: autograd cannot save them)
        if queue and queue[-1].shape != x.shape:
            raise ValueError(f"single-step x has shape {tuple(x.shape)} but the stored state was built from "
                             f"inputs of shape {tuple(queue[-1].shape)}; call functional.reset_net(net) "
                             f"before feeding sequences of another shape")
        keep = self._history_length(queue)
        stored = self._promoted(x)
        if keep and stored is given:  # (a copy: the caller may refill its buffer, or change it in place)
            stored = stored.clone()
        if keep and not queue and keep <= PADDED_HISTORY:  # zeros before the first step: one length from the
            # first step on, so torch.compile traces it once (there tensors apart, requiring grad as inputs do:
            # its guards see the same history at every step; eager, one tensor)
            queue = _compiled_zeros(stored, keep) if torch.compiler.is_compiling() \
                else (torch.zeros_like(stored),) * keep
        history = queue + (stored,)
        spikes = ops.mf_psn_step(ops.step_taps(history, self.k, self.dilation), **args)
        self.x_queue = history[max(0, len(history) - keep):] if keep > 0 else ()
        return spikes if spikes.dtype == given.dtype else spikes.to(given.dtype)  # (computed promoted)

    def _history_length(self, queue: tuple) -> int:
        """``(k-1) * dilation``, the length of the single-step history from its first step on (a longer one,
        beyond :data:`PADDED_HISTORY`, grows step by step); a stored one of another length (k or dilation
        changed mid-stream, also where it grows) is refused."""
        keep = (self.k - 1) * self.dilation
        if not queue:
            self._history_for = keep  # (what a history that grows was started for)
        elif len(queue) > keep or keep <= PADDED_HISTORY and len(queue) != keep \
                or getattr(self, "_history_for", keep) != keep:
            raise ValueError(f"the stored state holds {len(queue)} inputs but k={self.k}, dilation={self.dilation} "
                             f"take {keep}: call functional.reset_net(net) after changing k or dilation")
        return keep

    # ------------------------------------------------------------------ state handling
    def detach(self):
        self.x_queue = tuple(t.detach() for t in self.x_queue)
        super().detach()

    def _apply(self, fn, recurse=True):
        # A history on the meta device holds no values (e.g. after a meta forward, before to_empty): the stream
        # starts afresh rather than from what fn would make of it.
        self.x_queue = () if any(t.is_meta for t in self.x_queue) else tuple(fn(t) for t in self.x_queue)
        return super()._apply(fn)  # (SpikingJelly's takes no ``recurse``, which to_empty passes)



def _compiled_zeros(like: torch.Tensor, count: int) -> tuple:
    """``count`` zero tensors apart, requiring grad as ``like`` does (in a compiled graph)."""
    none = torch.zeros_like(like, dtype=torch.bool)
    return tuple(torch.where(none, like, 0.0) for _ in range(count))


# The longest single-step history padded with zeros from the first step on (one length: torch.compile traces
# a stream once); a longer one, of a huge dilation, grows as the steps come (the taps before the first read 0)
PADDED_HISTORY = 4096


class CheckpointConfig:
    """A state dict also holds ``(k, dilation)`` under :attr:`CONFIG_KEY` (an int64 tensor), so that a
    checkpoint of another order or dilation is refused by name rather than loaded into a neuron that
    then computes something else; checkpoints saved without it load as before (their k and channels
    are checked from the tensor :attr:`SHAPE_KEY`, of shape ``(C, k)``). First among a neuron's bases:
    the check runs before torch's load hooks (the lazy one would shape the parameters after the
    checkpoint)."""

    CONFIG_KEY = "order_dilation"
    SHAPE_KEY = "weight"

    @property
    def order_dilation(self) -> torch.Tensor:
        """``[k, dilation]``, the state dict's entry :attr:`CONFIG_KEY` (an attribute too, as
        ``torch.distributed.checkpoint``'s state-dict functions read every entry of a state dict)."""
        return torch.tensor([self.k, self.dilation])

    @order_dilation.setter
    def order_dilation(self, value) -> None:
        """Taken where it holds this neuron's ``[k, dilation]`` (``torch.func.functional_call`` with a whole state
        dict sets every entry); another value is refused."""
        try:
            same = isinstance(value, torch.Tensor) and value.tolist() == [self.k, self.dilation]
        except RuntimeError:  # (a function transform's wrapper holds no values to compare)
            same = True
        if not same:
            raise ValueError(f"order_dilation of this {type(self).__name__} is [k, dilation] = [{self.k}, "
                             f"{self.dilation}], not {value!r}: build a neuron of that order and dilation")

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + self.CONFIG_KEY] = self.order_dilation

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        mismatch = self._checkpoint_mismatch(state_dict, prefix)
        if mismatch:
            error_msgs.append(mismatch)
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        key = prefix + self.CONFIG_KEY
        if key in unexpected_keys:
            unexpected_keys.remove(key)

    def _checkpoint_mismatch(self, state_dict, prefix: str) -> str:
        """Why a checkpoint does not fit this neuron (order, dilation, channels), naming both; or ''."""
        shaped, config = state_dict.get(prefix + self.SHAPE_KEY), state_dict.get(prefix + self.CONFIG_KEY)
        where = f"layer {prefix[:-1]!r}" if prefix else "neuron"
        if nn.parameter.is_lazy(shaped):  # (saved before its first forward: channels unknown)
            if nn.parameter.is_lazy(getattr(self, self.SHAPE_KEY, None)):
                shaped = None
            else:
                return (f"the checkpoint's {where} is uninitialised (channels=None, saved before its first "
                        f"forward): load it into a neuron built with channels=None, or save after a forward")
        saved = {}
        if config is not None and not (isinstance(config, torch.Tensor) and config.numel() == 2):
            return (f"the checkpoint's {where} has {self.CONFIG_KEY}="
                    f"{config.tolist() if isinstance(config, torch.Tensor) else config!r}, not [k, dilation]: the "
                    f"checkpoint is damaged, or it is not an MF-PSN neuron's")
        if config is not None:
            saved["k"], saved["dilation"] = (int(v) for v in config.tolist())
        if isinstance(shaped, torch.Tensor) and shaped.dim() == 2:
            saved.setdefault("k", shaped.shape[1])
            saved["channels"] = shaped.shape[0]
        ours = {"k": self.k, "dilation": self.dilation, "channels": self.channels}
        wrong = [name for name, v in saved.items() if ours[name] is not None and v != ours[name]]
        if not wrong:
            return ""
        return (f"the checkpoint's {where} has " + ", ".join(f"{n}={saved[n]}" for n in wrong)
                + f" but this {type(self).__name__} has " + ", ".join(f"{n}={ours[n]}" for n in wrong)
                + f": build it with {', '.join(f'{n}={saved[n]}' for n in wrong)} to load this checkpoint")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_SURROGATE_EXPECTED = ("surrogate_function must be a surrogate function instance (e.g. surrogate.ATan()) or a "
                       "function of the charge, or None, got ")


def _surrogate_ok(sg) -> bool:
    return sg is None or callable(sg) and not isinstance(sg, type)


# What each setting of a neuron may be: name -> (test, what is expected). The constructor checks its
# arguments with it, and a built neuron checks a setting assigned later (``sn.eps = 0``) the same way.
_SETTINGS = {
    "k": (lambda v: _is_int(v) and v >= 1, "k (the order) must be an int >= 1"),
    "dilation": (lambda v: _is_int(v) and v >= 1, "dilation must be an int >= 1"),
    "quantize": (lambda v: isinstance(v, bool), "quantize must be True or False"),
    "exp_init": (lambda v: isinstance(v, bool), "exp_init must be True or False"),
    "ste": (lambda v: isinstance(v, str) and v in STE_MODES, f"ste must be one of {STE_MODES}"),
    "threshold": (lambda v: isinstance(v, str) and v in THRESHOLDS, f"threshold must be one of {THRESHOLDS}"),
    "momentum": (lambda v: v is None or _is_number(v) and 0.0 <= v <= 1.0,
                 "momentum must be a number in [0, 1] or None"),
    "eps": (lambda v: _is_number(v) and 0.0 < v < math.inf, "eps must be a number > 0 (added to the variance)"),
    "v_threshold_init": (lambda v: _is_number(v) and math.isfinite(v), "v_threshold must be a finite number"),
    "surrogate_function": (lambda v: callable(v) and not isinstance(v, type),
                           "surrogate_function must be a surrogate function instance (e.g. surrogate.ATan()) or "
                           "a function of the charge"),
}


def _check_method_layout(method: str, layout: str) -> None:
    """ValueError unless ``method`` (registered) runs ``layout``."""
    if layout not in ops.get(method).layouts:
        raise ValueError(f"method {method!r} runs the layouts {ops.get(method).layouts}, not layout={layout!r}; "
                         f"pass layout={ops.get(method).layouts[0]!r} or another method "
                         f"({', '.join(ops.names(layout=layout))})")


def _check_settings(**settings) -> None:
    """ValueError naming the first of ``settings`` that is not valid."""
    for name, value in settings.items():
        ok, expected = _SETTINGS[name]
        if not ok(value):
            raise ValueError(f"{expected}, got {value!r}")


class MulFreeChannelwisePSN(CheckpointConfig, LazyModuleMixin, ChargeNeuronBase):
    """Multiplication-free channel-wise Parallel Spiking Neuron.

    Args:
        channels: number of channels C (dim 1 of a single-step input); ``None`` infers it at the
            first forward (then build the optimiser after one forward, as with torch's lazy modules)
        k: order, the number of taps (>= 1)
        dilation: spacing between taps in time steps (>= 1)
        quantize: quantise the (fused) weight to signed powers of two
        ste: gradient of the quantiser: ``'whole'`` (dQ/dW = 1) or ``'round'`` (round' = 1)
        threshold: ``'bn'`` (batch-norm-fused threshold, paper Appendix C) or ``'param'``
            (learnable per-channel V_th, initialised to ``v_threshold``)
        surrogate_function: a SpikingJelly surrogate (``surrogate.ATan()`` by default)
        step_mode: ``'s'`` (input ``(N, C, ...)`` per call) or ``'m'`` (a whole sequence)
        backend: ``'torch'`` or another entry of :attr:`supported_backends`
        method: ``'auto'`` or a charge implementation name (see :attr:`supported_methods`)
        layout: multi-step layout, ``'time_first'`` ``(T, N, C, ...)`` or ``'time_last'``
            ``(N, C, ..., T)``
        momentum: running-statistics momentum for ``threshold='bn'`` (``None``: cumulative average)
        eps: added to the variance for ``threshold='bn'``
        exp_init: initialise W to ``(..., 1/4, 1/2, 1)``; otherwise Kaiming-uniform
        v_threshold: initial V_th for ``threshold='param'``
    """

    FIXED = {**ChargeNeuronBase.FIXED, "threshold": "it decides the parameters: gamma, beta and the running "
                                                      "statistics, or v_threshold"}
    REBUILT = ("k", "threshold")

    def __init__(self, channels: Optional[int] = None, k: int = 2, dilation: int = 1,
                 quantize: bool = True, ste: str = "whole", threshold: str = "bn",
                 surrogate_function=None, step_mode: str = "s", backend: str = "torch",
                 method: str = "auto", layout: str = "time_first", momentum: Optional[float] = 0.1,
                 eps: float = 1e-5, exp_init: bool = True, v_threshold: float = 1.0):
        super().__init__()
        if not (channels is None or _is_int(channels) and channels >= 1):
            raise ValueError(f"channels must be a positive int or None, got {channels!r}")
        # (each assignment below is checked by __setattr__, the surrogate by configure)
        self.k = k
        self.dilation = dilation
        self.quantize = quantize
        self.ste = ste
        self.threshold = threshold
        self.momentum = momentum
        self.eps = eps
        self.exp_init = exp_init
        self.v_threshold_init = v_threshold
        self._layout, self._backend, self._method = "time_first", "torch", "auto"
        self.surrogate_function = default_surrogate()
        self.configure(layout=layout, backend=backend, method=method, step_mode=step_mode,
                       surrogate_function=surrogate_function)
        # Single-step state: the last (k-1)*d inputs, oldest first (a tuple of tensors).
        self.register_memory("x_queue", ())

        self.weight = nn.UninitializedParameter()
        if threshold == "bn":
            self.gamma = nn.UninitializedParameter()
            self.beta = nn.UninitializedParameter()
            self.register_buffer("running_mean", LazyBuffer())
            self.register_buffer("running_var", LazyBuffer())
            self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))
        else:
            self.v_threshold = nn.UninitializedParameter()
        if channels is not None:
            self._materialize(channels)
            # Initialised already: drop the lazy-initialisation hooks, as torch does after a lazy first
            # forward (a module with a forward pre-hook takes nn.Module's slower call path).
            self._initialize_hook.remove()
            self._load_hook.remove()
            del self._initialize_hook, self._load_hook

    def _replicate_for_data_parallel(self):
        """``torch.nn.DataParallel``'s copy of a built neuron (torch's lazy-module mixin refuses every module,
        built or not: its own lazy modules change class once built)."""
        if self.has_uninitialized_params():
            return LazyModuleMixin._replicate_for_data_parallel(self)
        return ChargeNeuronBase._replicate_for_data_parallel(self)

    def _apply(self, fn, recurse=True):
        """Moves and casts; uninitialised parameters and buffers stay uninitialised, on ``fn``'s device and
        dtype (torch's ``Module._apply`` makes one moved to another device, e.g. meta, a real tensor of
        shape (0,), torch's ``LazyLinear`` too: the neuron then had 0 channels)."""
        lazy = {name: t for name, t in [*self._parameters.items(), *self._buffers.items()]
                if isinstance(t, nn.parameter.UninitializedTensorMixin)}
        for name, t in lazy.items():  # (fn sees empty tensors: an uninitialised one refuses e.g. .bfloat16())
            empty = torch.empty(0, dtype=t.dtype, device=t.device)
            if name in self._parameters:
                self._parameters[name] = nn.Parameter(empty, t.requires_grad)
            else:
                self._buffers[name] = empty
        try:
            return super()._apply(fn, recurse)
        finally:  # (also where fn fails: the neuron stays lazy)
            for name, t in lazy.items():
                if name in self._parameters:
                    done = self._parameters[name]
                    self._parameters[name] = nn.UninitializedParameter(t.requires_grad, done.device, done.dtype)
                else:
                    done = self._buffers[name]
                    self._buffers[name] = LazyBuffer(False, done.device, done.dtype, getattr(t, "persistent", True))

    # ------------------------------------------------------------------ parameters
    def _materialize(self, channels: int) -> None:
        self.weight.materialize((channels, self.k))
        if self.threshold == "bn":
            for t in (self.gamma, self.beta, self.running_mean, self.running_var):
                t.materialize((channels,))
        else:
            self.v_threshold.materialize((channels,))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The constructor's initial values again, running statistics included (torch's modules' method of
        this name, e.g. after ``to_empty``); nothing for a neuron not built yet (``channels=None``)."""
        if self.has_uninitialized_params():
            return
        with torch.no_grad():
            if self.exp_init:
                self.weight.copy_(exp_init_weight(self.channels, self.k))
            else:
                nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
            if self.threshold == "bn":
                self.gamma.fill_(1.0)
                self.beta.fill_(-1.0)
                self.reset_running_stats()
                return
            if abs(self.v_threshold_init) > torch.finfo(self.v_threshold.dtype).max:
                raise ValueError(f"v_threshold={self.v_threshold_init!r} is beyond the range of the parameters' "
                                 f"dtype {self.v_threshold.dtype}")
            self.v_threshold.fill_(self.v_threshold_init)

    def reset_running_stats(self) -> None:
        """Running mean 0, variance 1 and no batch counted (``threshold='bn'``; torch's batch norms' method of
        this name, which ``functional.update_bn`` calls)."""
        if self.threshold == "bn" and not self.has_uninitialized_params():
            self.running_mean.zero_()
            self.running_var.fill_(1.0)
            self.num_batches_tracked.zero_()

    def initialize_parameters(self, x: torch.Tensor, *args, **kwargs) -> None:
        """Lazy initialisation hook: infer C from the first input."""
        if self.has_uninitialized_params():
            self._check_rank(x)
            self._materialize(x.shape[self._channel_axis(x)])

    @property
    def channels(self) -> Optional[int]:
        w = self._member("weight")
        return None if isinstance(w, nn.parameter.UninitializedParameter) else w.shape[0]

    # ------------------------------------------------------------------ weight and bias
    def _quantizer(self) -> Optional[str]:
        return self.ste if self.quantize else None

    def _bn(self) -> ops.BatchNorm:
        member = self._member
        return ops.BatchNorm(member("gamma"), member("beta"), member("running_mean"), member("running_var"),
                             self.eps, self.momentum, member("num_batches_tracked"))

    def _mf_psn_args(self) -> dict:
        member = self._member
        threshold = {"bn": self._bn()} if self.threshold == "bn" else {"v_threshold": member("v_threshold")}
        return {"weight": member("weight"), **threshold, "quantize": self._quantizer(), "training": self.training}

    def fused_weight_bias(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Eval-mode ``(Wq, b)``: the (quantised) weight and the bias the neuron runs with, so that
        ``S = Theta(conv(X, Wq) + b)``. Uses running statistics for ``threshold='bn'``. NaN or inf in
        any of them raises a ``ValueError`` naming the tensor."""
        if self.threshold == "bn":
            bn = self._bn()
            w, b = fold_checked(self.weight, bn, bn.running_mean, bn.running_var)
        else:
            check_finite({"weight": self.weight, "v_threshold": self.v_threshold})
            w, b = self.weight, -self.v_threshold
        return (quantize(w, self.ste) if self.quantize else w), b

    def export_shifts(self) -> dict[str, torch.Tensor]:
        """Integer form of the eval-mode neuron: ``Wq = sign * 2**shift`` and the fused bias.

        Returns ``{'shift': int8 (C, k), 'sign': int8 (C, k), 'bias': float (C,)}``; the neuron fires
        where ``sum_i (X[t-(k-1-i)d] << shift[:, i]) * sign[:, i] + bias >= 0`` (a negative shift is
        a right shift).
        """
        if not self.quantize:
            raise ValueError("its weights are not quantised (quantize=False), so they are not powers of two: "
                             "folding (and export_shifts) needs a neuron trained with quantize=True")
        with torch.no_grad():
            w, b = self.fused_weight_bias()
            shift, sign = shift_amounts(w)
            if shift.numel() and (shift.min() < -128 or shift.max() > 127):
                raise ValueError("a shift amount does not fit in int8; the weights span too many octaves")
            return {"shift": shift.to(torch.int8), "sign": sign.to(torch.int8), "bias": b.detach().clone()}

    def _compute_dtype(self) -> torch.dtype:
        return self._member("weight").dtype

    def extra_repr(self) -> str:
        s = (f"channels={self.channels}, k={self.k}, dilation={self.dilation}, quantize={self.quantize}, "
             f"threshold={self.threshold!r}, layout={self._layout!r}, method={self._method!r}, "
             f"backend={self._backend!r}, step_mode={self.step_mode!r}")
        if self.ste != "whole":
            s += f", ste={self.ste!r}"
        if self.input_bn is not None:  # (it normalises its input: more work, another timing)
            s += f", input_bn={self.input_bn.batch_norm_class.__name__}"
        return s
