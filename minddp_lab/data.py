"""Datasets and per-rank loaders.

* :class:`SyntheticMNIST`: MNIST-shaped data made up on the fly from a seed:
  no files, no network, so every demo and lesson runs offline. The labels
  are learnable (each class is a fixed pattern of strokes, moved and dimmed
  at random, under noise), so a training loss visibly falls.
* :func:`load_mnist`: the real MNIST through ``torchvision.datasets.MNIST``
  from a local folder. Nothing touches the network unless ``download=True``,
  and then only rank 0 downloads while the others wait at a barrier.
* :func:`make_loader`: a ``DataLoader`` over this rank's shard, through
  :class:`minddp.DistributedSampler`, with a *global* batch size split evenly
  over the ranks and reproducible worker seeding.

Images are float tensors ``[1, 28, 28]`` in ``[0, 1]``; labels are ints.
"""

from __future__ import annotations

import functools
import gzip
import os
import shutil
import tempfile
from typing import Sized

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from minddp.sampler import DistributedSampler

__all__ = ["SyntheticMNIST", "load_mnist", "make_dataset", "make_loader", "MNIST_FILES", "DATA_KINDS"]

DATA_KINDS = ("synthetic", "mnist")
# What torchvision's MNIST reads: these four files, uncompressed, in ROOT/MNIST/raw/.
MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
SIDE = 28
CLASSES = 10
MAX_SHIFT = 3  # pixels a synthetic glyph moves, in each direction
NOISE = 0.2  # standard deviation of the synthetic images' pixel noise


# --------------------------------------------------------------- synthetic
@functools.lru_cache(maxsize=1)
def _class_patterns() -> torch.Tensor:
    """Ten fixed 28x28 "glyphs" (three soft strokes each, the same for every seed), zero-padded.

    Fixed on purpose: the training and the test split (and any seed) must be
    drawn from the same classes, or a test accuracy would mean nothing.
    """
    g = torch.Generator().manual_seed(20240528)
    ys, xs = torch.meshgrid(torch.arange(SIDE, dtype=torch.float32), torch.arange(SIDE, dtype=torch.float32), indexing="ij")
    pixels = torch.stack([xs, ys], dim=-1)  # [28, 28, 2]
    patterns = torch.zeros(CLASSES, SIDE, SIDE)
    for c in range(CLASSES):
        for _ in range(3):
            a, b = 5 + 18 * torch.rand(2, 2, generator=g)  # stroke end points inside the frame
            # Distance of every pixel to the segment a-b.
            ab = b - a
            t = ((pixels - a) @ ab / ab.dot(ab).clamp_min(1e-6)).clamp(0, 1)
            nearest = a + t[..., None] * ab
            dist2 = ((pixels - nearest) ** 2).sum(-1)
            patterns[c] = torch.maximum(patterns[c], torch.exp(-dist2 / (2 * 1.3**2)))
    # Zero border of MAX_SHIFT pixels: a 28x28 window of it is the glyph, moved.
    return torch.nn.functional.pad(patterns, (MAX_SHIFT,) * 4)


