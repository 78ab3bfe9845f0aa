"""Variables' values in files, put back in pieces.

Files in a temporary directory, written about 16 MiB at a time past the
page cache, and read back into tensors by TensorFlow ops one piece (at
most 1 MiB) at a time. So the host memory a copy takes does not grow
with the model (a host copy of a 1B-parameter model's Adam state would be
12 GB), and putting a value back never converts a host array to a
tensor: that conversion ends the process inside TensorFlow when memory
is short, where an op raises.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import mmap
import os
import shutil
import tempfile
import weakref

import numpy as np
import tensorflow as tf

# The largest saved piece: what putting a value back needs free at least.
# (Reading a slice of a larger saved tensor does not help: it needs more
# free than the slice, and fails with "Bad address" where the slice fit.)
_PIECE_BYTES = 2**20
# The most written or read at once: the host (and, on a GPU, the device)
# memory a copy needs beyond the model, give or take one piece.
_FILE_BYTES = 16 * 2**20


class DiskCopy:
    """Variables' values in files, to put back in pieces.

    Each piece is a part of one variable of at most `_PIECE_BYTES` (see
    `_cuts`), several to a file up to `_FILE_BYTES`. A file holds the
    pieces' bytes one after another, padded at its end to a multiple of
    `_ALIGNMENT`, written with `O_DIRECT` where the file system allows
    it: past the page cache, whose fresh pages cost the kernel about as
    much as the data is large (a buffered write of 217 MiB took 0.77 s of
    system time the first time in a process, 0.05 s direct). On a CPU a
    piece of whole rows is read from the variable's memory (a view); on a
    GPU each piece is copied to the host as it is written. Pieces of a
    type that has no fixed-size bytes (strings) go through TensorFlow's
    checkpoint writer (`SaveV2`) instead.

    Putting back reads a file (host memory, not the device's allocator)
    and makes each piece a tensor by ops (`decode_raw`): the device
    memory it needs is one piece at a time.

    Args:
        entries: list of `(source, targets)`: the `tf.Variable` read, and
            the `tf.Variable`s its value is put back into.
    """

    def __init__(self, entries):
        self.directory = tempfile.mkdtemp(prefix="tfmemsafe-state-")
        # Deleted with this object at the latest, also after an exception.
        self._delete = weakref.finalize(
            self, shutil.rmtree, self.directory, ignore_errors=True
        )
        # (path, [(dtype, cut, targets)], [(offset, size, shape)] or None
        # for a `SaveV2` file).
        self.files = []
        # Where raw pieces are gathered, page-aligned as `O_DIRECT` needs.
        # A file is written once it holds `_FILE_BYTES`, so before its
        # last piece (at most `_PIECE_BYTES`) it held less: this is room
        # enough, padding included. Anonymous: pages cost nothing untouched.
        buffer = mmap.mmap(-1, _FILE_BYTES + _PIECE_BYTES)
        groups = {True: ([], [], 0), False: ([], [], 0)}
        try:
            for source, targets in entries:
                value = source.read_value()
                raw = _has_bytes(source.dtype)
                # On a CPU the variable's own memory (`__array__` shares
                # it), cut in NumPy: no op, no copy.
                host = np.asarray(value) if raw and _on_cpu(value) else None
                for cut in _cuts(value):
                    if host is not None:
                        piece = host if cut is None else host[_index(cut)]
                    else:
                        piece = value if cut is None else value[_index(cut)]
                    tensors, pieces, size = groups[raw]
                    tensors.append(piece)
                    pieces.append((source.dtype, cut, targets))
                    size += _bytes(piece)
                    groups[raw] = (tensors, pieces, size)
                    if size >= _FILE_BYTES:
                        self._write(buffer, raw, tensors, pieces)
                        groups[raw] = ([], [], 0)
                del value, host
            for raw, (tensors, pieces, _) in groups.items():
                if tensors:
                    self._write(buffer, raw, tensors, pieces)
        finally:
            # A traceback may still hold a view of it: then it is closed
            # when collected.
            with contextlib.suppress(BufferError):
                buffer.close()

    def _write(self, buffer, raw: bool, tensors, pieces) -> None:
        path = os.path.join(self.directory, str(len(self.files)))
        if not raw:
            tf.raw_ops.SaveV2(
                prefix=path,
                tensor_names=[str(i) for i in range(len(tensors))],
                shape_and_slices=[""] * len(tensors),
                tensors=tensors,
            )
            self.files.append((path, pieces, None))
            return
        layout, used = [], 0
        for tensor in tensors:
            size = _bytes(tensor)
            layout.append((used, size, tensor.shape))
            used += size
        # `O_DIRECT` writes whole blocks: the file ends in padding.
        end = -(-used // _ALIGNMENT) * _ALIGNMENT
        with memoryview(buffer) as view:
            for tensor, (offset, size, _) in zip(tensors, layout, strict=True):
                # A piece on a GPU is copied to the host here, one by one.
                array = np.ascontiguousarray(np.asarray(tensor))
                view[offset : offset + size] = array.reshape(-1).view(np.uint8)
            with view[:end] as data:
                _write_file(path, data)
        self.files.append((path, pieces, layout))

    def restore(self) -> None:
        """Puts every value back, a file's pieces at a time.

        A raw file's pieces are made tensors one by one. Where a `SaveV2`
        file's pieces cannot be read at once (after an out-of-memory
        error, while something else still holds memory, 16 MiB may not be
        free), they are read one by one. A `ResourceExhaustedError` is
        raised only where even one piece (at most `_PIECE_BYTES`) cannot
        be read.
        """
        for path, pieces, layout in self.files:
            if layout is not None:
                contents = tf.io.read_file(path)
                for piece, place in zip(pieces, layout, strict=True):
                    value = _decode(contents, piece[0], place)
                    _put(value, piece)
                    del value
                del contents
                continue
            try:
                values = _read(path, range(len(pieces)), pieces)
            except tf.errors.ResourceExhaustedError:
                gc.collect()
                for index, piece in enumerate(pieces):
                    (value,) = _read(path, [index], [piece])
                    _put(value, piece)
                    del value
                continue
            for value, piece in zip(values, pieces, strict=True):
                _put(value, piece)
            del values

    def close(self) -> None:
        self._delete()


# What the length of an `O_DIRECT` write needs to be a multiple of.
_ALIGNMENT = 4096
# What `tf.io.decode_raw` makes directly; other types through bytes.
_DECODED = frozenset(
    [
        tf.float16,
        tf.bfloat16,
        tf.float32,
        tf.float64,
        tf.int8,
        tf.int16,
        tf.int32,
        tf.int64,
        tf.uint8,
        tf.uint16,
        tf.complex64,
        tf.complex128,
        tf.bool,
    ]
)


def _on_cpu(value) -> bool:
    return tf.DeviceSpec.from_string(value.device).device_type == "CPU"


def _has_bytes(dtype) -> bool:
    """Whether `dtype`'s values are fixed-size bytes (not strings)."""
    dtype = tf.as_dtype(dtype)
    return dtype != tf.string and dtype.is_numpy_compatible


