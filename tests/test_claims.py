"""Claims tested over seeds (report/claims.py): the paired-difference arithmetic and the verdicts, on
numbers worked out by hand here, then the ``claims`` section of a reproduce preset end to end."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from fedistill.errors import ConfigError
from fedistill.report.claims import (
    DOES_NOT_HOLD,
    HOLDS,
    INCONCLUSIVE,
    chain_verdict,
    claim_cells,
    evaluate_claims,
    link_verdict,
    paired_interval,
    parse_claim,
    t_quantile_975,
    wilcoxon_signed_rank,
)
from fedistill.studies.reproduce import load_preset, reproduce


def test_t_quantiles_match_the_printed_tables():
    # Student's t, two-sided 95 %, to the printed tables' 3 decimals: 12.706 (1 df), 4.303 (2), 2.262 (9),
    # 2.228 (10), 2.042 (30), 2.021 (40), 2.000 (60), 1.980 (120); the normal quantile 1.960 in the limit.
    for df, expected in ((1, 12.706), (2, 4.303), (9, 2.262), (10, 2.228), (30, 2.042), (40, 2.021), (60, 2.000), (120, 1.980)):
        assert t_quantile_975(df) == pytest.approx(expected, abs=5e-4), df
    assert 1.95996 < t_quantile_975(100_000) < 1.96
    with pytest.raises(ValueError):
        t_quantile_975(0)


# p-values of the hand-written test that scipy replaced (issue 62), computed by it before the change: exact sign-pattern
# counts up to 20 pairs, ties and zeros included, and the normal approximation with continuity correction beyond.
# (differences, n, W+, two-sided p, P(W+ >= w), P(W+ <= w), exact)
EARLIER_WILCOXON = [
    ([1.2, -0.4, 2.5, 0.9, -1.1, 3.0, 0.2, 1.7, -0.3, 2.2], 10, 45.0, 0.083984375, 0.0419921875, 0.9677734375, True),
    ([0.5, 0.5, -0.5, 1.0, 1.0, 0.0, 2.0, -1.0, 1.5, 0.5, 0.5], 10, 45.0, 0.08984375, 0.044921875, 0.970703125, True),
    ([2.0, 2.0, 2.0, -2.0], 4, 7.5, 0.625, 0.3125, 0.9375, True),
    ([0.0, 3.0], 1, 1.0, 1.0, 0.5, 1.0, True),
    ([1.0, 2.0, 3.0], 3, 6.0, 0.25, 0.125, 1.0, True),
    ([(-1.0) ** (k % 3 == 0) * (k % 7 + 1) for k in range(1, 26)], 25, 218.5, 0.13442974770816607, 0.06721487385408303, 0.9362244364987281, False),
]


@pytest.mark.parametrize(("d", "n", "w_plus", "p", "p_greater", "p_less", "exact"), EARLIER_WILCOXON)
def test_scipy_gives_the_p_values_of_the_earlier_hand_written_test(d, n, w_plus, p, p_greater, p_less, exact):
    test = wilcoxon_signed_rank(d)
    assert (test.n, test.w_plus, test.exact) == (n, w_plus, exact)
    assert (test.p, test.p_greater, test.p_less) == (pytest.approx(p, abs=1e-12), pytest.approx(p_greater, abs=1e-12), pytest.approx(p_less, abs=1e-12))


def test_every_committed_verdict_and_p_value_stands_under_scipy():
    """Each link of every committed claims.json, evaluated again from the per-seed values it records: the same
    verdict, the same Wilcoxon p to the last bits, and the interval where the quantile's change of under 5e-4 (the
    t-table held 3 decimals) puts it."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "benchmarks"
    files = sorted(root.glob("claims/*.json")) + sorted(root.glob("leaderboards/*/claims.json"))
    assert len(files) >= 6
    links = 0
    for path in files:
        for record in json.loads(path.read_text()):
            verdicts = []
            for link in record["links"]:
                seeds = sorted(link["a_values"], key=int)
                a = [link["a_values"][s] for s in seeds]
                b = [link["b_values"][s] for s in seeds]
                interval = paired_interval(a, b)
                verdict = link_verdict(link["relation"], interval, record["margin"])
                assert verdict == link["verdict"], (path.name, record["claim"], record["column"])
                verdicts.append(verdict)
                if link["ci95_low"] is not None:
                    # the quantile moved by under 5e-4, the bounds by that times s_d / sqrt(n)
                    moved = 5e-4 * interval.std / math.sqrt(interval.n) + 1e-9
                    assert interval.low == pytest.approx(link["ci95_low"], abs=moved)
                    assert interval.high == pytest.approx(link["ci95_high"], abs=moved)
                if link.get("wilcoxon_p") is not None:
                    test = wilcoxon_signed_rank([x - y for x, y in zip(a, b)])
                    assert (test.p, test.p_greater, test.p_less) == (
                        pytest.approx(link["wilcoxon_p"], abs=1e-12), pytest.approx(link["wilcoxon_p_greater"], abs=1e-12),
                        pytest.approx(link["wilcoxon_p_less"], abs=1e-12),
                    )  # fmt: skip
                links += 1
            if record["links"] and record["why"] is None:
                assert chain_verdict(verdicts) == record["verdict"], (path.name, record["claim"], record["column"])
    assert links >= 50


