"""Checkpoints: ``last.pt`` and ``best.pt``, each with a sha256 beside it, loaded without unpickling
arbitrary objects (``weights_only=True``) and refused when damaged, incomplete or diverged.

Files in a run directory:

- ``last.pt``: ``{"format", "kind": "last", "epoch", "model", "optimizer", "scheduler", "best", "identity"}``,
  replaced after every epoch; ``--resume`` continues from it. An epoch whose evaluation failed is saved with its
  metrics line as ``"unevaluated"`` too: the resume evaluates that epoch before training the next.
- ``best.pt``: ``{"format", "kind": "best", "epoch", "model", "metrics", "identity"}``, the model chosen on
  validation accuracy with its epoch's metrics line; replaced when validation accuracy improves.
- ``last.sha256`` / ``best.sha256``: ``<hex digest>  <file name>`` lines in ``sha256sum`` format
  (``sha256sum -c best.sha256`` checks a file by hand).

A checkpoint is written in three atomic steps: its ``.sha256`` listing the new digest and the digest of
the file it replaces, the checkpoint, then the ``.sha256`` listing the new digest alone. A crash or a full
disk between any two steps leaves a checkpoint whose digest is listed, so a run killed at any moment
resumes; a changed byte matches no listed digest and is refused.

``identity`` records what the parameters belong to: the dataset's name and sizes, the model section of
the config (or a custom model's class) and every parameter's shape, so a resume or a load with another
model or dataset is refused with one line naming what differs (:func:`identity_difference`). A run trained on
its own split (``dataset.split``) also records the split file's path and sha256, so that a missing or changed
split file is named before the dataset is loaded again (:func:`split_refusal`).
"""

from __future__ import annotations

import hashlib
import io
import pickle
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from betty_trainer.datasets.splits import split_sha256
from betty_trainer.errors import DatasetError, TrainingError
from betty_trainer.training.rundir import write_bytes, write_text

FORMAT = 1
LAST_NAME = "last.pt"
BEST_NAME = "best.pt"
CHECKPOINT_NAME = LAST_NAME  # the checkpoint --resume reads
CHECKPOINTS = {"last": LAST_NAME, "best": BEST_NAME}
REQUIRED_KEYS = {
    "last": ("epoch", "model", "optimizer", "best", "identity"),
    "best": ("epoch", "model", "metrics", "identity"),
}


def checksum_path(path: Path) -> Path:
    """``last.pt`` → ``last.sha256``: the digest file beside a checkpoint."""
    path = Path(path)
    return path.with_name(path.stem + ".sha256")


def sha256_hex(data: bytes | memoryview) -> str:
    """Hex sha256 digest of ``data``."""
    return hashlib.sha256(data).hexdigest()


def save_checkpoint(run_dir: Path, state: Mapping[str, Any], name: str = LAST_NAME) -> Path:
    """Write ``state`` to ``run_dir/name`` and its digest to ``name``'s ``.sha256`` file.

    The state is serialised in memory, then written with
    :func:`betty_trainer.training.rundir.write_bytes` (temp file, fsync, rename) in the three steps of the
    module docstring, so a crash, a full disk or a read-only file system mid-write leaves the previous
    checkpoint in place and verifiable.

    Args:
        run_dir: the run directory.
        state: tensors, numbers, strings, lists and dicts only; its ``"model"`` (a state dict) must be
            finite.
        name: ``last.pt`` or ``best.pt``.

    Returns:
        The checkpoint path.

    Raises:
        TrainingError: a parameter of ``state["model"]`` is NaN or infinite (nothing is written).
        RunDirError: a file cannot be written (the message names the path and the cause).
    """
    path = Path(run_dir) / name
    bad = non_finite(state.get("model", {}))
    if bad:
        raise TrainingError(f"not saving {path}: {bad}")
    buffer = io.BytesIO()
    torch.save(dict(state), buffer)  # in memory: a failing disk then raises OSError with its errno
    digest = sha256_hex(buffer.getbuffer())
    sums = checksum_path(path)
    previous = [d for d in _listed_digests(sums, name) if d != digest] if path.exists() else []
    write_text(sums, "".join(f"{d}  {name}\n" for d in [digest, *previous[:1]]))  # both stay valid in transit
    write_bytes(path, buffer.getbuffer())
    if previous:
        write_text(sums, f"{digest}  {name}\n")
    return path


