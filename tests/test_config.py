"""Config validation: sizes, one section per model arch, the device, values read from the registries,
and the README's config table."""

from __future__ import annotations

import re
from typing import get_args

import pytest
import torch
from pydantic import BaseModel

from betty_trainer.cli import main
from betty_trainer.config import MODEL_SECTIONS, MicroBatchConfig, load_config, parse_bytes
from betty_trainer.datasets import make_sbm
from betty_trainer.errors import ConfigError
from betty_trainer.models import ARCHITECTURES, GAT, GCN, GraphSAGE, architecture_of, build_model
from betty_trainer.models.sage import AGGREGATORS
from partition import PARTITIONERS
from tests.conftest import REPO
from tests.test_cli import assert_one_line_error, betty_in_process


@pytest.mark.parametrize("written, size", [
    (8000000000, 8_000_000_000), ("8000000000", 8_000_000_000), ("6GiB", 6 * 2**30), ("6 gib", 6 * 2**30),
    ("512 MB", 512 * 10**6), ("12MiB", 12 * 2**20), ("1.5GB", 1_500_000_000), ("10KB", 10_000), ("3kib", 3 * 2**10),
    ("2TiB", 2 * 2**40), (1.0e9, 10**9),
])
def test_budget_sizes_are_read_as_bytes(written, size):
    assert load_config(None, []).micro_batch.budget is None
    config = MicroBatchConfig(budget=written, safety_margin=written)
    assert (config.budget, config.safety_margin) == (size, size)
    assert parse_bytes(written) == size


@pytest.mark.parametrize("written, message", [
    ("-5", "a memory size must be positive, got -5"),
    ("0", "a memory size must be positive, got 0"),
    ("lots", "expected a size in bytes such as 8000000000, '6GiB' or '512 MB', got 'lots'"),
    ("12 parsecs", "expected a size in bytes"),
    ("true", "expected a size in bytes"),
])
def test_bad_budgets_are_refused_naming_the_key(written, message):
    with pytest.raises(ConfigError, match=re.escape("invalid config value for 'micro_batch.budget'")) as error:
        load_config(None, [f"micro_batch.budget={written}"])
    assert message in str(error.value)


def test_auto_and_null_budgets_and_a_zero_margin_are_kept():
    assert load_config(None, ["micro_batch.budget=auto"]).micro_batch.budget == "auto"
    assert load_config(None, ["micro_batch.budget= AUTO "]).micro_batch.budget == "auto"
    assert load_config(None, ["micro_batch.budget=null"]).micro_batch.budget is None
    assert load_config(None, ["micro_batch.safety_margin=0"]).micro_batch.safety_margin == 0
    with pytest.raises(ConfigError, match="a memory size must be non-negative, got -1"):
        load_config(None, ["micro_batch.safety_margin=-1"])


@pytest.mark.parametrize("overrides, section", [
    ([], MODEL_SECTIONS["sage"]),
    (["model.hidden=8"], MODEL_SECTIONS["sage"]),  # arch defaults to sage in a section that leaves it out
    (["model.arch=sage", "model.aggregator=lstm"], MODEL_SECTIONS["sage"]),
    (["model.arch=gcn"], MODEL_SECTIONS["gcn"]),
    (["model.arch=gat", "model.heads=2"], MODEL_SECTIONS["gat"]),
])
def test_each_arch_has_its_own_section(overrides, section):
    config = load_config(None, overrides)
    assert type(config.model) is section
    assert "arch" in config.model.model_dump()


