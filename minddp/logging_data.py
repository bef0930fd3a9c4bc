"""``model._get_ddp_logging_data()``: torch's dictionary of what a DDP model is and did, for what minddp knows.

torch's DDP logs its construction arguments, its buckets and runtime
statistics into a C++ logger, and ``_get_ddp_logging_data`` returns them as
one dictionary. Lightning reads it at the end of every ``fit``, and torch's
own tests read it. MiniDDP answers with the same keys and the same values
for everything it knows, recorded when torch records it (``num_buckets_reduced``:
the count of the backward before the last synchronized forward; torch samples
it after its tenth iteration, MiniDDP records it at every one). The keys it
has no value for (torch's timings, ``bucket_sizes`` of its construction-time
buckets, ``can_set_static_graph``, its NCCL settings) are absent, as in
torch before they are known, so ``.get(key)`` answers None.
"""

from __future__ import annotations

import os

import torch.distributed as dist

__all__ = ["ddp_logging_data"]


def ddp_logging_data(ddp) -> dict[str, int | str]:
    params = ddp.reducer.params
    data: dict[str, int | str] = {
        "world_size": ddp.world_size,
        "rank": dist.get_rank(ddp.process_group),
        "module_name": type(ddp.module).__name__,
        "device_ids": ",".join(str(i) for i in ddp.device_ids or ()),
        "output_device": ddp.device_ids[0] if ddp.device_ids else -1,
        "broadcast_buffers": int(ddp.forward_sync_buffers),
        "bucket_cap_bytes": ddp.bucket_bytes_cap,
        "find_unused_parameters": int(ddp.find_unused_parameters),
        "gradient_as_bucket_view": int(ddp.gradient_as_bucket_view),
        "backend_name": dist.get_backend(ddp.process_group),
        "has_sync_bn": int(any(type(m).__name__ == "SyncBatchNorm" for m in ddp.module.modules())),
        "is_multi_device_module": int(len({p.device for p in params}) > 1),
        "num_parameter_tensors": len(params),
        "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
        "master_addr": os.environ.get("MASTER_ADDR", "N/A"),
        "master_port": os.environ.get("MASTER_PORT", "N/A"),
    }
    if ddp.reducer.buckets_reduced_logged is not None:  # recorded at a synchronized forward, as torch's
        data["num_buckets_reduced"] = ddp.reducer.buckets_reduced_logged
    return data