def load_checkpoint(run_dir: Path, name: str = LAST_NAME) -> dict[str, Any]:
    """Read and check ``run_dir/name``: its sha256 must be one its ``.sha256`` file lists, it is
    unpickled with ``weights_only=True`` from the bytes that were checked (no arbitrary code runs),
    it must hold the keys its kind needs (:data:`REQUIRED_KEYS`) and finite model parameters.

    Args:
        run_dir: the run directory.
        name: ``last.pt`` (what ``--resume`` reads) or ``best.pt``.

    Returns:
        The checkpoint's state dict (tensors on the CPU).

    Raises:
        TrainingError: one line naming the file: missing, no or mismatching sha256, corrupt, holding
            objects other than tensors and plain data, lacking keys, a field of the wrong type (naming the
            field: ``epoch`` a non-negative integer, ``best``, ``optimizer``, ``identity``, …), or non-finite
            parameters.
    """
    path = Path(run_dir) / name
    if not path.is_file():
        if (Path(run_dir) / "checkpoint.pt").is_file():
            raise TrainingError(f"{run_dir} holds a checkpoint.pt of an earlier betty-train (no {name}, no sha256); "
                                "it cannot be verified: start a new run")
        raise TrainingError(f"no checkpoint {name} in {run_dir}" +
                            ("; nothing to resume from" if name == LAST_NAME else ""))
    data = _read(path)
    sums = checksum_path(path)
    listed = _listed_digests(sums, name)
    if not sums.is_file():
        raise TrainingError(f"checkpoint {path} has no checksum file {sums.name}, so it cannot be verified; "
                            "it was not written by betty-train")
    if sha256_hex(data) not in listed:
        raise TrainingError(f"checkpoint {path} does not match its sha256 in {sums.name}: the file is damaged "
                            "or was changed; it is refused")
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if "weights only" in str(error).lower():
            raise TrainingError(f"checkpoint {path} holds objects other than tensors and plain data; "
                                "it is refused (betty-train never writes such files)") from None
        raise TrainingError(f"checkpoint {path} is corrupt: {_first_line(error)}") from None
    except (RuntimeError, EOFError, ValueError, OSError) as error:
        raise TrainingError(f"checkpoint {path} is corrupt or unreadable: {_first_line(error)}") from None
    kind = "best" if name == BEST_NAME else "last"
    if not isinstance(state, dict):
        raise TrainingError(f"checkpoint {path} holds a {type(state).__name__}, not a betty-train checkpoint")
    missing = [key for key in REQUIRED_KEYS[kind] if key not in state]
    if missing:
        raise TrainingError(f"checkpoint {path} lacks {', '.join(map(repr, missing))}; it is not a betty-train "
                            f"{name} of this version (start a new run)")
    if not isinstance(state["model"], dict) or not all(isinstance(k, str) and isinstance(v, Tensor)
                                                       for k, v in state["model"].items()):
        raise TrainingError(f"checkpoint {path}: 'model' is not a state dict of tensors")
    wrong = _wrong_field(state, kind)
    if wrong:
        field, value, expected = wrong
        raise TrainingError(f"checkpoint {path}: {field!r} is {_shown(value)}, expected {expected}; the file was "
                            f"edited or is not a betty-train {name} of this version (start a new run)")
    bad = non_finite(state["model"])
    if bad:
        raise TrainingError(f"checkpoint {path} is refused: {bad}")
    return state


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_str_dict(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(key, str) for key in value)


