"""A name -> factory registry. Unknown names fail with the list of valid ones.

Used for datasets, models, optimizers and memory backends, instead of if/elif chains::

    DATASETS = Registry[Callable[..., DataSplits]]("dataset")

    @DATASETS.register("digits")
    def load_digits(cfg): ...

    DATASETS.get("digitz", key="dataset.name")
    # UnknownNameError: dataset.name='digitz' is invalid: unknown dataset 'digitz'; valid: cifar10, ...
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from dpsweep.errors import InputError

T = TypeVar("T")


class UnknownNameError(InputError, KeyError):
    """A registry lookup of a name that is not registered (bad input: exit code 2 in every command)."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = entry
            return entry

        return add

    def get(self, name: str, key: str | None = None) -> T:
        """The entry ``name``; ``key`` (e.g. ``dataset.name``) is the config key named in errors."""
        try:
            return self._entries[name]
        except KeyError:
            valid = ", ".join(sorted(self._entries))
            raise UnknownNameError(key or self.kind, name, f"unknown {self.kind} {name!r}; valid: {valid}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
