"""`Registry`: the name -> record table behind the architecture, optimizer and pipeline-schedule
registries (models/registry.py, parallel/data_parallel/optimizer_spec.py, pipeline/registry.py).

Each of those modules holds one `Registry` at module level, filled by its `register_*` calls at
import time: registries are the one allowed exception to "no module-level mutable state".
Each keeps its own lookup error (they name the config key the name came from)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar


class _Named(Protocol):
    name: str


T = TypeVar("T", bound=_Named)


class Registry(Generic[T]):
    """Records by `record.name`, in registration order; `kind` words the duplicate error."""

    def __init__(self, kind: str):
        self.kind = kind
        self._records: dict[str, T] = {}

    def add(self, record: T) -> T:
        """Add `record` under its name (a name taken is a ValueError); returns it."""
        if record.name in self._records:
            raise ValueError(f"{self.kind} {record.name!r} is already registered")
        self._records[record.name] = record
        return record

    def remove(self, name: str) -> None:
        """Remove `name` if registered (tests that register a toy one)."""
        self._records.pop(name, None)

    def get(self, name: str) -> T | None:
        return self._records.get(name)

    def names(self) -> tuple[str, ...]:
        return tuple(self._records)

    def __contains__(self, name: object) -> bool:
        return name in self._records

    def __iter__(self) -> Iterator[T]:
        return iter(self._records.values())
