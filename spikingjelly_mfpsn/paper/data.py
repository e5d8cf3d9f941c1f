"""Data for the examples: bundled handwritten digits, CIFAR-10/100 pickles, SHD .h5 files.

Nothing is downloaded. Images come back as float tensors ``(N, C, H, W)`` in ``[0, 1]`` with int64
labels; :func:`to_columns` and :func:`to_pixels` turn a batch into the time-first sequences of the
sequential and pixel tasks.
"""
from __future__ import annotations

import importlib.util
import math
import os
import pickle
import tarfile
import zlib
from typing import Optional

import numpy as np
import torch

Split = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # x_train, y_train, x_test, y_test

CIFAR = {
    # name: (archive, extracted folder, train members, test member, label key, classes)
    "cifar10": ("cifar-10-python.tar.gz", "cifar-10-batches-py",
                [f"data_batch_{i}" for i in range(1, 6)], "test_batch", b"labels", 10),
    "cifar100": ("cifar-100-python.tar.gz", "cifar-100-python", ["train"], "test", b"fine_labels", 100),
}
CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar.html"
SHD_FILES = ("shd_train.h5", "shd_test.h5")
SHD_URL = "https://zenkelab.org/resources/spiking-heidelberg-datasets-shd/"


class DataError(ValueError):
    """A data file that is there but cannot be used: damaged, truncated or of another format."""


def _unpickle(read, where: str, name: str) -> dict:
    """A CIFAR batch from ``read()`` (its bytes); a damaged or foreign file raises :class:`DataError`."""
    try:
        batch = pickle.loads(read(), encoding="bytes")
    except Exception as e:  # noqa: BLE001  (a damaged pickle raises almost anything)
        raise DataError(f"{where} is not a readable CIFAR python batch ({type(e).__name__}: {e}): the file is "
                        f"damaged or of another format; unpack the {name} python archive again") from e
    if not isinstance(batch, dict):
        raise DataError(f"{where} is not a CIFAR python batch: it holds a {type(batch).__name__}, not a dict")
    return batch


def load_digits(test_fraction: float = 0.25, seed: int = 0) -> Split:
    """scikit-learn's bundled handwritten digits (1797 images, 8x8, 10 classes), as a fixed split.

    The split is class-stratified. Images ``(N, 1, 8, 8)`` in ``[0, 1]``.
    """
    try:
        from sklearn.datasets import load_digits as sk_load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as e:
        if importlib.util.find_spec("sklearn") is not None:  # installed, but broken: its own error says why
            raise
        raise ImportError("the digits data set needs scikit-learn: pip install scikit-learn") from e
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    d = sk_load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    i_train, i_test = train_test_split(np.arange(len(y)), test_size=test_fraction, random_state=seed,
                                       stratify=d.target)
    i_train, i_test = torch.as_tensor(i_train), torch.as_tensor(i_test)
    return x[i_train], y[i_train], x[i_test], y[i_test]


def _integers(value, where: str, what: str, low: int, high: int) -> np.ndarray:
    """``value`` as an integer array with every entry in ``low..high``; anything else (floats, strings,
    ragged lists, values out of range) raises :class:`DataError` naming ``where`` and ``what``."""
    try:
        a = np.asarray(value)
    except (ValueError, TypeError) as e:  # ragged nested lists
        raise DataError(f"{where}: {what} is not an array of integers ({e})") from e
    if a.size == 0 and a.dtype.kind == "f":  # an empty list reads as float64
        a = a.astype(np.int64)
    if a.dtype.kind not in "ui":
        raise DataError(f"{where}: {what} must hold integers in {low}..{high}, got dtype {a.dtype}")
    if a.size and (a.min() < low or a.max() > high):
        raise DataError(f"{where}: {what} must hold integers in {low}..{high}, got values {a.min()}..{a.max()}")
    return a


