"""Run configuration: YAML files, dotted ``key=value`` overrides, validation (docs/design.md › CLI).

Every key has a default, so an empty file is a valid config (the synthetic
quickstart). Unknown keys and bad values raise :class:`ConfigError` naming the
dotted key and what is allowed.
"""

from __future__ import annotations

import logging
import math
import types
from pathlib import Path
from typing import Annotated, Any, ClassVar, Iterable, Literal, Sequence, Union, get_args, get_origin

import torch
import yaml
from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from betty_trainer.data.cache import CACHE_KINDS, cache_capacity
from betty_trainer.errors import ConfigError
from betty_trainer.models.registry import ARCHITECTURES
from partition import PARTITIONERS

logger = logging.getLogger(__name__)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)  # floats are finite

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """A number key (``int``/``float``, optional, or a list of ints) refuses ``true``/``false``
        (pydantic would read them as 1 and 0), and an integer key takes a whole number written with an
        exponent (``1e2``, which PyYAML reads as a string, or ``1.5e+2``, a float)."""
        kind, is_list = _number_kind(cls.model_fields[info.field_name].annotation)
        if kind is None:
            return value
        if is_list and isinstance(value, list):
            return [_number(item, kind) for item in value]
        return _number(value, kind)


def _number_kind(annotation: Any) -> tuple[type | None, bool]:
    """``(int or float, is a list)`` of a plain number field (``int``, ``float | None``, ``list[int] | None``),
    ``(None, False)`` for any other annotation (a size, a choice, a union with strings)."""
    if get_origin(annotation) in (Union, types.UnionType):
        members = [member for member in get_args(annotation) if member is not type(None)]
        if len(members) != 1:
            return None, False
        annotation = members[0]
    if get_origin(annotation) is list and get_args(annotation) in ((int,), (float,)):
        return get_args(annotation)[0], True
    return (annotation, False) if annotation in (int, float) else (None, False)


_EXACT_INTEGERS = 2**53  # floats up to here are exact integers


def _number(value: Any, kind: type) -> Any:
    """``value`` for a number field of ``kind``: a bool refused, a whole number given as a float or a string
    (``100.0``, ``'1e2'``) made an ``int`` for an integer field; anything else is left to pydantic."""
    if isinstance(value, bool):
        raise ValueError(f"expected {'an integer' if kind is int else 'a number'}, not true/false")
    if kind is int and isinstance(value, (float, str)):
        try:
            number = float(value)
        except ValueError:
            return value
        if math.isfinite(number) and number.is_integer() and abs(number) <= _EXACT_INTEGERS:
            return int(number)
    return value


class SyntheticConfig(_Section):
    """The synthetic stochastic-block-model graph (used when ``dataset.name`` is ``synthetic``)."""

    num_nodes: int = Field(2000, ge=10, description="number of nodes")
    num_classes: int = Field(5, ge=2, description="number of classes = blocks of the SBM")
    num_features: int = Field(32, ge=1, description="feature width")
    avg_degree: float = Field(10.0, gt=0, description="mean undirected degree")
    homophily: float = Field(0.7, ge=0, le=1, description="fraction of edges inside a class")
    feature_signal: float = Field(0.2, ge=0, description="class-mean separation of the features, in noise std units")
    train_per_class: int = Field(20, ge=1)
    num_val: int = Field(500, ge=1)
    num_test: int = Field(1000, ge=1)
    seed: int = Field(0, ge=0, description="seed of the generated graph (independent of the run seed)")


class PowerLawConfig(_Section):
    """The synthetic power-law graph (used when ``dataset.name`` is ``powerlaw``): a degree-corrected
    planted partition with Chung-Lu weights, streamed into the on-disk cache (products-scale by default)."""

    num_nodes: int = Field(2_000_000, ge=10, description="number of nodes")
    num_edges: int = Field(52_000_000, ge=1, description="directed edges drawn (both directions of each pair; "
                                                         "duplicates and self loops are then removed)")
    num_classes: int = Field(47, ge=2, description="number of classes = planted blocks")
    num_features: int = Field(100, ge=1, description="feature width")
    exponent: float = Field(2.5, gt=1, description="power-law exponent of the expected degrees (clipped at 200× the mean)")
    homophily: float = Field(0.8, ge=0, le=1, description="probability that an edge stays inside its class")
    feature_signal: float = Field(0.3, ge=0, description="class-mean separation of the features, in noise std units")
    train_fraction: float = Field(0.1, gt=0, lt=1, description="share of nodes in the training split")
    val_fraction: float = Field(0.02, ge=0, lt=1, description="share of nodes in the validation split")
    test_fraction: float = Field(0.1, ge=0, lt=1, description="share of nodes in the test split")
    seed: int = Field(0, ge=0, description="seed of the generated graph (independent of the run seed)")
    num_communities: int = Field(0, ge=0, description="0: edges cluster by class; else by this many smaller blocks "
                                                      "(block b has class b mod num_classes)")
    class_homophily: float = Field(0.0, ge=0, le=1, description="with num_communities: probability that an edge "
                                   "leaving its block stays inside the block's class (blocks nested in classes)")


