"""The error texts with which TensorFlow and XLA report a failed allocation.

`tfmemsafe.is_oom_error` counts an error as out-of-memory when it is a
`tf.errors.ResourceExhaustedError`, or when it is another
`tf.errors.OpError` or a `RuntimeError` (XLA's `XlaRuntimeError`) whose
message matches one of the patterns below. Every pattern is taken from
the TensorFlow, XLA or CUDA source that produces it (paths are relative
to github.com/tensorflow/tensorflow or github.com/openxla/xla) and states
that memory ran out; see `is_allocation_failure_text`.

Deliberately NOT counted, because the message does not say that memory
ran out and the usual cause is an installation problem (a missing or
mismatched cuDNN/cuBLAS, an old driver):

- "Failed to get convolution algorithm. This is probably because cuDNN
  failed to initialize" (`UnknownError`; tensorflow/core/kernels/
  conv_ops.cc up to TF 2.5, and the MIOpen twin in conv_ops_gpu.cc);
- "cudnn library could not create a handle: CUDNN_STATUS_NOT_INITIALIZED"
  or "...: CUDNN_STATUS_INTERNAL_ERROR" (`InternalError`; xla/
  stream_executor/cuda/cuda_dnn.cc, `CudnnSupport::Init`);
- "DNN library is not found." (`UnimplementedError`; xla/stream_executor)
  and "DNN library initialization failed" (`FailedPreconditionError`);
- "CUBLAS_STATUS_NOT_INITIALIZED" and "Attempting to perform BLAS
  operation using StreamExecutor without BLAS support" (xla/
  stream_executor/cuda/cuda_blas.cc logs that this "may be due to OOM ...
  or may be because this binary was not built with support for the GPU").

When memory is the cause, only the log says so ("Could not create cudnn
handle: ... Memory usage: N bytes free"), and it is memory the library
could not get outside TensorFlow's allocator when it created its handle
(typically because the allocator had reserved the whole GPU: memory growth
off). The allocator keeps what it has reserved when the batch shrinks, so
a retry at a smaller batch would not succeed either; it would only bury
the real error under "could not fit a batch of 1". Memory growth (on by
default in `tfmemsafe.configure`) is the fix for those, not halving.
Other cuDNN and cuBLAS
statuses (CUDNN_STATUS_BAD_PARAM, CUDNN_STATUS_NOT_SUPPORTED,
CUBLAS_STATUS_INVALID_VALUE, ...) are programming or support errors.
"""

from __future__ import annotations

import codecs
import math
import re

