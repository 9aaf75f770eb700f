"""betty-trainer side by side with DGL 2.1 (issue 7's table): memory, step time, sampling, mini-batch epochs.

One run prints, for the same graph arrays, seeds and thread count, betty-trainer's
figures beside DGL's. DGL runs in its own environment (``--dgl-python``, default
the environment ``bash .ci/dgl`` builds, ``~/.cache/betty-trainer/dgl-venv``) as a subprocess serving ``benchmarks/dgl_side.py``;
the two sides' repetitions interleave (ours, DGL, ours, …) so machine noise hits both.
Both sides call ``torch.set_num_threads(--threads)`` (and get ``OMP_NUM_THREADS``).

Model: 2-layer GraphSAGE-mean, dropout 0.5 (``--dropout``; 0 is the control that takes the two dropout
implementations out of the comparison, and ``--dropout 0.5,0`` runs both in one run) on the input features and the
hidden layer,
Adam (lr 0.01, weight decay 5e-4), one training step = forward + backward + Adam step.

Sections (``--sections``):

``memory``
    The measured peak of one full-batch step, full neighbourhood: ours at each K of
    ``--ks`` (the largest peak over the K micro-batches, each measured as training runs
    it: ``betty_trainer.execution.micro_batches.measure_training_step``, later micro-batches accumulating)
    vs DGL's ``SAGEConv`` on the whole graph (``dgl.graph``, COO, CSR and CSC made at load) and on a fresh
    ``dgl.Block`` holding only the CSC ours holds (the "DGL block" column: DGL makes its CSR inside the step).
    Both sides measure with ``estimator.measure.measure_peak`` (DGL side: the same file loaded by path): the peak
    of live bytes replayed from ``torch.profiler``'s allocation records, after one warm-up
    step so Adam's moments exist; resident = parameters, Adam state and graph structure
    (betty: the micro-batch's blocks; DGL: the graph's CSC tensors). The feature matrix
    is host data on both sides and not resident (DGL reads it in place; betty gathers a
    micro-batch's rows inside the step, and that copy counts). With K = 1 among ``--ks``, "ours K=1 kept" is the
    batch in one micro-batch with ``micro_batch.keep_transposes: true`` (its blocks keep their transposes: the
    other columns run without a budget, so ``auto`` keeps none). With ``--layerwise-ks``, ours also
    runs the batch layer by layer at each of those chunk counts per layer
    (``micro_batch.mode=layerwise``, REG chunks; ``betty_trainer.execution.layerwise.measure_layerwise_step``,
    resident: the model state, the batch's blocks and the chunks' structure). The output nodes are
    ``--outputs``: ``all`` (default: every node, so K = 1 computes exactly what DGL's
    full-graph step computes) or ``train`` (the dataset's training split; DGL still
    computes every node and takes the loss on those).
``time``
    Step time, full batch, full neighbourhood, for ``--epochs`` epochs (interleaved):
    ours K = 1, DGL on the graph, DGL on a CSC-only block (as in ``memory``), ours K = ``--time-k``. Ours
    is what ``betty_trainer.train`` does per batch: ``sample_batch`` (full neighbourhood), ``Planner.plan`` (REG + METIS +
    slicing; K = 1 skips the partitioner), the plan's ``run``, ``optimizer.step``.
    Printed: the first epoch and the median of the later ones (steady state: a planner
    that reuses the plan of an unchanged batch shows it there), the ratios ours/DGL and
    K/K=1, and the planning share of the K step. "K=1 step / DGL block" compares the same work on both
    sides: ours without sampling (plan, run, Adam) against DGL on a block made before its clock starts; "kept step /
    DGL block" the same with ``micro_batch.keep_transposes: true`` (a K = 1 run interleaved with the others).
    The DGL side inherits this process's environment, so both run with the process settings
    ``import betty_trainer`` makes (``betty_trainer/process.py``: the OpenMP wait policy and huge pages).
``sampling``
    Neighbour-sampling throughput (seeds/s), fanouts ``--sample-fanouts`` (10,10,10),
    batch ``--batch-size`` (1024), the same seed batches (a seeded permutation of all
    nodes) on both sides: ``betty_trainer.sample_batch`` (blocks relabelled) vs
    ``dgl.dataloading.NeighborSampler.sample_blocks``. Graphs ``--sample-graphs``:
    ego-Twitter (the registry's ``snap-ego-twitter``, from ``../shared/datasets/snap-jlg``: symmetrised,
    self loops dropped) and Coauthor Physics. The sampled edge counts are printed as a check
    that both sides do the same work.
``minibatch``
    One mini-batch training epoch (batch 1024, fanouts ``--train-fanouts`` 10,25) on
    ``--minibatch-graph`` (Amazon Computers) over every node (``--outputs all``) or the
    training split, the same shuffled seed batches on both sides: epoch time and the
    part of it spent sampling.

The CPU is shared: figures are medians of interleaved repetitions, and still noisy.

Run:
    python benchmarks/versus_dgl.py --quick
    python benchmarks/versus_dgl.py                      # everything (tens of minutes on 2 cores)
    python benchmarks/versus_dgl.py --sections memory --graphs coauthor-physics --hidden 64 --ks 1,8
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Kineto logs "USDT … profiler_start/stop" lines per measured step on stderr; level 6 silences them.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import common  # noqa: E402  (this folder)
from common import float_list, int_list, name_list  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from betty_trainer import HostFeatureStore, NeighborSampler, SampleKey, sample_batch  # noqa: E402
from betty_trainer.config import load_config  # noqa: E402
from betty_trainer.data.graph import Graph  # noqa: E402
from betty_trainer.memory.planner import make_planner  # noqa: E402
from betty_trainer.models import set_dropout_key  # noqa: E402
from betty_trainer.rng import derive_seed  # noqa: E402
from betty_trainer.sampling.schedule import plan_seed, split_seeds  # noqa: E402
from betty_trainer.training.trainer import init_model  # noqa: E402
from dgl_channel import DEFAULT_DGL_PYTHON, DGLProcess  # noqa: E402  (this folder)

MIB = 2**20
CPU = torch.device("cpu")
TWITTER = "ego-twitter"


# --- data ----------------------------------------------------------------------------------------------------

def load_graph(name: str, args: argparse.Namespace) -> Graph:
    """One of ``common.SBM``, or a registered dataset (``ego-twitter``: structure only, for the sampling section)."""
    return common.load_graph(name, args.data_dir)


def export(graph: Graph, folder: Path, features: bool) -> None:
    """The arrays DGL needs, as plain ``.npy`` (no pickles): CSC structure, and features and labels if asked."""
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "indptr.npy", graph.indptr.numpy())
    np.save(folder / "indices.npy", graph.indices.numpy())
    np.save(folder / "num_classes.npy", np.array(graph.num_classes))
    if features:
        np.save(folder / "x.npy", graph.x.numpy())
        np.save(folder / "y.npy", graph.y.numpy())


def outputs_of(graph: Graph, which: str) -> torch.Tensor:
    return torch.arange(graph.num_nodes) if which == "all" else graph.train_idx


# --- the DGL subprocess ----------------------------------------------------------------------------------------

# --- our side ------------------------------------------------------------------------------------------------

def config_for(hidden: int, k: int, seed: int, mode: str = "micro_batches", dropout: float = 0.5,
               keep_transposes: bool | str = "auto"):
    return load_config(None, [f"model.hidden={hidden}", "model.arch=sage", "model.aggregator=mean",
                              "model.num_layers=2", f"model.dropout={dropout}", f"micro_batch.num_micro_batches={k}",
                              f"micro_batch.mode={mode}", "micro_batch.partitioner=reg", f"seed={seed}",
                              "train.device=cpu", f"micro_batch.keep_transposes={str(keep_transposes).lower()}"])


class Ours:
    """A model, Adam and planner for one (graph, hidden, K, ``micro_batch.mode``, ``micro_batch.keep_transposes``),
    stepped as ``betty_trainer.train`` steps a batch."""

    def __init__(self, graph: Graph, hidden: int, k: int, seed: int, mode: str = "micro_batches",
                 dropout: float = 0.5, keep_transposes: bool | str = "auto"):
        self.graph, self.seed = graph, seed
        self.sampler: NeighborSampler | None = None
        self.config = config_for(hidden, k, seed, mode, dropout, keep_transposes)
        self.model = init_model(self.config, graph)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=self.config.optim.lr,
                                          weight_decay=self.config.optim.weight_decay)
        self.features = HostFeatureStore(graph.x, pin=False)
        self.planner = make_planner(self.config, graph, None, CPU, self.features, plan_seed(self.config))
        self.model.train()

    def step(self, seeds: torch.Tensor, fanouts: list, step: int, epoch: int) -> dict[str, float]:
        """Sample, plan, accumulate, Adam step; seconds of each part."""
        t0 = time.perf_counter()
        if self.sampler is None or self.sampler.fanouts != list(fanouts):
            self.sampler = NeighborSampler(self.graph, fanouts)  # one per run, as train() keeps one
        batch = self.sampler.sample(seeds, SampleKey(self.seed, epoch, step))
        t1 = time.perf_counter()
        plan = self.planner.plan(batch)
        t2 = time.perf_counter()
        set_dropout_key(self.model, self.seed, step)
        self.optimizer.zero_grad(set_to_none=True)
        plan.run(self.model, self.features, self.graph.y, CPU)
        self.optimizer.step()
        t3 = time.perf_counter()
        return {"total": t3 - t0, "sample": t1 - t0, "plan": t2 - t1, "compute": t3 - t2, "k": plan.pieces}

    def peak(self, seeds: torch.Tensor) -> tuple[int, int]:
        """Largest measured peak over the micro-batches of the full-neighbourhood batch of ``seeds`` (or of its
        layer-wise step), after one warm-up step; and K."""
        batch = sample_batch(self.graph, seeds, [None, None])
        plan = self.planner.plan(batch)
        set_dropout_key(self.model, self.seed, 0)
        # after a step that makes Adam's moments, as in steady state: each micro-batch, or the layer-wise step
        return max(plan.measure(self.model, self.optimizer, self.features, self.graph.y, CPU)), plan.pieces


# --- sections ------------------------------------------------------------------------------------------------

def release() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc ``malloc_trim``), so what one case
    freed is not still resident while the other side runs."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def max_rss_mib() -> float:
    """High-water resident memory of this process so far (MiB; Linux ``ru_maxrss`` is KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def median(values):
    return statistics.median(values) if values else float("nan")


def fmt_ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)))
    sys.stdout.flush()


