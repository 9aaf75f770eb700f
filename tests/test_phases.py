"""The training loop marks its phases as torch.profiler ranges (betty_trainer/phases.py): every phase appears in a
profiled run; a step once per batch and a gather once per micro-batch, each gather inside a step."""

from __future__ import annotations

from torch.profiler import ProfilerActivity, profile

from betty_trainer.config import load_config
from betty_trainer.phases import GATHER, PHASES, STEP
from betty_trainer.training.trainer import train

TINY = ["dataset.synthetic.num_nodes=600", "dataset.synthetic.num_features=16", "dataset.synthetic.train_per_class=40",
        "dataset.synthetic.num_val=50", "dataset.synthetic.num_test=50", "model.hidden=16", "sampling.fanouts=[5,5]",
        "sampling.batch_size=64", "optim.epochs=1", "train.progress=false", "micro_batch.num_micro_batches=2",
        "features.macro_batch=2"]


def test_a_profiled_run_names_every_phase_and_gathers_lie_inside_steps(tmp_path):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train(load_config(None, TINY), run_dir=tmp_path / "run")
    ranges: dict[str, list[tuple[int, int]]] = {name: [] for name in PHASES}
    for event in prof.events():
        if event.name in ranges:
            ranges[event.name].append((event.time_range.start, event.time_range.end))
    batches = -(-200 // 64)  # 5 classes × 40 training nodes in batches of 64
    assert {name: len(spans) for name, spans in ranges.items() if not spans} == {}, "every phase is marked"
    assert len(ranges[STEP]) == batches and len(ranges[GATHER]) == 2 * batches  # one gather per micro-batch
    for start, end in ranges[GATHER]:
        assert any(s <= start and end <= e for s, e in ranges[STEP]), "a training gather runs inside a step"
