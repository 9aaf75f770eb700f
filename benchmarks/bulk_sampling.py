"""Bulk matrix sampling (issue 25 item 1; bulk-sampling paper §4.1.4): seeds per second of ``bulk-ns`` sampling
``k`` batches at once against our per-batch NS and DGL's ``NeighborSampler``, on the same seeds, interleaved.

Each round samples the same sequence of ``--batches`` batches of ``--batch-size`` seeds (an epoch's first batches,
shuffled by ``--seed``) with every sampler in turn: NS one batch at a time, ``BulkNeighborSampler`` ``k`` at a time
for each ``k`` of ``--ks`` (``sample_many``; a ``k`` above ``--batches`` is all the batches in one stack), then DGL
(in its own environment, one warm-up pass and one timed pass per round). Seeds per second are over the CPU time
of the sampling process (``time.process_time``: the other workers on a shared machine do not count), the median of
``--reps`` rounds after one warm-up; ``--threads`` (default 1) intra-op threads on both sides. The process's peak
resident memory after each of our samplers' first round is printed beside it (it only grows: a sampler's own peak
shows where it exceeds the ones before). ``P`` holds every in-edge of every dst node of ``k`` batches: on ego-Twitter
``k = 64`` needs more than 20 GB (it was killed on a 23 GB machine), so that command runs ``--ks 1,8,16``.

The sampled vertex counts per layer are reported for every sampler: bulk-ns's batches are NS's bit for bit
(the same keyed draws), which the script checks on every batch; DGL's draws differ, so its counts are close.

Run from the repository root::

    python benchmarks/bulk_sampling.py --graph snap-ego-twitter --data-dir ../shared/datasets/snap-jlg --ks 1,8,16
    python benchmarks/bulk_sampling.py --graph coauthor-physics --batches 32
"""

from __future__ import annotations

import resource
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import int_list, markdown_table  # this folder
from dgl_channel import DEFAULT_DGL_PYTHON, DGLProcess  # this folder
from sampling import batch_arguments, epoch_batches  # this folder

from betty_trainer.sampling import BulkNeighborSampler, NeighborSampler, SampleKey


def parse_args(argv=None):
    parser = batch_arguments(__doc__.split("\n\n")[0])
    parser.set_defaults(threads=1, batches=64)
    parser.add_argument("--ks", type=int_list, default=[1, 8, 64], help="batches sampled at once by bulk-ns")
    parser.add_argument("--reps", type=int, default=3, help="timed rounds (after one warm-up round)")
    parser.add_argument("--device", default="cpu", help="where our samplers run (cuda: the graph on the GPU)")
    parser.add_argument("--dgl-python", default=str(DEFAULT_DGL_PYTHON), help="'' skips DGL")
    return parser.parse_args(argv)


def counts(batches) -> list[float]:
    """Mean sampled vertices per layer over ``batches``: each block's src nodes, input layer first, then the seeds."""
    return np.mean([[b.num_src for b in batch.blocks] + [batch.blocks[-1].num_dst] for batch in batches], 0).tolist()


