"""Every relative link in the README, the guide (docs/) and the other Markdown files resolves: the file
exists, and a #fragment names a heading of that file (as GitHub writes a heading's anchor)."""

import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md")), REPO_ROOT / "examples" / "README.md",
         REPO_ROOT / "bazel" / "README.md", REPO_ROOT / "benchmarks" / "RESULTS.md", REPO_ROOT / "benchmarks" / "README.md",
         *sorted((REPO_ROOT / "benchmarks" / "history").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def outside_code(text):
    """`text` without its fenced code blocks and inline code spans."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(page):
    """The anchors GitHub gives the headings of `page`: lowercase, punctuation but - and _ dropped,
    spaces as hyphens."""
    titles = re.findall(r"^#+ (.*)$", re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-") for title in titles}


def test_the_guide_has_its_pages_and_the_readme_stays_short():
    assert {p.name for p in (REPO_ROOT / "docs").glob("*.md")} >= {
        "keras.md", "density.md", "custom_loops.md", "multi_worker.md", "selection_op.md", "exchange.md",
        "building.md"}
    assert len((REPO_ROOT / "README.md").read_text().splitlines()) <= 200


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(outside_code(page.read_text())):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no {resolved}")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{target}: no heading #{fragment} in {resolved.relative_to(REPO_ROOT)}")
    assert not broken, broken


RESULTS = REPO_ROOT / "benchmarks" / "RESULTS.md"
LIBRARY = [p for p in sorted((REPO_ROOT / "tf_topk").rglob("*.py")) if "bench" not in p.parts]
# A measured accuracy figure quoted in the code ("4.3 points below dense", "+0.35 nats/byte").
QUOTED_FIGURE = re.compile(r"\d+(\.\d+)? points?\b|nats ?(/|per) ?byte")


def test_results_keeps_the_current_figures_within_600_lines():
    """Earlier runs, trials not kept and narratives live in benchmarks/history/, linked from RESULTS."""
    assert len(RESULTS.read_text().splitlines()) <= 600
    assert "](history/" in RESULTS.read_text()


@pytest.mark.parametrize("module", LIBRARY, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_the_library_links_results_rather_than_quoting_its_figures(module):
    """Figures copied into docstrings drift from the runs; a docstring says what an option does and
    links the RESULTS section that measures it, whose heading must exist."""
    text = module.read_text()
    assert [m.group(0) for m in QUOTED_FIGURE.finditer(text)] == []
    for fragment in re.findall(r"benchmarks/RESULTS\.md#([\w\-]+)", text):
        assert fragment in anchors(RESULTS), f"{module.name}: no heading #{fragment} in RESULTS.md"


@pytest.mark.parametrize("tool", sorted((REPO_ROOT / "benchmarks").glob("*.py")), ids=lambda p: p.name)
def test_each_maintained_benchmark_script_is_run_by_a_test_or_by_make(tool):
    """The scripts at benchmarks/'s top are the maintained ones (one-off trials live in history/trials/):
    each is run by a test or by the Makefile, and benchmarks/README.md says what it answers."""
    users = [path for path in [*(REPO_ROOT / "tests").glob("*.py"), REPO_ROOT / "Makefile"]
             if tool.stem in path.read_text()]
    assert users, f"benchmarks/{tool.name} is run by no test and no make target"
    assert f"benchmarks/{tool.name}" in (REPO_ROOT / "benchmarks" / "README.md").read_text(), \
        f"benchmarks/README.md does not say what {tool.name} answers"


README = REPO_ROOT / "README.md"


def readme_tables():
    """The README's table rows outside code, each as its list of cells (header and rule rows left out)."""
    rows = []
    for line in re.sub(r"^```.*?^```", "", README.read_text(), flags=re.M | re.S).splitlines():
        if line.startswith("|") and not re.match(r"^\|[-| ]+\|$", line):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def results_section(anchor):
    """RESULTS.md from the heading whose anchor is `anchor` to the next heading of its level or above."""
    lines = RESULTS.read_text().splitlines()
    for start, line in enumerate(lines):
        match = re.match(r"^(#+) (.*)$", line)
        if match and re.sub(r"[^\w\- ]", "", match.group(2).strip().lower()).replace(" ", "-") == anchor:
            level = len(match.group(1))
            end = next((i for i in range(start + 1, len(lines)) if re.match(rf"^#{{1,{level}}} ", lines[i])),
                       len(lines))
            return "\n".join(lines[start:end])
    raise AssertionError(f"no heading #{anchor} in RESULTS.md")


def test_the_readme_reads_in_short_paragraphs_and_cells():
    """A newcomer's page: every paragraph 120 words or fewer, every table cell 40 or fewer."""
    text = re.sub(r"^```.*?^```", "", README.read_text(), flags=re.M | re.S)
    for paragraph in re.split(r"\n\s*\n", text):
        if not paragraph.lstrip().startswith(("|", "#")):
            for item in re.split(r"^- ", paragraph, flags=re.M):  # a list's items one by one
                assert len(item.split()) <= 120, item[:80]
    for row in readme_tables():
        for cell in row:
            assert len(cell.split()) <= 40, cell[:80]


def test_each_readme_figure_appears_in_the_results_section_it_links_to():
    """A row that links a RESULTS section quotes its figures (the row's last cell) from that section:
    a figure that drifted from its run (229x where the section reads 235x) fails here."""
    checked = 0
    for row in readme_tables():
        anchors_linked = re.findall(r"\(benchmarks/RESULTS\.md#([\w\-]+)\)", " ".join(row))
        if not anchors_linked:
            continue
        figures = re.findall(r"[+-]?\d+(?:[.,]\d+)*(?:e-?\d+)?x?", re.sub(r"\([^)]*\)", "", row[-1]))
        section = "\n".join(results_section(anchor) for anchor in anchors_linked)
        missing = [figure for figure in figures if figure not in section]
        assert not missing, f"{row[-1][:60]}: {missing} not in RESULTS#{anchors_linked}"
        checked += 1
    assert checked >= 10


def test_the_readmes_default_table_is_the_librarys():
    """The table of what the default does says what `tf_topk.methods.DEFAULT_METHODS` says, row by row."""
    from tf_topk.methods import DEFAULT_METHODS

    rows = [row[:3] for row in readme_tables() if len(row) == 4 and row[0] != "inner optimizer"
            and row[0] in ("any", "Adam or AdamW", "any other")]
    assert rows == [list(case) for case in DEFAULT_METHODS]
