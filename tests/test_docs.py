"""The documentation the code points at exists, and every pointer into it resolves.

Checked over the repository as it is (generic: new citations are checked as they appear):

- every `docs/<...>.md` or `benchmarks/<...>.md` path mentioned in src/, benchmarks/, tests/,
  docs/ or README.md names an existing file;
- every bare `<name>.md` mentioned there is the name of a markdown file of the repository;
- every citation of docs/design.md by heading (its path, a comma, the heading in double quotes)
  names a heading of docs/design.md, and no one cites it by section number;
- docs/design.md has exactly the section headings other modules cite;
- every relative link or image in docs/*.md, benchmarks/*.md and README.md resolves, including
  its `#anchor` when it points into a markdown file;
- benchmarks/results/ holds only files something cites (the docs, or code and tests that read them),
  every results file the markdown cites exists, and benchmarks/RESULTS.md stays a page of current
  claims (at most RESULTS_MAX_LINES lines; history is in git).

The checkers are plain functions, each also tested on text that must fail.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DESIGN = REPO / "docs" / "design.md"

# The section headings of docs/design.md, in order: modules cite them by name.
DESIGN_HEADINGS = (
    "Element formats and E8M0 scales",
    "The Hadamard block rotation",
    "The exact FP8 fold and its window",
    "Fold granularity",
    "The three GEMMs and their operands",
    "Kernels, backends and the reference",
    "The one-pass packer",
    "Saved operands in six bits",
    "Inputs packed again in backward",
    "Fusions",
    "Precisions as converters and the layer map",
    "The trainer",
    "The weights' operands from the optimizer step",
    "LoRA on a frozen MXFP6 base",
    "Distributed training",
    "MLPerf",
    "Benchmarks",
)

SCANNED_DIRS = ("src", "benchmarks", "tests", "docs")
SCANNED_FILES = ("README.md",)
TEXT_SUFFIXES = {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".ini"}
SKIPPED_DIRS = {"__pycache__", ".pytest_cache", "results"}  # results: measured data, not prose
LINKED_MARKDOWN = ("docs/*.md", "benchmarks/*.md", "README.md")

# A path into docs/ or benchmarks/ ending in .md, not itself the tail of a longer path or URL.
_MD_PATH = re.compile(r"(?<![\w./-])((?:docs|benchmarks)/[\w./-]*?\.md)(?![\w])")
# A markdown file named without a directory.
_MD_NAME = re.compile(r"(?<![\w./-])([\w-]+\.md)(?![\w])")
# The design doc's path, a comma, a heading in double quotes; the heading may wrap onto the next line.
_CITATION = re.compile(r"docs/design\.md,?\s*\"([^\"]{1,200})\"")
_CITATION_BY_NUMBER = re.compile(r"docs/design\.md,?\s*(?:§|section\s+\d)", re.IGNORECASE)
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_LINK = re.compile(r"^[ \t]{0,3}\[[^\]]+\]:[ \t]*<?(\S+?)>?(?:[ \t]+\"[^\"]*\")?[ \t]*$", re.MULTILINE)
_FENCE = re.compile(r"^\s*(```|~~~)")
# A file of benchmarks/results/ named in text: `results/NAME.EXT` or `benchmarks/results/NAME.EXT`.
_RESULTS_FILE = re.compile(r"(?<![\w/.-])(?:benchmarks/)?results/([\w.+-]+\.[A-Za-z]\w*)")
RESULTS_DIR = REPO / "benchmarks" / "results"
RESULTS_MAX_LINES = 300
# Where a results file may be cited: the markdown that states the numbers, and the code and tests
# that read committed results.
CITING_FILES = ("README.md", "benchmarks/*.md", "docs/**/*.md", "benchmarks/*.py", "benchmarks/*.sh",
                "tests/**/*.py", "src/**/*.py")
# The markdown whose results citations must resolve.
RESULTS_CITING_MARKDOWN = ("README.md", "benchmarks/RESULTS.md", "benchmarks/NOTES.md", "docs/*.md")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")


# --- the checkers --------------------------------------------------------------------------------


def scanned_files(root: Path = REPO) -> list[Path]:
    """Text files whose mentions of markdown files are checked. This file is left out: its checker
    tests hold deliberately broken references."""
    files = [root / f for f in SCANNED_FILES if (root / f).is_file()]
    for d in SCANNED_DIRS:
        for p in sorted((root / d).rglob("*")):
            if (p.is_file() and p.suffix in TEXT_SUFFIXES and p != Path(__file__).resolve()
                    and not SKIPPED_DIRS & set(p.relative_to(root).parts)):
                files.append(p)
    return files


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def missing_md_paths(text: str, root: Path = REPO) -> list[tuple[int, str]]:
    """(line, path) of every docs/ or benchmarks/ markdown path in `text` that does not exist."""
    out = []
    for m in _MD_PATH.finditer(text):
        path = m.group(1)
        if "..." in path:  # an ellipsis in prose, not a path
            continue
        if not (root / path).is_file():
            out.append((line_of(text, m.start()), path))
    return out


def markdown_names(root: Path = REPO) -> set[str]:
    """File names of the repository's markdown files (where the scan looks, plus the top level)."""
    names = {p.name for p in root.glob("*.md")}
    for d in SCANNED_DIRS:
        names |= {p.name for p in (root / d).rglob("*.md")}
    return names


