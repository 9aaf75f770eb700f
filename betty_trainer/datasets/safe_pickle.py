"""Unpickling of dataset files that carry pickles (Planetoid's ``ind.*`` files, the gnn-benchmark
``.npz`` archives) without running code: only the numpy/scipy/builtin data types those files use
are resolved, any other global is refused. Plain :mod:`pickle` would execute whatever a file names."""

from __future__ import annotations

import io
import pickle
from collections import defaultdict

import numpy as np
import scipy.sparse as sp

from betty_trainer.errors import DatasetError


def _numpy_reconstruct():
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"): _numpy_reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _numpy_reconstruct,
    ("numpy", "ndarray"): lambda: np.ndarray,
    ("numpy", "dtype"): lambda: np.dtype,
    ("scipy.sparse.csr", "csr_matrix"): lambda: sp.csr_matrix,
    ("scipy.sparse._csr", "csr_matrix"): lambda: sp.csr_matrix,
    ("collections", "defaultdict"): lambda: defaultdict,
    ("__builtin__", "list"): lambda: list,
    ("builtins", "list"): lambda: list,
}


class ForbiddenGlobal(pickle.UnpicklingError):
    """A pickle asked for a global outside the allow-list."""


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals the dataset files use (numpy arrays and
    dtypes, scipy CSR matrices, ``defaultdict`` and ``list``); any other global is refused.

    Raises:
        ForbiddenGlobal: naming the refused ``module.name``.
    """

    def find_class(self, module: str, name: str):
        factory = _ALLOWED.get((module, name))
        if factory is None:
            raise ForbiddenGlobal(f"refusing to load {module}.{name} (not a numpy/scipy/builtin data type)")
        return factory()


def restricted_load(data: bytes, source: str = "<bytes>"):
    """Unpickle ``data`` with :class:`RestrictedUnpickler` (``latin1`` for Python-2 pickles).

    Raises:
        DatasetError: if the pickle asks for a forbidden global, is truncated, or is corrupt.
    """
    try:
        return RestrictedUnpickler(io.BytesIO(data), encoding="latin1").load()
    except ForbiddenGlobal as error:
        raise DatasetError(f"{source}: {error}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError, MemoryError) as error:
        raise DatasetError(f"{source} is truncated or corrupt ({type(error).__name__}: {error})") from None
