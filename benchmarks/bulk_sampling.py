"""Bulk matrix sampling (issue 25 item 1; bulk-sampling paper §4.1.4): seeds per second of ``bulk-ns`` sampling
``k`` batches at once against our per-batch NS and DGL's ``NeighborSampler``, on the same seeds, interleaved.

Each round samples the same sequence of ``--batches`` batches of ``--batch-size`` seeds (an epoch's first batches,
shuffled by ``--seed``) with every sampler in turn: NS one batch at a time, ``BulkNeighborSampler`` ``k`` at a time
for each ``k`` of ``--ks`` (``sample_many``; a ``k`` above ``--batches`` is all the batches in one stack), then DGL
(in its own environment, one pass per round). Seeds per second are over the CPU time of the sampling process
(``time.process_time``, ``--device cpu``: the other workers on a shared machine do not count; wall time,
synchronised, on a GPU), the median of ``--reps`` rounds after one warm-up round; ``--threads`` (default 1) intra-op
threads on both sides.

Checked, not only printed: every bulk batch equals NS's bit for bit (the same keyed draws), and so its sampled
vertex counts per layer are within 1% of NS's (they are equal); DGL's draws are its own, so its counts are close.
Peak memory is each sampler's own: how far the process's resident high-water mark (``VmHWM``) rises above its
resident size when it was reset (``/proc/PID/clear_refs`` ← 5; on our side after ``malloc_trim``, so that memory an
earlier sampler freed does not count) during the sampler's warm-up round, for our process and for DGL's (its first
run: a warm-up pass and a timed one over the batches): the sampler's transient memory and the batches the round
holds, not the graph. The load average (``/proc/loadavg``)
is printed before and after.

Run from the repository root::

    python benchmarks/bulk_sampling.py --graph ego-twitter
    python benchmarks/bulk_sampling.py --graph coauthor-physics --batches 32
"""

from __future__ import annotations

from common import int_list, markdown_table  # this folder

import ctypes
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from betty_trainer.sampling import BulkNeighborSampler, NeighborSampler, SampleKey
from dgl_channel import DEFAULT_DGL_PYTHON, DGLProcess  # this folder
from sampling import batch_arguments, epoch_batches  # this folder

NS = "NS (per batch)"
DGL = "DGL NeighborSampler"


def parse_args(argv=None):
    parser = batch_arguments(__doc__.split("\n\n")[0])
    parser.set_defaults(threads=1, batches=64)
    parser.add_argument("--ks", type=int_list, default=[1, 8, 64], help="batches sampled at once by bulk-ns")
    parser.add_argument("--reps", type=int, default=3, help="timed rounds (after one warm-up round)")
    parser.add_argument("--device", default="cpu", help="where bulk-ns samples (cuda: the graph structure on the GPU)")
    parser.add_argument("--dgl-python", default=str(DEFAULT_DGL_PYTHON), help="'' skips DGL")
    return parser.parse_args(argv)


def counts(batches) -> list[float]:
    """Mean sampled vertices per layer over ``batches``: each block's src nodes, input layer first, then the seeds."""
    return np.mean([[b.num_src for b in batch.blocks] + [batch.blocks[-1].num_dst] for batch in batches], 0).tolist()


def same_batch(a, b) -> bool:
    return all(torch.equal(x.src_nodes, y.src_nodes) and torch.equal(x.indptr, y.indptr)
               and torch.equal(x.indices, y.indices) for x, y in zip(a.blocks, b.blocks, strict=True))


def reset_peak(pid: int) -> int:
    """Reset the process's resident high-water mark (Linux ≥ 4.0) and return its resident size then, KiB; for this
    process, first hand the memory malloc holds freed back to the system."""
    if pid == os.getpid():
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _status_kib(pid, "VmRSS")


def peak_mib(pid: int, start: int) -> float:
    """How far the process's resident high-water mark rose above ``start`` (KiB) since :func:`reset_peak`, MiB."""
    return max(0, _status_kib(pid, "VmHWM") - start) / 2**10


def _status_kib(pid: int, field: str) -> int:
    line = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1])


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def timed(sample, device: torch.device) -> tuple[float, list]:
    """Seconds of ``sample()``, CPU time of this process (wall time, synchronised, on a GPU), and its batches."""
    clock = time.process_time if device.type == "cpu" else time.perf_counter
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = clock()
    sampled = sample()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return clock() - started, sampled