def _cifar_arrays(batch: dict, label_key: bytes, classes: int, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    if b"data" not in batch or label_key not in batch:
        raise DataError(f"{where} is not a CIFAR python batch: it lacks the keys b'data' and {label_key!r}")
    data = _integers(batch[b"data"], where, "b'data'", 0, 255)
    if data.ndim != 2 or data.shape[1] != 3072:
        raise DataError(f"{where}: b'data' must be (N, 3072) uint8, got shape {data.shape}")
    labels = _integers(batch[label_key], where, f"{label_key!r} (the labels)", 0, classes - 1)
    if labels.shape != (data.shape[0],):
        raise DataError(f"{where}: {label_key!r} must be a list of {data.shape[0]} labels, one per image, "
                        f"got shape {labels.shape}")
    x = torch.from_numpy(data.astype(np.uint8).reshape(-1, 3, 32, 32).astype(np.float32) / 255.0)
    return x, torch.from_numpy(labels.astype(np.int64))


def load_cifar(data_dir: str, name: str = "cifar10") -> Split:
    """CIFAR-10/100 from the standard python-pickle archive in ``data_dir``.

    ``data_dir`` holds either the archive itself (``cifar-10-python.tar.gz`` / ``cifar-100-python.tar.gz``)
    or its extracted folder (``cifar-10-batches-py/`` / ``cifar-100-python/``), or is that folder itself.
    Images ``(N, 3, 32, 32)`` in ``[0, 1]``.

    The batches are Python pickles: only read files from the official archive (or your own).
    """
    if name not in CIFAR:
        raise ValueError(f"name must be one of {sorted(CIFAR)}, got {name!r}")
    _, _, train_members, test_member, label_key, classes = CIFAR[name]
    batches = _cifar_batches(data_dir, name)
    train = [_cifar_arrays(batches[m][0], label_key, classes, batches[m][1]) for m in train_members]
    x_test, y_test = _cifar_arrays(batches[test_member][0], label_key, classes, batches[test_member][1])
    if not sum(len(y) for _, y in train):
        raise DataError(f"{name}: the training batches ({', '.join(train_members)}) hold no images")
    if not len(y_test):
        raise DataError(f"{batches[test_member][1]}: the test batch holds no images")
    return torch.cat([x for x, _ in train]), torch.cat([y for _, y in train]), x_test, y_test


def _cifar_batches(data_dir: str, name: str) -> dict:
    """``{member: (unpickled batch, where it was read)}`` of CIFAR ``name`` from ``data_dir``: the extracted
    folder (or ``data_dir`` itself) where it holds every batch, else the archive."""
    archive, folder, train_members, test_member, _, _ = CIFAR[name]
    archive_path = os.path.join(data_dir, archive)
    members = train_members + [test_member]
    folders = [p for p in (os.path.join(data_dir, folder), data_dir)
               if all(os.path.isfile(os.path.join(p, m)) for m in members)]
    if folders:
        paths = {m: os.path.join(folders[0], m) for m in members}
        batches = {}
        for m, path in paths.items():
            with open(path, "rb") as f:
                batches[m] = (_unpickle(f.read, path, name), path)
        return batches
    if os.path.isfile(archive_path):
        return _cifar_archive(archive_path, folder, members, name)
    partial = os.path.join(data_dir, folder)
    if os.path.isdir(partial):
        missing = [m for m in members if not os.path.isfile(os.path.join(partial, m))]
        raise FileNotFoundError(f"{partial} lacks {', '.join(missing)}: extract the whole {archive} there again "
                                f"(or put the archive itself in --data-dir {data_dir!r})")
    raise FileNotFoundError(
        f"{name} not found in --data-dir {data_dir!r}: put the python version of the data set there, either "
        f"the archive {archive} or its extracted folder {folder}/ (with {', '.join(members)}). "
        f"It is published at {CIFAR_URL}; nothing is downloaded automatically.")


def _cifar_archive(archive_path: str, folder: str, members: list, name: str) -> dict:
    """:func:`_cifar_batches` from the ``.tar.gz`` archive."""
    try:
        with tarfile.open(archive_path, "r:gz") as tar:
            names = set(tar.getnames())
            missing = [m for m in members if f"{folder}/{m}" not in names]
            if missing:
                raise FileNotFoundError(f"{archive_path} lacks {folder}/{missing[0]}; is it the {name} python "
                                        f"archive?")
            where = {m: f"{archive_path}:{folder}/{m}" for m in members}
            return {m: (_unpickle(_member(tar, f"{folder}/{m}", archive_path).read, where[m], name), where[m])
                    for m in members}
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise DataError(f"{archive_path} cannot be read as a .tar.gz archive ({type(e).__name__}: {e}): it is "
                        f"damaged or truncated; fetch {os.path.basename(archive_path)} again ({CIFAR_URL})") from e


def _member(tar: tarfile.TarFile, member: str, archive_path: str):
    """The open file of ``member`` in ``tar``; a member that is not a regular file raises :class:`DataError`."""
    f = tar.extractfile(member)
    if f is None:
        raise DataError(f"{archive_path}:{member} is not a file (a folder or a link): the archive is not the "
                        f"CIFAR python archive; fetch it again ({CIFAR_URL})")
    return f


def num_classes(name: str) -> int:
    """Number of classes of an image data set name ('digits', 'cifar10', 'cifar100')."""
    if name != "digits" and name not in CIFAR:
        raise ValueError(f"name must be 'digits' or one of {sorted(CIFAR)}, got {name!r}")
    return 10 if name == "digits" else CIFAR[name][-1]


def load_images(name: str, data_dir: Optional[str] = None) -> Split:
    """``'digits'`` (bundled) or ``'cifar10'`` / ``'cifar100'`` from ``data_dir``."""
    if name == "digits":
        return load_digits()
    if name in CIFAR:
        if data_dir is None:
            raise ValueError(f"dataset {name!r} needs --data-dir, the folder holding {CIFAR[name][0]}")
        return load_cifar(data_dir, name)
    raise ValueError(f"dataset must be 'digits', 'cifar10' or 'cifar100', got {name!r}")


def standardize(x_train: torch.Tensor, *others: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Zero mean, unit variance per channel, with the statistics of ``x_train`` applied to all."""
    dims = [d for d in range(x_train.dim()) if d != 1]
    mean = x_train.mean(dims, keepdim=True)
    std = x_train.std(dims, keepdim=True).clamp_min(1e-6)
    return tuple((x - mean) / std for x in (x_train, *others))


def to_columns(images: torch.Tensor) -> torch.Tensor:
    """``(N, C, H, W)`` images -> ``(T=W, N, C, H)``: one column per time step."""
    return images.permute(3, 0, 1, 2).contiguous()


def to_pixels(images: torch.Tensor) -> torch.Tensor:
    """``(N, C, H, W)`` images -> ``(T=H*W, N, C)``: one pixel per time step, row by row."""
    return images.flatten(2).permute(2, 0, 1).contiguous()


class SHD(torch.utils.data.Dataset):
    """Spiking Heidelberg Digits from its .h5 file, binned into frames of spike counts.

    Each sample is binned into ``bins`` frames. The file holds ``spikes/times`` in seconds, ``spikes/units``
    in 0..699 and ``labels``.

    Args:
        path: ``shd_train.h5`` or ``shd_test.h5``
        bins: number of time steps T
        duration: seconds covered by the bins; spikes at or after it (or before 0) are dropped and
            counted in :attr:`dropped_spikes`. ``None``: the latest spike time in the file, so nothing is dropped
        unit_bin: sum this many neighbouring input channels (700 / unit_bin features)
        units: number of input channels of the recording (700 for SHD)

    An item is ``(frames (T, units / unit_bin) float32, label int64)``.
    """

    def __init__(self, path: str, bins: int = 100, duration: Optional[float] = None, unit_bin: int = 5,
                 units: int = 700):
        try:
            import h5py
        except ImportError as e:
            raise ImportError("reading SHD needs h5py: pip install h5py") from e
        for name, v in (("bins", bins), ("unit_bin", unit_bin), ("units", units)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not (duration is None or isinstance(duration, (int, float)) and not isinstance(duration, bool)):
            raise ValueError(f"duration must be a finite number of seconds > 0 or None, got {duration!r}")
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"SHD file {path!r} not found: put {SHD_FILES[0]} and {SHD_FILES[1]} (gunzip the .h5.gz files "
                f"published at {SHD_URL}) in --data-dir; nothing is downloaded automatically.")
        try:
            f = h5py.File(path, "r")
        except OSError as e:
            raise DataError(f"{path} cannot be read as HDF5 ({e}): it is damaged, truncated or still gzipped; "
                            f"gunzip the .h5.gz published at {SHD_URL} again") from e
        try:
            with f:
                self.times, self.units, labels = _read_shd(f, path)
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001  (damage inside the file raises almost anything from h5py)
            raise DataError(f"{path} cannot be read as an SHD file ({type(e).__name__}: {e}): it is damaged; "
                            f"gunzip the .h5.gz published at {SHD_URL} again") from e
        self.labels = _checked_samples(path, self.times, self.units, labels, units)
        latest = max((t.max() for t in self.times if t.size), default=0.0)
        if duration is None:
            duration = float(np.nextafter(latest, np.inf)) if latest > 0 else 1.0
        if not (math.isfinite(duration) and duration > 0):
            raise ValueError(f"duration must be a finite number of seconds > 0, got {duration!r}")
        self.bins, self.duration, self.unit_bin = bins, float(duration), unit_bin
        self.features = -(-units // unit_bin)
        self.dropped_spikes = int(sum(((t < 0) | (t >= self.duration)).sum() for t in self.times))

    @property
    def num_classes(self) -> int:
        return int(self.labels.max()) + 1 if len(self.labels) else 0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        t, u = self.times[i], self.units[i]
        keep = (t >= 0) & (t < self.duration)
        step = np.minimum((t[keep] / self.duration * self.bins).astype(np.int64), self.bins - 1)
        frames = np.zeros((self.bins, self.features), dtype=np.float32)
        np.add.at(frames, (step, u[keep] // self.unit_bin), 1.0)
        return torch.from_numpy(frames), torch.tensor(self.labels[i])


def _read_shd(f, path: str) -> tuple[list, list, np.ndarray]:
    """(spike times, units, labels) of the open SHD file ``f``, as read (checked by the caller)."""
    for key in ("spikes/times", "spikes/units", "labels"):
        if key not in f:
            raise DataError(f"{path} is not an SHD file: it has no dataset {key!r}")
    times = [np.asarray(t, dtype=np.float64) for t in f["spikes/times"]]
    units = [np.asarray(u) for u in f["spikes/units"]]  # (integers: checked by the caller, not truncated here)
    return times, units, np.asarray(f["labels"])


def _checked_samples(path: str, times: list, units: list, labels: np.ndarray, channels: int) -> np.ndarray:
    """The int64 labels of an SHD file, after checking its samples; what does not fit raises :class:`DataError`."""
    labels = _integers(labels, path, "labels", 0, np.iinfo(np.int64).max).astype(np.int64)
    if labels.ndim != 1:
        raise DataError(f"{path}: labels must be one label per sample (shape (N,)), got shape {labels.shape}")
    if not len(times) == len(units) == len(labels):
        raise DataError(f"{path}: {len(times)} spike-time lists, {len(units)} unit lists and "
                        f"{len(labels)} labels; they must match")
    for i, (t, u) in enumerate(zip(times, units)):
        if t.shape != u.shape:
            raise DataError(f"{path}: sample {i} has {t.size} spike times but {u.size} units")
        if not np.isfinite(t).all():
            raise DataError(f"{path}: sample {i} has a spike time that is not a finite number (NaN or inf)")
        units[i] = _integers(u, path, f"spikes/units of sample {i}", 0, channels - 1).astype(np.int64)
    return labels


def load_shd(data_dir: str, **kwargs) -> tuple[SHD, SHD]:
    """``(train, test)`` :class:`SHD` sets from ``data_dir``, binned over the same duration.

    A file without samples raises :class:`DataError`."""
    train = SHD(os.path.join(data_dir, SHD_FILES[0]), **kwargs)
    kwargs["duration"] = train.duration
    test = SHD(os.path.join(data_dir, SHD_FILES[1]), **kwargs)
    for ds, name in ((train, SHD_FILES[0]), (test, SHD_FILES[1])):
        if not len(ds):
            raise DataError(f"{os.path.join(data_dir, name)} holds no samples")
    return train, test


__all__ = ["CIFAR", "SHD", "DataError", "load_cifar", "load_digits", "load_images", "load_shd", "num_classes", "standardize", "to_columns",
           "to_pixels"]