def test_wilcoxon_signed_rank_matches_the_printed_table():
    """Exact two-sided p against a statistics table (Wilcoxon signed-rank critical values, n = 10, two-sided
    α = 0.05: reject when min(W+, W-) <= 8) and the counts behind it: 25 of the 1,024 sign patterns have a rank
    sum <= 8 (subsets of 1..10 summing to 0..8: 1+1+1+2+2+3+4+5+6), 33 have one <= 9."""
    all_up = wilcoxon_signed_rank([float(k) for k in range(1, 11)])
    assert (all_up.n, all_up.w_plus, all_up.w_minus, all_up.exact) == (10, 55.0, 0.0, True)
    assert all_up.p == pytest.approx(2 / 1024) and all_up.p_greater == pytest.approx(1 / 1024) and all_up.p_less == 1.0
    at_critical = wilcoxon_signed_rank([1, 2, 3, 4, 5, 6, 7, -8, 9, 10])  # W- = 8: just significant
    assert at_critical.w_minus == 8.0 and at_critical.p == pytest.approx(2 * 25 / 1024) and at_critical.p < 0.05
    past_it = wilcoxon_signed_rank([1, 2, 3, 4, 5, 6, 7, 8, -9, 10])  # W- = 9: not
    assert past_it.p == pytest.approx(2 * 33 / 1024) and past_it.p > 0.05
    # n = 3, the smallest p possible: 2 / 8 (why 3 seeds cannot decide anything by this test)
    assert wilcoxon_signed_rank([0.5, 2.0, 1.0]).p == pytest.approx(0.25)
    # zeros are dropped (Wilcoxon's convention); all zeros: no test
    assert wilcoxon_signed_rank([0.0, 3.0, 1.0, 2.0]).n == 3
    assert wilcoxon_signed_rank([0.0, 0.0]) is None


def test_wilcoxon_with_ties_equals_counting_every_sign_pattern():
    """Tied |d| share their mean rank; the exact p is then the share of the 2^n sign patterns (each equally
    likely under the null) whose W+ is at least as extreme, counted here one pattern at a time."""
    import itertools

    d = [1.0, -1.0, 2.0, 2.0, 2.0, -3.5, 4.0, 4.0, 0.0]
    test = wilcoxon_signed_rank(d)
    nonzero = [x for x in d if x]
    ranks = {1.0: 1.5, 2.0: 4.0, 3.5: 6.0, 4.0: 7.5}  # |d| sorted: 1 1 2 2 2 3.5 4 4 -> ranks 1-2, 3-5, 6, 7-8
    w_plus = sum(ranks[abs(x)] for x in nonzero if x > 0)
    assert test.w_plus == w_plus == 1.5 + 4 * 3 + 7.5 * 2
    sums = [sum(ranks[abs(x)] for x, up in zip(nonzero, signs) if up) for signs in itertools.product((0, 1), repeat=8)]
    p_greater = sum(s >= w_plus for s in sums) / 256
    p_less = sum(s <= w_plus for s in sums) / 256
    assert test.p_greater == pytest.approx(p_greater) and test.p_less == pytest.approx(p_less)
    assert test.p == pytest.approx(min(1.0, 2 * min(p_greater, p_less)))


