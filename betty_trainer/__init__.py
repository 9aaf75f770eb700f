"""betty-trainer: train GNNs on a memory-constrained GPU by splitting each batch into micro-batches.

Public API::

    from betty_trainer import Config, load_config, load_dataset, train, GraphSAGE, load_model
"""

from betty_trainer.process import configure_process

configure_process()  # the OpenMP wait policy, huge pages and expandable segments, before the imports below load torch

from betty_trainer.config import Config, load_config
from betty_trainer.data.block import Batch, Block
from betty_trainer.data.feature_store import FeatureStore, HostFeatureStore, TransferStats
from betty_trainer.data.graph import Graph
from betty_trainer.datasets import DATASETS, load_dataset, make_sbm
from betty_trainer.errors import (
    BettyError,
    CalibrationError,
    ConfigError,
    DatasetError,
    PlanningError,
    RunDirError,
    TrainingError,
)
from betty_trainer.execution.micro_batches import MicroBatches, accumulate_gradients
from betty_trainer.execution.plan import StepPlan, StepResult
from betty_trainer.memory.custom import calibrate_model
from betty_trainer.memory.planner import plan_micro_batches
from betty_trainer.memory.recorded import record_model
from betty_trainer.models import GCN, GraphSAGE, NodeDropout, build_model
from betty_trainer.sampling import NeighborSampler, SampleKey, Sampler, sample_batch
from betty_trainer.training.dry_run import dry_run
from betty_trainer.training.evaluation import evaluate, evaluate_splits, full_neighbourhood_batches, layerwise_logits
from betty_trainer.training.inference import load_model
from betty_trainer.training.trainer import TrainResult, train

__version__ = "0.1.0"

__all__ = [
    "DATASETS", "GCN", "Batch", "BettyError", "Block", "CalibrationError", "Config", "ConfigError", "DatasetError",
    "FeatureStore", "Graph", "GraphSAGE", "HostFeatureStore", "MicroBatches", "NeighborSampler", "NodeDropout",
    "PlanningError", "RunDirError", "SampleKey", "Sampler", "StepPlan", "StepResult", "TrainResult",
    "TrainingError", "TransferStats", "accumulate_gradients", "build_model", "calibrate_model", "dry_run",
    "evaluate", "evaluate_splits", "full_neighbourhood_batches", "layerwise_logits", "load_config", "load_dataset", "load_model",
    "make_sbm", "plan_micro_batches", "record_model", "sample_batch", "train",
]
