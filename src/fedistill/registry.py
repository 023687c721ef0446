"""Name -> factory registries (timm style) for datasets, models, generators, partitions and algorithms.

The CLI lists them (``fedistill list``) and the config resolves names through them, so an unknown name
is reported with the allowed choices instead of a KeyError from deep inside.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Callable, Generic, Iterator, TypeVar

from .errors import ConfigError

T = TypeVar("T", bound=Callable)

# A citation of a developer card (``spec/fedlmd.md``, ``experiments-fedlmd.md §2 "Sharding"``, ``fedavg.md
# ambiguity 3``): those files live in the source repository only, so what users see omits them.
_CARD = re.compile(
    r"(?:Cards?:\s*)?(?:[\w./-]+/)?[\w-]+\.md\b"  # the file, with an optional "Card:" label
    r"(?:,?\s*(?:§\s*[\w.-]+|ambiguity\s+\d+)(?:\s*\"[^\"]*\")?)*"  # its sections: §2 "Sharding", ambiguity 3
    r"(?:\s*\([^()]*§[^()]*\))?"  # and a following "(protocol §0)"
)
_PARENS = re.compile(r"\s*\(([^()]*)\)")


def without_card_citations(text: str) -> str:
    """``text`` without citations of the repository's card files (``list`` shows what ships or is online)."""

    def parens(match: re.Match[str]) -> str:
        if not _CARD.search(match[1]):
            return match[0]
        pieces = re.split(r"(\s*[;,]\s*)", match[1])  # parts and the separators between them
        kept, sep = [], ""
        for i in range(0, len(pieces), 2):
            piece = pieces[i].strip()
            if piece and not _CARD.search(piece) and not re.match(r"(?:§|ambiguity\b)", piece):  # not a card's section
                kept.append(sep.strip() + " " + piece if kept else piece)
            sep = pieces[i + 1] if i + 1 < len(pieces) else ""
        return f" ({''.join(kept)})" if kept else ""

    text = _PARENS.sub(parens, text)
    text = _CARD.sub("", text)
    text = re.sub(r"\s+([.,;:])", r"\1", re.sub(r"\s{2,}", " ", text))
    return re.sub(r"\.{2,}$", ".", text).strip()


class NameTaken(ValueError):
    """A name registered a second time. The first registration stays: a plugin cannot replace a built-in (or
    another plugin's) entry, since configs and results that name it would silently change meaning."""

    def __init__(self, kind: str, name: str, owner: str) -> None:
        self.kind, self.name, self.owner = kind, name, owner
        super().__init__(f"{kind} {name!r} is already taken (by {owner}); register yours under another name")


_registering_plugin: str | None = None  # the plugin being imported (plugins.py), to say who took a name


@contextmanager
def registering_for(plugin: str) -> Iterator[None]:
    """Registrations made inside are attributed to ``plugin`` (e.g. ``"plugin my_methods.py"``) when a later
    registration of the same name is refused."""
    global _registering_plugin
    outer, _registering_plugin = _registering_plugin, plugin
    try:
        yield
    finally:
        _registering_plugin = outer


def _owner(fn: Callable, name: str) -> str:
    """Who registers ``fn`` under ``name``, in the words of the "already taken" message."""
    if _registering_plugin is not None:
        return _registering_plugin
    module = getattr(fn, "__module__", "") or ""
    if module == "fedistill" or module.startswith("fedistill."):
        return f"fedistill's built-in {name}"
    return f"{module}.{getattr(fn, '__qualname__', name)}"


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._help: dict[str, str] = {}
        self._owners: dict[str, str] = {}

    def register(self, name: str, help: str = "") -> Callable[[T], T]:
        def decorator(fn: T) -> T:
            if name in self._entries:
                raise NameTaken(self.kind, name, self._owners.get(name, "an earlier registration"))
            self._entries[name] = fn
            self._owners[name] = _owner(fn, name)
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
        """The entry's one-line help (the docstring's first line), without repository-only card citations."""
        return without_card_citations(self._help.get(name, ""))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


DATASETS: Registry = Registry("dataset")
MODELS: Registry = Registry("model")
# Named lists of model names (models/group.py): client k trains member k mod M; an entry returns its members.
MODEL_GROUPS: Registry = Registry("model group")
GENERATORS: Registry = Registry("generator")  # server-side image generators (models/generators.py), not classifiers
PARTITIONS: Registry = Registry("partition")
ALGORITHMS: Registry = Registry("algorithm")
