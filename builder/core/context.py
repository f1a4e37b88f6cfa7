"""What one command resolves once: the values that stay the same for as long as a command runs
(this machine's NVIDIA driver, a project's ``pyproject.toml``, the JIT remote a project names),
made the first time one is asked for and handed to every later asker of the same command.

The CLI opens the scope around each command (:func:`command`); each value is asked for through
the function that owns it (``driver.current()``, ``paths.project_text()``), which passes its
maker to :func:`once`. Outside a command (a library call, a test calling one function) nothing
is kept and each ask makes the value again, so no value outlives the command that made it: a
driver upgraded between two commands of one process is seen. A thread the command does its
work on (verify's checks, a lock's platforms, a matrix's cells) runs in the command's scope
through :func:`carried`; a new thread starts in an empty context otherwise (Python's rule),
which made a `build --verify` look for the driver twice once its checks ran on threads.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")

_values: contextvars.ContextVar[dict[Hashable, Any] | None] = contextvars.ContextVar(
    "cudaenv_command_context", default=None
)


@contextmanager
def command() -> Iterator[None]:
    """One command's scope: values made inside it are made once."""
    token = _values.set({})
    try:
        yield
    finally:
        _values.reset(token)


# One maker at a time: two of the command's threads asking at once get one value (an RLock:
# a maker may ask for another value).
_making = threading.RLock()


def once(key: Hashable, make: Callable[[], T]) -> T:
    """``make()``, made once per command for ``key``. An exception is not kept: the next ask
    tries again (and fails the same way where nothing changed)."""
    values = _values.get()
    if values is None:
        return make()
    with _making:
        if key not in values:
            values[key] = make()
        found: T = values[key]
    return found


def carried(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` to run on another thread in the scope of the command running now (its values
    shared, made once for both): a copy of this context per call, as one context cannot be
    entered by two threads at once."""
    here = contextvars.copy_context()

    def run(*args: Any, **kwargs: Any) -> T:
        return here.copy().run(fn, *args, **kwargs)

    return run


def kept_on(obj: object, name: str, make: Callable[[], T]) -> T:
    """``make()``, made once per ``obj`` (a frozen dataclass) and kept in its ``__dict__``
    under ``name``: not a field, so equality, hashing and ``dataclasses.replace`` (a new
    object, made afresh) ignore it."""
    found = obj.__dict__.get(name, _MISSING)
    if found is _MISSING:
        found = make()
        object.__setattr__(obj, name, found)
    made: T = found
    return made


_MISSING = object()
