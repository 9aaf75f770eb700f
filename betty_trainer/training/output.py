"""What a run shows while it runs: per-epoch progress with an ETA, and native stderr chatter filtered out.

Epochs are numbered from 0 everywhere a run names one (``metrics.jsonl``, checkpoints, ``resuming at
epoch N``, early stopping, errors, the final line), so the progress names the epoch that just ended by
that same index and shows how many of the run's epochs are done beside it: after the 48th of 50 epochs,
``epoch 47`` and ``48/50``.

On a terminal, :class:`EpochProgress` is a ``rich`` progress bar on one line (label, bar, epochs done,
elapsed time, ``ETA`` and rich's own estimate of the time remaining) and the epoch's status on a second
line. The bar and the label shrink and the status is cut with an ellipsis to fit the terminal's width,
so the count, the elapsed time and the ETA stay whole down to about 50 columns. When stdout is not a terminal
(``nohup … > log``, a batch job, CI), rich's live display would print once at the end, cut to 80
columns, so it prints one plain line per epoch instead, with the same ETA (read off the same rich
task). ``train.progress=false`` also asks for the plain lines.

:func:`quiet_native_stderr` hides lines that C++ libraries write straight to file descriptor 2, such as
the ``USDT … profiler_start`` lines the PyTorch profiler prints at every start and stop (``betty-train
plan --measure`` and custom-model calibration profile many steps); every other line written meanwhile
is passed on.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol

from rich.console import Console, RenderableType
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Column
from rich.text import Text

PROFILER_CHATTER = re.compile(r"^(USDT:|STAGE:|\[W .*(profiler|kineto)|.*ActivityProfilerController)")
"""Lines of the PyTorch profiler's native logging (kineto), which carry nothing for a user."""

BAR_WIDTH = 40
"""The bar's width in columns on a wide terminal; it shrinks to leave room for the count and the times."""

LABEL_WIDTH = 30
"""The most columns the bar's label (dataset · partitioner) takes; a longer one, or one on a terminal too
narrow for it, ends in an ellipsis."""


class EpochSummary(Protocol):
    """What :func:`epoch_status` reads of an epoch's metrics (``trainer.EpochMetrics`` has it all)."""

    loss: float
    val_acc: float | None
    feature_hits: int
    feature_misses: int
    host_to_device_bytes: int


def epoch_status(metrics: EpochSummary, best: Mapping[str, float | int | None]) -> str:
    """The status of an epoch that ended, as the progress line shows it.

    ``loss L · val V · best val B (epoch E, test T)``, then `` · feature hits H%`` when a node cache or a
    staged macro-batch served input rows and `` · M MiB to the device`` when features were copied there.
    ``val -`` when the epoch was not evaluated (``train.eval_every``); ``best val -`` until an
    evaluation has happened.

    Args:
        metrics: the epoch's mean training loss (``loss``), validation accuracy in ``[0, 1]`` or ``None``
            when not evaluated (``val_acc``), input rows found on the device and read from the host
            (``feature_hits``, ``feature_misses``) and bytes copied host→device (``host_to_device_bytes``).
        best: the run's best validation so far: ``epoch`` (0-based index; negative, or ``val_acc`` not a
            number in ``[0, 1]``, before the first evaluation), ``val_acc`` and ``test_acc`` (fractions; a
            missing test accuracy shows as ``-``). ``epoch`` may be left out: the epoch is then not shown.

    Returns:
        One line, without the epoch index (:meth:`EpochProgress.advance` puts it first).
    """
    val = "-" if metrics.val_acc is None else f"{metrics.val_acc:.3f}"
    status = f"loss {metrics.loss:.4f} · val {val} · best val {_best(best)}"
    if metrics.feature_hits:  # a node cache or a staged macro-batch served rows
        status += f" · feature hits {metrics.feature_hits / (metrics.feature_hits + metrics.feature_misses):.0%}"
    if metrics.host_to_device_bytes:
        status += f" · {metrics.host_to_device_bytes / 2**20:,.0f} MiB to the device"
    return status


