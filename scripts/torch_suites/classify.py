"""Why a test of ``distributed_test.py`` passes or fails on minddp, given torch's result beside it.

Every selected test gets one kind:

* ``pass both``, ``fail both``, ``skip`` (skipped by either run);
* ``minddp only``: torch fails (on the CPU) where minddp passes;
* for a test torch passes and minddp fails, one of
  ``torch-private`` (the test asked minddp for a torch-private name it does
  not have; the name is the reason), ``documented`` (a difference the
  project documents, in :data:`DOCUMENTED`, and minddp failed with the
  error that difference gives), or ``defect`` (anything else: to fix).

A *torch-private name* is one that starts with ``_`` (not a dunder) and that
torch's own class has: ``DistributedDataParallel``, its C++ ``Reducer`` and
``Logger``, ``SyncBatchNorm``, ``DistributedSampler`` (its attributes, and the
``self._x`` its source assigns); or an attribute torch's DDP sets on itself
without documenting it (it documents ``module`` only): ``bucket_bytes_cap_list``. Two witnesses say minddp lacked one: the
runner's record of private names asked of minddp's classes that they did not
have, and ``has no attribute '_x'`` in the failure's traceback. A recorded
name counts only where the test's own code (``private_in_code``) or the
traceback names it, so a library probing with ``hasattr`` is not a cause.
"""

from __future__ import annotations

import functools
import inspect
import re

from selection import is_private

PASS, FAIL, SKIP = "pass", "FAIL", "skip"
NO_ATTRIBUTE = re.compile(r"has no attribute '(\w+)'")
ASSIGNED_ON_SELF = re.compile(r"self\.(_\w+)\s*[:=]")

# What torch's DDP documents as its attributes ("Attributes:" in its docstring); every other
# attribute its source sets on itself (``self.bucket_bytes_cap_list = ...``) is torch's own.
DOCUMENTED_DDP_ATTRIBUTES = frozenset({"module"})
ASSIGNED_ANY_ON_SELF = re.compile(r"self\.(\w+)\s*=[^=]")

# Tests torch passes where minddp fails with an answer the project documents (docs/features.md):
# test -> (the start of minddp's expected first error line, why).
DOCUMENTED: dict[str, tuple[str, str]] = {
    test: ("RuntimeError: MiniDDP: parameters", "the earlier error for a parameter that got no gradient: at the end "
           "of that backward, naming it (docs/features.md); torch's DDP raises at the next forward, as the test expects")
    for test in ("test_ddp_multiple_nested_unused_params_error", "test_ddp_multiple_nested_unused_params_err_ignore_params",
                 "test_ddp_unused_params_rebuild_buckets_exception")
} | {
    test: ("AssertionError: Expected 'iteration' in ddp_logging_data", "MiniDDP raises torch's error (the test's "
           "assertRaisesRegex passes), but _get_ddp_logging_data() keeps no record of it: torch's private logger's "
           "'iteration' and 'error' fields (docs/frameworks.md)")
    for test in ("test_ddp_python_error_logged", "test_invalid_static_graph")
} | {
    "test_different_graph_across_ranks": ("AssertionError: 0 is not true", "_get_ddp_logging_data() has no "
        "'has_rebuilt_buckets' field; the buckets are rebuilt when torch rebuilds them (tests/library/test_bucket_boundaries.py)"),
    "test_skip_all_reduce_unused_parameters": ("AssertionError: Scalars are not equal!", "skip_all_reduce_unused_params: "
        "the used map is exchanged once, as torch, but a bucket no rank used is still all-reduced (its zeros: the same "
        "values, one collective more), so num_buckets_reduced is 2 where torch's is 1 (docs/torch_suites.md)"),
}


@functools.lru_cache(maxsize=1)
def undocumented_ddp_attributes() -> frozenset[str]:
    """Public-looking attributes torch's DDP sets on itself but does not document (``bucket_bytes_cap_list``)."""
    import torch.nn.parallel.distributed as ddp_module

    assigned = set(ASSIGNED_ANY_ON_SELF.findall(inspect.getsource(ddp_module.DistributedDataParallel)))
    return frozenset(name for name in assigned if not name.startswith("_")) - DOCUMENTED_DDP_ATTRIBUTES


@functools.lru_cache(maxsize=1)
def torch_private_names() -> frozenset[str]:
    """The private names of torch's DDP, Reducer, Logger, SyncBatchNorm and DistributedSampler.

    Their attributes, every ``self._x`` the source of a class they derive from assigns
    (``Joinable`` gives DDP its ``_join_config``), and DDP's undocumented attributes.
    """
    import torch.distributed as dist
    import torch.nn.parallel.distributed as ddp_module
    import torch.utils.data.distributed as sampler_module
    from torch.nn.modules import batchnorm

    names = set(undocumented_ddp_attributes())
    for cls in (ddp_module.DistributedDataParallel, dist.Reducer, dist.Logger, batchnorm.SyncBatchNorm,
                sampler_module.DistributedSampler):
        names |= {name for name in dir(cls) if is_private(name)}
        for base in cls.__mro__:
            try:
                names |= set(ASSIGNED_ON_SELF.findall(inspect.getsource(base)))
            except (OSError, TypeError):  # a class written in C++
                pass
    return frozenset(names)