def _wrong_field(state: Mapping[str, Any], kind: str) -> tuple[str, Any, str] | None:
    """``(dotted field, its value, what is expected)`` of the first field of a checkpoint of ``kind``
    (``"last"`` or ``"best"``) whose type differs from what :func:`save_checkpoint`'s callers write,
    else ``None``. Optional fields are checked when present; ``model`` is checked by the caller."""
    checks: list[tuple[str, Any, bool, str]] = []
    if "format" in state:
        checks.append(("format", state["format"], _is_int(state["format"]), "an integer"))
    if "kind" in state:
        checks.append(("kind", state["kind"], isinstance(state["kind"], str), "a string"))
    epoch = state["epoch"]
    checks.append(("epoch", epoch, _is_int(epoch) and epoch >= 0, "a non-negative integer"))
    ident = state["identity"]
    checks.append(("identity", ident, isinstance(ident, dict), "a mapping"))
    if kind == "last":
        optimizer, best = state["optimizer"], state["best"]
        checks.append(("optimizer", optimizer, isinstance(optimizer, dict), "an optimizer state dict"))
        if isinstance(optimizer, dict):
            checks.append(("optimizer.state", optimizer.get("state"), isinstance(optimizer.get("state"), dict),
                           "a mapping"))
            groups = optimizer.get("param_groups")
            checks.append(("optimizer.param_groups", groups,
                           isinstance(groups, list) and all(_is_str_dict(group) for group in groups),
                           "a list of mappings"))
        if "scheduler" in state:
            scheduler = state["scheduler"]
            checks.append(("scheduler", scheduler, scheduler is None or _is_str_dict(scheduler),
                           "null or a scheduler state dict"))
        if state.get("unevaluated") is not None:
            checks.append(("unevaluated", state["unevaluated"], _is_str_dict(state["unevaluated"]),
                           "null or a mapping of the epoch's metrics"))
        checks.append(("best", best, _is_str_dict(best), "a mapping of epoch, val_acc and test_acc"))
        if _is_str_dict(best):
            checks += [("best.epoch", best.get("epoch"), _is_int(best.get("epoch")) and best["epoch"] >= -1,
                        "an integer >= -1"),
                       ("best.val_acc", best.get("val_acc"), _is_number(best.get("val_acc")), "a number"),
                       ("best.test_acc", best.get("test_acc"),
                        best.get("test_acc") is None or _is_number(best.get("test_acc")), "a number or null")]
    else:
        checks.append(("metrics", state["metrics"], _is_str_dict(state["metrics"]), "a mapping"))
    for field, value, ok, expected in checks:
        if not ok:
            return field, value, expected
    for section in ("dataset", "model"):
        if section in ident and not _is_str_dict(ident[section]):
            return f"identity.{section}", ident[section], "a mapping"
    shapes = ident.get("shapes", {})
    if not _is_str_dict(shapes) or not all(isinstance(shape, list) and all(_is_int(n) for n in shape)
                                           for shape in shapes.values()):
        return "identity.shapes", shapes, "a mapping of parameter names to lists of integers"
    return None


def _shown(value: Any) -> str:
    """A short description of a checkpoint field's value: its repr for a scalar, else its type."""
    if value is None or isinstance(value, (bool, int, float, str)):
        text = repr(value)
        return f"{text[:40]}… ({type(value).__name__})" if len(text) > 40 else f"{text} ({type(value).__name__})"
    return f"a {type(value).__name__}"


