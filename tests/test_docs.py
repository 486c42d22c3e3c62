"""The docs cannot go stale: the generated reference equals what the code generates, and
every relative link (file and ``#anchor``) in docs/ and README.md resolves, as does every
page under docs/ that the code, tests and benches name."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"`[^`]*`")


def _generator():
    spec = importlib.util.spec_from_file_location("docs_generate", REPO / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GENERATE = _generator()


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a page's headings (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = GENERATE.slug(re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(2)))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def _links(path: Path) -> list[str]:
    targets = []
    for line in _prose(path.read_text(encoding="utf-8")):
        targets += LINK.findall(CODE_SPAN.sub("", line))
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("name", sorted(GENERATE.PAGES))
def test_the_generated_reference_is_what_the_code_generates(name: str) -> None:
    page = REPO / "docs" / "reference" / name
    assert page.is_file(), f"docs/reference/{name} is missing: run python docs/generate.py"
    assert page.read_text(encoding="utf-8") == GENERATE.PAGES[name](), (
        f"docs/reference/{name} is stale: run python docs/generate.py and commit the result")


def test_the_slug_is_githubs() -> None:
    assert GENERATE.slug("Parameters: the run spec (`flows/spec.py`)") == "parameters-the-run-spec-flowsspecpy"
    assert GENERATE.slug("`prefill store ls`") == "prefill-store-ls"
    assert GENERATE.slug("What is refused (and counted)") == "what-is-refused-and-counted"


def test_the_link_finder_sees_links_and_skips_code(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# A b\n\n[x](y.md#a-b) `[no](z.md)` [web](https://e.org) ![img](i.png)\n"
                    "```\n[no](fenced.md)\n```\n## A b\n", encoding="utf-8")
    assert _links(page) == ["y.md#a-b"]
    assert _anchors(page) == {"a-b", "a-b-1"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in _links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_every_docs_page_the_code_names_exists() -> None:
    named = re.compile(r"\bdocs/[\w./-]+?\.md\b")
    missing = []
    for folder in ("store", "prefill", "forecasting", "flows", "bench", "tests"):
        for path in (REPO / folder).rglob("*.py"):
            for ref in named.findall(path.read_text(encoding="utf-8")):
                if not (REPO / ref).is_file():
                    missing.append(f"{path.relative_to(REPO)}: {ref}")
    for path in (REPO / "Makefile", REPO / "prefect.yaml", REPO / "pyproject.toml"):
        missing += [f"{path.name}: {ref}" for ref in named.findall(path.read_text(encoding="utf-8"))
                    if not (REPO / ref).is_file()]
    assert not missing, "pages named but absent: " + "; ".join(missing)


def test_every_test_the_docs_cite_exists() -> None:
    """``tests/....py`` and ``tests/....py::test_name`` in the docs name files and tests that exist."""
    cited = re.compile(r"\b(tests/[\w/]+\.py)(?:::(\w+))?")
    missing = []
    for page in PAGES:
        for path, name in cited.findall(page.read_text(encoding="utf-8")):
            file = REPO / path
            if not file.is_file():
                missing.append(f"{page.relative_to(REPO)}: {path}")
            elif name and not re.search(rf"^\s*def {name}\(", file.read_text(encoding="utf-8"), re.M):
                missing.append(f"{page.relative_to(REPO)}: {path}::{name}")
    assert not missing, "cited but absent: " + "; ".join(missing)
