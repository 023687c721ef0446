"""What a run prints while it runs, on a terminal and off one (nohup, SLURM, ``| tee``), and ``run.log``.

On a terminal the round loop shows a rich progress bar. Off a terminal a bar is useless (rich draws it
only at the end) and Python buffers stdout in blocks, so a batch job showed nothing until the run ended:
there every round prints one plain line, flushed at once. Both write the same plain lines to the run
directory's ``run.log``. ``quiet`` keeps the console to the header and the summary; ``run.log`` always gets
every line.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


# A round's line fits a log file read in an 80-column terminal or editor: one line per round, never wrapped.
ROUND_LINE_WIDTH = 80


def _megabytes(n: Any) -> str:
    return "-" if n is None else f"{n / 1e6:.2f}"


def _loss(x: float) -> str:
    # four decimals as long as that stays short; a diverging run's 1e12 would otherwise take 18 characters
    return f"{x:.4f}" if abs(x) < 1e4 else f"{x:.4g}"


def round_line(row: dict[str, Any], rounds: int, accuracy_key: str, width: int = ROUND_LINE_WIDTH) -> str:
    """One round as one plain line of at most ``width`` characters: round, accuracy, losses, traffic, seconds.

    Round/total, the accuracy, the loss and the seconds are always there. When the line would be longer than
    ``width`` (most real runs: 200 rounds and tens of MB), the extras go, traffic first (the same each round
    for most methods, and totalled in the summary), then the train loss. metrics.csv keeps every field.
    The round number is padded to the total's width, so a run's lines align and keep the same fields.
    """
    acc = row.get(accuracy_key)
    test_loss, train_loss = row.get("test_loss"), row.get("train_loss")
    down, up = row.get("bytes_down"), row.get("bytes_up")
    label = "personal acc" if accuracy_key == "personal_accuracy" else "acc"
    # (text or None where the round has no such value, the step at which a too-long line drops it; 0: never).
    # Without a test loss (FedGKT, FedICT: only personal models are evaluated) the train loss is the loss.
    fields: list[tuple[str | None, int]] = [
        (f"round {row['round']:>{len(str(rounds))}}/{rounds}", 0),
        (f"{label} {acc:.2f}%" if acc is not None else f"{label} -", 0),
        (f"test loss {_loss(test_loss)}" if test_loss is not None else None, 0),
        (f"train loss {_loss(train_loss)}" if train_loss is not None else None, 2 if test_loss is not None else 0),
        (f"down/up {_megabytes(down)}/{_megabytes(up)} MB" if down is not None or up is not None else None, 1),
        (f"{row['seconds']:.1f} s" if row.get("seconds") is not None else None, 0),
    ]
    kept = [(text, step) for text, step in fields if text is not None]
    for step in (1, 2):
        if len("  ".join(text for text, _ in kept)) <= width:
            break
        kept = [(text, s) for text, s in kept if s != step]
    return "  ".join(text for text, _ in kept)


class RoundLog:
    """The header, one line per round and the closing line, on the console and in ``run.log``."""

    def __init__(self, console: Console, log_path: Path | None, rounds: int, start_round: int, accuracy_key: str,
                 progress: bool = True, quiet: bool = False) -> None:  # fmt: skip
        self.console = console
        self.rounds = rounds
        self.accuracy_key = accuracy_key
        self.quiet = quiet
        self.live = progress and console.is_terminal and not quiet
        self._file: TextIO | None = open(log_path, "a", encoding="utf-8") if log_path is not None else None
        self._progress = Progress(
            TextColumn("round {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("acc {task.fields[acc]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            disable=not self.live,
            transient=False,
        )
        self._task = self._progress.add_task("rounds", total=rounds, completed=start_round, acc="-")

    def _to_file(self, text: str) -> None:
        if self._file is not None:
            self._file.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")
            self._file.flush()

    def _to_console(self, text: str, markup: str | None = None) -> None:
        # soft_wrap: a long line (a deep run directory) stays one line in a log, as in run.log
        self.console.print(markup if markup is not None else text, highlight=False, markup=markup is not None, soft_wrap=True)
        self.console.file.flush()  # off a terminal stdout is block-buffered: show the line now

    def header(self, text: str, markup: str | None = None) -> None:
        self._to_file(text)
        self._to_console(text, markup)

    def round(self, row: dict[str, Any]) -> None:
        line = round_line(row, self.rounds, self.accuracy_key)
        self._to_file(line)
        if self.live:
            acc = row.get(self.accuracy_key)
            self._progress.update(self._task, completed=row["round"], **({"acc": f"{acc:.2f}%"} if acc is not None else {}))
        elif not self.quiet:
            self._to_console(line)

    def note(self, text: str) -> None:
        """A line for the log and the console (warnings, the run's end)."""
        self._to_file(text)
        self._to_console(text)

    def __enter__(self) -> "RoundLog":
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.__exit__(*exc)
        if self._file is not None:
            self._file.close()
            self._file = None