def memory_section(graphs, dgl, args, folders, results) -> None:
    rows = []
    for name in args.graphs:
        graph = graphs[name]
        outputs = outputs_of(graph, args.outputs)
        for hidden, dropout in itertools.product(args.hidden, args.dropout):
            theirs, blocks = (dgl("full_memory", name=name, hidden=hidden, seed=args.seed,
                                  outputs=folders.get(("outputs", name)), dropout=dropout, blocks=on_blocks)["peak_bytes"]
                              for on_blocks in (False, True))
            print(f"  memory {name} hidden {hidden} dropout {dropout}: DGL full graph: {theirs / MIB:.1f} MiB, on a "
                  f"CSC-only block {blocks / MIB:.1f} MiB", flush=True)
            ours = {}
            for k in args.ks:
                ours[k] = Ours(graph, hidden, k, args.seed, dropout=dropout).peak(outputs)
                release()
                print(f"  memory {name} hidden {hidden}: ours K={k}: {ours[k][0] / MIB:.1f} MiB "
                      f"(this process's RSS high-water so far {max_rss_mib():.0f} MiB)", flush=True)
            kept = None
            if 1 in args.ks:  # the batch in one micro-batch, its blocks keeping their transposes
                kept = Ours(graph, hidden, 1, args.seed, dropout=dropout, keep_transposes=True).peak(outputs)[0]
                release()
                print(f"  memory {name} hidden {hidden}: ours K=1 keeping transposes: {kept / MIB:.1f} MiB", flush=True)
            layerwise = {}
            for k in args.layerwise_ks:
                layerwise[k] = Ours(graph, hidden, k, args.seed, "layerwise", dropout).peak(outputs)
                release()
                print(f"  memory {name} hidden {hidden}: ours layer-wise {k} chunks: {layerwise[k][0] / MIB:.1f} MiB",
                      flush=True)
            k1 = ours.get(1, (None,))[0]
            row = [name, hidden, dropout, f"{theirs / MIB:.1f}", f"{blocks / MIB:.1f}"]
            for k, (peak, used) in ours.items():
                row.append(f"{peak / MIB:.1f} ({fmt_ratio(peak, theirs)})" + ("" if used == k else f" K={used}"))
            if kept is not None:
                row.append(f"{kept / MIB:.1f} ({fmt_ratio(kept, theirs)})")
            for k, (peak, used) in layerwise.items():
                row.append(f"{peak / MIB:.1f} ({fmt_ratio(peak, theirs)})" + ("" if used == k else f" K={used}"))
            row.append(fmt_ratio(ours[max(args.ks)][0], k1) if k1 else "-")
            rows.append(row)
            results.append({"section": "memory", "graph": name, "hidden": hidden, "dropout": dropout,
                            "dgl_peak_bytes": theirs, "dgl_block_peak_bytes": blocks,
                            "ours_peak_bytes": {k: v[0] for k, v in ours.items()}, "ours_k1_kept_peak_bytes": kept,
                            "ours_layerwise_peak_bytes": {k: v[0] for k, v in layerwise.items()}})
    print_table(f"Measured peak of one full-batch step, MiB (ours/DGL in brackets), outputs={args.outputs}",
                ["graph", "hidden", "dropout", "DGL full graph", "DGL block"] + [f"ours K={k}" for k in args.ks]
                + (["ours K=1 kept"] if 1 in args.ks else []) + [f"ours layer-wise {k}" for k in args.layerwise_ks]
                + [f"K={max(args.ks)}/K=1"], rows)


