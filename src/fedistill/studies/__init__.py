"""The experiment layer: studies made of many runs, above the composition roots that make one run.

- ``reproduce.py``: a preset (``configs/reproduce/*.yaml``) is columns x methods x seeds of runs, with the
  paper's table beside ours and the preset's claims judged over the seeds (``fedistill reproduce``);
  ``reproduce_tables.py`` writes its tables.
- ``bench.py``: a leaderboard suite (``configs/bench/*.yaml``) is settings x methods x seeds with FLOPs and time
  per cell (``fedistill bench``); ``bench_results.py`` turns the cells into the leaderboard, ``bench_rank.py``
  ranks a method of your own against the published cells.

Nothing below this layer imports it (tests/test_architecture.py).
"""
