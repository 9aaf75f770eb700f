"""Layer-wise chunked execution of one batch with recomputation: exact, and without Betty's redundancy
(the layer-by-layer order of ROC, NeutronStar and HongTu, with exact gradients): the :class:`LayerwisePlan`
of a batch and its executor, :func:`layerwise_backward`.

Betty's micro-batches (:mod:`betty_trainer.execution.micro_batches`) each carry all ``L`` layers of their
receptive field, so a hidden node read by several micro-batches is gathered and computed once per
micro-batch. Here the batch's blocks run one layer at a time, each layer's dst nodes a chunk at
a time (:func:`partition.chunks.chunk_layers`):

- **Forward**, layers 1 … L, without autograd: a chunk gathers its src rows of ``h_{l−1}`` (layer
  1: the input features, from the feature store) and computes its rows of ``h_l``, which is kept
  whole. The logits give the loss ``Σ CE / |V|`` and its gradient ``∂L/∂h_L``.
- **Backward**, layers L … 1: each chunk recomputes its forward from the stored ``h_{l−1}`` with
  autograd on and backpropagates its rows of ``∂L/∂h_l``; the parameter gradients add into
  ``.grad`` and its input rows' gradients into ``∂L/∂h_{l−1}`` (not at layer 1). ``h_l`` is freed
  before its layer's backward (the recompute makes what it needs), ``∂L/∂h_l`` after it.
- **Projected layers** (GAT, and SAGE ``mean``/``gcn`` when they project first:
  :func:`~betty_trainer.models.capabilities.projected_layers`): ``z = W·dropout(h_{l−1})`` is computed once per
  pass for all the layer's src rows (one row block per chunk) and kept until the layer's backward; each chunk
  gathers its rows of ``z`` (and, for a layer that ``reads_dst_input``, such as SAGE ``mean``'s self term, its dst
  nodes' input rows, whose gradient it adds into ``∂L/∂h_{l−1}``). Backward sums ``∂L/∂z`` over the chunks, then
  recomputes the projection block by block and backpropagates it.
- **Affine layers** (SAGE ``mean``/``gcn`` when they project first:
  :func:`~betty_trainer.models.capabilities.affine_layers`): the layer's output is ``A·z`` (``A`` from the block
  alone) plus terms without ``z``, so no gradient reads ``z``'s values. Its ``z`` is freed when its forward ends;
  in backward ``∂L/∂h_l`` first takes the stack's ReLU from the stored ``h_l`` (:func:`relu_backward_`; not at
  the output layer, which has no ReLU). Where the compiled CPU kernels run, such a layer runs off the whole block
  in as many contiguous dst row blocks as it has chunks (:meth:`_LayerPass.pieces`; the chunks' dst sets do not
  matter, so the planner splits it by ``range``): forward sums each row's CSR row of the block reading ``z`` in
  place, backward adds ``Aᵀ·∂L/∂h_l`` into ``∂L/∂z`` and recomputes nothing: block by block of the src rows, their
  input rows (with the stack's dropout) give the parameters' gradients from ``∂L/∂z`` and, on the dst rows, from
  ``∂L/∂h_l``, and the input rows' gradient (``SAGEConv.propagate_rows``, ``SAGEConv.projection_backward``). Elsewhere
  each chunk recomputes from zeros in place of its rows of ``z``, without the ReLU.
- **Structure**: a chunk keeps its dst nodes and CSC pointer; its slice and sub-block are made when it
  runs and freed when it ends (:meth:`partition.chunks.Chunk.slice`).
- **Where h_l lives**: on the device, or in host memory when the plan says so
  (``LayerChunks.host_outputs``); the chunks then copy their rows to the device.

Node-keyed dropout (:class:`~betty_trainer.models.dropout.NodeDropout`) draws the same mask for a
node in every chunk and in the recompute, so the result is the full batch's gradient up to
floating-point reassociation, as with micro-batches. Live at the peak: the stored layers (forward)
or ``h_{l−1}``, ``∂L/∂h_l`` and ``∂L/∂h_{l−1}`` (backward), and one chunk's one-layer step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.profiler import record_function

from betty_trainer.data.block import Batch, Block
from betty_trainer.data.feature_store import FeatureStore
from betty_trainer.errors import NonFiniteLossError
from betty_trainer.execution.micro_batches import training_state
from betty_trainer.execution.plan import StepResult, held_bytes, piece_row, plan_report
from betty_trainer.models.capabilities import affine_layers, projected_layers, whole_block_layers
from betty_trainer.models.stack import LayerStack, runs_layer_by_layer
from betty_trainer.phases import GATHER
from betty_trainer.rng import compiled_kernels
from estimator.layerwise import row_blocks
from estimator.measure import MeasuredPeak, measure_peak
from partition.chunks import Chunk, LayerChunks


@dataclass
class LayerwisePlan:
    """A :class:`~betty_trainer.execution.plan.StepPlan` that runs a batch layer by layer in ``chunks``
    (:func:`layerwise_backward`).

    Attributes:
        batch: the batch.
        chunks: its :class:`~partition.chunks.LayerChunks` (``chunks.host_outputs``: the hidden layers' outputs are
            kept in host memory, as the device budget does not hold them).
        work: the estimated cost the planner compared (see the protocol).
        partitioners: per layer (input layer first), what split its chunks (:attr:`partition.chunks.ChunkSearch.partitioners`):
            ``micro_batch.partitioner`` (``graph`` for a sampled batch's chunks without a budget: the run's graph
            partition, ``Planner``), or ``range`` for a layer run off the whole block (only its number of chunks
            matters) and for every layer at one dst node per chunk (when that partitioner could not fit the budget).
        estimated_peak: estimated peak bytes (0 without a built-in model's estimate).
        budget: bytes, or ``None`` (K given).
        tried: ``(chunks per layer, estimated peak)`` for every chunking evaluated, in order.
        seconds: wall time of planning.
        feature_store_bytes: device bytes the feature store holds beside the step (taken off the budget).
    """

    batch: Batch
    chunks: LayerChunks
    work: float
    partitioners: list[str]
    estimated_peak: int = 0
    budget: int | None = None
    tried: list[tuple[int, int]] = field(default_factory=list)
    seconds: float = 0.0
    feature_store_bytes: int = 0
    method: ClassVar[str] = "layerwise"

    @property
    def pieces(self) -> int:
        return self.chunks.k

    @property
    def estimate(self) -> int | None:
        return self.estimated_peak or None

    @property
    def summary(self) -> str:
        counts = [len(layer) for layer in self.chunks.layers]
        shown = str(counts[0]) if len(set(counts)) == 1 else ", ".join(map(str, counts))
        return f"layer by layer in {shown} chunk{'s' if max(counts) > 1 else ''} per layer"

    @property
    def partitioner(self) -> str:
        """What split the chunks, in words (``plan.json``'s ``partitioner``): one name when every layer's chunks were
        split by it, else each layer's, input layer first (``"range, metis"``)."""
        return self.partitioners[0] if len(set(self.partitioners)) == 1 else ", ".join(self.partitioners)

    @property
    def host_bytes(self) -> int:
        """The chunks' dst positions and CSC pointers (each chunk's slice is made when it runs)."""
        return held_bytes(t for chunks in self.chunks.layers for chunk in chunks for t in (chunk.dst, chunk.indptr))

    @property
    def host_outputs(self) -> bool:
        """Whether the hidden layers' outputs ``h_l`` are kept in host memory, not on the device."""
        return self.chunks.host_outputs

    def redundancy(self) -> list[float]:
        return [sum(piece.num_src for piece in pieces) / block.num_src
                for block, pieces in zip(self.batch.blocks, self.chunks.layers)]

    def run(self, model: LayerStack, features: FeatureStore, labels: Tensor, device: torch.device) -> StepResult:
        return layerwise_backward(model, self.batch, self.chunks, features, labels, device)

    def measure(self, model: LayerStack, optimizer: torch.optim.Optimizer, features: FeatureStore, labels: Tensor,
                device: torch.device) -> list[int]:
        """The measured peak of one layer-wise step (:func:`measure_layerwise_step`), after one that creates the
        optimizer's state."""
        measure_layerwise_step(model, optimizer, self, features, labels, device)
        return [measure_layerwise_step(model, optimizer, self, features, labels, device).peak_bytes]

    def report(self, measured: list[int] | None = None) -> dict:
        """Rows: chunk ``i`` of every layer is piece ``i`` (a layer with fewer chunks has zeros there); the chunks
        run in one step, estimated and measured whole (the report's ``estimate_peak_bytes``, ``measured_peak_bytes``)."""
        empty = {"src_nodes": 0, "dst_nodes": 0, "edges": 0}
        rows = [piece_row(index, [{"src_nodes": layer[index].num_src, "dst_nodes": layer[index].num_dst,
                                   "edges": layer[index].num_edges} if index < len(layer) else empty
                                  for layer in self.chunks.layers])
                for index in range(self.pieces)]
        return plan_report(self, rows, budget=self.budget, partitioner=self.partitioner, tried=self.tried,
                           seconds=self.seconds, feature_store_bytes=self.feature_store_bytes,
                           measured_step=measured[0] if measured is not None else None,
                           layer_outputs_on="host" if self.host_outputs else "device",
                           chunks_per_layer=[len(layer) for layer in self.chunks.layers],
                           partitioner_per_layer=self.partitioners)


def layerwise_backward(
    model: LayerStack,
    batch: Batch,
    chunks: LayerChunks,
    features: FeatureStore,
    labels: Tensor,
    device: torch.device,
) -> StepResult:
    """Forward and backward ``batch`` layer by layer in ``chunks``, adding ``∇ mean_{i∈V} CE_i`` to ``.grad``.

    Args:
        model: a :class:`~betty_trainer.models.stack.LayerStack`
            (:func:`~betty_trainer.models.stack.runs_layer_by_layer`), in the mode it trains in
            (dropout keyed by :func:`~betty_trainer.models.set_dropout_key`).
        batch: the batch (blocks input layer first; block ``l``'s src nodes are block ``l − 1``'s
            dst nodes, as every sampler here builds them).
        chunks: :func:`partition.chunks.chunk_layers` of ``batch.blocks``.
        features: the feature store (or an ``(N, F)`` tensor) the input rows are gathered from.
        labels: ``(N,)`` int64 labels.
        device: where the model runs; the gradients ``∂L/∂h_l`` are kept there, and so is ``h_l`` unless
            ``chunks.host_outputs`` (the planner's choice when the device budget does not hold them): then the
            hidden layers' outputs are kept in host memory (:func:`output_storage`) and each chunk's rows
            are copied to the device when it reads them (the logits stay on the device).

    Returns:
        The batch's mean loss and its number of correctly classified outputs.

    Raises:
        ValueError: ``model`` cannot run layer by layer, or ``chunks`` has another number of layers.
        NonFiniteLossError: the loss is NaN or infinite (no gradient is added).
    """
    if not runs_layer_by_layer(model):
        raise ValueError(f"{type(model).__name__} cannot run layer by layer: layer-wise execution needs a "
                         "LayerStack whose forward is the stack's own (use micro_batch.mode=micro_batches)")
    blocks = batch.blocks
    if len(chunks.layers) != len(blocks) or len(blocks) != len(model.layers):
        raise ValueError(f"{len(chunks.layers)} chunked layers for a batch of {len(blocks)} blocks and a model of "
                         f"{len(model.layers)} layers")
    dtype = next(model.parameters()).dtype
    whole_block = [rows and compiled_kernels(device, dtype) for rows in whole_block_layers(model)]
    layer_pass = _LayerPass(model, blocks, chunks, features, device, projected_layers(model),
                            affine_layers(model), whole_block, dtype)
    stored, projected = layer_pass.forward()
    return layer_pass.backward(stored, projected, labels, batch.output_nodes)


@dataclass
class _LayerPass:
    """One batch's layer-by-layer pass (:func:`layerwise_backward`): the model and blocks its chunk steps read,
    per layer whether it is projected, affine, and run off the whole block (an affine
    :class:`~betty_trainer.models.capabilities.AffineLayer` where the compiled CPU kernels run:
    :mod:`betty_trainer.models.capabilities`), and ``dtype``, the parameters' (of ``z``, its zeros and ``∂L/∂z``)."""

    model: LayerStack
    blocks: list[Block]
    chunks: LayerChunks
    store: FeatureStore
    device: torch.device
    projects: list[bool]
    affine: list[bool]
    whole_block: list[bool]
    dtype: torch.dtype

    @property
    def last(self) -> int:
        return len(self.blocks) - 1

    def runs_rows(self, index: int) -> bool:
        """Whether layer ``index``'s chunks run off the whole block (:attr:`whole_block`), without slices or gathered
        rows of ``z``, and backpropagate without recomputing."""
        return self.whole_block[index]

    def forward(self) -> tuple[list[Tensor | None], list[Tensor | None]]:
        """Layers 1 … L without autograd: each layer's output ``h_l`` (the last one the logits), and each
        projected, non-affine layer's ``z`` (``None`` for the others), which its backward reads."""
        stored: list[Tensor | None] = []
        projected: list[Tensor | None] = []
        h_prev = None
        with torch.no_grad():
            for index in range(len(self.blocks)):
                z_all = self.project(index, h_prev) if self.projects[index] else None
                out = None
                for piece in self.pieces(index):
                    if isinstance(piece, Chunk):
                        h = self.chunk_step(index, piece, h_prev, z_all, grad=False)[0]  # its input rows die here
                        rows = piece.dst
                    else:
                        h, rows = self.rows_forward(index, *piece, h_prev, z_all), slice(*piece)
                    if out is None:
                        host = self.chunks.host_outputs and index < self.last
                        out = output_storage(self.blocks[index].num_dst, h, host=host)
                    out[rows if isinstance(rows, slice) else rows.to(out.device)] = h.to(out.device)
                    del h
                stored.append(out)
                projected.append(None if self.affine[index] else z_all)  # an affine layer's backward does not read z
                h_prev, z_all = out, None
        return stored, projected

    def loss_backward(self, stored: list[Tensor | None], labels: Tensor,
                      output_nodes: Tensor) -> tuple[Tensor, StepResult]:
        """The loss ``Σ CE / |V|`` of the logits ``stored[-1]`` (then freed) and its gradient ``∂L/∂h_L``,
        with the loss and the number of correctly classified outputs.

        Raises:
            NonFiniteLossError: the loss is NaN or infinite.
        """
        logits = stored[-1].requires_grad_()
        y = labels[output_nodes].to(self.device)
        loss = F.cross_entropy(logits, y, reduction="sum") / output_nodes.numel()
        if not torch.isfinite(loss):
            raise NonFiniteLossError(f"loss is {loss.item()}")
        loss.backward()
        stored[-1] = None  # the logits and their gradient die with this frame (and loss's graph)
        return logits.grad, StepResult(loss.item(), int((logits.detach().argmax(1) == y).sum()))

    def backward(self, stored: list[Tensor | None], projected: list[Tensor | None], labels: Tensor,
                 output_nodes: Tensor) -> StepResult:
        """The loss (:meth:`loss_backward`), then layers L … 1: each layer frees its ``h_l`` (``stored``) and
        ``z`` (``projected``), recomputes its chunks with autograd and backpropagates their rows
        (:meth:`chunks_backward`), frees ``∂L/∂h_l``, then backpropagates a projected layer's projection; a layer
        run off the whole block (:meth:`runs_rows`) recomputes nothing: the aggregation's transpose, then
        :meth:`projection_backward` before ``∂L/∂h_l`` is freed. ``∂L/∂h_{l−1}`` is the next layer's ``grad_out``.
        Returns the loss and the correct outputs."""
        grad_out, result = self.loss_backward(stored, labels, output_nodes)
        for index in range(self.last, -1, -1):
            if self.affine[index] and index < self.last:  # the stack's ReLU backward, from h_l (chunks skip the ReLU)
                relu_backward_(grad_out, stored[index], len(self.chunks.layers[index]))
            stored[index] = None  # h_l: each chunk's recompute makes what its backward needs
            h_prev = stored[index - 1] if index > 0 else None
            grad_in = torch.zeros_like(h_prev, device=self.device) if h_prev is not None else None  # on the device
            z_all = projected[index]
            projected[index] = None
            grad_rows = grad_in  # ∂L/∂z for a projected layer
            if self.projects[index]:
                grad_rows = torch.zeros(self.blocks[index].num_src, self.model.layers[index].projected_width,
                                        device=self.device, dtype=self.dtype)
            self.chunks_backward(index, grad_out, h_prev, z_all, grad_rows, grad_in)
            z_all = None
            if self.runs_rows(index):  # the parameters' gradients from ∂L/∂z and ∂L/∂h_l, nothing recomputed
                self.projection_backward(index, h_prev, grad_rows, grad_out, grad_in)
            grad_out = None  # ∂L/∂h_l: its chunks are done
            if self.projects[index] and not self.runs_rows(index):
                self.project(index, h_prev, grad_rows, grad_in)
            del grad_rows
            grad_out = grad_in
        return result

    def chunks_backward(self, index: int, grad_out: Tensor, h_prev: Tensor | None, z_all: Tensor | None,
                        grad_rows: Tensor | None, grad_in: Tensor | None) -> None:
        """Layer ``index``'s chunks, each recomputed with autograd and backpropagated from its rows of
        ``grad_out``: parameter gradients into ``.grad``, the input rows' gradients into ``grad_rows``
        (``∂L/∂z`` for a projected layer, else ``∂L/∂h_{l−1}``) and the dst input rows' into ``grad_in``. A layer
        run off the whole block (:meth:`runs_rows`) only adds ``Aᵀ·∂L/∂h_l`` into ``grad_rows``, row block by row
        block, recomputing nothing."""
        if self.runs_rows(index):  # ∂L/∂z by the aggregation's transpose; the rest in projection_backward
            for begin, end in self.pieces(index):
                self.model.layers[index].propagate_rows_backward(self.blocks[index], begin, grad_out[begin:end],
                                                                 grad_rows)
            return
        for chunk in self.chunks.layers[index]:
            h, rows, src_index, h_dst, block = self.chunk_step(index, chunk, h_prev, z_all, grad=True)
            h.backward(grad_out[chunk.dst.to(self.device)])
            if grad_rows is not None:
                grad_rows.index_add_(0, src_index.to(self.device), rows.grad)
            if h_dst is not None and grad_in is not None:
                grad_in.index_add_(0, chunk.dst.to(self.device), h_dst.grad)
            del h, rows, src_index, h_dst, block

    def pieces(self, index: int) -> list[Chunk] | list[tuple[int, int]]:
        """What layer ``index`` runs a piece at a time: its chunks, or, for a layer that runs off the whole block
        (:meth:`runs_rows`), as many contiguous dst row blocks (:func:`~estimator.layerwise.row_blocks`), whose
        rows of ``h_{l−1}``, ``∂L/∂h_l`` and ``h_l`` are views."""
        chunks = self.chunks.layers[index]
        return row_blocks(self.blocks[index].num_dst, len(chunks)) if self.runs_rows(index) else chunks

    def rows_forward(self, index: int, begin: int, end: int, h_prev: Tensor | None, z_all: Tensor) -> Tensor:
        """An affine layer's dst rows ``[begin, end)`` without autograd, off the whole block (:meth:`runs_rows`):
        their input rows (with the stack's dropout) when the layer reads them, ``propagate_rows`` on ``z_all``,
        and the stack's ReLU below the output layer. Returns the rows' output."""
        h_dst, dst_nodes = self.dst_rows(index, begin, end, h_prev)
        if h_dst is not None:
            h_dst = self.model.dropout(h_dst, dst_nodes, index, index == 0)
        h = self.model.layers[index].propagate_rows(self.blocks[index], begin, end, z_all, h_dst)
        return F.relu(h) if index < self.last else h

    def dst_rows(self, index: int, begin: int, end: int, h_prev: Tensor | None) -> tuple[Tensor | None, Tensor]:
        """Dst rows ``[begin, end)`` of layer ``index`` run off the whole block: their input rows (gathered features
        at the input layer, a view of ``h_{l−1}`` above it; ``None`` when the layer does not read them) and their
        node ids (a view of the block's src ids)."""
        dst_nodes = self.blocks[index].src_nodes[begin:end]
        if not self.model.layers[index].reads_dst_input:
            return None, dst_nodes
        return self.layer_input(index, dst_nodes, slice(begin, end), h_prev), dst_nodes

    def layer_input(self, index: int, nodes: Tensor, positions: slice | Tensor, h_prev: Tensor | None) -> Tensor:
        """Rows of the layer's input for ``nodes`` (global ids) at ``positions`` among the block's src nodes:
        gathered features (layer 1, a fresh tensor) or rows of ``h_{l−1}`` (a view for a slice of a
        device-resident ``h_{l−1}``)."""
        if index == 0:
            with record_function(GATHER):
                return self.store.gather(nodes, self.device)
        if isinstance(positions, Tensor):
            positions = positions.to(h_prev.device)
        return h_prev[positions].to(self.device, non_blocking=True)  # host-resident h_l: the rows are copied over

    def project(self, index: int, h_prev: Tensor | None, grad_z: Tensor | None = None,
                grad_in: Tensor | None = None) -> Tensor | None:
        """A projected layer's ``z = W·dropout(h_{l−1})`` for all its src rows, block by block (one block per
        chunk, contiguous rows): returned whole (forward) or, given ``grad_z``, recomputed with autograd and
        backpropagated (parameter gradients into ``.grad``, input rows' gradients into ``grad_in``)."""
        block, layer, model = self.blocks[index], self.model.layers[index], self.model
        src_nodes = block.src_nodes.to(self.device)
        z_all = None
        if grad_z is None:
            z_all = torch.empty(block.num_src, layer.projected_width, device=self.device, dtype=self.dtype)
        for begin, end in row_blocks(block.num_src, len(self.chunks.layers[index])):
            rows = self.layer_input(index, src_nodes[begin:end], slice(begin, end), h_prev)
            if grad_z is not None and index > 0:
                rows = rows.detach().requires_grad_()
            z = layer.project(model.dropout(rows, src_nodes[begin:end], index, index == 0))
            if grad_z is None:
                z_all[begin:end] = z
            else:
                z.backward(grad_z[begin:end])
                if grad_in is not None:  # it may hold the dst rows' gradients of a self term already
                    grad_in[begin:end] += rows.grad
            del rows, z
        return z_all

    def projection_backward(self, index: int, h_prev: Tensor | None, grad_z: Tensor, grad_out: Tensor,
                            grad_in: Tensor | None) -> None:
        """An affine layer's backward off the whole block (:meth:`runs_rows`), nothing recomputed: block by block
        of its src rows (one block per chunk, contiguous rows), their input rows with the stack's dropout, the
        layer's ``projection_backward`` from their rows of ``∂L/∂z`` (``grad_z``) and, for the dst nodes among them
        (a block's first src nodes), of ``∂L/∂h_l`` (``grad_out``, the stack's ReLU applied); the input rows'
        gradient, through the dropout's backward, is added into ``grad_in`` (``∂L/∂h_{l−1}``; ``None`` at the
        input layer)."""
        block, layer, model = self.blocks[index], self.model.layers[index], self.model
        src_nodes = block.src_nodes.to(self.device)
        for begin, end in row_blocks(block.num_src, len(self.chunks.layers[index])):
            nodes = src_nodes[begin:end]
            with torch.no_grad():
                rows = model.dropout(self.layer_input(index, nodes, slice(begin, end), h_prev), nodes, index,
                                     index == 0)
            grad_dst = grad_out[min(begin, block.num_dst):min(end, block.num_dst)]
            grad_rows = layer.projection_backward(rows, grad_z[begin:end], grad_dst, grad_in is not None)
            del rows
            if grad_rows is not None:
                grad_in[begin:end] += model.dropout.backward_(grad_rows, nodes, index)
            del grad_rows

    def chunk_step(self, index: int, chunk: Chunk, h_prev: Tensor | None, z_all: Tensor | None,
                   grad: bool) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None, Block]:
        """One chunk's one-layer step: its slice and sub-block (made now, freed with the chunk), its input
        rows and its output rows. Returns the output rows, the input rows (``None`` at a plain input layer,
        whose gather input dropout may overwrite), the input rows' positions among the block's src nodes,
        the dst input rows (or ``None``) and the sub-block (the caller holds it until the chunk ends)."""
        piece = chunk.slice(self.blocks[index])
        block = self.blocks[index].restrict(piece).to(self.device)
        src_index = piece.src_index
        del piece  # its edge ids: the sub-block holds the rest
        if self.projects[index]:
            h, rows, h_dst = self._projected_chunk_step(index, chunk, block, src_index, h_prev, z_all, grad)
            return h, rows, src_index, h_dst, block
        if index == 0:  # a fresh gather: input dropout may overwrite it
            h = self.model.layer_forward(0, block, self.layer_input(0, block.src_nodes, src_index, None),
                                         consume_input=True)
            return h, None, src_index, None, block
        rows = self.layer_input(index, block.src_nodes, src_index, h_prev)
        if grad:
            rows.requires_grad_()
        return self.model.layer_forward(index, block, rows), rows, src_index, None, block

    def _projected_chunk_step(self, index: int, chunk: Chunk, block: Block, src_index: Tensor, h_prev: Tensor | None,
                              z_all: Tensor | None, grad: bool) -> tuple[Tensor, Tensor, Tensor | None]:
        """:meth:`chunk_step` of a projected layer: its input rows are rows of ``z`` (zeros in an affine layer's
        backward, whose gradients do not read z's values), plus the dst nodes' rows of ``h_{l−1}`` or features
        when the layer reads them; its output rows are before the stack's ReLU in an affine layer's backward
        (whose ``∂L/∂h_l`` has it applied already). Returns the output rows, the rows of ``z`` and the dst
        input rows (or ``None``)."""
        model, layer = self.model, self.model.layers[index]
        if z_all is not None:
            rows = z_all[src_index.to(self.device)]
        else:
            rows = torch.zeros(src_index.numel(), layer.projected_width, device=self.device, dtype=self.dtype)
        if grad:
            rows.requires_grad_()
        h_dst = None
        if layer.reads_dst_input:  # e.g. SAGE mean's W_self·h_d
            dst_nodes = block.src_nodes[: block.num_dst]
            h_dst = self.layer_input(index, dst_nodes, chunk.dst, h_prev)
            if grad and index > 0:
                h_dst.requires_grad_()
            h = layer.propagate(block, rows, model.dropout(h_dst, dst_nodes, index, index == 0))
        else:
            h = layer.propagate(block, rows)
        relu = index < self.last and not (grad and self.affine[index])
        return (F.relu(h) if relu else h), rows, h_dst


def output_storage(rows: int, like: Tensor, host: bool) -> Tensor:
    """Where a layer's output ``h_l`` is kept: like ``like`` on its device, or (``host``) in host memory,
    page-locked when CUDA is available. (A chunk's rows are gathered by indexing, which makes a pageable
    tensor, so their copy to the device is synchronous; a pinned staging buffer would make it asynchronous.)

    Shapes:
        ``(rows, like.shape[1])``, ``like``'s dtype.
    """
    if not host:
        return like.new_empty(rows, like.shape[1])
    return torch.empty(rows, like.shape[1], dtype=like.dtype, device="cpu", pin_memory=torch.cuda.is_available())


def relu_backward_(grad: Tensor, output: Tensor, parts: int) -> None:
    """``grad ⊙ 1{output > 0}`` in place, ``parts`` row blocks at a time (one boolean block of
    ``output``'s rows alive at once, made where ``output`` lives and copied to ``grad``'s device): ReLU's
    backward from its output ``output = ReLU(x)``, which is positive exactly where ``x`` is (the zeros it
    writes equal the ones ReLU's own backward writes).

    Shapes:
        ``grad`` and ``output``: the same ``(rows, F)``; float.
    """
    for begin, end in row_blocks(grad.shape[0], parts):
        grad[begin:end].masked_fill_((output[begin:end] <= 0).to(grad.device), 0)


def measure_layerwise_step(model: LayerStack, optimizer: torch.optim.Optimizer, plan: LayerwisePlan,
                           features: FeatureStore, labels: Tensor, device: torch.device) -> MeasuredPeak:
    """Run one layer-wise training step of ``plan`` (then ``optimizer.step()``) and return its measured peak
    (:func:`estimator.measure.measure_peak`), what :func:`estimator.layerwise.estimate_layerwise` estimates.

    This is a real step: it updates the model and the optimizer state. Every parameter starts with a zero
    gradient (resident, as the estimate counts it). CPU ``resident``: the model state, those gradients, the
    batch's blocks and the chunks' dst nodes and pointers (each chunk's slice is made when it runs).

    Args:
        model, optimizer: the model on ``device`` (its dropout key set) and an optimizer over its parameters.
        plan: the batch and its chunks.
        features: the feature store (or an ``(N, F)`` float tensor) the input rows are gathered from.
        labels: ``(N,)`` int64 labels.
        device: ``cpu`` or ``cuda``.

    Returns:
        The :class:`~estimator.measure.MeasuredPeak` (bytes).

    Raises:
        ValueError: the model cannot run layer by layer, or a device other than CPU or CUDA.
        NonFiniteLossError: the loss is NaN or infinite.
        RuntimeError: a torch profiler is already running (CPU).
    """
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    resident = training_state(model, optimizer) + [parameter.grad for parameter in model.parameters()]
    resident += [t for block in plan.batch.blocks for t in (block.src_nodes, block.indptr, block.indices,
                                                             block.edge_weight) if t is not None]
    resident += [t for layer in plan.chunks.layers for chunk in layer for t in (chunk.dst, chunk.indptr)]

    def step() -> None:
        layerwise_backward(model, plan.batch, plan.chunks, features, labels, device)
        optimizer.step()

    return measure_peak(step, device, resident)
