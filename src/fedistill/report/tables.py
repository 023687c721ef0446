"""The one table writer of every report (issue 62): Markdown and HTML tables with one escaping rule.

Every cell and every header goes through the same escape before it reaches a table:

- Markdown (GitHub's tables, which MkDocs reads the same way): ``|`` becomes ``\\|`` and a line break a space;
  nothing else is touched, so a method name or a claim reads as written.
- HTML: :func:`html.escape` on every cell and header, method names included.

Markup a cell needs (bold, a code span, a link, an HTML class, a cell over several columns) is asked for with
:class:`Cell` and added by the writer around the escaped text, so no caller writes markup into a cell's text and
no text reaches a table unescaped. A plain value is a cell too: None is an empty cell, anything else ``str()``.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

__all__ = ["Cell", "Column", "SORT_CALL", "escape_html", "escape_markdown", "html_header", "html_table", "markdown_table"]

_ALIGN = {"": "---", "left": ":---", "right": "---:", "center": ":---:"}


@dataclass(frozen=True)
class Column:
    """A table's column: its header, its alignment in Markdown (``""``, ``"left"``, ``"right"``, ``"center"``),
    and in HTML the class of its header and cells and, for a sortable table, whether it sorts as numbers."""

    title: str
    align: str = ""
    numeric: bool = False
    cls: str = ""


@dataclass(frozen=True)
class Cell:
    """A cell with markup: ``text`` (escaped), shown bold, as code and/or as a link to ``href``, then ``after``
    (plain text, escaped too: ``**name** (yours)``). ``cls``: its HTML class (instead of its column's);
    ``span``: the columns it covers (HTML colspan; in Markdown the cell and ``span - 1`` empty ones)."""

    text: Any
    bold: bool = False
    code: bool = False
    href: str | None = None
    after: str = ""
    cls: str = ""
    span: int = 1


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def escape_markdown(value: Any) -> str:
    """``value`` as the text of a Markdown table cell: ``|`` escaped as ``\\|``, line breaks as spaces."""
    text = _text(value).replace("\r\n", " ").replace("\r", " ").replace("\n", " ")
    return text.replace("|", "\\|")


def escape_html(value: Any) -> str:
    """``value`` as the text of an HTML cell: :func:`html.escape` (quotes too, as in an attribute)."""
    return html.escape(_text(value))


def _as_cell(value: Any) -> Cell:
    return value if isinstance(value, Cell) else Cell(value)


def _markdown_cell(cell: Cell) -> str:
    text = escape_markdown(cell.text)
    if cell.code and text:
        fence = "``" if "`" in text else "`"  # a backtick inside the span needs a longer fence
        text = f"{fence} {text} {fence}" if fence == "``" else f"`{text}`"
    if cell.bold and text:
        text = f"**{text}**"
    if cell.href is not None:
        text = f"[{text}]({escape_markdown(cell.href)})"
    return text + escape_markdown(cell.after)


def _markdown_row(cells: Iterable[str]) -> str:
    return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"


def markdown_table(columns: Sequence[Column | str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table: the header, the alignment row and one line per row (no trailing newline)."""
    columns = [c if isinstance(c, Column) else Column(c) for c in columns]
    lines = [_markdown_row(escape_markdown(c.title) for c in columns), "|" + "|".join(_ALIGN[c.align] for c in columns) + "|"]
    for row in rows:
        texts: list[str] = []
        for value in row:
            cell = _as_cell(value)
            texts += [_markdown_cell(cell)] + [""] * (cell.span - 1)
        lines.append(_markdown_row(texts))
    return "\n".join(lines)


def _html_cell(cell: Cell, column: Column | None) -> str:
    text = escape_html(cell.text)
    if cell.code and text:
        text = f"<code>{text}</code>"
    if cell.bold and text:
        text = f"<b>{text}</b>"
    if cell.href is not None:
        text = f"<a href='{escape_html(cell.href)}'>{text}</a>"
    attributes = f" colspan='{cell.span}'" if cell.span > 1 else ""
    cls = cell.cls or (column.cls if column is not None else "")
    if cls:
        attributes += f" class='{escape_html(cls)}'"
    return f"<td{attributes}>{text}{escape_html(cell.after)}</td>"


SORT_CALL = "lbSort(this)"
"""What a sortable header calls when clicked; the page that holds the table defines it (report/leaderboard.py)."""


def html_header(column: Column | str, sortable: bool = False) -> str:
    """One ``<th>``; a sortable one sorts its table by its column when clicked, as numbers or as text."""
    column = column if isinstance(column, Column) else Column(column)
    attributes = f" class='{escape_html(column.cls)}'" if column.cls else ""
    if sortable:
        kind = "num" if column.numeric else "text"
        attributes += f" data-type='{kind}' onclick='{SORT_CALL}' title='sort by this column'"
    return f"<th{attributes}>{escape_html(column.title)}</th>"


def html_table(
    columns: Sequence[Column | str], rows: Iterable[Sequence[Any]], sortable: bool = False,
    row_classes: Sequence[str | None] | None = None,
) -> str:  # fmt: skip
    """An HTML table: a head row of ``columns`` and a body of ``rows``, one line each (the head, every row and
    the end); ``row_classes``: an HTML class per row (None: none)."""
    columns = [c if isinstance(c, Column) else Column(c) for c in columns]
    lines = ["<table><thead><tr>" + "".join(html_header(c, sortable) for c in columns) + "</tr></thead><tbody>"]
    for index, row in enumerate(rows):
        cls = row_classes[index] if row_classes is not None else None
        cells, position = [], 0
        for value in row:
            cell = _as_cell(value)
            cells.append(_html_cell(cell, columns[position] if position < len(columns) else None))
            position += cell.span
        lines.append((f"<tr class='{escape_html(cls)}'>" if cls else "<tr>") + "".join(cells) + "</tr>")
    lines.append("</tbody></table>")
    return "\n".join(lines)
