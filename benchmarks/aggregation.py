"""The aggregation kernel side by side with DGL's GSpMM (issue 23, item 1): forward + backward of one
neighbourhood aggregation on the same block, per weighting, one thread each.

Ours is ``betty_trainer.models.aggregate.aggregate`` (``_SparseAggregate``: the compiled CSR kernels on the
CPU), DGL's the GSpMM its layers run (DGL 2.1, in its own environment, ``--dgl-python``, default the
environment ``bash .ci/dgl`` builds: this same file serves as DGL's side, started with ``--serve``):

``mean``
    ours: ``mean_neighbours`` (the sum, each row then scaled by ``1/deg``); DGL: ``SAGEConv``'s
    ``update_all(copy_u, mean)``.
``gcn``
    ``D_dst^-1/2 · A · D_src^-1/2 · h``, the scales from the graph's degrees + 1; ours: ``aggregate`` with
    ``row_scale`` and ``col_scale``; DGL: ``GraphConv(norm="both")``'s ``h · norm_src``, ``update_all(copy_u,
    sum)``, ``· norm_dst``.
``sum``
    ours: ``aggregate`` without values (GIN's sum); DGL: ``dgl.ops.copy_u_sum``.
``weighted``
    one positive weight per edge; ours: ``aggregate(values=w)``; DGL: ``dgl.ops.u_mul_e_sum``.

Blocks: every node of the graph as a dst node with its full neighbourhood (what a K = 1 full-batch step
aggregates): Amazon Computers and ``sbm-30k`` (``benchmarks/versus_dgl.py``'s 30k-node SBM), hidden widths
``--hidden``. The two sides read the same arrays (CSC structure, features, output gradient, weights, norms) and
check each other's results. Each side calls ``torch.set_num_threads(1)`` (ours also numba's); times are CPU time
(``time.process_time``) of one forward + backward, rounds interleaved (ours kept, ours per call, DGL, …), medians
over ``--processes`` runs of DGL's side (restarted each time, ours reloading its arrays; the rounds shared among
them): the memory placement alone took the same kernel on the same arrays 12.1–16.7 ms from one process to the next
at 256 columns on the SBM, whose 30 MiB of rows about fill this machine's 32 MiB L3, so one run's ratio can land
either side of 1.
DGL builds its out-edge (CSR) format in the warm-up call and keeps it on the graph. Ours runs twice: "kept", the
block keeping its transpose (``keep_transposes``: what a full batch trained every step keeps, planned in one
micro-batch), so the backward gathers on it; "per call", keeping nothing between calls (a sampled batch's blocks),
so the backward scatters up to ``SCATTER_MAX_WIDTH`` columns and builds ``Aᵀ`` per call above.
Both sides run with the process settings ``import betty_trainer`` makes (``betty_trainer/process.py``: the OpenMP
wait policy and huge pages), as a user's process gets them: ``common`` imports the package before torch loads, and
DGL's process inherits the environment.

On a GPU (``--device cuda``; no DGL there) ours runs its tensor path (``torch.sparse`` CSR products, ``Aᵀ`` built
per backward) against PyG's ``spmm`` on a ``torch.sparse`` CSR made before the clock, wall time with the device
synchronised, plus each side's ``max_memory_allocated`` peak above its inputs.

Run:
    python benchmarks/aggregation.py
    python benchmarks/aggregation.py --device cuda        # on a GPU machine: ours against PyG's spmm
    python benchmarks/aggregation.py --graphs amazon-computers --hidden 64 --rounds 5
"""

from __future__ import annotations

import common  # this folder
from common import int_list, markdown_table, name_list

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from dgl_channel import DEFAULT_DGL_PYTHON, DGLProcess, serve  # this folder

WEIGHTINGS = ("mean", "gcn", "sum", "weighted")
CPU = torch.device("cpu")


def timed(run, repeat: int, device: torch.device = CPU) -> list[float]:
    """Milliseconds of each of ``repeat`` calls of ``run``: CPU time on the CPU; on a GPU wall time, the device
    synchronised before and after each call."""
    cuda = device.type == "cuda"
    clock = time.perf_counter if cuda else time.process_time
    times = []
    for _ in range(repeat):
        if cuda:
            torch.cuda.synchronize(device)
        start = clock()
        run()
        if cuda:
            torch.cuda.synchronize(device)
        times.append((clock() - start) * 1e3)
    return times