class DatasetConfig(_Section):
    """``dataset``: which graph, where its raw files are, and how they are checked and preprocessed."""

    name: str = Field("synthetic", description="a name listed by `betty-train datasets`")
    data_dir: Path | None = Field(
        None, description="folder holding the raw files (else BETTY_DATA_DIR, else the download cache)")
    verify_checksums: bool = Field(True, description="check every raw file's sha256 before parsing it")
    normalize_features: bool = Field(True, description="row-normalise the bag-of-words features of Planetoid, gnn-benchmark (.npz) "
                                            "and MUSAE graphs (as DGL/GCN do); the other datasets keep theirs")
    to_undirected: bool | None = Field(
        None, description="add every reverse edge (null = the dataset's default; OGB: only ogbn-products)")
    mmap: bool = Field(True, description="memory-map cached arrays (features read on demand) instead of reading them")
    split: Path | None = Field(
        None, description="your own split in place of the dataset's: an .npz with integer arrays train_idx, val_idx "
                          "and test_idx, or an OGB-style folder with train.csv, valid.csv and test.csv (one node id a "
                          "line, optionally .gz); relative to the working directory, saved absolute in the run")
    synthetic: SyntheticConfig = SyntheticConfig()
    powerlaw: PowerLawConfig = PowerLawConfig()

    @field_validator("split")
    @classmethod
    def _split_is_absolute(cls, value: Path | None) -> Path | None:
        """A relative ``split`` is taken from the working directory and kept absolute, so that the run's saved
        config.yaml names the same file for ``evaluate``, ``predict`` and ``--resume`` run from elsewhere."""
        return None if value is None else value.expanduser().absolute()


MAX_LAYERS = 10_000
"""The most layers ``model.num_layers`` takes: 10,000 build in seconds; 10⁸ took hours before the first step."""


class _ModelSection(_Section):
    """Keys every built-in architecture has; ``arch`` picks the section (see :data:`ModelConfig`)."""

    arch: str = Field(description=f"built-in architecture: {', '.join(sorted(ARCHITECTURES))}")
    hidden: int = Field(64, ge=1, description="hidden width (per head for gat)")
    num_layers: int = Field(2, ge=1, le=MAX_LAYERS,
                            description=f"layers (one block each), at most {MAX_LAYERS:,}: the deepest published GNNs "
                                        "have about 1,000 (RevGNN), and each layer is a Python module to build")
    dropout: float = Field(0.5, ge=0, lt=1)


MODEL_SECTIONS: dict[str, type[_ModelSection]] = {
    name: create_model(f"{name.upper()}Config", __base__=_ModelSection, __module__=__name__,
                       __doc__=f"``model`` with ``arch: {name}``: {architecture.title}.",
                       arch=(Literal[name], name), **architecture.keys)
    for name, architecture in sorted(ARCHITECTURES.items())}
"""``model``'s section class per ``arch``, one per registered architecture
(:data:`betty_trainer.models.registry.ARCHITECTURES`), by name: the keys every architecture has and its own."""


def _arch_of(value: Any) -> Any:
    """The discriminator of :data:`ModelConfig`: ``arch``, ``sage`` when the section leaves it out."""
    if isinstance(value, dict):
        return value.get("arch", "sage")
    return getattr(value, "arch", None)


ModelConfig = Annotated[
    Union[tuple(Annotated[section, Tag(arch)] for arch, section in MODEL_SECTIONS.items())],
    Discriminator(_arch_of),
]
"""``model``: the built-in model and its widths (ignored for a custom model). One section per
``arch`` (:data:`MODEL_SECTIONS`); a key another arch owns (``aggregator`` under ``arch: gcn``) is refused."""


SAMPLERS = ("full", "ns", "bulk-ns", "bulk-ladies", "labor", "gns")
"""The built-in samplers ``sampling.sampler`` names (betty_trainer/sampling/schedule.py › make_sampler)."""


class LaborConfig(_Section):
    """``sampling.labor``: LABOR sampling (Balin & Çatalyürek; cooperative-minibatching paper A.1.2, A.7)."""

    importance_iterations: int = Field(
        0, ge=-1, description="fixed-point iterations of LABOR-*'s importance probabilities: 0 = LABOR-0, "
                              "n = LABOR-n, -1 = until an iteration lowers sum_t min(1, pi_t) by less than a "
                              "relative 1e-4 (at most 100 iterations)")
    layer_dependency: bool = Field(False, description="the same per-vertex variate r_t in every layer")
    batch_dependency: int | Literal["inf"] = Field(
        1, description="kappa: consecutive batches interpolate their variates over this many batches "
                       "(1 = independent batches, inf = the same variates in every batch)")

    @field_validator("batch_dependency", mode="before")
    @classmethod
    def _kappa(cls, value: Any) -> Any:
        if isinstance(value, float) and value == float("inf"):
            return "inf"
        if isinstance(value, str) and value.strip().lower() in ("inf", ".inf", "infinity"):
            return "inf"
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"batch_dependency must be a positive integer or inf, got {value!r}")
        return value


