"""Issue 42: one claim's verdict over seeds that finished on different machines or sessions, when the run
directories of the earlier seeds are gone and only their ``claims.json`` is left.

Where the run directories still exist, copy them under one ``--out`` and let ``fedistill reproduce --seeds ...``
tabulate them (or ``--status``); this script is for the other case. It reads the per-seed values every link of
a ``claims.json`` records (``a_values``, ``b_values``), joins the files seed by seed, and evaluates the preset's
claims again over the union with the library's own functions (paired t-interval, sign count, Wilcoxon), so the
merged record is what ``reproduce`` would have written had every seed run in one place.

A seed that two files both hold must carry the same value to the last bit in both: runs are seeded per (seed,
round, client), so a rerun seed is a determinism check, and a mismatch stops the merge.

    python benchmarks/merge_claim_seeds.py benchmarks/presets/fedict_fmnist_reduced.yaml merged.json \\
        benchmarks/claims/fedict_fmnist_reduced.json /work/repro10/fedict_fmnist_reduced/claims.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fedistill.report.claims import claims_markdown, claims_records, evaluate_claims
from fedistill.studies.reproduce import load_preset


def seed_values(records: list[dict]) -> dict[tuple[str, str], dict[int, float]]:
    """(column, method) -> {seed: value} from every link of every record of one claims.json."""
    values: dict[tuple[str, str], dict[int, float]] = {}
    for record in records:
        for link in record["links"]:
            for method, per_seed in ((link["a"], link["a_values"]), (link["b"], link["b_values"])):
                mine = values.setdefault((record["column"], method), {})
                for seed, value in per_seed.items():
                    mine[int(seed)] = value
    return values


def merge(preset_path: str, files: list[str]) -> list[dict]:
    preset = load_preset(preset_path)
    joined: dict[tuple[str, str], dict[int, float]] = {}
    planned: set[int] = set()
    for name in files:
        records = json.loads(Path(name).read_text())
        for record in records:
            planned.update(record.get("seeds_planned") or record.get("seeds_finished") or [])
        for key, per_seed in seed_values(records).items():
            mine = joined.setdefault(key, {})
            for seed, value in per_seed.items():
                if seed in mine and mine[seed] != value:
                    raise SystemExit(f"{name}: {key[1]} on {key[0]} seed {seed} is {value!r} here, {mine[seed]!r} in an earlier file: "
                                     "the same seed must give the same value; these runs differ in configuration or code")
                mine[seed] = value
    columns = sorted({column for column, _ in joined})
    seeds = sorted({s for per_seed in joined.values() for s in per_seed})
    rows = evaluate_claims(
        preset.parsed_claims(), columns, {c: spec.label for c, spec in preset.columns.items()}, seeds,
        value=lambda c, m, s, metric: joined[(c, m)].get(s),
        available=lambda c, m: (c, m) in joined and all(s in joined[(c, m)] for s in seeds),
        not_run=lambda missing, c: f"not every seed of {', '.join(missing)} on {c} is in the files",
    )  # fmt: skip
    for row in rows:
        row["seeds_finished"], row["seeds_planned"] = seeds, sorted(planned | set(seeds))
    return rows


def main(argv: list[str]) -> None:
    if len(argv) < 3:
        raise SystemExit(__doc__)
    preset_path, out, files = argv[0], Path(argv[1]), argv[2:]
    rows = merge(preset_path, files)
    out.write_text(json.dumps(claims_records(rows), indent=1) + "\n")
    print(claims_markdown(rows))
    print(f"seeds {rows[0]['seeds_finished']} of {rows[0]['seeds_planned']} -> {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
