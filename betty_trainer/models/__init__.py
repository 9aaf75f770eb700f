"""Built-in models operating on blocks, and node-keyed dropout.

Any ``torch.nn.Module`` with ``forward(blocks: list[Block], x: Tensor) -> Tensor``
(logits of ``blocks[-1]``'s dst nodes) trains with betty-trainer; these are the
built-in ones. Importing the package imports every module in it, so each built-in
architecture's file registers it (:mod:`betty_trainer.models.registry`): SAGE, GCN
and GAT first, in that order, then the others by file name.
"""

from __future__ import annotations

import importlib
import pkgutil

from torch import nn

from betty_trainer.data.graph import Graph
from betty_trainer.models.dropout import NodeDropout, keyed_bits, keyed_uniform, set_dropout_key
from betty_trainer.models.gat import GAT, GATConv
from betty_trainer.models.gcn import GCN, GCNConv
from betty_trainer.models.registry import ARCHITECTURES, Architecture, architecture_of
from betty_trainer.models.sage import GraphSAGE, SAGEConv

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def build_model(config, graph: Graph) -> nn.Module:
    """The built-in model a :class:`~betty_trainer.config.ModelConfig` section describes, sized for ``graph``:
    the :attr:`~betty_trainer.models.registry.Architecture.build` of the architecture ``config.arch`` names
    (e.g. :class:`GraphSAGE` with ``aggregator``, :class:`GCN`, :class:`GAT` with ``hidden`` the width per head)."""
    return ARCHITECTURES[config.arch].build(config, graph)


__all__ = ["ARCHITECTURES", "GAT", "GATConv", "GCN", "GCNConv", "Architecture", "GraphSAGE", "NodeDropout",
           "SAGEConv", "architecture_of", "build_model", "keyed_bits", "keyed_uniform", "set_dropout_key"]
