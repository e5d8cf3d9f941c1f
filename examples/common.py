"""Shared parts of the example training scripts.

Command-line options, (distributed) setup, deterministic seeding, choosing the MF-PSN implementation
(``--method`` / ``--layout``), the training loop with progress bars, per-epoch checkpoints,
``--resume``, a metrics JSON, a PNG of the accuracy curves and a final summary line.

Run under ``torchrun --nproc_per_node=N`` for DistributedDataParallel training (gloo on CPU, nccl on
GPU): each process trains on its share of every epoch (``--batch-size`` is per process) and rank 0
logs and writes the files.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

try:
    import spikingjelly_mfpsn  # noqa: F401
except ImportError:  # running from a source checkout without installing the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import spikingjelly_mfpsn  # noqa: F401

from spikingjelly.activation_based import functional
from tqdm import tqdm

from spikingjelly_mfpsn import MulFreeChannelwisePSN, ops
from spikingjelly_mfpsn.paper import data, models
from spikingjelly_mfpsn.paper.data import DataError

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.json"
CURVES = "curves.png"


# ------------------------------------------------------------------------------------------- options

class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """The examples' one ``--help`` policy: every option shows its default once, as "(default: X)".

    The formatter adds it to every option whose default is not None (``BooleanOptionalAction`` adds its
    own, which the formatter then leaves alone), so a help text never writes a default itself; one
    whose default is None says in its help, as "(default: ...)", what happens without the option."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def add_common_args(p: argparse.ArgumentParser, epochs: int, batch_size: int, lr: float, out_dir: str) -> None:
    g = p.add_argument_group("neuron")
    g.add_argument("--neuron", default="mfpsn", choices=models.NEURONS, help="spiking neuron")
    g.add_argument("--k", type=int, default=2, help="order of MF-PSN / Sliding PSN")
    g.add_argument("--sawtooth", action=argparse.BooleanOptionalAction, default=True,
                   help="MF-PSN dilations 1,2,3,1,2,3,... in running order")
    g.add_argument("--method", default="auto",
                   help="MF-PSN charge implementation: 'auto' (autoselect) or a name, e.g. shift_add, conv1d")
    g.add_argument("--layout", default=None, choices=("time_first", "time_last"),
                   help="layout to run in (default: autoselect's choice with --method auto, else time_first)")
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=int, default=epochs, help="epochs of the whole schedule")
    g.add_argument("--batch-size", type=int, default=batch_size, help="samples per step and process")
    g.add_argument("--lr", type=float, default=lr, help="peak learning rate (AdamW, cosine schedule per step)")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    g.add_argument("--label-smoothing", type=float, default=0.1, help="label smoothing of the cross entropy")
    g.add_argument("--seed", type=int, default=0, help="seed of the initial network, dropout and shuffling")
    g.add_argument("--limit-train", type=int, default=None, metavar="N",
                   help="use the first N training samples (default: all)")
    g.add_argument("--limit-test", type=int, default=None, metavar="N",
                   help="use the first N test samples (default: all)")
    g.add_argument("--device", default=None, help="device to train on (default: cuda if available, else cpu)")
    g.add_argument("--amp", default="off", choices=("off", "bf16", "fp16"),
                   help="mixed precision: forward passes (and autoselect) under torch.autocast with this dtype; "
                        "fp16 scales the loss (torch.amp.GradScaler); off: float32")
    g.add_argument("--threads", type=int, default=1,
                   help="CPU threads per process (the example networks are small, and extra threads "
                        "cost more than they give on a busy CPU; raise it for CIFAR-sized networks)")
    g = p.add_argument_group("output")
    g.add_argument("--out-dir", default=out_dir, help="folder for the metrics, curves and checkpoint")
    g.add_argument("--resume", action="store_true",
                   help=f"continue from OUT_DIR/{CHECKPOINT} (with the training options it was started with)")
    g.add_argument("--overwrite", action="store_true",
                   help=f"start a new run even where OUT_DIR holds one ({CHECKPOINT}, {METRICS}), replacing it")
    g.add_argument("--stop-after", type=int, default=None, metavar="N",
                   help="stop after N epochs of this run (the schedule still spans --epochs; continue with "
                        "--resume) (default: run to --epochs)")
    g.add_argument("--no-progress", action="store_true",
                   help="no progress bars on a terminal (there are none when stderr is not a terminal: "
                        "one line per epoch)")
    g.add_argument("--verbose", action="store_true",
                   help="print autoselect's full timing table where it timed the layers (otherwise, and for a "
                        "choice from its cache, one line with its choice)")


