"""The single-layer LSTM of GraphSAGE's ``lstm`` aggregator, unrolled over time in plain tensor ops."""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor, nn

from estimator.tape import AGG, GRAD, SharedGradient, StepTape


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

# ----- memory terms (estimator.tape): what the code above allocates, op by op -----------------------
# The closed-form estimate replays these; tests/test_estimator.py checks them against measured peaks,
# so a change to the code above without its terms here fails there.


def lstm_terms(tape: StepTape, seq: int, rows: int, length: int, a: int, hidden: int, grads: dict[str, SharedGradient]):
    """One in-degree group through :class:`~betty_trainer.models.lstm.LSTM`: ``length`` steps on
    ``rows`` sequences (``seq``: their gathered ``(B, L, a)`` inputs). Per step autograd keeps
    the step's input view, the activated gates, the cell state, ``tanh(c)`` and ``h``. Returns
    (final hidden state, backward); backward takes the final state's gradient, whether the
    input gradient is needed and whether to free the final state's gradient once used, and
    returns the per-step input gradients (none without ``x_grad``);
    ``grads`` holds the :class:`SharedGradient` of ``W_ih``, ``W_hh`` and ``b``."""
    r, f = tape.r, tape.f
    u, g4 = rows * hidden * f, 4 * rows * hidden * f
    h, saved = _lstm_forward_terms(tape, seq, length, u, g4)

    def backward(grad_h: int, x_grad: bool, free_grad_h: bool) -> list[int]:
        grad_x, grad_c = [], None
        for t in reversed(range(length)):
            i, g, o, f_sig, tanh_c, c_prev, h_prev = saved[t]
            grad_o, grad_tanh = r.alloc(u, GRAD), r.alloc(u, GRAD)  # MulBackward of o · tanh(c)
            if t < length - 1 or free_grad_h:
                r.drop(grad_h)
            from_tanh = r.alloc(u, GRAD)  # TanhBackward
            r.drop(grad_tanh, tanh_c)
            if grad_c is None:
                grad_c = from_tanh
            else:  # summed in place into the gradient the next step sent
                r.drop(from_tanh)
            grad_f_pre = None
            if t > 0:  # AddcmulBackward: (grad · 1) · other, for f_sigmoid and for c_prev
                scaled = r.alloc(u, GRAD)
                grad_f = r.alloc(u, GRAD)
                r.drop(scaled)
                scaled = r.alloc(u, GRAD)
                grad_c_prev = r.alloc(u, GRAD)
                r.drop(scaled, c_prev)
                grad_f_pre = r.alloc(u, GRAD)  # SigmoidBackward of f
                r.drop(grad_f, f_sig)
            grad_i, grad_g = r.alloc(u, GRAD), r.alloc(u, GRAD)  # MulBackward of i · g
            r.drop(grad_c)
            grad_o_pre = r.alloc(u, GRAD)
            r.drop(grad_o, o)
            grad_g_pre = r.alloc(u, GRAD)
            r.drop(grad_g, g)
            grad_i_pre = r.alloc(u, GRAD)
            r.drop(grad_i, i)
            if grad_f_pre is None:  # SplitBackward fills the unused forget gate's gradient with zeros
                grad_f_pre = r.alloc(u, GRAD)
            grad_gates = r.alloc(g4, GRAD)  # SplitBackward: cat
            r.drop(grad_i_pre, grad_f_pre, grad_g_pre, grad_o_pre)
            if t > 0:  # AddmmBackward of + h W_hh
                grad_h = r.alloc(u, GRAD)
                made = r.alloc(hidden * 4 * hidden * f, GRAD)
                r.drop(h_prev)
                grads["W_hh"].add(made, hidden * 4 * hidden * f)
            if x_grad:  # AddmmBackward of x_t W_ih + b
                grad_x.append(r.alloc(rows * a * f, GRAD))
            made = r.alloc(a * 4 * hidden * f, GRAD)
            bias = r.alloc(4 * hidden * f, GRAD)
            r.drop(grad_gates)
            grads["b"].add(bias, 4 * hidden * f)
            grads["W_ih"].add(made, a * 4 * hidden * f)
            r.drop(seq)
            grad_c = grad_c_prev if t > 0 else None
        return grad_x

    return h, backward


def _lstm_forward_terms(tape: StepTape, seq: int, length: int, u: int, g4: int) -> tuple[int, list[tuple]]:
    """The forward of :func:`lstm_terms`: ``length`` steps of ``u``-byte states and ``g4``-byte gates. Returns
    the final hidden state's handle and, per step, the handles autograd keeps
    ``(i, g, o, f_sigmoid, tanh_c, c_prev, h_prev)`` (``f_sigmoid`` is ``None`` at step 0)."""
    r = tape.r
    saved = []  # per step: (i, g, o, f_sigmoid, tanh_c, c_prev, h_prev)
    gates = h = c = None
    kept = r.saving  # False under torch.no_grad (a layer-wise forward): temporaries die as Python lets go
    for t in range(length):
        first = r.alloc(g4, AGG)  # x_t W_ih + b
        r.save(seq)  # AddmmBackward keeps x_t, a view of seq
        if t > 0:
            second = r.alloc(g4, AGG)  # + h W_hh, keeps h
            r.drop(first, gates)  # the previous gates die when f is rebound to a view of these
            first = second
        gates = first
        if not kept and saved:  # i, g, o rebound to views of the new gates: the previous activations die
            r.drop(*saved[-1][:3])
        i, g, o = (r.alloc(u, AGG) for _ in range(3))
        if t == 0:
            c_new, f_sig = r.alloc(u, AGG), None
        else:
            product = r.alloc(u, AGG)  # i * g
            f_sig = r.alloc(u, AGG)
            c_new = r.alloc(u, AGG)  # addcmul keeps f_sigmoid and the previous c
            r.drop(product)
            if not kept:
                r.drop(f_sig, c)
        tanh_c = r.alloc(u, AGG)
        h_new = r.alloc(u, AGG)
        if not kept:
            r.drop(tanh_c, h)
        saved.append((i, g, o, f_sig, tanh_c, c, h))
        h, c = h_new, c_new
    r.drop(c, gates)  # the last cell state and gates die with the function
    if not kept:
        r.drop(*saved[-1][:3])
    return h, saved
