"""The docs cite only documents that are in the repository (they once cited WORKLOADS.md, kept
outside it)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
CITED = re.compile(r"(?<![\w/])((?:docs/)?[\w-]+\.md)\b")


def test_every_cited_markdown_file_exists():
    sources = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
               *sorted((ROOT / "clients").rglob("*.py")), *sorted((ROOT / "scheduler_svc").rglob("*.py"))]
    missing = set()
    for source in sources:
        for name in CITED.findall(source.read_text()):
            candidates = [ROOT / name, ROOT / "docs" / name, source.parent / name, ROOT / "deploy" / name]
            if not any(path.exists() for path in candidates):
                missing.add(f"{source.relative_to(ROOT)}: {name}")
    assert not missing, sorted(missing)
