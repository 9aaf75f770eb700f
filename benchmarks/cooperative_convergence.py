"""Cooperative against independent training under ``torchrun``: the same number of steps reach the same accuracy.

Issue 21's convergence criterion. For each dataset and sampler, ``--seeds`` seeds (config ``seed``) of
``distributed.mode=cooperative`` and of ``distributed.mode=independent``, each a ``torchrun --nproc-per-node P``
run of ``python -m betty_trainer train`` into its own temporary run directory, with the same global batch size
(``sampling.batch_size``) and epochs in both modes, so both take the same optimizer steps on global batches of the
same seeds. The test accuracy is best.pt's (the model chosen on validation: the CLI's last line). The criterion:
the two modes' mean test accuracies differ by at most 1.5 points.

Samplers: ``ns`` (uniform neighbour sampling) and ``labor-N`` (LABOR-*, ``sampling.labor.importance_iterations
= N``). NS and LABOR-0 key their randomness per vertex, so a rank's share of a cooperative batch, an independent
rank's ``B/P`` seeds and a single process sample the same edges and every mode takes the same steps: the script
checks that the two modes' per-epoch losses agree (``max |Δ loss|``) and says so. LABOR-N with N ≥ 1 computes
its probabilities from the whole dst set of a layer, which differs between a cooperative rank, an independent
rank and one process, so its steps differ and only the accuracy can be compared.

As context it prints, from metrics.jsonl (summed over the ranks): the bytes a cooperative epoch exchanges
between ranks (mean over epochs), and the host→device bytes and feature-store misses of all epochs (host→device
is 0 on the CPU, where no copy is made).

Run (2 shared CPU cores, gloo; 29.4 min measured, 24 runs):
    python benchmarks/cooperative_convergence.py
    python benchmarks/cooperative_convergence.py --datasets cora --samplers ns --seeds 1 --epochs 5
"""

from __future__ import annotations

from common import REPO_ROOT, markdown_table, name_list, shared_folder  # this folder

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

SETTINGS = {
    # batch_size >= the training split (Cora 140, Amazon Computers 200): one global batch per epoch
    "cora": {"batch_size": 256, "epochs": 30, "lr": 0.01},
    "amazon-computers": {"batch_size": 1024, "epochs": 40, "lr": 0.05},
}
"""Per dataset: the global batch size, epochs and learning rate (``--epochs`` overrides every epochs)."""

LABEL = {"cora": "Cora", "amazon-computers": "Amazon Computers"}
FAILURES: list[str] = []
"""The failed attempts that were run again."""
FINAL = re.compile(r"final test accuracy ([0-9.]+) \(model chosen on validation: epoch (\d+)")


@dataclass
class Run:
    """One torchrun run: best.pt's test accuracy and epoch, and metrics.jsonl's per-epoch records."""

    test_acc: float
    best_epoch: int
    epochs: list[dict]
    seconds: float

    def total(self, name: str) -> int:
        return sum(epoch.get(name) or 0 for epoch in self.epochs)


def config(dataset: str, sampler: str, args: argparse.Namespace) -> dict:
    """The run's config (2-layer SAGE-mean, hidden 64, fanouts 10,10, one micro-batch per rank and step)."""
    setting = SETTINGS[dataset]
    sampling = {"sampler": "ns", "fanouts": [args.fanout] * 2, "batch_size": setting["batch_size"]}
    if sampler.startswith("labor"):
        sampling |= {"sampler": "labor", "labor": {"importance_iterations": int(sampler.split("-")[1])}}
    data_dir = args.data_dir or shared_folder(dataset)
    return {"name": "convergence", "seed": 0,
            "dataset": {"name": dataset, "normalize_features": True, **({"data_dir": str(data_dir)} if data_dir else {})},
            "model": {"arch": "sage", "aggregator": "mean", "hidden": 64, "num_layers": 2, "dropout": 0.5},
            "sampling": sampling,
            "micro_batch": {"partitioner": "reg", "num_micro_batches": 1},
            "optim": {"lr": setting["lr"], "weight_decay": 0.0005, "epochs": args.epochs or setting["epochs"]},
            "train": {"device": "cpu", "progress": False},
            "distributed": {"ownership": args.ownership}}