def time_section(graphs, dgl, args, folders, results) -> None:
    rows = []
    k = args.time_k
    for name in args.graphs:
        graph = graphs[name]
        outputs = outputs_of(graph, args.outputs)
        for hidden, dropout in itertools.product(args.hidden, args.dropout):
            one = Ours(graph, hidden, 1, args.seed, dropout=dropout)
            kept = Ours(graph, hidden, 1, args.seed, dropout=dropout, keep_transposes=True)
            many = Ours(graph, hidden, k, args.seed, dropout=dropout)
            runs = {"k1": [], "k1kept": [], "dgl": [], "dglb": [], "kk": []}
            for epoch in range(args.epochs):  # interleaved: ours K=1, kept, DGL on the graph, DGL on a block, ours K
                runs["k1"].append(one.step(outputs, [None, None], epoch, epoch))
                runs["k1kept"].append(kept.step(outputs, [None, None], epoch, epoch))
                for kind, on_blocks in (("dgl", False), ("dglb", True)):
                    runs[kind].append(dgl("full_step", name=name, hidden=hidden, seed=args.seed,
                                          outputs=folders.get(("outputs", name)), dropout=dropout, blocks=on_blocks,
                                          key=f"full-{name}-{hidden}-{dropout}-{kind}"))
                runs["kk"].append(many.step(outputs, [None, None], epoch, epoch))
                release()
                print(f"  time {name} hidden {hidden} dropout {dropout} epoch {epoch}: ours K=1 {runs['k1'][-1]['total']:.3f} s, "
                      f"DGL {runs['dgl'][-1]['seconds']:.3f} s, ours K={k} {runs['kk'][-1]['total']:.3f} s "
                      f"(plan {runs['kk'][-1]['plan']:.3f} s; RSS high-water {max_rss_mib():.0f} MiB)", flush=True)
            for phase, picked in (("first", slice(0, 1)), ("steady", slice(1, None))):
                k1 = median([r["total"] for r in runs["k1"][picked]])
                theirs = median([r["seconds"] for r in runs["dgl"][picked]])
                block = median([r["seconds"] for r in runs["dglb"][picked]])
                kk = median([r["total"] for r in runs["kk"][picked]])
                plan = median([r["plan"] for r in runs["kk"][picked]])
                sample = median([r["sample"] for r in runs["kk"][picked]])
                parts = "/".join(f"{median([r[p] for r in runs['k1'][picked]]):.2f}" for p in ("sample", "plan", "compute"))
                k1_step = median([r["plan"] + r["compute"] for r in runs["k1"][picked]])
                kept_step = median([r["plan"] + r["compute"] for r in runs["k1kept"][picked]])
                rows.append([name, hidden, dropout, phase, f"{k1:.3f}", parts, f"{theirs:.3f}", fmt_ratio(k1, theirs),
                             f"{block:.3f}", fmt_ratio(k1_step, block), fmt_ratio(kept_step, block), f"{kk:.3f}",
                             fmt_ratio(kk, k1), f"{plan:.3f}", f"{100 * plan / kk:.0f}%", f"{sample:.3f}"])
                results.append({"section": "time", "graph": name, "hidden": hidden, "dropout": dropout, "phase": phase,
                                "ours_k1_s": k1, "ours_k1_step_s": k1_step, "ours_k1_kept_step_s": kept_step,
                                "dgl_s": theirs, "dgl_block_s": block, "ours_k_s": kk, "k": k, "plan_s": plan, "sample_s": sample})
    print_table(f"Full-batch step time, seconds (first epoch; steady = median of epochs 1..{args.epochs - 1}), "
                f"outputs={args.outputs}",
                ["graph", "hidden", "dropout", "epochs", "ours K=1", "K=1 sample/plan/compute", "DGL", "K=1/DGL", "DGL block",
                 "K=1 step/DGL block", "kept step/DGL block", f"ours K={k}",
                 f"K={k}/K=1", f"plan K={k}", "plan share", f"sample K={k}"], rows)


