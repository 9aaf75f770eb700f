"""Loops over a tensor's rows or edges a chunk at a time (GAT's attention, the tensor path's keyed dropout and pool
segment max), which tell their observers where they begin and end: a recording of a layer
(``betty_trainer.models.recorded_terms``) listens, so that what one chunk allocates is counted for one chunk's items
however many its small recorded sizes had."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

_OBSERVERS: contextvars.ContextVar[tuple[Callable[[str, int, int], None], ...]] = contextvars.ContextVar(
    "chunk_observers", default=())


@contextlib.contextmanager
def observing(observer: Callable[[str, int, int], None]):
    """Inside the block (this thread or task), ``observer`` is called ``(moment, items, step)`` where a
    :func:`chunks` loop begins (``"begin"``) and ends (``"end"``): ``items`` in all, at most ``step`` per chunk."""
    token = _OBSERVERS.set((*_OBSERVERS.get(), observer))
    try:
        yield
    finally:
        _OBSERVERS.reset(token)


def chunks(items: int, step: int) -> Iterator[slice]:
    """Consecutive slices of at most ``step`` (≥ 1) of ``items`` (each chunk's temporaries freed before the next's
    are made); the :func:`observing` observers are told where the loop begins and ends."""
    observers = _OBSERVERS.get()
    for observer in observers:
        observer("begin", items, step)
    for start in range(0, items, step):
        yield slice(start, min(start + step, items))
    for observer in observers:
        observer("end", items, step)
