"""Run PyTorch's own DDP and ZeRO tests against minddp, with torch itself as the control.

torch's test files are not part of this project (nor downloaded by it): put
them in a folder first, from the PyTorch source matching the installed torch:
``test/distributed/test_c10d_gloo.py``, ``test/distributed/test_c10d_common.py``
and ``test/distributed/optim/test_zero_redundancy_optimizer.py`` (any folder
layout; files are found by name). Their helpers ship in torch's wheel
(``torch.testing._internal``), which needs the ``expecttest`` package::

    pip install expecttest
    PYTHONPATH=$PWD python scripts/torch_suites/run.py DIR            # both runs, then the table
    PYTHONPATH=$PWD python scripts/torch_suites/run.py DIR --list     # what would run
    python scripts/torch_suites/run.py DIR --impl minddp -k checkpointing --jsonl out.jsonl
    python scripts/torch_suites/run.py --report torch.jsonl minddp.jsonl        # the table from saved runs

Which tests: in the c10d files, every test whose class or own name mentions
``ddp`` or ``DistributedDataParallel``; in the ZeRO file, every test. Tests
torch marks GPU-only are run on the CPU where one device per rank is all they
ask for (what is patched, and why, is in ``patches.py`` beside this file).

Each implementation runs in its own process (``--impl torch`` is the
control, ``--impl minddp`` swaps in ``minddp.MiniDDP`` and
``minddp.zero.ZeroRedundancyOptimizer`` under torch's names). Every result is
appended to a JSON-lines file as soon as it is known, so a run cut short
keeps what it has; ``--report`` joins two such files into the table.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path

import classify
import distributed
import patches
import selection

SUITE_FILES = ("test_c10d_common.py", "test_c10d_gloo.py", "test_zero_redundancy_optimizer.py")
ALL_TESTS_FILES = ("test_zero_redundancy_optimizer",)  # every test of these files is selected
DDP_NAME = re.compile(r"ddp|distributeddataparallel", re.IGNORECASE)
SUITE_DIR_ENV = "TORCH_SUITES_DIR"
PEER_GONE = re.compile(r"Connection (closed|reset) by peer")  # a rank that failed because another one did
EXCEPTION_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure)\b.*)$")


def suite_modules(suite_dir: Path) -> list[str]:
    """The torch test files found under ``suite_dir``, put on ``sys.path``; their module names."""
    names = []
    for file_name in SUITE_FILES:
        found = sorted(suite_dir.rglob(file_name))
        if found:
            folder = str(found[0].parent)
            if folder not in sys.path:
                sys.path.insert(0, folder)
            names.append(found[0].stem)
    if not names:
        raise SystemExit(f"none of {', '.join(SUITE_FILES)} under {suite_dir}")
    return names


def import_suites(names: list[str]) -> list:
    modules = [importlib.import_module(name) for name in names]
    for module in modules:
        patches.retarget_suite_module(module)
    return modules


def is_selected(module_name: str, class_name: str, test_name: str) -> bool:
    """The selection rule: a whole-file suite, or a test named after DDP (by its class or itself)."""
    return module_name in ALL_TESTS_FILES or bool(DDP_NAME.search(class_name) or DDP_NAME.search(test_name))


def collect(modules: list, pattern: str | None = None) -> list[unittest.TestCase]:
    """Selected tests of the TestCase classes each module defines (not the ones it imports)."""
    loader, tests = unittest.TestLoader(), []
    for module in modules:
        for cls in vars(module).values():
            if not (isinstance(cls, type) and issubclass(cls, unittest.TestCase)) or cls.__module__ != module.__name__:
                continue
            for test in loader.loadTestsFromTestCase(cls):
                name = test.id()
                if is_selected(module.__name__, cls.__name__, test._testMethodName) and selection.matches(name, pattern):
                    tests.append(test)
    return tests


def last_exception(block: str) -> str:
    lines = [m.group(1) for m in map(EXCEPTION_LINE.match, block.splitlines()) if m]
    lines = [line for line in lines if not line.startswith("Traceback")]
    return (lines[-1] if lines else (block.strip().splitlines() or [""])[-1]).strip()


def first_error_line(text: str) -> str:
    """The exception a failed test ended on: the first rank's, unless that rank only lost its peer."""
    blocks = re.split(r"Process \d+ exited with error code \d+ and exception:\n", text)
    causes = [last_exception(block) for block in (blocks[1:] or blocks)]
    own = [cause for cause in causes if not PEER_GONE.search(cause)]
    return (own or causes)[0][:200]


def logged(log: Path, test_id: str) -> list[str]:
    """What a log of ``test id<TAB>entry`` lines (shims used, names missing) holds for one test."""
    if not log.exists():
        return []
    lines = (line.split("\t") for line in log.read_text().splitlines())
    return sorted({entry for test, entry in lines if test == test_id})


