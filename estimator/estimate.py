"""Closed-form memory estimate of one micro-batch training step (Betty §4.4.3, Table 3, Eq. 5).

The estimate follows the tensors the built-in models allocate, op by op, as a
function of the micro-batch's counts (Betty Table 3: N_in, H_in, N_out, E, h, L_i,
B_i) and the model's widths: each op's output, what autograd saves for backward,
the op's own temporaries, and in backward each gradient as it is made and freed.
Replaying those allocations and frees in order gives the peak (DESIGN.md: static +
max(forward-live, backward-live)) and what is live at that moment, by component.
No tensor is allocated; the cost is O(layers), or for the LSTM aggregator O(Σ of the
distinct in-degrees), one replayed step per LSTM step.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

from estimator.counts import INDEX_BYTES, LayerCounts, block_structure_bytes
from estimator.spec import OPTIMIZER_STATES, ModelSpec

COMPONENTS = (
    "parameters",
    "optimizer_state",
    "block_structure",
    "input_features",
    "labels",
    "hidden_outputs",
    "dropout_masks",
    "aggregator_intermediates",
    "gradients",
    "framework_overheads",
)



@dataclass(frozen=True)
class MemoryEstimate:
    """An itemised estimate in bytes.

    Attributes:
        peak_bytes: estimated peak of live bytes during the step (resident included).
        at_peak: bytes per component (:data:`COMPONENTS`) live at the peak; sums to ``peak_bytes``.
        totals: bytes per component allocated at some point in the step (not simultaneously).
        forward_peak_bytes, backward_peak_bytes: the peak within each phase.
        resident_bytes: bytes live before the step (parameters, optimizer state, blocks).
    """

    peak_bytes: int
    at_peak: dict[str, int]
    totals: dict[str, int]
    forward_peak_bytes: int
    backward_peak_bytes: int
    resident_bytes: int


class _Replay:
    """Live-byte bookkeeping with reference counts: a tensor is freed when its last holder
    (a Python variable, or autograd keeping it for backward) lets go; tracks the peak."""

    def __init__(self) -> None:
        self.live: dict[int, list] = {}  # handle → [bytes, component, references]
        self.by_component: dict[str, int] = defaultdict(int)
        self.totals: dict[str, int] = defaultdict(int)
        self.current = self.peak = 0
        self.at_peak: dict[str, int] = {}
        self.phase_peak: dict[str, int] = defaultdict(int)
        self.phase = "resident"
        self._next = 0

    def alloc(self, nbytes: float, component: str) -> int:
        """A new tensor held by one reference."""
        nbytes = int(nbytes)
        handle, self._next = self._next, self._next + 1
        self.live[handle] = [nbytes, component, 1]
        self.by_component[component] += nbytes
        self.totals[component] += nbytes
        self.current += nbytes
        self.phase_peak[self.phase] = max(self.phase_peak[self.phase], self.current)
        if self.current > self.peak:
            self.peak = self.current
            self.at_peak = dict(self.by_component)
        return handle

    def keep(self, *handles: int | None) -> None:
        """One more holder (e.g. autograd saving the tensor for backward)."""
        for handle in handles:
            if handle is not None:
                self.live[handle][2] += 1

    def drop(self, *handles: int | None) -> None:
        """One holder fewer; frees the tensor when none is left."""
        for handle in handles:
            if handle is None:
                continue
            entry = self.live[handle]
            entry[2] -= 1
            if entry[2] == 0:
                del self.live[handle]
                self.by_component[entry[1]] -= entry[0]
                self.current -= entry[0]

    def transient(self, nbytes: float, component: str) -> None:
        """An op's temporary: allocated and freed within the op."""
        self.drop(self.alloc(nbytes, component))


class _SharedGradient:
    """The gradient of a parameter used many times in one backward (the LSTM's weights, once per
    step): autograd sums the contributions in a buffer (the first one made; later ones are
    added in place and freed, except that the ``out_of_place_at``-th is added out of place)
    and, after the last one, hands it to ``.grad``, or when accumulating adds it into
    ``.grad`` and frees it."""

    def __init__(self, replay: _Replay, uses: int, accumulating: bool, out_of_place_at: int = 0):
        self.r, self.remaining, self.accumulating, self.out_of_place_at = replay, uses, accumulating, out_of_place_at
        self.buffer: int | None = None
        self.count = 0

    def add(self, made: int, nbytes: int) -> None:
        self.count += 1
        if self.buffer is None:
            self.buffer = made
        elif self.count == self.out_of_place_at:
            total = self.r.alloc(nbytes, _GRAD)
            self.r.drop(self.buffer, made)
            self.buffer = total
        else:
            self.r.drop(made)
        self.remaining -= 1
        if self.remaining == 0 and self.accumulating:
            self.r.drop(self.buffer)


_AGG = "aggregator_intermediates"
_HID = "hidden_outputs"
_GRAD = "gradients"
_DROP = "dropout_masks"
_OVER = "framework_overheads"