def unknown_md_names(text: str, known: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every bare `<name>.md` in `text` that no markdown file of the repo has."""
    return [(line_of(text, m.start()), m.group(1)) for m in _MD_NAME.finditer(text) if m.group(1) not in known]


def normalise_heading(text: str) -> str:
    """A cited heading with line breaks (and a comment's leading markers) folded to single spaces."""
    text = re.sub(r"\s*\n\s*(?:#+|//|\*|>)?\s*", " ", text)
    return re.sub(r"\s+", " ", text).strip()


def markdown_headings(text: str) -> list[str]:
    """ATX headings of a markdown text (any level), outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else _HEADING.match(line)
        if m:
            out.append(m.group(2).strip())
    return out


def bad_design_citations(text: str, headings: set[str]) -> list[tuple[int, str]]:
    """(line, what) for every design.md citation of a missing heading or by section number."""
    out = [(line_of(text, m.start()), normalise_heading(m.group(1))) for m in _CITATION.finditer(text)
           if normalise_heading(m.group(1)) not in headings]
    out += [(line_of(text, m.start()), m.group(0)) for m in _CITATION_BY_NUMBER.finditer(text)]
    return out


def github_anchors(headings: list[str]) -> set[str]:
    """The `#anchors` GitHub gives these headings (lower case, punctuation dropped, spaces to '-',
    '-1', '-2', ... appended to repeats)."""
    seen: dict[str, int] = {}
    out = set()
    for h in headings:
        h = h.replace("`", "").replace("*", "")  # inline markup is not part of the rendered text
        slug = re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def markdown_prose(text: str) -> str:
    """`text` with fenced code blocks and inline code blanked (same line numbers)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            lines.append("")
            continue
        lines.append("" if fenced else _INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line))
    return "\n".join(lines)


def broken_links(md_file: Path, text: str | None = None) -> list[tuple[int, str]]:
    """(line, target) of every relative link or image in a markdown file that does not resolve."""
    text = md_file.read_text(encoding="utf-8") if text is None else text
    prose = markdown_prose(text)
    targets = [(m.start(), m.group(1)) for m in _INLINE_LINK.finditer(prose)]
    targets += [(m.start(), m.group(1)) for m in _REFERENCE_LINK.finditer(prose)]
    out = []
    for pos, target in targets:
        if re.match(r"^[a-zA-Z][\w+.-]*:", target) or target.startswith("//"):
            continue  # a URL (http:, https:, mailto:, ...): not checked offline
        path, _, anchor = target.partition("#")
        dest = (md_file.parent / path).resolve() if path else md_file
        if not dest.exists():
            out.append((line_of(prose, pos), target))
        elif anchor and dest.suffix == ".md":
            dest_text = text if dest == md_file else dest.read_text(encoding="utf-8")
            if anchor not in github_anchors(markdown_headings(dest_text)):
                out.append((line_of(prose, pos), target))
    return out


def cited_results_files(text: str) -> set[str]:
    """Names of benchmarks/results/ files that `text` mentions."""
    return {m.group(1) for m in _RESULTS_FILE.finditer(text)}


def uncited_results_files(results_dir: Path, citing_texts: list[str]) -> list[str]:
    """Files of `results_dir` whose name no citing text mentions."""
    names = {p.name for p in results_dir.iterdir() if p.is_file()}
    cited = set().union(*(cited_results_files(t) | {n for n in names if n in t} for t in citing_texts))
    return sorted(names - cited)


def missing_results_files(text: str, results_dir: Path) -> list[tuple[int, str]]:
    """(line, name) of every results file `text` cites that `results_dir` does not hold."""
    return [(line_of(text, m.start()), m.group(1)) for m in _RESULTS_FILE.finditer(text)
            if not (results_dir / m.group(1)).is_file()]


def _files(patterns: tuple[str, ...], root: Path = REPO) -> list[Path]:
    return sorted({p for pattern in patterns for p in root.glob(pattern) if p.is_file()
                   and not SKIPPED_DIRS & set(p.relative_to(root).parts)})


def _report(problems: dict[Path, list[tuple[int, str]]]) -> str:
    return "\n".join(f"{p.relative_to(REPO)}:{line}: {what}" for p, items in problems.items()
                     for line, what in items)


# --- the repository --------------------------------------------------------------------------


def test_design_doc_has_the_cited_section_headings_in_order():
    headings = [h for level, h in ((len(m.group(1)), m.group(2).strip()) for m in
                                   map(_HEADING.match, DESIGN.read_text(encoding="utf-8").splitlines()) if m)
                if level == 2]
    assert tuple(headings) == DESIGN_HEADINGS


def test_every_docs_or_benchmarks_markdown_path_mentioned_exists():
    problems = {}
    for f in scanned_files():
        found = missing_md_paths(f.read_text(encoding="utf-8", errors="replace"))
        if found:
            problems[f] = found
    assert not problems, "markdown paths that do not exist:\n" + _report(problems)


def test_every_markdown_file_named_exists_in_the_repository():
    known = markdown_names()
    problems = {}
    for f in scanned_files():
        found = unknown_md_names(f.read_text(encoding="utf-8", errors="replace"), known)
        if found:
            problems[f] = found
    assert not problems, "markdown files named that the repository does not have:\n" + _report(problems)


def test_every_design_doc_citation_names_an_existing_heading():
    headings = set(markdown_headings(DESIGN.read_text(encoding="utf-8")))
    problems, cited = {}, 0
    for f in scanned_files():
        text = f.read_text(encoding="utf-8", errors="replace")
        cited += len(_CITATION.findall(text))
        found = bad_design_citations(text, headings)
        if found:
            problems[f] = found
    assert not problems, (f'docs/design.md citations whose heading does not exist (headings: {sorted(headings)}):\n'
                          + _report(problems))
    assert cited > 0  # the docs themselves cite it, so a scan that finds nothing is broken


@pytest.mark.parametrize("md_file", sorted({p for pattern in LINKED_MARKDOWN for p in REPO.glob(pattern)}),
                         ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_markdown_link_resolves(md_file):
    broken = broken_links(md_file)
    assert not broken, f"{md_file.relative_to(REPO)}: links that do not resolve:\n" + "\n".join(
        f"  line {line}: {target}" for line, target in broken)


def test_every_results_file_is_cited_by_the_docs_or_read_by_code():
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in _files(CITING_FILES)
             if p != Path(__file__).resolve()]
    uncited = uncited_results_files(RESULTS_DIR, texts)
    assert not uncited, ("benchmarks/results/ files nothing cites (cite them from RESULTS.md or NOTES.md, "
                         "or git rm them):\n  " + "\n  ".join(uncited))


def test_every_results_file_the_markdown_cites_exists():
    problems = {}
    for f in _files(RESULTS_CITING_MARKDOWN):
        found = missing_results_files(f.read_text(encoding="utf-8"), RESULTS_DIR)
        if found:
            problems[f] = found
    assert not problems, "results files cited that benchmarks/results/ does not hold:\n" + _report(problems)


def test_results_md_holds_current_claims_only():
    lines = (REPO / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= RESULTS_MAX_LINES, (
        f"benchmarks/RESULTS.md has {len(lines)} lines (at most {RESULTS_MAX_LINES}): keep the current claims, "
        "drop superseded sections (their history is in git)")


# --- the checkers on text that must fail -----------------------------------------------------


def test_missing_md_paths_finds_a_missing_file_and_ignores_urls_and_existing_ones(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "here.md").write_text("# Here\n")
    text = ("see docs/here.md and\n"
            "# also docs/gone" + ".md, https://example.org/docs/remote" + ".md, benchmarks/sub/x" + ".md\n")
    assert missing_md_paths(text, tmp_path) == [(2, "docs/gone.md"), (2, "benchmarks/sub/x.md")]


def test_unknown_md_names_finds_a_bare_name_without_a_file():
    text = "README" + ".md is here; NOWHERE" + ".md is not;\nsee a/path/OTHER" + ".md (a path, skipped)"
    assert unknown_md_names(text, {"README.md"}) == [(1, "NOWHERE.md")]


def test_design_citation_checker_folds_wrapped_headings_and_rejects_missing_ones():
    headings = {"The exact FP8 fold and its window", "Fusions"}
    cite = "docs/design" + ".md"
    text = (f'# the window ({cite}, "The exact FP8\n'
            f'# fold and its window") and {cite}, "Fusions";\n'
            f'{cite}, "Fusion" and {cite} §3\n')
    assert bad_design_citations(text, headings) == [(3, "Fusion"), (3, f"{cite} §")]


def test_github_anchors_match_githubs_slugs():
    assert github_anchors(["Kernels, backends and the reference", "MLPerf", "MLPerf"]) == {
        "kernels-backends-and-the-reference", "mlperf", "mlperf-1"}


def test_broken_links_finds_missing_files_and_anchors_and_skips_code_and_urls(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A title\n\n## Second part\n")
    doc = tmp_path / "docs" / "b.md"
    doc.write_text(
        "# B\n"
        "[ok](a.md) [ok anchor](a.md#second-part) [self](#b) [web](https://example.org/x.md)\n"
        "[no file](missing.md) [no anchor](a.md#third-part) ![no image](img/plot.png)\n"
        "`[in code](nowhere.md)`\n"
        "```\n[in a fence](nowhere.md)\n```\n"
        "[ref]: ../gone/c.md\n")
    assert broken_links(doc) == [(3, "missing.md"), (3, "a.md#third-part"), (3, "img/plot.png"),
                                 (8, "../gone/c.md")]


def test_results_checkers_find_uncited_and_missing_files(tmp_path):
    (tmp_path / "bench_a_2026-12-03.json").write_text("{}")
    (tmp_path / "bench_b_2026-12-03.log").write_text("")
    (tmp_path / "read_by_a_test.json").write_text("{}")
    md = ("see [a](results/bench_a_2026-12-03.json) and benchmarks/results/gone_2026-12-01.json;\n"
          "results/ alone names no file, nor $OUT/results/x or other/results/y.json\n")
    code = 'json.loads((ROOT / "benchmarks/results" / "read_by_a_test.json").read_text())'
    assert uncited_results_files(tmp_path, [md, code]) == ["bench_b_2026-12-03.log"]
    assert missing_results_files(md, tmp_path) == [(1, "gone_2026-12-01.json")]