@pytest.mark.parametrize("overrides, fragments", [
    (["model.arch=gcn", "model.aggregator=lstm"],
     ["unknown config key 'model.aggregator' with model.arch='gcn' (a key of model.arch='sage')",
      "allowed here: arch, hidden, num_layers, dropout"]),
    (["model.arch=gat", "model.aggregator=pool"], ["unknown config key 'model.aggregator' with model.arch='gat'"]),
    (["model.arch=gcn", "model.heads=2"], ["unknown config key 'model.heads' with model.arch='gcn' "
                                           "(a key of model.arch='gat')"]),
    (["model.heads=2"], ["unknown config key 'model.heads' with model.arch='sage'"]),
    (["model.arch=gcn", "model.aggregator=max"], ["'model.aggregator' ('max')", "'mean', 'gcn', 'pool' or 'lstm'",
                                                  "a key of model.arch='sage', not 'gcn'"]),
    (["model.arch=mlp"], ["'model.arch' ('mlp')", "Input should be 'gat', 'gcn'"]),  # the registry's, by name
    (["model=5"], ["'model' (5): a section (mapping of keys) is expected"]),
    (["train.device=tpu"], ["'train.device' ('tpu')", "use auto, cpu, cuda or cuda:N"]),
    (["train.device=mps"], ["'train.device' ('mps')"]),
    (["train.device=cuda:x"], ["'train.device' ('cuda:x')"]),
    (["train.device=CPU"], ["'train.device' ('CPU')"]),
    (["micro_batch.partitioner=kahip"], ["'micro_batch.partitioner' ('kahip')",
                                         "'reg', 'reg_unweighted', 'metis', 'range' or 'random'"]),
])
def test_validate_refuses_keys_and_values_an_arch_or_device_does_not_have(capsys, overrides, fragments):
    result = betty_in_process(capsys, "validate", "--config", str(REPO / "configs/quickstart.yaml"), *overrides)
    assert_one_line_error(result, *fragments)


def test_an_arch_override_drops_the_file_keys_only_the_file_arch_has(capsys):
    cora = REPO / "configs/cora-sage.yaml"
    assert load_config(cora).model.aggregator == "mean"  # the file has an aggregator: it is a sage config
    gcn = load_config(cora, ["model.arch=gcn", "model.hidden=16"])
    assert type(gcn.model) is MODEL_SECTIONS["gcn"] and (gcn.model.hidden, gcn.model.num_layers) == (16, 2)
    gat = load_config(cora, ["model.heads=2", "model.arch=gat"])
    assert type(gat.model) is MODEL_SECTIONS["gat"] and gat.model.heads == 2
    result = betty_in_process(capsys, "validate", "--config", str(cora), "model.arch=gcn", "model.aggregator=lstm")
    assert_one_line_error(result, "unknown config key 'model.aggregator' with model.arch='gcn'")


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:3"])
def test_validate_accepts_every_device_spelling_a_gpu_is_checked_when_the_run_starts(capsys, device):
    result = betty_in_process(capsys, "validate", "--config", str(REPO / "configs/quickstart.yaml"),
                              f"train.device={device}")
    assert result.returncode == 0 and "well-formed" in result.stdout


def test_cuda_without_a_gpu_is_refused_when_the_run_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = betty_in_process(capsys, "train", "--config", str(REPO / "configs/quickstart.yaml"),
                              "train.device=cuda", f"train.run_dir={tmp_path}")
    assert_one_line_error(result, "train.device is cuda but no CUDA GPU is available")


def test_allowed_values_are_the_registries():
    assert get_args(MicroBatchConfig.model_fields["partitioner"].annotation) == tuple(PARTITIONERS)
    assert get_args(MODEL_SECTIONS["sage"].model_fields["aggregator"].annotation) == tuple(AGGREGATORS)
    graph = make_sbm(num_nodes=60, num_classes=3, num_features=4, avg_degree=4.0, homophily=0.7, feature_signal=0.2,
                     train_per_class=2, num_val=5, num_test=5, seed=0)
    assert list(MODEL_SECTIONS) == sorted(ARCHITECTURES) and {"sage", "gcn", "gat"} <= set(ARCHITECTURES)
    for arch, kind in (("sage", GraphSAGE), ("gcn", GCN), ("gat", GAT)):
        assert ARCHITECTURES[arch].model is kind
    for arch, architecture in ARCHITECTURES.items():
        model = build_model(load_config(None, [f"model.arch={arch}"]).model, graph)
        assert type(model) is architecture.model and architecture_of(model) is architecture
    for aggregator in AGGREGATORS:
        model = build_model(load_config(None, [f"model.aggregator={aggregator}"]).model, graph)
        assert {layer.aggregator for layer in model.layers} == {aggregator}