def run_one(test: unittest.TestCase, shim_log: Path) -> dict:
    result = unittest.TestResult()
    start = time.monotonic()
    os.environ[patches.CURRENT_TEST_ENV] = test.id()
    test.run(result)
    outcome: dict = {"test": test.id(), "seconds": round(time.monotonic() - start, 1),
                     "shims": logged(shim_log, test.id())}
    method = getattr(test, test._testMethodName, None)
    outcome["on_cpu"] = bool(getattr(method, "retargeted_to_cpu", False))
    if result.skipped:
        outcome.update(result="skip", error=str(result.skipped[0][1])[:200])
    elif result.failures or result.errors:
        text = (result.failures or result.errors)[0][1]
        outcome.update(result="FAIL", error=first_error_line(text), traceback=text[-6000:])
    else:
        outcome.update(result="pass", error="")
    return outcome


def _write(out, outcome: dict) -> None:
    out.write(json.dumps(outcome) + "\n")
    out.flush()
    print(f"[{outcome['impl']}] {outcome['result']:4} {outcome['seconds']:6.1f}s {outcome['test']} {outcome['error']}",
          flush=True)


def run_worker(impl: str, suite_dir: Path, pattern: str | None, jsonl: Path) -> None:
    """Run the selected tests for one implementation in this process, appending results to ``jsonl``."""
    os.environ[SUITE_DIR_ENV] = str(suite_dir)
    shim_log = jsonl.with_suffix(f".{os.getpid()}.shims")  # this run's only
    os.environ[patches.SHIM_LOG_ENV] = str(shim_log)
    patches.install(impl)
    tests = collect(import_suites(suite_modules(suite_dir)), pattern)
    with jsonl.open("a") as out:
        for test in tests:
            _write(out, dict(run_one(test, shim_log), impl=impl))


def run_distributed_worker(impl: str, pattern: str | None, jsonl: Path) -> None:
    """``distributed_test.py``'s selected tests for one implementation, the class under test chosen per test."""
    missing_log = jsonl.with_suffix(f".{os.getpid()}.missing")
    os.environ[distributed.MISSING_LOG_ENV] = str(missing_log)
    patches.install(impl, swap_classes=False)
    module = distributed.import_suite()
    tests, reaches = distributed.collect(module, pattern)
    with jsonl.open("a") as out:
        for test in tests:
            reach = reaches[test._testMethodName]
            got = distributed.use_classes(module, impl, reach.targets)
            outcome = dict(run_one(test, missing_log), impl=impl, classes=got, gpu_decorated=reach.gpu_decorated,
                           private_in_code=sorted(reach.private_names))
            outcome["missing"] = outcome.pop("shims")
            _write(out, outcome)


def load(jsonl: Path) -> dict[str, dict]:
    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    return {row["test"]: row for row in rows}  # a rerun's line replaces the earlier one


def table(control: dict[str, dict], tested: dict[str, dict]) -> str:
    """Markdown: test, torch's result, minddp's result, and the first error line of a failure."""
    lines = ["| test | torch | minddp | first error line |", "|---|---|---|---|"]
    for name in sorted(set(control) | set(tested)):
        ours, theirs = tested.get(name, {}), control.get(name, {})
        error = ours.get("error", "") if ours.get("result") != "pass" else ""
        if theirs.get("result") == "FAIL" and ours.get("result") != "FAIL":
            error = f"torch: {theirs.get('error', '')}"
        short = name.split(".", 1)[-1] + (" (on CPU)" if ours.get("on_cpu") or theirs.get("on_cpu") else "")
        cell = error.replace("|", "\\|")
        result = ours.get("result", "-") + "".join(f" (shim {s})" for s in ours.get("shims", []))
        lines.append(f"| {short} | {theirs.get('result', '-')} | {result} | {cell} |")
    lines.append("")
    files = sorted({name.split(".")[0] for name in set(control) | set(tested)})
    for prefix in [f + "." for f in files] + [""]:
        lines.append(summary(prefix, control, tested))
    return "\n".join(lines)


def summary(prefix: str, control: dict[str, dict], tested: dict[str, dict]) -> str:
    """``torch passes P of R that ran; minddp passes ...`` over the tests whose id starts with ``prefix``."""
    said = []
    for impl, rows in (("torch", control), ("minddp", tested)):
        mine = [row for name, row in rows.items() if name.startswith(prefix)]
        passed, ran = sum(r.get("result") == "pass" for r in mine), sum(r.get("result") != "skip" for r in mine)
        said.append(f"{impl} passes {passed} of {ran}" + (" that ran" if impl == "torch" else ""))
    return f"{prefix.rstrip('.') + ': ' if prefix else ''}{'; '.join(said)}."


