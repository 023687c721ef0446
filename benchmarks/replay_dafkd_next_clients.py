"""The next round's clients from a DaFKD server step's student (issue 61, card ambiguity 21): round R+1's clients
(the ids of NEXT_DUMP) trained CE-only on the run's local SGD from ŵ_R, from the distilled w_R of DUMP, or from a
saved flat vector, each client's test accuracy, logit spread and feature norm, and their n-weighted average's.

    PYTHONPATH=src python benchmarks/replay_dafkd_next_clients.py DUMP_R.pt DUMP_R+1.pt [--starts aggregate distilled]
        [--start-file FLAT.pt] [--clip NORM]

Round 4's dump of MNIST α = 0.05 seed 1: the average is 27.9 % from ŵ, 9.8 % from Adam's student, 28.9 % from SGD's.
"""
import argparse, json
import torch
from fedistill.config import build_config, parse_override
from fedistill.models.flat import set_flat, get_flat
from fedistill.runner import load_dataset_for
from fedistill.simulation import Simulation
from fedistill.engine.evaluation import autocast_context

ap = argparse.ArgumentParser()
ap.add_argument("dump"); ap.add_argument("next_dump")
ap.add_argument("--starts", nargs="*", default=["aggregate", "distilled"])
ap.add_argument("--start-file", default=None)
ap.add_argument("--clip", type=float, default=None)
a = ap.parse_args()
dump = torch.load(a.dump, weights_only=False)
cids = torch.load(a.next_dump, weights_only=False)["cids"]
cfg = build_config(dump["config"], dict(parse_override(o) for o in ["run.progress=false", "run.threads=1", "run.workers=1"]))
sim = Simulation(cfg, load_dataset_for(cfg))
rt = sim.client_runtime
test = sim.server_runtime.test_pipeline
xt = torch.cat([xb for xb, _ in test.test_batches(500)]); yt = torch.cat([yb for _, yb in test.test_batches(500)])
dev = torch.device("cpu")
def evaluate(model):
    model.eval()
    with torch.no_grad(), autocast_context(cfg.run.precision, dev):
        f = model.extract(xt).float(); z = model.classify(f.to(torch.bfloat16) if cfg.run.precision == "bf16" else f).float()
    model.train()
    return dict(acc=round(100 * float((z.argmax(1) == yt).float().mean()), 2), spread=round(float((z.max(1).values - z.min(1).values).mean()), 2), feat=round(float(f.norm(dim=1).mean()), 2))
starts = {s: dump[s] for s in a.starts}
if a.start_file:
    starts["file"] = torch.load(a.start_file)
for name, w in starts.items():
    total, vecs, ns = None, [], []
    for cid in cids:
        ctx = rt.context(cid, dump["round"] + 1, {})
        model = ctx.model; set_flat(model, w)
        opt = torch.optim.SGD(model.parameters(), lr=cfg.local.lr, momentum=cfg.local.momentum, weight_decay=cfg.local.weight_decay)
        model.train()
        for epoch in range(cfg.local.epochs):
            for x, y in ctx.data.epoch_batches(ctx.train_indices, cfg.local.batch_size, ctx.generator):
                with autocast_context(cfg.run.precision, dev):
                    loss = torch.nn.functional.cross_entropy(model(x).float(), y)
                opt.zero_grad(); loss.backward()
                if a.clip: torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
                opt.step()
        vecs.append(get_flat(model).double()); ns.append(ctx.train_indices.numel())
        print(json.dumps({"start": name, "cid": cid, "n": ns[-1], **evaluate(model)}), flush=True)
    n = torch.tensor(ns, dtype=torch.float64)
    avg = (torch.stack(vecs) * (n / n.sum())[:, None]).sum(0).float()
    set_flat(model, avg)
    print(json.dumps({"start": name, "AVERAGE": True, "start_eval": None, **evaluate(model)}), flush=True)
    set_flat(model, w); print(json.dumps({"start": name, "START": True, **evaluate(model)}), flush=True)
