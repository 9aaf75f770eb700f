"""Accuracy on the Planetoid public split with REG micro-batches (Betty Table 5; DGL baseline measured here).

DGL 2.1 full-batch GraphSAGE-mean on this machine (hidden 64, lr 0.01, weight decay
5e-4, dropout 0.5, 200 epochs, model chosen on validation, 10 seeds): Cora
0.796 ± 0.007, CiteSeer 0.672 ± 0.017. The thresholds sit one std below those means.
"""

from __future__ import annotations

import pytest

from betty_trainer.config import load_config
from betty_trainer.trainer import train


def run(dataset, data_dir, tmp_path, k):
    config = load_config(None, [f"dataset.name={dataset}", f"dataset.data_dir={data_dir}",
                                f"micro_batch.num_micro_batches={k}", "micro_batch.partitioner=reg",
                                "train.progress=false", "seed=0"])
    assert (config.model.hidden, config.optim.lr, config.optim.weight_decay, config.model.dropout,
            config.optim.epochs) == (64, 0.01, 5e-4, 0.5, 200)
    return train(config, run_dir=tmp_path / f"{dataset}-k{k}")


@pytest.mark.parametrize("dataset, threshold", [("cora", 0.79), ("citeseer", 0.67)])
def test_reg_micro_batches_reach_dgl_full_batch_accuracy(planetoid_dir, tmp_path, dataset, threshold):
    four = run(dataset, planetoid_dir, tmp_path, 4)
    assert four.last.micro_batches == 4
    assert four.test_acc >= threshold
    if dataset == "cora":
        one = run(dataset, planetoid_dir, tmp_path, 1)
        assert abs(one.test_acc - four.test_acc) <= 0.005
        assert abs(one.last.test_acc - four.last.test_acc) <= 0.005
