"""How much a learner reads: lines, and lines of code (no blank line, comment or docstring), per file.

    python scripts/reading_lines.py                      # minddp's core and wrapper
    python scripts/reading_lines.py PATH [PATH ...]      # any Python files (another project's, to compare)
"""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAIN_PATH = ["minddp/ddp/core/reducer.py", "minddp/ddp/core/slots.py", "minddp/ddp/core/buckets.py",
              "minddp/ddp/core/assignment.py", "minddp/ddp/core/weak_hooks.py", "minddp/ddp/core/messages.py",
              "minddp/ddp/wrapper.py"]


def docstring_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                lines |= set(range(first.lineno, first.end_lineno + 1))
    return lines


def count(path: Path) -> tuple[int, int]:
    source = path.read_text()
    skip = docstring_lines(ast.parse(source))
    lines = source.splitlines()
    code = sum(1 for i, line in enumerate(lines, 1) if line.strip() and not line.strip().startswith("#") and i not in skip)
    return len(lines), code


def main() -> None:
    paths = [Path(p) for p in sys.argv[1:]] or [ROOT / p for p in PLAIN_PATH]
    total = [0, 0]
    for path in paths:
        lines, code = count(path)
        total[0] += lines
        total[1] += code
        print(f"{lines:>6} {code:>6}  {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    print(f"{total[0]:>6} {total[1]:>6}  total (lines, lines of code)")


if __name__ == "__main__":
    main()
