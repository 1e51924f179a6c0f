"""Arrays from files, for the command line, without reading them whole where
the format allows: ``.npy`` and ``.safetensors`` are memory-mapped, ``.pt``
is loaded with ``mmap=True`` (a legacy, non-zip ``.pt`` is read whole);
``.npz`` members are read when opened (zip members cannot be mapped).

Only regular files are opened (a FIFO or a device named ``x.npy`` would
block or never end), and every problem with a file, down to a malformed
safetensors header, is a `FileError` with a one-line message."""
from __future__ import annotations

import json
import math
import os
import stat
import struct
import warnings
import zipfile
from collections import Counter
from functools import partial
from typing import Any, Callable, Dict, FrozenSet, List, NoReturn, Optional, Tuple, Union

import numpy as np
import numpy.typing as npt

from .errors import FileError

__all__ = ["FORMATS", "FileError", "array_names", "dtype_name", "load_array", "load_named", "named_array"]

FORMATS = (".npy", ".npz", ".safetensors", ".pt", ".pth")

# The names an array may have for a role, when a file holds several and no
# key is given: Hugging Face dumps name the targets "labels". Logits (a
# model's or a reference's) are otherwise the file's only float array.
_ALIASES = {"targets": ("targets", "labels"), "reference logits": ("logits",)}
_LOGITS_ROLES = ("logits", "reference logits")
_KEY_FLAGS = {"logits": "--key", "targets": "--targets-key", "reference logits": "--reference-key"}


def dtype_name(x: Any) -> str:
    """An array's dtype as float32, bfloat16, int64, ... whatever its byte
    order (numpy's ``>f4`` is float32), or torch's ``torch.float32``."""
    return str(getattr(x.dtype, "name", x.dtype))


def _why(e: BaseException) -> str:
    """An exception as one short line."""
    msg = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {msg[0]}" if msg else type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _regular_file(path: str, role: str) -> None:
    """Raise unless ``path`` is a regular file (following links), before
    anything opens it: opening a FIFO blocks until a writer comes."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileError(f"{path}: no such file ({role})") from None
    except (OSError, ValueError) as e:
        raise FileError(f"{path}: cannot read ({role}): {e.strerror if isinstance(e, OSError) else e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise FileError(f"{path}: is a directory, not a file ({role})")
    if not stat.S_ISREG(st.st_mode):
        raise FileError(f"{path}: not a regular file ({role}); a pipe or a device cannot be read")


# ---------------------------------------------------------------------------
# safetensors: the header is checked the way the format's reference
# implementation (the Rust crate behind the ``safetensors`` package) checks it,
# so that a file is accepted here exactly when it is accepted there.

_ST_MAX_HEADER = 100_000_000  # bytes, the reference implementation's bound
_ST_MAX_DEPTH = 127           # JSON nesting serde_json accepts (its limit is 128)
_U64 = 2 ** 64

# Every dtype of the format, with its size in bits.
_ST_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8,
            "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16,
            "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64,
            "I64": 64, "U64": 64}
# Those numpy holds natively ...
_ST_NUMPY = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
             "F16": "float16", "I32": "int32", "U32": "uint32", "F32": "float32", "C64": "complex64",
             "F64": "float64", "I64": "int64", "U64": "uint64"}
# ... and those that need ml_dtypes, or else a torch view of the mapped bits.
_ST_EXTRA = {"BF16": "bfloat16", "F8_E5M2": "float8_e5m2", "F8_E4M3": "float8_e4m3fn",
             "F8_E8M0": "float8_e8m0fnu", "F8_E4M3FNUZ": "float8_e4m3fnuz",
             "F8_E5M2FNUZ": "float8_e5m2fnuz"}
_INFO_FIELDS = ("dtype", "shape", "data_offsets")
# a tensor's (dtype, shape, (begin, end)) in the header
_TensorInfo = Tuple[str, Tuple[int, ...], Tuple[int, int]]


class _Bad(Exception):
    """A malformed header (the message says what)."""


class _Pairs(Dict[str, Any]):
    """A JSON object that remembers which of its keys appeared twice (the
    value kept is the last one, as in the reference implementation)."""

    dups: FrozenSet[str] = frozenset()


def _pairs(items: List[Tuple[str, Any]]) -> _Pairs:
    d = _Pairs(items)
    if len(d) != len(items):
        d.dups = frozenset(k for k, count in Counter(k for k, _ in items).items() if count > 1)
    return d


class _Neg:
    """A negative JSON integer: valid JSON, never a valid size or offset."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _int(text: str) -> Union[int, float, _Neg]:
    """JSON integers as the reference parser reads them: exact within 64
    bits, else as a double, which must be finite."""
    if len(text) <= 20:
        v = int(text)
        if -2 ** 63 <= v < _U64:
            return _Neg(text) if text.startswith("-") else v
    if math.isinf(float(text)):
        raise _Bad(f"number {text[:20]}... out of range")
    return _Neg(text) if text.startswith("-") else float(text)