def timed(sample, device: torch.device) -> tuple[float, list]:
    """CPU seconds of ``sample()`` (synchronised on a GPU) and what it returned."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.process_time() if device.type == "cpu" else time.perf_counter()
    out = sample()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.process_time() if device.type == "cpu" else time.perf_counter()) - started, out


def same_batch(a, b) -> bool:
    return all(torch.equal(x.src_nodes, y.src_nodes) and torch.equal(x.indptr, y.indptr)
               and torch.equal(x.indices, y.indices) for x, y in zip(a.blocks, b.blocks, strict=True))


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    graph, _, batches = epoch_batches(args)
    ours = graph
    if device.type != "cpu":
        import dataclasses

        ours = dataclasses.replace(graph, indptr=graph.indptr.to(device), indices=graph.indices.to(device))
    seeds = [batch.to(device) for batch in batches]
    keys = [SampleKey(args.seed, 0, step) for step in range(len(seeds))]
    total = sum(batch.numel() for batch in batches)
    print(f"{args.graph}: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges; fanouts {args.fanouts} (input layer "
          f"first), {len(batches)} batches of {args.batch_size}, {args.threads} thread(s), ours on {device}", flush=True)
    samplers = {"NS (per batch)": lambda: [ns.sample(s, k) for s, k in zip(seeds, keys)]}
    ns = NeighborSampler(ours, args.fanouts)
    for k in args.ks:
        bulk = BulkNeighborSampler(ours, args.fanouts, bulk=k)
        samplers[f"bulk-ns k={k}"] = (lambda bulk=bulk, k=k: [
            batch for start in range(0, len(seeds), k)
            for batch in bulk.sample_many(seeds[start:start + k], keys[start:start + k])])
    seconds: dict[str, list[float]] = {name: [] for name in [*samplers, "DGL NeighborSampler"]}
    layers: dict[str, list[float]] = {}
    peaks: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        dgl = None
        if args.dgl_python and Path(args.dgl_python).exists() and device.type == "cpu":
            np.save(scratch / "indptr.npy", graph.indptr.numpy())
            np.save(scratch / "indices.npy", graph.indices.numpy())
            np.save(scratch / "seeds.npy", torch.cat(batches).numpy())
            sampling_script = Path(__file__).resolve().parent / "sampling.py"
            dgl = DGLProcess(args.dgl_python, sampling_script, ["--dgl-side"], args.threads, scratch / "dgl.log")
            hello = dgl("hello")
            dgl("load", folder=str(scratch))
            print(f"DGL {hello['dgl']} (torch {hello['torch']}, {hello['threads']} thread(s)) side by side", flush=True)
        reference = None
        for rep in range(args.reps + 1):
            for name, sample in samplers.items():
                spent, sampled = timed(sample, device)
                if rep == 0:
                    layers[name] = counts(sampled)
                    peaks[name] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB → GiB
                    if reference is None:
                        reference = sampled
                    elif not all(same_batch(a, b) for a, b in zip(reference, sampled, strict=True)):
                        raise SystemExit(f"{name}: a batch differs from NS's")
                else:
                    seconds[name].append(spent)
                del sampled
            if dgl is not None:
                theirs = dgl("run", kind="ns", seeds=str(scratch / "seeds.npy"), batch_size=args.batch_size,
                             fanouts=args.fanouts, importance=0, kappa=1, seed=args.seed, reps=1, lru=1)
                layers["DGL NeighborSampler"] = theirs["nodes_per_layer"]
                if rep:
                    seconds["DGL NeighborSampler"].append(theirs["cpu_seconds"][0])
            print(f"  round {rep}: " + ", ".join(f"{name} {values[-1]:.2f}s" for name, values in seconds.items()
                                                  if values), flush=True)
        if dgl is not None:
            dgl.close()
    degree = graph.in_degrees().to(device)
    nonzeros = np.mean([sum(int(degree[b.dst_nodes].sum()) for b in batch.blocks) for batch in reference])
    kept = np.mean([sum(b.num_edges for b in batch.blocks) for batch in reference])
    print(f"per batch: P = Q·A holds {nonzeros:,.0f} nonzeros over the layers (every in-edge of every dst node), "
          f"the blocks keep {kept:,.0f} ({kept / nonzeros:.0%})")
    ns_rate = total / statistics.median(seconds["NS (per batch)"])
    rows = []
    for name, values in seconds.items():
        if not values:
            continue
        rate = total / statistics.median(values)
        rows.append([name, "/".join(f"{v:,.0f}" for v in layers[name]), f"{rate:,.0f}", f"{rate / ns_rate:.2f}",
                     f"{peaks[name]:.2f}" if name in peaks else "-"])
    print()
    print(markdown_table(["sampler", "vertices per layer (input → seeds)", "seeds/s (CPU time)", "× NS",
                          "process peak RSS so far (GiB)"], rows))


if __name__ == "__main__":
    main()