def run(config_path: Path, mode: str, seed: int, run_dir: Path, world: int, retries: int) -> Run:
    """``torchrun --standalone --nproc-per-node world -m betty_trainer train`` in ``mode`` with ``seed``; a failed
    run is run again up to ``retries`` times (each failure kept in :data:`FAILURES` and printed).

    Raises:
        RuntimeError: the run failed ``retries + 1`` times (its output's tail), or printed no final accuracy.
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               "-m", "betty_trainer", "train", "--config", str(config_path), f"distributed.mode={mode}",
               f"seed={seed}", f"train.run_dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    for attempt in range(retries + 1):
        shutil.rmtree(run_dir, ignore_errors=True)
        start = time.perf_counter()
        done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        output = done.stdout + done.stderr
        final = FINAL.search(done.stdout)
        if done.returncode == 0 and final is not None:
            break
        failure = f"{' '.join(command)} exited {done.returncode}:\n{output[-3000:]}"
        if attempt == retries:
            raise RuntimeError(failure)
        FAILURES.append(f"{mode} seed {seed} ({run_dir.name}), exit {done.returncode}: " +
                        "; ".join(line for line in output.splitlines() if "terminate" in line or "exitcode" in line))
        print(f"{failure}\nretrying", file=sys.stderr, flush=True)
    epochs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return Run(float(final.group(1)), int(final.group(2)), epochs, seconds)


def mean_std(values: list[float]) -> str:
    """``mean ± std`` in percent (sample std; ``± 0`` for one value)."""
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.mean(values):.2f} ± {100 * std:.2f}"


def mib(value: float) -> str:
    return f"{value / 2**20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", type=name_list, default=list(SETTINGS), help=f"of {', '.join(SETTINGS)}")
    parser.add_argument("--samplers", type=name_list, default=["ns", "labor-1"],
                        help="ns, and labor-N for LABOR-* with N importance iterations (labor-0 = LABOR-0)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 … n−1 per mode")
    parser.add_argument("--epochs", type=int, default=None,
                        help="epochs of every run (default per dataset: " +
                             ", ".join(f"{k} {v['epochs']}" for k, v in SETTINGS.items()) + ")")
    parser.add_argument("--world", type=int, default=2, help="P, the processes of each run")
    parser.add_argument("--fanout", type=int, default=10, help="per layer (2 layers)")
    parser.add_argument("--ownership", choices=["metis", "random"], default="metis")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="the folder of the datasets' files (default: each one's folder in ../shared/datasets)")
    parser.add_argument("--retries", type=int, default=1, help="times a failed run is run again (reported)")
    parser.add_argument("--criterion", type=float, default=1.5, help="largest |difference| in points that passes")
    args = parser.parse_args()
    for dataset in args.datasets:
        if dataset not in SETTINGS:
            parser.error(f"--datasets: {dataset!r} is none of {', '.join(SETTINGS)}")
    for sampler in args.samplers:
        if sampler != "ns" and not re.fullmatch(r"labor-\d+", sampler):
            parser.error(f"--samplers: {sampler!r} is neither ns nor labor-N")

    started = time.perf_counter()
    results: dict[tuple[str, str, str], list[Run]] = {}
    with tempfile.TemporaryDirectory(prefix="convergence-") as folder:
        for dataset in args.datasets:
            for sampler in args.samplers:
                config_path = Path(folder) / f"{dataset}-{sampler}.yaml"
                config_path.write_text(yaml.safe_dump(config(dataset, sampler, args), sort_keys=False))
                for mode in ("cooperative", "independent"):
                    runs = results.setdefault((dataset, sampler, mode), [])
                    for seed in range(args.seeds):
                        one = run(config_path, mode, seed, Path(folder) / f"{dataset}-{sampler}-{mode}-{seed}",
                                  args.world, args.retries)
                        runs.append(one)
                        print(f"{dataset} {sampler} {mode} seed {seed}: test {one.test_acc:.4f} "
                              f"(best.pt epoch {one.best_epoch}) in {one.seconds:.0f} s", file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - started

    header = ["dataset", "sampler", "epochs", "cooperative test %", "independent test %", "difference (points)",
              f"within {args.criterion} points", "max abs Δ loss per epoch", "exchanged MiB / epoch (coop.)",
              "feature misses coop. / indep.", "host→device MiB coop. / indep."]
    rows, notes = [], []
    for dataset in args.datasets:
        for sampler in args.samplers:
            coop, indep = results[(dataset, sampler, "cooperative")], results[(dataset, sampler, "independent")]
            a, b = [r.test_acc for r in coop], [r.test_acc for r in indep]
            difference = 100 * (statistics.mean(a) - statistics.mean(b))
            loss_gap = max(abs(x["loss"] - y["loss"]) for c, i in zip(coop, indep)
                           for x, y in zip(c.epochs, i.epochs))
            exchanged = statistics.mean(e["exchanged_bytes"] or 0 for r in coop for e in r.epochs)
            name = "NS" if sampler == "ns" else f"LABOR-{sampler.split('-')[1]}"
            rows.append([LABEL[dataset], name, str(len(coop[0].epochs)), mean_std(a), mean_std(b),
                         f"{difference:+.2f}", "yes" if abs(difference) <= args.criterion else "**no**",
                         f"{loss_gap:.1e}", mib(exchanged),
                         f"{statistics.mean(r.total('feature_misses') for r in coop):,.0f} / "
                         f"{statistics.mean(r.total('feature_misses') for r in indep):,.0f}",
                         f"{mib(statistics.mean(r.total('host_to_device_bytes') for r in coop))} / "
                         f"{mib(statistics.mean(r.total('host_to_device_bytes') for r in indep))}"])
            if all(f"{x:.4f}" == f"{y:.4f}" for x, y in zip(a, b)):
                notes.append(f"{LABEL[dataset]}, {name}: every seed's cooperative and independent test accuracies "
                             f"are equal to 4 digits (max abs Δ loss {loss_gap:.1e}): the two modes take the same "
                             f"steps, as randomness keyed per vertex makes them")
            elif sampler in ("ns", "labor-0"):
                notes.append(f"{LABEL[dataset]}, {name}: the test accuracies differ although {name} keys its "
                             f"randomness per vertex (max abs Δ loss {loss_gap:.1e}): the modes' steps differ")
    print(f"P = {args.world} ranks (gloo, CPU), {args.ownership} ownership, 2-layer SAGE-mean, hidden 64, fanouts "
          f"{args.fanout},{args.fanout}, one global batch per step; {args.seeds} seeds per mode; test accuracy of "
          f"best.pt, mean ± std over seeds; counters summed over ranks, mean over seeds (misses and host→device: "
          f"all epochs)\n")
    print(markdown_table(header, rows))
    print()
    for note in notes:
        print(f"- {note}")
    for failure in FAILURES:
        print(f"- failed and run again: {failure}")
    print(f"\n{len(args.datasets) * len(args.samplers) * 2 * args.seeds} runs in {elapsed / 60:.1f} min")


if __name__ == "__main__":
    main()