def data_dir_problem(dataset: str, data_dir: Optional[str]) -> Optional[str]:
    """What keeps ``dataset`` ('digits', 'cifar10', 'cifar100' or 'shd') from being read from
    ``data_dir``, in one line naming ``--data-dir`` and the files expected there; None when the files
    are there (their contents are checked when they are read)."""
    if dataset == "digits":  # bundled with scikit-learn
        return None
    files = _shd_files(data_dir) if dataset == "shd" else _cifar_files(dataset, data_dir)
    expected, url, found, missing = files
    if found:
        return None
    if data_dir is None:
        return f"--dataset {dataset} needs --data-dir DIR, a folder holding {expected}; get it from {url}"
    shown = data_dir if os.path.isabs(data_dir) else f"{data_dir} ({os.path.abspath(data_dir)})"
    if not os.path.isdir(data_dir):
        return f"--data-dir {shown} is not a folder: put {expected} in one; get it from {url}"
    missing = f": {', '.join(missing)} missing" if missing else ""
    return f"--data-dir {shown} does not hold {expected}{missing}; get it from {url}"


def _missing(folder: Optional[str], names) -> list[str]:
    """Those of ``names`` that are not files in ``folder`` (all of them without a folder)."""
    return [n for n in names if folder is None or not os.path.isfile(os.path.join(folder, n))]


def _shd_files(data_dir: Optional[str]) -> tuple[str, str, bool, list[str]]:
    """(what SHD expects in --data-dir, where to get it, whether it is there, the files missing)."""
    missing = _missing(data_dir, data.SHD_FILES)
    partly = missing if len(missing) < len(data.SHD_FILES) else []  # (when none is there, the message says so)
    return f"{data.SHD_FILES[0]} and {data.SHD_FILES[1]} (gunzipped)", data.SHD_URL, not missing, partly


def _cifar_files(dataset: str, data_dir: Optional[str]) -> tuple[str, str, bool, list[str]]:
    """As :func:`_shd_files`: the archive, its extracted folder, or that folder's files in ``data_dir``
    itself (as :func:`data.load_cifar` reads them); the missing files are those of an extracted folder."""
    archive, folder, train, test = data.CIFAR[dataset][:4]
    members = train + [test]
    extracted = os.path.join(data_dir, folder) if data_dir is not None else None
    missing = _missing(extracted, members)
    found = data_dir is not None and (os.path.isfile(os.path.join(data_dir, archive)) or not missing
                                      or not _missing(data_dir, members))
    expected = f"{archive} or its extracted folder {folder}/ ({', '.join(members)})"
    return expected, data.CIFAR_URL, found, (missing if extracted and os.path.isdir(extracted) else [])


def check_data_dir(p: argparse.ArgumentParser, dataset: str, data_dir: Optional[str]) -> None:
    """Exit with status 2 and one line (:func:`data_dir_problem`) when the data files are not there,
    before anything is built or timed."""
    if dataset == "digits" and data_dir is not None:
        p.error(f"--data-dir {data_dir}: --dataset digits is bundled with scikit-learn and reads no folder; "
                f"--data-dir is for cifar10/cifar100")
    problem = data_dir_problem(dataset, data_dir)
    if problem is not None:
        p.exit(2, f"{p.prog}: error: {problem}\n")


