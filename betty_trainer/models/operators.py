"""The models' compiled CPU kernels (numba) as PyTorch operators, ``torch.ops.betty.<name>``, so a model's step
goes through the dispatcher: a recording on fake tensors (:mod:`estimator.recorder`) runs them by their fake
implementation instead of failing on ``.numpy()``, and sees every allocation.

Every operator only fills tensors its caller allocated (mutated arguments, ``Tensor(a!)`` in its schema) and returns
nothing: what a kernel writes is allocated in torch code, where the recorder sees it as an operator's output, and
its fake implementation has nothing to do. This module is the ``betty`` library's one home (a namespace is defined
once per process); the operators are defined next to their kernels (``betty_trainer.models.aggregate``,
``betty_trainer.models.dropout``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

LIBRARY = torch.library.Library("betty", "DEF")


def kernel_operator(schema: str, kernel: Callable[..., None]) -> torch._ops.OpOverload:
    """Define the operator ``betty::<name>`` by ``schema``, run on CPU tensors by ``kernel`` and on fake or meta
    tensors by nothing.

    Args:
        schema: ``"<name>(<arguments>) -> ()"``; each tensor the kernel writes is annotated as mutated
            (``Tensor(a!) out``, a letter of its own each), optional tensors are ``Tensor?``.
        kernel: called with the operator's arguments in order, tensors as numpy arrays (sharing their memory;
            ``None`` stays ``None``), scalars as they are; writes into the mutated ones, returns nothing. The
            operator's tensor arguments must not require grad (``.detach()`` those that do): ``.numpy()`` raises a
            ``RuntimeError`` on them.

    Returns:
        The operator (``torch.ops.betty.<name>.default``).

    Raises:
        RuntimeError: if ``betty::<name>`` is defined already.
    """
    name = schema.split("(", 1)[0]
    LIBRARY.define(schema)
    LIBRARY.impl(name, lambda *args: kernel(*[a.numpy() if isinstance(a, Tensor) else a for a in args]), "CPU")
    _register_fake(f"betty::{name}", lambda *args: None)
    return getattr(torch.ops.betty, name).default


def tensor_operator(schema: str, implementation: Callable[..., None]) -> torch._ops.OpOverload:
    """Define the operator ``betty::<name>`` by ``schema``, run on tensors of any device by ``implementation``
    (tensor ops: a library call fake tensors cannot run, e.g. a sparse CSR product, filling tensors its caller
    allocated) and on fake or meta tensors by nothing, as :func:`kernel_operator`'s are.

    Raises:
        RuntimeError: if ``betty::<name>`` is defined already.
    """
    name = schema.split("(", 1)[0]
    LIBRARY.define(schema)
    LIBRARY.impl(name, implementation, "CompositeExplicitAutograd")
    _register_fake(f"betty::{name}", lambda *args: None)
    return getattr(torch.ops.betty, name).default


def _register_fake(qualname: str, implementation: Callable[..., None]) -> None:
    """``torch.library.register_fake`` (torch ≥ 2.4), or its earlier name ``impl_abstract`` (torch 2.2, the DGL
    interop's environment)."""
    register = getattr(torch.library, "register_fake", None) or torch.library.impl_abstract
    register(qualname, implementation, lib=LIBRARY)