def _float(text: str) -> float:
    v = float(text)
    if math.isinf(v):
        raise _Bad(f"number {text} out of range")
    return v


def _constant(text: str) -> NoReturn:
    raise _Bad(f"{text} is not JSON")


def _check_tree(obj: object) -> None:
    """The nesting depth bound, and strings that are valid Unicode (no lone
    surrogates from \\u escapes), over the whole parsed header."""
    stack: List[Tuple[object, int]] = [(obj, 1)]
    while stack:
        x, depth = stack.pop()
        if isinstance(x, dict):
            if depth > _ST_MAX_DEPTH:
                raise _Bad("nested too deep")
            for k, v in x.items():
                k.encode("utf-8")
                stack.append((v, depth + 1))
        elif isinstance(x, list):
            if depth > _ST_MAX_DEPTH:
                raise _Bad("nested too deep")
            stack.extend((v, depth + 1) for v in x)
        elif isinstance(x, str):
            x.encode("utf-8")


def _size(x: object, what: str) -> int:
    if type(x) is not int:  # not bool, float, or a negative integer
        raise _Bad(f"{what} must be a non-negative integer below 2**64, got {x!r}")
    return int(x)


def _tensor_info(name: str, info: object) -> _TensorInfo:
    """(dtype, shape, (begin, end)) of one header entry, which is an object
    {"dtype", "shape", "data_offsets"} (other keys ignored) or a list of
    these three in order."""
    if isinstance(info, dict):
        dup = [k for k in _INFO_FIELDS if k in getattr(info, "dups", ())]
        if dup:
            raise _Bad(f"tensor {name!r} has {dup[0]!r} twice")
        missing = [k for k in _INFO_FIELDS if k not in info]
        if missing:
            raise _Bad(f"tensor {name!r} has no {missing[0]!r}")
        dtype, shape, offsets = (info[k] for k in _INFO_FIELDS)
    elif isinstance(info, list) and len(info) == 3:
        dtype, shape, offsets = info
    else:
        raise _Bad(f"tensor {name!r}: expected an object with dtype, shape and data_offsets, "
                   f"got {type(info).__name__}")
    if isinstance(dtype, dict) and len(dtype) == 1 and next(iter(dtype.values())) is None:
        dtype = next(iter(dtype))  # the JSON form {"F32": null} of the same dtype
    if not isinstance(dtype, str) or dtype not in _ST_BITS:
        raise _Bad(f"tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list):
        raise _Bad(f"tensor {name!r}: shape must be a list, got {shape!r}")
    shape = tuple(_size(d, f"tensor {name!r}: each dimension") for d in shape)
    if not isinstance(offsets, list) or len(offsets) != 2:
        raise _Bad(f"tensor {name!r}: data_offsets must be [begin, end], got {offsets!r}")
    begin, end = (_size(o, f"tensor {name!r}: data_offsets") for o in offsets)
    return dtype, shape, (begin, end)


def _parse_header(raw: bytes) -> Tuple[Optional[Dict[str, str]], Dict[str, _TensorInfo], int]:
    """(metadata, {name: (dtype, shape, (begin, end))}, data length) of a
    header, or _Bad."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _Bad("the header is not UTF-8") from None
    try:
        header = json.loads(text, object_pairs_hook=_pairs, parse_int=_int, parse_float=_float,
                            parse_constant=_constant)
    except RecursionError:
        raise _Bad("nested too deep") from None
    except ValueError as e:  # JSONDecodeError, and int() of an over-long literal
        raise _Bad(f"the header is not JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(header, dict):
        kind = {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(header), "number")
        raise _Bad(f"the header is a JSON {kind}, not an object")
    try:
        _check_tree(header)
    except UnicodeEncodeError:
        raise _Bad("the header holds an unpaired \\u surrogate") from None
    if "__metadata__" in getattr(header, "dups", ()):
        raise _Bad("__metadata__ appears twice")
    meta = header.pop("__metadata__", None)
    if meta is not None:
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise _Bad("__metadata__ must be an object of strings")
    tensors = {name: _tensor_info(name, info) for name, info in header.items()}
    # The tensors, in order of their offsets, must tile the data section from
    # 0 to its end, each exactly as long as its dtype and shape say.
    end_prev = 0
    for name, (dtype, shape, (begin, end)) in sorted(tensors.items(), key=lambda kv: kv[1][2]):
        if begin != end_prev or end < begin:
            raise _Bad(f"tensor {name!r}: data_offsets [{begin}, {end}] do not start where the "
                       f"previous tensor ends ({end_prev}); tensors must not overlap or leave gaps")
        end_prev = end
        n = 1
        for d in shape:
            n *= d
            if n >= _U64:
                raise _Bad(f"tensor {name!r}: shape {list(shape)} overflows")
        bits = n * _ST_BITS[dtype]
        if bits >= _U64:
            raise _Bad(f"tensor {name!r}: shape {list(shape)} overflows")
        if bits % 8:
            raise _Bad(f"tensor {name!r}: {list(shape)} {dtype} is not a whole number of bytes")
        if end - begin != bits // 8:
            raise _Bad(f"tensor {name!r}: data_offsets [{begin}, {end}] span {end - begin} bytes, "
                       f"but {dtype} {list(shape)} takes {bits // 8}")
    return meta, tensors, end_prev


def _safetensors(path: str) -> Dict[str, Callable[[], Any]]:
    """name -> a function returning the memory-mapped array (bfloat16 and
    float8 as ml_dtypes types, or as torch tensor views when ml_dtypes is
    absent), after checking the whole header."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise _Bad(f"{size} bytes is too short for the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > _ST_MAX_HEADER:
                raise _Bad(f"header length {n} exceeds the format's bound of {_ST_MAX_HEADER} bytes")
            if 8 + n > size:
                raise _Bad(f"header length {n} runs past the end of the file ({size} bytes)")
            raw = f.read(n)
        if len(raw) != n:
            raise _Bad("the file shrank while being read")
        _, tensors, data_len = _parse_header(raw)
        if 8 + n + data_len != size:
            raise _Bad(f"the tensors cover {data_len} bytes of data, the file holds {size - 8 - n}")
    except _Bad as e:
        raise FileError(f"{path}: not a valid safetensors file: {e}") from None
    return {name: partial(_st_array, path, name, 8 + n, *t) for name, t in tensors.items()}


def _st_array(path: str, name: str, base: int, dtype: str, shape: Tuple[int, ...],
              offsets: Tuple[int, int]) -> Any:
    torch_dtype = None
    if dtype in _ST_NUMPY:
        npdt = np.dtype(_ST_NUMPY[dtype])
    elif dtype in _ST_EXTRA:
        try:
            import ml_dtypes

            npdt = np.dtype(getattr(ml_dtypes, _ST_EXTRA[dtype]))
        except (ImportError, AttributeError):
            try:
                import torch

                torch_dtype = getattr(torch, _ST_EXTRA[dtype])
            except (ImportError, AttributeError):
                raise FileError(f"{path}: tensor {name!r} is {dtype}, which needs ml_dtypes "
                                f"(pip install ml_dtypes) or torch") from None
            npdt = np.dtype(np.uint16 if dtype == "BF16" else np.uint8)
    else:
        raise FileError(f"{path}: tensor {name!r} has dtype {dtype}, which lmmetrics cannot read")
    arr: npt.NDArray[Any]
    try:
        if offsets[1] > offsets[0]:
            arr = np.memmap(path, dtype=npdt, mode="r", offset=base + offsets[0], shape=shape)
        else:
            arr = np.zeros(shape, npdt)
    except (ValueError, OverflowError, OSError, MemoryError) as e:
        raise FileError(f"{path}: tensor {name!r} ({dtype} {list(shape)}) cannot be mapped: {_why(e)}") from None
    if torch_dtype is not None:  # a torch view of the mapped bits
        import torch

        with warnings.catch_warnings():  # the mapping is read-only, as intended
            warnings.simplefilter("ignore")
            return torch.from_numpy(np.asarray(arr)).view(torch_dtype)
    return arr


# ---------------------------------------------------------------------------


def _pt(path: str) -> Dict[str, Callable[[], Any]]:
    try:
        import torch
    except ImportError:
        raise FileError(f"{path}: reading .pt files needs torch") from None
    try:
        with warnings.catch_warnings():  # torch's deprecation notes on sparse / quantized storage
            warnings.simplefilter("ignore")
            # only the zip format (torch >= 1.6's default) can be mapped; a legacy file is read whole
            obj = torch.load(path, map_location="cpu", mmap=zipfile.is_zipfile(path), weights_only=True)
    except Exception as e:  # torch raises many kinds for a bad file
        raise FileError(f"{path}: cannot load as a torch file ({_why(e)})") from None
    if isinstance(obj, torch.Tensor):
        obj = {"": obj}
    if not (isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values())):
        raise FileError(f"{path}: expected a tensor or a dict of tensors, got {type(obj).__name__}")
    for k, v in obj.items():
        what = f"tensor {k!r}" if k != "" else "the tensor"
        if v.layout != torch.strided:
            raise FileError(f"{path}: {what} is {str(v.layout).replace('torch.', '')}; "
                            f"only dense (strided) tensors can be read")
        if v.device.type != "cpu":
            raise FileError(f"{path}: {what} is on the {v.device.type} device and holds no data")
        if v.is_quantized:
            raise FileError(f"{path}: {what} is quantized ({v.dtype}); dequantize it first")
    return {str(k): partial(_given, v) for k, v in obj.items()}


