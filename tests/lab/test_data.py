"""Synthetic data, real MNIST files through torchvision, and per-rank loaders."""

import gzip
import os
import random
import struct
import time

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from minddp_lab.data import MNIST_FILES, SyntheticMNIST, load_mnist, make_dataset, make_loader


# ------------------------------------------------------------------ synthetic
def test_synthetic_has_mnist_shape_and_is_deterministic():
    start = time.perf_counter()
    data = SyntheticMNIST()  # 60000 samples
    assert time.perf_counter() - start < 2.0  # nothing is generated up front
    assert len(data) == 60000
    image, label = data[123]
    assert image.shape == (1, 28, 28) and image.dtype == torch.float32
    assert 0.0 <= image.min() and image.max() <= 1.0
    assert isinstance(label, int) and 0 <= label < 10
    again, label_again = SyntheticMNIST()[123]
    assert torch.equal(image, again) and label == label_again
    assert torch.equal(data[-1][0], data[59999][0])
    assert not torch.equal(SyntheticMNIST(seed=1)[123][0], image)
    assert not torch.equal(SyntheticMNIST(train=False)[123][0], image)
    with pytest.raises(IndexError, match="out of range"):
        data[60000]
    with pytest.raises(ValueError, match="size must be an int >= 0, got -1"):
        SyntheticMNIST(size=-1)


def test_synthetic_labels_are_learnable_from_the_images():
    train, test = SyntheticMNIST(2000, seed=3), SyntheticMNIST(500, seed=3, train=False)
    x = torch.stack([train[i][0].flatten() for i in range(len(train))])
    class_means = torch.stack([x[train.targets == c].mean(0) for c in range(10)])
    xt = torch.stack([test[i][0].flatten() for i in range(len(test))])
    accuracy = (torch.cdist(xt, class_means).argmin(1) == test.targets).float().mean().item()
    assert 0.5 < accuracy  # far above chance (0.1): a classifier has something to learn


def test_make_dataset_kinds(tmp_path):
    assert len(make_dataset("synthetic")) == 60000 and len(make_dataset("synthetic", train=False)) == 10000
    with pytest.raises(ValueError, match="unknown dataset kind 'cifar'; choose one of synthetic, mnist"):
        make_dataset("cifar")
    with pytest.raises(FileNotFoundError):
        make_dataset("mnist", root=tmp_path)


# ---------------------------------------------------------------------- MNIST
def _idx_bytes(array: torch.Tensor) -> bytes:
    """The IDX format: 0, 0, type (0x08 = unsigned byte), ndim; big-endian dims; the data."""
    header = bytes([0, 0, 0x08, array.dim()]) + b"".join(struct.pack(">I", d) for d in array.shape)
    return header + array.to(torch.uint8).contiguous().numpy().tobytes()


def write_tiny_mnist(root, n_train=6, n_test=4, compress=False, seed=0):
    """A real-format MNIST with a few images, in ROOT/MNIST/raw; returns the arrays."""
    g = torch.Generator().manual_seed(seed)
    raw = os.path.join(root, "MNIST", "raw")
    os.makedirs(raw, exist_ok=True)
    arrays = {}
    for split, n in (("train", n_train), ("t10k", n_test)):
        arrays[split] = (torch.randint(0, 256, (n, 28, 28), generator=g), torch.randint(0, 10, (n,), generator=g))
        for kind, array in zip(("images-idx3", "labels-idx1"), arrays[split]):
            path = os.path.join(raw, f"{split}-{kind}-ubyte")
            data = _idx_bytes(array)
            if compress:
                with gzip.open(path + ".gz", "wb") as f:
                    f.write(data)
            else:
                with open(path, "wb") as f:
                    f.write(data)
    return arrays


@pytest.mark.parametrize("compress", [False, True], ids=["ubyte", "gz"])
@pytest.mark.parametrize("train", [True, False])
def test_tiny_mnist_loads_through_torchvision(tmp_path, compress, train):
    arrays = write_tiny_mnist(tmp_path, compress=compress)
    images, labels = arrays["train" if train else "t10k"]
    data = load_mnist(tmp_path, train=train)
    assert len(data) == len(labels)
    for i in range(len(data)):
        image, label = data[i]
        assert image.shape == (1, 28, 28) and image.dtype == torch.float32
        torch.testing.assert_close(image[0], images[i].float() / 255)
        assert label == labels[i].item()


def test_missing_mnist_says_how_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        load_mnist(tmp_path / "nowhere")
    message = str(info.value)
    assert "there is no folder" in message and os.path.join("nowhere", "MNIST", "raw") in message
    assert "download=True" in message and "synthetic" in message


def test_partly_missing_mnist_names_the_missing_files(tmp_path):
    write_tiny_mnist(tmp_path)
    os.remove(tmp_path / "MNIST" / "raw" / "t10k-labels-idx1-ubyte")
    with pytest.raises(FileNotFoundError, match="lacks t10k-labels-idx1-ubyte"):
        load_mnist(tmp_path)