def load_arrays(folder: Path) -> dict[str, torch.Tensor]:
    return {path.stem: torch.from_numpy(np.load(path, allow_pickle=False)) for path in folder.glob("*.npy")}


class DGLSide:
    """DGL's half (run with DGL's Python by :class:`~dgl_channel.DGLProcess`): the graph as a ``dgl.Block`` built
    from the CSC arrays, the passes as DGL's layers run them."""

    def __init__(self) -> None:
        import dgl

        self.dgl = dgl
        self.cases: dict[str, tuple] = {}

    def load(self, key: str, folder: str) -> dict:
        arrays = load_arrays(Path(folder))
        indptr, indices = arrays["indptr"].long(), arrays["indices"].long()
        block = self.dgl.create_block(("csc", (indptr, indices, torch.arange(indices.numel()))),
                                      num_src_nodes=arrays["h"].shape[0], num_dst_nodes=indptr.numel() - 1)
        self.cases[key] = (block, arrays)
        return {}

    def run(self, key: str, weighting: str, repeat: int) -> dict:
        block, arrays = self.cases[key]
        fn, ops = self.dgl.function, self.dgl.ops
        h = arrays["h"].clone().requires_grad_(True)

        def forward():
            if weighting == "mean":
                with block.local_scope():
                    block.srcdata["h"] = h
                    block.update_all(fn.copy_u("h", "m"), fn.mean("m", "neigh"))
                    return block.dstdata["neigh"]
            if weighting == "gcn":
                with block.local_scope():
                    block.srcdata["h"] = h * arrays["col_scale"].unsqueeze(1)
                    block.update_all(fn.copy_u("h", "m"), fn.sum("m", "h"))
                    return block.dstdata["h"] * arrays["row_scale"].unsqueeze(1)
            if weighting == "sum":
                return ops.copy_u_sum(block, h)
            return ops.u_mul_e_sum(block, h, arrays["weight"].unsqueeze(1))

        def step():
            h.grad = None
            forward().backward(arrays["grad"])

        times = timed(step, repeat)
        return {"ms": times, "out": forward().double().sum().item(), "grad": h.grad.double().sum().item()}


class OurSide:
    """Ours, in this process, on the same arrays (moved to ``device``): an unweighted block, and one carrying the
    weights for ``weighted``; with ``kept`` each keeps its transpose (``keep_transposes``; the CPU only)."""

    def __init__(self, arrays: dict[str, torch.Tensor], device: torch.device = CPU, kept: bool = False) -> None:
        from betty_trainer import Block
        from betty_trainer.models.aggregate import keep_transposes

        self.arrays, self.device = {key: value.to(device) for key, value in arrays.items()}, device
        num_src = arrays["h"].shape[0]
        self.blocks = {weighted: Block(torch.arange(num_src), arrays["indptr"].numel() - 1, arrays["indptr"],
                                       arrays["indices"], arrays["weight"] if weighted else None).to(device)
                       for weighted in (False, True)}
        keep_transposes(list(self.blocks.values()), [kept] * 2)

    def run(self, weighting: str, repeat: int) -> dict:
        from betty_trainer.models.aggregate import aggregate, mean_neighbours

        block, arrays = self.blocks[weighting == "weighted"], self.arrays
        h = arrays["h"].clone().requires_grad_(True)

        def forward():
            if weighting == "mean":
                return mean_neighbours(block, h)
            if weighting == "gcn":
                return aggregate(block, h, row_scale=arrays["row_scale"], col_scale=arrays["col_scale"])
            return aggregate(block, h, block.edge_weight)

        return measured(forward, h, arrays["grad"], repeat, self.device)