def non_finite(tensors: Mapping[str, Any]) -> str | None:
    """``None`` when every floating tensor of ``tensors`` is finite, else a phrase naming the first one
    with NaN or infinite values and how many it holds."""
    for key, value in tensors.items():
        if isinstance(value, Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            count = int((~torch.isfinite(value)).sum())
            return f"parameter {key!r} has {count} NaN or infinite value{'s' if count > 1 else ''}"
    return None


def identity(dataset: Mapping[str, Any], model: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> dict:
    """What a checkpoint's parameters belong to (see the module docstring).

    Args:
        dataset: e.g. ``{"name": ..., "num_nodes": ..., "num_edges": ..., "num_features": ..., "num_classes": ...}``.
        model: the config's ``model`` section as a dict, or ``{"custom": "<module>.<class>"}``.
        state_dict: the model's state dict (its shapes are recorded).
    """
    return {"dataset": dict(dataset), "model": dict(model),
            "shapes": {key: list(value.shape) for key, value in state_dict.items()}}


def identity_difference(saved: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
    """``None`` when ``current`` matches ``saved`` (both from :func:`identity`), else a phrase naming the
    first difference, e.g. ``"model.hidden is 32 here but 64 in the checkpoint"``."""
    for section in ("dataset", "model"):
        for key in _keys(saved.get(section, {}), current.get(section, {})):
            here, there = current.get(section, {}).get(key), saved.get(section, {}).get(key)
            if section == "dataset" and key == "split":
                phrase = split_difference(there, here)
                if phrase is not None:
                    return phrase
                continue
            if here != there and key == "fingerprint":
                return ("the dataset's content differs from the checkpoint's (same name and sizes, other structure, "
                        "labels, split or features)")
            if here != there:
                return f"{section}.{key} is {here!r} here but {there!r} in the checkpoint"
    shapes, saved_shapes = current.get("shapes", {}), saved.get("shapes", {})
    for key in _keys(saved_shapes, shapes):
        if shapes.get(key) != saved_shapes.get(key):
            return (f"model parameter {key!r} has shape {shapes.get(key)} here but {saved_shapes.get(key)} "
                    "in the checkpoint")
    return None


def state_dict_difference(model: Mapping[str, Any], saved: Mapping[str, Any]) -> str | None:
    """``None`` when the checkpoint's state dict ``saved`` fits the model's ``model`` (the same keys, each tensor of
    the same shape), else a phrase naming the first parameter that does not and both shapes, e.g. ``"parameter
    'layers.0.weight' has shape [64, 16] in the checkpoint but [64, 32] in the model"``: what ``load_state_dict``
    would refuse, said in one line (a checkpoint edited and re-hashed by hand still gets here)."""
    for key in _keys(model, saved):
        if key not in saved:
            return f"the checkpoint lacks parameter {key!r}"
        if key not in model:
            return f"the checkpoint holds parameter {key!r}, which the model does not have"
        here, there = model[key], saved[key]
        if isinstance(here, Tensor) and isinstance(there, Tensor) and here.shape != there.shape:
            return (f"parameter {key!r} has shape {list(there.shape)} in the checkpoint but {list(here.shape)} in "
                    "the model")
    return None


def _keys(one: Mapping[str, Any], two: Mapping[str, Any]) -> Iterable[str]:
    return list(one) + [key for key in two if key not in one]


def _listed_digests(sums: Path, name: str) -> list[str]:
    try:
        lines = sums.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    digests = []
    for line in lines:
        digest, _, listed = line.partition("  ")
        if listed.strip().lstrip("*") == name and len(digest) == 64:
            digests.append(digest.lower())
    return digests


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise TrainingError(f"cannot read checkpoint {path}: {error.strerror or error}") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


FINGERPRINT_ROWS = 1024  # feature rows hashed into a dataset's fingerprint (a memory-mapped matrix is not read whole)


def dataset_identity(graph: Any, split: Path | None = None) -> dict[str, Any]:
    """The ``identity["dataset"]`` of a :class:`~betty_trainer.data.graph.Graph`: its name, sizes and a
    fingerprint: 16 hex digits of the sha256 of its CSC structure, labels, splits and first
    :data:`FINGERPRINT_ROWS` feature rows, so another split or another feature preprocessing of the same
    dataset is told apart too; with ``split`` (the config's ``dataset.split``, whose split the graph holds),
    also ``split``: the file's path and sha256 (:func:`~betty_trainer.datasets.splits.split_sha256`), so that a
    missing or changed split file is named (:func:`split_refusal`).

    Raises:
        DatasetError: ``split`` is given but missing.
    """
    digest = hashlib.sha256()
    for tensor in (graph.indptr, graph.indices, graph.y, graph.train_idx, graph.val_idx, graph.test_idx,
                   graph.x[:FINGERPRINT_ROWS]):
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return {"name": graph.name, "num_nodes": int(graph.num_nodes), "num_edges": int(graph.indices.numel()),
            "num_features": int(graph.num_features), "num_classes": int(graph.num_classes),
            "fingerprint": digest.hexdigest()[:16],
            **({"split": {"path": str(split), "sha256": split_sha256(split)}} if split is not None else {})}


def split_difference(saved: Any, current: Any) -> str | None:
    """``None`` when a run's ``identity["dataset"]["split"]`` (``saved``) and the one here (``current``) name
    the same split (same sha256; the file may have moved), else a phrase naming the file and what differs.
    A graph given from Python records no split (``current`` is ``None``): its fingerprint decides."""
    if not isinstance(saved, Mapping):
        saved = None
    if current is None or (saved is None and not isinstance(current, Mapping)):
        return None
    if saved is None:
        return (f"dataset.split is {current['path']} here but the checkpoint was trained on the dataset's own "
                "split (no dataset.split)")
    if current.get("sha256") == saved.get("sha256"):
        return None
    return (f"the split file {current['path']} (dataset.split) has sha256 {str(current.get('sha256'))[:16]}… "
            f"here but the run was trained on {saved.get('path')} with sha256 {str(saved.get('sha256'))[:16]}…: "
            "the split changed since training; restore the original file, or train a new run on this split")


def split_refusal(saved_identity: Mapping[str, Any], split: Path | None) -> str | None:
    """Before a run's dataset is loaded again (``evaluate``, ``predict``, ``--resume``): ``None`` when the
    config's ``dataset.split`` (``split``) is the file the run was trained on (``saved_identity``, its
    checkpoint's identity) or the run used none, else a phrase naming the path and what is missing or differs."""
    dataset = saved_identity.get("dataset") if isinstance(saved_identity, Mapping) else None
    saved = dataset.get("split") if isinstance(dataset, Mapping) else None
    if not isinstance(saved, Mapping):
        return None
    if split is None:
        return (f"the run was trained on the split file {saved.get('path')} (dataset.split) but no dataset.split "
                f"is given here; give dataset.split={saved.get('path')}")
    if not split.exists():
        moved = "" if str(split) == saved.get("path") else f" (trained on {saved.get('path')})"
        return (f"the run was trained on the split file {split}{moved} (dataset.split, sha256 "
                f"{str(saved.get('sha256'))[:16]}…), which is missing; put that file back, or train a new run")
    try:
        digest = split_sha256(split)
    except DatasetError as error:
        return str(error)
    return split_difference(saved, {"path": str(split), "sha256": digest})
