"""The run directory: one run at a time (a lock), and a read-only directory or a full disk ends in a
one-line error that names the path and the cause, with the last good checkpoint intact.

Read-only file systems and full disks are simulated by failing ``os.open``/``os.mkdir``/``os.write``
for paths in the run directory with the errno the kernel gives (the suite runs as root, for whom a
``chmod 0o555`` folder stays writable).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from betty_trainer.errors import RunDirError
from betty_trainer.training.checkpoint import CHECKPOINT_NAME, load_checkpoint
from betty_trainer.training.rundir import LOCK_NAME, RunDirectory, append_line, write_text
from tests.conftest import REPO
from tests.test_cli import QUICK, assert_one_line_error, betty_in_process


def train_args(run: Path, *extra: str) -> list[str]:
    return ["train", "--config", str(REPO / "configs/quickstart.yaml"), *QUICK, f"train.run_dir={run}", *extra]


class FaultyDisk:
    """Makes ``os.mkdir``, ``os.open`` (for writing) and ``os.write`` fail with an errno for files under
    ``root`` once ``when(path)`` is true; every other call goes to the real function."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path):
        self.root, self.fds, self.rules = str(root), {}, []
        self.real_open, self.real_write, self.real_mkdir = os.open, os.write, os.mkdir
        monkeypatch.setattr(os, "open", self.open)
        monkeypatch.setattr(os, "write", self.write)
        monkeypatch.setattr(os, "mkdir", self.mkdir)

    def fail(self, call: str, code: int, when=lambda path: True, partial: bool = False) -> None:
        """Fail ``call`` (``open``, ``write`` or ``mkdir``) with ``code``; ``partial``: a write first
        writes half its bytes, as a disk that fills up mid-write does."""
        self.rules.append((call, code, when, partial))

    def _check(self, call: str, path: str) -> tuple[int, bool] | None:
        if not path.startswith(self.root):
            return None
        for rule_call, code, when, partial in self.rules:
            if rule_call == call and when(Path(path)):
                return code, partial
        return None

    def mkdir(self, path, *args, **kwargs):
        if (hit := self._check("mkdir", os.path.abspath(path))) is not None:
            raise OSError(hit[0], os.strerror(hit[0]), str(path))
        return self.real_mkdir(path, *args, **kwargs)

    def open(self, path, flags, *args, **kwargs):
        full = os.path.abspath(path)
        writes = flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        if writes and (hit := self._check("open", full)) is not None:
            raise OSError(hit[0], os.strerror(hit[0]), str(path))
        fd = self.real_open(path, flags, *args, **kwargs)
        self.fds[fd] = full
        return fd

    def write(self, fd, data):
        if (hit := self._check("write", self.fds.get(fd, ""))) is not None:
            code, partial = hit
            if partial:
                self.real_write(fd, bytes(data)[: len(data) // 2])
            raise OSError(code, os.strerror(code))
        return self.real_write(fd, data)


def metrics_lines(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_second_run_into_a_run_directory_in_use_is_refused_and_a_dead_holder_is_taken_over(tmp_path, capsys):
    run = tmp_path / "run"
    hold = ("import sys; from pathlib import Path; from betty_trainer.training.rundir import RunDirectory; "
            f"run = RunDirectory.open(Path({str(run)!r})); print('locked', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", hold], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        refused = betty_in_process(capsys, *train_args(run))
        assert_one_line_error(refused, f"run directory {run} is in use by another run (pid {holder.pid} on host ",
                              "wait for it to end, or choose another train.run_dir")
        assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]  # nothing of the refused run was written
    finally:
        holder.kill()  # dies without releasing anything itself: the kernel drops its lock
        holder.wait()
    assert json.loads((run / LOCK_NAME).read_text())["pid"] == holder.pid  # the stale lock file stays behind
    taken_over = betty_in_process(capsys, *train_args(run))
    assert taken_over.returncode == 0, taken_over.stderr
    assert json.loads((run / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert load_checkpoint(run)["epoch"] == 1
    with RunDirectory.open(run, create=False):  # the finished run released its lock; a resume is refused now
        assert_one_line_error(betty_in_process(capsys, "train", "--resume", str(run), "optim.epochs=3"),
                              "is in use by another run", f"pid {os.getpid()} on host")
    with pytest.raises(RunDirError, match="does not exist; nothing to resume"):
        RunDirectory.open(tmp_path / "missing", create=False)


@pytest.mark.parametrize("code, cause", [(errno.ENOSPC, "No space left on device (ENOSPC); the disk is full"),
                                         (errno.EDQUOT, "(EDQUOT); the disk quota is used up")])
def test_a_full_disk_while_checkpointing_keeps_the_last_good_checkpoint_and_the_run_resumes(tmp_path, capsys,
                                                                                            monkeypatch, code, cause):
    run = tmp_path / "run"
    disk = FaultyDisk(monkeypatch, run)
    good = {}

    def second_checkpoint(path: Path) -> bool:
        if not path.name.startswith(CHECKPOINT_NAME) or not (run / CHECKPOINT_NAME).exists():
            return False
        good.setdefault("bytes", (run / CHECKPOINT_NAME).read_bytes())  # what epoch 0 left
        return True

    disk.fail("write", code, second_checkpoint, partial=True)
    failed = betty_in_process(capsys, *train_args(run, "optim.epochs=3"))
    assert_one_line_error(failed, f"cannot write {run / CHECKPOINT_NAME}: ", cause,
                          f"the previous {CHECKPOINT_NAME} is unchanged")
    assert (run / CHECKPOINT_NAME).read_bytes() == good["bytes"]
    assert load_checkpoint(run)["epoch"] == 0
    assert not (run / (CHECKPOINT_NAME + ".partial")).exists()
    assert [m["epoch"] for m in metrics_lines(run)] == [0, 1]  # epoch 1's line came before its checkpoint failed

    monkeypatch.undo()  # space freed
    resumed = betty_in_process(capsys, "train", "--resume", str(run), "optim.epochs=3")
    assert resumed.returncode == 0, resumed.stderr
    assert load_checkpoint(run)["epoch"] == 2
    assert [m["epoch"] for m in metrics_lines(run)] == [0, 1, 2]


def test_a_full_disk_while_appending_metrics_leaves_no_half_line(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    disk = FaultyDisk(monkeypatch, run)
    disk.fail("write", errno.ENOSPC, lambda path: path.name == "metrics.jsonl" and path.stat().st_size > 0,
              partial=True)
    failed = betty_in_process(capsys, *train_args(run))
    assert_one_line_error(failed, f"cannot write {run / 'metrics.jsonl'}: No space left on device (ENOSPC)")
    assert (run / "metrics.jsonl").read_text().endswith("\n")
    assert [m["epoch"] for m in metrics_lines(run)] == [0]
    assert load_checkpoint(run)["epoch"] == 0


@pytest.mark.parametrize("code, cause", [
    (errno.EROFS, "Read-only file system (EROFS); the file system is read-only: choose a writable train.run_dir"),
    (errno.EACCES, "Permission denied (EACCES); no permission: make it writable or choose another train.run_dir"),
])
def test_a_read_only_run_directory_is_a_one_line_error_that_keeps_the_checkpoint(tmp_path, capsys, monkeypatch,
                                                                                 code, cause):
    # A new run under a read-only folder cannot create its run directory.
    disk = FaultyDisk(monkeypatch, tmp_path / "read-only")
    disk.fail("mkdir", code)
    new = tmp_path / "read-only" / "run"
    assert_one_line_error(betty_in_process(capsys, *train_args(new)), f"cannot create run directory {new}: ", cause)
    assert not new.exists()
    monkeypatch.undo()

    # A run whose directory turns read-only after its first checkpoint stops at the next write.
    run = tmp_path / "run"
    disk = FaultyDisk(monkeypatch, run)
    disk.fail("open", code, lambda path: (run / CHECKPOINT_NAME).exists())
    stopped = betty_in_process(capsys, *train_args(run, "optim.epochs=3"))
    assert_one_line_error(stopped, f"cannot write {run}/", cause)
    assert load_checkpoint(run)["epoch"] == 0
    good = (run / CHECKPOINT_NAME).read_bytes()

    # Resuming in it is refused before anything is read or written; the checkpoint stays as it was.
    refused = betty_in_process(capsys, "train", "--resume", str(run), "optim.epochs=3")
    assert_one_line_error(refused, f"cannot lock run directory {run / LOCK_NAME}: ", cause)
    assert (run / CHECKPOINT_NAME).read_bytes() == good


def test_atomic_writes_replace_whole_files_or_nothing(tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    write_text(path, "first")
    disk = FaultyDisk(monkeypatch, tmp_path)
    disk.fail("write", errno.ENOSPC, partial=True)
    with pytest.raises(RunDirError, match=r"cannot write .*plan\.json: No space left on device \(ENOSPC\); .*"
                                          r"the previous plan\.json is unchanged"):
        write_text(path, "second, longer than the first")
    assert path.read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
    monkeypatch.undo()
    append_line(tmp_path / "log", "a")
    write_text(path, "second")
    assert path.read_text() == "second" and (tmp_path / "log").read_text() == "a\n"


def test_plan_output_on_a_read_only_path_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    disk = FaultyDisk(monkeypatch, tmp_path)
    disk.fail("open", errno.EROFS)
    result = betty_in_process(capsys, "plan", "--config", str(REPO / "configs/quickstart.yaml"), *QUICK,
                              "--output", str(tmp_path / "plan.json"))
    assert_one_line_error(result, f"cannot write {tmp_path / 'plan.json'}: Read-only file system (EROFS)")
