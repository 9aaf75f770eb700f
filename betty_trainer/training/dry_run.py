"""``betty-train plan``: plan the first batch as training would, without training (optionally measure it)."""

from __future__ import annotations

import torch

from betty_trainer.config import Config
from betty_trainer.data.feature_store import HostFeatureStore
from betty_trainer.datasets import load_dataset
from betty_trainer.memory.plan import make_planner, plan_report
from betty_trainer.models import set_dropout_key
from betty_trainer.sampling.schedule import first_batch, plan_seed
from betty_trainer.training.layerwise import LayerwiseBatch, measure_layerwise_step
from betty_trainer.training.output import quiet_native_stderr
from betty_trainer.training.preflight import check_config, check_model_size, resolve_device
from betty_trainer.training.step import measure_training_step
from betty_trainer.training.trainer import init_model


def dry_run(config: Config, measure: bool = False) -> dict:
    """Sample epoch 0's first batch exactly as :func:`~betty_trainer.training.trainer.train` does, plan it,
    and report (see :func:`~betty_trainer.memory.plan.plan_report`).

    With ``measure``, one real training step per micro-batch runs on copies of the model
    and a fresh Adam (stepped once first, so its state is resident as in training), the
    micro-batches after the first with the earlier ones' gradients resident as in
    training, and each row gets ``measured_peak_bytes`` and ``error`` =
    (estimate − measured) / measured. The profiler's own stderr lines are hidden
    (:func:`~betty_trainer.training.output.quiet_native_stderr`).

    Returns:
        The report dict (what ``plan.json`` holds).

    Raises:
        BettyError: bad config or dataset, impossible budget.
    """
    check_config(config)  # the checks train makes before loading data
    device = resolve_device(config.train.device)
    graph = load_dataset(config.dataset)
    check_model_size(config, graph, device)
    planner = make_planner(config, graph, None, device)
    batch = first_batch(config, graph)
    micro_batches, plan = planner.plan(batch, plan_seed(config))  # built one at a time, as training builds them
    report = plan_report(planner, batch, micro_batches, plan)
    report.update(dataset=graph.name, device=str(device), model=config.model.model_dump())
    if measure:
        with quiet_native_stderr():
            if isinstance(micro_batches, LayerwiseBatch):
                _measure_layerwise(config, graph, device, micro_batches, report)
            else:
                _measure(config, graph, device, batch, micro_batches, report)
    return report


def _measured_setup(config: Config, graph, device: torch.device):
    """The run's model on ``device`` with its dropout key, its Adam, and the feature store training gathers from."""
    model = init_model(config, graph).to(device)
    set_dropout_key(model, config.seed, 0)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.optim.lr, weight_decay=config.optim.weight_decay)
    return model, optimizer, HostFeatureStore(graph.x, pin=device.type == "cuda")


def _measure_layerwise(config: Config, graph, device: torch.device, work: LayerwiseBatch, report: dict) -> None:
    """Add ``measured_peak_bytes`` and ``error`` of one layer-wise step to a layer-wise ``report``."""
    model, optimizer, features = _measured_setup(config, graph, device)
    measure_layerwise_step(model, optimizer, work, features, graph.y, device)  # Adam state exists
    measured = measure_layerwise_step(model, optimizer, work, features, graph.y, device).peak_bytes
    report["measured_peak_bytes"] = measured
    if report["estimate_peak_bytes"]:
        report["error"] = (report["estimate_peak_bytes"] - measured) / measured


def _measure(config: Config, graph, device: torch.device, batch, micro_batches, report: dict) -> None:
    """Add ``measured_peak_bytes`` and ``error`` to each row of ``report`` (see :func:`dry_run`)."""
    model, optimizer, features = _measured_setup(config, graph, device)
    measure_training_step(model, optimizer, micro_batches[0], features, graph.y, device)  # Adam state exists
    for index, (row, micro_batch) in enumerate(zip(report["micro_batches"], micro_batches)):
        measured = measure_training_step(model, optimizer, micro_batch, features, graph.y, device,
                                         num_outputs=batch.output_nodes.numel(), accumulate=index > 0)
        row["measured_peak_bytes"] = measured.peak_bytes
        if "estimate" in row:
            row["error"] = (row["estimate"]["peak_bytes"] - measured.peak_bytes) / measured.peak_bytes