def _write_file(path: str, data) -> None:
    """Writes `data` (a multiple of `_ALIGNMENT` bytes, page-aligned) to a
    new file, with `O_DIRECT` where the file system takes it."""
    direct = getattr(os, "O_DIRECT", 0)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    if direct:
        try:
            descriptor = os.open(path, flags | direct, 0o600)
        except OSError:  # tmpfs and others refuse it: EINVAL.
            pass
        else:
            try:
                _write_all(descriptor, data)
                return
            except OSError:  # Refused at the first write by some.
                pass
            finally:
                os.close(descriptor)
            os.remove(path)
    descriptor = os.open(path, flags, 0o600)
    try:
        _write_all(descriptor, data)
    finally:
        os.close(descriptor)


def _write_all(descriptor: int, data) -> None:
    written = 0
    while written < len(data):
        written += os.write(descriptor, data[written:])


def _decode(contents, dtype, place):
    """A raw file's piece at `place` (`(offset, size, shape)`), a tensor."""
    offset, size, shape = place
    data = tf.strings.substr(contents, offset, size)
    dtype = tf.as_dtype(dtype)
    if dtype in _DECODED:
        return tf.reshape(tf.io.decode_raw(data, dtype), shape)
    values = tf.reshape(tf.io.decode_raw(data, tf.uint8), [-1, dtype.size])
    return tf.reshape(tf.bitcast(values, dtype), shape)


def _read(path: str, indices, pieces) -> list:
    """The saved pieces `indices` of `SaveV2` file `path`, as tensors."""
    return tf.raw_ops.RestoreV2(
        prefix=path,
        tensor_names=[str(i) for i in indices],
        shape_and_slices=[""] * len(pieces),
        dtypes=[dtype for dtype, *_ in pieces],
    )


def _put(value, piece) -> None:
    """Assigns a saved piece's `value` back to its variables."""
    _, cut, targets = piece
    for target in targets:
        if cut is None:
            target.assign(value)
            continue
        prefix, begin, end = cut
        # Not `target[...].assign(value)`: that reads the whole variable
        # first, which may copy it (16 MiB that a short memory did not
        # have, measured).
        tf.raw_ops.ResourceStridedSliceAssign(
            ref=target.handle,
            begin=[*prefix, begin],
            end=[*(i + 1 for i in prefix), end],
            strides=[1] * (len(prefix) + 1),
            value=value,
            shrink_axis_mask=(1 << len(prefix)) - 1,
        )


def _bytes(value) -> int:
    """The size of a tensor or a NumPy array, in bytes."""
    if isinstance(value, np.ndarray):
        return value.nbytes
    return value.dtype.size * int(np.prod(value.shape))


def _cuts(value) -> list:
    """Where to cut `value` in pieces of at most `_PIECE_BYTES`.

    `None` for the whole value: a scalar, or one that small. Else
    `(prefix, begin, end)`s: the indices of the leading axes, and a range
    along the next, the outermost axis along which one index holds no
    more than a piece (a conv kernel `(3, 3, 512, 512)` of 9 MiB is cut
    in nine: each `(i, j)` of its first two axes). On a CPU a piece of
    whole rows (no prefix) is a view; others are copied, a piece at a
    time.
    """
    size = _bytes(value)
    shape = value.shape.as_list()
    if not shape or size <= _PIECE_BYTES:
        return [None]
    axis, block = 0, size // shape[0]
    while block > _PIECE_BYTES:
        axis += 1
        block //= shape[axis]
    step = max(1, _PIECE_BYTES // block)
    return [
        (prefix, begin, min(shape[axis], begin + step))
        for prefix in itertools.product(*map(range, shape[:axis]))
        for begin in range(0, shape[axis], step)
    ]


def _index(cut) -> tuple:
    prefix, begin, end = cut
    return (*prefix, slice(begin, end))
