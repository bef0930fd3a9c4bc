"""benchmarks/fsdp_peers.py: its memory tracker counted on tensors made by hand, and a --quick run end to end.

The tracker (``benchmarks/benchlib/live_bytes.py``) is checked without processes: exact byte counts for
allocations, views, frees, in-place storage resizes (FSDP2's way of freeing), tensor subclasses,
and model state (parameters, gradients, communication buffers) kept apart from activations. The --quick run (a 2-block GPT, 2 ranks, one round)
checks that every setup trains to the same parameters as torch's DDP and that the memory table
has what it promises; it asserts nothing about timings.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "benchmarks", "experiments")]

from benchlib.live_bytes import LiveBytes  # noqa: E402

KiB = 1024


def test_live_bytes_counts_allocations_views_and_frees_exactly():
    with LiveBytes() as live:
        a = torch.empty(256)  # 1 KiB
        b = torch.empty(512)  # 2 KiB
        view = a[10:20]  # no new storage
        assert (live.current, live.peak) == (3 * KiB, 3 * KiB)
        del a
        assert live.current == 3 * KiB  # the view keeps a's storage alive
        del view, b
        assert (live.current, live.peak) == (0, 3 * KiB)
        live.reset_peak()
        c = torch.ones(128)
        assert live.peak == KiB // 2
        del c


def test_live_bytes_follows_storage_resizes_and_counts_tensors_made_before_the_window():
    before = torch.zeros(1024)  # 4 KiB, made outside
    original = torch.UntypedStorage.resize_
    with LiveBytes() as live:
        live.track([before], {"x": before})  # counted once
        assert live.current == 4 * KiB
        full = torch.empty(2048)
        full.untyped_storage().resize_(0)  # FSDP2 frees a gathered parameter like this
        assert live.current == 4 * KiB
        full.untyped_storage().resize_(2048 * 4)
        assert (live.current, live.peak) == (12 * KiB, 12 * KiB)
    assert torch.UntypedStorage.resize_ is original  # the wrapper lives only as long as the window


def test_live_bytes_counts_parameters_and_their_gradients_as_model_state_not_activations():
    """Two 16 KiB weights, a batch of 32: in backward the 8 KiB gradients flowing from the
    second layer back to the first, and what the forward saved, are activations; the weights
    and their gradients are model state, 64 KiB exactly. Not vacuous: counting every byte
    but what autograd saved (this tracker's earlier rule) put the flowing gradients in too."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.ReLU(),
                                torch.nn.Linear(64, 64, bias=False))
    def step():
        x = torch.randn(32, 64)  # made in the step (anything alive between steps is model state)
        model(x).sum().backward()

    with LiveBytes() as live:
        live.track(list(model.parameters()))
        live.watch_parameters(model)
        live.reset_peak()
        step()
        assert live.peak > live.peak_state == 64 * KiB
        live.reset_peak()  # from here, what lives from the step before counts (the gradients too)
        for p in model.parameters():
            p.grad = None  # zero_grad: the gradients go
        assert live.peak_state == 64 * KiB


@pytest.mark.timeout(120)
def test_quick_run_every_setup_trains_like_torch_ddp(tmp_path):
    out = tmp_path / "peers.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "fsdp_peers.py"), "--quick", "--json",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=100,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, f"fsdp_peers.py --quick failed:\n{proc.stdout}\n{proc.stderr}"
    (result,) = json.loads(out.read_text())["results"]
    assert result["world_size"] == 2
    setups = set(result["memory"])
    assert {"torch-ddp", "ddp", "stage1", "stage2", "fsdp2"} <= setups
    for name in setups:
        # Same weights, same batches, two ranks: the same sums, so the same parameters.
        assert result["param_diff"][name] < 1e-6 and result["time_param_diff"][name] < 1e-6, (name, result)
        m = result["memory"][name]
        assert 0 < m["built"] <= m["peak_state"] <= m["peak_all"], (name, m)
    numel = 43_904  # the quick GPT: parameters + gradients + AdamW's two moments are live at once under DDP
    assert result["memory"]["ddp"]["peak_state"] >= 16 * numel
    assert result["memory"]["fsdp2"]["built"] < result["memory"]["ddp"]["built"]  # sharded at construction
    assert "| fsdp2 |" in proc.stdout and "CPU / FSDP2" in proc.stdout


def test_thread_cpu_reader_charges_work_to_the_thread_that_did_it():
    """benchmarks/experiments/fsdp_threads.py reads each thread's CPU from /proc: 0.3 s of busy work on the main
    thread shows there, and a busy helper thread does not (it is 'other')."""
    import threading
    import time

    import fsdp_threads

    def busy(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    before = fsdp_threads.thread_cpu_ms()
    busy(0.3)
    helper = threading.Thread(target=busy, args=(0.3,))
    helper.start(), helper.join()
    after = fsdp_threads.thread_cpu_ms()
    assert 250 <= after["main"] - before["main"] <= 450
    assert after["gloo_tcp_loop"] == before["gloo_tcp_loop"]


def _a_step_made_local(rank, world_size):
    from benchlib.fsdp_setups import collectives_made_local
    from c10d_calls import RecordedCollectives
    from minddp.fsdp import fully_shard, unit

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    fully_shard(model[0]), fully_shard(model[1]), fully_shard(model)
    originals = unit.all_gather, unit.start_reduce_scatter
    with collectives_made_local(True), RecordedCollectives() as local:
        model(torch.randn(4, 8)).sum().backward()
    with RecordedCollectives() as normal:
        model(torch.randn(4, 8)).sum().backward()
    restored = (unit.all_gather, unit.start_reduce_scatter) == originals
    return local.calls, normal.calls, restored


def test_the_local_floor_runs_a_stage3_step_without_any_collective(ranks):
    """fsdp_threads' 'stage3 local' row and validate_stage3's compute mean 'the step with no
    communication': not one c10d call (a normal step right after makes some, so the recording sees
    them), and the real collectives come back."""
    for local_calls, calls, restored in ranks(2).run(_a_step_made_local, timeout_s=60):
        assert local_calls == [] and calls and restored, (local_calls, calls)
