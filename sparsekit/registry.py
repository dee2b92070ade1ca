"""Named registries: the extension points (criteria, quantization schemes, accel variants).

A registry maps names to objects registered in code (``registry.register(name, obj)``), plus,
when it has an entry point ``group``, the entry points of that group declared by *installed*
distributions (``[project.entry-points."sparsekit.criteria"] toy = "my_pkg.toy:Toy"``). Entry
point names are listed without importing anything; an entry point is imported the first time
its name is looked up. Nothing read from a file (a checkpoint, a run directory) is ever passed
to an import: such files only name registered objects.

The one rule for a name that comes from a file (a checkpoint header, a run directory's
recorded overrides, a config read back on resume, an exported config): it resolves only among
the objects registered *in code* (:meth:`Registry.in_code`, :func:`from_file`); an installed
plugin (an entry point) is honoured only when the name was typed on the command line or passed
in code, never because a file names it.

Config choices and ``sparsekit --help`` are derived from :meth:`Registry.names`.

>>> colours = Registry("colour")
>>> colours.register("red", (255, 0, 0))
>>> colours["red"], "blue" in colours, colours.names()
((255, 0, 0), False, ('red',))
>>> colours["blue"]
Traceback (most recent call last):
...
sparsekit.errors.UsageError: unknown colour 'blue'; allowed: 'red'
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from importlib import metadata
from typing import Generic, TypeVar

from sparsekit.errors import ConfigTypeError, UnsafeFileError, UsageError

T = TypeVar("T")


class Registry(Mapping[str, T], Generic[T]):
    """Objects of one ``kind`` by name; a read-only mapping (``registry[name]``, ``in``, ``len``,
    iteration in registration order, entry points last). ``kind`` names what is registered in
    error messages ("criterion", "quantization scheme"); ``group`` is the entry point group
    scanned for plugins (None: code registrations only); ``check(obj)`` says what is wrong
    with a loaded plugin's object (None: it is one), so that a plugin giving something else is
    one line naming it, not an AttributeError when it is used."""

    def __init__(self, kind: str, group: str | None = None,
                 check: Callable[[object], str | None] | None = None):
        self.kind, self.group, self._check = kind, group, check
        self._objects: dict[str, T] = {}
        self._entry_points: dict[str, metadata.EntryPoint] | None = None
        self._loaded_plugins: set[str] = set()  # entry points loaded into _objects

    def register(self, name: str, obj: T) -> None:
        """Make ``obj`` available as ``name`` (registering a name again replaces it)."""
        if not isinstance(name, str) or not name or name != name.strip():
            raise ConfigTypeError(f"a {self.kind} name must be a non-empty string, got {name!r}")
        self._objects[name] = obj
        self._loaded_plugins.discard(name)

    def unregister(self, name: str) -> None:
        """Remove ``name`` (registered in code, or an entry point already loaded) and forget the
        entry points found so far: the next lookup scans the installed distributions again."""
        self._objects.pop(name, None)
        self._loaded_plugins.discard(name)
        self._entry_points = None

    def _plugins(self, rescan: bool = False) -> dict[str, metadata.EntryPoint]:
        if self.group is None:
            return {}
        if self._entry_points is None or rescan:
            found = metadata.entry_points(group=self.group)
            self._entry_points = {ep.name: ep for ep in found}
        return self._entry_points

    def names(self) -> tuple[str, ...]:
        """Every name: registered in code first, then installed entry points."""
        return tuple(dict.fromkeys([*self._objects, *self._plugins()]))

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        return name in self._objects or name in self._plugins(rescan=name not in self.names())

    def __getitem__(self, name: str) -> T:
        if name in self._objects:
            return self._objects[name]
        if name not in self:  # rescans the entry points: a plugin installed since
            allowed = ", ".join(map(repr, self.names()))
            raise UsageError(f"unknown {self.kind} {name!r}; allowed: {allowed}")
        ep = self._plugins()[name]
        try:
            obj = ep.load()
        except Exception as e:
            raise UsageError(
                f"{self.kind} {name!r} (entry point {ep.value!r} of group {self.group!r}) cannot "
                f"be loaded: {type(e).__name__}: {e}"
            ) from e
        try:
            obj = obj() if isinstance(obj, type) else obj
        except Exception as e:
            raise UsageError(f"{self.kind} {name!r} (entry point {ep.value!r} of group "
                             f"{self.group!r}) cannot be created: {type(e).__name__}: {e}") from e
        wrong = None if self._check is None else self._check(obj)
        if wrong is not None:
            raise ConfigTypeError(f"{self.kind} {name!r} (entry point {ep.value!r} of group "
                                  f"{self.group!r}) is not a {self.kind}: {wrong}")
        self._objects[name] = obj
        self._loaded_plugins.add(name)
        return self._objects[name]

    def in_code(self, name: object) -> bool:
        """Whether ``name`` is registered in code (a built-in, or a ``register`` call of this
        process), not an installed entry point: what a name read from a file may resolve to.
        Lists and imports nothing."""
        return isinstance(name, str) and name in self._objects and name not in self._loaded_plugins

    def code_names(self) -> tuple[str, ...]:
        """The names registered in code (see :meth:`in_code`)."""
        return tuple(n for n in self._objects if n not in self._loaded_plugins)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self.names())})"


def from_file(registry: Registry[T], name: object, where: str) -> T:
    """Resolve ``name``, read from the file or run directory ``where``, among ``registry``'s
    objects registered in code; :class:`~sparsekit.errors.UnsafeFileError` naming ``where``
    otherwise (a plugin the file names is never imported for it: type it on the command line
    or pass it in code).

    >>> colours = Registry("colour", group="sparsekit.colours")
    >>> colours.register("red", (255, 0, 0))
    >>> from_file(colours, "red", "run.json")
    (255, 0, 0)
    >>> from_file(colours, "blue", "run.json")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    sparsekit.errors.UnsafeFileError: run.json names colour 'blue', which is not built in ...
    """
    if not registry.in_code(name):
        allowed = ", ".join(map(repr, registry.code_names()))
        raise UnsafeFileError(
            f"{where} names {registry.kind} {name!r}, which is not built in (built in: "
            f"{allowed}); a name read from a file never loads a plugin: pass it on the "
            "command line or in code"
        )
    return registry[name]  # type: ignore[index]
