"""The single-layer LSTM of GraphSAGE's ``lstm`` aggregator, unrolled over time in plain tensor ops."""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor, nn


class LSTM(nn.Module):
    """A one-layer LSTM (Hochreiter & Schmidhuber 1997, with PyTorch's gate equations) that returns
    the final hidden state, starting from zero hidden and cell states.

    Per step ``t`` with input ``x_t``::

        i, f, g, o = split(x_t W_ih + h_{t−1} W_hh + b)        (gate order of torch.nn.LSTM)
        c_t = σ(f) ⊙ c_{t−1} + σ(i) ⊙ tanh(g)
        h_t = σ(o) ⊙ tanh(c_t)

    It computes what ``torch.nn.LSTM`` computes with ``weight_ih_l0 = weight_ihᵀ``,
    ``weight_hh_l0 = weight_hhᵀ`` and ``bias_ih_l0 + bias_hh_l0 = bias`` (one bias: the
    two are redundant). The loop is written out rather than calling the fused kernel
    because the fused kernels (oneDNN on CPU, cuDNN on CUDA) keep a workspace whose size
    is implementation-defined; written out, every tensor the step allocates is known,
    which is what lets ``estimator`` bound a micro-batch's memory (Betty §4.4.3, Eq. 5).
    Per step autograd keeps the four activated gates, the cell state, ``tanh(c_t)`` and
    ``h_t``: ``7 · B · H`` elements. The weights are stored ``(in, 4H)`` so that the
    per-step weight gradients sum in place.

    Args:
        input_size: input width ``F``.
        hidden_size: hidden width ``H``.

    Shapes:
        ``steps``: ``L ≥ 1`` tensors ``(B, F)`` (views of one ``(B, L, F)`` tensor, e.g. from
        ``unbind(1)``) → ``(B, H)``.

    Raises:
        ValueError: from ``forward`` when ``steps`` is empty.
    """

    def __init__(self, input_size: int, hidden_size: int):
        super().__init__()
        self.input_size, self.hidden_size = input_size, hidden_size
        self.weight_ih = nn.Parameter(torch.empty(input_size, 4 * hidden_size))
        self.weight_hh = nn.Parameter(torch.empty(hidden_size, 4 * hidden_size))
        self.bias = nn.Parameter(torch.empty(4 * hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``U(−1/√H, 1/√H)`` for every parameter, as ``torch.nn.LSTM``."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for parameter in self.parameters():
            nn.init.uniform_(parameter, -bound, bound)

    def forward(self, steps: Sequence[Tensor]) -> Tensor:
        if not steps:
            raise ValueError("an LSTM needs at least one step")
        h = c = None
        for x in steps:
            gates = torch.addmm(self.bias, x, self.weight_ih)
            if h is not None:  # h_0 = 0 adds nothing
                gates = torch.addmm(gates, h, self.weight_hh)
            i, f, g, o = gates.chunk(4, 1)
            i, g, o = i.sigmoid(), g.tanh(), o.sigmoid()
            c = i * g if c is None else torch.addcmul(i * g, f.sigmoid(), c)  # c_0 = 0: no forget gate
            h = o * c.tanh()
        return h

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}"
