"""A small synthetic corpus with three distinct domains, for tests that prepare datasets."""

from __future__ import annotations

import json
import random
from pathlib import Path

__all__ = ["write_corpus"]

_WORDS = "light darkness water earth heaven spirit kingdom people city wall gate house field".split()
_NAMES = ["HAMLET", "OPHELIA", "HORATIO", "PORTIA", "BRUTUS", "VIOLA", "FALSTAFF"]
_IDENTS = ["value", "items", "result", "buffer", "offset", "count", "parser", "token"]


def write_corpus(root: Path, per_domain: int = 40, seed: int = 0) -> Path:
    """Three synthetic domains with distinct styles: scripture (.txt), plays (.md), code (.py + .jsonl)."""
    rng = random.Random(seed)
    for d in ("scripture", "plays", "code"):
        (root / d).mkdir(parents=True, exist_ok=True)
    for i in range(per_domain):
        verses = "\n".join(
            f"{v} And the {rng.choice(_WORDS)} of the {rng.choice(_WORDS)} was upon the {rng.choice(_WORDS)}."
            for v in range(1, rng.randint(6, 12))
        )
        (root / "scripture" / f"ch{i:03d}.txt").write_text(f"Chapter {i}\n\n{verses}\n")
        lines = "\n\n".join(
            f"**{rng.choice(_NAMES)}**  \nO {rng.choice(_WORDS)}, thou art {rng.choice(_WORDS)}!" for _ in range(rng.randint(5, 10))
        )
        (root / "plays" / f"scene{i:03d}.md").write_text(f"_Enter {rng.choice(_NAMES)}_\n\n{lines}\n")
        body = "\n".join(f"    {rng.choice(_IDENTS)} = {rng.choice(_IDENTS)} + {rng.randint(0, 99)}" for _ in range(rng.randint(5, 12)))
        (root / "code" / f"mod{i:03d}.py").write_text(f"def {rng.choice(_IDENTS)}_{i}(self):\n{body}\n    return None\n")
    with open(root / "code" / "snippets.jsonl", "w") as f:
        for i in range(10):
            f.write(json.dumps({"text": f"import {rng.choice(_IDENTS)}\n{rng.choice(_IDENTS)}.run({i})\n"}) + "\n")
    return root
