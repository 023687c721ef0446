"""Issue 42: keep the finished runs of a claim that takes longer than one session (or one machine), so that the
next one continues it instead of starting again.

A finished run is read back by ``fedistill reproduce`` from three small files of its directory: ``config.yaml``
(checked against the preset, so a changed preset is refused), ``metrics.jsonl`` (one line per round) and
``summary.json`` (``finished`` or ``diverged``); ``environment.json`` says where it ran, and a ``fedistill bench``
cell's ``flops.json`` its count of one round. The checkpoint and the
plots are left behind: a finished run is never resumed. This copies those files of every finished run under
SOURCE to the same place under DEST, which works both ways:

    # at the end of a session: the finished runs into the repository
    python benchmarks/keep_finished_runs.py /work/repro10/dafkd_reduced_issue10 benchmarks/claims/kept/dafkd_reduced_issue10
    # at the start of the next: back under --out, where reproduce counts them as done
    python benchmarks/keep_finished_runs.py benchmarks/claims/kept/dafkd_reduced_issue10 /work/repro10/dafkd_reduced_issue10

A run that DEST already holds finished is left as it is; a run DEST holds part way (an interrupted one, with a
checkpoint) is replaced by the finished one of the same configuration; a DEST run of another configuration stops
the copy. Configurations are compared as reproduce
compares them (only the settings that decide the numbers: the data may lie elsewhere on the other machine).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from fedistill.errors import ConfigError
from fedistill.runs import comparable_config, read_saved

# flops.json: a bench cell's count of one round (studies/bench_rank.py FLOPS_FILE); without it the next bench
# counts the round again.
KEPT = ("config.yaml", "metrics.jsonl", "summary.json", "environment.json", "flops.json")


def finished(run: Path) -> bool:
    """Finished (or diverged, also a result) as reproduce reads the run: its summary's status."""
    try:
        _, _, summary = read_saved(run)
    except ConfigError:  # no metrics.jsonl or config.yaml: not a run reproduce could reuse
        return False
    return summary.get("status") in ("finished", "diverged")


def same_configuration(a: Path, b: Path) -> bool:
    """Reproduce's own comparison (fedistill.runs.comparable_config): the settings that decide the numbers, so
    the dataset's file settings (``data_dir``: the data may lie elsewhere on the other machine) and ``run.*`` do
    not count."""
    return comparable_config(read_saved(a)[0]) == comparable_config(read_saved(b)[0])


def keep(source: Path, dest: Path) -> tuple[int, int, int]:
    """(copied, already there, replaced part-way) run directories."""
    copied = same = replaced = 0
    for summary in sorted(source.rglob("summary.json")):
        run = summary.parent
        if not finished(run):
            continue
        target = dest / run.relative_to(source)
        if (target / "config.yaml").is_file():
            if not same_configuration(target, run):
                raise SystemExit(f"{target} holds a run of another configuration than {run}; move one of them away")
            if finished(target):  # the same run (their seconds may differ: a rerun elsewhere); DEST's stays
                same += 1
                continue
            shutil.rmtree(target)  # part way: the finished run of the same configuration supersedes it
            replaced += 1
        target.mkdir(parents=True, exist_ok=True)
        for name in KEPT:
            if (run / name).is_file():
                shutil.copy2(run / name, target / name)
        copied += 1
    return copied, same, replaced


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit(__doc__)
    source, dest = Path(argv[0]), Path(argv[1])
    if not source.is_dir():
        raise SystemExit(f"{source}: no such directory")
    copied, same, replaced = keep(source, dest)
    print(f"{copied} finished runs copied to {dest} ({replaced} of them over a part-way run), {same} already there")


if __name__ == "__main__":
    main(sys.argv[1:])
