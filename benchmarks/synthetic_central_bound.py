"""The best one linear model can do on FedProx's Synthetic(1, 1) with K clients: a logistic regression
trained centrally (Adam 0.01, 300 full-batch epochs) on N samples drawn from the pooled distribution
(clients in proportion to their sizes), tested on 10,000 more. Used in RESULTS.md "Scale" (c).

    PYTHONPATH=src python benchmarks/synthetic_central_bound.py K N
"""

import sys, numpy as np, torch
from fedistill.data.synthetic import SyntheticSpec, SyntheticClients
K = int(sys.argv[1]); N = int(sys.argv[2])
spec = SyntheticSpec(num_clients=K)
sizes = SyntheticClients(spec).sizes
rng = np.random.default_rng(123)
def pooled(n, split):
    owners = rng.choice(K, size=n, p=sizes / sizes.sum())
    ks, cs = np.unique(owners, return_counts=True)
    xs, ys = zip(*(spec.client_samples(int(k), int(c), split) for k, c in zip(ks, cs)))
    return torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))
xtr, ytr = pooled(N, "train"); xte, yte = pooled(10000, "test")
model = torch.nn.Linear(60, 10); opt = torch.optim.Adam(model.parameters(), lr=0.01)
for epoch in range(300):
    opt.zero_grad(); loss = torch.nn.functional.cross_entropy(model(xtr), ytr); loss.backward(); opt.step()
with torch.no_grad():
    acc = (model(xte).argmax(1) == yte).float().mean().item() * 100
    tr = (model(xtr).argmax(1) == ytr).float().mean().item() * 100
maj = np.bincount(yte.numpy(), minlength=10).max() / len(yte) * 100
print(f"K={K} N={N}: central logistic regression train {tr:.1f} % test {acc:.1f} % (majority class {maj:.1f} %)")
