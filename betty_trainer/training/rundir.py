"""The run directory (docs/design.md › CLI): where it is, its lock, and how its files are written.

One run at a time writes a run directory. :meth:`RunDirectory.open` takes an
exclusive ``flock`` on ``run.lock`` inside it and writes the holder's pid and host
there; a second run into the same directory is refused with a :class:`RunDirError`
naming that holder. The kernel drops the lock when its process ends, however it
ends, so a lock file left by a dead process is simply taken over. (``filelock``
does the same locking but cannot tell the refused run who holds the lock, which
is the first thing a user asks.)

Every file is written atomically: into ``<name>.partial`` beside it, ``fsync``,
then ``os.replace``. A failed write (read-only file system, full disk, no
permission) removes the partial file, leaves the previous version of the file as
it was and raises a one-line :class:`RunDirError` naming the path and the cause.
``metrics.jsonl`` grows by appends; an append that fails is cut back to the
previous end of the file, so no half line is left.

A run is never lost: a new run into a directory that already holds one (any of
:data:`RUN_FILES`) is refused unless it is resumed or explicitly overwritten, and an
overwrite removes only the files a run writes (:meth:`RunDirectory.clear`), once the
new run really starts.
"""

from __future__ import annotations

import contextvars
import errno
import fcntl
import functools
import json
import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from importlib import metadata as _metadata
from pathlib import Path
from typing import Any, Callable, TypeVar, cast

from betty_trainer.errors import RunDirError

LOCK_NAME = "run.lock"
RUN_FILES = ("config.yaml", "metrics.jsonl", "plan.json", "last.pt", "last.sha256", "best.pt", "best.sha256",
             "environment.json", "resumes.yaml", "checkpoint.pt")
"""Files a run writes; a directory holding any of them holds a run (``checkpoint.pt``: earlier versions)."""
TENSORBOARD_DIR = "tensorboard"

_F = TypeVar("_F", bound=Callable[..., Any])
_SCOPE: contextvars.ContextVar[list[RunDirectory] | None] = contextvars.ContextVar("run_dir_scope", default=None)


def new_run_dir(config: Any) -> Path:
    """``config.train.run_dir``, or ``runs/<config.name>-<timestamp>`` (never an existing folder).

    Args:
        config: a :class:`~betty_trainer.config.Config`.
    """
    if config.train.run_dir is not None:
        return Path(config.train.run_dir)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    candidate, n = Path("runs") / f"{config.name}-{stamp}", 1
    while candidate.exists():
        candidate, n = Path("runs") / f"{config.name}-{stamp}-{n}", n + 1
    return candidate