class _Step:
    """Emits the allocations of one training step of a built-in model into a :class:`_Replay`.

    Each ``*_forward`` mirrors the model's code op by op: ``alloc`` for an op's output,
    ``keep`` where autograd saves a tensor for backward, ``drop`` when a Python variable
    goes out of scope. It returns the output and a closure emitting that piece's backward,
    which receives the output's gradient and returns the input's (or ``None``).
    """

    def __init__(self, replay: _Replay, model: ModelSpec, accumulate: bool):
        self.r, self.model, self.f, self.accumulating = replay, model, model.dtype_bytes, accumulate
        self.pending: list[int] = []

    def param_grad(self, numel: int) -> int:
        """A parameter's gradient, made by a backward node. It becomes ``.grad`` and lives to the end
        of the step, or, when accumulating, is added into the resident ``.grad`` once the node that
        made it is done (:meth:`settle`)."""
        made = self.r.alloc(numel * self.f, _GRAD)
        if self.accumulating:
            self.pending.append(made)
        return made

    def settle(self) -> None:
        """The end of a backward node: accumulating, the gradients it made are added into ``.grad`` and freed."""
        self.r.drop(*self.pending)
        self.pending.clear()

    def accumulate(self, first: int | None, second: int | None) -> int | None:
        """Autograd summing two gradients of one tensor in place: the second is freed."""
        if first is None or second is None:
            return first if second is None else second
        self.r.drop(second)
        return first

    # ----- Block.edge_dst() and the sparse aggregation of aggregate.py ---------------------------
    def edge_dst(self, c: LayerCounts) -> int:
        r, d, e = self.r, c.num_dst, c.num_edges
        arange, degrees = r.alloc(d * INDEX_BYTES, _OVER), r.alloc(d * INDEX_BYTES, _OVER)
        cumsum = r.alloc(d * INDEX_BYTES, _OVER)
        buffer = r.alloc(e * INDEX_BYTES, _OVER)
        r.drop(cumsum)
        result = r.alloc(e * INDEX_BYTES, _AGG)
        r.drop(buffer, arange, degrees)
        return result

    def per_edge(self, c: LayerCounts) -> int:
        """aggregate.per_edge: ``repeat_interleave(per_dst, in_degrees, output_size=E)``: the degrees,
        their cumsum and the ``(E,)`` int64 positions, then the ``(E,)`` gathered values."""
        r, d, e = self.r, c.num_dst, c.num_edges
        degrees, cumsum = r.alloc(d * INDEX_BYTES, _OVER), r.alloc(d * INDEX_BYTES, _OVER)
        positions = r.alloc(e * INDEX_BYTES, _OVER)
        r.drop(cumsum)
        values = r.alloc(e * self.f, _AGG)
        r.drop(positions, degrees)
        return values

    def per_dst_scale(self, c: LayerCounts) -> int:
        """``block.in_degrees().to(dtype)`` (then scaled in place): ``(D,)`` floats."""
        degrees = self.r.alloc(c.num_dst * INDEX_BYTES, _OVER)
        scale = self.r.alloc(c.num_dst * self.f, _AGG)
        self.r.drop(degrees)
        return scale

    def mean_values(self, c: LayerCounts) -> int:
        """aggregate.mean_values: ``1/deg(d)`` per edge, or ``w_e / Σ w`` on a weighted block."""
        r = self.r
        if not c.weighted:
            inverse = self.per_dst_scale(c)
            values = self.per_edge(c)
            r.drop(inverse)
            return values
        total = r.alloc(c.num_dst * self.f, _OVER)
        edge_dst = self.edge_dst(c)
        r.drop(edge_dst)
        spread = self.per_edge(c)
        values = r.alloc(c.num_edges * self.f, _AGG)
        r.drop(spread, total)
        return values

    def csr_matmul(self, rows: int, c: LayerCounts, width: int, component: str) -> int:
        """aggregate._csr_matmul: the ``(rows, width)`` result; MKL's int32 copies of the CSR pointer and
        indices are made and freed inside ``addmm``."""
        r = self.r
        zero = r.alloc(self.f, _OVER)
        out = r.alloc(rows * width * self.f, component)
        pointer, indices = r.alloc((rows + 1) * 4, _OVER), r.alloc(c.num_edges * 4, _OVER)
        r.drop(indices, pointer, zero)
        return out

    def aggregate(self, c: LayerCounts, width: int, record: bool, values: int, self_scale: int | None = None):
        """aggregate.aggregate (one sparse matmul; autograd keeps ``values`` and ``self_scale``).
        Returns (out, backward); backward gives the ``(S, width)`` gradient of ``h_src``."""
        r = self.r
        out = self.csr_matmul(c.num_dst, c, width, _AGG)
        if record:
            r.keep(values, self_scale)

        def backward(grad: int) -> int:
            e, s = c.num_edges, c.num_src
            if self.model.compiled_kernels:  # the counting sort writes int32 pointer and positions: no copies
                transposed = [r.alloc((s + 1) * 4, _OVER), r.alloc(e * 4, _OVER), r.alloc(e * self.f, _OVER)]
                zero = r.alloc(self.f, _OVER)
                grad_src = r.alloc(s * width * self.f, _GRAD)
                r.drop(zero, *transposed, grad, values, self_scale)
                return grad_src
            order = r.alloc(e * INDEX_BYTES, _OVER)  # argsort(indices, stable): keys, order, iota
            sorting = [r.alloc(e * INDEX_BYTES, _OVER) for _ in range(2)]
            r.drop(*sorting)
            pointer = r.alloc((s + 1) * INDEX_BYTES, _OVER)
            for _ in range(2):  # bincount's min and max
                r.transient(INDEX_BYTES, _OVER)
            r.transient(s * INDEX_BYTES, _OVER)  # the counts, cumsummed into the pointer
            edge_dst = self.edge_dst(c)
            transposed = r.alloc(e * INDEX_BYTES, _OVER)  # edge_dst[order]
            r.drop(edge_dst)
            transposed_values = r.alloc(e * self.f, _OVER)  # values[order]
            grad_src = self.csr_matmul(s, c, width, _GRAD)
            r.drop(transposed_values, transposed, order, pointer, grad, values, self_scale)
            return grad_src

        return out, backward

    # ----- NodeDropout ---------------------------------------------------------------------------
    def keyed_mask(self, rows: int, width: int) -> None:
        """apply_keyed_mask's transients for one row chunk: the per-node hash (mixed through two more
        temporaries), the per-feature hash, the int64 bits and a shifted copy of them; then the
        boolean mask (the hashes and bits freed around it) and the mask as floats in the product.
        The fused CPU kernel makes none of them."""
        r = self.r
        if self.model.compiled_kernels:
            return
        chunk_rows = min(rows, max(1, self.model.mask_chunk_elements // max(width, 1)))
        node_hash = r.alloc(chunk_rows * INDEX_BYTES, _OVER)
        r.transient(2 * chunk_rows * INDEX_BYTES, _OVER)
        columns = r.alloc(width * INDEX_BYTES, _OVER)
        bits = r.alloc(chunk_rows * width * INDEX_BYTES, _DROP)
        r.transient(chunk_rows * width * INDEX_BYTES, _DROP)  # each `bits >> k`
        r.drop(node_hash, columns)
        keep = r.alloc(chunk_rows * width, _DROP)  # bool
        r.drop(bits)
        r.transient(chunk_rows * width * self.f, _DROP)  # keep.to(dtype) inside the product
        r.drop(keep)

    def dropout(self, h: int, rows: int, width: int, requires_grad: bool):
        """NodeDropout: its output, made chunk by chunk; backward remakes the mask (nothing is saved)."""
        r = self.r
        out = r.alloc(rows * width * self.f, _HID)
        self.keyed_mask(rows, width)

        def backward(grad: int) -> int:
            grad_h = r.alloc(rows * width * self.f, _GRAD)
            self.keyed_mask(rows, width)
            r.drop(grad)
            return grad_h

        return out, backward

    # ----- Linear without bias (F.linear → mm) ---------------------------------------------------
    def linear(self, x: int, rows: int, a: int, b: int, x_grad: bool, component: str = _HID):
        r = self.r
        out = r.alloc(rows * b * self.f, component)
        r.keep(x)  # MmBackward saves the input (for the weight's gradient)

        def backward(grad: int, free_grad: bool = True, x_grad: bool = x_grad) -> int | None:
            self.param_grad(a * b)
            grad_x = r.alloc(rows * a * self.f, _GRAD) if x_grad else None
            self.settle()
            r.drop(x)
            if free_grad:
                r.drop(grad)
            return grad_x

        return out, backward

    @staticmethod
    def aggregation_width(a: int, b: int, hd_grad: bool) -> tuple[bool, int, bool]:
        """``(project_first, width aggregated, record)``: layers apply their linear map before
        aggregating when ``a > b``; the aggregation is recorded by autograd when its input
        requires grad (projected, or a hidden layer's input)."""
        project_first = a > b
        return project_first, (b if project_first else a), project_first or hd_grad

    # ----- GraphSAGE (mean, gcn) -------------------------------------------------------------------
    def sage_forward(self, c: LayerCounts, hd: int, a: int, b: int, hd_grad: bool):
        r, f = self.r, self.f
        d = c.num_dst
        project_first, w, record = self.aggregation_width(a, b, hd_grad)
        h, lin_neigh_bwd = self.linear(hd, c.num_src, a, b, hd_grad, _AGG) if project_first else (hd, None)
        if self.model.aggregator == "mean":
            values, scale = self.mean_values(c), None
        else:  # gcn: 1/(deg + 1) per dst node, spread over its edges (times the edge weights in place)
            scale = self.per_dst_scale(c)
            values = self.per_edge(c)
        neigh, agg_bwd = self.aggregate(c, w, record, values, scale)
        r.drop(values, scale)
        if project_first:
            r.drop(h)  # the projected features die with the statement: the aggregation keeps none of them
            out, lin_out_bwd = neigh, None
        else:
            out, lin_out_bwd = self.linear(neigh, d, a, b, True)
            r.drop(neigh)
        self_bwd = None
        if self.model.aggregator == "mean":
            self_out, self_bwd = self.linear(hd, d, a, b, hd_grad)
            summed = r.alloc(d * b * f, _HID)
            r.drop(out, self_out)
            out = summed
        result = r.alloc(d * b * f, _HID)  # + bias
        r.drop(out)

        def backward(grad: int) -> int | None:
            self.param_grad(b)  # bias
            self.settle()
            grad_hd = None
            if self_bwd is not None:
                grad_self = self_bwd(grad, free_grad=False)
                if grad_self is not None:  # SliceBackward: zeros(S, a) then copy
                    grad_hd = r.alloc(c.num_src * a * f, _GRAD)
                    r.drop(grad_self)
            grad_neigh = lin_out_bwd(grad, True, record) if lin_out_bwd is not None else grad
            if not record:
                return grad_hd
            grad_h = agg_bwd(grad_neigh)
            if lin_neigh_bwd is not None:
                grad_h_in = lin_neigh_bwd(grad_h)
            else:
                grad_h_in = grad_h if hd_grad else r.drop(grad_h)
            return self.accumulate(grad_hd, grad_h_in)

        return result, backward

    # ----- GraphSAGE pool ---------------------------------------------------------------------------
    def segment_max(self, c: LayerCounts, width: int):
        """max_neighbours: the ``(D, w)`` maxima and their int32 argmax (kept for backward). The compiled
        kernel makes nothing else; the tensor path makes one chunk of rows' gathered values, their
        comparison and first-hit positions at a time. Returns (out, backward); backward gives the
        ``(S + 1, w)`` gradient buffer whose first ``S`` rows are ``h``'s gradient."""
        r, f = self.r, self.f
        d, s = c.num_dst, c.num_src
        out, argmax = r.alloc(d * width * f, _AGG), r.alloc(d * width * 4, _AGG)
        if not self.model.compiled_kernels:
            self.segment_max_chunks(c, width)

        def backward(grad: int) -> int:
            grad_src = r.alloc((s + 1) * width * f, _GRAD)
            if not self.model.compiled_kernels:
                r.transient(d * width * INDEX_BYTES, _GRAD)  # argmax.long() for scatter_add_
            r.drop(grad, argmax)
            return grad_src

        return out, backward

    def segment_max_chunks(self, c: LayerCounts, width: int) -> None:
        """aggregate._segment_max_chunks' temporaries: the degrees, then one chunk of rows' segment ids,
        gathered values, maxima, comparison, positions and first hits. With one chunk (the rows fit
        MAX_CHUNK_ELEMENTS) this is exact; with several, the chunk's edges are bounded by its rows'
        widest in-degrees, so the estimate is an upper bound."""
        r, f = self.r, self.f
        widest = max((length for length, _ in c.degree_histogram), default=1)
        rows = min(c.num_dst, max(1, self.model.max_chunk_elements // max(width, 1) // widest))
        edges, left = 0, rows  # one chunk's edges: all of them, or at most those of its rows' widest degrees
        for length, count in sorted(c.degree_histogram, reverse=True):
            edges, left = edges + min(count, left) * length, left - min(count, left)
        degrees = r.alloc(c.num_dst * INDEX_BYTES, _OVER)
        r.transient(INDEX_BYTES, _OVER)  # degrees.max()
        if edges == 0:
            r.drop(degrees)
            return
        ids, cumsum = r.alloc(rows * INDEX_BYTES, _OVER), r.alloc(rows * INDEX_BYTES, _OVER)
        positions = r.alloc(edges * INDEX_BYTES, _OVER)
        r.drop(cumsum)
        segment = r.alloc(edges * INDEX_BYTES, _OVER)
        r.drop(positions, ids)
        gathered = r.alloc(edges * width * f, _AGG)
        peak = r.alloc(rows * width * f, _AGG)
        peak_gathered = r.alloc(edges * width * f, _AGG)
        equal = r.alloc(edges * width, _AGG)  # bool
        r.drop(peak_gathered)
        iota = r.alloc(edges * INDEX_BYTES, _OVER)
        position = r.alloc(edges * width * INDEX_BYTES, _AGG)
        r.drop(equal, iota)
        first_hit = r.alloc(rows * width * INDEX_BYTES, _AGG)
        has_edges = r.alloc(rows, _OVER)  # bool
        clamped = r.alloc(rows * width * INDEX_BYTES, _AGG)
        chosen = r.alloc(rows * width * INDEX_BYTES, _AGG)
        r.drop(clamped)
        r.transient(rows * width * INDEX_BYTES, _AGG)  # torch.where, copied into the int32 argmax
        r.drop(chosen, segment, gathered, peak, position, first_hit, has_edges, degrees)

    def sage_combine(self, c: LayerCounts, hd: int, neigh: int, a: int, b: int, hd_grad: bool):
        """``fc_neigh(neigh) + fc_self(h[:num_dst]) + bias`` (SAGE pool and lstm). Returns (result,
        backward); backward gives (the gradient of ``h`` from the self term or ``None``, that of ``neigh``)."""
        r, f = self.r, self.f
        s, d = c.num_src, c.num_dst
        neigh_out, neigh_bwd = self.linear(neigh, d, a, b, True)
        r.drop(neigh)
        self_out, self_bwd = self.linear(hd, d, a, b, hd_grad)
        summed = r.alloc(d * b * f, _HID)
        r.drop(neigh_out, self_out)
        result = r.alloc(d * b * f, _HID)  # + bias
        r.drop(summed)

        def backward(grad: int) -> tuple[int | None, int]:
            self.param_grad(b)
            self.settle()
            grad_hd = self_bwd(grad, free_grad=False)
            if grad_hd is not None:  # SliceBackward
                sliced = r.alloc(s * a * f, _GRAD)
                r.drop(grad_hd)
                grad_hd = sliced
            return grad_hd, neigh_bwd(grad)

        return result, backward

    def sage_pool_forward(self, c: LayerCounts, hd: int, a: int, b: int, hd_grad: bool):
        r, f = self.r, self.f
        s = c.num_src
        pooled = r.alloc(s * a * f, _AGG)  # fc_pool (addmm)
        r.keep(hd)
        activated = r.alloc(s * a * f, _AGG)  # relu, saved
        r.keep(activated)
        r.drop(pooled)
        neigh, max_bwd = self.segment_max(c, a)
        r.drop(activated)
        result, combine_bwd = self.sage_combine(c, hd, neigh, a, b, hd_grad)

        def backward(grad: int) -> int | None:
            grad_hd, grad_neigh = combine_bwd(grad)
            grad_activated = max_bwd(grad_neigh)
            grad_pooled = r.alloc(s * a * f, _GRAD)  # ReluBackward
            r.drop(grad_activated, activated)
            grad_in = r.alloc(s * a * f, _GRAD) if hd_grad else None  # AddmmBackward
            self.param_grad(a * a)
            self.param_grad(a)
            self.settle()
            r.drop(grad_pooled, hd)
            return self.accumulate(grad_hd, grad_in)

        return result, backward

    # ----- GraphSAGE lstm ---------------------------------------------------------------------------
    def in_degree_groups(self, c: LayerCounts) -> int:
        """in_degree_groups: degrees, a stable argsort (kept: the groups are views of it), the sorted
        degrees and unique_consecutive's two outputs. Returns the argsort's handle."""
        r, d = self.r, c.num_dst
        degrees = r.alloc(d * INDEX_BYTES, _OVER)
        values, indices, order = (r.alloc(d * INDEX_BYTES, _OVER) for _ in range(3))
        r.drop(values, indices)
        scratch = [r.alloc(d * INDEX_BYTES, _OVER) for _ in range(3)]  # degrees[order], lengths, counts
        r.drop(degrees, *scratch)
        return order

    def lstm(self, seq: int, rows: int, length: int, a: int, hidden: int, grads: dict[str, _SharedGradient]):
        """One in-degree group through :class:`~betty_trainer.models.lstm.LSTM`: ``length`` steps on
        ``rows`` sequences (``seq``: their gathered ``(B, L, a)`` inputs). Per step autograd keeps
        the step's input view, the activated gates, the cell state, ``tanh(c)`` and ``h``. Returns
        (final hidden state, backward); backward takes the final state's gradient, whether the
        input gradient is needed and whether to free the final state's gradient once used, and
        returns the per-step input gradients (none without ``x_grad``);
        ``grads`` holds the :class:`_SharedGradient` of ``W_ih``, ``W_hh`` and ``b``."""
        r, f = self.r, self.f
        u, g4 = rows * hidden * f, 4 * rows * hidden * f
        saved = []  # per step: (i, g, o, f_sigmoid, tanh_c, c_prev, h_prev)
        gates = h = c = None
        for t in range(length):
            first = r.alloc(g4, _AGG)  # x_t W_ih + b
            r.keep(seq)  # AddmmBackward keeps x_t, a view of seq
            if t > 0:
                second = r.alloc(g4, _AGG)  # + h W_hh, keeps h
                r.drop(first, gates)  # the previous gates die when f is rebound to a view of these
                first = second
            gates = first
            i, g, o = (r.alloc(u, _AGG) for _ in range(3))
            if t == 0:
                c_new, f_sig = r.alloc(u, _AGG), None
            else:
                product = r.alloc(u, _AGG)  # i * g
                f_sig = r.alloc(u, _AGG)
                c_new = r.alloc(u, _AGG)  # addcmul keeps f_sigmoid and the previous c
                r.drop(product)
            tanh_c = r.alloc(u, _AGG)
            h_new = r.alloc(u, _AGG)
            saved.append((i, g, o, f_sig, tanh_c, c, h))
            h, c = h_new, c_new
        r.drop(c, gates)  # the last cell state and gates die with the function

        def backward(grad_h: int, x_grad: bool, free_grad_h: bool) -> list[int]:
            grad_x, grad_c = [], None
            for t in reversed(range(length)):
                i, g, o, f_sig, tanh_c, c_prev, h_prev = saved[t]
                grad_o, grad_tanh = r.alloc(u, _GRAD), r.alloc(u, _GRAD)  # MulBackward of o · tanh(c)
                if t < length - 1 or free_grad_h:
                    r.drop(grad_h)
                from_tanh = r.alloc(u, _GRAD)  # TanhBackward
                r.drop(grad_tanh, tanh_c)
                if grad_c is None:
                    grad_c = from_tanh
                else:  # summed in place into the gradient the next step sent
                    r.drop(from_tanh)
                grad_f_pre = None
                if t > 0:  # AddcmulBackward: (grad · 1) · other, for f_sigmoid and for c_prev
                    scaled = r.alloc(u, _GRAD)
                    grad_f = r.alloc(u, _GRAD)
                    r.drop(scaled)
                    scaled = r.alloc(u, _GRAD)
                    grad_c_prev = r.alloc(u, _GRAD)
                    r.drop(scaled, c_prev)
                    grad_f_pre = r.alloc(u, _GRAD)  # SigmoidBackward of f
                    r.drop(grad_f, f_sig)
                grad_i, grad_g = r.alloc(u, _GRAD), r.alloc(u, _GRAD)  # MulBackward of i · g
                r.drop(grad_c)
                grad_o_pre = r.alloc(u, _GRAD)
                r.drop(grad_o, o)
                grad_g_pre = r.alloc(u, _GRAD)
                r.drop(grad_g, g)
                grad_i_pre = r.alloc(u, _GRAD)
                r.drop(grad_i, i)
                if grad_f_pre is None:  # SplitBackward fills the unused forget gate's gradient with zeros
                    grad_f_pre = r.alloc(u, _GRAD)
                grad_gates = r.alloc(g4, _GRAD)  # SplitBackward: cat
                r.drop(grad_i_pre, grad_f_pre, grad_g_pre, grad_o_pre)
                if t > 0:  # AddmmBackward of + h W_hh
                    grad_h = r.alloc(u, _GRAD)
                    made = r.alloc(hidden * 4 * hidden * f, _GRAD)
                    r.drop(h_prev)
                    grads["W_hh"].add(made, hidden * 4 * hidden * f)
                if x_grad:  # AddmmBackward of x_t W_ih + b
                    grad_x.append(r.alloc(rows * a * f, _GRAD))
                made = r.alloc(a * 4 * hidden * f, _GRAD)
                bias = r.alloc(4 * hidden * f, _GRAD)
                r.drop(grad_gates)
                grads["b"].add(bias, 4 * hidden * f)
                grads["W_ih"].add(made, a * 4 * hidden * f)
                r.drop(seq)
                grad_c = grad_c_prev if t > 0 else None
            return grad_x

        return h, backward

    def lstm_neighbours(self, c: LayerCounts, hd: int, a: int, hd_grad: bool):
        """lstm_neighbours: per in-degree group, gather the ``(B, L, a)`` sequences and run the LSTM;
        then ``index_copy_`` the final states into a zero ``(D, a)``. Returns (out, backward)."""
        r, f = self.r, self.f
        d = c.num_dst
        active = sum(rows for _, rows in c.degree_histogram)
        out = r.alloc(d * a * f, _AGG)  # zeros, filled in place
        order = self.in_degree_groups(c)
        steps = sum(length for length, _ in c.degree_histogram)  # each LSTM step uses W_ih and b once
        grads = {"W_ih": _SharedGradient(r, steps, self.accumulating),
                 "W_hh": _SharedGradient(r, steps - len(c.degree_histogram), self.accumulating),
                 "b": _SharedGradient(r, steps, self.accumulating, out_of_place_at=2)}  # as the profiler shows
        groups, finals, edges = [], [], None
        for length, rows in c.degree_histogram:
            starts, steps = r.alloc(rows * INDEX_BYTES, _OVER), r.alloc(length * INDEX_BYTES, _OVER)
            new_edges = r.alloc(rows * length * INDEX_BYTES, _OVER)
            r.drop(starts, steps, edges)
            edges = new_edges
            index = r.alloc(rows * length * INDEX_BYTES, _AGG)  # indices[edges]
            seq = r.alloc(rows * length * a * f, _AGG)
            if hd_grad:
                r.keep(index)  # IndexSelectBackward keeps the index
            r.drop(index)
            final, lstm_bwd = self.lstm(seq, rows, length, a, a, grads)
            r.drop(seq)
            groups.append((rows, length, index, lstm_bwd))
            finals.append(final)
        rows_cat, finals_cat = r.alloc(active * INDEX_BYTES, _AGG), r.alloc(active * a * f, _AGG)
        r.keep(rows_cat, finals_cat)  # IndexCopyBackward keeps the index and the source
        r.drop(rows_cat, finals_cat, *finals, order, edges)

        def backward(grad: int, grad_h: int | None) -> int | None:
            """``grad_h``: the gradient ``h`` already has (from the self term), which every group's
            gather gradient is added into."""
            source = r.alloc(active * a * f, _GRAD)  # IndexCopyBackward: grad.index_select
            r.drop(grad, rows_cat, finals_cat)
            for position, (rows, length, index, lstm_bwd) in reversed(list(enumerate(groups))):
                # each group's final state's gradient is a view of it; the last group processed frees it
                grad_x = lstm_bwd(source, hd_grad, position == 0)
                if not hd_grad:
                    continue
                stacked = r.alloc(rows * length * a * f, _GRAD)  # UnbindBackward: stack
                r.drop(*grad_x)
                grad_h = self.accumulate(grad_h, r.alloc(c.num_src * a * f, _GRAD))  # IndexSelectBackward
                r.drop(stacked, index)
            if not groups:
                r.drop(source)
            return grad_h

        return out, backward

    def sage_lstm_forward(self, c: LayerCounts, hd: int, a: int, b: int, hd_grad: bool):
        neigh, lstm_bwd = self.lstm_neighbours(c, hd, a, hd_grad)
        result, combine_bwd = self.sage_combine(c, hd, neigh, a, b, hd_grad)

        def backward(grad: int) -> int | None:
            grad_hd, grad_neigh = combine_bwd(grad)
            return lstm_bwd(grad_neigh, grad_hd)

        return result, backward

    # ----- GAT ------------------------------------------------------------------------------------
    def gat_forward(self, c: LayerCounts, hd: int, a: int, heads: int, width: int, concat: bool, hd_grad: bool):
        """GATConv: z = W h, per-edge scores, edge softmax, Σ α z. Blocks are assumed free of self
        edges (betty_trainer drops self loops when it builds a graph), so the layer attends over
        E + D edges: the block's and one self edge per dst node."""
        r, f = self.r, self.f
        s, d, e = c.num_src, c.num_dst, c.num_edges
        e2, hf = e + d, heads * width
        z, linear_bwd = self.linear(hd, s, a, hf, hd_grad, _AGG)
        edge_dst = self.edge_dst(c)
        not_self, loops = r.alloc(e, _OVER), r.alloc(d * INDEX_BYTES, _OVER)
        ends = []
        for _ in range(2):  # torch.cat([ids[not_self], loops]) for src and for dst
            nonzero = r.alloc(e * INDEX_BYTES, _OVER)
            kept = r.alloc(e * INDEX_BYTES, _OVER)
            r.drop(nonzero)
            ends.append(r.alloc(e2 * INDEX_BYTES, _AGG))
            r.drop(kept)
        edge_src2, edge_dst2 = ends
        r.drop(edge_dst)
        product = r.alloc(s * hf * f, _AGG)  # z * att_src
        score_src = r.alloc(s * heads * f, _AGG)
        r.keep(z, z)  # both score products save z (the dst one a view of it)
        r.drop(product)
        product = r.alloc(d * hf * f, _AGG)  # z[:D] * att_dst
        score_dst = r.alloc(d * heads * f, _AGG)
        r.drop(product)
        gathered = [r.alloc(e2 * heads * f, _AGG) for _ in range(2)]
        scores = r.alloc(e2 * heads * f, _AGG)
        r.keep(edge_src2, edge_dst2)  # the two IndexSelectBackwards
        r.drop(*gathered)
        activated = r.alloc(e2 * heads * f, _AGG)  # leaky_relu saves its input
        r.keep(scores)
        r.drop(scores)
        peak = r.alloc(d * heads * f, _AGG)
        peak_gathered = r.alloc(e2 * heads * f, _AGG)
        shifted = r.alloc(e2 * heads * f, _AGG)
        r.drop(peak_gathered)
        weights = r.alloc(e2 * heads * f, _AGG)  # exp, saved (its result)
        r.keep(weights, weights, edge_dst2)  # ExpBackward; IndexAddBackward of the sum (source, index)
        r.drop(shifted)
        total = r.alloc(d * heads * f, _AGG)
        total_gathered = r.alloc(e2 * heads * f, _AGG)
        r.keep(edge_dst2)
        alpha = r.alloc(e2 * heads * f, _AGG)  # weights / total_gathered, both saved
        r.keep(weights)
        r.drop(weights, total, peak)
        out = r.alloc(d * hf * f, _AGG)  # attention_aggregate: new_zeros, then one chunk's products at a time
        chunk = min(e2, max(1, self.model.attention_chunk_elements // hf))
        r.transient(chunk * hf * f, _AGG)
        r.keep(z, edge_src2, edge_dst2)  # it saves z, alpha (the local's reference) and the edge ends
        r.drop(edge_dst2, edge_src2)
        if concat:
            result = r.alloc(d * hf * f, _HID)  # + bias
        else:
            averaged = r.alloc(d * width * f, _HID)
            result = r.alloc(d * width * f, _HID)
            r.drop(averaged)
        r.drop(out, not_self, loops, score_src, score_dst, activated)

        def backward(grad: int) -> int | None:
            self.param_grad(hf if concat else width)  # bias
            self.settle()
            if not concat:  # MeanBackward materialises the expanded gradient
                expanded = r.alloc(d * hf * f, _GRAD)
                r.drop(grad)
                grad = expanded
            grad_z = r.alloc(s * hf * f, _GRAD)  # attention_aggregate's backward: zeros_like(z)
            grad_alpha = r.alloc(e2 * heads * f, _GRAD)  # empty_like(alpha), filled chunk by chunk
            grad_messages = r.alloc(chunk * hf * f, _GRAD)  # grad.index_select(dst)
            gathered = r.alloc(chunk * hf * f, _GRAD)  # z.index_select(src)
            product = r.alloc(chunk * hf * f, _GRAD)
            r.drop(gathered)
            r.transient(chunk * heads * f, _GRAD)  # .sum(-1), copied into grad_alpha
            r.drop(product, grad_messages, grad, z, alpha, edge_src2, edge_dst2)
            grad_weights = r.alloc(e2 * heads * f, _GRAD)  # DivBackward: grad / other, and -grad·self/other²
            temporaries = [r.alloc(e2 * heads * f, _GRAD) for _ in range(3)]
            r.drop(temporaries[0], temporaries[1], grad_alpha)
            grad_total_gathered = r.alloc(e2 * heads * f, _GRAD)
            r.drop(temporaries[2], total_gathered, weights)
            grad_total = r.alloc(d * heads * f, _GRAD)  # IndexSelectBackward of total_gathered
            r.drop(grad_total_gathered, edge_dst2)
            grad_weights = self.accumulate(grad_weights, r.alloc(e2 * heads * f, _GRAD))  # IndexAddBackward
            r.drop(grad_total, weights, edge_dst2)
            grad_shifted = r.alloc(e2 * heads * f, _GRAD)  # ExpBackward: grad · result
            r.drop(grad_weights, weights)
            grad_scores = r.alloc(e2 * heads * f, _GRAD)  # LeakyReluBackward
            r.drop(grad_shifted, scores)
            grad_score_dst = r.alloc(d * heads * f, _GRAD)
            r.drop(edge_dst2)
            grad_score_src = r.alloc(s * heads * f, _GRAD)
            r.drop(grad_scores, edge_src2)
            grad_z_dst = r.alloc(d * hf * f, _GRAD)  # (z[:D] * att_dst).sum backward
            r.transient(d * hf * f, _GRAD)
            self.param_grad(hf)
            self.settle()
            r.drop(grad_score_dst)
            sliced = r.alloc(s * hf * f, _GRAD)  # SliceBackward
            r.drop(grad_z_dst)
            grad_z = self.accumulate(grad_z, sliced)
            grad_z_src = r.alloc(s * hf * f, _GRAD)  # (z * att_src).sum backward
            r.transient(s * hf * f, _GRAD)
            self.param_grad(hf)
            self.settle()
            r.drop(grad_score_src)
            grad_z = self.accumulate(grad_z, grad_z_src)
            r.drop(z, z)
            return linear_bwd(grad_z)

        return result, backward

    # ----- GCN ------------------------------------------------------------------------------------
    def gcn_forward(self, c: LayerCounts, hd: int, a: int, b: int, hd_grad: bool):
        r, f = self.r, self.f
        s, d = c.num_src, c.num_dst
        project_first, w, record = self.aggregation_width(a, b, hd_grad)
        norm = r.alloc(s * f, _AGG)  # inv_sqrt_degree[src_nodes]
        h, lin_in_bwd = self.linear(hd, s, a, b, hd_grad, _AGG) if project_first else (hd, None)
        values = r.alloc(c.num_edges * f, _AGG)  # norm[indices], times the dst norm per edge in place
        r.drop(self.per_edge(c))
        scale = r.alloc(d * f, _AGG)  # dst norm²
        out, agg_bwd = self.aggregate(c, w, record, values, scale)
        r.drop(scale)
        lin_out, lin_out_bwd = (None, None) if project_first else self.linear(out, d, a, b, True)
        result = r.alloc(d * b * f, _HID)  # + bias
        r.drop(out, lin_out, values, norm)
        if project_first:
            r.drop(h)

        def backward(grad: int) -> int | None:
            self.param_grad(b)
            self.settle()
            if lin_out_bwd is not None:
                grad = lin_out_bwd(grad, True, record)
            if not record:
                return None
            grad_h = agg_bwd(grad)
            if lin_in_bwd is not None:
                return lin_in_bwd(grad_h)
            return grad_h if hd_grad else r.drop(grad_h)

        return result, backward

    # ----- the whole step ----------------------------------------------------------------------
    def layer_forward(self, index: int, c: LayerCounts, h: int, a: int, b: int, h_grad: bool):
        if self.model.arch == "gcn":
            return self.gcn_forward(c, h, a, b, h_grad)
        if self.model.arch == "gat":
            concat = index < self.model.num_layers - 1
            return self.gat_forward(c, h, a, self.model.heads, self.model.widths[index + 1], concat, h_grad)
        sage = {"pool": self.sage_pool_forward, "lstm": self.sage_lstm_forward}.get(self.model.aggregator,
                                                                                  self.sage_forward)
        return sage(c, h, a, b, h_grad)

    def relu(self, x: int, rows: int, width: int):
        out = self.r.alloc(rows * width * self.f, _HID)
        self.r.keep(out)  # ReluBackward saves its result
        self.r.drop(x)

        def backward(grad: int) -> int:
            grad_x = self.r.alloc(rows * width * self.f, _GRAD)
            self.r.drop(grad, out)
            return grad_x

        return out, backward

    def cross_entropy(self, rows: int, classes: int, labels: int):
        r = self.r
        log_probs = r.alloc(rows * classes * self.f, _HID)
        r.keep(log_probs, labels)  # LogSoftmaxBackward saves its result; NLLLoss saves both
        r.keep(log_probs)
        r.drop(log_probs)

        def backward() -> int:
            grad_nll = r.alloc(rows * classes * self.f, _GRAD)
            r.drop(log_probs, labels)
            grad_logits = r.alloc(rows * classes * self.f, _GRAD)
            r.drop(grad_nll, log_probs)
            return grad_logits

        return backward

    def optimizer_step(self) -> None:
        """Adam/AdamW, on the path PyTorch takes (:attr:`ModelSpec.foreach`).

        Single-tensor (CPU's default), parameter by parameter: with weight decay the gradient
        plus decay is a new tensor, freed at the end of that parameter's update; ``denom =
        sqrt(v) / c`` is made (sqrt, then div) while the previous parameter's ``denom`` is
        still referenced. ``foreach`` (CUDA's default), all parameters at once: with weight
        decay a copy of every gradient (freed before the moments' square roots), then
        ``sqrt(v)`` of every parameter, divided and used in place."""
        if OPTIMIZER_STATES[self.model.optimizer] == 0:
            return
        r, f = self.r, self.f
        if self.model.foreach:
            total = self.model.num_parameters * f
            if self.model.weight_decay:
                r.transient(total, _OVER)
            r.transient(total, _OVER)
            return
        previous = None
        for layer in self.model.parameter_numels:
            for numel in layer:
                decayed = r.alloc(numel * f, _OVER) if self.model.weight_decay else None
                root = r.alloc(numel * f, _OVER)
                denom = r.alloc(numel * f, _OVER)
                r.drop(root, previous, decayed)
                previous = denom
        r.drop(previous)


def model_state_bytes(model: ModelSpec) -> dict[str, int]:
    """Bytes live before any micro-batch: ``parameters`` (buffers included) and ``optimizer_state``
    (Adam: two moments per parameter plus a 4-byte step counter per parameter tensor)."""
    shapes = [numel for layer in model.parameter_numels for numel in layer]
    states = OPTIMIZER_STATES[model.optimizer]
    return {
        "parameters": sum(shapes) * model.dtype_bytes + model.buffer_bytes,
        "optimizer_state": (states * sum(shapes) * model.dtype_bytes + 4 * len(shapes)) if states else 0,
    }


def estimate_micro_batch(layers: Sequence[LayerCounts], model: ModelSpec, accumulate: bool = False) -> MemoryEstimate:
    """Estimate the memory of one training step of a micro-batch, itemised (Betty §4.4.3).

    The step is the one :func:`betty_trainer.training.step.measure_training_step` measures:
    gather input features and labels, forward, cross-entropy, backward, the accuracy
    count, optimizer step. Resident before it: parameters, optimizer state (Adam:
    2 × parameters + a step counter per tensor) and the blocks' structure. A batch's
    first micro-batch allocates the parameter gradients as backward computes them
    (``accumulate=False``); the later ones (``accumulate=True``) start with them resident
    and add each new gradient into them, which costs more.

    Args:
        layers: the micro-batch's :class:`LayerCounts`, input layer first (one per model layer).
        model: the model (:class:`ModelSpec`).
        accumulate: estimate a micro-batch after the first of its batch.

    Returns:
        A :class:`MemoryEstimate` (bytes).

    Raises:
        ValueError: if the number of layers differs from the model's.
    """
    if len(layers) != model.num_layers:
        raise ValueError(f"the micro-batch has {len(layers)} layers but the model has {model.num_layers}")
    replay = _Replay()
    step = _Step(replay, model, accumulate)
    f = model.dtype_bytes
    for component, nbytes in model_state_bytes(model).items():
        replay.alloc(nbytes, component)
    if accumulate:  # the earlier micro-batches' gradients
        replay.alloc(model.num_parameters * f, _GRAD)
    replay.alloc(block_structure_bytes(layers), "block_structure")
    resident = replay.current

    replay.phase = "forward"
    x = replay.alloc(layers[0].num_src * model.widths[0] * f, "input_features")
    labels = replay.alloc(layers[-1].num_dst * INDEX_BYTES, "labels")
    h, h_grad, backwards = x, False, []
    for index, counts in enumerate(layers):
        a, b = model.layer_dims(index)
        if model.dropout > 0 and h is x:  # the step hands x over: input dropout overwrites it in place
            step.keyed_mask(counts.num_src, a)
            hd, dropout_bwd = x, None
            replay.keep(x)
        elif model.dropout > 0:
            hd, dropout_bwd = step.dropout(h, counts.num_src, a, h_grad)
            replay.drop(h)
        else:
            hd, dropout_bwd = h, None
            if h is x:
                replay.keep(x)
        out, layer_bwd = step.layer_forward(index, counts, hd, a, b, h_grad)
        replay.drop(hd)
        relu_bwd = None
        if index < model.num_layers - 1:
            out, relu_bwd = step.relu(out, counts.num_dst, b)
        backwards.append((dropout_bwd if h_grad else None, layer_bwd, relu_bwd))
        h, h_grad = out, True
    logits = h
    loss_bwd = step.cross_entropy(layers[-1].num_dst, model.widths[-1], labels)

    replay.phase = "backward"
    grad = loss_bwd()
    for dropout_bwd, layer_bwd, relu_bwd in reversed(backwards):
        if relu_bwd is not None:
            grad = relu_bwd(grad)
        grad = layer_bwd(grad)
        if grad is not None and dropout_bwd is not None:
            grad = dropout_bwd(grad)
    predictions = replay.alloc(layers[-1].num_dst * INDEX_BYTES, _OVER)  # (logits.argmax(1) == y).sum()
    hits = replay.alloc(layers[-1].num_dst, _OVER)
    replay.drop(predictions, hits)
    replay.drop(grad, x, labels, logits)  # the micro-batch's tensors die before the optimizer step
    replay.phase = "optimizer"
    step.optimizer_step()
    return MemoryEstimate(
        peak_bytes=replay.peak,
        at_peak={name: replay.at_peak.get(name, 0) for name in COMPONENTS},
        totals={name: replay.totals.get(name, 0) for name in COMPONENTS},
        forward_peak_bytes=replay.phase_peak["forward"],
        backward_peak_bytes=replay.phase_peak["backward"],
        resident_bytes=resident,
    )
