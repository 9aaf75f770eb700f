"""Accuracy of the closed-form memory estimator against measured peaks (CPU, or CUDA with ``--device cuda``), per
micro-batch.

Source: Betty (ASPLOS '23) §4.4.3, Table 7. For each dataset, model, number of
layers, hidden width and K, the full training batch (full neighbourhood unless
``--fanouts``/``--fanouts3`` are given) is split into K micro-batches with REG
(``plan_micro_batches(batch, K, "reg", seed)``). The model is built with a fixed
seed, Adam is warmed by one measured step (so its two moments exist, as in steady
state), then every micro-batch is estimated (``estimate_micro_batch``) and run for
real (``measure_training_step`` on the CPU: peak of the profiler's allocation
records), as training runs it: the micro-batches after the first accumulate into
the earlier ones' gradients (``accumulate=True`` for both). The error of a micro-batch is ``(estimate − measured) / measured``;
a row reports the largest |error|, the worst (most negative) error, the mean
error, the number of micro-batches, the largest measured peak (MiB), the wall time
of the row's measured steps (the Adam warm-up step and the profiler included) and
the estimator's own time for all the row's micro-batches.

``synthetic-100k`` is ``make_sbm(num_nodes=100_000, num_features=64, avg_degree=10,
train_per_class=200, num_val=1000, num_test=1000)``. sage-lstm is slow on CPU where
the features are wide: its input-layer LSTM is as wide as the features (1433 on
Cora, 3703 on CiteSeer), so a Cora step takes tens of seconds and a CiteSeer step
minutes; ``--models`` without ``sage-lstm`` runs the rest quickly.

Run:
    python benchmarks/estimator_accuracy.py --quick
    python benchmarks/estimator_accuracy.py --datasets cora,citeseer --layers 2 --hidden 64,256 --ks 1,4,8
    python benchmarks/estimator_accuracy.py --models sage-mean,sage-gcn,sage-pool,gcn,gat --json estimator.json
    python benchmarks/estimator_accuracy.py --models sage-lstm --fanouts 10,25 --fanouts3 5,10,15
    python benchmarks/estimator_accuracy.py --layerwise --models sage-mean,gcn,gat --layers 2 --ks 2,4,8
    python benchmarks/estimator_accuracy.py --custom                 # custom models, recorded (issue 24)
    python benchmarks/estimator_accuracy.py --custom --datasets amazon-computers --fanouts 10,25

``--layerwise``: each row runs layer by layer instead (``micro_batch.mode=layerwise``), K METIS chunks per layer
(``chunk_layers(batch.blocks, K, "metis", seed)``), estimated by ``estimate_layerwise`` (with the model's projected
layers) and measured by ``measure_layerwise_step``: one step per row, reported as one "micro-batch".

``--custom``: the models of ``benchmarks/custom_models.py`` (GIN, JK-Net, a two-head GAT with edge features from
``torch_geometric.nn.GATConv``, PyG's GraphSAGE through ``PyGModel``), each recorded once per dataset by
``betty_trainer.memory.recorded.record_model`` (the estimate ``train(config, model=...)`` plans with), then every
micro-batch estimated and measured as above.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Sequence

# Kineto logs two "USDT … profiler_start/stop" lines per measured step on stderr; level 6
# silences them (set KINETO_LOG_LEVEL yourself to see kineto's messages).
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import common  # noqa: E402  (this folder)
from common import int_list, name_list  # noqa: E402

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from betty_trainer import plan_micro_batches, sample_batch  # noqa: E402
from betty_trainer.config import load_config  # noqa: E402
from betty_trainer.data.block import Batch  # noqa: E402
from betty_trainer.data.feature_store import HostFeatureStore  # noqa: E402
from betty_trainer.data.graph import Graph  # noqa: E402
from betty_trainer.datasets import DATASETS  # noqa: E402
from betty_trainer.errors import BettyError  # noqa: E402
from betty_trainer.execution.layerwise import LayerwisePlan, measure_layerwise_step  # noqa: E402
from betty_trainer.execution.micro_batches import measure_training_step  # noqa: E402
from betty_trainer.memory.recorded import record_model  # noqa: E402
from betty_trainer.memory.spec import model_spec  # noqa: E402
from betty_trainer.models import build_model, set_dropout_key  # noqa: E402
from custom_models import CUSTOM_MODELS  # noqa: E402  (this folder)
from estimator.counts import counts_of  # noqa: E402
from estimator.estimate import estimate_micro_batch  # noqa: E402
from estimator.layerwise import estimate_layerwise  # noqa: E402
from partition.chunks import chunk_layers  # noqa: E402

MIB = 2**20
CPU = torch.device("cpu")
TOLERANCE = 0.05

MODELS: dict[str, list[str]] = {
    "sage-mean": ["model.arch=sage", "model.aggregator=mean"],
    "sage-gcn": ["model.arch=sage", "model.aggregator=gcn"],
    "sage-pool": ["model.arch=sage", "model.aggregator=pool"],
    "sage-lstm": ["model.arch=sage", "model.aggregator=lstm"],
    "gcn": ["model.arch=gcn"],
    "gat": ["model.arch=gat"],
}

DEFAULTS = dict(datasets=["cora", "citeseer", "synthetic-100k"], layers=[2, 3], hidden=[64, 256], ks=[1, 4, 8])
QUICK = dict(datasets=["cora"], layers=[2], hidden=[64], ks=[1, 4])
CUSTOM = dict(datasets=["cora"], layers=[2], hidden=[64], ks=[1, 4])
"""``--custom``'s defaults (issue 24's grid is these and ``--datasets amazon-computers --fanouts 10,25``)."""


def built_in(graph: Graph, overrides: Sequence[str], seed: int, device: torch.device):
    """A built-in model of ``overrides`` on ``device`` (seeded, its dropout key set), its estimator spec and its Adam."""
    config = load_config(None, overrides)
    spec = model_spec(config, graph, device)
    torch.manual_seed(seed)
    model = build_model(config.model, graph).to(device)
    set_dropout_key(model, seed, 0)
    return spec, model, torch.optim.Adam(model.parameters(), lr=config.optim.lr, weight_decay=config.optim.weight_decay)


def measure_row(graph: Graph, overrides: Sequence[str], micro_batches: Sequence[Batch], seed: int,
                device: torch.device = CPU) -> dict[str, Any]:
    """Estimate and measure every micro-batch of one built-in (model, layers, hidden, K) cell on ``device`` (CUDA:
    the estimate of the path CUDA takes, the measured ``max_memory_allocated`` and ``max_memory_reserved``).

    Returns the row's record: the per-micro-batch numbers and aggregates (:func:`measured_micro_batches`).
    """
    spec, model, optimizer = built_in(graph, overrides, seed, device)

    def estimate(counts, accumulate: bool) -> tuple[int, str | None]:
        peak = estimate_micro_batch(counts, spec, accumulate=accumulate)
        return peak.peak_bytes, peak.at_peak

    return measured_micro_batches(graph, model, optimizer, estimate, micro_batches, device)


def layerwise_row(graph: Graph, overrides: Sequence[str], batch: Batch, k: int, seed: int,
                  device: torch.device = CPU) -> dict[str, Any]:
    """One built-in (model, layers, hidden, K) cell run layer by layer in ``k`` METIS chunks per layer: its
    estimate (``estimate_layerwise``) against the step measured by ``measure_layerwise_step`` after one warm-up
    step (Adam's state), in :func:`measured_micro_batches`' record with the step as its one "micro-batch"."""
    spec, model, optimizer = built_in(graph, overrides, seed, device)
    chunks = chunk_layers(batch.blocks, k, "metis", seed)
    plan = LayerwisePlan(batch, chunks, work=0.0, partitioners=["metis"] * len(batch.blocks))
    features = HostFeatureStore(graph.x, pin=False)
    start = time.perf_counter()
    measure_layerwise_step(model, optimizer, plan, features, graph.y, device)  # Adam's state exists from here on
    warm_s = time.perf_counter() - start
    t0 = time.perf_counter()
    estimate = estimate_layerwise(counts_of(batch.blocks), [counts_of(layer, [False] * len(layer))
                                                            for layer in chunks.layers], spec, spec.projections)
    estimate_s = time.perf_counter() - t0
    measured = measure_layerwise_step(model, optimizer, plan, features, graph.y, device)
    error = (estimate.peak_bytes - measured.peak_bytes) / measured.peak_bytes
    step = {"reserved_bytes": torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None,
            "micro_batch": 0, "outputs": batch.output_nodes.numel(), "input_nodes": batch.input_nodes.numel(),
            "chunks_per_layer": [len(layer) for layer in chunks.layers], "estimate_bytes": estimate.peak_bytes,
            "measured_bytes": measured.peak_bytes, "error": error, "estimate_at_peak": estimate.at_peak}
    return {"num_micro_batches": 1, "max_abs_error": abs(error), "worst_error": error, "mean_error": error,
            "max_measured_bytes": measured.peak_bytes, "seconds": time.perf_counter() - start, "warm_seconds": warm_s,
            "estimate_ms": estimate_s * 1e3, "micro_batches": [step]}


def custom_row(graph: Graph, name: str, hidden: int, micro_batches: Sequence[Batch], seed: int) -> dict[str, Any]:
    """:func:`measure_row` for the custom model ``name`` (``benchmarks/custom_models.py``, 2 layers) on the CPU,
    estimated by the recorder (``betty_trainer.memory.recorded.record_model``, recorded once per model and graph;
    its time is the row's ``record_s``)."""
    torch.manual_seed(seed)
    model = CUSTOM_MODELS[name](graph.num_features, hidden, graph.num_classes)
    config = load_config(None, [])

    def adam(parameters):
        return torch.optim.Adam(parameters, lr=config.optim.lr, weight_decay=config.optim.weight_decay)

    started = time.perf_counter()
    recorded = record_model(model, graph, 2, adam)
    record_s = time.perf_counter() - started
    row = measured_micro_batches(graph, model, adam(model.parameters()),
                                 lambda counts, accumulate: (recorded.estimate(counts, accumulate), None),
                                 micro_batches, CPU)
    return {**row, "record_s": record_s}


def measured_micro_batches(graph: Graph, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                           estimate: Callable[[Any, bool], tuple[int, str | None]], micro_batches: Sequence[Batch],
                           device: torch.device) -> dict[str, Any]:
    """Every micro-batch's ``estimate(counts, accumulate)`` (bytes, and where the peak falls or ``None``) against
    its peak measured as training runs it, after one step that creates Adam's state; the row's aggregates."""
    features = HostFeatureStore(graph.x, pin=False)
    start = time.perf_counter()
    measure_training_step(model, optimizer, micro_batches[0], features, graph.y, device)  # Adam state exists
    warm_s = time.perf_counter() - start
    per_mb, estimate_s = [], 0.0
    total = sum(micro_batch.output_nodes.numel() for micro_batch in micro_batches)
    for index, micro_batch in enumerate(micro_batches):
        t0 = time.perf_counter()
        estimated, at_peak = estimate(counts_of(micro_batch.blocks), index > 0)
        estimate_s += time.perf_counter() - t0
        measured = measure_training_step(model, optimizer, micro_batch, features, graph.y, device,
                                         num_outputs=total, accumulate=index > 0)
        reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
        per_mb.append({
            "reserved_bytes": reserved,
            "micro_batch": index,
            "outputs": micro_batch.output_nodes.numel(),
            "input_nodes": micro_batch.input_nodes.numel(),
            "estimate_bytes": estimated,
            "measured_bytes": measured.peak_bytes,
            "error": (estimated - measured.peak_bytes) / measured.peak_bytes,
            "estimate_at_peak": at_peak,
        })
    errors = [mb["error"] for mb in per_mb]
    return {
        "num_micro_batches": len(per_mb),
        "max_abs_error": max(abs(e) for e in errors),
        "worst_error": min(errors),
        "mean_error": sum(errors) / len(errors),
        "max_measured_bytes": max(mb["measured_bytes"] for mb in per_mb),
        "seconds": time.perf_counter() - start,
        "warm_seconds": warm_s,
        "estimate_ms": estimate_s * 1e3,
        "micro_batches": per_mb,
    }


def fanouts_for(num_layers: int, args: argparse.Namespace) -> list[int | None]:
    """``--fanouts`` for 2-layer rows, ``--fanouts3`` for 3-layer rows, else the full neighbourhood."""
    given = {2: args.fanouts, 3: args.fanouts3}.get(num_layers)
    return [None if f == -1 else f for f in given] if given else [None] * num_layers


def summary(rows: list[dict[str, Any]]) -> str:
    """One line over every row with numbers: max |error|, worst under-estimate, the 5% verdict."""
    if not rows:
        return "summary: no row has numbers"

    def where(r: dict[str, Any]) -> str:
        return f"{r['dataset']} {r['model']} L={r['layers']} h={r['hidden']} K={r['k']}"

    largest = max(rows, key=lambda r: r["max_abs_error"])
    worst = min(rows, key=lambda r: r["worst_error"])
    within = all(r["max_abs_error"] <= TOLERANCE for r in rows)
    never_below = all(r["worst_error"] >= -TOLERANCE for r in rows)
    low = min(worst["micro_batches"], key=lambda mb: mb["error"])
    under = (f"worst under-estimate {worst['worst_error']:+.3%} = {low['estimate_bytes'] - low['measured_bytes']:+,} "
             f"bytes ({where(worst)})" if worst["worst_error"] < 0
             else f"no under-estimate (smallest error {worst['worst_error']:+.3%}, {where(worst)})")
    count = sum(r["num_micro_batches"] for r in rows)
    return (f"summary over {len(rows)} rows, {count} micro-batches: max |error| {largest['max_abs_error']:.3%} "
            f"({where(largest)}); {under}; every estimate within ±{TOLERANCE:.0%}: {'yes' if within else 'NO'}; "
            f"never more than {TOLERANCE:.0%} below the measurement: {'yes' if never_below else 'NO'}")


def parse_args(argv=None) -> argparse.Namespace:
    """The options, with ``--quick``'s or the defaults filled in; ``parser.error`` on values it cannot run."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="folder of the datasets' raw files (default: each one's folder in ../shared/datasets)")
    parser.add_argument("--datasets", type=name_list, default=None,
                        help=f"e.g. cora,citeseer (default {','.join(DEFAULTS['datasets'])}); "
                             f"synthetic: {', '.join(common.SBM)}")
    parser.add_argument("--models", type=name_list, default=None,
                        help=f"from {','.join(MODELS)} (default all); with --custom from {','.join(CUSTOM_MODELS)}")
    parser.add_argument("--custom", action="store_true",
                        help="custom models (benchmarks/custom_models.py) estimated by the recorder, 2 layers "
                             f"(default: {','.join(CUSTOM['datasets'])}, K {','.join(map(str, CUSTOM['ks']))})")
    parser.add_argument("--layerwise", action="store_true",
                        help="run each row layer by layer, K METIS chunks per layer (micro_batch.mode=layerwise)")
    parser.add_argument("--layers", type=int_list, default=None, help="numbers of layers (default 2,3)")
    parser.add_argument("--hidden", type=int_list, default=None, help="hidden widths (default 64,256)")
    parser.add_argument("--ks", type=int_list, default=None, help="numbers of micro-batches (default 1,4,8)")
    parser.add_argument("--fanouts", type=int_list, default=None,
                        help="fanouts of 2-layer rows, input layer first, e.g. 10,25 (-1 = full); default full")
    parser.add_argument("--fanouts3", type=int_list, default=None,
                        help="fanouts of 3-layer rows, input layer first, e.g. 5,10,15 (-1 = full); default full")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="extra config override for every model, e.g. model.dropout=0 (repeatable)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model, sampling, REG and dropout")
    parser.add_argument("--quick", action="store_true",
                        help="cora only, hidden 64, 2 layers, K 1,4 (options given explicitly still win)")
    parser.add_argument("--json", type=Path, default=None, help="write all raw numbers to this file")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: max_memory_allocated (and reserved) per step")
    args = parser.parse_args(argv)

    base = CUSTOM if args.custom else QUICK if args.quick else DEFAULTS
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    known = CUSTOM_MODELS if args.custom else MODELS
    args.models = list(known) if args.models is None else args.models
    if args.custom and args.layerwise:
        parser.error("--custom models are estimated by the recorder for micro-batches, not layer by layer")
    if args.custom and (args.layers != [2] or args.device != "cpu"):
        parser.error("--custom models have 2 layers and are recorded on the CPU (--layers 2, --device cpu)")
    unknown = [d for d in args.datasets if d not in DATASETS and d not in common.SBM]
    if unknown:
        parser.error(f"unknown dataset(s) {', '.join(unknown)}; known: {', '.join([*DATASETS, *common.SBM])}")
    unknown = [m for m in args.models if m not in known]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(known)}")
    for option, fanouts, length in (("--fanouts", args.fanouts, 2), ("--fanouts3", args.fanouts3, 3)):
        if fanouts is not None and len(fanouts) != length:
            parser.error(f"{option} needs {length} values (one per layer, input layer first), got {fanouts}")
        if fanouts is not None and any(f == 0 or f < -1 for f in fanouts):
            parser.error(f"{option}: each fanout must be positive, or -1 for the full neighbourhood")
    if any(n < 1 for n in args.layers) or any(h < 1 for h in args.hidden) or any(k < 1 for k in args.ks):
        parser.error("--layers, --hidden and --ks take positive integers")
    try:
        for overrides in [MODELS.get(m, []) + args.overrides for m in args.models]:
            load_config(None, overrides)
    except BettyError as error:
        parser.error(str(error))
    return args


def dataset_rows(name: str, graph: Graph, args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[int, Batch]]:
    """Every (model, layers, hidden, K) row of one dataset (:func:`measure_row`), and its full batch per layer count."""
    batches = {num_layers: sample_batch(graph, graph.train_idx, fanouts_for(num_layers, args),
                                        torch.Generator().manual_seed(args.seed)) for num_layers in args.layers}
    splits: dict[tuple[int, int], list[Batch]] = {}
    rows: list[dict[str, Any]] = []
    for model_name, num_layers, hidden, k in itertools.product(args.models, args.layers, args.hidden, args.ks):
        overrides = MODELS.get(model_name, []) + [f"model.num_layers={num_layers}", f"model.hidden={hidden}"]
        overrides += args.overrides
        row: dict[str, Any] = {"dataset": name, "model": model_name, "layers": num_layers,
                               "hidden": hidden, "k": k, "overrides": overrides}
        if args.layerwise:
            row.update(layerwise_row(graph, overrides, batches[num_layers], k, args.seed, torch.device(args.device)))
            rows.append(row)
            continue
        if (num_layers, k) not in splits:
            splits[(num_layers, k)] = plan_micro_batches(batches[num_layers], k, "reg", args.seed)
        if args.custom:
            row.update(custom_row(graph, model_name, hidden, splits[(num_layers, k)], args.seed))
        else:
            row.update(measure_row(graph, overrides, splits[(num_layers, k)], args.seed, torch.device(args.device)))
        rows.append(row)
    return rows, batches


def rows_table(name: str, rows: list[dict[str, Any]], sizes: dict[int, list[int]], args: argparse.Namespace) -> Table:
    """One dataset's rows as a rich table; its caption gives the full batch's nodes per layer (``sizes``)."""

    def describe(n: int) -> str:
        fanouts = fanouts_for(n, args)
        what = "full neighbourhood" if all(f is None for f in fanouts) else f"fanouts {fanouts}"
        return f"{n} layers: {' → '.join(map(str, sizes[n]))} nodes ({what})"

    unit = "layer-wise step (K chunks per layer)" if args.layerwise else "micro-batch"
    table = Table(title=f"{name}: estimated vs measured peak per {unit} ({args.device}); error = (est − meas) / meas",
                  caption="full batch, " + "; ".join(describe(n) for n in args.layers))
    for column in ("model", "L", "hidden", "K"):
        table.add_column(column, justify="left" if column == "model" else "right", no_wrap=True)
    for column in ("#mb", "max |err|", "worst err", "mean err", "peak MiB", "time s", "est ms"):
        table.add_column(column, justify="right", no_wrap=True)
    for row in rows:
        head = (row["model"], str(row["layers"]), str(row["hidden"]), str(row["k"]))
        table.add_row(*head, str(row["num_micro_batches"]), f"{row['max_abs_error']:.2%}",
                      f"{row['worst_error']:+.2%}", f"{row['mean_error']:+.2%}",
                      f"{row['max_measured_bytes'] / MIB:.1f}", f"{row['seconds']:.1f}",
                      f"{row['estimate_ms']:.1f}")
    return table


def main(argv=None) -> None:
    args = parse_args(argv)
    # rich assumes 80 columns when piped, too narrow for the table: use 120 unless COLUMNS says otherwise
    console = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 120)
    all_rows: list[dict[str, Any]] = []
    results: dict[str, Any] = {"config": {**vars(args), "data_dir": None if args.data_dir is None else str(args.data_dir),
                                          "json": None if args.json is None else str(args.json)},
                               "datasets": {}}
    total_start = time.perf_counter()
    for name in args.datasets:
        try:
            graph = common.load_graph(name, args.data_dir)
        except BettyError as error:
            raise SystemExit(f"error: {error}") from None
        rows, batches = dataset_rows(name, graph, args)
        all_rows += rows
        sizes = {n: [b.num_src for b in batch.blocks] + [batch.blocks[-1].num_dst] for n, batch in batches.items()}
        results["datasets"][name] = {"num_nodes": graph.num_nodes, "batch_layer_sizes": sizes,
                                     "fanouts": {n: fanouts_for(n, args) for n in args.layers}, "rows": rows}
        console.print(rows_table(name, rows, sizes, args))

    console.print(summary(all_rows), soft_wrap=True)
    console.print(f"total time {time.perf_counter() - total_start:.1f} s", soft_wrap=True)
    results["summary"] = summary(all_rows)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
        console.print(f"raw numbers written to {args.json}")


if __name__ == "__main__":
    main()
