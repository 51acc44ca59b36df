"""Write ``peer``'s rows of README.md's layout table from :data:`peer.LAYERS`:
``python tests/golden/regen_readme_layout.py`` (``tests/project/test_layering.py`` fails while they differ)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import peer  # noqa: E402

PACKAGE_ROW = "| `peer/"
"""How a row of one of peer's packages begins (the row of ``peer/`` itself, which introduces them, is kept)."""
INTRO_ROW = "| `peer/` |"


def with_layout(text: str) -> str:
    """README.md's ``text`` with the package rows after the ``peer/`` row replaced by :func:`peer.layout_rows`."""
    lines = text.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith(INTRO_ROW)) + 1
    end = start
    while end < len(lines) and lines[end].startswith(PACKAGE_ROW):
        end += 1
    return "\n".join(lines[:start] + peer.layout_rows() + lines[end:])


def main() -> None:
    readme = ROOT / "README.md"
    readme.write_text(with_layout(readme.read_text()))
    print(f"wrote {readme.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
