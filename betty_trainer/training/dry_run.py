"""``betty-train plan``: plan the first batch as training would, without training (optionally measure it)."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from betty_trainer.config import Config
from betty_trainer.data.feature_store import HostFeatureStore
from betty_trainer.data.graph import Graph
from betty_trainer.datasets import load_dataset
from betty_trainer.datasets.aggregation import aggregation_dir
from betty_trainer.distributed.group import leave
from betty_trainer.errors import PlanningError
from betty_trainer.memory.planner import make_planner
from betty_trainer.models import set_dropout_key
from betty_trainer.sampling.schedule import first_batch, make_sampler, plan_seed
from betty_trainer.training.aggregation import (
    aggregation_kind,
    check_aggregation_cache,
    input_features,
    without_aggregation_cache,
)
from betty_trainer.training.checkpoint import dataset_identity
from betty_trainer.training.distributed import finish_together, join_run, this_rank
from betty_trainer.training.output import quiet_native_stderr
from betty_trainer.training.preflight import check_config, check_model_size, resolve_device
from betty_trainer.training.trainer import data_path, feature_store, init_model, qualified_name
from partition import GraphPartition


def dry_run(config: Config, measure: bool = False, model: nn.Module | None = None, graph: Graph | None = None) -> dict:
    """Sample epoch 0's first batch exactly as :func:`~betty_trainer.training.trainer.train` does, plan it,
    and report it (:meth:`~betty_trainer.execution.plan.StepPlan.report`).

    ``model``: a custom model, planned as ``train(config, model=model)`` plans it (its estimate recorded, or
    calibrated where the recorder refuses it: :func:`~betty_trainer.memory.planner.make_planner`); default: the
    built-in model of ``config.model``. ``graph``: the graph to plan on; default: ``config.dataset`` loaded.

    With ``measure``, the plan runs real training steps (:meth:`~betty_trainer.execution.plan.StepPlan.measure`)
    on the run's model (a deep copy of a custom ``model``, which is left as it was) and a fresh optimizer, stepped
    once first so its state is resident as in training, and the report gets each measured peak and ``error`` =
    (estimate − measured) / measured. The profiler's own stderr
    lines are hidden (:func:`~betty_trainer.training.output.quiet_native_stderr`).

    With ``features.aggregation_cache`` the report's ``aggregation_cache`` holds the cache's bytes and where they
    live, and the plan of the same batch without the cache (:func:`aggregation_report`).

    Under ``torchrun`` with ``distributed.mode`` set, every rank plans its share of the first global batch (a
    cooperative rank its rounds, with the exchanges' buffers in each estimate) and the report holds them all under
    ``ranks``.

    Returns:
        The report dict (what ``plan.json`` holds: :meth:`~betty_trainer.memory.planner.Planner.report`), with the
        dataset, device and model.

    Raises:
        BettyError: bad config or dataset, impossible budget.
    """
    check_config(config)  # the checks train makes before loading data, and its allocator setting
    device = resolve_device(config.train.device)
    processes = join_run(config, device)  # under torchrun: every rank plans its share; rank 0 prints them all
    try:
        device = device if processes is None else processes.device
        graph = load_dataset(config.dataset) if graph is None else graph
        check_aggregation_cache(config, model)
        if model is None:
            check_model_size(config, graph, device)
        sampler, features, planner, cached = data_path(config, graph, device, model,
                                                       HostFeatureStore(graph.x, pin=device.type == "cuda"))
        rows = input_features(config, graph) if cached else graph.x  # what the training steps gather
        partition = planner.graph_partition  # the uncached plan of the report cuts the same graph
        sampler, planner, _ = this_rank(config, graph, dataset_identity(graph, config.dataset.split)["fingerprint"],
                                        sampler, planner, processes)
        plan = planner.plan(first_batch(config, graph, sampler))
        measured = None
        if measure:
            measured_model = (init_model(config, graph) if model is None else copy.deepcopy(model)).to(device)
            set_dropout_key(measured_model, config.seed, 0)
            optimizer = config.optim.make_optimizer(measured_model.parameters())
            with quiet_native_stderr():
                measured = plan.measure(measured_model, optimizer, HostFeatureStore(rows, pin=device.type == "cuda"),
                                        graph.y, device)
        report = planner.report(plan, measured)
        if config.features.aggregation_cache is not False:
            report["aggregation_cache"] = aggregation_report(config, graph, device, cached, features.max_device_bytes,
                                                             rows if cached else None, partition)
        finish_together(processes)
    finally:
        leave()
    report.update(dataset=graph.name, device=str(device),
                  model=config.model.model_dump() if model is None else {"custom": qualified_name(model)})
    return report


def aggregation_report(config: Config, graph: Graph, device: torch.device, used: bool, device_bytes: int,
                       rows: Tensor | None = None, partition: GraphPartition | None = None) -> dict:
    """What ``betty-train plan`` shows of the aggregation cache (``plan.json``'s ``aggregation_cache``; BatchGNN §3,
    App. C): ``mode``, ``used`` (``micro_batch.mode: auto`` may leave it out:
    :func:`~betty_trainer.training.trainer.data_path`), ``kind``, ``row_width`` (columns), ``host_bytes`` (the
    ``(N, W)`` table, memory-mapped from ``path``, pinned on CUDA), ``device_bytes`` (the run's feature store's node
    cache and staged rows), and ``uncached``: the plan of epoch 0's first batch with
    ``features.aggregation_cache=false`` and everything else the same: its ``summary``, ``estimate_peak_bytes``,
    ``full_batch_estimate_bytes``, ``layers`` (per block ``src_nodes``, ``dst_nodes``, ``edges``: layer 0's block
    and input rows are there) and ``work``, or where no uncached plan fits the budget, ``refused``: the planner's
    message. The cache lowers the peak where layer 0's dst nodes are much fewer than its src nodes (micro-batches,
    3 layers) and raises it where they are about as many (a 2-layer full batch whose first hop covers the graph;
    BatchGNN Table 5), unless the batch's input nodes are ``0 … N − 1`` in order, which the step reads in place on
    the CPU either way. ``rows``: the cache's table when the caller has it (else it is read); ``partition``: the
    run planner's graph partition, which the uncached plan shares (:func:`~betty_trainer.memory.planner.make_planner`).
    """
    rows = input_features(config, graph) if rows is None else rows
    uncached = without_aggregation_cache(config)
    sampler = make_sampler(uncached, graph)
    planner = make_planner(uncached, graph, None, device, feature_store(uncached, graph, device, sampler),
                           plan_seed(uncached), partition, sampler.bulk_draw)
    try:
        plan = planner.plan(first_batch(uncached, graph, sampler))
    except PlanningError as error:
        alternative = {"refused": str(error)}
    else:
        full_batch = plan.report()["full_batch"]
        alternative = {"summary": plan.summary, "estimate_peak_bytes": plan.estimate,
                       "full_batch_estimate_bytes": full_batch["estimate_peak_bytes"], "layers": full_batch["layers"],
                       "work": plan.work}
    return {"mode": config.features.aggregation_cache, "used": used, "kind": aggregation_kind(config),
            "row_width": int(rows.shape[1]), "host_bytes": rows.numel() * rows.element_size(),
            "path": str(aggregation_dir(graph, aggregation_kind(config))), "device_bytes": device_bytes,
            "uncached": alternative}
