"""Arrays from files, for the command line, without reading them whole where
the format allows: ``.npy`` and ``.safetensors`` are memory-mapped, ``.pt``
is loaded with ``mmap=True``; ``.npz`` members are read when opened (zip
members cannot be mapped)."""
from __future__ import annotations

import json
import os
import struct
from typing import Any, Dict, Optional

import numpy as np

FORMATS = (".npy", ".npz", ".safetensors", ".pt", ".pth")


class FileError(Exception):
    """A user-facing problem with an input file (one line, no traceback)."""


_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
              "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
              "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8"}


def _safetensors(path: str) -> Dict[str, Any]:
    """name -> memory-mapped array (bfloat16 as ml_dtypes.bfloat16, or as a
    torch tensor view when ml_dtypes is absent)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise FileError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise FileError(f"{path}: not a safetensors file (bad header)") from None
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = _ST_DTYPES.get(info.get("dtype"))
        if dt is None:
            raise FileError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')}")
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if dt == "bfloat16":
            try:
                import ml_dtypes

                npdt = np.dtype(ml_dtypes.bfloat16)
            except ImportError:
                npdt = None
        else:
            npdt = np.dtype(dt)
        raw = np.memmap(path, dtype=np.uint16 if npdt is None else npdt, mode="r",
                        offset=8 + n + start, shape=shape) if end > start else np.zeros(shape, npdt or np.uint16)
        if npdt is None:  # bfloat16 without ml_dtypes: a torch view of the mapped bits
            import torch

            raw = torch.from_numpy(np.asarray(raw)).view(torch.bfloat16)
        out[name] = raw
    return out


def _pt(path: str) -> Dict[str, Any]:
    try:
        import torch
    except ImportError:
        raise FileError(f"{path}: reading .pt files needs torch") from None
    try:
        obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # torch raises many kinds for a bad file
        raise FileError(f"{path}: cannot load as a torch file ({type(e).__name__}: {e})".splitlines()[0]) from None
    if isinstance(obj, torch.Tensor):
        return {"": obj}
    if isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return dict(obj)
    raise FileError(f"{path}: expected a tensor or a dict of tensors, got {type(obj).__name__}")


def load_array(path: str, role: str, key: Optional[str] = None) -> Any:
    """The array in ``path`` for ``role`` (``logits``, ``targets``, ...):
    the file's only array, or the one named ``key``, or the one named
    ``role``."""
    if not os.path.exists(path):
        raise FileError(f"{path}: no such file ({role})")
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise FileError(f"{path}: unsupported format {ext or '(none)'} for {role}; "
                        f"use one of {', '.join(FORMATS)}")
    if ext == ".npy":
        try:
            return np.load(path, mmap_mode="r")
        except ValueError as e:
            raise FileError(f"{path}: cannot read as .npy ({e})") from None
    if ext == ".npz":
        try:
            z = np.load(path)
        except (ValueError, OSError) as e:
            raise FileError(f"{path}: cannot read as .npz ({e})") from None
        return _pick(path, role, key, {k: None for k in z.files}, lambda k: z[k])
    arrays = _safetensors(path) if ext == ".safetensors" else _pt(path)
    return _pick(path, role, key, arrays, arrays.__getitem__)


def _pick(path, role, key, names, get):
    if key is not None:
        if key not in names:
            raise FileError(f"{path}: no array named {key!r} (it holds {sorted(names)})")
        return get(key)
    if len(names) == 1:
        return get(next(iter(names)))
    if role in names:
        return get(role)
    raise FileError(f"{path} holds several arrays {sorted(names)}: name the {role} one with --key")