def test_shipped_configs_are_well_formed(capsys):
    configs = sorted((REPO / "configs").glob("*.yaml"))
    assert len(configs) >= 3
    for path in configs:
        assert main(["validate", "--config", str(path)]) == 0, capsys.readouterr().err


def test_the_readme_table_names_every_key_and_every_allowed_value():
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("| key | default | meaning |"):]
    table = table[: table.index("\n\n")]
    documented = set(re.findall(r"`([a-z_]+(?:\.[a-z_]+)*)`", table))
    config = load_config(None, [])
    keys = set()

    def walk(prefix, section):
        for name, value in section:
            if isinstance(value, BaseModel):
                walk(f"{prefix}{name}.", value)
            else:
                keys.add(prefix + name)

    for arch in MODEL_SECTIONS:
        walk("", load_config(None, [f"model.arch={arch}"]))
    keys = {key for key in keys if not key.startswith("dataset.synthetic.")} | {"dataset.synthetic"}
    assert keys <= documented, sorted(keys - documented)
    assert set(PARTITIONERS) | set(AGGREGATORS) | set(MODEL_SECTIONS) <= documented
    assert config.micro_batch.partitioner in documented


@pytest.mark.parametrize("override, fragment", [
    ("optim.lr=1e39", "at most"), ("optim.lr=3.4e38", "at most"), ("optim.lr=1e300", "at most"),
    ("optim.lr=.inf", "finite"), ("optim.lr=.nan", "finite"), ("optim.weight_decay=1e39", "at most"),
    ("optim.weight_decay=.inf", "finite"), ("optim.min_lr=1e39", "at most"), ("optim.min_lr=.inf", "finite"),
    ("optim.gamma=.nan", "finite"), ("dataset.synthetic.avg_degree=.inf", "finite"),
])
def test_non_finite_and_float32_overflowing_optimiser_values_are_refused_naming_the_key(capsys, override, fragment):
    key = override.partition("=")[0]
    result = betty_in_process(capsys, "validate", "--config", str(REPO / "configs/quickstart.yaml"), override)
    assert_one_line_error(result, f"invalid config value for {key!r}", fragment)


def test_the_largest_accepted_learning_rate_and_weight_decay_step_adam():
    """The bounds are the largest values Adam's float32 step takes without an overflow error: the step
    divides lr by 1 - beta1 = 0.1 (Kingma & Ba, Algorithm 1), and weight decay multiplies the parameters."""
    from betty_trainer.config import MAX_LR, MAX_WEIGHT_DECAY

    config = load_config(None, [f"optim.lr={MAX_LR!r}", f"optim.weight_decay={MAX_WEIGHT_DECAY!r}",
                                f"optim.min_lr={MAX_LR!r}"])
    assert (config.optim.lr, config.optim.weight_decay) == (MAX_LR, MAX_WEIGHT_DECAY)
    for lr, weight_decay in ((MAX_LR, 0.0), (0.01, MAX_WEIGHT_DECAY)):
        parameter = torch.nn.Parameter(torch.ones(3))
        optimizer = torch.optim.Adam([parameter], lr=lr, weight_decay=weight_decay)
        parameter.sum().backward()
        optimizer.step()  # no "value cannot be converted to type float without overflow"
    with pytest.raises(RuntimeError, match="overflow"):  # the bound is tight: 2x over it overflows
        torch.optim.Adam([parameter], lr=2 * MAX_LR).step()
    with pytest.raises(ConfigError, match="'optim.lr'"):
        load_config(None, [f"optim.lr={2 * MAX_LR!r}"])


def test_a_config_that_is_not_utf8_is_a_one_line_error(tmp_path, capsys):
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"\xff\xfe bad")
    for command in ("validate", "train"):
        result = betty_in_process(capsys, command, "--config", str(path))
        assert_one_line_error(result, f"config {path}", "UTF-8")


