"""User-facing errors.

Every error a user can cause (a bad config, a corrupt dataset file, an
impossible request) is a :class:`BettyError`. The CLI catches it once and prints
its message as one line; the Python API lets it propagate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


class BettyError(Exception):
    """Base class of errors caused by user input; the message names the input and the fix."""


def host_allocation_failure(error: BaseException) -> str | None:
    """The cause, in at most 100 characters, when ``error`` is a failed host-memory allocation (``MemoryError``, or
    torch's ``RuntimeError: … DefaultCPUAllocator: can't allocate memory …``); ``None`` for any other error. The one
    test every command uses to turn running out of host memory into a one-line error."""
    line = (str(error).splitlines() or [""])[0]
    if isinstance(error, MemoryError):
        return line[:100] or "MemoryError"
    if isinstance(error, RuntimeError) and "can't allocate memory" in line:
        return line[line.index("can't allocate memory"):][:100]
    return None


class ConfigError(BettyError):
    """A configuration file or override is malformed or names an unknown key or bad value."""


class DatasetError(BettyError):
    """A dataset is unknown, missing, truncated, tampered with or fails its checksum."""


class TrainingError(BettyError):
    """Training cannot continue (e.g. the loss became NaN, or a checkpoint is unusable)."""


class NonFiniteLossError(TrainingError):
    """A training loss is NaN or infinite: the model diverged (the one failure a lower learning rate may cure)."""


class PlanningError(BettyError):
    """No split of a batch fits the memory budget (the message gives the numbers)."""


class CalibrationError(BettyError):
    """A custom model's memory cannot be calibrated (its step fails, or its peak does not follow the counts)."""


class RunDirError(BettyError):
    """The run directory cannot be used: another run holds it, or it cannot be created or written
    (read-only, disk full); the message names the path and the cause."""


@contextlib.contextmanager
def host_memory_as_one_line(message: Callable[[str], str]) -> Iterator[None]:
    """A failed host-memory allocation inside the block (:func:`host_allocation_failure`) becomes a
    :class:`TrainingError` whose text is ``message(cause)``; any other error passes as it is.

    Raises:
        TrainingError: ``message(cause)``.
    """
    try:
        yield
    except (RuntimeError, MemoryError) as error:
        cause = host_allocation_failure(error)
        if cause is None:
            raise
        raise TrainingError(message(cause)) from None
