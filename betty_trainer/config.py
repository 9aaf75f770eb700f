"""Run configuration: YAML files, dotted ``key=value`` overrides, validation (DESIGN.md › CLI).

Every key has a default, so an empty file is a valid config (the synthetic
quickstart). Unknown keys and bad values raise :class:`ConfigError` naming the
dotted key and what is allowed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from betty_trainer.errors import ConfigError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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


class DatasetConfig(_Section):
    """``dataset``: which graph, where its raw files are, and how they are checked and preprocessed."""

    name: str = Field("synthetic", description="a name listed by `betty-train datasets`")
    data_dir: Path | None = Field(None, description="folder holding the raw files (else BETTY_DATA_DIR, else the download cache)")
    verify_checksums: bool = Field(True, description="check every raw file's sha256 before parsing it")
    normalize_features: bool = Field(True, description="row-normalise features (as DGL/GCN do for Planetoid)")
    synthetic: SyntheticConfig = SyntheticConfig()


class ModelConfig(_Section):
    """``model``: the built-in model (GraphSAGE, GCN or GAT) and its widths; ignored for a custom model."""

    arch: Literal["sage", "gcn", "gat"] = "sage"
    aggregator: Literal["mean", "gcn", "pool", "lstm"] = Field("mean", description="GraphSAGE aggregator")
    hidden: int = Field(64, ge=1)
    heads: int = Field(4, ge=1, description="attention heads (gat)")
    num_layers: int = Field(2, ge=1)
    dropout: float = Field(0.5, ge=0, lt=1)


class SamplingConfig(_Section):
    """``sampling``: per-layer fanouts (input layer first) and the seed nodes per batch."""

    fanouts: list[int] | None = Field(None, description="per layer, input layer first; null or -1 = full neighbourhood")
    batch_size: int | None = Field(None, ge=1, description="seed nodes per mini-batch; null = the full batch")

    @field_validator("fanouts", mode="before")
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.strip("[]").split(",") if part.strip()]
        if isinstance(value, int):
            return [value]
        return value

    @field_validator("fanouts")
    @classmethod
    def _positive(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(f == 0 or f < -1 for f in value):
            raise ValueError("each fanout must be positive, or -1 for the full neighbourhood")
        return value


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: Any) -> int:
    """A memory size: an integer number of bytes or a string such as ``"6GiB"``, ``"512 MB"``.

    Raises:
        ValueError: not a size, or not positive.
    """
    if isinstance(value, bool):
        raise ValueError("expected a size in bytes such as 8000000000 or '6GiB'")
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        match = _SIZE.match(str(value))
        if not match:
            raise ValueError(f"expected a size in bytes such as 8000000000 or '6GiB', got {value!r}")
        number = float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()]
    if number <= 0:
        raise ValueError(f"a memory size must be positive, got {value!r}")
    return int(number)


class MicroBatchConfig(_Section):
    """``micro_batch``: how each batch is split: partitioner, K or a memory budget (bytes)."""

    partitioner: Literal["reg", "reg_unweighted", "metis", "range", "random"] = "reg"
    num_micro_batches: int = Field(4, ge=1, description="K micro-batches per batch when budget is null")
    budget: int | Literal["auto"] | None = Field(
        None, description="memory budget per micro-batch: bytes ('6GiB' works), 'auto' (GPU free memory "
                          "minus safety_margin), or null to use num_micro_batches")
    safety_margin: int = Field(512 * 2**20, description="bytes kept free under an 'auto' budget")
    balance: bool = Field(True, description="METIS balances each output's receptive-field size, not output counts")

    @field_validator("budget", mode="before")
    @classmethod
    def _budget_size(cls, value: Any) -> Any:
        if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
            return None if value is None else "auto"
        return parse_bytes(value)

    @field_validator("safety_margin", mode="before")
    @classmethod
    def _margin_size(cls, value: Any) -> Any:
        return 0 if value in (0, "0") else parse_bytes(value)


class OptimConfig(_Section):
    """``optim``: Adam's learning rate and weight decay, and the number of epochs."""

    lr: float = Field(0.01, gt=0)
    weight_decay: float = Field(5e-4, ge=0)
    epochs: int = Field(200, ge=1)


class TrainConfig(_Section):
    """``train``: run directory, device, evaluation frequency and progress bars."""

    run_dir: Path | None = Field(None, description="run directory; null = runs/<config name>-<timestamp>")
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    eval_every: int = Field(1, ge=1, description="evaluate every this many epochs")
    progress: bool = Field(True, description="show progress bars")


class Config(_Section):
    """A whole run. ``Config()`` is the synthetic quickstart."""

    name: str = Field("run", description="run name, used for the default run directory")
    seed: int = Field(0, ge=0)
    dataset: DatasetConfig = DatasetConfig()
    model: ModelConfig = ModelConfig()
    sampling: SamplingConfig = SamplingConfig()
    micro_batch: MicroBatchConfig = MicroBatchConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()

    @model_validator(mode="after")
    def _fanouts_match_layers(self) -> "Config":
        fanouts = self.sampling.fanouts
        if fanouts is not None and len(fanouts) != self.model.num_layers:
            raise ValueError(
                f"sampling.fanouts has {len(fanouts)} entries but model.num_layers is {self.model.num_layers}"
            )
        return self

    def to_yaml(self) -> str:
        """The resolved config as YAML (paths as strings)."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML config, apply ``key.path=value`` overrides and validate.

    Override values are parsed as YAML scalars (``true``, ``3``, ``null``,
    ``[10, 25]``); a comma list ``10,25`` is accepted for list keys.

    Args:
        path: YAML file, or ``None`` for the defaults.
        overrides: ``"dotted.key=value"`` strings.

    Raises:
        ConfigError: unreadable file, bad YAML, malformed override, unknown key or bad value.
    """
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as error:
            raise ConfigError(f"cannot read config {path}: {error.strerror}") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError(f"config {path} is not valid YAML{where}: {getattr(error, 'problem', error)}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config {path} must be a mapping of keys to values, got {type(data).__name__}")
        data.setdefault("name", path.stem)
    for override in overrides:
        _apply_override(data, override)
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


def _apply_override(data: dict[str, Any], override: str) -> None:
    key, sep, raw = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {override!r} must look like key.path=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    node = data
    parts = key.strip().split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _describe(error: ValidationError) -> str:
    first = error.errors()[0]
    key = ".".join(str(p) for p in first["loc"]) or "config"
    if first["type"] == "extra_forbidden":
        section = _section_at(first["loc"][:-1])
        allowed = ", ".join(section.model_fields) if section else "?"
        return f"unknown config key {key!r}; allowed here: {allowed}"
    message = first["msg"].removeprefix("Value error, ")
    if not first["loc"]:
        return f"invalid config: {message}"
    return f"invalid config value for {key!r} ({first.get('input')!r}): {message}"


def _section_at(loc: tuple) -> type[BaseModel] | None:
    section: type[BaseModel] = Config
    for part in loc:
        field = section.model_fields.get(str(part))
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        section = annotation
    return section