def _given(x: Any) -> Any:
    return x


def _npy(path: str) -> npt.NDArray[Any]:
    try:
        with warnings.catch_warnings(), np.errstate(all="raise"):  # a header's shape may overflow
            warnings.simplefilter("ignore")
            arr = np.load(path, mmap_mode="r")
    except Exception as e:  # numpy raises many kinds for a bad file
        raise FileError(f"{path}: cannot read as .npy ({_why(e)})") from None
    if not isinstance(arr, np.ndarray):  # an .npz zip or a pickle under the .npy name
        if hasattr(arr, "close"):
            arr.close()
        raise FileError(f"{path}: not an .npy file (it is {type(arr).__name__})")
    return arr


def _npz(path: str) -> Dict[str, Callable[[], Any]]:
    try:
        z = np.load(path)
    except Exception as e:  # zipfile.BadZipFile, ValueError, OSError, EOFError, ...
        raise FileError(f"{path}: cannot read as .npz ({_why(e)})") from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise FileError(f"{path}: not an .npz archive (it holds a single .npy array)")

    def get(k: str) -> npt.NDArray[Any]:
        try:
            a = z[k]
        except Exception as e:  # a corrupt member: BadZipFile, zlib.error, EOFError, ValueError
            raise FileError(f"{path}: cannot read member {k!r} ({_why(e)})") from None
        if not isinstance(a, np.ndarray):
            raise FileError(f"{path}: member {k!r} is not an .npy array")
        return a

    return {k: partial(get, k) for k in z.files}


