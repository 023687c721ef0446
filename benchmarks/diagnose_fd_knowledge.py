"""What a FedGKT-family server teaches its clients (issue 25's FedICT finding).

For each run directory given (FedGKT, FedDKC, FedICT; its last checkpoint): the share of each client's training
samples whose stored server knowledge Z_S (the logits sent back, fedgkt.md A4 / fedict.md A11) names the right
class, its mean softmax entropy at τ = 3 (log 10 = 2.30 is uniform) and its mean logit range.
A client distils from Z_S with weight β τ² (13.5 at the presets' β = 1.5, τ = 3) against 1 for its own CE, so
knowledge that is right less often than the client itself pulls the client down.

Usage: python benchmarks/diagnose_fd_knowledge.py RUN_DIR [RUN_DIR ...]
"""

import sys

import torch


def knowledge_stats(run_dir: str, temperature: float = 3.0) -> dict:
    checkpoint = torch.load(f"{run_dir}/checkpoint.pt", weights_only=False, map_location="cpu")
    state = checkpoint["server_state"]
    accuracy, entropy, spread = [], [], []
    for cid, logits in sorted(state["knowledge"].items()):
        labels = state["labels"][cid]
        accuracy.append(float((logits.argmax(1) == labels).float().mean()) * 100)
        p = torch.softmax(logits.float() / temperature, 1)
        entropy.append(float(-(p * p.clamp_min(1e-12).log()).sum(1).mean()))
        spread.append(float((logits.max(1).values - logits.min(1).values).mean()))
    n = len(accuracy)
    return {"round": checkpoint["round"], "accuracy_mean": sum(accuracy) / n, "accuracy_min": min(accuracy),
            "entropy": sum(entropy) / n, "logit_range": sum(spread) / n}  # fmt: skip


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print("| run | round | knowledge right, mean % | worst client % | entropy at τ=3 | logit range |")
    print("|---|---|---|---|---|---|")
    for run_dir in sys.argv[1:]:
        s = knowledge_stats(run_dir)
        print(f"| {run_dir} | {s['round']} | {s['accuracy_mean']:.1f} | {s['accuracy_min']:.1f} | {s['entropy']:.2f} | {s['logit_range']:.1f} |")


if __name__ == "__main__":
    main()
