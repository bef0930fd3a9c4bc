"""Bucket assignment is a pure function: no process group needed."""

import pytest
import torch

from minddp.bucket_assignment import MiB, TensorSpec, assign_buckets
from minddp.buckets import Bucket


def spec(numel, dtype=torch.float32, device="cpu"):
    return TensorSpec(numel, torch.tensor([], dtype=dtype).element_size(), dtype, torch.device(device))


def test_fills_buckets_up_to_the_cap_in_the_given_order():
    # four 100-byte tensors, cap 250 bytes: two per bucket
    assert assign_buckets([spec(25)] * 4, cap_bytes=250) == [[0, 1], [2, 3]]


def test_bucket_never_exceeds_the_cap_and_a_big_tensor_gets_its_own():
    specs = [spec(10), spec(1000), spec(10), spec(10)]
    assert assign_buckets(specs, cap_bytes=100) == [[0], [1], [2, 3]]


def test_one_bucket_when_everything_fits():
    assert assign_buckets([spec(5)] * 7, cap_bytes=MiB) == [list(range(7))]


def test_dtypes_never_mix_and_order_follows_first_member():
    specs = [spec(10), spec(10, torch.float64), spec(10), spec(10, torch.float64)]
    assert assign_buckets(specs, cap_bytes=MiB) == [[0, 2], [1, 3]]


def test_first_bucket_has_its_own_smaller_cap():
    # first cap 100 bytes, then 1 KiB: communication starts after the first small bucket
    specs = [spec(25)] * 6
    assert assign_buckets(specs, cap_bytes=1024, first_cap_bytes=100) == [[0], [1, 2, 3, 4, 5]]


def test_a_zero_cap_means_one_tensor_per_bucket_as_in_torch():
    # torch's DDP accepts bucket_cap_mb=0 and course material uses it to mean
    # "one all-reduce per parameter"; the first-bucket cap must not change that.
    assert assign_buckets([spec(1)] * 3, cap_bytes=0, first_cap_bytes=1024) == [[0], [1], [2]]


def test_rejects_a_negative_cap():
    with pytest.raises(ValueError, match="bucket cap must be >= 0"):
        assign_buckets([spec(1)], cap_bytes=-1)


def test_bucket_life_cycle_and_views():
    a, b = torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(4))
    bucket = Bucket(0, [a, b], ["a", "b"])
    assert bucket.view(a).shape == a.shape and bucket.buffer.numel() == 10
    bucket.view(b).fill_(1.0)
    assert bucket.buffer[6:].tolist() == [1.0] * 4  # views share the flat buffer
    assert bucket.mark_ready(a) is False and bucket.unready_names() == ["b"]
    with pytest.raises(RuntimeError, match="unready parameters"):
        bucket.launch(lambda _: None)
    assert bucket.mark_ready(b) is True
    with pytest.raises(RuntimeError, match="'b' produced a gradient twice"):
        bucket.mark_ready(b)
    fut = torch.futures.Future()
    bucket.launch(lambda bk: fut)
    fut.set_result(torch.full((10,), 2.0))  # a comm hook may hand back a new tensor
    bucket.wait()
    assert bucket.buffer.tolist() == [2.0] * 10
    bucket.reset()
    assert not bucket.ready and not bucket.launched
    with pytest.raises(RuntimeError, match="before it was launched"):
        bucket.wait()