def test_broken_mnist_file_is_a_clear_error(tmp_path):
    write_tiny_mnist(tmp_path)
    with open(tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte", "wb") as f:
        f.write(b"not an idx file")
    with pytest.raises(RuntimeError, match="could not be read.*synthetic"):
        load_mnist(tmp_path)


def test_nothing_reaches_the_network_without_download(tmp_path, monkeypatch):
    import torchvision.datasets

    def no_network(*args, **kwargs):
        raise AssertionError("tried to download")

    monkeypatch.setattr(torchvision.datasets.MNIST, "download", no_network)
    with pytest.raises(FileNotFoundError):
        load_mnist(tmp_path)


def _download_with_a_group(rank, world_size, root):
    """Every rank asks for a download; the fake download is slow and records who ran it."""
    import torchvision.datasets

    def fake_download(self):
        with open(os.path.join(root, f"downloaded-by-{rank}"), "w"):
            pass
        time.sleep(1.0)  # a rank that did not wait would find no files
        write_tiny_mnist(root)

    original = torchvision.datasets.MNIST.download
    torchvision.datasets.MNIST.download = fake_download
    try:
        return len(load_mnist(root, train=False, download=True))
    finally:
        torchvision.datasets.MNIST.download = original


def test_download_runs_on_rank0_while_the_others_wait(ranks, tmp_path):
    assert ranks(2).run(_download_with_a_group, str(tmp_path), timeout_s=60) == [4, 4]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("downloaded")) == ["downloaded-by-0"]


# --------------------------------------------------------------------- loader
def test_per_rank_batch_is_the_global_batch_split():
    data = SyntheticMNIST(100)
    loader = make_loader(data, 12, rank=1, world_size=3)
    images, labels = next(iter(loader))
    assert images.shape == (4, 1, 28, 28) and labels.shape == (4,)
    assert len(loader) == 100 // 3 // 4  # 33 samples per rank, full batches only
    with pytest.raises(ValueError, match=r"global batch size 10 does not divide evenly over 3 ranks.*9 or 12"):
        make_loader(data, 10, rank=0, world_size=3)
    with pytest.raises(ValueError, match=r"global_batch_size must be an int >= 1, got 0"):
        make_loader(data, 0, rank=0, world_size=1)


class _Indices(Dataset):
    """Returns its index and a random number drawn where the sample is loaded."""

    def __len__(self):
        return 50

    def __getitem__(self, i):
        return i, torch.rand(()).item(), random.random()


def _one_epoch(loader, epoch=0):
    loader.sampler.set_epoch(epoch)
    return [tuple(t.tolist() for t in batch) for batch in loader]


def test_each_rank_sees_its_shard_and_shards_cover_the_data():
    world = 3
    loaders = [make_loader(_Indices(), 6, rank=r, world_size=world, drop_last=False) for r in range(world)]
    seen = [[i for batch in _one_epoch(loader) for i in batch[0]] for loader in loaders]
    assert [len(s) for s in seen] == [17, 17, 17]  # 50 padded to 51
    assert set().union(*map(set, seen)) == set(range(50))
    assert len(set(seen[0]) & set(seen[1])) <= 1  # disjoint but for the padding
    # Evaluation setting: every sample exactly once.
    loaders = [make_loader(_Indices(), 6, rank=r, world_size=world, drop_last=False, pad=False) for r in range(world)]
    assert sorted(i for loader in loaders for batch in _one_epoch(loader) for i in batch[0]) == list(range(50))


@pytest.mark.parametrize("workers", [0, 2])
def test_loading_is_reproducible_and_differs_by_rank_and_epoch(workers):
    def epoch(rank, seed=0, number=0):
        loader = make_loader(_Indices(), 8, rank=rank, world_size=2, seed=seed, num_workers=workers)
        return _one_epoch(loader, number)

    def indices(batches):
        return [batch[0] for batch in batches]

    first = epoch(0)
    assert indices(epoch(0)) == indices(first)
    assert indices(epoch(1)) != indices(first)
    assert indices(epoch(0, number=1)) != indices(first)
    assert indices(epoch(0, seed=1)) != indices(first)
    if workers:
        # Random numbers drawn in workers (torch's and Python's) are reproducible
        # too; without workers they come from the main process's own generators.
        assert epoch(0) == first
        assert epoch(1) != first and epoch(0, number=1) != first
        values = [v for batch in first for v in batch[2]]
        assert len(set(values)) == len(values)  # workers do not repeat each other


def _loader_from_group(rank, world_size):
    loader = make_loader(SyntheticMNIST(40), 8, shuffle=False)
    return loader.batch_size, list(loader.sampler)[:3], dist.get_world_size()


def test_loader_takes_rank_and_world_from_the_process_group(ranks):
    assert ranks(2).run(_loader_from_group) == [(4, [0, 2, 4], 2), (4, [1, 3, 5], 2)]