def load_array(path: str, role: str, key: Optional[str] = None, prefer: Optional[str] = None) -> Any:
    """The array in ``path`` for ``role`` (``logits``, ``targets``, ...):
    the one named ``key``; without a key the one named ``prefer`` where the
    file holds one, else the file's only array, or the one named ``role``
    (for ``targets``, also one named ``labels``; a file holding both is an
    error naming the key option, as either may be meant)."""
    return load_named(path, role, key, prefer)[1]


def load_named(path: str, role: str, key: Optional[str] = None, prefer: Optional[str] = None) -> Tuple[str, Any]:
    """`load_array`'s array with its name in the file ("" for an
    ``.npy`` or a ``.pt`` of a bare tensor)."""
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        if not os.path.exists(path):
            raise FileError(f"{path}: no such file ({role})")
        raise FileError(f"{path}: unsupported format {ext or '(none)'} for {role}; "
                        f"use one of {', '.join(FORMATS)}")
    _regular_file(path, role)
    try:
        if ext == ".npy":
            return "", _npy(path)  # one unnamed array: a key does not apply
        return _pick(path, role, key, _getters(path, ext), prefer)
    except OSError as e:  # permission denied, an I/O error, a file gone meanwhile
        raise FileError(f"{path}: cannot read ({role}): {e.strerror or _why(e)}") from None


