"""The README's generated blocks (issue 43): the table of methods and the leaderboards' top rows.

The README holds them between ``<!-- generated:NAME -->`` and ``<!-- /generated:NAME -->`` markers, so that nothing
the documentation site generates is copied into it by hand: ``python -m fedistill.report.readme_blocks README.md``
rewrites them, and tests/test_docs_site.py fails when the committed README differs from what this module makes.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from ..registry import ALGORITHMS
from .groups import format_stat
from .method_pages import card_of
from .tables import Cell, markdown_table
from ..fileio import atomic_write

SYSTEMS = ("fedlmd", "fedlmd_tf", "fedftg", "fedict", "dafkd")  # the four papers' systems (FedLMD-Tf: its variant)


def methods_block(root: Path) -> str:
    """Every registered method: its name linked to its card in spec/ (the site has a page for each), its one line."""
    import fedistill.algorithms.build  # noqa: F401  (registers every built-in method)

    rows = []
    for name in ALGORITHMS.names():
        card = card_of(name, ALGORITHMS.get(name), root / "spec")
        link = Cell(name, code=True, href=None if card is None else f"spec/{card.name}")
        rows.append([link, "system" if name in SYSTEMS else "baseline", ALGORITHMS.describe(name)])
    return markdown_table(["method", "kind", "what it does"], rows)


def leaderboard_block(root: Path, top: int = 3) -> str:
    """The ``top`` rows of each setting of each published leaderboard, in one table, and each leaderboard's figure
    of its last setting on one line (the README is kept short: the full tables are a link away)."""
    table: list[list] = []
    figures: list[str] = []
    for path in sorted((root / "benchmarks" / "leaderboards").glob("*/leaderboard.json")):
        suite = path.parent.name
        rows = json.loads(path.read_text(encoding="utf-8"))
        settings = list(dict.fromkeys(r["setting"] for r in rows))
        for setting in settings:
            ranked = sorted((r for r in rows if r["setting"] == setting and r.get("rank") is not None), key=lambda r: r["rank"])
            for r in ranked[:top]:
                # a one-seed std is None in leaderboard.json and n/a here (format_stat), never 0
                table.append([f"{suite}, {r.get('label', setting)}", r["rank"], r["method"],
                              format_stat({"mean": r["final_accuracy"], "std": r.get("final_accuracy_std")}),
                              f"{r['mb_per_round']:.3g}", f"{r['seconds_per_round']:.1f}"])  # fmt: skip
        figures.append(f"![{suite}: {settings[-1]}](benchmarks/leaderboards/{suite}/leaderboard_{settings[-1]}.png)")
    if not table:
        return ""
    lines = [markdown_table(["suite, setting", "rank", "method", "final acc %", "MB/round", "s/round"], table), ""]
    return "\n".join(lines + [" ".join(figures)])


BLOCKS = {"methods": methods_block, "leaderboard": leaderboard_block}


def rewrite(readme: str, root: Path) -> str:
    """``readme`` with every generated block replaced by what its function makes now."""
    for name, make in BLOCKS.items():
        pattern = re.compile(rf"(<!-- generated:{name} -->\n)(?:.*?\n)?(<!-- /generated:{name} -->)", re.S)
        if not pattern.search(readme):
            raise ValueError(f"README has no <!-- generated:{name} --> ... <!-- /generated:{name} --> block")
        block = make(root)
        readme = pattern.sub(lambda m: m.group(1) + block + "\n" + m.group(2), readme)
    return readme


def main(argv: list[str] | None = None) -> int:
    path = Path((argv or sys.argv[1:] or ["README.md"])[0])
    atomic_write(path, rewrite(path.read_text(encoding="utf-8"), path.resolve().parent))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
