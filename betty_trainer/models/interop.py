"""Adaptors that let a model written for DGL's or PyG's mini-batches train through betty-trainer's micro-batches.

betty-trainer calls a model as ``model(blocks, x)``: ``blocks`` the ``L`` :class:`~betty_trainer.data.block.Block`\\ s
of one micro-batch (input layer first), ``x`` the ``(blocks[0].num_src, F)`` input features, and it expects the
``(blocks[-1].num_dst, C)`` logits of the micro-batch's output nodes. DGL's and PyG's node-classification models
take the same information in their own types; each adaptor converts the blocks and calls the wrapped module
unchanged. Neither imports DGL or PyG: :meth:`Block.to_dgl` imports DGL when it is called, and PyG's layers need
nothing but tensors.

Micro-batching stays exact (Betty §4.2.3: the micro-batches' gradients sum to the full batch's) for any model
whose output for a node depends only on its sampled neighbourhood, as message passing does. ``torch.nn.Dropout``
is the exception: each micro-batch draws its own masks (the trainer warns). A DGL model can use
:class:`~betty_trainer.models.dropout.NodeDropout` keyed by ``block.srcdata[dgl.NID]`` instead, whose mask is the
same for a node in every micro-batch.
"""

from __future__ import annotations

from torch import Tensor, nn

from betty_trainer.data.block import Block


class DGLModel(nn.Module):
    """A model written for DGL blocks (``forward(blocks, x)`` with ``dgl.Block``\\ s, as in DGL's GraphSAGE
    example) as a betty-trainer model.

    ``forward(blocks, x)`` converts every block with :meth:`Block.to_dgl` (global ids in
    ``srcdata``/``dstdata[dgl.NID]``, edge weights of LABOR/GNS in ``edata["w"]``) and returns
    ``module(dgl_blocks, x)``.

    Args:
        module: an ``nn.Module`` whose ``forward(blocks: list[dgl.Block], x: Tensor) -> Tensor`` returns the
            logits of the last block's dst nodes.

    Shapes:
        ``x`` ``(blocks[0].num_src, F)`` → ``(blocks[-1].num_dst, C)``.

    Raises:
        ImportError: at the first forward, if DGL is not installed.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, blocks: list[Block], x: Tensor) -> Tensor:
        return self.module([block.to_dgl() for block in blocks], x)


class PyGModel(nn.Module):
    """A model written for PyG's ``NeighborSampler`` layers (``forward(x, adjs)``, as in PyG's GraphSAGE
    examples on Reddit and ogbn-products) as a betty-trainer model.

    ``forward(blocks, x)`` returns ``module(x, [block.to_pyg() for block in blocks])``: one
    :class:`~betty_trainer.data.block.PyGAdj` ``(edge_index, e_id, size)`` per block, input layer first, whose dst
    nodes are the first ``size[1]`` src nodes, so the usual layer call is
    ``conv((x, x[: size[1]]), edge_index)`` (:meth:`Block.pyg_inputs` builds these arguments). ``e_id`` is
    ``None``; the edge weights of LABOR/GNS blocks are not passed.

    Args:
        module: an ``nn.Module`` whose ``forward(x: Tensor, adjs: list[PyGAdj]) -> Tensor`` returns the logits
            of the last block's dst nodes.

    Shapes:
        ``x`` ``(blocks[0].num_src, F)`` → ``(blocks[-1].num_dst, C)``.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, blocks: list[Block], x: Tensor) -> Tensor:
        return self.module(x, [block.to_pyg() for block in blocks])


class DGLLayer(nn.Module):
    """One ``dgl.nn`` layer (e.g. ``dgl.nn.SAGEConv``) as a layer of a
    :class:`~betty_trainer.models.stack.LayerStack`: ``forward(block, h_src)`` returns
    ``conv(block.to_dgl(), h_src)``. Built into a stack, the DGL layers get the stack's ReLU and its node-keyed
    dropout (exact under micro-batching) and run layer by layer in evaluation.

    Args:
        conv: a ``dgl.nn`` layer whose ``forward(block, h_src)`` takes a ``dgl.Block`` and its src features.

    Shapes:
        ``h_src`` ``(block.num_src, F_in)`` → ``(block.num_dst, F_out)``.

    Raises:
        ImportError: at the first forward, if DGL is not installed.
    """

    def __init__(self, conv: nn.Module):
        super().__init__()
        self.conv = conv

    def forward(self, block: Block, h_src: Tensor) -> Tensor:
        return self.conv(block.to_dgl(), h_src)


class PyGLayer(nn.Module):
    """One ``torch_geometric.nn`` layer (e.g. ``SAGEConv``) as a layer of a
    :class:`~betty_trainer.models.stack.LayerStack`: ``forward(block, h_src)`` returns
    ``conv((h_src, h_src[:num_dst]), edge_index, size)`` (:meth:`Block.pyg_inputs`), PyG's bipartite call.

    Args:
        conv: a ``torch_geometric.nn`` layer that accepts a ``(x_src, x_dst)`` pair, ``edge_index`` and ``size``.

    Shapes:
        ``h_src`` ``(block.num_src, F_in)`` → ``(block.num_dst, F_out)``.
    """

    def __init__(self, conv: nn.Module):
        super().__init__()
        self.conv = conv

    def forward(self, block: Block, h_src: Tensor) -> Tensor:
        return self.conv(*block.pyg_inputs(h_src))
