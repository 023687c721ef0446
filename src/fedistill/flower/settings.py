"""The Flower run configuration keys fedistill reads, and how a fedistill Config travels in them.

A Flower App's run configuration (``[tool.flwr.app.config]`` in its ``pyproject.toml``, overridable with
``flwr run ... --run-config 'key=value'``) is a flat table of TOML scalars. fedistill reads these keys:

========================  =========  ====================================================================================
key                       default    meaning
========================  =========  ====================================================================================
``config-json``           ``""``     the fedistill configuration as inline JSON (``Config.to_dict()``)
``config-path``           ``""``     or a fedistill YAML file on the SuperLink machine (used when config-json is empty)
``overrides``             ``""``     ``key=value`` overrides on top, separated by spaces (``"rounds=5 local.lr=0.1"``)
``run-dir``               ``""``     the run directory; empty: ``run.out_dir/run.name`` (an automatic name if unset)
``resume``                ``false``  continue ``run-dir``: from its ``checkpoint.pt``, or from round 1 if it has none yet
``allow-numeric-change``  ``false``  with ``resume``: let run settings that change results differ from the checkpoint's
``round-timeout``         ``600.0``  seconds the server waits for the replies of one round
``min-fraction``          ``1.0``    a round completes if at least this fraction of its sampled clients replied ...
``min-replies``           ``1``      ... and at least this many; otherwise the run stops (RoundFailed)
``discovery-timeout``     ``120.0``  seconds to wait at the start for every client's SuperNode to connect
========================  =========  ====================================================================================

``allow-numeric-change`` covers run.precision, run.channels_last, run.device and the client thread count
(``run.threads``): a change of any of them makes the rest of the run differ from an uninterrupted one, so a
resume refuses it unless this key is true, and records it in the run directory's ``resumes.jsonl``.

The server sends the resolved configuration to every SuperNode in its first (discovery) message, so the
clients need no configuration file of their own.
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass
from typing import Any, Mapping

from ..config import Config, build_config, parse_override, read_yaml
from ..errors import ConfigError

DEFAULTS: dict[str, Any] = {
    "config-json": "",
    "config-path": "",
    "overrides": "",
    "run-dir": "",
    "resume": False,
    "allow-numeric-change": False,
    "round-timeout": 600.0,
    "min-fraction": 1.0,
    "min-replies": 1,
    "discovery-timeout": 120.0,
}


def _flag(values: Mapping[str, Any], key: str) -> bool:
    """A true/false run-config key; a string such as "false" is refused (bool("false") would be True)."""
    value = values[key]
    if not isinstance(value, bool):
        raise ConfigError(f"run config {key}: must be true or false (got {value!r}); write --run-config '{key}=true'")
    return value


@dataclass(frozen=True)
class FlowerSettings:
    config_json: str = ""
    config_path: str = ""
    overrides: str = ""
    run_dir: str = ""
    resume: bool = False
    allow_numeric_change: bool = False
    round_timeout: float = 600.0
    min_fraction: float = 1.0
    min_replies: int = 1
    discovery_timeout: float = 120.0

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> "FlowerSettings":
        unknown = sorted(k for k in run_config if k not in DEFAULTS)
        if unknown:
            raise ConfigError(
                f"run config: unknown key(s) {', '.join(unknown)} (fedistill reads: {', '.join(DEFAULTS)})"
            )
        values = {**DEFAULTS, **dict(run_config)}
        settings = cls(
            config_json=str(values["config-json"]),
            config_path=str(values["config-path"]),
            overrides=str(values["overrides"]),
            run_dir=str(values["run-dir"]),
            resume=_flag(values, "resume"),
            allow_numeric_change=_flag(values, "allow-numeric-change"),
            round_timeout=float(values["round-timeout"]),
            min_fraction=float(values["min-fraction"]),
            min_replies=int(values["min-replies"]),
            discovery_timeout=float(values["discovery-timeout"]),
        )
        if not settings.round_timeout > 0:
            raise ConfigError(f"run config round-timeout: must be > 0 seconds (got {settings.round_timeout})")
        if not 0 <= settings.min_fraction <= 1:
            raise ConfigError(f"run config min-fraction: must be in [0, 1] (got {settings.min_fraction})")
        if settings.min_replies < 0:
            raise ConfigError(f"run config min-replies: must be >= 0 (got {settings.min_replies})")
        if settings.allow_numeric_change and not settings.resume:
            raise ConfigError(
                "run config allow-numeric-change=true goes with resume=true (it lets a continued run change "
                "run.precision, run.threads, run.channels_last or run.device): "
                "--run-config 'resume=true run-dir=\"<run directory>\" allow-numeric-change=true'"
            )
        return settings

    def config(self) -> Config:
        """The fedistill Config: config-json, else config-path, else the defaults; then the overrides."""
        if self.config_json.strip():
            try:
                base = json.loads(self.config_json)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"run config config-json: not valid JSON ({exc.msg} at position {exc.pos})") from None
            if not isinstance(base, dict):
                raise ConfigError("run config config-json: must be a JSON object (Config.to_dict())")
        elif self.config_path.strip():
            base = read_yaml(self.config_path)
        else:
            base = {}
        overrides = [parse_override(item) for item in shlex.split(self.overrides)]
        return build_config(base, dict(overrides))

    def required_replies(self, sampled: int) -> int:
        """Replies a round of ``sampled`` clients needs in order to complete."""
        return min(sampled, max(self.min_replies, math.ceil(self.min_fraction * sampled - 1e-9)))


def with_client_threads(cfg: Config) -> Config:
    """``cfg`` with ``run.threads`` set to the count ``fedistill run`` would train each client with here.

    The thread count changes the order of floating-point reductions, so it decides whether a Flower run
    reproduces the simulation bit for bit. The ServerApp sends the run's configuration to the ClientApps,
    and they train with its ``run.threads``: resolving an unset value once (here, where the app is
    written or on the SuperLink) gives every client the count ``fedistill run`` of the same configuration
    uses on this machine, and records it in the run directory's config.yaml.
    """
    if cfg.run.threads is not None:
        return cfg
    from ..engine.cores import client_threads

    return build_config(cfg.to_dict(), {"run.threads": client_threads(cfg)})