MAX_THREADS = 4 * (os.cpu_count() or 256)
FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # (a larger rate or decay overflows the optimiser's float32)
MAX_SEED = 2 ** 53


def check_common_args(p: argparse.ArgumentParser, args) -> None:
    for name in ("k", "epochs", "batch_size", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.threads > MAX_THREADS:
        p.error(f"--threads must be at most {MAX_THREADS} (4 per CPU core here), got {args.threads}")
    for name in ("limit_train", "limit_test", "stop_after"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < args.lr <= FLOAT32_MAX:
        p.error(f"--lr must be a finite number > 0, got {args.lr}")
    if not 0 <= args.weight_decay <= FLOAT32_MAX:
        p.error(f"--weight-decay must be a finite number >= 0, got {args.weight_decay}")
    if abs(args.seed) > MAX_SEED:  # (each epoch seeds seed * 1000 + epoch, which must fit an int64)
        p.error(f"--seed must be in [-{MAX_SEED}, {MAX_SEED}], got {args.seed}")
    if not 0 <= args.label_smoothing < 1:
        p.error(f"--label-smoothing must be in [0, 1), got {args.label_smoothing}")
    if args.method != "auto":
        try:
            ops.get(args.method)
        except ValueError as e:
            p.error(f"--method: {e}")
    if args.device is not None:
        try:
            torch.empty(0, device=torch.device(args.device))
        except (RuntimeError, AssertionError) as e:  # unknown type, or not here (e.g. no CUDA build/device)
            p.error(f"--device {args.device}: cannot put a tensor there ({e})")
        if torch.device(args.device).type == "meta":
            p.error("--device meta: a meta tensor holds no data to train on or measure; use cpu or cuda")
    if args.neuron in ("psn", "sliding_psn") and not models.psn_available(args.neuron):
        p.error(f"--neuron {args.neuron} needs SpikingJelly >= 2.0 (the installed one has no PSN family); "
                f"use mfpsn, lif or plif")
    check_out_dir(p, args)


def check_out_dir(p: argparse.ArgumentParser, args) -> None:
    """--out-dir must be a folder (or not there yet); a new run does not replace a run already in it
    unless --overwrite is given."""
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        p.error(f"--out-dir {args.out_dir} is a file, not a folder")
    parent = os.path.dirname(os.path.abspath(args.out_dir))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        p.error(f"--out-dir {args.out_dir} cannot be made: {parent} is a file, not a folder")
    held = [n for n in (CHECKPOINT, METRICS) if os.path.isfile(os.path.join(args.out_dir, n))]
    if held and not (args.resume or args.overwrite):
        p.error(f"--out-dir {args.out_dir} already holds a run ({', '.join(held)}): pass --resume to continue it, "
                f"--overwrite to replace it, or choose another --out-dir")


# ------------------------------------------------------------------------------------------- setup

@dataclass
class Env:
    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0

    def log(self, msg: str) -> None:
        if self.main:
            tqdm.write(msg, file=sys.stdout)
            sys.stdout.flush()


def setup(args) -> Env:
    """Seeds everything, makes algorithms deterministic and joins the process group under torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if args.device is not None:
        device = torch.device(args.device)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if world > 1:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    seed_all(args.seed)  # the same initial network on every rank
    return Env(rank, world, device)


def seed_all(seed: int, *salt: int) -> None:
    s = hash((seed,) + salt) % (2 ** 31)
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)


def teardown(env: Env) -> None:
    """Leave the process group once every rank is done: the barrier keeps a rank from destroying it
    while another still has collectives in flight (gloo then aborts that rank at exit)."""
    if env.world > 1:
        dist.barrier()
        dist.destroy_process_group()


def main(parse_args: Callable, build_task: Callable, argv=None) -> dict:
    """A script's ``main``: parse, set up, ``build_task(args, env)``, :func:`fit`, tear down.

    After a failure the process group is not torn down collectively: the other ranks may never reach
    the barrier, and the launcher stops them anyway."""
    args = parse_args(argv)
    env = setup(args)
    try:
        task = build_task(args, env)
    except (FileNotFoundError, DataError, ImportError) as e:  # missing or damaged data, or a missing optional
        raise SystemExit(str(e))                                 # package: the message says what to do
    result = fit(task, args, env)
    teardown(env)
    return result


# ------------------------------------------------------------------------------------------- method

def autocast(args, env: Env):
    """The ``--amp`` context: ``torch.autocast`` on the run's device, or one that changes nothing."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    return torch.autocast(env.device.type, dtype=dtype, enabled=dtype is not None)


def configure_method(net: nn.Module, args, x_example: torch.Tensor, env: Env) -> tuple[nn.Module, str, float]:
    """Apply ``--method`` / ``--layout``; returns the (possibly converted) net, what it runs and the
    seconds autoselect took (0 without it).

    ``--method auto`` runs :func:`spikingjelly_mfpsn.functional.autoselect` on every rank (rank 0 times,
    every rank applies its choice), restricted to ``--layout`` when given, under ``--amp`` as training.
    """
    from spikingjelly_mfpsn.functional import autoselect, set_method
    if args.method == "auto":
        layouts = (args.layout,) if args.layout else ("time_first", "time_last")
        with autocast(args, env):
            report = autoselect(net, x_example, layouts=layouts, progress=False)
        env.log(str(report) if args.verbose else autoselect_line(report))
        if args.layout and report.layout != args.layout:  # (a run named after a layout it does not run)
            usage_exit(f"--layout {args.layout}: the network cannot run in it ({'; '.join(report.skipped)})")
        return net, f"auto ({report.layout})", report.seconds
    if not any(isinstance(m, MulFreeChannelwisePSN) for m in net.modules()):
        env.log(f"method={args.method}: the network has no MF-PSN layer; ignored")
        try:
            return _convert_layout(net, args.layout, x_example), "n/a", 0.0
        except (TypeError, ValueError) as e:  # (e.g. a LIF network, which has no time-last form)
            usage_exit(f"--layout {args.layout}: {' '.join(line.strip() for line in str(e).splitlines())}")
    layout = args.layout or "time_first"
    held = _HeldWarnings()  # (its warning that some layers keep their method: the usage error below says it)
    logging.getLogger("spikingjelly_mfpsn").addFilter(held)
    try:
        net = set_method(net, args.method, layout=layout, example_input=x_example)
    finally:
        logging.getLogger("spikingjelly_mfpsn").removeFilter(held)
    kept = [m for m in net.modules() if isinstance(m, MulFreeChannelwisePSN) and m.method != args.method]
    held.release(unless=bool(kept))
    if kept:  # (a run named after a method its layers do not run)
        runs = dict.fromkeys([*kept[0].supported_methods, *kept[0].candidate_methods])
        usage_exit(f"--method {args.method}: {len(kept)} MF-PSN layer(s) cannot run it in the {layout} layout (they "
                   f"run {', '.join(runs)}); pick one of those, or another --layout")
    return net, f"{args.method} ({layout})", 0.0


class _HeldWarnings(logging.Filter):
    """A logging filter that holds the records passing through it, to be let out later or dropped."""

    def __init__(self):
        super().__init__()
        self.records = []

    def filter(self, record) -> bool:
        self.records.append(record)
        return False

    def release(self, unless: bool) -> None:
        for record in [] if unless else self.records:
            logging.getLogger(record.name).handle(record)


def usage_exit(message: str):
    """Exit with status 2 and ``message``, as argparse does for a bad command line."""
    print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def autoselect_line(report) -> str:
    """Autoselect's choice in one line: the layout, how many layers run each method, the time it took."""
    took = (f"{report.timed} timed, {report.cache_hits} cached"
            + (f", {len(report.skipped)} skipped" if report.skipped else "") + f", {report.seconds:.2f} s")
    if report.layout is None:
        return f"autoselect: no configuration reproduced the network's outputs, it runs as built; {took} " \
               f"(--verbose: the table)"
    counts = Counter(m for m in report.methods.values() if m != "-")
    methods = ", ".join(f"{name} x{n}" for name, n in counts.most_common()) or "none to choose"
    totals = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in report.totals.items())
    return (f"autoselect: layout {report.layout} ({totals}), methods {methods}"
            f"{', compiled' if report.compiled else ''}; {took} (--verbose: the table)")


def _convert_layout(net: nn.Module, layout: Optional[str], x_example: torch.Tensor) -> nn.Module:
    if layout != "time_last":
        return net
    from spikingjelly_mfpsn import to_time_last
    return to_time_last(net, example_input=x_example)


# ------------------------------------------------------------------------------------------- data

class Sharded(torch.utils.data.Dataset):
    """The ``rank``-th of ``world`` interleaved shards of a data set (no padding, no duplicates)."""

    def __init__(self, dataset, rank: int, world: int):
        self.dataset, self.indices = dataset, range(rank, len(dataset), world)

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        return self.dataset[self.indices[i]]


def limit(dataset, n: Optional[int]):
    return dataset if n is None or n >= len(dataset) else torch.utils.data.Subset(dataset, range(n))


# ------------------------------------------------------------------------------------------- training

@dataclass
class Task:
    """What a script trains: data, the network, and how a batch becomes the network's input."""
    name: str
    net: nn.Module
    train_set: torch.utils.data.Dataset
    test_set: torch.utils.data.Dataset
    to_input: Callable[[torch.Tensor], torch.Tensor]  # batch from the loader -> time-first sequence
    config: dict  # everything that defines the network, checked on --resume
    after_step: Optional[Callable[[nn.Module], None]] = None  # e.g. clamp learnable delays
    param_groups: Optional[Callable[[nn.Module], list]] = None  # optimiser groups (default: one group)


def _step_batch(net, x, y, task, criterion):
    out = net(task.to_input(x))
    logits = out.mean(0)  # average the per-step scores over time
    loss = criterion(logits, y)
    return loss, (logits.argmax(1) == y).sum()


def _reduce(env: Env, *values: float) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=env.device)
    if env.world > 1:
        dist.all_reduce(t)
    return t.tolist()


