"""The papers' comparative claims, tested over seeds: paired differences, their 95 % intervals, a verdict.

A reproduce preset may list ``claims``: ``"FedICT > FedDKC > FedGKT"``, ``"FedLMD-Tf ~ FedLMD"``,
``"FedICT < FedAvg"`` with ``metric: mb`` (traffic). Each claim is read as a chain of pairwise links between
adjacent methods; a link is tested on every column the claim names (all of the preset's columns by default)
from the seeds both methods ran, pairing the runs by seed (same seed, same partition and initialisation):

    d_s = m_A(s) - m_B(s),  mean d = (1/n) sum_s d_s,  s_d = sample std (n - 1),
    95 % interval  mean d -/+ t_{0.975, n-1} s_d / sqrt(n)   (Student's t; the paired t-interval)

and the verdict of a link, in the metric's own units (accuracy points, MB, seconds):

    A > B   holds when the interval lies above 0, does not hold when it lies below 0, else inconclusive;
    A < B   the mirror image;
    A ~ B   (within ``margin``) holds when the interval lies inside [-margin, margin], does not hold when it
            lies wholly outside it, else inconclusive (two one-sided tests at 2.5 % each, in interval form).

A chain holds on a column when every link holds, does not hold when any link does not hold, and is
inconclusive otherwise; fewer than two paired seeds make a link inconclusive (no interval). With 3 seeds
t_{0.975, 2} = 4.30: the interval is wide, and an ordering of methods that differ by a point needs the seeds
to agree closely; "inconclusive" says exactly that, not that the claim is false.

Runs that diverged have no final accuracy to pair; their seeds are left out of the links that need them,
and the row says so.

Beside the interval, each ordering link (> or <) shows the two-sided p of the Wilcoxon signed-rank test of the
same differences (:func:`wilcoxon_signed_rank`, exact up to 20 pairs): it assumes no normality, only symmetry
under the null. It does not change the verdict; where the two disagree (a t-interval above 0 with p >= 0.05, or
the reverse) the data sit near the edge and more seeds would tell.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .groups import format_stat, stat

__all__ = [
    "METRICS", "HOLDS", "DOES_NOT_HOLD", "INCONCLUSIVE", "Claim", "parse_claim", "t_quantile_975",
    "paired_interval", "wilcoxon_signed_rank", "Wilcoxon", "link_verdict", "chain_verdict", "evaluate_claims",
    "claims_markdown", "claims_records", "claim_rows", "print_claims", "run_value",
]  # fmt: skip

HOLDS, DOES_NOT_HOLD, INCONCLUSIVE = "holds", "does not hold", "inconclusive"

# metric name -> (description, unit); the values come from reproduce's RunResult (see METRIC_READERS there).
METRICS: dict[str, tuple[str, str]] = {
    "final": ("final accuracy", "points"),
    "best": ("best accuracy", "points"),
    # the mean over the last 5 evaluated rounds: under strong label skew the accuracy swings by several points
    # from round to round, and one round's value ranks methods partly by where the swing happened to stop
    "last5": ("mean accuracy over the last 5 rounds", "points"),
    "mb": ("MB per round, down + up", "MB"),
    "seconds": ("seconds per round", "s"),
}


def t_quantile_975(df: int) -> float:
    """t_{0.975, df}, the two-sided 95 % quantile of Student's t with ``df`` degrees of freedom
    (``scipy.stats.t.ppf``: 12.706 at 1, 4.303 at 2, 2.262 at 9)."""
    if df < 1:
        raise ValueError(f"t quantile: {df} degrees of freedom; an interval needs at least 2 paired values")
    from scipy.stats import t

    return float(t.ppf(0.975, df))


@dataclass(frozen=True)
class Wilcoxon:
    """The Wilcoxon signed-rank test of paired differences d_s against a distribution symmetric about 0.

    ``n``: the non-zero differences (zeros are dropped, Wilcoxon's own convention); ``w_plus`` / ``w_minus``: the
    sums of the ranks of |d_s| (ties share their mean rank) over the positive / negative differences;
    ``p_greater`` = P(W+ >= w_plus), ``p_less`` = P(W+ <= w_plus) under the null, ``p`` = the two-sided
    min(1, 2 min(p_greater, p_less)); ``exact``: from the 2^n equally likely sign patterns (n <= 20), else the
    normal approximation with the tie correction and a continuity correction of 1/2."""

    n: int
    w_plus: float
    w_minus: float
    p: float
    p_greater: float
    p_less: float
    exact: bool


EXACT_WILCOXON_MAX_N = 20


def wilcoxon_signed_rank(differences: Sequence[float]) -> Wilcoxon | None:
    """The signed-rank test of ``differences`` (see :class:`Wilcoxon`); None when every difference is 0.

    The p-values are scipy's with the method pinned, so that each is deterministic whatever the data (zeros are
    dropped first, ``zero_method="wilcox"``, so n counts the non-zero pairs):

    * up to :data:`EXACT_WILCOXON_MAX_N` pairs without tied |d|: ``scipy.stats.wilcoxon(method="exact")``, the
      exact null distribution of W+;
    * up to that many with ties: every one of the 2^n sign patterns, enumerated by
      ``scipy.stats.permutation_test`` (``n_resamples=inf``: exact, no resampling) on the signed-rank
      statistic W+ with the mean ranks of the ties. That is what ``wilcoxon`` itself does with a
      ``PermutationMethod``, but with the statistic vectorised over the patterns: ``wilcoxon`` calls it once
      per pattern from Python, 90 s for 20 pairs against 0.3 s here; its ``"exact"`` method would treat
      tied ranks as distinct and its ``"auto"`` resamples at random past 13 pairs with ties;
    * beyond: ``scipy.stats.wilcoxon(method="asymptotic", correction=True)``, the normal approximation with the
      tie correction and a continuity correction of 1/2.

    It asks less of the data than the t-interval (no normality, only symmetry under the null), and with n
    pairs its smallest two-sided p is 2 / 2^n: 0.25 at 3 seeds, 0.002 at 10."""
    import numpy as np
    from scipy.stats import permutation_test, rankdata, wilcoxon

    d = np.array([float(x) for x in differences if x != 0], dtype=np.float64)
    n = int(d.size)
    if n == 0:
        return None
    ranks = rankdata(np.abs(d), method="average")
    w_plus = float(ranks[d > 0].sum())
    w_minus = n * (n + 1) / 2 - w_plus
    exact = n <= EXACT_WILCOXON_MAX_N
    tied = len(np.unique(np.abs(d))) < n

    def p_value(alternative: str) -> float:
        if exact and tied:
            # A pattern flips signs of d; the |d|, so the ranks, stay: W+ is the rank sum over the positive entries.
            def positive_rank_sum(signed: np.ndarray, axis: int = -1) -> np.ndarray:
                return np.sum(np.where(signed > 0, ranks, 0.0), axis=axis)

            result = permutation_test(
                (d,), positive_rank_sum, permutation_type="samples", vectorized=True, n_resamples=np.inf,
                alternative=alternative,
            )  # fmt: skip
        else:
            method = "exact" if exact else "asymptotic"
            result = wilcoxon(d, zero_method="wilcox", correction=True, alternative=alternative, method=method)
        return float(result.pvalue)

    return Wilcoxon(n, w_plus, w_minus, p_value("two-sided"), p_value("greater"), p_value("less"), exact)


@dataclass(frozen=True)
class Claim:
    """One claim of a preset: ``methods[0] relations[0] methods[1] relations[1] ...``."""

    text: str
    methods: tuple[str, ...]
    relations: tuple[str, ...]  # ">", "<" or "~" between methods[i] and methods[i + 1]
    metric: str = "final"
    margin: float | None = None  # "~" only: the equivalence margin in the metric's units
    columns: tuple[str, ...] | None = None  # None: every column of the preset
    paper: str | None = None  # where the paper makes the claim
    note: str | None = None

    @property
    def links(self) -> list[tuple[str, str, str]]:
        return [(self.methods[i], self.relations[i], self.methods[i + 1]) for i in range(len(self.relations))]


_RELATION = re.compile(r"\s+(>|<|~|≈)\s+")


def parse_claim(text: str, metric: str = "final", margin: float | None = None, columns: Sequence[str] | None = None,
                paper: str | None = None, note: str | None = None) -> Claim:  # fmt: skip
    """``"A > B > C"`` (methods named as in the preset; a relation needs a space on each side, so method
    names may hold ``+``, ``-`` and spaces) into a :class:`Claim`; ``≈`` is read as ``~``."""
    parts = _RELATION.split(text.strip())
    methods, relations = tuple(p.strip() for p in parts[0::2]), tuple("~" if r == "≈" else r for r in parts[1::2])
    if len(methods) < 2 or any(not m for m in methods):
        raise ConfigError(
            f"claim {text!r}: write it as methods joined by ' > ', ' < ' or ' ~ ' with a space on each side, "
            "e.g. 'FedICT > FedDKC > FedGKT'"
        )
    if metric not in METRICS:
        raise ConfigError(f"claim {text!r}: metric {metric!r} is not one of {', '.join(METRICS)}")
    if "~" in relations:
        if margin is None or not (math.isfinite(margin) and margin > 0):
            raise ConfigError(f"claim {text!r}: '~' needs a positive margin (in {METRICS[metric][1]}), e.g. margin: 1.0")
    elif margin is not None:
        raise ConfigError(f"claim {text!r}: margin applies to '~' only; this claim has none")
    if len(set(methods)) != len(methods):
        raise ConfigError(f"claim {text!r}: a method appears twice")
    return Claim(text.strip(), methods, relations, metric, margin, tuple(columns) if columns else None, paper, note)


def parse_claims(specs: Sequence[Any], methods: Sequence[str] | None = None, columns: Sequence[str] | None = None,
                 where: str = "", column_word: str = "columns", owner: str = "preset") -> list[Claim]:  # fmt: skip
    """The claims of a reproduce preset or a bench suite (``specs``: its ClaimSpec entries) parsed, and, given its
    ``methods`` and ``columns``, checked to name only those; errors start with ``where``."""
    try:
        claims = [parse_claim(c.claim, c.metric, c.margin, c.columns, c.paper, c.note) for c in specs]
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}" if where else str(exc)) from None
    for claim in claims if methods is not None and columns is not None else []:
        unknown = [m for m in claim.methods if m not in methods]
        unknown_columns = [c for c in claim.columns or () if c not in columns]
        if unknown or unknown_columns:
            what = f"methods {', '.join(unknown)}" if unknown else f"{column_word} {', '.join(unknown_columns)}"
            raise ConfigError(
                f"{where}: claim {claim.text!r} names {what} the {owner} does not have "
                f"(methods: {', '.join(methods)}; {column_word}: {', '.join(columns)})"
            )
    return claims


@dataclass
class Interval:
    """The paired difference of one link on one column."""

    n: int
    mean: float | None
    std: float | None
    low: float | None
    high: float | None
    a_wins: int  # seeds where the first method's value is above the second's
    a_below: int = 0  # seeds where it is below (the claimed side of an 'A < B' link)

    def fmt(self, digits: int = 2) -> str:
        if self.mean is None:
            return "-"
        if self.low is None:
            return f"{self.mean:+.{digits}f} (n={self.n})"
        return f"{self.mean:+.{digits}f} [{self.low:+.{digits}f}, {self.high:+.{digits}f}]"


def paired_interval(a: Sequence[float], b: Sequence[float]) -> Interval:
    """Mean of a - b over paired values with its 95 % t-interval (no interval under 2 pairs)."""
    if len(a) != len(b):
        raise ValueError(f"paired values: {len(a)} against {len(b)}")
    d = [x - y for x, y in zip(a, b)]
    n = len(d)
    wins, below = sum(x > y for x, y in zip(a, b)), sum(x < y for x, y in zip(a, b))
    if n == 0:
        return Interval(0, None, None, None, None, 0)
    mean = statistics.fmean(d)
    if n < 2:
        return Interval(n, mean, None, None, None, wins, below)
    std = statistics.stdev(d)
    half = t_quantile_975(n - 1) * std / math.sqrt(n)
    return Interval(n, mean, std, mean - half, mean + half, wins, below)


def link_verdict(relation: str, interval: Interval, margin: float | None = None) -> str:
    """The verdict of ``A relation B`` from the interval of A - B (module docstring)."""
    if interval.low is None:
        return INCONCLUSIVE
    low, high = interval.low, interval.high
    if relation == ">":
        return HOLDS if low > 0 else DOES_NOT_HOLD if high < 0 else INCONCLUSIVE
    if relation == "<":
        return HOLDS if high < 0 else DOES_NOT_HOLD if low > 0 else INCONCLUSIVE
    if relation == "~":
        if margin is None:
            raise ValueError("'~' needs a margin")
        if -margin <= low and high <= margin:
            return HOLDS
        return DOES_NOT_HOLD if low > margin or high < -margin else INCONCLUSIVE
    raise ValueError(f"unknown relation {relation!r}")


def chain_verdict(verdicts: Iterable[str]) -> str:
    verdicts = list(verdicts)
    if verdicts and all(v == HOLDS for v in verdicts):
        return HOLDS
    return DOES_NOT_HOLD if DOES_NOT_HOLD in verdicts else INCONCLUSIVE


@dataclass
class LinkResult:
    a: str
    relation: str
    b: str
    a_values: dict[int, float]
    b_values: dict[int, float]
    interval: Interval
    verdict: str
    left_out: list[str] = field(default_factory=list)  # "seed 2: FedX diverged", ...

    @property
    def wilcoxon(self) -> Wilcoxon | None:
        """The signed-rank test of the paired differences (beside the t-interval; None under 2 pairs)."""
        if self.interval.n < 2:
            return None
        return wilcoxon_signed_rank([self.a_values[s] - self.b_values[s] for s in self.a_values])


def evaluate_claims(
    claims: Sequence[Claim],
    columns: Sequence[str],
    labels: dict[str, str],
    seeds: Sequence[int],
    value: Callable[[str, str, int, str], float | None],
    available: Callable[[str, str], bool],
    why_missing: Callable[[str, str, int], str | None] = lambda c, m, s: None,
    not_run: Callable[[list[str], str], str] | None = None,
) -> list[dict[str, Any]]:
    """One row per (claim, column): the links' paired differences and the chain's verdict.

    ``value(column, method, seed, metric)`` is a run's value (None when it has none, e.g. diverged);
    ``available(column, method)`` says whether the method ran on that column in this invocation (a claim
    whose methods were not run is reported as not run, never guessed); ``why_missing`` says why a value
    is None (shown in the row); ``not_run(methods, column)`` says why those methods have no values there (the
    default: they were not run in this invocation)."""
    rows: list[dict[str, Any]] = []
    for claim in claims:
        unknown_columns = [c for c in claim.columns or () if c not in labels]
        if unknown_columns:
            raise ConfigError(f"claim {claim.text!r}: column {', '.join(unknown_columns)} is not in the preset")
        for column in claim.columns or columns:
            base = {
                "claim": claim.text, "column": column, "setting": labels[column], "metric": claim.metric,
                "unit": METRICS[claim.metric][1], "margin": claim.margin, "paper": claim.paper, "note": claim.note,
            }  # fmt: skip
            missing = [m for m in claim.methods if column not in columns or not available(column, m)]
            if missing:
                rows.append({**base, "verdict": "not run", "links": [], "means": {},
                             "why": not_run(missing, column) if not_run else f"not run in this invocation: {', '.join(missing)} on {column}"})  # fmt: skip
                continue
            values = {m: {s: value(column, m, s, claim.metric) for s in seeds} for m in claim.methods}
            means = {m: stat(values[m].values()) for m in claim.methods}
            links = []
            for a, relation, b in claim.links:
                paired = [s for s in seeds if values[a][s] is not None and values[b][s] is not None]
                left_out = [
                    f"seed {s}: {m} {why_missing(column, m, s) or 'has no value'}"
                    for s in seeds if s not in paired for m in (a, b) if values[m][s] is None
                ]  # fmt: skip
                interval = paired_interval([values[a][s] for s in paired], [values[b][s] for s in paired])
                links.append(
                    LinkResult(a, relation, b, {s: values[a][s] for s in paired}, {s: values[b][s] for s in paired},
                               interval, link_verdict(relation, interval, claim.margin), left_out)
                )
            rows.append({**base, "verdict": chain_verdict(link.verdict for link in links), "links": links, "means": means, "why": None})
    return rows


def seeds_on_the_claimed_side(link: LinkResult, margin: float | None = None) -> str:
    """'2/3 A ahead' for 'A > B', '3/3 A below' for 'A < B' (an 'A < B' claim on traffic is met by the seeds where
    A sends less), '3/3 within ±1' for 'A ~ B' with its margin: the seeds that agree with the claim."""
    iv = link.interval
    if link.relation == "~" and margin is not None:
        within = sum(abs(link.a_values[s] - link.b_values[s]) <= margin for s in link.a_values)
        return f"{within}/{iv.n} within ±{margin:g}"
    return f"{iv.a_below}/{iv.n} {link.a} below" if link.relation == "<" else f"{iv.a_wins}/{iv.n} {link.a} ahead"


def wilcoxon_text(link: LinkResult) -> str:
    """'; Wilcoxon p=0.004' (two-sided) for an ordering link with at least 2 pairs; '' otherwise (an 'A ~ B'
    claim is an equivalence, which a test of a zero difference does not decide)."""
    test = link.wilcoxon if link.relation in ("<", ">") else None
    if test is None:
        return ""
    return f"; Wilcoxon p={test.p:.2g}" if test.p < 0.01 else f"; Wilcoxon p={test.p:.2f}"


def claim_cells(row: dict[str, Any]) -> dict[str, str]:
    """The printed cells of one row: the methods' mean ± std, each link's paired difference and interval,
    the paired seeds and the verdict (a chain's links joined by ';')."""
    if row["verdict"] == "not run":
        return {"values": "-", "difference": "-", "seeds": "-", "verdict": f"not run ({row['why']})"}
    values = ", ".join(f"{m} {format_stat(ms)}" for m, ms in row["means"].items())
    diffs = "; ".join(
        f"{link.a} - {link.b}: {link.interval.fmt()}" + (f" ({link.verdict})" if len(row["links"]) > 1 else "")
        for link in row["links"]
    )
    seeds = "; ".join(
        f"{link.interval.n} ({seeds_on_the_claimed_side(link, row['margin'])}{wilcoxon_text(link)})" for link in row["links"]
    )
    left_out = sorted({entry for link in row["links"] for entry in link.left_out})
    verdict = row["verdict"] + provisional_text(row) + (f" (left out: {'; '.join(left_out)})" if left_out else "")
    return {"values": values, "difference": diffs, "seeds": seeds, "verdict": verdict}


def provisional_text(row: dict[str, Any]) -> str:
    """' (provisional: 3 of 10 planned seeds)' for a claim read before all its planned seeds finished
    (``reproduce --status``), '' otherwise: the number of seeds is part of a claim's design."""
    finished, planned = row.get("seeds_finished"), row.get("seeds_planned")
    if finished is None or planned is None or len(finished) >= len(planned):
        return ""
    return f" (provisional: {len(finished)} of {len(planned)} planned seeds)"


def claims_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The verdict table as Markdown (report/tables.py writes it: every cell escaped alike)."""
    from .tables import Cell, markdown_table

    table = []
    for row in rows:
        cells = claim_cells(row)
        metric = METRICS[row["metric"]][0] + (f", margin ±{row['margin']:g} {row['unit']}" if row["margin"] is not None else "")
        table.append([row["claim"], row["setting"], metric, cells["values"], cells["difference"], cells["seeds"],
                      Cell(cells["verdict"], bold=True)])  # fmt: skip
    columns = ["claim", "setting", "metric", "mean ± std over seeds", "paired difference [95 % interval]", "seeds", "verdict"]
    return markdown_table(columns, table) + "\n"


def claims_records(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """JSON-ready rows (claims.json): every link with its per-seed values and interval."""
    out = []
    for row in rows:
        record = {k: v for k, v in row.items() if k not in ("links", "means")}
        record["means"] = {m: {"mean": ms["mean"], "std": ms["std"]} for m, ms in row["means"].items()}
        record["links"] = [
            {
                "a": link.a, "relation": link.relation, "b": link.b,
                "a_values": {str(s): v for s, v in link.a_values.items()},
                "b_values": {str(s): v for s, v in link.b_values.items()},
                "n": link.interval.n, "mean_difference": link.interval.mean, "std_difference": link.interval.std,
                "ci95_low": link.interval.low, "ci95_high": link.interval.high, "a_wins": link.interval.a_wins, "a_below": link.interval.a_below,
                "verdict": link.verdict, "left_out": link.left_out,
                **wilcoxon_record(link),
            }
            for link in row["links"]
        ]
        out.append(record)
    return out


def wilcoxon_record(link: LinkResult) -> dict[str, Any]:
    test = link.wilcoxon
    if test is None:
        return {"wilcoxon_p": None}
    return {"wilcoxon_n": test.n, "wilcoxon_w_plus": test.w_plus, "wilcoxon_p": test.p,
            "wilcoxon_p_greater": test.p_greater, "wilcoxon_p_less": test.p_less, "wilcoxon_exact": test.exact}  # fmt: skip


def run_value(run, metric: str) -> float | None:
    """A run's value of a claim's metric; a diverged run has no accuracy to compare (left out, said so)."""
    if metric in ("final", "best", "last5") and run.diverged_after is not None:
        return None
    if metric == "final":
        return run.final
    if metric == "last5":
        last = [a for _, a in run.accuracies[-5:]]
        return statistics.fmean(last) if last else None
    if metric == "best":
        return run.best
    if metric == "mb":
        return None if run.bytes_per_round is None else run.bytes_per_round / 1e6
    if metric == "seconds":
        return run.seconds_per_round
    raise ValueError(f"unknown claim metric {metric!r}")


def claim_rows(preset, results: dict[tuple[str, str, int], Any], columns: list[str], seeds: list[int]) -> list[dict[str, Any]]:
    """A reproduce preset's claims evaluated on that invocation's runs (``results``: reproduce's RunResult
    per (column, method, seed)); a claim whose methods did not run there is listed as not run."""

    def why(column: str, method: str, seed: int) -> str | None:
        run = results.get((column, method, seed))
        return None if run is None or run.diverged_after is None else f"diverged after round {run.diverged_after}"

    return evaluate_claims(
        preset.parsed_claims(), columns, {c: spec.label for c, spec in preset.columns.items()}, seeds,
        value=lambda c, m, s, metric: run_value(results[(c, m, s)], metric),
        available=lambda c, m: all((c, m, s) in results for s in seeds),
        why_missing=why,
    )  # fmt: skip


def print_claims(console, claims: list[dict[str, Any]], root: Path, where: str = "at the top of table.md") -> None:
    """The verdict table after the comparison table (``where``: the other file that holds it)."""
    if not claims:
        return
    from ..runner import print_rows

    rows = {}
    for row in claims:
        cells = claim_cells(row)
        metric = "" if row["metric"] == "final" else f" ({METRICS[row['metric']][0]})"
        rows[f"{row['claim']}{metric} [{row['setting']}]"] = [cells["values"], cells["difference"], cells["seeds"], cells["verdict"]]
    print_rows(console, "claims (paired over seeds, 95 % t-interval)", ("claim [setting]", "mean ± std", "paired difference [95 %]", "seeds", "verdict"), rows)
    console.print(f"claims: {root / 'claims.json'} (and {where})")