def _getters(path: str, ext: str) -> Dict[str, Callable[[], Any]]:
    """name -> a function giving the array, for a file of several arrays."""
    return {".npz": _npz, ".safetensors": _safetensors}.get(ext, _pt)(path)


def array_names(path: str) -> List[str]:
    """The names of the arrays in ``path``, sorted (``[""]`` for an
    ``.npy``, which holds one unnamed array)."""
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    if ext == ".npy":
        return [""]
    try:
        return sorted(_getters(path, ext))
    except OSError as e:
        raise FileError(f"{path}: cannot read: {e.strerror or _why(e)}") from None


def named_array(path: str, name: str) -> Optional[Any]:
    """The array named ``name`` in ``path`` (an .npz, .safetensors or .pt
    file of named arrays), or None where the file has no such name (an .npy
    has none)."""
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS or ext == ".npy":
        return None
    _regular_file(path, name)
    try:
        getters = _getters(path, ext)
        return getters[name]() if name in getters else None
    except OSError as e:
        raise FileError(f"{path}: cannot read ({name}): {e.strerror or _why(e)}") from None


def _pick(path: str, role: str, key: Optional[str], getters: Dict[str, Callable[[], Any]],
          prefer: Optional[str] = None) -> Tuple[str, Any]:
    names = sorted(getters)
    if key is not None:
        if key not in getters:
            raise FileError(f"{path}: no array named {key!r} (it holds {names})")
        return key, getters[key]()
    if prefer is not None and prefer in getters:
        return prefer, getters[prefer]()
    if len(getters) == 1:
        return names[0], getters[names[0]]()
    if not getters:
        raise FileError(f"{path}: holds no arrays")
    flag = _KEY_FLAGS.get(role)
    aliases = [name for name in _ALIASES.get(role, (role,)) if name in getters]
    if len(aliases) > 1:  # {targets, labels}: aligned and unshifted ids are both usual, either may be meant
        raise FileError(f"{path} holds several arrays {names}, of which {' and '.join(map(repr, aliases))} could "
                        f"each be the {role}: name the {role} one with {flag}")
    if aliases:
        return aliases[0], getters[aliases[0]]()
    if role in _LOGITS_ROLES:
        arrays = {k: getters[k]() for k in names}
        floats = [k for k, a in arrays.items() if "float" in dtype_name(a)]
        if len(floats) == 1:
            return floats[0], arrays[floats[0]]
    how = f"name the {role} one with {flag}" if flag else f"call the {role} one {role!r} in the file, or save it alone"
    raise FileError(f"{path} holds several arrays {names}: {how}")
