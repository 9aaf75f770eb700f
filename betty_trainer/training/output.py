"""What a run shows while it runs: per-epoch progress with an ETA, and native stderr chatter filtered out.

On a terminal, :class:`EpochProgress` is a ``rich`` progress bar with the elapsed time and rich's own
estimate of the time remaining. When stdout is not a terminal (``nohup … > log``, a batch job, CI),
rich's live display would print once at the end, cut to 80 columns, so it prints one plain line per
epoch instead, with the same ETA (read off the same rich task). ``train.progress=false`` also asks
for the plain lines.

:func:`quiet_native_stderr` hides lines that C++ libraries write straight to file descriptor 2, such as
the ``USDT … profiler_start`` lines the PyTorch profiler prints at every start and stop (``betty-train
plan --measure`` and custom-model calibration profile many steps); every other line written meanwhile
is passed on.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from datetime import timedelta

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

PROFILER_CHATTER = re.compile(r"^(USDT:|STAGE:|\[W .*(profiler|kineto)|.*ActivityProfilerController)")
"""Lines of the PyTorch profiler's native logging (kineto), which carry nothing for a user."""


class EpochProgress:
    """Progress over epochs: a live bar on a terminal, else one plain line per epoch.

    Args:
        console: where to print (its ``is_terminal`` picks the form).
        description: the bar's label.
        total: the run's epochs.
        completed: epochs already done (a resumed run).
        live: show the live bar when the console is a terminal (``train.progress``); without it,
            plain lines are printed.
    """

    def __init__(self, console: Console, description: str, total: int, completed: int, live: bool = True):
        self.console, self.total = console, total
        self.live = live and console.is_terminal
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("epochs"),
            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[status]}"),
            console=console, disable=not self.live,
        )
        self.task = self.progress.add_task(description, total=total, completed=completed, status="")

    def __enter__(self) -> EpochProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.progress.__exit__(*exc_info)

    def advance(self, epoch: int, status: str) -> None:
        """Epoch ``epoch`` (0-based) is done; ``status`` sums it up (loss, accuracies)."""
        self.progress.update(self.task, advance=1, status=status)
        if not self.live:
            remaining = self.progress.tasks[0].time_remaining
            eta = "-" if remaining is None else str(timedelta(seconds=round(remaining)))
            self.console.print(f"epoch {epoch + 1}/{self.total} · {status} · ETA {eta}", highlight=False,
                               soft_wrap=True)


@contextlib.contextmanager
def quiet_native_stderr(pattern: re.Pattern[str] = PROFILER_CHATTER) -> Iterator[None]:
    """Capture what is written to file descriptor 2 meanwhile, and pass on the lines that do not match
    ``pattern`` when the block ends (Python's ``sys.stderr`` writes included, in order).

    Does nothing when descriptor 2 cannot be duplicated (no such descriptor).
    """
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with tempfile.TemporaryFile() as capture:
        _flush()
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            _flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = [line for line in capture.read().decode(errors="replace").splitlines(keepends=True)
                    if not pattern.match(line)]
            if kept:
                sys.stderr.write("".join(kept))
                _flush()


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