def progress_bar(steps: int, desc: str, enabled: bool) -> tqdm:
    """A bar on stderr that advances once per ``update()``, or none at all when stderr is not a
    terminal (a log file gets the epoch's one summary line instead of bar redraws).

    The bar is updated by hand: one iterated over the loader keeps its count to itself between
    redraws (every ``mininterval``), so a postfix redrawn each step showed a stale "0/N"."""
    return tqdm(total=steps, desc=desc, disable=not (enabled and sys.stderr.isatty()), leave=False,
                dynamic_ncols=True, mininterval=0, miniters=1, file=sys.stderr)


def run_epoch(net, model, loader, task, env, criterion, desc, optimizer=None, scheduler=None, progress=True,
              amp=contextlib.nullcontext, scaler=None):
    """One pass over ``loader``; trains when ``optimizer`` is given. Returns (mean loss, accuracy)
    over all ranks. ``net`` is what runs (maybe DDP-wrapped), ``model`` the bare network; ``amp()``
    the context of the forward passes, ``scaler`` a ``GradScaler`` (fp16) or None."""
    train = optimizer is not None
    model.train(train)
    loss_sum, correct, count = 0.0, 0.0, 0
    with torch.set_grad_enabled(train), progress_bar(len(loader), desc, env.main and progress) as bar:
        for x, y in loader:
            x, y = x.to(env.device), y.to(env.device)
            with amp():
                loss, hits = _step_batch(net if train else model, x, y, task, criterion)
            if train:
                optimizer.zero_grad(set_to_none=True)
                if scaler is None:
                    loss.backward()
                    optimizer.step()
                else:
                    scaler.scale(loss).backward()
                    scaler.step(optimizer)
                    scaler.update()
                scheduler.step()
                if task.after_step is not None:
                    task.after_step(model)
            functional.reset_net(model)
            loss_sum += loss.item() * len(y)
            correct += hits.item()
            count += len(y)
            bar.set_postfix(loss=f"{loss_sum / count:.4f}", acc=f"{correct / count:.4f}", refresh=False)
            bar.update()  # redraws with the new count and postfix
    loss_sum, correct, count = _reduce(env, loss_sum, correct, count)
    return loss_sum / max(count, 1), correct / max(count, 1)