class GNSConfig(_Section):
    """``sampling.gns``: global neighbour sampling (Dong et al., GNS, §3)."""

    cache_fraction: float = Field(0.01, gt=0, le=1, description="nodes in the global node cache, as a "
                                                                "fraction of the graph's nodes (paper: 1%)")
    refresh_every: int = Field(100, ge=1, description="the cache is sampled again every this many batches")
    cache_only_input_layer: bool = Field(False, description="the input layer samples only cached neighbours")
    cache_probability: Literal["auto", "degree", "random_walk"] = Field(
        "auto", description="the cache's sampling probability: degree (Eq. 6), random_walk (Eq. 7-9), or auto "
                            "(degree when training nodes are at least half the graph, else random_walk)")


class SamplingConfig(_Section):
    """``sampling``: the sampler, its per-layer fanouts (input layer first) and the seed nodes per batch."""

    sampler: Literal[SAMPLERS] = Field("ns", description="full, ns (uniform neighbour sampling; with null fanouts "
                                                         "the full neighbourhood), bulk-ns (ns's batches, sampled "
                                                         "`bulk` at a time as sparse products), bulk-ladies (LADIES' "
                                                         "layer-wise samples, `bulk` at a time), labor or gns")
    fanouts: list[int] | None = Field(None, description="per layer, input layer first; null or -1 = full neighbourhood")
    batch_size: int | None = Field(None, ge=1, description="seed nodes per mini-batch; null = the full batch")
    bulk: int | Literal["auto"] = Field(
        "auto", description="bulk-ns, bulk-ladies: consecutive batches of an epoch sampled together as one stack per "
                            "layer (the same batches as one at a time; more batches are alive at once); auto: as many "
                            "of the epoch's batches as fit bulk_memory (at least 1)")
    bulk_memory: int = Field(
        128 * 2**20, description="bulk-ns, bulk-ladies with bulk: auto: the bytes a draw of k batches may take (the "
                                 "sampler's upper bound of its peak, on sampling.device: '128MiB' works); 128 MiB "
                                 "gives k = 8, the fastest k measured on the CPU, for 1024 seeds and fanouts 10,10,10 "
                                 "on ego-Twitter, and is 1.6% of an 8 GiB GPU")
    device: Literal["cpu", "cuda"] = Field("cpu", description="bulk-ns, bulk-ladies: where the sampling runs (the "
                                                              "graph structure is copied to the GPU with cuda); the "
                                                              "blocks come back to the graph's device")
    labor: LaborConfig = LaborConfig()
    gns: GNSConfig = GNSConfig()

    @field_validator("fanouts", mode="before")
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.strip("[]").split(",") if part.strip()]
        if isinstance(value, int):
            return [value]
        return value

    @field_validator("bulk", mode="before")
    @classmethod
    def _bulk(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"expected auto or a number of batches of at least 1, got {value!r}")
        return value

    @field_validator("bulk_memory", mode="before")
    @classmethod
    def _bulk_memory(cls, value: Any) -> Any:
        return parse_bytes(value)

    @field_validator("fanouts")
    @classmethod
    def _positive(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(f == 0 or f < -1 for f in value):
            raise ValueError("each fanout must be positive, or -1 for the full neighbourhood")
        return value

    @model_validator(mode="after")
    def _fanouts_fit_sampler(self) -> "SamplingConfig":
        if self.sampler == "full" and self.fanouts is not None and any(f != -1 for f in self.fanouts):
            raise ValueError("sampler 'full' takes every in-edge: set sampling.fanouts to null (or -1 per layer), "
                             "or choose sampler ns, labor or gns")
        if self.device == "cuda" and not self.sampler.startswith("bulk-"):
            raise ValueError(f"sampling.device=cuda runs the bulk samplers on the GPU; sampler {self.sampler!r} "
                             "samples on the graph's device: set sampling.sampler to bulk-ns or bulk-ladies, or "
                             "sampling.device=cpu")
        if self.sampler in ("labor", "gns") and self.fanouts is None:
            raise ValueError(f"sampler {self.sampler!r} needs sampling.fanouts (one per layer, input layer first), "
                             "e.g. sampling.fanouts=[10,10]")
        return self


class CacheConfig(_Section):
    """``features.cache``: the device node cache in front of the host features (GNS §3)."""

    kind: Literal[CACHE_KINDS] = Field(
        "none", description="none; static (highest out-degree nodes, filled once); lru (most recently read); "
                            "gns (the GNS sampler's node cache, refreshed with it; needs sampling.sampler=gns)")
    size: float | int | str = Field(
        0.1, description="static/lru cache size: a fraction of the nodes in (0, 1] (0.1), a node count (50000) or "
                         "bytes with a unit ('256MiB'); gns takes sampling.gns.cache_fraction")

    @field_validator("size", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        cache_capacity(value, num_nodes=1, row_bytes=1)  # its rules, before any graph is known (ValueError)
        return value


class FeaturesConfig(_Section):
    """``features``: how input features reach the training device (docs/design.md › Feature store)."""

    cache: CacheConfig = CacheConfig()
    macro_batch: int = Field(
        0, ge=0, description="BatchGNN macro-batch gathering: the union of the input nodes of this many consecutive "
                             "mini-batches is gathered once (1 = the micro-batches of one batch share one gather); "
                             "0 = off")
    macro_batch_budget: int | None = Field(
        None, description="device bytes a staged macro-batch may take (its distinct input rows x row bytes); a "
                          "group of features.macro_batch batches over it is staged in several rounds of consecutive "
                          "batches (BatchGNN's F <= B), and a batch over it on its own is not staged; null = no "
                          "limit (refused under a micro_batch.budget)")

    aggregation_cache: bool | Literal["approximate"] = Field(
        False, description="BatchGNN's input-feature aggregation cache (§3, App. B-C): layer 0's neighbour "
                           "aggregation of the input features is computed once per run over the full neighbourhood "
                           "(kept on disk beside the dataset) and layer 0 reads each dst node's cached rows instead "
                           "of its block; true: exact, refused with a sampled layer 0 or dropout; approximate: "
                           "allowed there, with a warning (it changes what layer 0 computes); sage mean/gcn and gcn")

    @field_validator("macro_batch_budget", mode="before")
    @classmethod
    def _macro_budget(cls, value: Any) -> Any:
        return None if value is None else parse_bytes(value)

    @field_validator("aggregation_cache", mode="before")
    @classmethod
    def _cache_mode(cls, value: Any) -> Any:
        return _bool_or_word(value, "approximate")


_SIZE_HINT = "expected a size in bytes such as 8000000000, '6GiB' or '512 MB'"
_BYTE_SIZE = TypeAdapter(ByteSize)


def parse_bytes(value: Any, *, allow_zero: bool = False) -> int:
    """A memory size in bytes: an integer, or a string ``pydantic.ByteSize`` reads (``"6GiB"``,
    ``"512 MB"``, ``"12mib"``, ``"1.5GB"``; decimal ``kB``/``MB``/``GB``/``TB`` and binary
    ``KiB``/``MiB``/``GiB``/``TiB``, case-insensitive). A float is rounded down.

    Args:
        value: the size as written in the config or an override.
        allow_zero: accept 0 (a safety margin may be none).

    Returns:
        The size in bytes.

    Raises:
        ValueError: not a size, or not positive (negative with ``allow_zero``).
    """
    if isinstance(value, bool):
        raise ValueError(_SIZE_HINT)
    if isinstance(value, (int, float)):
        number = int(value)
    else:
        try:
            number = int(_BYTE_SIZE.validate_python(str(value).strip()))
        except ValidationError:
            raise ValueError(f"{_SIZE_HINT}, got {value!r}") from None
    if number < 0 or (number == 0 and not allow_zero):
        raise ValueError(f"a memory size must be {'non-negative' if allow_zero else 'positive'}, got {value!r}")
    return number


class MicroBatchConfig(_Section):
    """``micro_batch``: how each batch is split: mode, partitioner, K or a memory budget (bytes)."""

    partitioner: Literal[tuple(PARTITIONERS)] = Field("reg", description="a key of partition.PARTITIONERS")
    num_micro_batches: int = Field(4, ge=1, description="K when budget is null: micro-batches per batch (mode "
                                   "micro_batches) or chunks per layer (mode layerwise)")
    budget: int | Literal["auto"] | None = Field(
        None, description="memory budget per micro-batch: bytes ('6GiB' works), 'auto' (GPU free memory "
                          "plus what the run already holds there), or null to use num_micro_batches; the "
                          "planner plans against it less safety_margin and the feature store's device bytes")
    safety_margin: int | None = Field(
        None, description="bytes of the budget kept free for the CUDA caching allocator's fragmentation; null: "
                          "betty_trainer.memory.device.allocator_margin of the allocator setting (0 on the CPU)")
    balance: bool = Field(True, description="METIS balances each output's receptive-field size, not output counts")
    assignment: Literal["batch", "graph", "auto"] = Field(
        "auto", description="how a batch's outputs go to micro-batches: batch (the partitioner cuts each batch); "
                            "graph (METIS cuts the whole graph once per K for the run, and each output takes its "
                            "node's part; under a budget a batch whose plan misses it is planned per batch, and "
                            "the next batches try more micro-batches; layer-wise chunks group each layer's dst "
                            "nodes by their parts in a partition balancing every node); auto: graph for sampled "
                            "batches (a mini-batch or sampled fanouts) with a METIS-based partitioner (reg, "
                            "reg_unweighted, metis), batch otherwise")
    mode: Literal["micro_batches", "layerwise", "auto"] = Field(
        "micro_batches", description="micro_batches: K micro-batches of the outputs, each through all layers "
                                     "(Betty); layerwise: one layer at a time in K chunks per layer, recomputed in "
                                     "backward (built-in models); auto: under a budget, the fitting plan of either "
                                     "with the least estimated work. K is num_micro_batches in both")
    keep_transposes: bool | Literal["auto"] = Field(
        "auto", description="a full batch trained every step and planned in one micro-batch on the CPU keeps each "
                            "block's transpose (a CSR) for the run where its aggregation backpropagates, so that "
                            "backward gathers instead of scattering (faster; 4·(S + 1) + 2·E bytes per block of "
                            "fewer than 2^15 dst nodes, 4·(S + 1 + E) above, counted in the estimate); true: "
                            "whenever the estimate with them fits the budget (or without one); auto: only under a "
                            "budget they fit; false: never")

    @field_validator("keep_transposes", mode="before")
    @classmethod
    def _keep_transposes(cls, value: Any) -> Any:
        return _bool_or_word(value, "auto")

    @field_validator("mode", mode="before")
    @classmethod
    def _renamed_mode(cls, value: Any) -> Any:
        if value == "betty":  # the name until 0.1: the method, not the paper, names a mode now
            logger.warning("micro_batch.mode=betty is now called micro_batch.mode=micro_batches; "
                           "'betty' still works but will be removed")
            return "micro_batches"
        return value

    @field_validator("budget", mode="before")
    @classmethod
    def _budget_size(cls, value: Any) -> Any:
        if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
            return None if value is None else "auto"
        return parse_bytes(value)

    @field_validator("safety_margin", mode="before")
    @classmethod
    def _margin_size(cls, value: Any) -> Any:
        return None if value is None else parse_bytes(value, allow_zero=True)


def _bool_or_word(value: Any, word: str) -> Any:
    """``true``/``false`` or ``word``; a string from the command line (``'true'``) is read as YAML does.

    Raises:
        ValueError: anything else.
    """
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if value not in (True, False, word):
        raise ValueError(f"expected true, false or {word}, got {value!r}")
    return value


MAX_WEIGHT_DECAY = float(torch.finfo(torch.float32).max)
"""Largest ``optim.weight_decay``: float32's largest value (Adam converts it to a float32 scalar)."""
MAX_LR = 3.4e37
"""Largest ``optim.lr``/``optim.min_lr``: Adam's first step divides the learning rate by its bias correction
``1 - beta1 = 0.1`` (Kingma & Ba 2015, Algorithm 1) and converts the quotient to a float32 scalar, which
overflows above float32's largest value (3.4028e38)."""


class OptimConfig(_Section):
    """``optim``: Adam's learning rate and weight decay, the number of epochs and the learning-rate
    schedule (``torch.optim.lr_scheduler``, stepped once per epoch; off by default)."""

    lr: float = Field(0.01, gt=0)
    weight_decay: float = Field(5e-4, ge=0)
    epochs: int = Field(200, ge=1)
    scheduler: Literal["none", "step", "cosine"] = Field(
        "none", description="none; step (StepLR: lr × gamma every step_size epochs); cosine (CosineAnnealingLR "
                            "from lr down to min_lr over optim.epochs)")
    step_size: int = Field(50, ge=1, description="epochs between two decays of the step scheduler")
    gamma: float = Field(0.5, gt=0, le=1, description="decay factor of the step scheduler")
    min_lr: float = Field(0.0, ge=0, description="last learning rate of the cosine scheduler")

    optimizer: ClassVar[str] = "adam"
    """Not a key: the optimizer :meth:`make_optimizer` builds, as the memory estimate names it
    (``estimator.spec.ModelSpec.optimizer``)."""

    def make_optimizer(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The run's optimizer over ``params``: ``torch.optim.Adam`` with ``lr`` and ``weight_decay`` (PyTorch's
        default ``foreach`` choice); training, the dry run's measurement and a custom model's calibration all
        build it here."""
        return torch.optim.Adam(params, lr=self.lr, weight_decay=self.weight_decay)

    @field_validator("lr", "min_lr")
    @classmethod
    def _lr_fits_float32(cls, value: float) -> float:
        if value > MAX_LR:
            raise ValueError(f"a learning rate must be at most {MAX_LR:.3g}: Adam divides it by 1 - beta1 = 0.1 "
                             "and the result must fit in float32")
        return value

    @field_validator("weight_decay")
    @classmethod
    def _decay_fits_float32(cls, value: float) -> float:
        if value > MAX_WEIGHT_DECAY:
            raise ValueError(f"weight decay must be at most {MAX_WEIGHT_DECAY:.5g} (float32's largest value)")
        return value


_DEVICE = r"^(auto|cpu|cuda(:[0-9]+)?)$"


class TrainConfig(_Section):
    """``train``: run directory, device, evaluation frequency, progress display, early stopping and
    TensorBoard logging."""

    run_dir: Path | None = Field(None, description="run directory; null = runs/<config name>-<timestamp>")
    device: str = Field("auto", pattern=_DEVICE, description="auto, cpu, cuda or cuda:N (whether a GPU is there "
                                                             "is checked when the run starts)")
    eval_every: int = Field(1, ge=1, description="evaluate every this many epochs")
    progress: bool = Field(True, description="show a live progress bar on a terminal (else one line per epoch)")
    patience: int | None = Field(
        None, ge=1, description="early stopping: stop when validation accuracy has not improved for this many "
                                "epochs; null = train all optim.epochs")
    tensorboard: bool = Field(False, description="also log the metrics for TensorBoard in <run_dir>/tensorboard "
                                                 "(needs the tensorboard package)")
    stop_on_divergence: bool = Field(
        False, description="end the run when an epoch's training loss exceeds 1000 × ln(num_classes), the "
                           "cross-entropy of a uniform guess (false: a warning only)")


class DistributedConfig(_Section):
    """``distributed``: several processes training one model, launched by ``torchrun`` (README › Several GPUs).

    ``cooperative`` shares each global batch of ``sampling.batch_size`` seeds among the ``P`` processes (cooperative
    minibatching, Balın et al. 2023, §3.1, Alg. 1): each samples, loads and computes the part of the batch whose
    vertices it owns, and embeddings move between them by all-to-all. ``independent`` is the usual data-parallel
    baseline: each process samples its ``B/P`` share of the global batch's seeds on its own. Both all-reduce the
    gradients, so every process takes the same optimizer step on the gradient of the global batch's mean loss."""

    mode: Literal["none", "cooperative", "independent"] = Field(
        "none", description="none: one process; cooperative: one global batch shared by all processes over "
                            "all-to-all; independent: each process samples its B/P share of the seeds alone")
    ownership: Literal["random", "metis"] = Field(
        "metis", description="cooperative: which process owns each vertex (its features, its in-edges' sampling "
                             "and its embeddings); metis communicates fewer vertices, random balances exactly. "
                             "Computed once and kept beside the dataset's cache")
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="torch.distributed backend: auto = nccl on CUDA, gloo on the CPU (sampled ids always "
                            "go over a gloo group)")
    timeout_s: float = Field(
        600.0, gt=0, description="seconds a collective waits for the other processes before the run ends with an "
                                 "error naming this process (a process that dies is noticed at once on gloo)")


class Config(_Section):
    """A whole run. ``Config()`` is the synthetic quickstart."""

    name: str = Field("run", description="run name, used for the default run directory")
    seed: int = Field(0, ge=0)
    dataset: DatasetConfig = DatasetConfig()
    model: ModelConfig = MODEL_SECTIONS["sage"]()
    sampling: SamplingConfig = SamplingConfig()
    features: FeaturesConfig = FeaturesConfig()
    micro_batch: MicroBatchConfig = MicroBatchConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    distributed: DistributedConfig = DistributedConfig()

    @model_validator(mode="after")
    def _fanouts_match_layers(self) -> "Config":
        fanouts = self.sampling.fanouts
        if fanouts is not None and len(fanouts) != self.model.num_layers:
            raise ValueError(
                f"sampling.fanouts has {len(fanouts)} entries but model.num_layers is {self.model.num_layers}"
            )
        _check_aggregation_cache(self)
        if self.features.cache.kind == "gns" and self.sampling.sampler != "gns":
            raise ValueError(f"features.cache.kind 'gns' caches the GNS sampler's node set, but sampling.sampler is "
                             f"{self.sampling.sampler!r}: set sampling.sampler=gns, or features.cache.kind=static or lru")
        return self

    @field_validator("name")
    @classmethod
    def _name_is_not_a_path(cls, value: str) -> str:
        if any(sep in value for sep in ("/", "\\", "\0")) or value in (".", ".."):
            raise ValueError("the name goes into the run directory runs/<name>-<timestamp>, so it must not contain "
                             "'/', '\\' or a NUL byte, nor be '.' or '..'; set train.run_dir to choose the folder")
        return value

    def to_yaml(self) -> str:
        """The resolved config as YAML (paths as strings)."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


AGGREGATION_CACHE_MODELS = (("sage", "mean"), ("sage", "gcn"), ("gcn", None))
"""``(model.arch, model.aggregator)`` whose layer 0 the aggregation cache replaces: a linear aggregation of the input
features, the same for every parameter value (``None``: the architecture has no aggregator key)."""


def _check_aggregation_cache(config: "Config") -> None:
    """``features.aggregation_cache``'s rules (BatchGNN §3, App. B): a model whose layer 0 is a linear aggregation,
    two layers or more, one process, micro-batches; ``true`` (exact) only where layer 0 aggregates the full
    neighbourhood of unmasked features (fanout ``-1``/null of ``full``, ``ns`` or ``bulk-ns``, ``model.dropout: 0``).

    Raises:
        ValueError: the first rule broken, naming the keys.
    """
    mode = config.features.aggregation_cache
    if mode is False:
        return
    model = config.model
    if (model.arch, getattr(model, "aggregator", None)) not in AGGREGATION_CACHE_MODELS:
        raise ValueError("features.aggregation_cache caches a linear first-layer aggregation: model.arch=sage with "
                         "model.aggregator mean or gcn, or model.arch=gcn; set features.aggregation_cache=false")
    if model.num_layers < 2:
        raise ValueError("features.aggregation_cache replaces layer 0's block: model.num_layers must be at least 2")
    if config.distributed.mode != "none":
        raise ValueError("features.aggregation_cache runs in one process: set distributed.mode=none")
    if config.micro_batch.mode == "layerwise":
        raise ValueError("features.aggregation_cache runs micro-batches: set micro_batch.mode=micro_batches or auto "
                         "(which keeps the cache only where the estimate is lower with it)")
    if mode == "approximate":
        return
    fanouts = config.sampling.fanouts
    sampled = config.sampling.sampler not in ("full", "ns", "bulk-ns") or (fanouts is not None and fanouts[0] != -1)
    if sampled or model.dropout > 0:
        why = "layer 0 samples its neighbourhood" if sampled else f"model.dropout={model.dropout} masks the input features"
        raise ValueError(f"features.aggregation_cache=true is exact only over the full neighbourhood without dropout, "
                         f"and here {why}: set sampling.sampler=full or ns with sampling.fanouts[0]=-1 and "
                         "model.dropout=0, or features.aggregation_cache=approximate to train on the full-neighbourhood "
                         "aggregate anyway (BatchGNN App. B: accuracy may rise or fall)")


MAX_CONFIG_VALUES = 10_000
"""Values (mappings, lists, scalars) a config may expand to; a real one has a few hundred. YAML aliases can make a
300-byte file expand to billions (an "alias bomb"), which is refused before it is walked further."""


class _Refused(Exception):
    """A YAML document :class:`_ConfigLoader` refuses; the message says why."""


class _TooLarge(_Refused):
    def __init__(self) -> None:
        super().__init__(f"it expands to over {MAX_CONFIG_VALUES:,} values through YAML aliases (*name); a config "
                         "has a few hundred: write the values out")


class _DuplicateKey(_Refused):
    """A mapping of a YAML document names a key twice (raised by :class:`_ConfigLoader`)."""

    def __init__(self, key: str, first_line: int, second_line: int) -> None:
        super().__init__(f"key {key!r} appears twice (lines {first_line} and {second_line}); keep one")


class _ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that names a key twice (plain YAML keeps the last one
    silently) with :class:`_DuplicateKey` naming the dotted key and both lines, and a document that expands to
    over :data:`MAX_CONFIG_VALUES` values (:class:`_TooLarge`), before anything is constructed."""

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        _check_unique_keys(node, [], [0])
        return self.construct_document(node)


def _check_unique_keys(node: yaml.Node, path: list[str], walked: list[int]) -> None:
    """Walk ``node`` as expanded (an aliased node once per use), counting the nodes in ``walked[0]``.

    Raises:
        _DuplicateKey: a mapping names a key twice. _TooLarge: over :data:`MAX_CONFIG_VALUES` nodes.
    """
    walked[0] += 1
    if walked[0] > MAX_CONFIG_VALUES:
        raise _TooLarge()
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else None
            if key is not None and key_node.tag != "tag:yaml.org,2002:merge":
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise _DuplicateKey(".".join([*path, key]), seen[key], line)
                seen[key] = line
            _check_unique_keys(value_node, [*path, str(key)], walked)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _check_unique_keys(item, [*path, str(index)], walked)


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML config, apply ``key.path=value`` overrides and validate.

    Override values are parsed as YAML scalars (``true``, ``3``, ``null``,
    ``[10, 25]``); a comma list ``10,25`` is accepted for list keys.

    Args:
        path: YAML file, or ``None`` for the defaults.
        overrides: ``"dotted.key=value"`` strings.

    Raises:
        ConfigError: unreadable or not UTF-8 file, bad YAML, a key written twice, a YAML alias bomb (over
            :data:`MAX_CONFIG_VALUES` values once expanded), malformed override, unknown key or bad value.
    """
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise ConfigError(f"cannot read config {path}: {error.strerror}") from None
        except UnicodeDecodeError as error:
            raise ConfigError(f"config {path} is not UTF-8 text (byte {error.start} is {error.object[error.start]:#04x}): "
                              "a config must be a UTF-8 YAML file") from None
        try:
            data = yaml.load(text, Loader=_ConfigLoader) or {}
        except _Refused as error:
            raise ConfigError(f"config {path}: {error}") from None
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError(f"config {path} is not valid YAML{where}: {getattr(error, 'problem', error)}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config {path} must be a mapping of keys to values, got {type(data).__name__}")
        data.setdefault("name", path.stem)
    parsed = [_parse_override(override) for override in overrides]
    _switch_arch(data, parsed)
    for override, parts, value in parsed:
        _set(data, override, parts, value)
    return validate_config(data)


def validate_config(data: dict[str, Any]) -> Config:
    """Validate a nested dict as a :class:`Config`.

    Raises:
        ConfigError: naming the first bad key and what is allowed.
    """
    try:
        return Config.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_describe(error)) from None


def _parse_override(override: str) -> tuple[str, list[str], Any]:
    """``"a.b=value"`` → ``(override, ["a", "b"], value parsed as YAML)``."""
    key, sep, raw = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {override!r} must look like key.path=value")
    try:
        value = yaml.load(raw, Loader=_ConfigLoader) if raw.strip() else None
    except _Refused as error:
        raise ConfigError(f"override {override!r}: {error}") from None
    except yaml.YAMLError:
        value = raw
    return override, key.strip().split("."), value


def _switch_arch(data: dict[str, Any], parsed: list[tuple[str, list[str], Any]]) -> None:
    """An override of ``model.arch`` keeps the file's model keys the new arch has and drops the
    others (``--config cora-sage.yaml model.arch=gcn`` drops the file's ``aggregator``); keys given
    as overrides are all kept, so ``model.arch=gcn model.aggregator=lstm`` is still refused."""
    arches = [value for _, parts, value in parsed if parts == ["model", "arch"]]
    section = data.get("model")
    if arches and isinstance(section, dict) and arches[-1] in MODEL_SECTIONS:
        keys = MODEL_SECTIONS[arches[-1]].model_fields
        data["model"] = {key: value for key, value in section.items() if key in keys}


def _set(data: dict[str, Any], override: str, parts: list[str], value: Any) -> None:
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _describe(error: ValidationError) -> str:
    first = error.errors()[0]
    loc, section = _walk(first["loc"])
    key = ".".join(loc) or "config"
    if first["type"] == "extra_forbidden":
        allowed = ", ".join(section.model_fields) if section else "?"
        if section not in MODEL_SECTIONS.values():
            return f"unknown config key {key!r}; allowed here: {allowed}"
        arch = section.model_fields["arch"].default
        owners = [other for other in MODEL_SECTIONS.values() if loc[-1] in other.model_fields]
        if not owners:
            return f"unknown config key {key!r} with model.arch={arch!r}; allowed here: {allowed}"
        owned = f"a key of model.arch={' or '.join(repr(o.model_fields['arch'].default) for o in owners)}"
        try:  # a value no arch accepts is reported as such first
            setattr(owners[0].model_construct(), loc[-1], first["input"])
        except ValidationError as wrong:
            return f"invalid config value for {key!r} ({first['input']!r}): " \
                   f"{wrong.errors()[0]['msg'].removeprefix('Value error, ')} ({owned}, not {arch!r})"
        return f"unknown config key {key!r} with model.arch={arch!r} ({owned}); allowed here: {allowed}"
    if first["type"] == "union_tag_invalid":
        tag = first["ctx"]["tag"]
        return f"invalid config value for '{key}.arch' ({tag!r}): Input should be {_choices(MODEL_SECTIONS)}"
    if first["type"] == "union_tag_not_found":
        return f"invalid config value for {key!r} ({first.get('input')!r}): a section (mapping of keys) is expected"
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "string_pattern_mismatch" and loc == ["train", "device"]:
        message = "use auto, cpu, cuda or cuda:N (e.g. cuda:1)"
    if not loc:
        return f"invalid config: {message}"
    return f"invalid config value for {key!r} ({first.get('input')!r}): {message}"


def _choices(names: Sequence[str]) -> str:
    """``'a', 'b' or 'c'``, as pydantic words a literal's choices."""
    quoted = [repr(name) for name in names]
    return ", ".join(quoted[:-1]) + f" or {quoted[-1]}" if len(quoted) > 1 else quoted[0]


def _walk(loc: tuple) -> tuple[list[str], type[BaseModel] | None]:
    """The dotted key of an error location, with union tags (``model.<arch>``) dropped, and the
    section that holds its last part (``None`` below a plain value)."""
    parts = [str(part) for part in loc]
    keys: list[str] = []
    section: type[BaseModel] | None = Config
    container = section
    while parts:
        container, part = section, parts.pop(0)
        keys.append(part)
        field = section.model_fields.get(part) if section else None
        members = _tagged_members(field.annotation) if field else {}
        if members and parts and parts[0] in members:
            section = members[parts.pop(0)]
        elif field and isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            section = field.annotation
        else:
            section = None
    return keys, container


def _tagged_members(annotation: Any) -> dict[str, type[BaseModel]]:
    """``{tag: section}`` of a discriminated union such as :data:`ModelConfig`, else ``{}``."""
    if get_origin(annotation) is not Union:
        return {}
    members = {}
    for member in get_args(annotation):
        if get_origin(member) is Annotated:
            cls, *metadata = get_args(member)
            members.update({meta.tag: cls for meta in metadata if isinstance(meta, Tag)})
    return members
