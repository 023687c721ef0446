"""Summaries of a run's history: personalised-accuracy rows and quantiles, and the final/best/rounds-to-target
summary the CLI, reproduce and the Flower server print."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..protocol import EVAL_PREFIX, Message

PERSONAL_QUANTILES = {"min": 0.0, "q1": 0.25, "median": 0.5, "q3": 0.75, "max": 1.0}


def _personal_row(accuracies: dict[int, float], correct: int, count: int) -> dict[str, Any]:
    """The personal metrics of one evaluation: ``accuracies`` per client (%), and ``correct`` of ``count`` test
    samples over the same clients."""
    cids = sorted(accuracies)
    values = torch.tensor([accuracies[c] for c in cids], dtype=torch.float64)
    row: dict[str, Any] = {"personal_accuracy": float(values.mean())}  # unweighted over clients (avg UA)
    # The clients' test samples pooled: correct over all of them, each client weighted by its test size (HtFLlib's
    # and FedProx's reported accuracy), beside the mean over clients.
    row["personal_pooled_accuracy"] = 100.0 * correct / count
    for name, q in PERSONAL_QUANTILES.items():
        row[f"personal_{name}"] = float(torch.quantile(values, q))
    row["personal_clients"] = cids
    row["personal_accuracies"] = [float(v) for v in values]
    return row


def personal_metrics(correct_by_client: Mapping[int, torch.Tensor]) -> dict[str, Any]:
    """avg UA and its spread over clients (experiments-fedict.md §6) from per-sample correctness.

    ``personal_accuracy`` is the unweighted mean of the clients' accuracies (%), as the paper's np.mean;
    the quartiles show how differently the clients fare; ``personal_pooled_accuracy`` is the share of all the
    clients' test samples that are right. Clients with an empty test split are left out.
    """
    held = {cid: c for cid, c in correct_by_client.items() if c.numel()}
    accuracies = {cid: 100.0 * float(c.double().mean()) for cid, c in held.items()}
    correct = sum(int(c.sum()) for c in held.values())
    count = sum(int(c.numel()) for c in held.values())
    return _personal_row(accuracies, correct, count) if accuracies else {}


def personal_metrics_of_ranges(correct: torch.Tensor, offsets: Any) -> dict[str, Any]:
    """:func:`personal_metrics` where client k's test samples are the contiguous range ``offsets[k]:offsets[k+1]``
    of ``correct`` (the synthetic federation's held-out set, sorted by client): one cumulative sum instead of
    one index tensor per client, so that 100,000 clients cost O(test set) per evaluation."""
    offsets = torch.as_tensor(offsets, dtype=torch.int64)
    totals = torch.cat([torch.zeros(1, dtype=torch.int64), correct.to(torch.int64).cumsum(0)])
    hits, counts = totals[offsets[1:]] - totals[offsets[:-1]], offsets[1:] - offsets[:-1]
    present = torch.nonzero(counts > 0).flatten()
    shares = 100.0 * hits[present].double() / counts[present].double()
    accuracies = dict(zip(present.tolist(), shares.tolist()))
    return _personal_row(accuracies, int(hits.sum()), int(counts.sum())) if accuracies else {}


def personal_metrics_from_counts(replies: Mapping[int, Message]) -> dict[str, Any]:
    """The same, from the correct/count reports clients attached to their replies (their own models)."""
    counts = {
        cid: (int(r[f"{EVAL_PREFIX}correct"]), int(r[f"{EVAL_PREFIX}count"]))
        for cid, r in replies.items()
        if int(r[f"{EVAL_PREFIX}count"]) > 0
    }
    accuracies = {cid: 100.0 * correct / count for cid, (correct, count) in counts.items()}
    correct, count = sum(c for c, _ in counts.values()), sum(n for _, n in counts.values())
    return _personal_row(accuracies, correct, count) if accuracies else {}


def summarise(history: list[dict[str, Any]], target: float | None, metric: str = "global") -> dict[str, Any]:
    """Final and best accuracy, round of best, rounds to target, totals (DESIGN.md "run directory").

    ``metric`` picks the accuracy: ``global`` (the global model on the test set) or ``personal`` (the
    clients' average accuracy on their own test splits, ``Config.accuracy_metric``).
    """
    key = "personal_accuracy" if metric == "personal" else "test_accuracy"
    evaluated = [r for r in history if r.get(key) is not None]
    best = max(evaluated, key=lambda r: r[key], default=None)
    reached = next((r["round"] for r in evaluated if target is not None and r[key] >= target), None)
    bytes_total = sum(r["bytes_down"] + r["bytes_up"] for r in history)
    weights_total = sum(r.get("bytes_weight_exchange") or 0 for r in history)
    summary = {
        "rounds": len(history),
        "accuracy_metric": metric,
        "final_accuracy": evaluated[-1][key] if evaluated else None,
        "final_loss": evaluated[-1].get("test_loss") if evaluated else None,
        "best_accuracy": best[key] if best else None,
        "best_round": best["round"] if best else None,
        "target_accuracy": target,
        "rounds_to_target": reached,
        "bytes_down": int(sum(r["bytes_down"] for r in history)),
        "bytes_up": int(sum(r["bytes_up"] for r in history)),
        "bytes_per_round": bytes_total / len(history) if history else None,
        # Bytes sent against what exchanging the clients' weights (FedAvg) would have cost in the same
        # rounds with the same clients and architectures: the FD papers' communication claim.
        "bytes_ratio_to_weight_exchange": bytes_total / weights_total if weights_total else None,
        "seconds": float(sum(r["seconds"] for r in history)),
        "mean_train_loss_last": history[-1]["train_loss"] if history else None,
        # Rounds at chance after an earlier round 20 points above it (engine/server.py's collapse rule, issue 61).
        "collapsed_rounds": sum(1 for r in history if r.get("collapse")),
    }
    personal = [r for r in history if r.get("personal_accuracy") is not None]
    if personal:
        last = personal[-1]
        summary["final_personal_accuracy"] = last["personal_accuracy"]
        summary["best_personal_accuracy"] = max(r["personal_accuracy"] for r in personal)
        summary["final_personal_spread"] = {name: last[f"personal_{name}"] for name in PERSONAL_QUANTILES}
        # mean of the last 10 evaluated rounds (experiments-fedict.md §6 asks for it next to the final value)
        tail = personal[-10:]
        summary["last10_personal_accuracy"] = sum(r["personal_accuracy"] for r in tail) / len(tail)
        pooled = [r["personal_pooled_accuracy"] for r in personal if r.get("personal_pooled_accuracy") is not None]
        if pooled:  # (rows written before the pooled value existed lack it)
            summary["final_personal_pooled_accuracy"] = pooled[-1]
            summary["best_personal_pooled_accuracy"] = max(pooled)
    return summary
