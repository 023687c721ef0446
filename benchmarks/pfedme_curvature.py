"""Top Hessian eigenvalue of the cross-entropy of a bench cell's CNN on a 32-image batch of two classes (power
iteration on Hessian-vector products, fp32), at initialisation and along plain SGD on that batch: is it above pFedMe's
stability limit 2/eta_p - lambda (7.2 at eta_p 0.09, lambda 15; 185 at eta_p 0.01)? See RESULTS.md "pFedMe diverged".

    python benchmarks/pfedme_curvature.py BENCH/fd-mnist/shards_2/pfedme/seed1/config.yaml ../shared/data
"""
import sys
import torch
import torch.nn.functional as F
from fedistill.config import build_config, parse_override, read_yaml
from fedistill.runner import load_dataset_for
from fedistill.simulation import Simulation

torch.set_num_threads(1)
torch.manual_seed(0)  # the power iteration's start vector
cfg = build_config(read_yaml(sys.argv[1]), dict(parse_override(o) for o in [f"dataset.data_dir={sys.argv[2]}", "run.precision=fp32"]))
sim = Simulation(cfg, load_dataset_for(cfg))
model = sim.server.model.float()
x, y = sim.server_runtime.test_pipeline.clean_batch(torch.arange(2000))
pick = torch.nonzero((y == 3) | (y == 8)).flatten()[:32]
x, y = x[pick].float(), y[pick]
params = [p for p in model.parameters() if p.requires_grad]

def top_eigenvalue(iters=30):
    v = [torch.randn_like(p) for p in params]
    lam = 0.0
    for _ in range(iters):
        norm = torch.sqrt(sum((t * t).sum() for t in v))
        v = [t / norm for t in v]
        loss = F.cross_entropy(model(x), y)
        grads = torch.autograd.grad(loss, params, create_graph=True)
        hv = torch.autograd.grad(sum((g * t).sum() for g, t in zip(grads, v)), params)
        lam = float(sum((h * t).sum() for h, t in zip(hv, v)))
        v = [h.detach() for h in hv]
    return lam

model.train()
opt = torch.optim.SGD(params, lr=0.01)
for step in range(0, 101):
    if step in (0, 10, 50, 100):
        with torch.no_grad():
            loss = F.cross_entropy(model(x), y).item()
        print(f"SGD step {step}: loss {loss:.3f}, top Hessian eigenvalue {top_eigenvalue():.1f}", flush=True)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