def make_loaders(task: Task, args, env: Env):
    """The training set, its sampler (several processes) and generator, and both data loaders."""
    train_set = limit(task.train_set, args.limit_train)
    test_set = Sharded(limit(task.test_set, args.limit_test), env.rank, env.world)
    sampler = torch.utils.data.DistributedSampler(train_set, env.world, env.rank, shuffle=True, seed=args.seed) \
        if env.world > 1 else None
    gen = torch.Generator()
    train_loader = torch.utils.data.DataLoader(train_set, args.batch_size, shuffle=sampler is None, sampler=sampler,
                                               generator=gen, drop_last=False)
    return train_set, sampler, gen, train_loader, torch.utils.data.DataLoader(test_set, args.batch_size)


def make_optimizer(task: Task, model: nn.Module, args, env: Env, total_steps: int, ckpt: Optional[dict]):
    """AdamW, its cosine schedule and the fp16 gradient scaler, in the checkpoint's state when resuming."""
    params = task.param_groups(model) if task.param_groups is not None else model.parameters()
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    # Cosine annealing per step, in closed form so that a resumed run with more epochs follows the new schedule.
    def cosine(step):
        return 0.5 * (1 + math.cos(math.pi * min(step, total_steps) / total_steps))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine)
    scaler = torch.amp.GradScaler(env.device.type) if args.amp == "fp16" else None
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        # (the optimizer's rates are the old schedule's last: the first resumed step takes the new one's)
        for group, base in zip(optimizer.param_groups, scheduler.base_lrs):
            group["lr"] = base * cosine(scheduler.last_epoch)
        if scaler is not None and ckpt.get("scaler"):
            scaler.load_state_dict(ckpt["scaler"])
    return optimizer, scheduler, scaler


