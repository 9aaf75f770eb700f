"""Distributed training launched as users launch it: ``torchrun ... -m betty_trainer train`` on loopback with gloo
(README › Several GPUs). Each test starts real processes; the synthetic quickstart graph keeps them to seconds."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
QUICK = ["--config", str(REPO / "configs" / "quickstart.yaml"), "optim.epochs=3", "sampling.fanouts=[10,10]",
         "sampling.batch_size=256", "micro_batch.num_micro_batches=2", "train.progress=false"]
_TORCH_DIST = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "GROUP_RANK",
               "ROLE_RANK", "TORCHELASTIC_RUN_ID")


def free_port() -> int:
    """A loopback port free now (torchrun's rendezvous needs TCP; another test may take it in between, rarely)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def environment(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in _TORCH_DIST}
    return {**env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra}


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def betty(*args: str) -> list[str]:
    return [sys.executable, "-m", "betty_trainer", *args]


def run(command: list[str], timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, env=environment(**env), capture_output=True, text=True, timeout=timeout)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def single_run(tmp_path_factory) -> list[dict]:
    """The quickstart in one process, the reference the distributed runs must equal."""
    run_dir = tmp_path_factory.mktemp("single") / "run"
    done = run(betty("train", *QUICK, f"train.run_dir={run_dir}"))
    assert done.returncode == 0, done.stderr
    return metrics(run_dir)


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """The quickstart on two gloo ranks under torchrun in each mode (kept for the tests that read a finished
    distributed run): mode → (run directory, the job's stdout)."""
    runs = {}
    for mode in ("cooperative", "independent"):
        run_dir = tmp_path_factory.mktemp(mode) / "run"
        done = run(torchrun("--nproc-per-node", "2", "-m", "betty_trainer", "train", *QUICK,
                            f"distributed.mode={mode}", "distributed.ownership=random", f"train.run_dir={run_dir}"))
        assert done.returncode == 0, done.stdout + done.stderr
        runs[mode] = run_dir, done.stdout
    return runs


@pytest.mark.parametrize("mode", ["cooperative", "independent"])
def test_torchrun_trains_like_one_process_and_rank_0_alone_writes(two_rank_runs, single_run, mode):
    """Two gloo ranks under torchrun: with NS (randomness keyed per node) every epoch's loss and accuracies equal
    the single process's (same global batches, the gradient of the global mean loss); one metrics line per epoch
    (rank 0 alone writes), each with both ranks' counters; one console (rank 0's)."""
    run_dir, stdout = two_rank_runs[mode]
    assert stdout.count("final test accuracy") == 1
    lines = metrics(run_dir)
    assert [line["epoch"] for line in lines] == [0, 1, 2]
    for ours, reference in zip(lines, single_run):
        assert ours["loss"] == pytest.approx(reference["loss"], rel=1e-5)  # float32 sums reassociated across ranks
        assert (ours["val_acc"], ours["test_acc"], ours["train_acc"]) == \
               (reference["val_acc"], reference["test_acc"], reference["train_acc"])
        assert len(ours["ranks"]) == 2
        assert ours["feature_misses"] == sum(rank["feature_misses"] for rank in ours["ranks"])
        assert (ours["exchanged_bytes"] > 0) == (mode == "cooperative")
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["mode"] == mode and [rank["rank"] for rank in plan["ranks"]] == [0, 1]
    identity = subprocess.run([sys.executable, "-c", "import torch,sys; print(torch.load(sys.argv[1], "
                               "weights_only=True)['identity']['distributed'])", str(run_dir / "last.pt")],
                              capture_output=True, text=True, env=environment())
    assert "'world_size': 2" in identity.stdout


def test_a_resume_with_another_number_of_processes_is_refused_and_evaluate_works_in_one(two_rank_runs):
    run_dir, _ = two_rank_runs["cooperative"]
    resumed = run(betty("train", "--resume", str(run_dir), "optim.epochs=4"))
    assert resumed.returncode == 2
    error = resumed.stderr.strip().splitlines()[-1]
    assert error.startswith("error: cannot resume") and "cooperative on 2 process(es)" in error, resumed.stderr
    evaluated = run(betty("evaluate", "--run", str(run_dir)))
    assert evaluated.returncode == 0 and "test" in evaluated.stdout, evaluated.stderr


_HOLDERS_OF_THE_GROUP = """
import gc, sys
import betty_trainer.distributed.group as group
import betty_trainer.training.distributed as distributed
from betty_trainer.cli import main
made = []
def join(*args, **kwargs):
    processes = group.join(*args, **kwargs)
    made.append(processes.group)
    return processes
distributed.join = join
status = main(sys.argv[1:])
gc.collect()
print("holders", sys.getrefcount(made[0]) - 2, "dynamo" in " ".join(sys.modules))
sys.exit(status)
"""


def test_a_finished_run_leaves_nothing_holding_its_process_group(tmp_path):
    """Once ``train`` returns, nothing but the caller holds the process group's Python object, so gloo tears it
    down then, not at interpreter finalisation (where a rank could abort after its run had finished, SIGABRT).
    torch imports ``torch.distributed.nn.functional`` lazily (through ``torch._dynamo``), and its functions'
    default ``group`` arguments held the group when that import came after the group was made. A fresh
    interpreter, so that no earlier test imported it first; a world of one process runs the same code."""
    done = run([sys.executable, "-c", _HOLDERS_OF_THE_GROUP, "train", *QUICK, "optim.epochs=1",
                "distributed.mode=cooperative", f"train.run_dir={tmp_path / 'run'}"])
    assert done.returncode == 0, done.stderr
    holders, dynamo = done.stdout.strip().splitlines()[-1].split()[1:]
    assert dynamo == "True", "torch._dynamo was not imported: the lazy import this test guards against did not happen"
    assert holders == "0", done.stdout


def test_processes_with_different_configs_are_refused_before_training(tmp_path):
    """Two processes started as torchrun would (its environment variables), one with another learning rate: both
    stop before anything is written, with one line naming what differs and the ranks."""
    port, run_dir = free_port(), tmp_path / "run"
    procs = [subprocess.Popen(betty("train", *QUICK, "distributed.mode=cooperative", f"train.run_dir={run_dir}",
                                    f"optim.lr={lr}"),
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=environment(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for rank, lr in enumerate(["0.01", "0.02"])]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    for rank, (proc, (_, stderr)) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 2, stderr
        assert f"error: rank {rank}: the processes of this run differ in their config" in stderr
        assert "rank 0 has" in stderr and "rank 1 has" in stderr
    assert not (run_dir / "metrics.jsonl").exists()


def _rank_pid(parent: int, rank: int) -> int | None:
    """The pid of the worker of ``rank`` among ``parent``'s children (read from its environment)."""
    for child in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
        try:
            variables = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in variables:
            return int(child)
    return None


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the worker's pid through Linux's /proc")
def test_a_killed_rank_ends_the_job_within_60_s_naming_it(tmp_path):
    run_dir = tmp_path / "run"
    agent = subprocess.Popen(torchrun("--nproc-per-node", "2", "-m", "betty_trainer", "train", *QUICK,
                                      "optim.epochs=100000", "distributed.mode=cooperative",
                                      "distributed.ownership=random", f"train.run_dir={run_dir}"),
                             cwd=REPO, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "metrics.jsonl").read_text():
            assert time.monotonic() < deadline and agent.poll() is None, "the run did not start"
            time.sleep(0.2)
        victim = _rank_pid(agent.pid, 1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)  # mid-epoch: epochs take about 0.3 s
        killed = time.monotonic()
        output, _ = agent.communicate(timeout=60)
        assert time.monotonic() - killed < 60
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode != 0
    assert "rank: 1" in output and "Signal 9 (SIGKILL)" in output, output[-3000:]  # torchrun's root cause


def test_two_torchrun_agents_on_loopback_train_one_model(tmp_path):
    """Two nodes as torchrun runs them (``--nnodes 2`` with a c10d rendezvous), here two agents on one machine."""
    port, run_dir = free_port(), tmp_path / "run"
    agents = [subprocess.Popen(torchrun("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                                        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "betty-test",
                                        "-m", "betty_trainer", "train", *QUICK, "distributed.mode=cooperative",
                                        "distributed.ownership=random", f"train.run_dir={run_dir}"),
                               cwd=REPO, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    outputs = [agent.communicate(timeout=240)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(output[-2000:] for output in outputs)
    assert sum(output.count("final test accuracy") for output in outputs) == 1
    assert [line["epoch"] for line in metrics(run_dir)] == [0, 1, 2]


@pytest.mark.parametrize("override, named", [
    ("sampling.sampler=gns sampling.fanouts=[5,5]", "sampling.sampler"),
    ("micro_batch.mode=layerwise", "micro_batch.mode=micro_batches"),
("features.macro_batch=2", "features.macro_batch=0"),
])
def test_what_cooperative_mode_does_not_run_is_refused_by_validate_in_one_line(tmp_path, capsys, override, named):
    from betty_trainer.cli import main

    config = tmp_path / "c.yaml"
    config.write_text("distributed:\n  mode: cooperative\n")
    assert main(["validate", "--config", str(config), *override.split()]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: distributed.mode=cooperative") and named in error and "\n" not in error


def test_plan_under_torchrun_estimates_and_measures_every_ranks_rounds(tmp_path, planetoid_dir):
    """``betty-train plan --measure`` on two cooperative ranks (Cora, 1433-wide input rows): every rank's rounds,
    estimated with the exchanges' buffers, measured on that rank, within the estimator's 0.1%; one table per rank,
    printed by rank 0 alone."""
    output = tmp_path / "plan.json"
    done = run(torchrun("--nproc-per-node", "2", "-m", "betty_trainer", "plan", "--config",
                        str(REPO / "configs" / "cora-ns.yaml"), "--data-dir", str(planetoid_dir),
                        "distributed.mode=cooperative", "micro_batch.num_micro_batches=2", "--measure",
                        "--output", str(output)))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.count("rank 0 of 2") == 1 and done.stdout.count("rank 1 of 2") == 1 and "exchange" in done.stdout
    ranks = json.loads(output.read_text())["ranks"]
    rows = [row for rank in ranks for row in rank["pieces"]]
    assert len(rows) == 4 and all(abs(row["error"]) <= 1e-3 for row in rows)
    assert any(row["estimate"]["at_peak"]["exchange_buffers"] > 0 for row in rows)  # the peak at an exchange



def test_under_a_budget_the_ranks_agree_on_the_fewest_rounds_that_fit_every_share(tmp_path):
    """``plan.json`` holds each rank's rounds with their estimates (exchange buffers included); under a budget below
    one round's largest estimate every rank runs the same, larger number of rounds, each estimated within it, and
    holds their shares (``plan_host_bytes``; none for one round, which is the batch)."""
    common = [*QUICK, "optim.epochs=1", "distributed.mode=cooperative", "distributed.ownership=random"]
    one = run(torchrun("--nproc-per-node", "2", "-m", "betty_trainer", "train", *common,
                       "micro_batch.num_micro_batches=1", f"train.run_dir={tmp_path / 'one'}"))
    assert one.returncode == 0, one.stderr
    ranks = json.loads((tmp_path / "one" / "plan.json").read_text())["ranks"]
    largest = max(row["estimate"]["peak_bytes"] for rank in ranks for row in rank["pieces"])
    assert all("exchange_buffers" in row["estimate"]["at_peak"] for rank in ranks for row in rank["pieces"])
    assert all(rank["plan_host_bytes"] == 0 for rank in ranks), "one round is the batch itself"
    budget = int(0.9 * largest)
    fitted = run(torchrun("--nproc-per-node", "2", "-m", "betty_trainer", "train", *common,
                          f"micro_batch.budget={budget}", f"train.run_dir={tmp_path / 'budget'}"))
    assert fitted.returncode == 0, fitted.stderr
    ranks = json.loads((tmp_path / "budget" / "plan.json").read_text())["ranks"]
    assert len({rank["num_pieces"] for rank in ranks}) == 1 and ranks[0]["num_pieces"] > 1
    assert all(rank["plan_host_bytes"] > 0 for rank in ranks), "the rounds' shares are the plan's own"
    assert all(row["estimate"]["peak_bytes"] <= budget for rank in ranks for row in rank["pieces"])


def test_global_batches_smaller_than_the_ranks_leave_a_rank_without_seeds_and_still_train(tmp_path):
    """One seed per global batch on two independent ranks: every step one rank has no seeds; it joins the
    collectives with no gradient of its own, and the run equals one process's (a cooperative rank that owns none of
    a round's seeds: tests/test_cooperative.py, 5 seeds in 3 rounds on 4 ranks)."""
    mode = "independent"
    single = [*QUICK, "optim.epochs=1", "sampling.batch_size=1", "dataset.synthetic.train_per_class=2"]
    reference = run(betty("train", *single, f"train.run_dir={tmp_path / 'single'}"))
    assert reference.returncode == 0, reference.stderr
    done = run(torchrun("--nproc-per-node", "2", "-m", "betty_trainer", "train", *single, f"distributed.mode={mode}",
                        "distributed.ownership=random", f"train.run_dir={tmp_path / 'run'}"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    ours, theirs = metrics(tmp_path / "run")[0], metrics(tmp_path / "single")[0]
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
    assert (ours["val_acc"], ours["test_acc"]) == (theirs["val_acc"], theirs["test_acc"])
