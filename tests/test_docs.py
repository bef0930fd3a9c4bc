"""The README is a short way in, and the docs pages it links hold up: links resolve,
tables name their commands, the lesson lists match the lessons, the figures draw."""

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
LESSONS_README = ROOT / "lessons" / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, LESSONS_README, *DOCS]
# Pages other people are writing at the same time; a link to one of them may wait for it.
PAGES_WRITTEN_ELSEWHERE = {"real_links.md"}
# Pages whose first lines must say what is on them (the others' pages included once they exist).
OWN_PAGES = ["features.md", "against_torch.md", "memory.md", "launching.md", "simulator.md", "testing.md", "glossary.md",
             "reading_the_code.md", "simulator_checked.md", "collectives_checked.md"]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
LOOK_BACK = 40  # lines before a table where the command that made it may stand (same section)
COMMAND = re.compile(r"`(?:python3?|bash|PYTHONPATH=|minddp-train|pytest|sbatch|mpirun|torchrun|NPROC=|NNODES=|NP=)[^`]*`|```(?:bash|sh)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def relative_links(page: pathlib.Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+://|mailto:", t)]


def test_the_readme_stays_under_1500_words():
    words = len(README.read_text().split())
    assert words <= 1500, f"README.md has {words} words; the reference material belongs in docs/ (at most 1500)"


def test_the_readme_first_screen_starts_the_course():
    text = README.read_text()
    first = text[: text.index("## The two set-up commands")]
    assert "python lessons/01_process_group.py" in first, "the first lesson's command belongs before the set-up commands"
    assert "--index-url https://download.pytorch.org/whl/cpu" in first, "the CPU-only install belongs on the first screen"
    assert "| part | lessons |" in first, "the learning path belongs on the first screen"


def lesson_numbers() -> set[str]:
    return {p.name.split("_")[0] for p in (ROOT / "lessons").glob("[0-9]*_*.py")}


def numbers_in(cell: str) -> set[str]:
    """The lessons a cell names: '01-08' is 01 to 08 with 07b; '16-18, 17b' is 16, 17, 17b, 18."""
    found = set()
    for low, high, single in re.findall(r"(\d+)-(\d+)|(\d+b?)", cell):
        if single:
            found.add(single)
        else:
            found |= {n for n in lesson_numbers() if int(low) <= int(n.rstrip("b")) <= int(high)}
    return found


@pytest.mark.parametrize("page", [README, LESSONS_README], ids=["README", "lessons/README"])
def test_the_learning_path_covers_every_lesson_once(page):
    rows = [line for line in page.read_text().splitlines() if re.match(r"\| \d\. ", line)]
    assert rows, f"{page.name}: no learning-path table (rows '| 1. part | lessons | ...')"
    seen: list[str] = []
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        seen += sorted(numbers_in(next(c for c in cells if re.match(r"\d\d", c))))
    assert sorted(seen) == sorted(lesson_numbers()), (
        f"{page.name}'s learning path lists lessons {sorted(seen)}; lessons/ holds {sorted(lesson_numbers())}")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    missing = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            if resolved.name in PAGES_WRITTEN_ELSEWHERE and resolved.parent == ROOT / "docs":
                continue  # written by another change; checked here once it lands
            missing.append(f"{target} (no file {resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved})")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            missing.append(f"{target} (no heading with anchor #{anchor} in {resolved.name})")
    assert not missing, f"{page.relative_to(ROOT)} links to: " + "; ".join(missing)


@pytest.mark.parametrize("name", OWN_PAGES)
def test_every_docs_page_starts_with_what_is_here(name):
    lines = (ROOT / "docs" / name).read_text().splitlines()
    assert lines[0].startswith("# "), f"docs/{name} starts with its title"
    assert any(line.startswith("**What is here.**") for line in lines[1:4]), (
        f"docs/{name}: a short '**What is here.**' paragraph belongs right under the title")


def tables(text: str) -> list[tuple[int, int]]:
    """(first line, last line) of every Markdown table outside code blocks."""
    lines = text.splitlines()
    found, start, in_code = [], None, False
    for i, line in enumerate(lines + [""]):
        if line.startswith("```"):
            in_code = not in_code
        is_row = not in_code and line.startswith("|")
        if is_row and start is None:
            start = i
        elif not is_row and start is not None:
            found.append((start, i - 1))
            start = None
    return found