def fit(task: Task, args, env: Env) -> dict:
    """Train ``task.net`` for ``args.epochs``; returns the metrics written to ``OUT_DIR/metrics.json``."""
    start_time = time.time()
    model = task.net.to(env.device)
    train_set, sampler, gen, train_loader, test_loader = make_loaders(task, args, env)
    ckpt_path = os.path.join(args.out_dir, CHECKPOINT)
    options = training_options(args, env)
    ckpt = load_checkpoint(ckpt_path, task.config, env, options) if args.resume else None
    if ckpt is not None and ckpt["epoch"] > args.epochs:  # (it trained nothing, and reported more epochs)
        raise SystemExit(f"--resume: {ckpt_path} has trained {ckpt['epoch']} epochs, more than --epochs "
                         f"{args.epochs}: pass --epochs {ckpt['epoch']} or more")
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])

    x_example = next(iter(torch.utils.data.DataLoader(train_set, args.batch_size)))[0].to(env.device)
    model, method, select_seconds = configure_method(model, args, task.to_input(x_example), env)
    functional.reset_net(model)
    net = model
    if env.world > 1:
        net = nn.parallel.DistributedDataParallel(model, device_ids=[env.device] if env.device.type == "cuda" else None)
    optimizer, scheduler, scaler = make_optimizer(task, model, args, env, args.epochs * len(train_loader), ckpt)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    history, first_epoch = ([], 0) if ckpt is None else (ckpt["history"], ckpt["epoch"])
    if ckpt is not None:
        env.log(f"resumed from {ckpt_path} after epoch {first_epoch}")

    n_params = sum(p.numel() for p in model.parameters())
    run_info = dict(task=task.name, config=task.config, args=vars(args), method=method, parameters=n_params,
                    processes=env.world, autoselect_seconds=select_seconds)
    env.log(f"{task.name}: {len(train_set)} train / {len(limit(task.test_set, args.limit_test))} test samples, "
            f"{n_params} parameters, neuron={args.neuron} k={args.k} sawtooth={args.sawtooth} method={method}, "
            f"{env.world} process(es) on {env.device}")
    if env.main:
        os.makedirs(args.out_dir, exist_ok=True)
    last_epoch = args.epochs if args.stop_after is None else min(args.epochs, first_epoch + args.stop_after)
    for epoch in range(first_epoch, last_epoch):
        t0, lr = time.time(), optimizer.param_groups[0]["lr"]  # (the rate the epoch starts with)
        seed_all(args.seed, env.rank, epoch)  # dropout and shuffling depend only on (seed, rank, epoch): resumable
        gen.manual_seed(args.seed * 1000 + epoch)
        if sampler is not None:
            sampler.set_epoch(epoch)
        tag = f"epoch {epoch + 1}/{args.epochs}"
        amp = partial(autocast, args, env)
        train_loss, train_acc = run_epoch(net, model, train_loader, task, env, criterion, f"{tag} train", optimizer,
                                          scheduler, not args.no_progress, amp, scaler)
        test_loss, test_acc = run_epoch(net, model, test_loader, task, env, criterion, f"{tag} test",
                                        progress=not args.no_progress, amp=amp)
        history.append(dict(epoch=epoch + 1, train_loss=train_loss, train_acc=train_acc, test_loss=test_loss,
                            test_acc=test_acc, lr=lr, seconds=time.time() - t0))
        env.log(f"{tag}: train loss {train_loss:.4f} acc {train_acc:.4f} | test loss {test_loss:.4f} "
                f"acc {test_acc:.4f} | {history[-1]['seconds']:.1f}s")
        if env.main:
            save_checkpoint(ckpt_path, dict(model=model.state_dict(), optimizer=optimizer.state_dict(),
                                            scheduler=scheduler.state_dict(), epoch=epoch + 1, history=history,
                                            scaler=scaler.state_dict() if scaler is not None else None,
                                            config=task.config, options=options))
            write_json(os.path.join(args.out_dir, METRICS), dict(run_info, history=history))
            plot_curves(history, os.path.join(args.out_dir, CURVES), task.name)
    return finish(run_info, history, time.time() - start_time, task, args, env)


