"""The public Python API: what ``import fedistill`` offers (issue 27). Small and stable; everything else is internal.

    import fedistill
    result = fedistill.run("configs/digits_fedavg.yaml", rounds=5, local={"lr": 0.01}, out_dir="runs")
    result.final_accuracy, result.history[-1], result.run_dir
    again = fedistill.load_run(result.run_dir)

Extension points: subclass :class:`fedistill.Algorithm` and decorate it with ``@fedistill.register_algorithm("name")``
(likewise ``register_dataset``, ``register_model``, ``register_partition``); the name is then valid in any config.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

from .config import Config, build_config, find_config, read_yaml
from .errors import ConfigError
from .registry import ALGORITHMS, DATASETS, MODELS, PARTITIONS

T = TypeVar("T", bound=Callable[..., Any])

# Top-level keyword overrides that are run settings, not config sections: fedistill.run(..., out_dir="x", name="y").
_RUN_SHORTCUTS = {"out_dir": "run.out_dir", "name": "run.name", "threads": "run.threads", "workers": "run.workers"}


@dataclass
class RunResult:
    """A finished run: its summary (``summary.json``), its per-round metric rows (``metrics.jsonl``), its directory
    and its resolved configuration."""

    summary: dict[str, Any]
    history: list[dict[str, Any]]
    run_dir: Path
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def final_accuracy(self) -> float | None:
        """The last round's accuracy in percent (global, or personal for methods without a global model)."""
        return self.summary.get("final_accuracy")

    @property
    def best_accuracy(self) -> float | None:
        return self.summary.get("best_accuracy")


def _tree(config: Config | Mapping[str, Any] | str | Path | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, Config):
        return config.to_dict()
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, Path)):
        return read_yaml(find_config(str(config)))
    raise ConfigError(f"fedistill.run: config must be a Config, a dict or a YAML path, not {type(config).__name__}")


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    """``{"a": {"b": 1}}`` under ``prefix`` as ``prefix.a.b = 1`` (an empty mapping stays a value)."""
    if isinstance(value, Mapping) and value:
        for key, sub in value.items():
            _flatten(f"{prefix}.{key}", sub, out)
    else:
        out[prefix] = value


def make_config(config: Config | Mapping[str, Any] | str | Path | None = None, **overrides: Any) -> Config:
    """The validated :class:`Config` of ``config`` (a Config, a dict tree, a YAML path or a shipped config's name)
    with ``overrides`` on top: ``rounds=5``, nested sections as dicts (``local={"lr": 0.01}``) or with ``__`` for the
    dot (``local__lr=0.01``), ``algorithm="fedprox"`` or ``algorithm={"name": "fedprox", "mu": 0.01}``, and the run
    shortcuts ``out_dir``, ``name``, ``threads``, ``workers``. Errors are :class:`fedistill.ConfigError`."""
    dotted: dict[str, Any] = {}
    for key, value in overrides.items():
        key = _RUN_SHORTCUTS.get(key, key.replace("__", "."))
        _flatten(key, value, dotted)
    return build_config(_tree(config), dotted)


def run(config: Config | Mapping[str, Any] | str | Path | None = None, /, *, verbose: bool = False, **overrides: Any) -> RunResult:
    """Run an experiment in this process and return its :class:`RunResult` (see :func:`make_config` for
    ``config`` and ``overrides``). Silent unless ``verbose``: the per-round lines and the summary table go
    nowhere, the run directory gets everything as with ``fedistill run``."""
    from rich.console import Console

    from .runner import make_console, run_experiment

    cfg = make_config(config, **overrides)
    if not verbose:
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"progress": False})})
    console = make_console() if verbose else Console(file=io.StringIO(), width=120)
    summary = run_experiment(cfg, console=console, quiet=not verbose)
    return load_run(summary["run_dir"])


def load_run(path: str | Path) -> RunResult:
    """A run directory written by :func:`run` or ``fedistill run`` (finished, diverged or interrupted)."""
    from .report.rundir import read_run

    config, rows, summary = read_run(path)
    return RunResult(summary=summary, history=rows, run_dir=Path(path), config=config)


def compare(paths: list[str | Path], out: str | Path = "compare.png", target: float | None = None) -> Path:
    """``fedistill compare`` from Python: overlaid accuracy curves of run directories and seed groups written
    to ``out`` (png, pdf or svg); returns its path. Silent."""
    from rich.console import Console

    from .runner import compare_runs

    compare_runs([str(p) for p in paths], Path(out), target, console=Console(file=io.StringIO(), width=120))
    return Path(out)


def register_algorithm(name: str, help: str = "") -> Callable[[T], T]:
    """Class decorator: a :class:`fedistill.Algorithm` subclass becomes ``algorithm.name: NAME``. Give it a
    ``Params`` (a pydantic :class:`fedistill.AlgorithmParams`) for its parameters; ``name`` is set for it."""

    def decorator(cls: T) -> T:
        if "name" not in vars(cls):  # a subclass of a registered method would otherwise carry its parent's name
            cls.name = name  # type: ignore[attr-defined]
        return ALGORITHMS.register(name, help)(cls)

    return decorator


def register_dataset(name: str, help: str = "") -> Callable[[T], T]:
    """Function decorator: ``loader(root, download=False, verify=True) -> fedistill.data.dataset.Dataset``
    becomes ``dataset.name: NAME``."""
    return DATASETS.register(name, help)


def register_model(name: str, help: str = "") -> Callable[[T], T]:
    """Function decorator: ``factory(input_shape, num_classes, **kwargs) -> ClassifierModel`` becomes
    ``model.name: NAME``."""
    return MODELS.register(name, help)


def register_partition(name: str, help: str = "") -> Callable[[T], T]:
    """Function decorator for a partition scheme (see ``shards`` in fedistill/data/partition.py for the
    signature) that becomes ``partition.scheme: NAME``."""
    return PARTITIONS.register(name, help)
