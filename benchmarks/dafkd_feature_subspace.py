"""Where a DaFKD server step moved the features (issue 61, card ambiguity 21): the change of the student's features
on real test images, split into the part the aggregate's head sees (its row space) and the part it does not (its
null space), for the dump's distilled model and any saved flat vectors.

    PYTHONPATH=src python benchmarks/dafkd_feature_subspace.py DUMP.pt [NAME=FLAT.pt ...]

DUMP.pt is a `diagnose_dafkd.py --dump-rounds` file (its "aggregate" ŵ and "distilled" w); FLAT.pt a flat vector
saved by `trace_dafkd_step.py --save`.
"""
import json
import sys

import torch

from fedistill.config import build_config, parse_override
from fedistill.models.flat import set_flat
from fedistill.runner import load_dataset_for
from fedistill.simulation import Simulation

dump = torch.load(sys.argv[1], weights_only=False)
cfg = build_config(dump["config"], dict(parse_override(o) for o in ["run.progress=false", "run.threads=1", "run.workers=1"]))
sim = Simulation(cfg, load_dataset_for(cfg))
model = sim.server_runtime.server.model.float().eval()
xt = torch.cat([xb for xb, _ in sim.server_runtime.test_pipeline.test_batches(500)])[:2000].float()
set_flat(model, dump["aggregate"])
with torch.no_grad():
    before = model.extract(xt)
head_rows, _ = torch.linalg.qr(model.classifier.weight.detach().T)  # orthonormal basis of the head's row space
steps = {"distilled (dump)": dump["distilled"]}
steps.update({arg.partition("=")[0]: torch.load(arg.partition("=")[2]) for arg in sys.argv[2:]})
for name, flat in steps.items():
    set_flat(model, flat)
    with torch.no_grad():
        moved = model.extract(xt) - before
    visible = moved @ head_rows @ head_rows.T
    print(json.dumps({
        "step": name,
        "feature_norm_before": round(float(before.norm(dim=1).mean()), 2),
        "feature_norm_after": round(float((before + moved).norm(dim=1).mean()), 2),
        "change_in_head_row_space": round(float(visible.norm(dim=1).mean()), 2),
        "change_in_head_null_space": round(float((moved - visible).norm(dim=1).mean()), 2),
    }))