def finish(run_info: dict, history: list, wall: float, task: Task, args, env: Env) -> dict:
    """The run's metrics (final and best accuracy, autoselect's share of an epoch), logged and written."""
    metrics = dict(run_info, history=history, wall_seconds=wall)
    select_seconds = run_info["autoselect_seconds"]
    if history:
        metrics.update(final_test_acc=history[-1]["test_acc"], best_test_acc=max(h["test_acc"] for h in history))
        if select_seconds:
            epoch_seconds = sum(h["seconds"] for h in history) / len(history)
            metrics["autoselect_percent_of_epoch"] = 100.0 * select_seconds / epoch_seconds
            env.log(f"autoselect took {select_seconds:.2f}s, {metrics['autoselect_percent_of_epoch']:.1f}% of a "
                    f"mean epoch ({epoch_seconds:.1f}s)")
        env.log(f"summary: {task.name} neuron={args.neuron} k={args.k} sawtooth={'on' if args.sawtooth else 'off'} "
                f"method={run_info['method']} epochs={len(history)} final test acc {metrics['final_test_acc']:.4f} "
                f"(best {metrics['best_test_acc']:.4f}) in {wall:.1f}s on {env.world} process(es) "
                f"-> {os.path.join(args.out_dir, METRICS)}")
    if env.main:
        write_json(os.path.join(args.out_dir, METRICS), metrics)
    return metrics


