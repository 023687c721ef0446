"""One documentation page per registered method, generated from the code (issue 43; docs/hooks.py builds them).

A page holds what the method does (the opening of its card in ``spec/``), a parameter table built from the
method's pydantic ``Params`` (name, default, description, constraints), the presets that run it (paper tables
under ``configs/reproduce/``, reduced protocols under ``benchmarks/presets/``), its rows of every published
leaderboard (``benchmarks/leaderboards/*/leaderboard.json``) and the claims that name it (``claims.json``). Nothing
on a page is written by hand, so a new field, preset or leaderboard shows up at the next build; the tests compare
each page's table with its class (tests/test_docs_site.py).
"""

from __future__ import annotations

import functools
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic.fields import FieldInfo

from ..registry import ALGORITHMS
from .groups import format_stat
from .tables import Cell, escape_markdown, markdown_table

# Constraint classes of annotated_types, as pydantic stores them in FieldInfo.metadata: attribute -> symbol.
_BOUNDS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "min_length": "length ≥", "max_length": "length ≤"}


@dataclass(frozen=True)
class ParameterRow:
    """One row of a method's parameter table: the field as its class defines it."""

    name: str
    default: str
    description: str
    constraints: str


def format_value(value: Any) -> str:
    """A default as a reader would write it in a config: None as null, booleans in lower case, floats short."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, default=str)
    return str(value)


def field_constraints(field: FieldInfo) -> str:
    """Bounds (``≥ 0``) and, for a ``Literal`` (or an optional one), the allowed values; empty when free."""
    parts = []
    for item in field.metadata:
        for attribute, symbol in _BOUNDS.items():
            bound = getattr(item, attribute, None)
            if bound is not None:
                parts.append(f"{symbol} {format_value(bound)}")
    choices = literal_choices(field.annotation)
    if choices:
        parts.append("one of " + ", ".join(format_value(c) for c in choices))
    return "; ".join(parts)


def literal_choices(annotation: Any) -> list[Any]:
    """The values of a ``Literal[...]`` annotation, also inside ``X | None``; [] for any other type."""
    if get_origin(annotation) is Literal:
        return list(get_args(annotation))
    choices: list[Any] = []
    for arg in get_args(annotation):
        if get_origin(arg) is Literal:
            choices.extend(get_args(arg))
    return choices


def field_default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        return format_value(field.default_factory())
    if field.is_required():
        return "required"
    return format_value(field.default)


def parameter_rows(params_cls: Any) -> list[ParameterRow]:
    """Every field of a method's ``Params`` class, in the class's order (inherited fields first, as pydantic
    keeps them)."""
    return [
        ParameterRow(name, field_default(field), (field.description or "").strip(), field_constraints(field))
        for name, field in params_cls.model_fields.items()
    ]


markdown_cell = escape_markdown
"""Text safe inside a Markdown table cell (report/tables.py's one rule; the name kept for its callers)."""


def parameter_table(rows: list[ParameterRow]) -> str:
    if not rows:
        return "This method has no parameters of its own.\n"
    table = [[Cell(r.name, code=True), Cell(r.default, code=True), r.description, r.constraints] for r in rows]
    return markdown_table(["parameter", "default", "description", "constraints"], table) + "\n"


def card_of(name: str, cls: type, spec_dir: Path) -> Path | None:
    """The method's card: the first ``spec/X.md`` its module or class docstring cites, else ``spec/NAME.md``."""
    module = sys.modules.get(cls.__module__)
    text = ((module.__doc__ if module else "") or "") + (cls.__doc__ or "")
    for cited in re.findall(r"spec/([\w.-]+\.md)", text):
        if (spec_dir / cited).exists():
            return spec_dir / cited
    own = spec_dir / f"{name}.md"
    return own if own.exists() else None


def card_summary(card: Path, title: str) -> str:
    """The card's section on this method: a ``## ...`` section whose heading names it (cards that hold several
    methods), else its "Idea" section, else the text before the first section; without the heading."""
    sections = re.split(r"(?m)^(?=## )", card.read_text(encoding="utf-8"))
    key = title.lower()
    chosen = next((s for s in sections[1:] if key in s.splitlines()[0].lower()), None)
    if chosen is None:
        chosen = next((s for s in sections[1:] if "idea" in s.splitlines()[0].lower()), sections[0])
    body = chosen.split("\n", 1)[1] if chosen.startswith("#") else chosen
    # Headings of the card would nest under the page's own; make them bold lines instead.
    body = re.sub(r"(?m)^#{1,6} (.*)$", r"**\1**", body)
    return body.strip() + "\n"


def presets_using(name: str, preset_dirs: list[Path]) -> list[tuple[str, str, list[str]]]:
    """(preset file, title, the preset's method labels that run ``name``) for every preset that runs it."""
    found = []
    for directory in preset_dirs:
        for path in sorted(directory.glob("*.yaml")):
            title, methods = _preset_methods(str(path), path.stat().st_mtime_ns)
            labels = [label for label, algorithm, plus in methods if algorithm == name or name in plus]
            if labels:
                found.append((f"{directory.name}/{path.name}", title, labels))
    return found


@functools.lru_cache(maxsize=None)
def _preset_methods(path: str, mtime_ns: int) -> tuple[str, tuple[tuple[str, Any, tuple[str, ...]], ...]]:
    """A preset's title and, per method label, its algorithm name and the names it adds with ``plus``: parsed
    once per version of the file (``mtime_ns`` is in the key). Every method page reads every preset, and parsing
    the YAML again for each page was most of the pages' time (about 40 pages x 30 presets in a docs build)."""
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    methods = []
    for label, spec in (data.get("methods") or {}).items():
        algorithm = ((spec or {}).get("config") or {}).get("algorithm") or {}
        methods.append((label, algorithm.get("name"), tuple(algorithm.get("plus") or {})))
    return str(data.get("title", Path(path).stem)), tuple(methods)


def leaderboard_rows(name: str, leaderboard_dir: Path) -> list[tuple[str, dict[str, Any]]]:
    """(suite, row) for each published leaderboard row of ``name``."""
    rows = []
    for path in sorted(leaderboard_dir.glob("*/leaderboard.json")):
        for row in json.loads(path.read_text(encoding="utf-8")):
            if row.get("method") == name:
                rows.append((path.parent.name, row))
    return rows


def claims_naming(name: str, claims_files: list[Path]) -> list[tuple[str, dict[str, Any]]]:
    """(source, claim) for each recorded claim with ``name`` on either side of one of its links."""
    found = []
    for path in claims_files:
        for claim in json.loads(path.read_text(encoding="utf-8")):
            names = {link.get(side) for link in claim.get("links", []) for side in ("a", "b")}
            if name in names:
                found.append((path.parent.name, claim))
    return found


def method_page(name: str, root: Path) -> str:
    """The Markdown page of registered method ``name``; ``root`` is the repository (spec/, configs/, benchmarks/)."""
    cls = ALGORITHMS.get(name)
    title = ALGORITHMS.describe(name).split(":")[0].strip() or name
    lines = [f"# {title} (`algorithm.name: {name}`)", "", ALGORITHMS.describe(name), ""]
    card = card_of(name, cls, root / "spec")
    lines += ["## What it does", ""]
    if card is not None:
        lines += [f"From its card, `spec/{card.name}`:", "", card_summary(card, title)]
    else:
        lines += ["No card in `spec/` (the class docstring is the reference).", ""]
    lines += ["## Parameters", "", "Set under `algorithm:` in a config, or `--set algorithm.KEY=VALUE`.", ""]
    lines += [parameter_table(parameter_rows(cls.Params))]
    presets = presets_using(name, [root / "configs" / "reproduce", root / "benchmarks" / "presets"])
    lines += ["## Presets that run it", ""]
    if presets:
        lines += [markdown_table(["preset", "title", "as"], [[Cell(p, code=True), t, ", ".join(ls)] for p, t, ls in presets])]
        lines += ["", "Run one with `fedistill reproduce PRESET` (a file under benchmarks/presets/ by its path)."]
    else:
        lines += ["No preset runs it."]
    lines += ["", "## Leaderboard rows", ""]
    rows = leaderboard_rows(name, root / "benchmarks" / "leaderboards")
    if rows:
        table = []
        for suite, r in rows:
            # a one-seed std is None in leaderboard.json and n/a here (format_stat), never 0
            accuracy = "n/a" if r.get("final_accuracy") is None else format_stat({"mean": r["final_accuracy"], "std": r.get("final_accuracy_std")})
            seconds = "" if r.get("seconds_per_round") is None else f"{r['seconds_per_round']:.1f}"
            mb = "" if r.get("mb_per_round") is None else f"{r['mb_per_round']:.1f}"
            table.append([suite, r.get("label", r["setting"]), r.get("rank"), accuracy, mb, seconds, f"{r.get('finished', '')}/{r.get('seeds', '')}"])
        lines += [markdown_table(["suite", "setting", "rank", "final acc %", "MB/round", "s/round", "seeds"], table)]
    else:
        lines += ["Not in a published leaderboard yet."]
    lines += ["", "## Claims", ""]
    from .claims import provisional_text

    claims = claims_naming(name, sorted((root / "benchmarks").glob("**/claims.json")))
    if claims:
        table = [[src, c["claim"], c.get("setting", ""), c.get("metric", ""), c.get("verdict", "") + provisional_text(c)] for src, c in claims]
        lines += [markdown_table(["source", "claim", "setting", "metric", "verdict"], table)]
    else:
        lines += ["No recorded claim names it."]
    return "\n".join(lines) + "\n"


def methods_index(root: Path) -> str:
    """The Methods section's landing page: every registered method with its one-line help."""
    lines = ["# Methods", "", "Every method registered in fedistill, one generated page each.", ""]
    table = [[Cell(name, code=True, href=f"{name}.md"), ALGORITHMS.describe(name)] for name in ALGORITHMS.names()]
    lines += [markdown_table(["method", "what it does"], table)]
    return "\n".join(lines) + "\n"
