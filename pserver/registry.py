"""One registry per kind of name (modes, optimizers, codecs, models, datasets, layers...).

A Registry maps each name a user may give to what it names, with a one-line summary. The
package that owns the kind holds its registry; the CLI's `choices=`, the config's checks and
the docs' tables read it, so a new entry is added in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

from pserver.errors import ConfigError


@dataclass(frozen=True)
class Entry:
    name: str
    summary: str   # one line, for --help and the docs' tables
    value: Any     # what the name stands for: a class, a function, or None for a plain choice
    form: str      # how a user writes it: the name, or with its arguments ("topk:RATIO")
    info: dict = field(default_factory=dict)   # what else the kind records of it (a model's task)


class Registry:
    """Names of one kind, in the order they were added (the order --help and errors list them).

    `kind` names the kind in errors ("unknown <kind> 'x'"), `flag` the option that takes one.
    """

    def __init__(self, kind: str, flag: str):
        self.kind, self.flag = kind, flag
        self._entries: dict[str, Entry] = {}

    def add(self, name: str, summary: str, value: Any = None, form: str | None = None, **info) -> Any:
        """Register `name` (written as `form` where it takes arguments, e.g. "topk:RATIO"), with
        what else its kind records of it (`info`: `info(name)`); returns `value`, so a module can
        add and keep what it defined."""
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        if not summary or "\n" in summary:
            raise ValueError(f"{self.kind} {name!r}: the summary must be one line")
        self._entries[name] = Entry(name, summary, value, form or name, info)
        return value

    def register(self, cls):
        """Class decorator: registers `cls` under cls.name with cls.summary (and cls.form)."""
        self.add(cls.name, cls.summary, cls, getattr(cls, "form", None))
        return cls

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def forms(self) -> tuple[str, ...]:
        """How each entry is written, arguments included ("topk:RATIO"), for help and errors."""
        return tuple(e.form for e in self._entries.values())

    def values(self) -> tuple:
        return tuple(e.value for e in self._entries.values())

    def get(self, name: str, what: str | None = None):
        """The value registered as `name`; an unknown name raises ConfigError listing the names."""
        if name not in self._entries:
            raise ConfigError(f"{what or self.flag}: unknown {self.kind} {name!r}; "
                              f"choose one of {', '.join(self._entries)}")
        return self._entries[name].value

    def info(self, name: str) -> dict:
        """What `add` recorded of `name` beside its value ({} for a name not registered)."""
        entry = self._entries.get(name)
        return dict(entry.info) if entry else {}

    def summary(self, name: str) -> str:
        return self._entries[name].summary

    def table_rows(self) -> list[tuple[str, str]]:
        """(form, summary) per entry, for a docs table."""
        return [(e.form, e.summary) for e in self._entries.values()]

    def __contains__(self, name) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._entries)})"


__all__ = ["Entry", "Registry"]