def sampling_section(graphs, dgl, args, folders, results) -> None:
    rows = []
    fanouts = args.sample_fanouts
    for name in args.sample_graphs:
        graph = graphs[name]
        seeds_path = folders[("seeds", name)]
        seeds = torch.from_numpy(np.load(seeds_path)).split(args.batch_size)
        ours_s, dgl_s, ours_edges, dgl_edges = [], [], 0, 0
        for rep in range(args.reps + 1):  # repetition 0 warms both sides up and is not counted
            generator = torch.Generator().manual_seed(derive_seed(args.seed, rep))
            started, ours_edges = time.perf_counter(), 0
            for batch in seeds:
                ours_edges += sum(block.num_edges for block in sample_batch(graph, batch, fanouts, generator).blocks)
            ours_s.append(time.perf_counter() - started)
            reply = dgl("sample", name=name, seeds=str(seeds_path), batch_size=args.batch_size, fanouts=fanouts,
                        seed=args.seed + rep)
            dgl_s.append(reply["seconds"])
            dgl_edges = reply["edges"]
            print(f"  sampling {name} rep {rep}: ours {ours_s[-1]:.3f} s, DGL {dgl_s[-1]:.3f} s"
                  + (" (warm-up)" if rep == 0 else ""), flush=True)
        ours_s, dgl_s = ours_s[1:], dgl_s[1:]
        total = sum(batch.numel() for batch in seeds)
        ours_rate, dgl_rate = total / median(ours_s), total / median(dgl_s)
        rows.append([name, f"{graph.num_nodes:,}/{graph.num_edges:,}", len(seeds), f"{ours_rate:,.0f}",
                     f"{dgl_rate:,.0f}", fmt_ratio(ours_rate, dgl_rate), f"{ours_edges:,}", f"{dgl_edges:,}"])
        results.append({"section": "sampling", "graph": name, "ours_seeds_per_s": ours_rate,
                        "dgl_seeds_per_s": dgl_rate, "ours_edges": ours_edges, "dgl_edges": dgl_edges})
    print_table(f"Neighbour sampling, fanouts {','.join(map(str, fanouts))}, batch {args.batch_size}, seeds/s "
                f"(median of {args.reps})",
                ["graph", "nodes/edges", "batches", "ours", "DGL", "ours/DGL", "edges ours", "edges DGL"], rows)


