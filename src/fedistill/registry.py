"""Name -> factory registries (timm style) for datasets, models, generators, partitions and algorithms.

The CLI lists them (``fedistill list``) and the config resolves names through them, so an unknown name
is reported with the allowed choices instead of a KeyError from deep inside.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

from .errors import ConfigError

T = TypeVar("T", bound=Callable)


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._help: dict[str, str] = {}

    def register(self, name: str, help: str = "") -> Callable[[T], T]:
        def decorator(fn: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._entries[name] = fn
            doc = (fn.__doc__ or "").strip().splitlines()
            self._help[name] = help or (doc[0] if doc else "")
            return fn

        return decorator

    def get(self, name: str, key: str | None = None) -> T:
        try:
            return self._entries[name]
        except KeyError:
            where = f"{key}: " if key else ""
            raise ConfigError(
                f"{where}unknown {self.kind} {name!r}; choose one of: {', '.join(sorted(self._entries))}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def describe(self, name: str) -> str:
        return self._help.get(name, "")

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


DATASETS: Registry = Registry("dataset")
MODELS: Registry = Registry("model")
GENERATORS: Registry = Registry("generator")  # server-side image generators (models/generators.py), not classifiers
PARTITIONS: Registry = Registry("partition")
ALGORITHMS: Registry = Registry("algorithm")