@pytest.mark.parametrize("name", sorted({*OWN_PAGES, *(p.name for p in DOCS)}))
def test_every_docs_table_names_the_command_that_made_it(name):
    text = (ROOT / "docs" / name).read_text()
    lines = text.splitlines()
    bare = []
    for first, last in tables(text):
        start = max(0, first - LOOK_BACK)
        headings = [i for i in range(start, first) if re.match(r"#+ ", lines[i])]
        near = "\n".join(lines[headings[-1] if headings else start: last + 6])
        if not COMMAND.search(near):
            bare.append(f"line {first + 1}: {lines[first][:60]}")
    assert not bare, (f"docs/{name}: tables with no command in their section within {LOOK_BACK} lines before "
                      "or 5 after: " + "; ".join(bare))


def test_every_test_the_docs_name_exists():
    defined = {m.group(1) for p in (ROOT / "tests").glob("test_*.py")
               for m in re.finditer(r"^(?:async )?def (test_\w+)", p.read_text(), flags=re.M)}
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("*.py")}
    missing = []
    for page in [p for p in PAGES if p.name != "torch_suites.md"]:  # that page names torch's own tests
        text = page.read_text()
        missing += [f"{page.name}: {name}" for name in re.findall(r"`(?:tests/\w+\.py::)?(test_\w+)`", text)
                    if name not in defined and f"tests/{name}.py" not in files]
        missing += [f"{page.name}: {path}" for path in re.findall(r"(tests/\w+\.py)", text) if path not in files]
    assert not missing, "the docs name tests that do not exist: " + "; ".join(sorted(set(missing)))


def test_the_simulated_link_lessons_are_the_ones_that_use_it():
    using = sorted(p.name.split("_")[0] for p in (ROOT / "lessons").glob("[0-9]*_*.py")
                   if re.search(r"simulated_link|make_link", p.read_text()))
    text = " ".join(LESSONS_README.read_text().split())
    m = re.search(r"so lessons ([0-9b, and]+?) send their collectives through a \*\*simulated link\*\*", text)
    assert m, "lessons/README.md names the lessons that use the simulated link"
    named = sorted(re.findall(r"\d+b?", m.group(1)))
    assert named == using, f"lessons/README.md says lessons {named} use the simulated link; the code says {using}"


def load_draw_figures():
    spec = importlib.util.spec_from_file_location("draw_figures", ROOT / "scripts" / "draw_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_ring_picture_follows_lesson_03s_ring():
    draw = load_draw_figures()
    states = draw.ring_states(4)
    assert len(states) == 1 + 2 * 3, "a start, 3 reduce-scatter steps and 3 all-gather steps"
    after_reduce_scatter = states[3][1]
    for r in range(4):
        assert after_reduce_scatter[r][(r + 1) % 4] == frozenset(range(4)), (
            f"after reduce-scatter rank {r} holds the whole sum of chunk {(r + 1) % 4} (lesson 03)")
    assert all(chunk == frozenset(range(4)) for row in states[-1][1] for chunk in row), "every rank holds every sum"


@pytest.mark.parametrize("allreduce_time", [None, 5.0], ids=["drawn", "slow-link"])
def test_the_bucket_picture_launches_in_order_one_at_a_time(allreduce_time):
    draw = load_draw_figures()
    _, buckets, backward_end, written = draw.bucket_schedule(*([allreduce_time] if allreduce_time else []))
    for before, after in zip(buckets, buckets[1:]):
        assert after["launched"] >= before["reduced"], "one bucket on the wire at a time, in bucket order"
    for b in buckets:
        assert b["first"] <= b["full"] <= b["launched"] < b["reduced"] <= written
    assert written > backward_end


def test_the_figure_script_writes_both_pictures(tmp_path):
    pytest.importorskip("matplotlib")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "draw_figures.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in ("bucket_life.png", "ring_allreduce.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000, f"{name} was not drawn"
        assert (ROOT / "docs" / "figures" / name).exists(), f"docs/figures/{name} is committed"
