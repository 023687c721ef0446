"""Plugins: a method, dataset, model or partition of one's own, registered from outside the package (issue 27).

A plugin is a Python file or an importable module that registers what it defines with ``fedistill.register_*``
when imported. Three ways in, all loaded before a configuration is validated:

- ``fedistill run --plugin my_method.py`` (or a module name; repeatable, also on ``reproduce`` and ``list``);
- ``$FEDISTILL_PLUGINS``: the same entries separated by ``os.pathsep``. ``--plugin`` adds to it, so that worker
  processes (``run.workers``) and anything else started from the run import the same plugins;
- an installed package's entry point in the group ``fedistill.plugins`` (``[project.entry-points."fedistill.plugins"]
  my_method = "my_package.my_method"``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

from .errors import ConfigError
from .registry import NameTaken, registering_for

PLUGIN_ENV = "FEDISTILL_PLUGINS"
ENTRY_POINT_GROUP = "fedistill.plugins"
_loaded: set[str] = set()


def add_plugins(entries: list[str]) -> None:
    """Load ``entries`` now and pass them on to child processes through ``$FEDISTILL_PLUGINS``."""
    current = [e for e in os.environ.get(PLUGIN_ENV, "").split(os.pathsep) if e]
    for entry in entries:
        resolved = str(Path(entry).resolve()) if entry.endswith(".py") else entry
        if resolved not in current:
            current.append(resolved)
    os.environ[PLUGIN_ENV] = os.pathsep.join(current)
    load_plugins()


def load_plugins() -> None:
    """Import every plugin of ``$FEDISTILL_PLUGINS`` and of the installed entry points (each once per process)."""
    for entry in (e for e in os.environ.get(PLUGIN_ENV, "").split(os.pathsep) if e):
        _load(entry, f"plugin {entry}")
    for name, value in _installed_entry_points():
        _load(value, f"plugin {name} (entry point {value} of an installed package)")


@functools.lru_cache(maxsize=1)
def _installed_entry_points() -> tuple[tuple[str, str], ...]:
    """The installed packages' fedistill entry points as (name, value), read once per process: the scan reads the
    metadata of every installed distribution (2-4 ms in the test environment) and ``load_plugins`` runs on every
    config built: thousands of times in the test suite, about 2 % of its CPU. A package installed while a process
    runs is seen by the next process."""
    return tuple((point.name, point.value) for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def _register_builtins() -> None:
    """Register fedistill's own names first. They are otherwise registered when first needed, which can be
    after a plugin's import: a plugin that took ``mlp`` would then succeed and fedistill's own ``mlp`` fail
    with a traceback, instead of the plugin being refused with its name."""
    from . import algorithms as _algorithms  # noqa: F401
    from . import models as _models  # noqa: F401  (generators included)
    from .data import partition as _partition  # noqa: F401
    from .data import sources as _sources  # noqa: F401


def _load(entry: str, what: str) -> None:
    if entry in _loaded:
        return
    _register_builtins()
    _loaded.add(entry)  # before importing: a plugin that fails is reported once, not on every config
    try:
        if entry.endswith(".py"):
            path = Path(entry)
            if not path.is_file():
                raise ConfigError(f"{what}: no such file (give the path of a .py file or an importable module name)")
            name = f"fedistill_plugin_{path.stem}"
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # pickling a plugin class (worker processes) finds its module
            with registering_for(what):
                spec.loader.exec_module(module)
        else:
            with registering_for(what):
                importlib.import_module(entry.split(":")[0])
    except ConfigError:
        _loaded.discard(entry)
        raise
    except NameTaken as exc:  # say which plugin clashes with what, not "importing it failed"
        raise ConfigError(
            f"{what} registers {exc.kind} {exc.name!r}, which is already taken (by {exc.owner}); rename it"
        ) from exc
    except Exception as exc:  # the plugin's own code failed: say which plugin, in one line
        raise ConfigError(f"{what}: importing it failed: {type(exc).__name__}: {exc}") from exc
