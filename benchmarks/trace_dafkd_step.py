"""One DaFKD server step replayed epoch by epoch (issue 61, card ambiguity 21): the student's test accuracy, its
feature norm and logit spread on real test images and on the generated batch, and how far its weights moved, under
the distillation optimiser given (--opt adam|sgd, --lr, --epochs; --anchor adds an L2 pull towards ŵ).

    PYTHONPATH=src python benchmarks/trace_dafkd_step.py DUMP.pt --opt sgd --lr 0.01 [--save FLAT.pt]

DUMP.pt is a `diagnose_dafkd.py --dump-rounds` file; --save keeps the distilled student's flat vector for
`replay_dafkd_next_clients.py --start-file` and `dafkd_feature_subspace.py`.
"""
import argparse, json, math
import torch
from fedistill.config import build_config, parse_override
from fedistill.models.flat import set_flat, get_flat
from fedistill.protocol import Message, RoundInfo
from fedistill.runner import load_dataset_for
from fedistill.simulation import Simulation
from fedistill.engine.evaluation import autocast_context
from fedistill.algorithms.dafkd import distillation_target, once
from fedistill.losses import domain_aware_distillation

ap = argparse.ArgumentParser()
ap.add_argument("dump"); ap.add_argument("--set", action="append", default=[])
ap.add_argument("--opt", default="adam"); ap.add_argument("--lr", type=float, default=None)
ap.add_argument("--epochs", type=int, default=None); ap.add_argument("--save", default=None)
ap.add_argument("--anchor", type=float, default=0.0, help="L2 pull towards the aggregate")
a = ap.parse_args()
dump = torch.load(a.dump, weights_only=False)
cfg = build_config(dump["config"], dict(parse_override(o) for o in ["run.progress=false", "run.threads=1", "run.workers=1", *a.set]))
sim = Simulation(cfg, load_dataset_for(cfg))
rt, alg = sim.server_runtime, sim.algorithm
server = rt.server
set_flat(server.model, dump["aggregate"])
server.state.clear(); server.state.update({k: (v.clone() if torch.is_tensor(v) else v) for k, v in dump["server_state"].items()})
replies = [Message(r) for r in dump["replies"]]
p = alg.params
x = alg.server_distill_inputs(server, dump["round"])
agg = once(lambda: alg.aggregate_logits(server, x))
log_target = distillation_target(alg.teacher_target(server, x, replies, agg if p.teacher_scale != "raw" else None),
                                 lambda: torch.log_softmax(agg() / p.temperature, dim=1), p.target_prior)
test = rt.test_pipeline
xt = torch.cat([xb for xb, _ in test.test_batches(500)]); yt = torch.cat([yb for _, yb in test.test_batches(500)])
dev = torch.device("cpu"); model = server.model
def ev(inp, labels=None):
    was = model.training; model.eval()
    with torch.no_grad(), autocast_context(cfg.run.precision, dev):
        f = model.extract(inp); z = model.classify(f).float(); f = f.float()
    model.train(was)
    out = dict(spread=round(float((z.max(1).values - z.min(1).values).mean()), 2), feat=round(float(f.norm(dim=1).mean()), 2))
    if labels is not None: out["acc"] = round(100 * float((z.argmax(1) == labels).float().mean()), 2)
    return out
w0 = get_flat(model).clone()
params = [q for q in model.parameters()]
anchor = [q.detach().clone() for q in params]
lr = a.lr if a.lr is not None else p.distill_lr
opt = torch.optim.Adam(params, lr=lr) if a.opt == "adam" else torch.optim.SGD(params, lr=lr, momentum=0.9)
plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=p.plateau_factor, patience=p.plateau_patience)
print(json.dumps({"epoch": 0, "real": ev(xt, yt), "gen": ev(x), "target_top_share": float(torch.bincount(log_target.argmax(1), minlength=10).max()) / x.shape[0]}), flush=True)
model.train(not p.freeze_student_bn_stats)
for epoch in range(a.epochs or p.distill_epochs):
    tot = 0.0
    for s in range(0, x.shape[0], p.distill_batch_size):
        xb, tb = x[s:s + p.distill_batch_size], log_target[s:s + p.distill_batch_size]
        with autocast_context(cfg.run.precision, dev):
            logits = model(xb)
        loss = domain_aware_distillation(logits, tb, p.temperature, p.kd_reduction)
        if a.anchor:
            loss = loss + a.anchor * sum(((q - q0) ** 2).sum() for q, q0 in zip(params, anchor))
        opt.zero_grad(); loss.backward(); opt.step(); tot += float(loss) * xb.shape[0]
    plateau.step(tot / x.shape[0])
    if epoch % 4 == 3 or epoch < 2:
        print(json.dumps({"epoch": epoch + 1, "loss": round(tot / x.shape[0], 4), "real": ev(xt, yt), "gen": ev(x), "dist": round(float((get_flat(model) - w0).norm()), 3)}), flush=True)
if a.save: torch.save(get_flat(model).clone(), a.save)