class SparseMMSide:
    """PyG's ``torch_geometric.utils.spmm`` on a ``torch.sparse`` CSR of ``A`` made once, before the clock (as a PyG
    model holds its adjacency): ``sum``, ``mean`` (its sum divided by the in-degree), and ``gcn`` and ``weighted``
    as the sum over a CSR whose values are the edges' factors (``row_scale[d]·col_scale[s]``, or the weights). On
    CUDA its sum is ``torch.sparse.mm`` (cuSPARSE; the backward transposes the CSR per call)."""

    def __init__(self, arrays: dict[str, torch.Tensor], device: torch.device) -> None:
        self.arrays, self.device = {key: value.to(device) for key, value in arrays.items()}, device
        indptr, indices = self.arrays["indptr"], self.arrays["indices"].long()
        dst = torch.repeat_interleave(torch.arange(indptr.numel() - 1, device=device), indptr.diff())
        factors = {"sum": None, "mean": None, "weighted": self.arrays["weight"],
                   "gcn": self.arrays["row_scale"][dst] * self.arrays["col_scale"][indices]}
        shape = (indptr.numel() - 1, self.arrays["h"].shape[0])
        with warnings.catch_warnings():  # "sparse CSR support is in beta"
            warnings.simplefilter("ignore", UserWarning)
            self.matrices = {weighting: torch.sparse_csr_tensor(
                indptr, indices, torch.ones_like(indices, dtype=torch.float32) if values is None else values, shape)
                for weighting, values in factors.items()}

    def run(self, weighting: str, repeat: int) -> dict:
        from torch_geometric.utils import spmm

        matrix, h = self.matrices[weighting], self.arrays["h"].clone().requires_grad_(True)
        return measured(lambda: spmm(matrix, h, "mean" if weighting == "mean" else "sum"), h, self.arrays["grad"],
                        repeat, self.device)


def measured(forward, h: torch.Tensor, grad: torch.Tensor, repeat: int, device: torch.device) -> dict:
    """Times of ``repeat`` forward + backward calls (:func:`timed`), the output's and ``h``'s gradient's sums, and
    on a GPU the step's peak: ``max_memory_allocated`` above what was allocated before it (bytes)."""

    def step():
        h.grad = None
        forward().backward(grad)

    times = timed(step, repeat, device)
    peak = None
    if device.type == "cuda":
        h.grad = None
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        peak = torch.cuda.max_memory_allocated(device) - before
    return {"ms": times, "out": forward().double().sum().item(), "grad": h.grad.double().sum().item(), "peak": peak}


def export(name: str, hidden: int, folder: Path) -> None:
    """The block's arrays for both sides: CSC structure, ``h`` and the output gradient (seeded normals), one
    weight per edge (uniform in [0.5, 1.5)) and GCN's scales ``(deg + 1)^-1/2``."""
    graph = common.load_graph(name)
    generator = torch.Generator().manual_seed(0)
    n = graph.num_nodes
    norm = (graph.in_degrees().float() + 1).rsqrt()
    arrays = {"indptr": graph.indptr, "indices": graph.indices, "h": torch.randn(n, hidden, generator=generator),
              "grad": torch.randn(n, hidden, generator=generator), "row_scale": norm, "col_scale": norm,
              "weight": torch.rand(graph.indices.numel(), generator=generator) + 0.5}
    folder.mkdir(parents=True)
    for key, value in arrays.items():
        np.save(folder / f"{key}.npy", value.numpy())