def test_wilcoxon_beyond_twenty_pairs_is_the_normal_approximation(monkeypatch):
    """n > 20: W+ against N(n(n+1)/4, n(n+1)(2n+1)/24) with a continuity correction; close to the exact count."""
    from fedistill.report import claims

    d = [(-1.0) ** (k % 3 == 0) * k for k in range(1, 26)]  # 25 pairs, every third one negative
    approx = wilcoxon_signed_rank(d)
    assert not approx.exact and approx.n == 25
    monkeypatch.setattr(claims, "EXACT_WILCOXON_MAX_N", 30)
    exact = wilcoxon_signed_rank(d)
    assert exact.exact and approx.p == pytest.approx(exact.p, abs=0.005)
    # W+ = 325 for 1..25 all positive: z = (325 - 0.5 - 162.5) / sqrt(25·26·51/24) = 4.3588, two-sided 1.31e-5
    assert claims.wilcoxon_signed_rank([float(k) for k in range(1, 26)]).p == pytest.approx(2 / 2**25)  # exact now
    monkeypatch.setattr(claims, "EXACT_WILCOXON_MAX_N", 20)
    assert claims.wilcoxon_signed_rank([float(k) for k in range(1, 26)]).p == pytest.approx(1.31e-5, rel=0.01)


def test_paired_interval_on_hand_computed_numbers():
    # d = (2, 3, 1): mean 2, sample std 1, half width 4.303 * 1 / sqrt(3) = 2.4843
    iv = paired_interval([80.0, 82.0, 81.0], [78.0, 79.0, 80.0])
    assert (iv.n, iv.a_wins) == (3, 3)
    assert iv.mean == pytest.approx(2.0) and iv.std == pytest.approx(1.0)
    assert (iv.low, iv.high) == (pytest.approx(2 - 2.48434, abs=5e-4), pytest.approx(2 + 2.48434, abs=5e-4))
    # the pairing matters: the same values unpaired (sorted differently) give another interval
    shuffled = paired_interval([80.0, 82.0, 81.0], [80.0, 78.0, 79.0])  # d = (0, 4, 2): mean 2, std 2
    assert shuffled.std == pytest.approx(2.0) and shuffled.high - shuffled.low == pytest.approx(2 * 4.303 * 2 / math.sqrt(3), abs=1e-3)
    # two seeds: t with 1 degree of freedom; d = (1, 3): mean 2, std sqrt(2), half 12.706 * sqrt(2) / sqrt(2)
    two = paired_interval([11.0, 13.0], [10.0, 10.0])
    assert (two.low, two.high) == (pytest.approx(2 - 12.706, abs=5e-4), pytest.approx(2 + 12.706, abs=5e-4))
    # one seed: a difference, no interval
    one = paired_interval([5.0], [4.0])
    assert (one.mean, one.low, one.high) == (1.0, None, None)
    assert paired_interval([], []).mean is None


@pytest.mark.parametrize(
    ("a", "b", "relation", "margin", "verdict"),
    [
        ([80, 82, 81], [78, 79, 80], ">", None, INCONCLUSIVE),  # d (2, 3, 1): [-0.48, 4.48] straddles 0
        ([83, 84, 85], [79, 80, 80], ">", None, HOLDS),  # d (4, 4, 5): mean 4.33, std 0.577, [2.90, 5.77]
        ([79, 80, 80], [83, 84, 85], ">", None, DOES_NOT_HOLD),  # the same reversed: [-5.77, -2.90]
        ([79, 80, 80], [83, 84, 85], "<", None, HOLDS),
        ([83, 84, 85], [79, 80, 80], "<", None, DOES_NOT_HOLD),
        ([70, 71, 72], [70, 71, 72], ">", None, INCONCLUSIVE),  # identical: [0, 0] is not above 0
        ([70, 71, 72], [69, 70, 71], ">", None, HOLDS),  # a constant +1: std 0, [1, 1]
        ([70.1, 70.9, 72.0], [70, 71, 72], "~", 1.0, HOLDS),  # d (0.1, -0.1, 0): [-0.25, 0.25] inside ±1
        ([73, 74, 75], [70, 71, 71], "~", 1.0, DOES_NOT_HOLD),  # d (3, 3, 4): mean 3.33, [1.90, 4.77] beyond +1
        ([70.5, 72.5, 73], [70, 71, 72], "~", 1.0, INCONCLUSIVE),  # d (0.5, 1.5, 1): [-0.24, 2.24]
        ([70.5, 72.5, 73], [70, 71, 72], "~", 3.0, HOLDS),  # the same inside a ±3 margin
    ],
)
def test_link_verdicts(a, b, relation, margin, verdict):
    assert link_verdict(relation, paired_interval(a, b), margin) == verdict