# Each pattern states that an allocation failed; where it comes from.
ALLOCATION_FAILURE_PATTERNS = tuple(
    re.compile(pattern)
    for pattern in (
        # The status code's name, as XLA and absl print a status
        # ("RESOURCE_EXHAUSTED: ...") inside Internal or Unknown errors.
        r"\bRESOURCE_EXHAUSTED\b",
        # tensorflow/core/framework/op_kernel.cc (allocate_tensor) and
        # tensorflow/core/common_runtime/gpu/gpu_device.cc
        # (MaybeCopyTensorToGPU): "OOM when allocating tensor with shape".
        r"\bOOM when allocating\b",
        # xla/stream_executor/integrations/tf_allocator_adapter.cc
        # (MemoryAllocationError): "Out of memory while trying to allocate
        # N bytes." and "Out of host memory while trying to allocate".
        r"\bOut of (?:host )?memory while trying to allocate\b",
        # xla/tsl/framework/bfc_allocator.cc: "Allocator (GPU_0_bfc) ran out
        # of memory trying to allocate 2.0GiB". Usually only logged.
        r"\bran out of memory trying to allocate\b",
        # tensorflow/core/common_runtime/gpu/gpu_util.cc and
        # pluggable_device/pluggable_device_util.cc: a host-to-device copy
        # whose destination could not be allocated (InternalError).
        r"\bDst tensor is not initialized\b",
        # xla/stream_executor/cuda/cuda_dnn.cc (CudnnStatusToString):
        # cuDNN's own allocation failed, e.g. "cudnn library could not
        # create a handle: CUDNN_STATUS_ALLOC_FAILED" (InternalError) or a
        # failed call (UnknownError).
        r"\bCUDNN_STATUS_ALLOC_FAILED\b",
        # xla/stream_executor/cuda/cuda_blas.cc (DoBlasInternalImpl returns
        # InternalError(ToString(status))): cuBLAS's workspace or handle.
        r"\bCUBLAS_STATUS_ALLOC_FAILED\b",
        # The CUDA driver's error name, as xla/stream_executor/cuda prints
        # driver errors ("...: CUDA_ERROR_OUT_OF_MEMORY: out of memory").
        r"\bCUDA_ERROR_OUT_OF_MEMORY\b",
        # The CUDA runtime's error name, e.g. in cuda_dnn.cc: "There was an
        # error before creating cudnn handle (2): cudaErrorMemoryAllocation".
        r"\bcudaErrorMemoryAllocation\b",
        # DnnScratchAllocator (tensorflow/core/kernels/conv_ops_gpu.h): a
        # cuDNN workspace that did not fit; listed in the NotFoundError
        # "No algorithm worked!  Error messages: ..." of gpu_utils.cc.
        r"\bFailed to allocate the requested memory size\b",
    )
)

# `ResourceExhaustedError`s that are not about memory. TensorFlow maps these
# errno values to RESOURCE_EXHAUSTED when a file or socket operation fails
# (ErrnoToCode in xla/tsl/platform/errors.cc; the message ends with
# strerror's text), and gRPC reports an oversized message with the same
# code. A smaller batch fixes none of them, so they are never retried.
OTHER_RESOURCE_PATTERNS = tuple(
    re.compile(pattern)
    for pattern in (
        r"\bNo space left on device\b",  # ENOSPC
        r"\bDisk quota exceeded\b",  # EDQUOT
        r"\bToo many open files\b",  # EMFILE, ENFILE ("... in system")
        r"\bToo many links\b",  # EMLINK
        r"\bNo buffer space available\b",  # ENOBUFS
        r"\bNo data available\b",  # ENODATA
        r"\bOut of streams resources\b",  # ENOSR
        r"\bToo many users\b",  # EUSERS
        # grpc/src/core (message_size_filter): "Received message larger
        # than max (N vs. M)" and "Sent message larger than max".
        r"\b(?:Received|Sent) message larger than max\b",
    )
)


def is_other_resource_text(message: str) -> bool:
    """Whether a RESOURCE_EXHAUSTED message is about something not memory.

    A message that also reports a failed allocation is about memory.
    """
    if any(pattern.search(message) for pattern in ALLOCATION_FAILURE_PATTERNS):
        return False
    return any(pattern.search(message) for pattern in OTHER_RESOURCE_PATTERNS)


# Device::MakeTensorFromProto (tensorflow/core/common_runtime/
# threadpool_device.cc, gpu/gpu_device.cc, pluggable_device/
# pluggable_device.cc), called by the ConstantOp constructor
# (tensorflow/core/kernels/constant_op.cc), returns this InvalidArgumentError
# with the proto's DebugString whenever Tensor::FromProto returns false.
_PROTO_MARKER = "Cannot parse tensor from proto:"

