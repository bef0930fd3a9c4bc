"""Bucket assignment is a pure function: no process group needed."""

import pytest
import torch

from minddp.ddp.core.assignment import MiB, TensorSpec, assign_buckets
from minddp.ddp.core.buckets import Bucket


def spec(numel, dtype=torch.float32, device="cpu"):
    return TensorSpec(numel, torch.tensor([], dtype=dtype).element_size(), dtype, torch.device(device))


def test_a_bucket_closes_after_the_tensor_that_reaches_the_cap():
    # four 100-byte tensors, cap 250 bytes: the third passes the cap and closes the bucket (torch's rule)
    assert assign_buckets([spec(25)] * 4, cap_bytes=250) == [[0, 1, 2], [3]]
    assert assign_buckets([spec(25)] * 4, cap_bytes=200) == [[0, 1], [2, 3]]  # exactly at the cap: closed


def test_a_bucket_passes_its_cap_by_one_tensor_at_most():
    specs = [spec(10), spec(1000), spec(10), spec(10)]
    assert assign_buckets(specs, cap_bytes=100) == [[0, 1], [2, 3]]


def test_one_bucket_when_everything_fits():
    assert assign_buckets([spec(5)] * 7, cap_bytes=MiB) == [list(range(7))]


def test_dtypes_never_mix_and_buckets_come_in_the_order_they_close():
    specs = [spec(10), spec(10, torch.float64), spec(10), spec(10, torch.float64)]
    assert assign_buckets(specs, cap_bytes=MiB) == [[0, 2], [1, 3]]
    specs = [spec(10, torch.float64), spec(20), spec(10), spec(30, torch.float64)]
    assert assign_buckets(specs, cap_bytes=100) == [[1, 2], [0, 3]]  # the float32 one closed first


def test_first_bucket_has_its_own_smaller_cap():
    # first cap 100 bytes, then 1 KiB: communication starts after the first small bucket
    specs = [spec(25)] * 6
    assert assign_buckets(specs, cap_bytes=1024, first_cap_bytes=100) == [[0], [1, 2, 3, 4, 5]]


def test_a_zero_cap_means_one_tensor_per_bucket_as_in_torch():
    # torch's DDP accepts bucket_cap_mb=0 and course material uses it to mean
    # "one all-reduce per parameter"; the first-bucket cap must not change that.
    assert assign_buckets([spec(1)] * 3, cap_bytes=0, first_cap_bytes=1024) == [[0], [1], [2]]


def _random_specs(seed):
    g = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.float32, torch.float64, torch.float16]
    return [spec(int(torch.randint(0, 400, (1,), generator=g)), dtypes[int(torch.randint(0, 4, (1,), generator=g))])
            for _ in range(int(torch.randint(1, 30, (1,), generator=g)))]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("limits", [[0], [100], [1000], [300, 1000], [50, 200, 600], [10 ** 9]])
def test_assignment_equals_torchs_own(seed, limits):
    """torch's ``compute_bucket_assignment_by_size`` (the installed torch's, through its Python binding)
    is the oracle: in gradient-arrival order (a rebuild) and in registration order (the first guess)."""
    from minddp.ddp.core.assignment import first_guess_buckets

    specs = _random_specs(seed)
    tensors = [torch.zeros(s.numel, dtype=s.dtype) for s in specs]
    arrival = list(range(len(specs)))
    torchs, _ = torch.distributed._compute_bucket_assignment_by_size(tensors, limits, [], arrival)
    mine = assign_buckets(specs, limits[-1], per_bucket_caps=limits)
    # Across dtypes, torch lists the buckets still open at the end in its hash map's order (unspecified):
    # compare the buckets of each dtype, in order.
    for dtype in {s.dtype for s in specs}:
        assert [b for b in mine if specs[b[0]].dtype == dtype] == [b for b in torchs if specs[b[0]].dtype == dtype]
    assert len(mine) == len(torchs)
    torchs_first, _ = torch.distributed._compute_bucket_assignment_by_size(tensors, limits)
    assert first_guess_buckets(specs, limits) == list(reversed(torchs_first))  # DDP reverses them
    single = [s for s in specs if s.dtype == torch.float32]
    if single:  # one dtype: the order is torch's exactly
        tensors = [torch.zeros(s.numel) for s in single]
        torchs, _ = torch.distributed._compute_bucket_assignment_by_size(tensors, limits, [], list(range(len(single))))
        assert assign_buckets(single, limits[-1], per_bucket_caps=limits) == torchs


def test_rejects_a_negative_cap():
    with pytest.raises(ValueError, match="bucket cap must be >= 0"):
        assign_buckets([spec(1)], cap_bytes=-1)


def test_bucket_life_cycle_and_views():
    a, b = torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(4))
    bucket = Bucket(0, [a, b], ["a", "b"], [0, 1])
    assert bucket.views[0].shape == a.shape and bucket.buffer.numel() == 10
    bucket.views[1].fill_(1.0)
    assert bucket.buffer[6:].tolist() == [1.0] * 4  # views share the flat buffer
    assert bucket.mark_ready_at(0) is False and bucket.unready_names() == ["b"]
    with pytest.raises(RuntimeError, match="unready parameters"):
        bucket.launch(lambda _: None)
    assert bucket.mark_ready_at(1) is True
    with pytest.raises(RuntimeError, match="'b' produced a gradient twice"):
        bucket.mark_ready_at(1)
    fut = torch.futures.Future()
    bucket.launch(lambda bk: fut)
    fut.set_result(torch.full((10,), 2.0))  # a comm hook may hand back a new tensor
    bucket.wait()
    assert bucket.buffer.tolist() == [2.0] * 10
    bucket.reset()
    assert not bucket.ready and not bucket.launched
    with pytest.raises(RuntimeError, match="before it was launched"):
        bucket.wait()
