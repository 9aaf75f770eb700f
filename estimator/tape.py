"""The replay the memory estimate runs on (Betty §4.4.3): live bytes with reference counts, and the
tape a layer's memory terms write to (docs/design.md › Memory estimate).

No tensor is allocated: a tensor is a handle with a size and a component; the peak and what is
live at the peak fall out of replaying the allocations and frees of one training step in order.
"""

from __future__ import annotations

from collections import defaultdict

from estimator.counts import INDEX_BYTES, LayerCounts
from estimator.spec import OPTIMIZER_STATES, ModelSpec

AGG = "aggregator_intermediates"
HID = "hidden_outputs"
GRAD = "gradients"
OVER = "framework_overheads"
__all__ = ["AGG", "GRAD", "HID", "INDEX_BYTES", "OVER", "Replay", "SharedGradient", "StepTape"]


class Replay:
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
        self.saving = True  # autograd records (False: the replayed code runs under torch.no_grad)
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
        """One more holder (a Python variable aliasing the tensor; see :meth:`save` for autograd)."""
        for handle in handles:
            if handle is not None:
                self.live[handle][2] += 1

    def save(self, *handles: int | None) -> None:
        """Autograd saving the tensors for backward: one more holder each while :attr:`saving`; nothing
        when the step runs without autograd (``torch.no_grad``, a layer-wise forward)."""
        if self.saving:
            self.keep(*handles)

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

    def mark(self) -> int:
        """A position in the replay: :meth:`release_since` frees what was allocated after it."""
        return self._next

    def release_since(self, mark: int) -> None:
        """Free every tensor allocated since ``mark`` that is still live, whoever holds it (a scope
        that ends: e.g. a chunk whose autograd graph and locals are all released at once)."""
        for handle in [h for h in self.live if h >= mark]:
            self.live[handle][2] = 1
            self.drop(handle)

    def transient(self, nbytes: float, component: str) -> None:
        """An op's temporary: allocated and freed within the op."""
        self.drop(self.alloc(nbytes, component))


class SharedGradient:
    """The gradient of a parameter used many times in one backward (the LSTM's weights, once per
    step): autograd sums the contributions in a buffer (the first one made; later ones are
    added in place and freed, except that the ``out_of_place_at``-th is added out of place)
    and, after the last one, hands it to ``.grad``, or when accumulating adds it into
    ``.grad`` and frees it."""

    def __init__(self, replay: Replay, uses: int, accumulating: bool, out_of_place_at: int = 0):
        self.r, self.remaining, self.accumulating, self.out_of_place_at = replay, uses, accumulating, out_of_place_at
        self.buffer: int | None = None
        self.count = 0

    def add(self, made: int, nbytes: int) -> None:
        self.count += 1
        if self.buffer is None:
            self.buffer = made
        elif self.count == self.out_of_place_at:
            total = self.r.alloc(nbytes, GRAD)
            self.r.drop(self.buffer, made)
            self.buffer = total
        else:
            self.r.drop(made)
        self.remaining -= 1
        if self.remaining == 0 and self.accumulating:
            self.r.drop(self.buffer)


