"""Name -> factory registries (timm style) for datasets, models, generators, partitions and algorithms.

The CLI lists them (``fedistill list``) and the config resolves names through them, so an unknown name
is reported with the allowed choices instead of a KeyError from deep inside.
"""

from __future__ import annotations

import re
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
        """The entry's one-line help (the docstring's first line), without repository-only card citations."""
        return without_card_citations(self._help.get(name, ""))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


DATASETS: Registry = Registry("dataset")
MODELS: Registry = Registry("model")
GENERATORS: Registry = Registry("generator")  # server-side image generators (models/generators.py), not classifiers
PARTITIONS: Registry = Registry("partition")
ALGORITHMS: Registry = Registry("algorithm")