def test_a_chain_holds_only_when_every_link_holds():
    assert chain_verdict([HOLDS, HOLDS]) == HOLDS
    assert chain_verdict([HOLDS, INCONCLUSIVE]) == INCONCLUSIVE
    assert chain_verdict([HOLDS, DOES_NOT_HOLD, INCONCLUSIVE]) == DOES_NOT_HOLD
    assert link_verdict(">", paired_interval([1.0], [0.0])) == INCONCLUSIVE  # one seed decides nothing


def test_claims_parse_and_bad_claims_say_how_to_write_them():
    claim = parse_claim("SCAFFOLD+FedFTG > SCAFFOLD", columns=["a"])
    assert claim.links == [("SCAFFOLD+FedFTG", ">", "SCAFFOLD")] and claim.columns == ("a",)
    chain = parse_claim("FedICT > FedDKC > FedGKT")
    assert chain.links == [("FedICT", ">", "FedDKC"), ("FedDKC", ">", "FedGKT")]
    assert parse_claim("FedLMD-Tf ≈ FedLMD", margin=1.0).relations == ("~",)
    assert parse_claim("DaFKD (paper) < FedAvg", metric="mb").methods == ("DaFKD (paper)", "FedAvg")
    for text, kwargs, message in [
        ("FedICT>FedGKT", {}, "space on each side"),
        ("FedICT", {}, "space on each side"),
        ("A ~ B", {}, "needs a positive margin"),
        ("A ~ B", {"margin": -1.0}, "needs a positive margin"),
        ("A > B", {"margin": 1.0}, "margin applies to '~' only"),
        ("A > B", {"metric": "accuracy"}, "metric 'accuracy' is not one of final, best, last5, mb, seconds"),
        ("A > B > A", {}, "appears twice"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_claim(text, **kwargs)


def test_evaluate_claims_pairs_by_seed_and_leaves_out_what_has_no_value():
    finals = {  # (method, seed) -> final accuracy; B diverged on seed 2
        ("A", 0): 80.0, ("A", 1): 82.0, ("A", 2): 81.0, ("A", 3): 84.0,
        ("B", 0): 78.0, ("B", 1): 79.0, ("B", 2): None, ("B", 3): 80.0,
        ("C", 0): 70.0, ("C", 1): 71.0, ("C", 2): 72.0, ("C", 3): 73.0,
    }  # fmt: skip
    rows = evaluate_claims(
        [parse_claim("A > B > C"), parse_claim("A > D")],
        ["col"], {"col": "a column"}, [0, 1, 2, 3],
        value=lambda c, m, s, metric: finals[(m, s)],
        available=lambda c, m: m != "D",
        why_missing=lambda c, m, s: "diverged after round 4" if (m, s) == ("B", 2) else None,
    )  # fmt: skip
    chain, absent = rows
    ab, bc = chain["links"]
    # A - B on seeds 0, 1, 3: d = (2, 3, 4): mean 3, std 1, [3 -/+ 4.303 / sqrt(3)] = [0.516, 5.484]
    assert ab.interval.n == 3 and ab.a_values == {0: 80.0, 1: 82.0, 3: 84.0}
    assert (ab.interval.low, ab.interval.high) == (pytest.approx(0.5157, abs=1e-3), pytest.approx(5.4843, abs=1e-3))
    assert ab.verdict == HOLDS and ab.left_out == ["seed 2: B diverged after round 4"]
    # B - C on the same three seeds: d = (8, 8, 7): holds
    assert bc.interval.n == 3 and bc.verdict == HOLDS and chain["verdict"] == HOLDS
    assert chain["means"]["A"]["mean"] == pytest.approx(81.75) and chain["means"]["B"]["mean"] == pytest.approx(79.0)
    assert absent["verdict"] == "not run" and "D" in absent["why"]


def test_a_reproduce_preset_prints_and_writes_its_claims(tmp_path, capsys):
    preset = {
        "name": "claims_demo", "title": "claims on digits", "source": "test", "paper_rounds": 2,
        "base": {
            "clients_per_round": 3, "dataset": {"name": "digits"}, "partition": {"num_clients": 6, "scheme": "iid"},
            "local": {"epochs": 1, "batch_size": 32, "lr": 0.05}, "run": {"figures": False, "progress": False, "threads": 1},
        },
        "columns": {"iid": {"label": "digits iid"}},
        "methods": {
            "FedAvg": {"config": {"algorithm": {"name": "fedavg"}}},
            "FedProx mu=0": {"config": {"algorithm": {"name": "fedprox", "mu": 0.0}}},
            "Frozen": {"config": {"algorithm": {"name": "fedavg"}, "local": {"lr": 1.0e-9}}},
        },
        "claims": [
            {"claim": "FedAvg > Frozen", "paper": "a model that trains beats one that does not"},
            {"claim": "FedProx mu=0 ~ FedAvg", "margin": 0.5, "note": "FedProx with mu 0 is FedAvg step for step"},
            {"claim": "FedAvg < Frozen", "metric": "mb"},
        ],
    }  # fmt: skip
    path = tmp_path / "claims_demo.yaml"
    path.write_text(yaml.safe_dump(preset, sort_keys=False, allow_unicode=True))
    reproduce(load_preset(str(path)), tmp_path / "out", rounds=2, seeds=[0, 1, 2])
    records = json.loads((tmp_path / "out" / "claims_demo" / "claims.json").read_text())
    trains, same, traffic = records
    assert trains["verdict"] == HOLDS and trains["links"][0]["n"] == 3
    # identical runs: every paired difference 0, the interval [0, 0] inside any margin
    assert same["verdict"] == HOLDS and same["links"][0]["ci95_low"] == 0.0 == same["links"][0]["ci95_high"]
    assert traffic["verdict"] == INCONCLUSIVE  # equal traffic: the interval [0, 0] is not below 0
    table = (tmp_path / "out" / "claims_demo" / "table.md").read_text()
    assert table.index("## Claims") < table.index("## digits iid")  # the verdicts lead the table
    assert "| FedAvg > Frozen | digits iid | final accuracy |" in table and "**holds**" in table
    out = " ".join(capsys.readouterr().out.split())
    assert "claims (paired over seeds" in out and "FedProx mu=0 ~ FedAvg" in out


def test_a_claim_naming_an_unknown_method_or_column_is_refused_at_load(tmp_path):
    base = {
        "name": "bad", "title": "t", "source": "s", "paper_rounds": 1, "base": {},
        "columns": {"iid": {"label": "iid"}}, "methods": {"FedAvg": {"config": {}}},
    }  # fmt: skip
    for claims, message in [
        ([{"claim": "FedAvg > FedLMD"}], "names methods FedLMD the preset does not have"),
        ([{"claim": "FedAvg ~ FedAvg2", "margin": 1}], "names methods FedAvg2"),
        ([{"claim": "FedAvg > FedAvg"}], "appears twice"),
        ([{"claim": "FedAvg > X", "columns": ["cifar"]}], "names methods X"),
        ([{"claim": "FedAvg > FedAvg", "metric": "acc"}], "metric 'acc'"),
        ([{"claim": "FedAvg > B", "unknown_key": 1}], "claims.0.unknown_key"),
    ]:
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump({**base, "claims": claims}))
        with pytest.raises(ConfigError, match=message):
            load_preset(str(path))
    base["methods"]["B"] = {"config": {}}
    path.write_text(yaml.safe_dump({**base, "claims": [{"claim": "FedAvg > B", "columns": ["cifar"]}]}))
    with pytest.raises(ConfigError, match="names columns cifar"):
        load_preset(str(path))


def test_run_values_of_each_metric():
    from fedistill.report.claims import run_value
    from fedistill.studies.reproduce import RunResult

    run = RunResult("c", "A", 0, [(r, float(a)) for r, a in enumerate([10, 50, 40, 60, 70, 20, 30], 1)], 2.5,
                    bytes_per_round=3_000_000.0)  # fmt: skip
    assert run_value(run, "final") == 30.0 and run_value(run, "best") == 70.0
    assert run_value(run, "last5") == pytest.approx((40 + 60 + 70 + 20 + 30) / 5)  # rounds 3-7
    assert run_value(run, "mb") == 3.0 and run_value(run, "seconds") == 2.5
    run.diverged_after = 7
    assert run_value(run, "final") is None and run_value(run, "last5") is None and run_value(run, "mb") == 3.0


def test_the_seeds_cell_counts_the_claimed_side_of_each_relation():
    """An 'A < B' claim (FedICT's traffic) is met by the seeds where A is below B: '3/3 A ahead' there read as
    the opposite of what the numbers say (issue 25's homogeneous FedICT run printed it for 3,013 MB vs 0.87)."""
    mb = {("FedICT", 0): 3013.2, ("FedICT", 1): 3013.2, ("FedAvg", 0): 0.87, ("FedAvg", 1): 0.87,
          ("Small", 0): 0.5, ("Small", 1): 0.9}  # fmt: skip
    rows = evaluate_claims(
        [parse_claim("FedICT < FedAvg"), parse_claim("Small < FedAvg"), parse_claim("FedICT > FedAvg")],
        ["col"], {"col": "a column"}, [0, 1],
        value=lambda c, m, s, metric: mb[(m, s)], available=lambda c, m: True, why_missing=lambda c, m, s: None,
    )  # fmt: skip
    cells = [claim_cells(row)["seeds"] for row in rows]
    # Wilcoxon, by hand: FedICT - FedAvg = (+3012.33, +3012.33), tied ranks 1.5 and 1.5, W+ = 3, the largest of
    # the 4 sign patterns' W+ (0, 1.5, 1.5, 3): P(W+ >= 3) = 1/4, two-sided 0.5. Small - FedAvg = (-0.37, +0.03):
    # ranks 2 and 1, W+ = 1, P(W+ <= 1) = 2/4 (patterns 0, 1, 2, 3), two-sided 1.
    assert cells == [
        "2 (0/2 FedICT below; Wilcoxon p=0.50)", "2 (1/2 Small below; Wilcoxon p=1.00)", "2 (2/2 FedICT ahead; Wilcoxon p=0.50)",
    ]  # fmt: skip
    assert rows[0]["verdict"] == DOES_NOT_HOLD and rows[2]["verdict"] == HOLDS
    # an 'A ~ B' claim counts the seeds within its margin: Small - FedAvg is -0.37 and +0.03 MB
    (close,) = evaluate_claims(
        [parse_claim("Small ~ FedAvg", "final", 0.1)], ["col"], {"col": "a column"}, [0, 1],
        value=lambda c, m, s, metric: mb[(m, s)], available=lambda c, m: True,
    )  # fmt: skip
    assert claim_cells(close)["seeds"] == "2 (1/2 within ±0.1)"


def test_claims_vs_leaderboard_pairs_verdicts_and_skips_rows_never_run(tmp_path, capsys):
    """benchmarks/claims_vs_leaderboard.py: a leaderboard claim beside the same claim on a paper protocol, matched by
    methods (case, punctuation and a parenthesised variant ignored) and metric. One that holds beside one that does
    not hold is a disagreement; a paper row that never ran is left out rather than printed as an empty pair."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "claims_vs_leaderboard.py"
    spec = importlib.util.spec_from_file_location("claims_vs_leaderboard", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def record(claim, setting, verdict, metric="final"):
        return {"claim": claim, "setting": setting, "metric": metric, "verdict": verdict, "links": []}

    suite = tmp_path / "suite.json"
    suite.write_text(json.dumps([record("dafkd > fedavg", "shards", "holds"), record("fedict < fedavg", "shards", "holds", "mb")]))
    papers = tmp_path / "papers.json"
    papers.write_text(json.dumps([
        record("DaFKD > FedAvg", "MNIST", "does not hold"),
        record("DaFKD (sweep) > FedAvg", "MNIST", "not run"),
        record("DaFKD > FedAvg", "Fashion-MNIST", "inconclusive"),
        record("DaFKD > FedAvg", "Fashion-MNIST", "holds", metric="last5"),
    ]))  # fmt: skip
    assert module.main([str(suite), str(papers)]) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert len(rows) == 3, rows  # the never-run row and the other metric's row are not paired
    assert rows[0].endswith("| disagree |") and "MNIST: does not hold" in rows[0]
    assert rows[1].endswith("| differ |") and "Fashion-MNIST: inconclusive" in rows[1]
    assert "not tested on a paper protocol" in rows[2]