class StepTape:
    """What a layer's memory terms write to: the :class:`Replay` of one training step (``r``), the
    bytes per element (``f``), which kernels run (``compiled_kernels``), whether the step
    accumulates into resident gradients, and the terms of the torch ops every layer uses
    (``linear``, ``relu``, the loss, the optimizer step, parameter gradients).

    A layer's terms, recorded (``betty_trainer.models.recorded_terms``) or written by hand where the recorder
    refuses it (a ``memory_terms(tape, counts, h, h_grad)`` beside its ``forward``), replay its ops in order:
    ``r.alloc`` for an op's output, ``r.keep`` where autograd saves a tensor for backward, ``r.drop`` when a Python
    variable goes out of scope. They return the output's handle and a closure emitting that piece's backward, which
    receives the output's gradient and returns the input's (or ``None``).

    ``transposed`` lists, with the compiled kernels, the counts of each layer whose sparse aggregation's backward
    ran (a product by ``Aᵀ``, which the recorded terms see: ``betty_trainer.models.recorded_terms``): the layers
    whose blocks a kept transpose would serve.
    """

    def __init__(self, replay: Replay, model: ModelSpec, accumulate: bool):
        self.r, self.model, self.f, self.accumulating = replay, model, model.dtype_bytes, accumulate
        self.pending: list[int] = []
        self.compiled_kernels = model.compiled_kernels
        self.transposed: list[LayerCounts] = []  # layers whose aggregation's backward ran a product by Aᵀ (compiled)

    def param_grad(self, numel: int) -> int:
        """A parameter's gradient, made by a backward node. It becomes ``.grad`` and lives to the end
        of the step, or, when accumulating, is added into the resident ``.grad`` once the node that
        made it is done (:meth:`settle`)."""
        made = self.r.alloc(numel * self.f, GRAD)
        if self.accumulating:
            self.pending.append(made)
        return made

    def settle(self) -> None:
        """The end of a backward node: accumulating, the gradients it made are added into ``.grad`` and freed."""
        self.r.drop(*self.pending)
        self.pending.clear()

    def accumulate(self, first: int | None, second: int | None) -> int | None:
        """Autograd summing two gradients of one dense tensor: in place into ``first``, the second freed (a sum into a
        gradient that came through a view's backward is out of place: the recorder follows the engine there,
        ``estimator.recorder``)."""
        if first is None or second is None:
            return first if second is None else second
        self.r.drop(second)
        return first

    # ----- Linear without bias (F.linear → mm) ---------------------------------------------------
    def linear(self, x: int, rows: int, a: int, b: int, x_grad: bool, component: str = HID):
        r = self.r
        out = r.alloc(rows * b * self.f, component)
        r.save(x)  # MmBackward saves the input (for the weight's gradient)

        def backward(grad: int, free_grad: bool = True, x_grad: bool = x_grad) -> int | None:
            self.param_grad(a * b)
            grad_x = r.alloc(rows * a * self.f, GRAD) if x_grad else None
            self.settle()
            r.drop(x)
            if free_grad:
                r.drop(grad)
            return grad_x

        return out, backward

    def relu(self, x: int, rows: int, width: int):
        out = self.r.alloc(rows * width * self.f, HID)
        self.r.save(out)  # ReluBackward saves its result
        self.r.drop(x)

        def backward(grad: int) -> int:
            grad_x = self.r.alloc(rows * width * self.f, GRAD)
            self.r.drop(grad, out)
            return grad_x

        return out, backward

    def cross_entropy(self, rows: int, classes: int, labels: int):
        r = self.r
        log_probs = r.alloc(rows * classes * self.f, HID)
        r.save(log_probs, labels)  # LogSoftmaxBackward saves its result; NLLLoss saves both
        r.save(log_probs)
        r.drop(log_probs)

        def backward() -> int:
            grad_nll = r.alloc(rows * classes * self.f, GRAD)
            r.drop(log_probs, labels)
            grad_logits = r.alloc(rows * classes * self.f, GRAD)
            r.drop(grad_nll, log_probs)
            return grad_logits

        return backward

    def loss(self, rows: int, classes: int, labels: int):
        """The step's loss ``Σ CE / |V|`` on ``rows`` logits of ``classes`` columns: :meth:`cross_entropy`, then the
        loss scalar (the division's output, which the step holds until it returns). Returns ``(backward,
        scalars)``: ``backward()`` first makes autograd's seed gradient (``ones_like`` of the loss, alive through
        the backward), then returns ``∂L/∂logits`` as :meth:`cross_entropy`'s does; ``scalars()`` the handles of
        the loss and the seed, for the caller to free where the step's tensors die."""
        loss_bwd = self.cross_entropy(rows, classes, labels)
        held = [self.r.alloc(self.f, OVER)]

        def backward() -> int:
            held.append(self.r.alloc(self.f, GRAD))
            return loss_bwd()

        return backward, lambda: tuple(held)

    def optimizer_step(self) -> None:
        """Adam/AdamW, on the path PyTorch takes (:attr:`ModelSpec.foreach`).

        Single-tensor (CPU's default), parameter by parameter: with weight decay the gradient
        plus decay is a new tensor, freed at the end of that parameter's update; ``denom =
        sqrt(v) / c`` is made (sqrt, then div, whose Python-float divisor becomes a double scalar
        tensor and its copy in the parameter's dtype inside the op) while the previous parameter's
        ``denom`` is still referenced. ``foreach`` (CUDA's default), all parameters at once: with weight
        decay a copy of every gradient (freed before the moments' square roots), then
        ``sqrt(v)`` of every parameter, divided and used in place."""
        if OPTIMIZER_STATES[self.model.optimizer] == 0:
            return
        r, f = self.r, self.f
        if self.model.foreach:
            total = self.model.num_parameters * f
            if self.model.weight_decay:
                r.transient(total, OVER)
            r.transient(total, OVER)
            return
        previous = None
        for layer in self.model.parameter_numels:
            for numel in layer:
                decayed = r.alloc(numel * f, OVER) if self.model.weight_decay else None
                root = r.alloc(numel * f, OVER)
                # `/ bias_correction2_sqrt` wraps the Python float in a double scalar tensor and casts it to the
                # parameter's dtype inside the div (no copy for float64): both live while the div makes its output
                scalars = r.alloc(8 + (f if f != 8 else 0), OVER)
                denom = r.alloc(numel * f, OVER)
                r.drop(scalars, root, previous, decayed)
                previous = denom
        r.drop(previous)
