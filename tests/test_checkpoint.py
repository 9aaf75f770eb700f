"""Checkpoints whose fields have the wrong types (a hand-edited file with a matching sha256) are refused in
one line naming the field, before a trainer or ``evaluate`` uses them."""

from __future__ import annotations

import pytest
import torch

from betty_trainer.errors import TrainingError
from betty_trainer.training.checkpoint import BEST_NAME, FORMAT, LAST_NAME, identity, load_checkpoint, save_checkpoint


def _states() -> dict[str, dict]:
    """A ``last.pt`` and a ``best.pt`` state as the trainer writes them (a real Adam stepped once, StepLR)."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    ident = identity({"name": "synthetic", "num_nodes": 10, "fingerprint": "0" * 16}, {"arch": "sage", "hidden": 2},
                     model.state_dict())
    last = {"format": FORMAT, "kind": "last", "epoch": 3, "model": model.state_dict(),
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "best": {"epoch": 2, "val_acc": 0.5, "test_acc": float("nan")}, "identity": ident}
    best = {"format": FORMAT, "kind": "best", "epoch": 2, "model": model.state_dict(),
            "metrics": {"epoch": 2, "loss": 0.3, "val_acc": 0.5, "test_acc": None}, "identity": ident}
    return {LAST_NAME: last, BEST_NAME: best}


@pytest.mark.parametrize("name", [LAST_NAME, BEST_NAME])
def test_checkpoints_as_the_trainer_writes_them_load(tmp_path, name):
    state = _states()[name]
    save_checkpoint(tmp_path, state, name)
    loaded = load_checkpoint(tmp_path, name)
    assert loaded["epoch"] == state["epoch"] and loaded.keys() == state.keys()
    no_scheduler = dict(_states()[LAST_NAME], scheduler=None, best={"epoch": -1, "val_acc": -1.0, "test_acc": None})
    save_checkpoint(tmp_path, no_scheduler, LAST_NAME)
    assert load_checkpoint(tmp_path, LAST_NAME)["scheduler"] is None


def _set(state: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    for part in parents:
        state = state[part]
    state[last] = value


@pytest.mark.parametrize("name, field, value", [
    (LAST_NAME, "epoch", "x"),
    (LAST_NAME, "epoch", True),
    (LAST_NAME, "epoch", 2.0),
    (LAST_NAME, "epoch", -1),
    (BEST_NAME, "epoch", "x"),
    (LAST_NAME, "format", "1"),
    (LAST_NAME, "kind", 5),
    (LAST_NAME, "best", "x"),
    (LAST_NAME, "best.epoch", "x"),
    (LAST_NAME, "best.val_acc", "0.5"),
    (LAST_NAME, "best.test_acc", "nan"),
    (LAST_NAME, "optimizer", []),
    (LAST_NAME, "optimizer.param_groups", {}),
    (LAST_NAME, "optimizer.state", []),
    (LAST_NAME, "scheduler", 5),
    (LAST_NAME, "unevaluated", "x"),
    (LAST_NAME, "unevaluated", [0.5]),
    (LAST_NAME, "identity", []),
    (LAST_NAME, "identity.dataset", "synthetic"),
    (LAST_NAME, "identity.model", None),
    (LAST_NAME, "identity.shapes", {"weight": "3x2"}),
    (BEST_NAME, "metrics", "x"),
    (BEST_NAME, "identity.shapes", [1, 2]),
])
def test_a_field_of_the_wrong_type_is_refused_naming_it(tmp_path, name, field, value):
    state = _states()[name]
    _set(state, field, value)
    save_checkpoint(tmp_path, state, name)  # a matching sha256: the file looks like one betty-train wrote
    with pytest.raises(TrainingError, match=f"checkpoint {tmp_path / name}: '{field}' is ") as error:
        load_checkpoint(tmp_path, name)
    assert "\n" not in str(error.value) and "start a new run" in str(error.value)


def test_a_model_with_a_non_string_key_is_refused(tmp_path):
    state = _states()[LAST_NAME]
    state["model"] = {0: torch.zeros(2)}
    save_checkpoint(tmp_path, state, LAST_NAME)
    with pytest.raises(TrainingError, match="'model' is not a state dict of tensors"):
        load_checkpoint(tmp_path, LAST_NAME)