def minibatch_section(graphs, dgl, args, folders, results) -> None:
    name = args.minibatch_graph
    graph = graphs[name]
    hidden = args.hidden[0]
    seeds_path = folders[("epoch", name)]
    batches = torch.from_numpy(np.load(seeds_path)).split(args.batch_size)
    ours = Ours(graph, hidden, 1, args.seed, dropout=args.dropout[0])
    ours_runs, dgl_runs = [], []
    for epoch in range(args.minibatch_epochs):
        parts = [ours.step(batch, args.train_fanouts, epoch * len(batches) + i, epoch) for i, batch in enumerate(batches)]
        ours_runs.append({"seconds": sum(p["total"] for p in parts), "sampling": sum(p["sample"] for p in parts),
                          "plan": sum(p["plan"] for p in parts)})
        reply = dgl("minibatch_epoch", name=name, hidden=hidden, seed=args.seed + epoch, seeds=str(seeds_path),
                    batch_size=args.batch_size, fanouts=args.train_fanouts, key=f"mini-{name}-{hidden}",
                    dropout=args.dropout[0])
        dgl_runs.append({"seconds": reply["seconds"], "sampling": reply["sampling_seconds"]})
        print(f"  minibatch {name} epoch {epoch}: ours {ours_runs[-1]['seconds']:.3f} s, "
              f"DGL {dgl_runs[-1]['seconds']:.3f} s", flush=True)
    ours_s, dgl_s = median([r["seconds"] for r in ours_runs]), median([r["seconds"] for r in dgl_runs])
    ours_sample, dgl_sample = median([r["sampling"] for r in ours_runs]), median([r["sampling"] for r in dgl_runs])
    ours_plan = median([r["plan"] for r in ours_runs])
    print_table(f"Mini-batch epoch, batch {args.batch_size}, fanouts {','.join(map(str, args.train_fanouts))}, "
                f"hidden {hidden}, {len(batches)} batches, seconds (median of {args.minibatch_epochs})",
                ["graph", "ours epoch", "DGL epoch", "ours/DGL", "ours sampling", "DGL sampling", "ours/DGL",
                 "ours plan (K=1)"],
                [[name, f"{ours_s:.3f}", f"{dgl_s:.3f}", fmt_ratio(ours_s, dgl_s), f"{ours_sample:.3f}",
                  f"{dgl_sample:.3f}", fmt_ratio(ours_sample, dgl_sample), f"{ours_plan:.3f}"]])
    results.append({"section": "minibatch", "graph": name, "ours_s": ours_s, "dgl_s": dgl_s,
                    "ours_sampling_s": ours_sample, "dgl_sampling_s": dgl_sample})


