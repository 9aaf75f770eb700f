"""Using a finished run: load its model, evaluate a checkpoint, write per-node predictions.

Everything here reads a run directory written by :func:`~betty_trainer.training.trainer.train`: its
``config.yaml`` rebuilds the model and loads the dataset, and ``best.pt`` or ``last.pt`` (checked
against its sha256, :func:`~betty_trainer.training.checkpoint.load_checkpoint`) gives the parameters.
Evaluation is the one training runs (:func:`~betty_trainer.training.evaluation.evaluate_splits`), so
``betty-train evaluate`` prints exactly the accuracies training reported for that checkpoint.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from betty_trainer.config import Config, load_config
from betty_trainer.data.feature_store import HostFeatureStore
from betty_trainer.data.graph import Graph
from betty_trainer.datasets import load_dataset
from betty_trainer.errors import ConfigError, TrainingError, host_memory_as_one_line
from betty_trainer.models.stack import runs_layer_by_layer
from betty_trainer.training.checkpoint import (
    CHECKPOINTS,
    dataset_identity,
    identity,
    identity_difference,
    load_checkpoint,
    split_refusal,
    state_dict_difference,
)
from betty_trainer.training.evaluation import (
    EVAL_CHUNK,
    EVALUATION_HOST_MEMORY,
    evaluate_splits,
    fitting_chunks,
    full_neighbourhood_batches,
    layerwise_logits,
)
from betty_trainer.training.preflight import resolve_device
from betty_trainer.training.rundir import refuse_run_file
from betty_trainer.training.trainer import init_model

logger = logging.getLogger(__name__)
PREDICTION_FORMATS = (".pt", ".csv", ".parquet")


@dataclass
class LoadedRun:
    """A run's model with its checkpoint loaded, in eval mode.

    Attributes:
        model: the model on ``device``.
        config: the run's ``config.yaml``.
        graph: the dataset it was trained on.
        checkpoint: ``"best"`` or ``"last"``.
        epoch: the checkpoint's epoch (0-based).
        metrics: the ``metrics.jsonl`` line of that epoch as stored in ``best.pt`` (``None`` for ``last``).
        device: where the model is.
    """

    model: nn.Module
    config: Config
    graph: Graph
    checkpoint: str
    epoch: int
    metrics: dict[str, Any] | None
    device: torch.device


def load_run(run_dir: str | Path, checkpoint: str = "best", *, model: nn.Module | None = None,
             graph: Graph | None = None, device: str | torch.device = "cpu",
             data_dir: str | Path | None = None) -> LoadedRun:
    """Load a run's model from ``best.pt`` or ``last.pt`` (see :func:`load_model`); ``data_dir``, when given, is
    where the dataset's files are now, instead of the run's recorded ``dataset.data_dir`` (a moved dataset).

    Raises:
        ConfigError: unknown ``checkpoint``, or ``run_dir`` is not a run directory.
        TrainingError: the checkpoint is missing, damaged, or belongs to another model or dataset.
        DatasetError: the dataset cannot be loaded.
    """
    if checkpoint not in CHECKPOINTS:
        raise ConfigError(f"--checkpoint must be best or last, got {checkpoint!r}")
    run_dir = Path(run_dir)
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml)")
    config = load_config(saved, [] if data_dir is None else [f"dataset.data_dir={data_dir}"])
    state = load_checkpoint(run_dir, CHECKPOINTS[checkpoint])
    device = resolve_device(str(device))
    split = config.dataset.split if graph is None else None  # a graph given from Python carries its own split
    if graph is None:
        refusal = split_refusal(state["identity"], split)
        if refusal is not None:
            raise TrainingError(f"cannot load {run_dir / CHECKPOINTS[checkpoint]}: {refusal}")
    graph = graph if graph is not None else load_dataset(config.dataset)
    builtin = model is None
    if builtin and "custom" in state["identity"].get("model", {}):
        custom = state["identity"]["model"]["custom"]
        raise ConfigError(f"{run_dir} was trained with the custom model {custom}, which betty-train evaluate/predict "
                          "cannot rebuild; load it from Python with an instance of that class: "
                          f"betty_trainer.load_model({str(run_dir)!r}, model={custom.rsplit('.', 1)[-1]}(...))")
    model = model if model is not None else init_model(config, graph)
    model_id = config.model.model_dump(mode="json") if builtin else state["identity"].get("model", {})
    difference = identity_difference(state["identity"], identity(dataset_identity(graph, split), model_id,
                                                                  model.state_dict()))
    if difference is None:
        difference = state_dict_difference(model.state_dict(), state["model"])
    if difference is not None:
        raise TrainingError(f"cannot load {run_dir / CHECKPOINTS[checkpoint]}: {difference}")
    model.load_state_dict(state["model"])
    model.to(device).eval()
    return LoadedRun(model, config, graph, checkpoint, int(state["epoch"]), state.get("metrics"), device)


def load_model(run_dir: str | Path, checkpoint: str = "best", *, model: nn.Module | None = None,
               graph: Graph | None = None, device: str | torch.device = "cpu") -> nn.Module:
    """The trained model of a run directory, ready for inference (eval mode).

    The built-in model is rebuilt from the run's ``config.yaml`` and sized for its dataset (which is
    loaded unless ``graph`` is given: GCN needs its degrees); a custom model is passed as ``model``, an
    instance of the class that was trained, and gets the checkpoint's parameters. The checkpoint is
    verified against its sha256 and must be finite and belong to this model and dataset.

    Example::

        model = load_model("runs/cora-sage-20261122-101500")            # best.pt
        logits = layerwise_logits(model, graph, HostFeatureStore(graph.x), torch.device("cpu"))

    Args:
        run_dir: a run directory written by :func:`~betty_trainer.training.trainer.train`.
        checkpoint: ``"best"`` (the model chosen on validation accuracy) or ``"last"``.
        model: an instance of the custom model the run trained; default: the built-in model of the config.
        graph: the dataset, if already loaded; default: loaded from the run's config.
        device: where to put the model.

    Returns:
        The model (``forward(blocks, x)`` → ``(num_outputs, num_classes)`` logits), in eval mode.

    Raises:
        ConfigError: not a run directory, unknown ``checkpoint``, or a custom-model run without ``model``.
        TrainingError: the checkpoint is missing, damaged, non-finite, or belongs to another model or dataset.
    """
    return load_run(run_dir, checkpoint, model=model, graph=graph, device=device).model


def run_device(run_dir: str | Path) -> torch.device:
    """The device the run's ``train.device`` names on this machine; the CPU when it names a GPU this
    machine lacks (a run trained on a GPU node, evaluated on a laptop)."""
    saved = Path(run_dir) / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml)")
    try:
        return resolve_device(load_config(saved).train.device)
    except ConfigError:
        logger.info("the run's device is not on this machine; evaluating on the CPU")
        return torch.device("cpu")


def evaluate_run(run_dir: str | Path, checkpoint: str = "best", splits: str = "test",
                 device: str | torch.device | None = None,
                 data_dir: str | Path | None = None) -> tuple[LoadedRun, dict]:
    """Accuracy of a run's checkpoint on ``val``, ``test`` or ``all`` (train, val and test).

    Args:
        run_dir: the run directory.
        checkpoint: ``"best"`` or ``"last"``.
        splits: ``"val"``, ``"test"`` or ``"all"``.
        device: where to evaluate; default: where the run trained (:func:`run_device`).
        data_dir: the folder holding the dataset's files (``--data-dir``); default: the run's ``dataset.data_dir``.

    Returns:
        The loaded run and ``{split: fraction in [0, 1]}``, computed as training computes them (layer by
        layer for built-in models, on the run's device), so they equal the accuracies training reported
        for that epoch.

    Raises:
        ConfigError, TrainingError: see :func:`load_run`; ``splits`` not val, test or all.
        TrainingError: evaluation ran out of host memory (the message says what it holds).
    """
    names = {"val": ["val"], "test": ["test"], "all": ["train", "val", "test"]}.get(splits)
    if names is None:
        raise ConfigError(f"--split must be val, test or all, got {splits!r}")
    run = load_run(run_dir, checkpoint, device=device if device is not None else run_device(run_dir),
                   data_dir=data_dir)
    nodes = {"train": run.graph.train_idx, "val": run.graph.val_idx, "test": run.graph.test_idx}
    features = HostFeatureStore(run.graph.x, pin=run.device.type == "cuda")  # as training builds it
    with _host_memory(f"evaluating {Path(run_dir) / CHECKPOINTS[checkpoint]}"):
        accuracy = evaluate_splits(run.model, run.graph, features, run.device, {name: nodes[name] for name in names},
                                   run.config.model.num_layers)
    return run, accuracy


@torch.no_grad()
def predict_run(run_dir: str | Path, output: str | Path, checkpoint: str = "best",
                data_dir: str | Path | None = None) -> Path:
    """Write every node's predicted class and class probabilities (softmax of the logits) to ``output``.

    Formats, by ``output``'s suffix (one row per node, in node-id order):

    - ``.pt``: ``{"node": (N,) int64, "prediction": (N,) int64, "probabilities": (N, C) float32}``, read with
      ``torch.load(path, weights_only=True)``;
    - ``.csv``: header ``node,prediction,prob_0,…,prob_{C-1}``;
    - ``.parquet``: the same columns (needs ``pyarrow``).

    ``data_dir`` (``--data-dir``) is where the dataset's files are, if not at the run's ``dataset.data_dir``.

    Returns:
        ``output``.

    Raises:
        ConfigError: unknown suffix, a missing output folder, or ``.parquet`` without pyarrow.
        RunDirError: ``output`` is a file the run directory manages (``best.pt``, ``config.yaml``, ...;
            :func:`~betty_trainer.training.rundir.is_run_file`).
        TrainingError: see :func:`load_run`; or the logits ran out of host memory.
    """
    output = Path(output)
    refuse_run_file(output)
    suffix = output.suffix.lower()
    if suffix not in PREDICTION_FORMATS:
        raise ConfigError(f"--output {output}: use a .pt, .csv or .parquet file")
    if not output.parent.is_dir():
        raise ConfigError(f"--output {output}: folder {output.parent} does not exist; create it or choose another")
    if suffix == ".parquet" and importlib.util.find_spec("pyarrow") is None:
        raise ConfigError("--output *.parquet needs pyarrow (pip install pyarrow); or write .csv or .pt")
    run = load_run(run_dir, checkpoint, data_dir=data_dir)
    with _host_memory(f"predicting with {Path(run_dir) / CHECKPOINTS[checkpoint]}"):
        probabilities = torch.softmax(node_logits(run), dim=1).float()
    table = {"node": torch.arange(run.graph.num_nodes), "prediction": probabilities.argmax(1),
             "probabilities": probabilities}
    try:
        if suffix == ".pt":
            torch.save(table, output)
        elif suffix == ".csv":
            _write_csv(output, table)
        else:
            _write_parquet(output, table)
    except OSError as error:
        raise ConfigError(f"cannot write --output {output}: {error.strerror or error}") from None
    return output


@torch.no_grad()
def node_logits(run: LoadedRun) -> Tensor:
    """``(N, C)`` logits of every node of ``run.graph``, on the CPU, without autograd (layer-wise for built-in models,
    else full-neighbourhood batches), in chunks halved after each CUDA out-of-memory error until they fit
    (:func:`~betty_trainer.training.evaluation.fitting_chunks`)."""
    features = HostFeatureStore(run.graph.x, pin=False)

    def logits(chunk_size: int) -> Tensor:
        if runs_layer_by_layer(run.model):
            return layerwise_logits(run.model, run.graph, features, run.device, chunk_size=chunk_size)
        parts = []
        for batch in full_neighbourhood_batches(run.graph, torch.arange(run.graph.num_nodes),
                                                run.config.model.num_layers, chunk_size):
            parts.append(run.model(batch.to(run.device).blocks, features.gather(batch.input_nodes, run.device)).cpu())
        return torch.cat(parts)

    return fitting_chunks(logits, EVAL_CHUNK, run.device)[0]


@contextlib.contextmanager
def _host_memory(what: str) -> Iterator[None]:
    """A failed host-memory allocation (:func:`~betty_trainer.errors.host_allocation_failure`) inside the block as
    a one-line :class:`TrainingError` naming ``what`` and what evaluation holds in host memory."""
    with host_memory_as_one_line(lambda cause: f"{what}: out of host memory ({cause}); {EVALUATION_HOST_MEMORY}: "
                                 "free host memory or use a machine with more"):
        yield


def _write_csv(path: Path, table: dict[str, Tensor]) -> None:
    classes = table["probabilities"].shape[1]
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["node", "prediction", *(f"prob_{c}" for c in range(classes))])
        for node, prediction, row in zip(table["node"].tolist(), table["prediction"].tolist(),
                                         table["probabilities"].tolist()):
            writer.writerow([node, prediction, *(f"{p:.7g}" for p in row)])


def _write_parquet(path: Path, table: dict[str, Tensor]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {"node": pa.array(table["node"].numpy()), "prediction": pa.array(table["prediction"].numpy())}
    for c, column in enumerate(table["probabilities"].T.contiguous().numpy()):
        columns[f"prob_{c}"] = pa.array(column)
    pq.write_table(pa.table(columns), path)
