"""MkDocs hooks of the fedistill documentation site (mkdocs.yml ``hooks:``; issue 43).

At build time they add the pages generated from the code and the committed results (one page per registered
method, the claims table, each leaderboard, the lab notebook by topic, the architecture map), build the
navigation with them, and point the hand-written pages' repository links (``../README.md``,
``../benchmarks/...``) at their places in the site. Everything generated is built from the same sources each
time, so the site cannot drift from the code.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

from fedistill.registry import ALGORITHMS
from fedistill.report.method_pages import method_page, methods_index
from fedistill.report.results_pages import TOPICS, claims_table, leaderboard_page, notebook_page, split_notebook

ROOT = Path(__file__).resolve().parent.parent
LEADERBOARDS = ROOT / "benchmarks" / "leaderboards"


def _method_names() -> list[str]:
    import fedistill.algorithms.build  # noqa: F401  (registers every built-in method)

    return ALGORITHMS.names()


def _suites() -> list[str]:
    return sorted(p.parent.name for p in LEADERBOARDS.glob("*/leaderboard.json"))


def _claims_files() -> list[tuple[str, Path]]:
    """Every committed claims.json: the leaderboards' and the reproduce presets' (benchmarks/claims/)."""
    found = [(f"{p.parent.name} (bench)", p) for p in sorted(LEADERBOARDS.glob("*/claims.json"))]
    found += [(p.stem, p) for p in sorted((ROOT / "benchmarks" / "claims").glob("*.json"))]
    return found


def _notebook() -> dict[str, list[tuple[str, str]]]:
    return split_notebook((ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8"))


def on_config(config: Any) -> Any:
    """The navigation, with one entry per registered method, suite and notebook topic."""
    topics = _notebook()
    config["nav"] = [
        {"Home": "index.md"},
        {"Getting started": "getting-started.md"},
        {"Concepts": "concepts.md"},
        {"Methods": ["methods/index.md", *[{name: f"methods/{name}.md"} for name in _method_names()],
                     {"Options and paper presets": "methods.md"}]},  # fmt: skip
        {"Results": [
            {"The claims, explained": "results.md"},
            {"Claims table": "results/claims.md"},
            *[{f"Leaderboard: {suite}": f"results/leaderboard-{suite}.md"} for suite in _suites()],
            *[{f"Notebook: {title}": f"results/notebook-{key}.md"} for key, title, _ in TOPICS if topics.get(key)],
        ]},  # fmt: skip
        {"Guides": [
            {"Commands, Python API, plugins, configuration": "usage.md"},
            {"Your own method, dataset, model or partition": "guides/extend.md"},
            {"Clients with different architectures: model groups": "guides/model-groups.md"},
            {"Flower across machines": "flower.md"},
            {"Benchmarks, on Ray or SLURM": "bench.md"},
            {"Speed, shared cores, the GPU path": "speed.md"},
            {"Reproducing a paper table": "guides/reproduce.md"},
            {"Rank your own method": "guides/rank.md"},
        ]},  # fmt: skip
        {"API reference": "api.md"},
    ]
    return config


def on_files(files: Files, config: Any) -> Files:
    """Add the generated pages and the figures they show."""

    def add(uri: str, content: str) -> None:
        files.append(File.generated(config, uri, content=content))

    add("concepts.md", (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8"))
    add("methods/index.md", methods_index(ROOT))
    for name in _method_names():
        add(f"methods/{name}.md", method_page(name, ROOT))
    claims = _claims_files()
    add("results/claims.md", "# Claims table\n\nEvery committed `claims.json`, one row per link of a claim (generated).\n\n"
        + claims_table(claims))  # fmt: skip
    for suite in _suites():
        add(f"results/leaderboard-{suite}.md", leaderboard_page(suite, LEADERBOARDS / suite, f"../assets/leaderboards/{suite}"))
        for figure in sorted((LEADERBOARDS / suite).glob("*.png")):
            files.append(File.generated(config, f"assets/leaderboards/{suite}/{figure.name}", abs_src_path=str(figure)))
    for key, entries in _notebook().items():
        if entries:
            add(f"results/notebook-{key}.md", notebook_page(key, entries))
    return files


# Repository paths that hand-written pages and the notebook link to -> their page in the site.
_REPOSITORY_LINKS = {
    "README.md": "index.md",
    "ARCHITECTURE.md": "concepts.md",
    "benchmarks/RESULTS.md": "results/notebook-speed.md",
}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Repository links of a page -> site links (README -> home, the notebook -> its pages, figures -> assets).

    A leaderboard page drops the table of contents on the right: its table has ten columns, and beside both
    sidebars it was wider than the page at 1400 px (the % of peak column cut off)."""
    if page.file.src_uri.startswith("results/leaderboard-"):
        page.meta["hide"] = sorted({*page.meta.get("hide", []), "toc"})
    page_dir = posixpath.dirname(page.file.src_uri)
    source_dir = "benchmarks" if page.file.src_uri.startswith("results/notebook-") else "docs"

    def rewrite(match: re.Match[str]) -> str:
        target, anchor = match.group(2), match.group(3) or ""
        if re.match(r"[a-z]+://", target) or not target:
            return match.group(0)
        repository_path = posixpath.normpath(posixpath.join(source_dir, target))
        site_path = _REPOSITORY_LINKS.get(repository_path)
        leaderboard = re.match(r"benchmarks/leaderboards/([\w.-]+)/(.+\.png)$", repository_path)
        if leaderboard:
            site_path = f"assets/leaderboards/{leaderboard.group(1)}/{leaderboard.group(2)}"
        if site_path is None:
            return match.group(0)
        return f"{match.group(1)}({posixpath.relpath(site_path, page_dir or '.')}{anchor})"

    return re.sub(r"(\]\s?)\(([^)#\s]*)(#[^)\s]*)?\)", rewrite, markdown)


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:
    """The docstrings' Sphinx roles (``:class:`Config```), which Markdown renders as ``:class:`` before the code,
    shown as the code alone on the API page."""
    return re.sub(r":(?:class|func|meth|attr|mod|data|exc|obj):(<code>)", r"\1", html)