class RunDirectory:
    """A run directory this process holds the lock of; its files are written through it.

    Open it with :meth:`open`; :meth:`close` (or leaving a ``with`` block, or the end of a
    function decorated with :func:`holds_run_directories`) releases the lock.

    Attributes:
        path: the directory.
    """

    def __init__(self, path: Path, lock_fd: int, created: Sequence[Path] = ()):
        self.path = path
        self._lock_fd: int | None = lock_fd
        self._created = list(created)  # the folders open() made, deepest first

    @classmethod
    def open(cls, path: Path, *, create: bool = True, overwrite: bool = False) -> RunDirectory:
        """Create ``path`` (with ``create``) and take its lock.

        Args:
            path: the run directory.
            create: a new run: make the directory (and its parents) if missing; it must not hold a
                run unless ``overwrite``. ``False`` to resume, where it must exist.
            overwrite: a new run may replace the run the directory holds (call :meth:`clear` once
                the new run starts).

        Returns:
            The held run directory (registered with the enclosing :func:`holds_run_directories`).

        Raises:
            RunDirError: another process (or another open in this one) holds the lock; the path or
                one of its parents is a file; a new run finds files betty-train did not write there
                (:func:`foreign_files`, even with ``overwrite``) or, without ``overwrite``, a run; or
                the directory cannot be created or its lock file written. The message names the
                path, the cause and the fix.
        """
        path = Path(path)
        check_run_dir_path(path)
        created = []
        if create:
            refuse_foreign_files(path)
            created = [folder for folder in [path, *path.parents] if not folder.exists()]
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise RunDirError(_failure("cannot create run directory", path, error)) from None
        elif not path.is_dir():
            raise RunDirError(f"run directory {path} does not exist; nothing to resume there")
        lock = path / LOCK_NAME
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise RunDirError(_failure("cannot lock run directory", lock, error)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise RunDirError(f"run directory {path} is in use by another run ({holder}); wait for it to end, "
                              "or choose another train.run_dir") from None
        run = cls(path, fd, created)
        if create and not overwrite and holds_run(path):
            run.close()
            go_on = (f"continue it with betty-train train --resume {path}, " if holds_checkpoint(path)
                     else "it has no checkpoint to resume from; ")
            raise RunDirError(f"run directory {path} already holds a run ({', '.join(run_files(path))}); {go_on}"
                              "replace it with --overwrite, or choose another train.run_dir")
        try:
            os.ftruncate(fd, 0)
            _write_all(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                       "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode() + b"\n")
        except OSError as error:
            run.close()
            raise RunDirError(_failure("cannot lock run directory", lock, error)) from None
        scope = _SCOPE.get()
        if scope is not None:
            scope.append(run)
        return run

    def close(self) -> None:
        """Release the lock (the lock file stays; a later run takes it over). Idempotent."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor drops its flock
            self._lock_fd = None

    def abandon(self) -> None:
        """A run refused before it started: release the lock and remove the folders :meth:`open` made, as
        long as they hold nothing but the lock file (a refused run leaves no directory behind)."""
        self.close()
        if self._created and [entry.name for entry in self.path.iterdir()] in ([], [LOCK_NAME]):
            _discard(self.path / LOCK_NAME)
            for folder in self._created:
                try:
                    folder.rmdir()
                except OSError:
                    break  # not empty (or not ours to remove): the rest are its parents

    def clear(self) -> None:
        """Remove the files a run writes (:data:`RUN_FILES`, their ``.partial`` leftovers and the
        TensorBoard folder); the lock and any other file stay.

        Raises:
            RunDirError: a file cannot be removed (the message names it and the cause).
        """
        for name in RUN_FILES:
            for path in (self.path / name, self.path / (name + ".partial")):
                try:
                    path.unlink(missing_ok=True)
                except OSError as error:
                    raise RunDirError(_failure("cannot remove", path, error)) from None
        board = self.path / TENSORBOARD_DIR
        if board.is_dir():
            try:
                shutil.rmtree(board)
            except OSError as error:
                raise RunDirError(_failure("cannot remove", board, error)) from None

    def __enter__(self) -> RunDirectory:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def write_text(self, name: str, text: str) -> Path:
        """Replace ``path/name`` with ``text`` (UTF-8) atomically; see :func:`write_bytes`."""
        return write_bytes(self.path / name, text.encode())

    def write_bytes(self, name: str, data: bytes) -> Path:
        """Replace ``path/name`` with ``data`` atomically; see :func:`write_bytes`."""
        return write_bytes(self.path / name, data)

    def append_line(self, name: str, line: str) -> None:
        """Append ``line`` and a newline to ``path/name``; see :func:`append_line`."""
        append_line(self.path / name, line)


def run_files(path: Path) -> list[str]:
    """The :data:`RUN_FILES` present in ``path``."""
    return [name for name in RUN_FILES if (Path(path) / name).is_file()]


def foreign_files(path: Path) -> list[str]:
    """The entries of the folder ``path`` that betty-train did not write, sorted: anything but :data:`RUN_FILES`,
    their ``.partial`` leftovers, the lock and the TensorBoard folder; and, in a folder without a run's
    ``environment.json`` (the first file every run writes) or checkpoint, the :data:`RUN_FILES` names too (the
    user's own ``config.yaml``, say). ``[]`` for a missing folder."""
    path = Path(path)
    if not path.is_dir():
        return []
    written = {LOCK_NAME, TENSORBOARD_DIR} | {name + ".partial" for name in RUN_FILES}
    if _written_by_a_run(path):
        written |= set(RUN_FILES)
    return sorted(entry.name for entry in path.iterdir() if entry.name not in written)


def refuse_foreign_files(path: Path) -> None:
    """Refuse a new run into a folder holding files betty-train did not write (:func:`foreign_files`): a run
    directory is only what a run wrote, and ``--overwrite`` must never remove or replace a user's file.

    Raises:
        RunDirError: naming the folder and up to five of those files.
    """
    foreign = foreign_files(path)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise RunDirError(f"train.run_dir {path} holds files betty-train did not write ({shown}), so it is not a "
                          "run directory and is left alone (--overwrite too); choose a new or empty train.run_dir")


def _written_by_a_run(path: Path) -> bool:
    """Whether the folder ``path`` holds what only a run writes: its ``environment.json`` (the first file every run
    writes) or a checkpoint; then the :data:`RUN_FILES` names in it are the run's, not the user's."""
    return any((Path(path) / name).is_file() for name in ("environment.json", "last.pt", "checkpoint.pt"))


def holds_run(path: Path) -> bool:
    """Whether ``path`` is a folder holding a run (any of :data:`RUN_FILES`)."""
    return Path(path).is_dir() and bool(run_files(path))


def is_run_file(path: Path) -> bool:
    """Whether ``path`` (or the file a link at ``path`` points to) is a file a run directory manages: one of
    :data:`RUN_FILES`, the lock or a ``.partial`` leftover of them, in a folder a run wrote (its ``environment.json``
    or a checkpoint; :func:`foreign_files`' rule) or a run holds (its lock). A folder with only the user's own
    ``config.yaml`` or an earlier ``plan.json`` is not a run directory."""
    path = Path(path)
    managed = {LOCK_NAME, *RUN_FILES, *(name + ".partial" for name in RUN_FILES)}
    for candidate in {path.absolute(), path.resolve()}:
        folder = candidate.parent
        if candidate.name in managed and (_written_by_a_run(folder) or (folder / LOCK_NAME).is_file()):
            return True
    return False


def refuse_run_file(path: Path, what: str = "--output") -> None:
    """Refuse to write ``what`` at ``path`` when it is a run directory's own file (:func:`is_run_file`): writing
    there would replace a checkpoint, its digest, the run's config or its metrics.

    Raises:
        RunDirError: naming ``what``, the path and the fix.
    """
    if is_run_file(path):
        raise RunDirError(f"{what} {path} is a file of the run directory {Path(path).resolve().parent} "
                          "(betty-train writes and reads it), so it is left alone; choose another file")


def holds_checkpoint(path: Path) -> bool:
    """Whether the run in ``path`` has a ``last.pt`` (``checkpoint.LAST_NAME``) that ``--resume`` continues from."""
    return (Path(path) / "last.pt").exists()


def check_run_dir_path(path: Path, what: str = "train.run_dir") -> None:
    """Refuse a run directory that is a file or lies under a file (checked before anything is written).

    Raises:
        RunDirError: naming ``what``, the file and the fix.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise RunDirError(f"{what} {path} is a file, not a folder; choose another {what}")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise RunDirError(f"{what} {path} lies under {parent}, which is a file; choose another {what}")
            break


def environment(device: Any, command: Sequence[str] | None = None) -> dict[str, Any]:
    """What a run ran on, for ``environment.json`` and ``resumes.yaml``: time, command line, working
    folder, host, Python, torch (and its CUDA), betty-trainer and its main dependencies' versions, the
    device (and the GPU's name), and the git commit of the source when it is a git checkout.

    Args:
        device: the ``torch.device`` training runs on.
        command: the command line; default ``sys.argv``.
    """
    import torch  # the run directory's other helpers need no torch

    versions = {}
    for package in ("betty-trainer", "numpy", "scipy", "pymetis", "pydantic", "rich", "numba", "pyyaml"):
        try:
            versions[package] = _metadata.version(package)
        except _metadata.PackageNotFoundError:
            if package == "betty-trainer":
                versions[package] = "source checkout, not installed"
    device_name = None
    if getattr(device, "type", None) == "cuda" and torch.cuda.is_available():
        device_name = torch.cuda.get_device_name(device)
    return {
        "time": datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join(list(command) if command is not None else sys.argv),
        "cwd": os.getcwd(),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": str(torch.__version__),
        "cuda": torch.version.cuda,
        "packages": versions,
        "device": str(device),
        "device_name": device_name,
        "git": git_commit(Path(__file__).resolve().parents[2]),
    }


def git_commit(folder: Path) -> dict[str, Any] | None:
    """``{"commit": sha, "dirty": bool}`` of the git checkout holding ``folder``, or ``None`` when it is
    not one (an installed wheel) or git is missing."""
    try:
        commit = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10)
        if commit.returncode != 0:
            return None
        status = subprocess.run(["git", "-C", str(folder), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip()) if status.returncode == 0 else None}


def config_changes(before: Mapping[str, Any], after: Mapping[str, Any], prefix: str = "") -> dict[str, list]:
    """Dotted keys whose values differ between two nested dicts: ``{"optim.epochs": [200, 400]}``."""
    changes: dict[str, list] = {}
    for key in list(before) + [k for k in after if k not in before]:
        one, two = before.get(key), after.get(key)
        if isinstance(one, Mapping) and isinstance(two, Mapping):
            changes.update(config_changes(one, two, f"{prefix}{key}."))
        elif one != two:
            changes[f"{prefix}{key}"] = [one, two]
    return changes


def holds_run_directories(function: _F) -> _F:
    """Decorator: every :class:`RunDirectory` opened during a call of ``function`` is closed
    when the call returns or raises, so its lock never outlives the run."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opened: list[RunDirectory] = []
        token = _SCOPE.set(opened)
        try:
            return function(*args, **kwargs)
        finally:
            _SCOPE.reset(token)
            for run in opened:
                run.close()

    return cast(_F, wrapper)


def write_bytes(path: Path, data: bytes | memoryview) -> Path:
    """Replace ``path`` with ``data`` atomically: write ``<name>.partial`` beside it, ``fsync``,
    ``os.replace``, ``fsync`` the folder. A crash or a failed write leaves the old file intact.

    Args:
        path: the file to replace.
        data: its new content.

    Returns:
        ``path``.

    Raises:
        RunDirError: the write failed (read-only, disk full, no permission, ...); the partial file
            is removed and the message names ``path`` and the cause.
    """
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(partial, path)
        _fsync_folder(path.parent)
    except OSError as error:
        _discard(partial)
        kept = f"; the previous {path.name} is unchanged" if path.exists() else ""
        raise RunDirError(_failure("cannot write", path, error) + kept) from None
    except BaseException:  # e.g. Ctrl-C during the write: the old file stands, the partial one goes
        _discard(partial)
        raise
    return path


def write_text(path: Path, text: str) -> Path:
    """:func:`write_bytes` of ``text`` encoded as UTF-8."""
    return write_bytes(path, text.encode())


def append_line(path: Path, line: str) -> None:
    """Append ``line`` and a newline to ``path`` (created if missing). A failed append is cut
    back to the file's previous end, so readers never see a half line.

    Raises:
        RunDirError: the write failed; the message names ``path`` and the cause.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as error:
        raise RunDirError(_failure("cannot write", path, error)) from None
    try:
        end = os.fstat(fd).st_size
        try:
            _write_all(fd, line.encode() + b"\n")
            os.fsync(fd)
        except OSError as error:
            try:
                os.ftruncate(fd, end)
            except OSError:
                pass  # the half line stays; the reader of metrics.jsonl drops lines past the checkpoint
            raise RunDirError(_failure("cannot write", path, error)) from None
    finally:
        os.close(fd)


def _discard(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass  # e.g. the folder itself is gone or read-only: nothing was written there


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _fsync_folder(folder: Path) -> None:
    """Make a rename durable (POSIX: the folder entry is data of the folder)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _holder(fd: int) -> str:
    """``pid P on host H since T`` from a lock file's content, or what is known of it."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        record = json.loads(os.read(fd, 4096).decode() or "{}")
        return f"pid {record['pid']} on host {record['host']} since {record['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its holder did not record itself"


_FIXES = {
    errno.ENOSPC: "the disk is full: free space (a run continues from its last checkpoint with "
                  "betty-train train --resume RUN_DIR)",
    errno.EDQUOT: "the disk quota is used up: free space (a run continues from its last checkpoint with "
                  "betty-train train --resume RUN_DIR)",
    errno.EROFS: "the file system is read-only: choose a writable train.run_dir",
    errno.EACCES: "no permission: make it writable or choose another train.run_dir",
    errno.EPERM: "no permission: make it writable or choose another train.run_dir",
}


def _failure(what: str, path: Path, error: OSError) -> str:
    """One line: ``<what> <path>: <strerror> (<ERRNO>); <fix>``."""
    code = errno.errorcode.get(error.errno, str(error.errno)) if error.errno else "?"
    reason = error.strerror or str(error) or type(error).__name__
    fix = _FIXES.get(error.errno, "check the path or choose another train.run_dir")
    return f"{what} {path}: {reason} ({code}); {fix}"