# --- driver --------------------------------------------------------------------------------------------------

SECTIONS = {"memory": memory_section, "time": time_section, "sampling": sampling_section,
            "minibatch": minibatch_section}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="fast check: Amazon Computers, hidden 64, K=1,8, 2 epochs, 3 sampling batches, "
                             "4 mini-batches")
    parser.add_argument("--sections", type=name_list, default=list(SECTIONS))
    parser.add_argument("--graphs", type=name_list, default=["amazon-computers", "coauthor-physics"])
    parser.add_argument("--hidden", type=int_list, default=[64, 256])
    parser.add_argument("--ks", type=int_list, default=[1, 8, 16], help="K of the memory section")
    parser.add_argument("--layerwise-ks", type=int_list, default=[],
                        help="chunks per layer of the memory section's layer-wise columns (none by default)")
    parser.add_argument("--time-k", type=int, default=8, help="K of the time section")
    parser.add_argument("--epochs", type=int, default=4, help="full-batch epochs of the time section (≥ 2)")
    parser.add_argument("--outputs", choices=["all", "train"], default="all")
    parser.add_argument("--sample-graphs", type=name_list, default=[TWITTER, "coauthor-physics"])
    parser.add_argument("--sample-fanouts", type=int_list, default=[10, 10, 10])
    parser.add_argument("--sample-batches", type=int, default=20, help="seed batches per sampling repetition")
    parser.add_argument("--reps", type=int, default=3, help="sampling repetitions (after one warm-up repetition)")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--minibatch-graph", default="amazon-computers")
    parser.add_argument("--train-fanouts", type=int_list, default=[10, 25])
    parser.add_argument("--minibatch-epochs", type=int, default=3)
    parser.add_argument("--minibatch-batches", type=int, default=None, help="cap the batches of an epoch")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dropout", type=float_list, default=[0.5],
                        help="dropout of both models; several (e.g. 0.5,0) give the memory and time sections one row "
                             "each, 0 being the control that takes dropout's implementations out")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="folder of the graphs' raw files (default: each one's folder in ../shared/datasets)")
    parser.add_argument("--dgl-python", default=str(DEFAULT_DGL_PYTHON))
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.quick:
        args.graphs, args.hidden, args.ks, args.epochs = ["amazon-computers"], [64], [1, 8], 2
        args.sample_batches, args.reps, args.minibatch_epochs, args.minibatch_batches = 3, 2, 1, 4
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {list(SECTIONS)}")
    if args.epochs < 2:
        parser.error("--epochs must be at least 2 (the first epoch and a steady one)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    needed, trained = set(), set()  # graphs loaded; graphs the DGL side trains on (it needs their features)
    if {"memory", "time"} & set(args.sections):
        trained |= set(args.graphs)
    if "minibatch" in args.sections:
        trained.add(args.minibatch_graph)
    needed |= trained
    if "sampling" in args.sections:
        needed |= set(args.sample_graphs)
    with tempfile.TemporaryDirectory(prefix="versus-dgl-") as tmp:
        tmp = Path(tmp)
        dgl = DGLProcess(args.dgl_python, Path(__file__).resolve().parent / "dgl_side.py", [], args.threads,
                         tmp / "dgl-side.log")
        try:
            hello = dgl("hello")
            print(f"betty-trainer (torch {torch.__version__}, {torch.get_num_threads()} threads) vs DGL {hello['dgl']} "
                  f"(torch {hello['torch']}, {hello['threads']} threads); CPU, shared machine: figures are noisy")
            graphs, folders = {}, {}
            for name in sorted(needed):
                graph = graphs[name] = load_graph(name, args)
                export(graph, tmp / name, features=name in trained)
                info = dgl("load", name=name, folder=str(tmp / name))
                assert (info["nodes"], info["edges"]) == (graph.num_nodes, graph.num_edges), (info, graph)
                print(f"  {graph!r}; DGL holds its structure as {'/'.join(info['formats']).upper()} (int64, "
                      f"{info['structure_bytes'] / MIB:.1f} MiB); ours as CSC ({graph.indices.dtype} indices, "
                      f"{(graph.indptr.nbytes + graph.indices.nbytes) / MIB:.1f} MiB)", flush=True)
                if args.outputs == "train":
                    np.save(tmp / f"{name}-outputs.npy", graph.train_idx.numpy())
                    folders[("outputs", name)] = str(tmp / f"{name}-outputs.npy")
                generator = torch.Generator().manual_seed(args.seed)
                permutation = torch.randperm(graph.num_nodes, generator=generator)
                np.save(tmp / f"{name}-seeds.npy", permutation[: args.sample_batches * args.batch_size].numpy())
                folders[("seeds", name)] = tmp / f"{name}-seeds.npy"
                if name == args.minibatch_graph:
                    nodes = outputs_of(graph, args.outputs)
                    epoch = split_seeds(nodes, args.batch_size, torch.Generator().manual_seed(args.seed))
                    epoch = epoch[: args.minibatch_batches] if args.minibatch_batches else epoch
                    np.save(tmp / f"{name}-epoch.npy", torch.cat(epoch).numpy())
                    folders[("epoch", name)] = tmp / f"{name}-epoch.npy"
            results: list[dict] = []
            for section in args.sections:
                SECTIONS[section](graphs, dgl, args, folders, results)
        finally:
            dgl.close()
    print(f"\nwall time {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