def start_dgl(args, graph, batches, scratch: Path) -> DGLProcess | None:
    """DGL's side with the graph and the seeds loaded, or ``None`` without DGL's Python."""
    if not args.dgl_python or not Path(args.dgl_python).exists():
        return None
    np.save(scratch / "indptr.npy", graph.indptr.numpy())
    np.save(scratch / "indices.npy", graph.indices.numpy())
    np.save(scratch / "seeds.npy", torch.cat(batches).numpy())
    sampling_script = Path(__file__).resolve().parent / "sampling.py"
    dgl = DGLProcess(args.dgl_python, sampling_script, ["--dgl-side"], args.threads, scratch / "dgl.log")
    hello = dgl("hello")
    dgl("load", folder=str(scratch))
    print(f"DGL {hello['dgl']} (torch {hello['torch']}, {hello['threads']} thread(s)) side by side", flush=True)
    return dgl


def table(seconds: dict[str, list[float]], layers: dict[str, list[float]], peaks: dict[str, float],
          seeds: int) -> str:
    """The printed table; refuses a bulk sampler whose vertices per layer are off NS's by over 1%."""
    ns_rate = seeds / statistics.median(seconds[NS])
    rows = []
    for name, values in seconds.items():
        if not values:
            continue
        rate = seeds / statistics.median(values)
        deviation = max(abs(a / b - 1) for a, b in zip(layers[name], layers[NS], strict=True))
        if name.startswith("bulk") and deviation > 0.01:
            raise SystemExit(f"{name}: sampled vertices per layer {layers[name]} off NS's {layers[NS]} by over 1%")
        rows.append([name, "/".join(f"{v:,.0f}" for v in layers[name]), f"{deviation:.2%}", f"{rate:,.0f}",
                     f"{rate / ns_rate:.2f}", f"{peaks[name]:,.0f}"])
    return markdown_table(["sampler", "vertices per layer (input → seeds)", "max Δ vs NS, a layer",
                           "seeds/s (CPU time)", "× NS", "peak RSS rise (MiB)"], rows)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    graph, _, batches = epoch_batches(args)
    keys = [SampleKey(args.seed, 0, step) for step in range(len(batches))]
    print(f"{args.graph}: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges; fanouts {args.fanouts} (input layer "
          f"first), {len(batches)} batches of {args.batch_size}, {args.threads} thread(s), bulk-ns on {device}; "
          f"load average {load_average()}", flush=True)
    ns = NeighborSampler(graph, args.fanouts)
    samplers = {NS: lambda: [ns.sample(s, k) for s, k in zip(batches, keys)]}
    bulks = []
    for k in args.ks:
        bulk = BulkNeighborSampler(graph, args.fanouts, bulk=k, device=device)
        bulks.append(bulk)
        samplers[f"bulk-ns k={k}"] = (lambda bulk=bulk, k=k: [
            batch for start in range(0, len(batches), k)
            for batch in bulk.sample_many(batches[start:start + k], keys[start:start + k])])
    for sample_first in (lambda: ns.sample(batches[0][:16], keys[0]),
                         *(lambda bulk=bulk: bulk.sample_many([batches[0][:16]], keys[:1]) for bulk in bulks)):
        sample_first()  # compiles or loads the kernels before any peak is read
    seconds: dict[str, list[float]] = {name: [] for name in [*samplers, DGL]}
    layers: dict[str, list[float]] = {}
    peaks: dict[str, float] = {}
    reference = None
    with tempfile.TemporaryDirectory() as scratch:
        dgl = start_dgl(args, graph, batches, Path(scratch))
        for rep in range(args.reps + 1):
            for name, sample in samplers.items():
                start = reset_peak(os.getpid())
                spent, sampled = timed(sample, device)
                if rep == 0:  # the warm-up round: peaks, counts and the check against NS
                    peaks[name], layers[name] = peak_mib(os.getpid(), start), counts(sampled)
                    reference = reference or sampled
                    if not all(same_batch(a, b) for a, b in zip(reference, sampled, strict=True)):
                        raise SystemExit(f"{name}: a batch differs from NS's")
                else:
                    seconds[name].append(spent)
                del sampled
            if dgl is not None:
                start = reset_peak(dgl.process.pid)
                theirs = dgl("run", kind="ns", seeds=str(Path(scratch) / "seeds.npy"), batch_size=args.batch_size,
                             fanouts=args.fanouts, importance=0, kappa=1, seed=args.seed, reps=1, lru=1)
                if rep == 0:  # its first run: a warm-up pass and a timed one, each holding its batches
                    peaks[DGL], layers[DGL] = peak_mib(dgl.process.pid, start), theirs["nodes_per_layer"]
                else:
                    seconds[DGL].append(theirs["cpu_seconds"][0])
            spent = ", ".join(f"{name} {values[-1]:.2f}s" for name, values in seconds.items() if values)
            print(f"  round {rep}: {spent or 'warm-up'}", flush=True)
        if dgl is not None:
            dgl.close()
    print(f"\nload average after: {load_average()}\n")
    print(table(seconds, layers, peaks, sum(batch.numel() for batch in batches)))


if __name__ == "__main__":
    main()
