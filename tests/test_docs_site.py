"""The documentation site (issue 43): generated method pages match their classes, generated results pages hold
what their JSON holds, the notebook splits by topic newest first, and `mkdocs build --strict` passes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import fedistill.algorithms.build  # noqa: F401  (registers every method)
from fedistill.registry import ALGORITHMS
from fedistill.report.method_pages import method_page
from fedistill.report.results_pages import claims_table, split_notebook

ROOT = Path(__file__).resolve().parent.parent


def _section(page: str, heading: str) -> str:
    return page.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]


def _table_rows(section: str) -> list[list[str]]:
    """The body rows of the first Markdown table in ``section``, cells stripped (escaped pipes restored)."""
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]
    return [[c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows]


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_every_method_page_lists_exactly_its_class_fields_with_defaults_descriptions_and_bounds(name):
    cls = ALGORITHMS.get(name)
    fields = cls.Params.model_fields
    rows = _table_rows(_section(method_page(name, ROOT), "Parameters"))
    assert [r[0].strip("`") for r in rows] == list(fields)  # every field, in the class's order, nothing else
    for (field_name, default, description, constraints), field in zip(rows, fields.values()):
        # The default read back as YAML (what a user writes in a config) is the field's default.
        assert yaml.safe_load(default.strip("`")) == field.default, field_name
        assert description == (field.description or "").strip().replace("\n", " "), field_name
        for item in field.metadata:
            for attribute, symbol in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
                bound = getattr(item, attribute, None)
                if bound is not None:
                    assert f"{symbol} {bound:g}" in constraints, (field_name, constraints)


def test_a_method_page_names_its_card_presets_and_leaderboard_rows():
    page = method_page("dafkd", ROOT)
    assert "spec/dafkd.md" in _section(page, "What it does")
    presets = _section(page, "Presets that run it")
    assert "`reproduce/dafkd_table1.yaml`" in presets and "`presets/dafkd_reduced.yaml`" in presets
    # Every published leaderboard's rows of the method (fd-mnist and fd-fmnist), one per setting each.
    rows = [r for path in sorted((ROOT / "benchmarks/leaderboards").glob("*/leaderboard.json")) for r in json.loads(path.read_text())]
    published = [r for r in rows if r["method"] == "dafkd"]
    board = _table_rows(_section(page, "Leaderboard rows"))
    assert len(board) == len(published) > 0
    assert {row[3] for row in board} == {f"{r['final_accuracy']:.2f} ± {r['final_accuracy_std']:.2f}" for r in published}


def test_claims_table_has_one_row_per_link_with_its_interval_ahead_count_and_verdict(tmp_path):
    link = {"a": "x", "relation": ">", "b": "y", "n": 3, "mean_difference": 1.5, "ci95_low": -0.25, "ci95_high": 3.25,
            "a_wins": 2, "verdict": "inconclusive", "wilcoxon_p": 0.5}  # fmt: skip
    claims = [{"claim": "x > y > z", "setting": "S", "metric": "final", "verdict": "holds",
               "links": [link, {**link, "a": "y", "b": "z", "verdict": "holds", "a_wins": 3}]}]  # fmt: skip
    path = tmp_path / "claims.json"
    path.write_text(json.dumps(claims))
    rows = _table_rows(claims_table([("mine", path)]))
    assert rows == [
        ["mine", "x > y > z", "S", "final", "x > y", "+1.50 [-0.25, +3.25]", "2/3", "0.500", "inconclusive"],
        ["mine", "x > y > z", "S", "final", "y > z", "+1.50 [-0.25, +3.25]", "3/3", "0.500", "holds"],
    ]
    # Read by `reproduce --status` before every planned seed finished: the verdict says so.
    claims[0].update(seeds_finished=[0, 1, 2], seeds_planned=list(range(10)))
    path.write_text(json.dumps(claims))
    assert _table_rows(claims_table([("mine", path)]))[1][-1] == "holds (provisional: 3 of 10 planned seeds)"


def test_the_notebook_splits_by_topic_newest_first():
    notebook = (
        "# RESULTS\n\nintro\n\n"
        "## Speed of the loop, 2026-11-20\nold speed\n"
        "## The GPU path, 2026-11-22\ngpu\n"
        "## Cores shared with other programs, 2026-11-27\nnew speed\n"
        "### a subsection stays with its section\n"
        "## FedLMD fidelity, 2026-11-21\nfidelity\n"
    )
    topics = split_notebook(notebook)
    assert [date for date, _ in topics["speed"]] == ["2026-11-27", "2026-11-20"]
    assert "a subsection stays" in topics["speed"][0][1]
    assert [date for date, _ in topics["gpu"]] == ["2026-11-22"]
    assert [date for date, _ in topics["fidelity"]] == ["2026-11-21"]


def test_the_site_builds_strict_offline_with_a_page_per_method(tmp_path):
    """`mkdocs build --strict` (what `make docs` runs; mkdocs is in the test extra, so no skip): a broken link,
    reference or nav entry fails it."""
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=ROOT, capture_output=True, text=True,
                          env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for name in ALGORITHMS.names():
        assert (site / "methods" / f"{name}.html").exists(), name
    assert (site / "results" / "leaderboard-fd-mnist.html").exists()
    # The leaderboards' ten-column tables get the table of contents' width (issue 62: cut off at 1400 px).
    toc = re.compile(r'md-sidebar--secondary"[^>]*data-md-type="toc"\s*(hidden)?>')
    assert toc.search((site / "results" / "leaderboard-fd-mnist.html").read_text(encoding="utf-8"))[1] == "hidden"
    assert toc.search((site / "methods.html").read_text(encoding="utf-8"))[1] is None
    # Nothing fetched from the network when the site is read: no remote script, stylesheet or font.
    for page in site.rglob("*.html"):
        html = page.read_text(encoding="utf-8")
        assert not re.search(r"<(script|link)[^>]+(src|href)=\"https?://", html), page
        assert "fonts.googleapis" not in html, page


def test_the_readmes_generated_blocks_are_what_the_code_makes_now_and_it_stays_short():
    """The README's methods table and leaderboard rows are generated (python -m fedistill.report.readme_blocks
    README.md): the committed README must equal a fresh rewrite, name every registered method, and stay within
    250 lines with the two setup commands."""
    from fedistill.report.readme_blocks import rewrite

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert rewrite(readme, ROOT) == readme, "run: python -m fedistill.report.readme_blocks README.md"
    methods = readme.split("<!-- generated:methods -->", 1)[1].split("<!-- /generated:methods -->", 1)[0]
    assert {row[0].split("`")[1] for row in _table_rows(methods)} == set(ALGORITHMS.names())
    assert len(readme.splitlines()) <= 250
    assert "make run" in readme and "make test" in readme
