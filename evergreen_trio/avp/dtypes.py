"""AVP tensor data types and where their bytes live (host NumPy, device CuPy): the bottom of ``avp/``.

``message.py``, ``kv.py`` and ``codec.py`` all import from here, so none has to import another lazily.
"""

from __future__ import annotations

import enum
from typing import Any

import ml_dtypes
import numpy as np

from evergreen_trio.avp.errors import AVPDeviceError

KV_HEADER_SIZE = 17


class DataType(enum.IntEnum):
    """The tensor's element type (``avp.DataType``)."""

    FLOAT32 = 0
    FLOAT16 = 1
    BFLOAT16 = 2
    INT8 = 3


NUMPY_DTYPES: dict[DataType, np.dtype[Any]] = {
    DataType.FLOAT32: np.dtype("<f4"),
    DataType.FLOAT16: np.dtype("<f2"),
    DataType.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    DataType.INT8: np.dtype("i1"),
}
ITEMSIZE = {dtype: np_dtype.itemsize for dtype, np_dtype in NUMPY_DTYPES.items()}
DTYPE_BY_NAME = {np_dtype.name: dtype for dtype, np_dtype in NUMPY_DTYPES.items()}


def require_cupy() -> Any:
    """The CuPy module, if it imports and sees a CUDA device; else `AVPDeviceError`."""
    try:
        import cupy
    except ImportError as exc:
        raise AVPDeviceError(f"a GPU array was asked for, but CuPy is not importable: {exc}") from None
    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        raise AVPDeviceError(f"a GPU array was asked for, but no CUDA device is usable: {exc}") from None
    return cupy


def to_device(array: np.ndarray[Any, Any]) -> Any:
    """Copy a host array onto the current CUDA device as a CuPy array (`AVPDeviceError` for bfloat16)."""
    if array.dtype == NUMPY_DTYPES[DataType.BFLOAT16]:
        raise AVPDeviceError(
            "a GPU array was asked for with dtype bfloat16, which CuPy lacks; "
            "use as_array() and view it as uint16 on the device"
        )
    return require_cupy().asarray(array)