def missing_private(row: dict, private: frozenset[str] | None = None) -> list[str]:
    """The torch-private names minddp lacked in this (failed) test, by the two witnesses above."""
    private = torch_private_names() if private is None else private
    traceback = row.get("traceback", "")
    in_traceback = set(NO_ATTRIBUTE.findall(traceback))
    recorded = {entry.rsplit(".", 1)[-1] for entry in row.get("missing", [])}
    in_code = set(row.get("private_in_code", []))
    named = in_traceback | {name for name in recorded if name in in_code or name in traceback}
    return sorted(named & private)


def classify(torch_row: dict | None, minddp_row: dict | None, documented: dict[str, tuple[str, str]] | None = None,
             private: frozenset[str] | None = None) -> tuple[str, str]:
    """``(kind, reason)`` for one test from the two runs' rows (see the module docstring)."""
    documented = DOCUMENTED if documented is None else documented
    theirs, ours = (torch_row or {}).get("result"), (minddp_row or {}).get("result")
    if theirs is None or ours is None:
        return "not run", "only one side ran"
    if SKIP in (theirs, ours):
        return "skip", (torch_row if theirs == SKIP else minddp_row).get("error", "")
    if theirs == ours == PASS:
        return "pass both", ""
    if theirs == FAIL and ours == FAIL:
        return "fail both", f"torch: {torch_row.get('error', '')}; minddp: {minddp_row.get('error', '')}"
    if theirs == FAIL:
        return "minddp only", f"torch: {torch_row.get('error', '')}"
    names = missing_private(minddp_row, private)
    if names:
        return "torch-private", ", ".join(n if n.startswith("_") else f"{n} (undocumented attribute)" for n in names)
    test_name = minddp_row["test"].rsplit(".", 1)[-1]
    expected_error, why = documented.get(test_name, (None, ""))
    if expected_error is not None and minddp_row.get("error", "").startswith(expected_error):
        return "documented", why
    return "defect", minddp_row.get("error", "")


def counts(rows: dict[str, dict]) -> str:
    results = [row.get("result") for row in rows.values()]
    return f"{results.count(PASS)} / {results.count(FAIL)} / {results.count(SKIP)}"


def report(control: dict[str, dict], tested: dict[str, dict], made_by: str = "") -> str:
    """Markdown: the counts, the remaining minddp failures with their reasons, then every test's kind.

    ``made_by`` (the command that made it, for a document) stands before each table.
    """
    said = [made_by, ""] if made_by else []
    names = sorted(set(control) | set(tested))
    kinds = {name: classify(control.get(name), tested.get(name)) for name in names}
    torch_passes = [n for n in names if control.get(n, {}).get("result") == PASS]
    public = [n for n in torch_passes if kinds[n][0] != "torch-private"]
    public_passed = [n for n in public if tested.get(n, {}).get("result") == PASS]
    gpu = sum(bool(control.get(n, tested.get(n, {})).get("gpu_decorated")) for n in names)
    lines = said + [
        f"| {len(names)} selected ({gpu} GPU-decorated, run on the CPU) | torch pass / fail / skip "
        f"| minddp pass / fail / skip |",
        "|---|---|---|",
        f"| distributed_test.py | {counts(control)} | {counts(tested)} |",
        "",
        f"**Public-behaviour tests torch passes: {len(public)}; minddp passes {len(public_passed)} of them.** "
        f"({len(torch_passes) - len(public)} more torch passes call a torch-private name minddp lacks.)",
        "",
        "Every test torch passes and minddp fails, and why:",
        "",
        *said,
        "| test | kind | reason (the torch-private names, or minddp's first error line) |",
        "|---|---|---|",
    ]
    for name in torch_passes:
        kind, reason = kinds[name]
        if tested.get(name, {}).get("result") == FAIL:
            lines.append(f"| {_short(name)} | {kind} | {_cell(reason)} |")
    lines += ["", "The torch-private names those tests ask for, and how many tests each stops:", ""]
    lines += [f"- `{name}`: {count}" for name, count in _private_name_counts(kinds, torch_passes, tested)]
    lines += ["", "Every selected test:", "", *said, "| test | reaches | torch | minddp | kind | note |", "|---|---|---|---|---|---|"]
    for name in names:
        row = control.get(name) or tested.get(name, {})
        reached = _reached(tested.get(name, {}))
        kind, reason = kinds[name]
        lines.append(f"| {_short(name)}{' (on CPU)' if row.get('gpu_decorated') else ''} | {reached} "
                     f"| {control.get(name, {}).get('result', '-')} | {tested.get(name, {}).get('result', '-')} "
                     f"| {kind} | {_cell(reason)} |")
    return "\n".join(lines)


def _private_name_counts(kinds: dict, torch_passes: list[str], tested: dict[str, dict]) -> list[tuple[str, int]]:
    counted: dict[str, int] = {}
    for name in torch_passes:
        kind, reason = kinds[name]
        if kind == "torch-private" and tested.get(name, {}).get("result") == FAIL:
            for private in reason.split(", "):
                counted[private] = counted.get(private, 0) + 1
    return sorted(counted.items(), key=lambda item: (-item[1], item[0]))


def _reached(row: dict) -> str:
    return ", ".join(k.replace("DistributedDataParallel", "DDP") for k, side in row.get("classes", {}).items()
                     if side == "minddp")


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:240]