# ------------------------------------------------------------------------------------------- files

# Options the optimiser, the schedule or the data order depend on, and the test set the history's
# accuracies are taken on: a resumed run must keep them.
TRAINING_OPTIONS = ("lr", "weight_decay", "batch_size", "limit_train", "label_smoothing", "seed",
                    "delay_lr", "dropout", "duration", "limit_test")  # (limit_test: one history, one test set)


def training_options(args, env: Env) -> dict:
    """The run's :data:`TRAINING_OPTIONS` (those its script has) and its number of processes."""
    options = {name: getattr(args, name) for name in TRAINING_OPTIONS if hasattr(args, name)}
    return dict(options, processes=env.world)


def check_training_options(path: str, saved: Optional[dict], now: dict) -> None:
    """Refuse to resume with other training options than the checkpoint's (one from before they were
    saved has none to compare)."""
    if saved is None:
        return
    changed = [k for k in now if k in saved and saved[k] != now[k]]
    if changed:
        flag = {k: "torchrun --nproc_per_node" if k == "processes" else f"--{k.replace('_', '-')}" for k in changed}
        raise SystemExit(f"--resume: {path} was trained with other training options: "
                         + ", ".join(f"{flag[k]} {saved[k]!r} (now {now[k]!r})" for k in changed)
                         + "; resume with the saved values, or start a new run in another --out-dir")


def load_checkpoint(path: str, config: dict, env: Env, options: Optional[dict] = None) -> dict:
    """The checkpoint at ``path``, after checking that it was trained with the network ``config`` (and,
    when given and saved, the training ``options``)."""
    if not os.path.isfile(path):
        raise SystemExit(f"--resume: no checkpoint at {path}")
    try:  # tensors, numbers, strings and containers only: no code from the file runs
        ckpt = torch.load(path, map_location=env.device, weights_only=True)
        missing = [k for k in ("config", "model", "optimizer", "scheduler", "epoch", "history") if k not in ckpt]
        if missing:
            raise KeyError(f"it has no {', '.join(missing)}")
        saved = ckpt["config"]
    except Exception as e:  # noqa: BLE001  (a damaged file raises almost anything)
        raise SystemExit(f"--resume: {path} cannot be read as a checkpoint of these scripts ({type(e).__name__}: "
                         f"{e}); it is damaged or another file: move it away to start over") from e
    changed = {k: (saved.get(k), v) for k, v in config.items() if saved.get(k) != v}
    if changed:
        raise SystemExit(f"--resume: {path} was trained with a different network: "
                         + ", ".join(f"{k}={old!r} (now {new!r})" for k, (old, new) in changed.items()))
    if options is not None:
        check_training_options(path, ckpt.get("options"), options)
    return ckpt


def save_checkpoint(path: str, state: dict) -> None:
    """Write atomically: an interrupted save never leaves a truncated checkpoint behind."""
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def plot_curves(history: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(9, 3.5))
    for key, label in (("train", "train"), ("test", "test")):
        ax_acc.plot(epochs, [100 * h[f"{key}_acc"] for h in history], marker="o", label=label)
        ax_loss.plot(epochs, [h[f"{key}_loss"] for h in history], marker="o", label=label)
    ax_acc.set(xlabel="epoch", ylabel="accuracy (%)", title=f"{title}: accuracy")
    ax_loss.set(xlabel="epoch", ylabel="loss", title=f"{title}: loss")
    for ax in (ax_acc, ax_loss):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
