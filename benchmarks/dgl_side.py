"""The DGL half of ``benchmarks/versus_dgl.py``: runs in DGL's own environment (``bash .ci/dgl`` builds it).

Never imported by betty-trainer: ``versus_dgl.py`` starts it as a subprocess with the
DGL environment's Python and talks to it in JSON lines (one command on stdin, one
answer on stdout), so the two sides' repetitions interleave. Graphs arrive as plain
``.npy`` arrays (no pickles) written by ``versus_dgl.py``: the same CSC arrays, features,
labels and seed batches the betty side uses.

The model is DGL's GraphSAGE as in its examples: ``SAGEConv(aggregator_type="mean")``
layers, dropout on the input features and on every hidden representation, ReLU between
layers, the same structure as betty's ``GraphSAGE``. The memory peak is measured with
betty's ``estimator/measure.py`` loaded by path (it imports only torch): the replay of
``torch.profiler``'s allocation records, the same function the betty side uses.

Commands (``op``): ``load``, ``full_memory``, ``full_step``, ``sample``, ``minibatch_epoch``, ``quit``;
see :func:`main`.
"""

from __future__ import annotations

from common import REPO_ROOT  # this folder

import importlib.util
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dgl_channel import serve  # this folder

_MEASURE = REPO_ROOT / "estimator" / "measure.py"


