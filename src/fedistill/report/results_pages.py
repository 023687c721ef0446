"""The documentation's Results pages, generated (issue 43; docs/hooks.py builds them).

- the claims table from every committed ``claims.json`` (one row per link of a claim: the paired difference with its
  95 % t-interval, the seeds ahead, Wilcoxon's p and the verdict);
- one page per published leaderboard from its ``leaderboard.json`` (every row of every setting) and its figures;
- benchmarks/RESULTS.md, the lab notebook, split by topic (GPU, Flower, fidelity, claims, leaderboards, scale, speed) into
  pages, newest first within each: its ``## `` sections carry their dates in the heading.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from .claims import provisional_text
from .groups import format_stat
from .leaderboard import timing_note
from .tables import Cell, markdown_table

# Topic of a RESULTS.md section, by the first keyword its heading contains (checked in this order).
TOPICS: list[tuple[str, str, tuple[str, ...]]] = [
    ("gpu", "The GPU path", ("gpu", "cuda", "h100", "h200")),
    ("flower", "Flower across machines", ("flower", "superlink", "supernode")),
    ("fidelity", "Fidelity to the papers", ("fidelity", "table 1", "table 3", "'s mnist protocol",
                                             "bitwise", " against fedavg")),
    ("claims", "Claims over seeds", ("claim", "10 seeds", "over 3 seeds", "wilcoxon", "non-finite", "nan")),
    ("leaderboards", "Leaderboards", ("`fedistill bench", "leaderboard", "fd-mnist", "fd-fmnist")),
    ("scale", "Scale", ("scale", "client state", "10,000")),
    ("speed", "Speed", ()),  # every other section: what a round costs and why
]
_DATE = re.compile(r"(20\d\d-\d\d-\d\d)")


def _number(value: float | None, digits: int = 2, signed: bool = False) -> str:
    if value is None:
        return ""
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def claims_table(claims_files: list[tuple[str, Path]]) -> str:
    """One row per link of every claim in ``claims_files`` ((source label, path) pairs)."""
    table = []
    for source, path in claims_files:
        for claim in json.loads(path.read_text(encoding="utf-8")):
            for link in claim.get("links", []):
                interval = ""
                if link.get("mean_difference") is not None:
                    low, high = link.get("ci95_low"), link.get("ci95_high")
                    bounds = f" [{_number(low, signed=True)}, {_number(high, signed=True)}]" if low is not None else ""
                    interval = _number(link["mean_difference"], signed=True) + bounds
                ahead = f"{link.get('a_wins', '')}/{link.get('n', '')}" if link.get("n") else ""
                p = _number(link.get("wilcoxon_p"), 3) if link.get("wilcoxon_p") is not None else ""
                table.append([
                    source, claim["claim"], claim.get("setting", ""), claim.get("metric", ""),
                    f"{link['a']} {link.get('relation', '')} {link['b']}", interval, ahead, p,
                    link.get("verdict", claim.get("verdict", "")) + provisional_text(claim),
                ])  # fmt: skip
    columns = ["source", "claim", "setting", "metric", "link", "paired difference [95 %]", "ahead", "Wilcoxon p", "verdict"]
    return markdown_table(columns, table) + "\n"


def leaderboard_page(suite: str, suite_dir: Path, image_prefix: str) -> str:
    """Every row of ``suite_dir/leaderboard.json`` by setting, with the setting's figure (``image_prefix`` is the
    figures' path relative to the page)."""
    rows = json.loads((suite_dir / "leaderboard.json").read_text(encoding="utf-8"))
    lines = [f"# Leaderboard: {suite}", ""]
    notes = suite_dir / "leaderboard.md"
    if notes.exists():  # the suite's own description: the paragraph under the leaderboard's title
        paragraphs = notes.read_text(encoding="utf-8").split("\n\n")
        lines += [p for p in paragraphs[1:3] if not p.startswith("#")] + [""]
    if note := timing_note(rows):  # seconds from more than one CPU: the page says so, as the leaderboard does
        lines += [f"**{note}**", ""]
    for setting in dict.fromkeys(r["setting"] for r in rows):
        chosen = sorted((r for r in rows if r["setting"] == setting), key=lambda r: (r.get("rank") is None, r.get("rank") or 0))
        lines += [f"## {chosen[0].get('label', setting)}", ""]
        figure = suite_dir / f"leaderboard_{setting}.png"
        if figure.exists():
            lines += [f"![{suite}, {setting}]({image_prefix}/{figure.name})", ""]
        table = []
        for r in chosen:
            # a one-seed std is None in leaderboard.json and n/a here (format_stat), never 0
            final = "n/a" if r.get("final_accuracy") is None else format_stat({"mean": r["final_accuracy"], "std": r.get("final_accuracy_std")})
            best = "" if r.get("best_accuracy") is None else format_stat({"mean": r["best_accuracy"], "std": r.get("best_accuracy_std")})
            table.append([
                r.get("rank"), Cell(r["method"], href=f"../methods/{r['method']}.md"), final, best, r.get("metric", ""),
                _number(r.get("mb_per_round"), 1), _number(r.get("seconds_per_round"), 1), _number(r.get("gflops_per_round"), 0),
                _number(r.get("percent_of_bf16_peak"), 1), f"{r.get('finished', '')}/{r.get('seeds', '')}",
            ])  # fmt: skip
        columns = ["rank", "method", "final acc %", "best acc %", "metric", "MB/round", "s/round", "GFLOP/round", "% of bf16 peak", "seeds"]
        lines += [markdown_table(columns, table), ""]
    return "\n".join(lines)


def split_notebook(text: str) -> dict[str, list[tuple[str, str]]]:
    """RESULTS.md's ``## `` sections by topic: {topic: [(date, section text), ...]}, newest first (undated last,
    in the notebook's order)."""
    sections = re.split(r"(?m)^(?=## )", text)
    by_topic: dict[str, list[tuple[int, str, str]]] = {key: [] for key, _, _ in TOPICS}
    for index, section in enumerate(s for s in sections if s.startswith("## ")):
        heading = section.splitlines()[0].lower()
        topic = next(key for key, _, words in TOPICS if not words or any(w in heading for w in words))
        match = _DATE.search(section.splitlines()[0])
        by_topic[topic].append((index, match.group(1) if match else "", section))
    ordered: dict[str, list[tuple[str, str]]] = {}
    for key, entries in by_topic.items():
        dated = sorted((e for e in entries if e[1]), key=lambda e: (e[1], -e[0]), reverse=True)
        undated = [e for e in entries if not e[1]]
        ordered[key] = [(date, section) for _, date, section in dated + undated]
    return ordered


def notebook_page(topic: str, entries: list[tuple[str, str]]) -> str:
    title = next(t for key, t, _ in TOPICS if key == topic)
    lines = [f"# {title}: measurements", "",
             "Sections of the lab notebook (benchmarks/RESULTS.md) on this topic, newest first.", ""]  # fmt: skip
    for _, section in entries:
        # The notebook's own headings move one level down under the page title.
        lines.append(re.sub(r"(?m)^(#{2,5}) ", lambda m: "#" + m.group(1) + " ", section).rstrip() + "\n")
    return "\n".join(lines)