class SyntheticMNIST(Dataset):
    """A deterministic MNIST look-alike: ``(image [1, 28, 28] in [0, 1], label)``.

    Sample ``i`` depends only on ``(seed, train, i)``: it is generated when
    asked for, from its own random generator, so construction is instant,
    memory stays flat, and worker processes need no shared state. The
    training and test splits (``train``) never share a sample.
    """

    classes = [str(d) for d in range(CLASSES)]

    def __init__(self, size: int = 60000, seed: int = 0, train: bool = True):
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"size must be an int >= 0, got {size!r}")
        self.size = size
        self.seed = seed
        self.train = train
        self._stream = 2 * seed + (0 if train else 1)  # separate streams for the two splits
        # Per-sample label, shift and brightness: drawn for all samples at once
        # (a few hundred KB); only the noise is drawn per sample, when asked for.
        g = torch.Generator().manual_seed(self._item_seed(-1))
        self.targets = torch.randint(0, CLASSES, (size,), generator=g)
        self._shifts = torch.randint(0, 2 * MAX_SHIFT + 1, (size, 2), generator=g).tolist()
        self._brightness = (0.6 + 0.4 * torch.rand(size, generator=g, dtype=torch.float64)).tolist()

    def _item_seed(self, index: int) -> int:
        # torch's CPU generator (Mersenne Twister) keeps only 32 bits of its
        # seed. Consecutive seeds within a dataset, and a pseudo-random 32-bit
        # offset per (seed, split): two datasets overlap only if their offsets
        # fall within len(dataset) of each other (about 3e-5 for MNIST's size).
        return (index + 1 + self._stream * 0x9E3779B1) % (1 << 32)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not -self.size <= index < self.size:
            raise IndexError(f"index {index} out of range for SyntheticMNIST of size {self.size}")
        index %= self.size
        label = int(self.targets[index])
        y, x = self._shifts[index]  # a window of the zero-padded glyph: the glyph moved by up to 3 pixels
        glyph = _class_patterns()[label, y : y + SIDE, x : x + SIDE]
        noise = torch.randn(1, SIDE, SIDE, generator=torch.Generator().manual_seed(self._item_seed(index)))
        return noise.mul_(NOISE).add_(glyph, alpha=self._brightness[index]).clamp_(0.0, 1.0), label

    def __repr__(self) -> str:
        split = "train" if self.train else "test"
        return f"SyntheticMNIST(size={self.size}, seed={self.seed}, {split})"


# ------------------------------------------------------------------- MNIST
def _how_to_get_mnist(root: str) -> str:
    raw = os.path.join(root, "MNIST", "raw")
    return (
        f"Get it with load_mnist({root!r}, download=True) (minddp-train --data mnist --data-dir {root} --download), "
        f"or copy the four MNIST files ({', '.join(MNIST_FILES)}; .gz files are fine) into {raw}. "
        "Or use the synthetic data, which needs no files: make_dataset('synthetic') (minddp-train --data synthetic)."
    )