def agree(ours: dict, theirs: dict) -> bool:
    """The two sides' output and gradient sums agree to float32 reassociation."""
    return all(abs(ours[k] - theirs[k]) <= 1e-4 * max(1.0, abs(theirs[k])) for k in ("out", "grad"))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graphs", type=name_list, default=["amazon-computers", "sbm-30k"])
    parser.add_argument("--hidden", type=int_list, default=[64, 256])
    parser.add_argument("--weightings", type=name_list, default=list(WEIGHTINGS))
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (ours, DGL) per case")
    parser.add_argument("--repeat", type=int, default=3, help="timed calls per side per round")
    parser.add_argument("--processes", type=int, default=3,
                        help="runs per graph and width, DGL's side restarted and ours reloading its arrays, the "
                             "rounds shared among them (1 to --rounds)")
    parser.add_argument("--dgl-python", default=str(DEFAULT_DGL_PYTHON))
    parser.add_argument("--device", default="cpu",
                        help="cpu (against DGL), or cuda: ours against PyG's spmm on torch.sparse, wall time, peaks")
    parser.add_argument("--serve", action="store_true", help="serve DGL's side (run with DGL's Python)")
    args = parser.parse_args(argv)
    if not 1 <= args.processes <= args.rounds:
        parser.error(f"--processes must be 1 to --rounds ({args.rounds}), got {args.processes}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.serve:
        serve(DGLSide())
        return
    if args.device != "cpu":
        on_device(args, torch.device(args.device))
        return
    import numba

    numba.set_num_threads(1)
    rows, header = [], ""
    with tempfile.TemporaryDirectory(prefix="aggregation-") as tmp:
        tmp = Path(tmp)
        for name in args.graphs:
            for hidden in args.hidden:
                key = f"{name}-{hidden}"
                export(name, hidden, tmp / key)
                ms = {weighting: {"kept": [], "per call": [], "dgl": []} for weighting in args.weightings}
                checked = dict.fromkeys(args.weightings, True)
                for pair in range(args.processes):  # DGL restarted, ours reloading: another memory placement each
                    rounds = len(range(pair, args.rounds, args.processes))
                    dgl = DGLProcess(args.dgl_python, Path(__file__).resolve(), ["--serve"], 1, tmp / "dgl-side.log")
                    try:
                        hello = dgl("hello")
                        if not header:
                            header = (f"ours (torch {torch.__version__}, {torch.get_num_threads()} thread, numba "
                                      f"{numba.get_num_threads()}) vs DGL {hello['dgl']} (torch {hello['torch']}, "
                                      f"{hello['threads']} thread); CPU ms of one forward + backward, median of "
                                      f"{args.rounds} interleaved rounds × {args.repeat} calls over "
                                      f"{args.processes} runs of DGL's side")
                            print(header)
                        dgl("load", key=key, folder=str(tmp / key))
                        sides = None  # the last run's arrays freed before these load
                        sides = {"kept": OurSide(load_arrays(tmp / key), kept=True),
                                 "per call": OurSide(load_arrays(tmp / key))}
                        for weighting in args.weightings:
                            theirs = dgl("run", key=key, weighting=weighting, repeat=1)
                            checked[weighting] &= all(agree(side.run(weighting, 1), theirs) for side in sides.values())
                            for _ in range(rounds):
                                for arm, side in sides.items():
                                    ms[weighting][arm] += side.run(weighting, args.repeat)["ms"]
                                ms[weighting]["dgl"] += dgl("run", key=key, weighting=weighting,
                                                            repeat=args.repeat)["ms"]
                    finally:
                        dgl.close()
                for weighting in args.weightings:
                    kept, per_call, b = (statistics.median(ms[weighting][arm]) for arm in ("kept", "per call", "dgl"))
                    rows.append([name, str(hidden), weighting, f"{kept:.2f}", f"{per_call:.2f}", f"{b:.2f}",
                                 f"{kept / b:.2f}", f"{per_call / b:.2f}", "yes" if checked[weighting] else "NO"])
                    print(" | ".join(rows[-1]), flush=True)
    print()
    print(markdown_table(["graph", "hidden", "weighting", "ours kept ms", "ours per call ms", "DGL ms",
                          "kept/DGL", "per call/DGL", "same result"], rows))


def mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.1f}"


def on_device(args: argparse.Namespace, device: torch.device) -> None:
    """Ours against PyG's ``spmm`` (:class:`SparseMMSide`) on ``device``, rounds interleaved: wall milliseconds of one
    forward + backward (median) and each side's peak above its inputs (issue 23 item 1, on a GPU)."""
    rows = []
    print(f"ours vs PyG spmm on {torch.cuda.get_device_name(device)} (torch {torch.__version__}); wall ms of one "
          f"forward + backward, median of {args.rounds} interleaved rounds × {args.repeat} calls; peak MiB above inputs")
    with tempfile.TemporaryDirectory(prefix="aggregation-") as tmp:
        for name in args.graphs:
            for hidden in args.hidden:
                export(name, hidden, Path(tmp) / f"{name}-{hidden}")
                arrays = load_arrays(Path(tmp) / f"{name}-{hidden}")
                sides = {"ours": OurSide(arrays, device), "pyg": SparseMMSide(arrays, device)}
                for weighting in args.weightings:
                    first = {side: runner.run(weighting, 1) for side, runner in sides.items()}
                    ms = {side: [] for side in sides}
                    for _ in range(args.rounds):
                        for side, runner in sides.items():
                            ms[side] += runner.run(weighting, args.repeat)["ms"]
                    a, b = statistics.median(ms["ours"]), statistics.median(ms["pyg"])
                    rows.append([name, str(hidden), weighting, f"{a:.3f}", f"{b:.3f}", f"{a / b:.2f}",
                                 *(mib(first[side]["peak"]) for side in sides),
                                 "yes" if agree(first["ours"], first["pyg"]) else "NO"])
                    print(" | ".join(rows[-1]), flush=True)
    print()
    print(markdown_table(["graph", "hidden", "weighting", "ours ms", "PyG spmm ms", "ours/PyG", "ours peak MiB",
                          "PyG peak MiB", "same result"], rows))


if __name__ == "__main__":
    main()