# Tensor::FromProto (tensorflow/core/framework/tensor.cc) returns false for
# an invalid shape, DT_INVALID or an unsupported dtype, `tensor_content` of
# the wrong size, or undecodable strings and variants -- or when the
# allocator returns null. For these simple dtypes with a valid shape of
# N > 0 elements and either no `tensor_content` (the value fields never
# fail: FromProtoField pads or truncates them) or one of exactly N * size
# bytes, the allocation is the only thing left that can fail.
_DTYPE_SIZES = {
    "DT_FLOAT": 4,
    "DT_DOUBLE": 8,
    "DT_HALF": 2,
    "DT_BFLOAT16": 2,
    "DT_INT8": 1,
    "DT_UINT8": 1,
    "DT_INT16": 2,
    "DT_UINT16": 2,
    "DT_INT32": 4,
    "DT_UINT32": 4,
    "DT_INT64": 8,
    "DT_UINT64": 8,
    "DT_BOOL": 1,
    "DT_COMPLEX64": 8,
    "DT_COMPLEX128": 16,
    "DT_QINT8": 1,
    "DT_QUINT8": 1,
    "DT_QINT16": 2,
    "DT_QUINT16": 2,
    "DT_QINT32": 4,
}
_MAX_RANK = 254  # TensorShape::MaxDimensions().
_DTYPE = re.compile(r"\bdtype:\s*(DT_\w+)")
_SHAPE = re.compile(r"\btensor_shape\s*\{")
_DIM = re.compile(r"\bdim\s*\{([^{}]*)\}")
_SIZE = re.compile(r"\bsize:\s*(-?\d+)")
_CONTENT = re.compile(r'\btensor_content:\s*"((?:[^"\\]|\\.)*)"', re.DOTALL)


def is_allocation_failure_text(message: str) -> bool:
    """Whether an error message reports a failed allocation."""
    if any(pattern.search(message) for pattern in ALLOCATION_FAILURE_PATTERNS):
        return True
    return _is_failed_tensor_from_proto(message)


def _is_failed_tensor_from_proto(message: str) -> bool:
    """Whether "Cannot parse tensor from proto" was a failed allocation.

    Grappler turns large zero-filled tensors into constants (an AddN
    rewritten into a temporary variable initialised from a `tmp_var_zeros`
    constant of the whole batch's shape, say); when the allocator cannot
    hold one, TensorFlow reports it as a parse error. The message carries
    the proto, so the cases where parsing itself could have failed can be
    ruled out. The other texts of this failure (grappler's and
    SingleThreadedCpuDevice's "Cannot parse tensor from tensor_proto.")
    carry no proto, are swallowed by the optimizer, and are not counted.
    """
    start = message.find(_PROTO_MARKER)
    if start < 0:
        return False
    proto = message[start + len(_PROTO_MARKER) :]
    # The proto ends where the node annotation ("[[{{node ...}}]]") begins,
    # unless that is inside its `tensor_content` string.
    node = proto.find("[[")
    content = _CONTENT.search(proto)
    if content is not None and node >= 0 and content.start() > node:
        content = None
    if content is not None:
        head = proto[: content.start()]  # dtype and shape come first.
    else:
        head = proto if node < 0 else proto[:node]
    dtype = _DTYPE.search(head)
    shape_start = _SHAPE.search(head)
    if not dtype or dtype.group(1) not in _DTYPE_SIZES or not shape_start:
        return False
    shape = _braced_block(head, shape_start.end())
    if shape is None or "unknown_rank" in shape:
        return False
    sizes = []
    for dim in _DIM.findall(shape):
        size = _SIZE.search(dim)
        sizes.append(int(size.group(1)) if size else 0)  # 0 is not printed.
    if len(sizes) > _MAX_RANK or any(size < 0 for size in sizes):
        return False
    num_elements = math.prod(sizes)
    if num_elements == 0:  # Nothing to allocate.
        return False
    if content is None:
        return True
    try:
        data = codecs.escape_decode(content.group(1).encode("latin-1"))[0]
    except (UnicodeEncodeError, ValueError):
        return False
    return len(data) == num_elements * _DTYPE_SIZES[dtype.group(1)]


def _braced_block(text: str, start: int) -> str | None:
    """The text from `start` to the brace that closes the one before it."""
    depth = 1
    for index in range(start, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[start:index]
    return None
