"""A run's input-feature aggregation cache (BatchGNN §3, "Input Feature Aggregation Cache"; App. B–C;
``features.aggregation_cache``): the rows its training steps gather instead of the input features.

With the cache on, the sampler samples layers 1 … L − 1 only (:func:`~betty_trainer.sampling.schedule.make_sampler`),
a batch's input nodes are layer 0's dst nodes, and the feature store serves each one's row of the cache
(:func:`input_features`), from which the model's layer 0 computes its output row by row
(:meth:`~betty_trainer.models.stack.LayerStack.aggregated_forward`). Evaluation keeps the whole model on blocks and
the input features, as BatchGNN evaluates SAGE and GCN (App. E).
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from betty_trainer.config import Config
from betty_trainer.data.block import Block
from betty_trainer.data.graph import Graph
from betty_trainer.datasets.aggregation import aggregation_table
from betty_trainer.errors import ConfigError
from betty_trainer.models import build_model

logger = logging.getLogger(__name__)


def aggregation_kind(config: Config) -> str:
    """The aggregation ``config.model``'s layer 0 computes: ``sage-mean``, ``sage-gcn`` or ``gcn`` (the names of the
    cache's folders; :data:`~betty_trainer.config.AGGREGATION_CACHE_MODELS`)."""
    aggregator = getattr(config.model, "aggregator", None)
    return config.model.arch if aggregator is None else f"{config.model.arch}-{aggregator}"


def check_aggregation_cache(config: Config, model: nn.Module | None) -> None:
    """What a run with ``features.aggregation_cache`` checks before it loads anything, once: a custom ``model`` (not
    ``None``) is refused, as only a built-in model's layer 0 reads the cache; ``approximate`` logs its one warning:
    layer 0 then trains on the full-neighbourhood aggregate of unmasked features while the run samples or drops
    out (BatchGNN App. B: accuracy may rise or fall).

    Raises:
        ConfigError: a custom model with the cache on.
    """
    mode = config.features.aggregation_cache
    if mode is not False and model is not None:
        raise ConfigError("features.aggregation_cache needs a built-in model, whose layer 0 reads the cache "
                          "(model.arch=sage or gcn); set features.aggregation_cache=false for a custom model")
    if mode == "approximate":
        logger.warning("features.aggregation_cache=approximate: layer 0 reads every node's aggregate over its full "
                       "neighbourhood of unmasked input features, whatever sampling.fanouts[0] and model.dropout say; "
                       "this changes what the model trains on (BatchGNN App. B: accuracy may rise or fall), and "
                       "evaluation runs the uncached layer 0")


def without_aggregation_cache(config: Config) -> Config:
    """``config`` with ``features.aggregation_cache: false`` and everything else the same (the plan a run would
    make without the cache: :func:`~betty_trainer.training.trainer.data_path`, ``betty-train plan``)."""
    return config.model_copy(update={"features": config.features.model_copy(update={"aggregation_cache": False})})


def input_features(config: Config, graph: Graph) -> Tensor:
    """The rows a run's training steps gather, indexed by node id: ``graph.x`` ``(N, F)``, or with
    ``features.aggregation_cache`` the cache's ``(N, W)`` float32 table, layer 0's aggregation of ``graph.x`` over
    every node's full neighbourhood (the built-in model's ``aggregated_input``; ``W = 2F`` for SAGE ``mean``, its own
    row beside its neighbours' mean, else ``F``), read from or written to its folder beside the dataset
    (:func:`~betty_trainer.datasets.aggregation.aggregation_table`).

    Leaves torch's global RNG as it was: the model whose layer 0 aggregates is built only when the table is not on
    disk yet, its parameters (which the aggregation does not read) initialised under a forked RNG, so a run draws
    the same whether the table was cached or not.
    """
    if config.features.aggregation_cache is False:
        return graph.x

    def aggregate(block: Block, x: Tensor) -> Tensor:
        with torch.random.fork_rng(devices=[]):  # initialising the parameters draws from the global RNG
            model = build_model(config.model, graph)
        return model.aggregated_input(block, x)  # reads no parameter

    return aggregation_table(graph, aggregation_kind(config), aggregate)
