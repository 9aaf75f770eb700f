"""Built-in models operating on blocks, and node-keyed dropout.

Any ``torch.nn.Module`` with ``forward(blocks: list[Block], x: Tensor) -> Tensor``
(logits of ``blocks[-1]``'s dst nodes) trains with betty-trainer; these are the
built-in ones.
"""

from __future__ import annotations

from torch import nn

from betty_trainer.data.graph import Graph
from betty_trainer.models.dropout import NodeDropout, keyed_bits, keyed_uniform, set_dropout_key
from betty_trainer.models.gat import GAT, GATConv
from betty_trainer.models.gcn import GCN, GCNConv
from betty_trainer.models.sage import GraphSAGE, SAGEConv


def build_model(config, graph: Graph) -> nn.Module:
    """The built-in model a :class:`~betty_trainer.config.ModelConfig` describes, sized for ``graph``.

    ``arch`` picks :class:`GraphSAGE` (with ``aggregator``), :class:`GCN` or :class:`GAT`
    (``hidden`` is then the width per head, ``heads`` the number of heads).
    """
    if config.arch == "sage":
        return GraphSAGE(graph.num_features, config.hidden, graph.num_classes, config.num_layers,
                         config.aggregator, config.dropout)
    if config.arch == "gat":
        return GAT(graph.num_features, config.hidden, graph.num_classes, config.num_layers, config.heads,
                   config.dropout)
    return GCN(graph.num_features, config.hidden, graph.num_classes, graph.in_degrees(),
               config.num_layers, config.dropout)


__all__ = ["GAT", "GATConv", "GCN", "GCNConv", "GraphSAGE", "NodeDropout", "SAGEConv", "build_model", "keyed_bits",
           "keyed_uniform", "set_dropout_key"]