def _best(best: Mapping[str, float | int | None]) -> str:
    """``0.872 (epoch 47, test 0.860)``, or ``-`` before the first evaluation."""
    epoch, val, test = best.get("epoch"), best.get("val_acc"), best.get("test_acc")
    if val is None or not 0.0 <= val <= 1.0 or (epoch is not None and epoch < 0):
        return "-"
    test_text = "-" if test is None or test != test else f"{test:.3f}"  # NaN: no test split
    where = "" if epoch is None else f"epoch {epoch}, "
    return f"{val:.3f} ({where}test {test_text})"


class _LabelColumn(ProgressColumn):
    """The task's description in bold on one line, ending in an ellipsis when its column is narrowed (not
    read as rich markup, so a dataset named ``[x]`` shows as such)."""

    def render(self, task: Task) -> Text:
        return Text(task.description, style="bold", no_wrap=True, overflow="ellipsis")


class _BarAndStatus(Progress):
    """rich's progress table (the bar line), then each task's status on a line of its own, cut to the
    console's width with an ellipsis (rich's documented extension point, ``get_renderables``)."""

    def get_renderables(self) -> Iterable[RenderableType]:
        yield self.make_tasks_table(self.tasks)
        for task in self.tasks:
            if task.visible and task.fields.get("status"):
                yield Text(task.fields["status"], no_wrap=True, overflow="ellipsis")


class EpochProgress:
    """Progress over epochs: a live bar and a status line on a terminal, else one plain line per epoch.

    On a terminal (the bar line shrinks to the width, the status line ends in ``…`` when cut)::

        synthetic · reg ━━━━━━━━━━━━━━━━━━━━━━━━━━━━━╸  48/50 epochs 0:00:12 ETA 0:00:01
        epoch 47 · loss 2.7026 · val 0.872 · best val 0.872 (epoch 47, test 0.860)

    Otherwise, one line per epoch, never cut::

        epoch 47 (48/50 done) · loss 2.7026 · val 0.872 · best val 0.872 (epoch 47, test 0.860) · ETA 0:00:01

    The epoch is the 0-based index that ``metrics.jsonl``, the checkpoints and every message use;
    ``48/50`` counts the epochs done.

    Args:
        console: where to print (its ``is_terminal`` picks the form).
        description: the bar's label (at most :data:`LABEL_WIDTH` columns, fewer on a narrow terminal).
        total: the run's epochs.
        completed: epochs already done (a resumed run).
        live: show the live bar when the console is a terminal (``train.progress``); without it,
            plain lines are printed.
    """

    def __init__(self, console: Console, description: str, total: int, completed: int, live: bool = True):
        self.console, self.total = console, total
        self.live = live and console.is_terminal
        # Only the label and the bar may wrap, so only they give up columns when the line is too wide (rich's
        # table narrows wrappable columns first, then shrinks every column alike, which hid the count and the
        # times); the label itself never wraps (:class:`_LabelColumn`).
        fixed = Column(no_wrap=True)
        self.progress = _BarAndStatus(
            _LabelColumn(table_column=Column(max_width=LABEL_WIDTH)),
            BarColumn(bar_width=None, table_column=Column(max_width=BAR_WIDTH)),
            MofNCompleteColumn(table_column=fixed.copy()), TextColumn("epochs", table_column=fixed.copy()),
            TimeElapsedColumn(table_column=fixed.copy()), TextColumn("ETA", table_column=fixed.copy()),
            TimeRemainingColumn(table_column=fixed.copy()),
            console=console, disable=not self.live,
        )
        self.task = self.progress.add_task(description, total=total, completed=completed, status="")

    def __enter__(self) -> EpochProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.progress.__exit__(*exc_info)

    def advance(self, epoch: int, status: str) -> None:
        """Epoch ``epoch`` (0-based, as in ``metrics.jsonl``) is done; ``status`` sums it up
        (:func:`epoch_status`)."""
        self.progress.update(self.task, advance=1, status=f"epoch {epoch} · {status}")
        if not self.live:
            task = self.progress.tasks[0]
            eta = eta_text(task.time_remaining)
            self.console.print(f"epoch {epoch} ({int(task.completed)}/{self.total} done) · {status} · ETA {eta}",
                               highlight=False, soft_wrap=True)


def eta_text(seconds: float | None) -> str:
    """A time remaining as ``H:MM:SS``, the hours unbounded (as the live bar's column shows it), e.g. ``0:00:05`` or
    ``30:00:00``, whatever the number of epochs; ``-`` when unknown or not finite."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    minutes, secs = divmod(max(0, round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


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
