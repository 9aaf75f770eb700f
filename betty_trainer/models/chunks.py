"""Loops over a tensor's rows or edges a chunk at a time (GAT's attention, the tensor path's keyed dropout), which tell
their observers where they begin and end: a recording of a layer (``betty_trainer.models.recorded_terms``) listens,
so that what one chunk allocates is counted for one chunk's items however many its small recorded sizes had."""

from __future__ import annotations

from collections.abc import Callable, Iterator

OBSERVERS: list[Callable[[str, int, int], None]] = []
"""Called ``(moment, items, step)`` where a :func:`chunks` loop begins (``"begin"``) and ends (``"end"``): ``items``
in all, at most ``step`` per chunk."""


def chunks(items: int, step: int) -> Iterator[slice]:
    """Consecutive slices of at most ``step`` (≥ 1) of ``items`` (each chunk's temporaries freed before the next's
    are made); :data:`OBSERVERS` are told where the loop begins and ends."""
    for observer in OBSERVERS:
        observer("begin", items, step)
    for start in range(0, items, step):
        yield slice(start, min(start + step, items))
    for observer in OBSERVERS:
        observer("end", items, step)