def _load_measure():
    spec = importlib.util.spec_from_file_location("_betty_measure", _MEASURE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


class SAGE(nn.Module):
    """DGL GraphSAGE: ``dropout → SAGEConv → ReLU → dropout → … → SAGEConv`` (logits)."""

    def __init__(self, in_feats: int, hidden: int, out_feats: int, num_layers: int, dropout: float):
        super().__init__()
        from dgl.nn import SAGEConv

        widths = [in_feats] + [hidden] * (num_layers - 1) + [out_feats]
        self.layers = nn.ModuleList(SAGEConv(a, b, "mean") for a, b in zip(widths[:-1], widths[1:]))
        self.dropout = nn.Dropout(dropout)

    def forward(self, graphs, x):
        h = x
        for index, (layer, graph) in enumerate(zip(self.layers, graphs)):
            h = layer(graph, self.dropout(h))
            if index < len(self.layers) - 1:
                h = F.relu(h)
        return h


class Side:
    """State kept between commands: graphs, their arrays, and the models of the timed runs."""

    def __init__(self) -> None:
        import dgl

        self.dgl = dgl
        self.measure = _load_measure()
        self.graphs: dict[str, dict] = {}
        self.models: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}

    def load(self, name: str, folder: str) -> dict:
        folder = Path(folder)
        arrays = {path.stem: np.load(path, allow_pickle=False) for path in folder.glob("*.npy")}
        indptr = torch.from_numpy(arrays["indptr"]).long()
        indices = torch.from_numpy(arrays["indices"]).long()  # betty may store int32; DGL takes int64 here
        num_nodes = indptr.numel() - 1
        dst = torch.repeat_interleave(torch.arange(num_nodes), indptr[1:] - indptr[:-1])
        graph = self.dgl.graph((indices, dst), num_nodes=num_nodes)
        graph.create_formats_()  # CSC/CSR/COO built once, outside every measurement
        entry = {"graph": graph, "num_classes": int(arrays.get("num_classes", np.array(0))), "csc": (indptr, indices)}
        if "x" in arrays:
            entry["x"] = torch.from_numpy(arrays["x"])
            entry["y"] = torch.from_numpy(arrays["y"])
        self.graphs[name] = entry
        structure = [t for form in ("coo", "csr", "csc") for t in graph.adj_tensors(form) if isinstance(t, torch.Tensor)]
        return {"nodes": num_nodes, "edges": graph.num_edges(), "formats": graph.formats()["created"],
                "structure_bytes": sum(t.numel() * t.element_size() for t in structure)}

    def _model(self, name: str, hidden: int, seed: int, dropout: float = 0.5, num_layers: int = 2):
        entry = self.graphs[name]
        torch.manual_seed(seed)
        model = SAGE(entry["x"].shape[1], hidden, entry["num_classes"], num_layers, dropout)
        return model, torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)

    def structure(self, name: str, blocks: bool):
        """What a step runs on: the whole graph (COO, CSR and CSC made at load), or with ``blocks`` a fresh
        ``dgl.Block`` holding only the CSC that betty's full-batch block holds (DGL makes the CSR its backward
        needs inside the step, as a freshly sampled block would)."""
        if not blocks:
            return self.graphs[name]["graph"]
        indptr, indices = self.graphs[name]["csc"]
        nodes = indptr.numel() - 1
        return self.dgl.create_block(("csc", (indptr, indices, torch.empty(0, dtype=torch.int64))),
                                     num_src_nodes=nodes, num_dst_nodes=nodes)

    def _full_step(self, name: str, model: nn.Module, optimizer: torch.optim.Optimizer, outputs: torch.Tensor | None,
                   graph):
        entry = self.graphs[name]
        x, y = entry["x"], entry["y"]
        optimizer.zero_grad(set_to_none=True)
        logits = model([graph] * len(model.layers), x)
        if outputs is None:
            loss = F.cross_entropy(logits, y)
        else:
            loss = F.cross_entropy(logits[outputs], y[outputs])
        loss.backward()
        optimizer.step()

    def full_memory(self, name: str, hidden: int, seed: int, outputs: str | None, dropout: float = 0.5,
                    blocks: bool = False) -> dict:
        """Peak bytes of one full-graph step after one warm-up step (Adam state exists), as betty measures; with
        ``blocks`` on a fresh CSC-only block (:meth:`structure`)."""
        model, optimizer = self._model(name, hidden, seed, dropout)
        out = None if outputs is None else torch.from_numpy(np.load(outputs, allow_pickle=False))
        model.train()
        self._full_step(name, model, optimizer, out, self.structure(name, blocks))
        optimizer.zero_grad(set_to_none=True)
        state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        graph = self.structure(name, blocks)
        structure = [t for t in graph.adj_tensors("csc") if isinstance(t, torch.Tensor)]
        resident = [*model.parameters(), *state, *structure]
        peak = self.measure.measure_peak(lambda: self._full_step(name, model, optimizer, out, graph), "cpu", resident)
        return {"peak_bytes": peak.peak_bytes, "resident_bytes": peak.resident_bytes}

    def full_step(self, name: str, hidden: int, seed: int, outputs: str | None, key: str,
                  dropout: float = 0.5, blocks: bool = False) -> dict:
        """One timed full-graph training step on a model kept under ``key`` (created on first use); with ``blocks``
        on a fresh CSC-only block, made before the clock starts."""
        if key not in self.models:
            self.models[key] = self._model(name, hidden, seed, dropout)
        model, optimizer = self.models[key]
        out = None if outputs is None else torch.from_numpy(np.load(outputs, allow_pickle=False))
        model.train()
        graph = self.structure(name, blocks)
        started = time.perf_counter()
        self._full_step(name, model, optimizer, out, graph)
        return {"seconds": time.perf_counter() - started}

    def sample(self, name: str, seeds: str, batch_size: int, fanouts: list[int], seed: int) -> dict:
        """Seconds to sample every batch of ``seeds`` with ``NeighborSampler(fanouts)`` (blocks included)."""
        from dgl.dataloading import NeighborSampler

        graph = self.graphs[name]["graph"]
        batches = torch.from_numpy(np.load(seeds, allow_pickle=False)).split(batch_size)
        sampler = NeighborSampler(fanouts)
        self.dgl.seed(seed)
        edges = 0
        started = time.perf_counter()
        for batch in batches:
            _, _, blocks = sampler.sample_blocks(graph, batch)
            edges += sum(block.num_edges() for block in blocks)
        return {"seconds": time.perf_counter() - started, "seeds": sum(b.numel() for b in batches), "edges": edges}

    def minibatch_epoch(self, name: str, hidden: int, seed: int, seeds: str, batch_size: int, fanouts: list[int],
                        key: str, dropout: float = 0.5) -> dict:
        """One mini-batch epoch over the given seed batches: sample, gather, forward, backward, Adam step."""
        from dgl.dataloading import NeighborSampler

        if key not in self.models:
            self.models[key] = self._model(name, hidden, seed, dropout)
        model, optimizer = self.models[key]
        entry = self.graphs[name]
        graph, x, y = entry["graph"], entry["x"], entry["y"]
        batches = torch.from_numpy(np.load(seeds, allow_pickle=False)).split(batch_size)
        sampler = NeighborSampler(fanouts)
        self.dgl.seed(seed)
        model.train()
        sampling = 0.0
        started = time.perf_counter()
        for batch in batches:
            t0 = time.perf_counter()
            input_nodes, output_nodes, blocks = sampler.sample_blocks(graph, batch)
            sampling += time.perf_counter() - t0
            optimizer.zero_grad(set_to_none=True)
            logits = model(blocks, x[input_nodes])
            F.cross_entropy(logits, y[output_nodes]).backward()
            optimizer.step()
        return {"seconds": time.perf_counter() - started, "sampling_seconds": sampling}


def main() -> None:
    """Serve the driver's commands over the JSON-lines channel (:mod:`dgl_channel`)."""
    serve(Side())


if __name__ == "__main__":
    main()
