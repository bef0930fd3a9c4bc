"""The torch-suites runner's own logic, on a tiny fake test file (torch's real files are not in the project).

``scripts/torch_suites.py`` selects tests by name, re-targets GPU-only tests
to the CPU and reads results back; these tests check each of those pieces
without installing its process-wide patches (they would swap torch's DDP
class in this very pytest process).
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import torch_suites  # noqa: E402
import torch_suites_patches as patches  # noqa: E402

FAKE_SUITE = textwrap.dedent('''
    import unittest

    class DistributedDataParallelTest(unittest.TestCase):
        def test_anything(self):
            pass

    class ProcessGroupTest(unittest.TestCase):
        def test_ddp_comm_hook(self):
            pass

        def test_allreduce(self):
            pass
''')


def load_fake(tmp_path: Path, module_name: str):
    path = tmp_path / f"{module_name}.py"
    path.write_text(FAKE_SUITE)
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_selection_by_class_or_test_name_mentioning_ddp(tmp_path):
    tests = torch_suites.collect([load_fake(tmp_path, "test_c10d_gloo")])
    names = sorted(t.id().split(".", 1)[1] for t in tests)
    assert names == ["DistributedDataParallelTest.test_anything", "ProcessGroupTest.test_ddp_comm_hook"]


def test_the_zero_file_is_selected_whole_and_k_filters(tmp_path):
    module = load_fake(tmp_path, "test_zero_redundancy_optimizer")
    assert len(torch_suites.collect([module])) == 3
    assert [t._testMethodName for t in torch_suites.collect([module], "allreduce")] == ["test_allreduce"]


def test_suite_files_are_found_by_name_in_any_folder(tmp_path):
    (tmp_path / "test" / "distributed").mkdir(parents=True)
    (tmp_path / "test" / "distributed" / "test_c10d_gloo.py").write_text("")
    assert torch_suites.suite_modules(tmp_path) == ["test_c10d_gloo"]
    with pytest.raises(SystemExit, match="none of"):
        torch_suites.suite_modules(tmp_path / "test" / "distributed" / "missing")


def test_first_error_line_is_the_first_ranks_exception():
    text = (
        "Traceback (most recent call last):\nRuntimeError: Process 0 exited with error code 10 and exception:\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in f\nAssertionError: grads differ\n\n'
        "Process 1 exited with error code 10 and exception:\nValueError: other rank\n"
    )
    assert torch_suites.first_error_line(text) == "AssertionError: grads differ"
    peer_gone = text.replace("AssertionError: grads differ", "RuntimeError: [pair.cc:561] Connection closed by peer")
    assert torch_suites.first_error_line(peer_gone) == "ValueError: other rank"


def test_table_names_results_shims_and_counts():
    control = {"m.C.test_a": {"result": "pass"}, "m.C.test_b": {"result": "pass", "on_cpu": True}}
    tested = {"m.C.test_a": {"result": "FAIL", "error": "KeyError: x"},
              "m.C.test_b": {"result": "pass", "on_cpu": True, "shims": ["_all_params"]}}
    text = torch_suites.table(control, tested)
    assert "| C.test_a | pass | FAIL | KeyError: x |" in text
    assert "| C.test_b (on CPU) | pass | pass (shim _all_params) |  |" in text
    assert text.endswith("m: torch passes 2 of 2 that ran; minddp passes 1 of 2.\n"
                         "torch passes 2 of 2 that ran; minddp passes 1 of 2.")


def test_accelerator_devices_become_the_cpu():
    with patches.CpuDevices():
        made = torch.zeros(2, device=0)
        moved = torch.ones(1).to(1)
        named = torch.ones(1).to("cuda:1", torch.float64)
        module = torch.nn.Linear(2, 2).to(device=1)
    assert {made.device.type, moved.device.type, named.device.type, module.weight.device.type} == {"cpu"}
    assert named.dtype == torch.float64


def test_one_gpu_per_rank_is_retargeted_more_is_left_to_skip():
    calls = []
    skip_if_lt_x_gpu = patches.retarget_lt_x_gpu(lambda x, allow_cpu=False: calls.append(x) or (lambda f: f))
    seen = []

    @skip_if_lt_x_gpu(2)
    def test(x):
        torch.accelerator.set_device_index(1)  # a no-op while retargeted
        seen.append(torch.ones(1, device=x).device.type)

    before = torch.accelerator.set_device_index
    test(0)
    assert seen == ["cpu"] and test.retargeted_to_cpu and torch.accelerator.set_device_index is before
    skip_if_lt_x_gpu(4)
    assert calls == [4]


def test_device_ids_are_dropped_for_a_module_on_the_cpu():
    class RecordingDDP:
        def __init__(self, module, device_ids=None, output_device=None, **kwargs):
            self.device_ids, self.output_device, self.kwargs = device_ids, output_device, kwargs

    wrapped = patches.cpu_ddp(RecordingDDP)(torch.nn.Linear(1, 1), device_ids=[0], output_device=0, static_graph=True)
    assert (wrapped.device_ids, wrapped.output_device, wrapped.kwargs) == (None, None, {"static_graph": True})
    assert patches.cpu_ddp(RecordingDDP).__name__ == "RecordingDDP"


def test_tests_needing_an_accelerator_backend_skip_without_one():
    @patches.needs_accelerator_backend()
    def test():
        pass

    assert getattr(test, "__unittest_skip__", False) is (not torch.accelerator.is_available())