@pytest.mark.parametrize("override", [
    "model.hidden=true", "optim.epochs=true", "seed=false", "micro_batch.num_micro_batches=true",
    "sampling.batch_size=true", "sampling.fanouts=[true, 5]", "optim.lr=true", "train.patience=yes",
])
def test_booleans_are_not_numbers(capsys, override):
    key = override.partition("=")[0]
    result = betty_in_process(capsys, "validate", "--config", str(REPO / "configs/quickstart.yaml"), override)
    assert_one_line_error(result, f"invalid config value for {key!r}", "not true/false")


def test_a_boolean_in_the_file_is_not_an_integer(tmp_path, capsys):
    path = tmp_path / "bool.yaml"
    path.write_text("model:\n  hidden: true\n")
    assert_one_line_error(betty_in_process(capsys, "validate", "--config", str(path)),
                          "invalid config value for 'model.hidden' (True)", "not true/false")


def test_integer_keys_take_integral_numbers_written_with_an_exponent():
    """PyYAML (YAML 1.1) reads ``1e2`` as the string '1e2' and ``1.5e+2`` as the float 150.0; an integer key
    takes both when the value is a whole number, and refuses a fraction."""
    config = load_config(None, ["optim.epochs=1e2", "model.hidden=1.5e+2", "sampling.fanouts=[1e1, 2.5e1]",
                                "sampling.batch_size=1E3"])
    assert (config.optim.epochs, config.model.hidden, config.sampling.fanouts, config.sampling.batch_size) == \
        (100, 150, [10, 25], 1000)
    assert type(config.optim.epochs) is int and type(config.model.hidden) is int
    for bad in ("optim.epochs=1.5", "optim.epochs=2.5e0", "optim.epochs=1e400"):
        with pytest.raises(ConfigError, match="'optim.epochs'"):
            load_config(None, [bad])


@pytest.mark.parametrize("content, fragment", [
    ("optim:\n  lr: 0.1\n  epochs: 3\n  lr: 0.2\n", "key 'optim.lr' appears twice (lines 2 and 4)"),
    ("seed: 1\nseed: 2\n", "key 'seed' appears twice (lines 1 and 2)"),
    ("optim: {lr: 0.1}\nmodel: {hidden: 8}\noptim: {epochs: 2}\n", "key 'optim' appears twice (lines 1 and 3)"),
    ("sampling:\n  labor: {layer_dependency: true, layer_dependency: false}\n",
     "key 'sampling.labor.layer_dependency' appears twice (lines 2 and 2)"),
])
def test_a_key_written_twice_in_a_file_is_refused(tmp_path, capsys, content, fragment):
    path = tmp_path / "twice.yaml"
    path.write_text(content)
    assert_one_line_error(betty_in_process(capsys, "validate", "--config", str(path)), f"config {path}", fragment)


def test_a_key_written_twice_in_an_override_value_is_refused():
    with pytest.raises(ConfigError, match=r"override 'optim=\{lr: 1, lr: 2\}': key 'lr' appears twice"):
        load_config(None, ["optim={lr: 1, lr: 2}"])
    assert load_config(None, ["optim={lr: 1, epochs: 2}"]).optim.epochs == 2


@pytest.mark.parametrize("name", ["../../escape", "/tmp/x", "a/b", "..", ".", "a\\b", '"x\\0y"'])
def test_a_name_that_is_a_path_is_refused(capsys, name):
    result = betty_in_process(capsys, "validate", "--config", str(REPO / "configs/quickstart.yaml"), f"name={name}")
    assert_one_line_error(result, "invalid config value for 'name'", "runs/<name>-<timestamp>")


def test_ordinary_names_are_kept():
    for name in ("cora-sage", "my run", "v1.2", "a..b"):
        assert load_config(None, [f"name={name}"]).name == name


def test_the_optimizer_is_built_from_optim_in_one_place():
    """Training, the dry run and calibration build ``config.optim.make_optimizer``; the estimate names the same one."""
    optim = load_config(None, ["optim.lr=0.003", "optim.weight_decay=0"]).optim
    optimizer = optim.make_optimizer([torch.nn.Parameter(torch.zeros(2))])
    assert type(optimizer).__name__.lower() == optim.optimizer
    assert (optimizer.defaults["lr"], optimizer.defaults["weight_decay"]) == (0.003, 0)