def _gunzip_missing(raw: str) -> None:
    """Unpack NAME.gz into NAME where only the .gz is there (torchvision reads uncompressed files).

    Decompressed into a temporary file then renamed, so ranks that do this at
    the same time on a shared folder never read a half-written file.
    """
    for name in MNIST_FILES:
        target, packed = os.path.join(raw, name), os.path.join(raw, name + ".gz")
        if os.path.exists(target) or not os.path.exists(packed):
            continue
        fd, tmp = tempfile.mkstemp(dir=raw, prefix=name + ".")
        try:
            with gzip.open(packed, "rb") as src, os.fdopen(fd, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.replace(tmp, target)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise


def _download_on_rank0(root: str) -> None:
    from torchvision import datasets

    grouped = dist.is_available() and dist.is_initialized()
    failure: BaseException | None = None
    if not grouped or dist.get_rank() == 0:
        try:
            datasets.MNIST(root, train=True, download=True)  # fetches both splits
        except Exception as exc:  # still reach the barrier, so no rank hangs
            failure = exc
    if grouped:
        dist.barrier()
    if failure is not None:
        raise RuntimeError(f"downloading MNIST into {root} failed: {failure}") from failure


def load_mnist(root: str | os.PathLike, train: bool = True, download: bool = False) -> Dataset:
    """MNIST from ``root/MNIST/raw`` through torchvision, images as ``[1, 28, 28]`` floats in ``[0, 1]``.

    ``download=True`` fetches the files first (rank 0 only, when a process
    group is initialized; every rank must then call this). Otherwise nothing
    reaches the network: a missing folder raises ``FileNotFoundError`` and an
    unreadable file ``RuntimeError``, both saying how to get the data.
    """
    from torchvision import datasets, transforms

    root = os.fspath(root)
    if download:
        _download_on_rank0(root)
    raw = os.path.join(root, "MNIST", "raw")
    if os.path.isdir(raw):
        _gunzip_missing(raw)
    missing = [name for name in MNIST_FILES if not os.path.isfile(os.path.join(raw, name))]
    if missing:
        where = f"{raw} lacks {', '.join(missing)}" if os.path.isdir(raw) else f"there is no folder {raw}"
        raise FileNotFoundError(f"MNIST not found: {where}. {_how_to_get_mnist(root)}")
    try:
        return datasets.MNIST(root, train=train, transform=transforms.ToTensor(), download=False)
    except Exception as exc:
        raise RuntimeError(
            f"MNIST files in {raw} could not be read ({type(exc).__name__}: {exc}); they may be truncated "
            f"or not MNIST. Delete them and get them again. {_how_to_get_mnist(root)}"
        ) from exc


def make_dataset(
    kind: str, root: str | os.PathLike | None = None, train: bool = True, download: bool = False
) -> Dataset:
    """``"synthetic"`` (the default everywhere: offline) or ``"mnist"`` (from ``root``, default ``./data``).

    The synthetic splits have MNIST's sizes: 60000 training, 10000 test images.
    """
    if kind == "synthetic":
        return SyntheticMNIST(size=60000 if train else 10000, train=train)
    if kind == "mnist":
        return load_mnist("data" if root is None else root, train=train, download=download)
    raise ValueError(f"unknown dataset kind {kind!r}; choose one of {', '.join(DATA_KINDS)}")


# ------------------------------------------------------------------ loader
def make_loader(
    dataset: Sized,
    global_batch_size: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = True,
    pad: bool = True,
    num_workers: int = 0,
    rank: int | None = None,
    world_size: int | None = None,
    pin_memory: bool | None = None,
) -> DataLoader:
    """A ``DataLoader`` over this rank's shard; each batch holds ``global_batch_size // world_size`` samples.

    ``rank``/``world_size`` default to the initialized process group's (or 0
    and 1 without one). ``drop_last`` (default) drops the samples that do not
    fill a whole step on every rank, so all ranks take the same number of
    full steps; ``drop_last=False, pad=False`` is the evaluation setting
    (every sample exactly once). Call ``loader.sampler.set_epoch(epoch)`` at
    the start of every epoch. Random numbers drawn in worker processes
    (augmentation) are reproducible: they depend on ``seed``, the rank and
    the worker only.

    ``pin_memory`` (default: when the process group's backend is NCCL, whose
    ranks train on GPUs) puts batches in page-locked memory: only from there
    is ``batch.to("cuda", non_blocking=True)`` asynchronous; from ordinary
    memory the copy makes the CPU wait. Pass ``True`` for Gloo with CUDA tensors.
    """
    grouped = dist.is_available() and dist.is_initialized()
    if pin_memory is None:
        pin_memory = grouped and dist.get_backend() == "nccl" and torch.cuda.is_available()
    if world_size is None or rank is None:
        if world_size is None:
            world_size = dist.get_world_size() if grouped else 1
        if rank is None:
            rank = dist.get_rank() if grouped else 0
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ValueError(f"global_batch_size must be an int >= 1, got {global_batch_size!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if global_batch_size % world_size:
        raise ValueError(
            f"global batch size {global_batch_size} does not divide evenly over {world_size} ranks; "
            f"use a multiple of {world_size}, e.g. {global_batch_size // world_size * world_size or world_size} "
            f"or {(global_batch_size // world_size + 1) * world_size}"
        )
    sampler = DistributedSampler(
        dataset, world_size, rank, shuffle=shuffle, seed=seed, drop_last=drop_last, pad=pad
    )
    # Worker seeding: each time an epoch starts, the DataLoader draws a base
    # seed from this generator, and worker w seeds torch, Python's random and
    # NumPy from base + w. Seeding the generator from (seed, rank) makes all
    # of it reproducible, and different on every rank.
    generator = torch.Generator()
    generator.manual_seed((seed * 1_000_003 + rank) % (1 << 63))
    return DataLoader(
        dataset,
        batch_size=global_batch_size // world_size,
        sampler=sampler,
        drop_last=drop_last,
        num_workers=num_workers,
        generator=generator,
        pin_memory=pin_memory,
    )
