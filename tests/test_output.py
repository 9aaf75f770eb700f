"""The training progress: the epoch index it names, what fits in an 80-column terminal, the status line."""

from __future__ import annotations

import io
import json
import re
from types import SimpleNamespace

from rich.console import Console

from betty_trainer.config import load_config
from betty_trainer.training.output import EpochProgress, epoch_status
from betty_trainer.training.trainer import train
from tests.conftest import REPO
from tests.test_cli import QUICK

QUICKSTART = REPO / "configs/quickstart.yaml"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
TIME = r"\d+:\d\d:\d\d"
NO_VALIDATION_YET = {"epoch": -1, "val_acc": -1.0, "test_acc": float("nan")}  # the trainer's starting `best`


def summary(loss: float = 2.7026, val_acc: float | None = 0.872, **counters: int) -> SimpleNamespace:
    fields = {"feature_hits": 0, "feature_misses": 0, "host_to_device_bytes": 0} | counters
    return SimpleNamespace(loss=loss, val_acc=val_acc, **fields)


def live_frames(width: int, description: str, status: str) -> tuple[list[str], list[str]]:
    """The last frame the live display drew on a ``width``-column colour terminal after epoch 47 of 50, and
    the same display rendered once more on its own (what stays on screen), colour codes removed."""
    console = Console(file=io.StringIO(), width=width, force_terminal=True, color_system="standard")
    with EpochProgress(console, description, total=50, completed=46) as progress:
        progress.advance(46, "loss 2.8000")
        progress.advance(47, status)
        alone = Console(file=io.StringIO(), width=width, force_terminal=True, color_system="standard")
        alone.print(progress.progress.get_renderable())
    drawn = [line for line in re.split(r"[\r\n]+", ANSI.sub("", console.file.getvalue())) if line.strip()]
    return drawn[-2:], ANSI.sub("", alone.file.getvalue()).splitlines()


def test_at_80_columns_the_bar_keeps_the_count_the_elapsed_time_and_the_eta():
    long_status = epoch_status(summary(feature_hits=30, feature_misses=70, host_to_device_bytes=3 * 2**20),
                               {"epoch": 47, "val_acc": 0.872, "test_acc": 0.86})
    for width in (80, 50):
        for description in ("synthetic · reg", "ogbn-products-with-a-very-long-name · metis"):
            drawn, alone = live_frames(width, description, long_status)
            assert drawn == alone  # the live display's last frame is what stays on screen
            bar, status = alone
            shown = re.fullmatch(rf"(.+?) [━╸╺]+ +48/50 epochs {TIME} ETA {TIME}", bar)
            assert shown, bar
            label = shown.group(1)
            assert label == description or (label.endswith("…") and description.startswith(label[:-1])), label
            assert len(bar) <= width and len(status) == width
            assert status.startswith("epoch 47 · loss 2.7026 · val 0.872 · best val 0."[:width - 1])
            assert status.endswith("…")  # the status (107 characters) is cut, not wrapped onto the bar's line


def test_on_a_wide_terminal_the_bar_is_40_columns_and_the_status_is_whole():
    status = epoch_status(summary(feature_hits=30, feature_misses=70, host_to_device_bytes=3 * 2**20),
                          {"epoch": 47, "val_acc": 0.872, "test_acc": 0.86})
    _, (bar, shown) = live_frames(120, "synthetic · reg", status)
    assert re.fullmatch(rf"synthetic · reg [━╸╺]{{40}} 48/50 epochs {TIME} ETA {TIME}", bar), bar
    assert shown == f"epoch 47 · {status}"


def test_without_a_terminal_each_epoch_is_one_line_with_its_index_the_count_done_and_the_eta():
    plain = Console(file=io.StringIO(), force_terminal=False, width=80)
    with EpochProgress(plain, "synthetic", total=4, completed=1) as progress:
        progress.advance(1, "loss 1.0 · " + "x" * 100)
        progress.advance(2, "loss 0.5")
    first, second = plain.file.getvalue().splitlines()
    assert first.startswith("epoch 1 (2/4 done) · loss 1.0 · " + "x" * 100 + " · ETA ")  # never cut
    assert re.fullmatch(rf"epoch 2 \(3/4 done\) · loss 0.5 · ETA {TIME}", second), second


def test_the_status_says_best_val_dash_until_a_validation_exists():
    assert epoch_status(summary(val_acc=None), NO_VALIDATION_YET) == "loss 2.7026 · val - · best val -"
    assert epoch_status(summary(val_acc=0.5), {"epoch": 2, "val_acc": 0.5, "test_acc": 0.25}) == \
        "loss 2.7026 · val 0.500 · best val 0.500 (epoch 2, test 0.250)"
    assert epoch_status(summary(val_acc=None), {"epoch": 2, "val_acc": 0.5, "test_acc": 0.25}) == \
        "loss 2.7026 · val - · best val 0.500 (epoch 2, test 0.250)"
    assert epoch_status(summary(), {"val_acc": 0.5, "test_acc": 0.4}) == \
        "loss 2.7026 · val 0.872 · best val 0.500 (test 0.400)"  # no epoch given: none shown
    assert epoch_status(summary(), {"epoch": 0, "val_acc": 0.5, "test_acc": float("nan")}).endswith("(epoch 0, test -)")


def test_the_status_adds_the_feature_hit_rate_and_the_bytes_moved_only_when_there_are_some():
    best = {"epoch": 0, "val_acc": 0.5, "test_acc": 0.4}
    assert "hits" not in epoch_status(summary(feature_misses=100), best)
    assert epoch_status(summary(host_to_device_bytes=3 * 2**20, feature_hits=30, feature_misses=70), best) \
        .endswith("(epoch 0, test 0.400) · feature hits 30% · 3 MiB to the device")


def test_a_run_names_its_epochs_by_the_index_of_metrics_jsonl_and_of_resuming(tmp_path):
    run = tmp_path / "run"

    def lines(epochs: int, resume: bool) -> list[str]:
        console = Console(file=io.StringIO(), force_terminal=False, width=80)
        config = load_config(QUICKSTART, [*QUICK[1:], f"optim.epochs={epochs}", "train.eval_every=2"])
        train(config, run_dir=run, resume=resume, console=console)
        return console.file.getvalue().splitlines()

    first = [line for line in lines(2, False) if line.startswith("epoch ")]
    assert [line.split(" · ")[0] for line in first] == ["epoch 0 (1/2 done)", "epoch 1 (2/2 done)"]
    resumed = lines(3, True)
    assert resumed[0].endswith("(resuming at epoch 2)")
    assert [line.split(" · ")[0] for line in resumed if line.startswith("epoch ")] == ["epoch 2 (3/3 done)"]
    recorded = [json.loads(line)["epoch"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert recorded == [0, 1, 2]


def test_the_eta_of_an_absurd_number_of_epochs_is_printed_not_an_overflow(monkeypatch):
    import time

    clock = iter(float(t) for t in range(0, 1000, 5))
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))  # rich's clock: 5 s an epoch
    stream = io.StringIO()
    with EpochProgress(Console(file=stream, width=200), "synthetic · reg", 10**18, 0, live=False) as progress:
        for epoch in range(3):
            progress.advance(epoch, "loss 1.0")
    etas = [line.rsplit("ETA ", 1)[1] for line in stream.getvalue().splitlines()]
    assert re.fullmatch(r"\d{7,}:\d\d:\d\d", etas[-1]), etas  # years of hours, as the live bar shows them
