"""Every pointer to the documentation in code, messages, comments, configs and scripts (``docs/backends.md,
'Anchors: Liger-Kernel and SonicMoE'``) names a page and a heading that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS_DIR = ROOT / "tests"
SCANNED = ("harness", "baselines", "mok_kernels", "mok_tools", "contract", "configs", "scripts", "slurm",
           "hydra_plugins", "tests", "notebooks", ".ci")
SUFFIXES = {".py", ".sh", ".yaml", ".toml", ".ipynb", ""}
# a page (README.md, docs/<page>.md, <folder>/README.md, or a bare README / docs), then a quoted heading
REF = re.compile(r"(?<![\w/.])((?:[\w-]+/)?README(?:\.md)?|docs(?:/[\w.-]+\.md)?)(?![\w/])[,:]?\s+(?:section\s+)?"
                 r"([\"'])")


def _files() -> list[Path]:
    out = [ROOT / "pyproject.toml"]
    for d in SCANNED:
        out += [p for p in sorted((ROOT / d).rglob("*")) if p.is_file() and p.suffix in SUFFIXES
                and "__pycache__" not in p.parts]
    return out


def headings(page: Path) -> set[str]:
    """The page's headings, without the ``#`` marks and backticks."""
    return {ln.lstrip("#").strip().replace("`", "") for ln in page.read_text().splitlines() if ln.startswith("#")}


def references(text: str) -> list[tuple[int, str, str]]:
    """(line number, page, heading) of each pointer in ``text``; the heading is None where its quote does not close
    on the same line (a pointer split over two string literals or comment lines)."""
    out = []
    for m in REF.finditer(text):
        rest = text[m.end():].split("\n", 1)[0]
        end = rest.find(m.group(2))
        out.append((text.count("\n", 0, m.start()) + 1, m.group(1), rest[:end] if end > 0 else None))
    return out


def resolves(page: str, heading: str) -> bool:
    """Whether ``page`` exists and has ``heading``: the whole heading, or its words before a parenthesis."""
    path = ROOT / page
    if not page.endswith(".md") or not path.is_file():
        return False
    heading = heading.replace("`", "").strip()
    return any(h == heading or h.startswith(heading + " (") for h in headings(path))


def test_every_pointer_to_the_docs_names_a_page_and_heading_that_exist():
    bad = []
    for f in _files():
        if f == Path(__file__):
            continue
        for line, page, heading in references(f.read_text(errors="replace")):
            if heading is None or not resolves(page, heading):
                bad.append(f"{f.relative_to(ROOT)}:{line}: {page}, {heading!r}")
    assert not bad, "pointers to a page or heading that does not exist:\n" + "\n".join(bad)


def test_every_docs_page_named_exists():
    """Every ``docs/<page>.md`` named in code, configs and scripts, with or without a heading, exists (tests hold
    made-up pages as test data)."""
    missing = sorted({f"{f.relative_to(ROOT)}: {m}" for f in _files() if TESTS_DIR not in f.parents
                      for m in re.findall(r"(?<![\w/])docs/[\w.-]+\.md", f.read_text(errors="replace"))
                      if not (ROOT / m).is_file()})
    assert not missing, missing


@pytest.mark.parametrize("text,ok", [
    ("see docs/backends.md, 'Anchors: Liger-Kernel and SonicMoE')", True),
    ("(docs/backends.md, 'DeepEP and HybridEP')", True),  # the heading's words before its parenthesis
    ("(README, 'Optional backends: DeepEP and HybridEP')", False),  # a section that moved
    ("(README.md, \"Quick start\")", False),
    ("(docs, 'Anchors: LigerCute and DeepGEMM MegaMoE')", False),  # no page named
    ("(docs/backends.md, 'Transformer Engine and \"\n\"Megatron-core')", False),  # split over two literals
    ("README.md, \"Set up and run\"", True),
])
def test_the_scan_finds_a_pointer_and_judges_it(text, ok):
    (ref,) = references(text)
    assert (ref[2] is not None and resolves(ref[1], ref[2])) == ok, ref