def report(control: dict[str, dict], tested: dict[str, dict], made_by: str = "") -> str:
    """The files' table for their tests, then ``distributed_test.py``'s classification, for what the runs hold."""
    def of_distributed(rows: dict[str, dict], wanted: bool) -> dict[str, dict]:
        return {name: row for name, row in rows.items() if name.startswith(distributed.TEST_ID_PREFIX + ".") == wanted}

    parts = []
    if of_distributed(control, False) or of_distributed(tested, False):
        parts.append(table(of_distributed(control, False), of_distributed(tested, False)))
    if of_distributed(control, True) or of_distributed(tested, True):
        parts.append(classify.report(of_distributed(control, True), of_distributed(tested, True), made_by))
    return "\n\n".join(parts)


def write_into(document: Path, text: str) -> None:
    """Replace what lies between ``document``'s two result markers with ``text``."""
    begin, end = "<!-- torch_suites --report: begin -->", "<!-- torch_suites --report: end -->"
    content = document.read_text()
    if begin not in content or end not in content:
        raise SystemExit(f"{document} has no '{begin}' ... '{end}' section to fill")
    head, rest = content.split(begin, 1)
    document.write_text(f"{head}{begin}\n{text}\n{end}{rest.split(end, 1)[1]}")


def list_tests(suite: str, suite_dir: Path | None, pattern: str | None) -> list[str]:
    if suite == "files":
        patches.install("torch")
        return [test.id() for test in collect(import_suites(suite_modules(suite_dir)), pattern)]
    patches.install("torch", swap_classes=False)
    return [test.id() for test in distributed.collect(distributed.import_suite(), pattern)[0]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("suite_dir", nargs="?", type=Path, help="folder holding torch's smaller test files")
    parser.add_argument("--suite", choices=("files", "distributed", "all"),
                        help="the files in suite_dir, distributed_test.py (from the wheel), or both; "
                             "default: all with suite_dir, else distributed")
    parser.add_argument("--impl", choices=(*patches.IMPLS, "both"), default="both")
    parser.add_argument("-k", dest="pattern", help="only tests whose id contains this (a,b: either; a$: ends with a)")
    parser.add_argument("--failed", type=Path, metavar="JSONL", help="only the tests that failed in this run's results")
    parser.add_argument("--list", action="store_true", help="print the selected tests and stop")
    parser.add_argument("--jsonl", type=Path, help="append results here (one run: --impl torch or minddp)")
    parser.add_argument("--report", nargs=2, type=Path, metavar=("TORCH_JSONL", "MINDDP_JSONL"))
    parser.add_argument("--into", type=Path, metavar="DOC", help="with --report: write it into DOC's marked section")
    args = parser.parse_args(argv)
    if args.report:
        command = "python scripts/torch_suites/run.py " + " ".join(argv or sys.argv[1:])
        text = report(load(args.report[0]), load(args.report[1]), f"Made by `{command}`:" if args.into else "")
        if args.into:
            write_into(args.into, text)
        else:
            print(text)
        return
    if args.failed:
        failed = [row["test"] for row in load(args.failed).values() if row["result"] == "FAIL"]
        args.pattern = ",".join("." + name.rsplit(".", 1)[-1] + "$" for name in failed) or "no test failed"
    suite = args.suite or ("all" if args.suite_dir else "distributed")
    if suite != "distributed" and args.suite_dir is None:
        parser.error(f"--suite {suite} needs suite_dir, the folder holding torch's smaller test files")
    suites = ("files", "distributed") if suite == "all" else (suite,)
    if args.list:
        for one in suites:  # one process each: the patches are process-wide
            if len(suites) > 1:
                subprocess.run([sys.executable, __file__, str(args.suite_dir), "--suite", one, "--list"], check=False)
            else:
                names = list_tests(one, args.suite_dir, args.pattern)
                print("\n".join(names) + f"\n{len(names)} tests")
        return
    if args.impl != "both":
        if len(suites) > 1:
            parser.error("one implementation runs one suite: give --suite files or --suite distributed")
        jsonl = args.jsonl or Path(f"{args.impl}.jsonl")
        if suite == "files":
            run_worker(args.impl, args.suite_dir.resolve(), args.pattern, jsonl)
        else:
            run_distributed_worker(args.impl, args.pattern, jsonl)
        return
    out = Path(tempfile.mkdtemp(prefix="torch_suites_"))
    for one in suites:
        for impl in patches.IMPLS:  # one process each: the patches are process-wide
            command = [sys.executable, __file__, *([str(args.suite_dir)] if args.suite_dir else []), "--suite", one,
                       "--impl", impl, "--jsonl", str(out / f"{impl}.jsonl")]
            subprocess.run(command + (["-k", args.pattern] if args.pattern else []), check=False)
    print(f"results in {out}")
    print(report(load(out / "torch.jsonl"), load(out / "minddp.jsonl")))


if os.environ.get(patches.IMPL_ENV) and os.environ.get(SUITE_DIR_ENV):  # a rank spawned by a files test
    patches.install(os.environ[patches.IMPL_ENV])
    import_suites(suite_modules(Path(os.environ[SUITE_DIR_ENV])))

if __name__ == "__main__":
    main()
