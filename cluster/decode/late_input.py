"""A step's input that arrives after its graph was built (`LateInput`): how a node builds its
steps ahead.

A model in one process builds step n+1 while the device runs step n, on step n's token still
on the device (cluster.decode.runner). A node of a pipeline cannot: its input (the head's
tokens, another node's hidden states) arrives as bytes from another process, and MLX has no
input that a built graph can take later. A `LateInput` is that input: a mailbox and the
doorbell that says it is filled. The runner builds the step it expects next on
`LateInput.input`; when the step's message arrives, the node's event loop writes its tokens or
hidden states into the mailbox and rings (`ring`), and the built step runs on them.

- `PinnedLateInput` (MLX CUDA): the input is a one-block kernel that waits on a word of pinned
  host memory, then copies the payload written beside it. The whole step is launched behind
  it, so the device starts the moment the bytes land; the node's host builds and launches the
  step while the other nodes compute. The ring must come from a thread
  other than the one that launched the step: MLX may block that thread while the device waits.
- `HostLateInput` (the CPU, Metal): the input is a slice of an MLX array that the ring writes
  through its buffer, so the step can only be built ahead, not launched (`launches_ahead`):
  evaluated before the ring, it would read the last payload.

A step built on a late input that is rung without data (`ring(None)`: the node got something
else) runs on whatever the mailbox holds, and the runner undoes it from its marks.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import logging
import threading

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)

PAYLOAD_OFFSET = 256  # bytes: the sequence word lives alone at the mailbox's start
_ALIGN = 16  # the kernel copies 16-byte words


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class LateInput:
    """The mailbox and its sequence numbers; subclasses give the device's input."""

    launches_ahead = False

    def __init__(self) -> None:
        self._seq = 0
        self.pending: int | None = None  # armed and not yet rung
        self._delivered: int | None = None  # the last sequence rung with data
        self._order = threading.Lock()

    # -- the event loop's side ---------------------------------------------------------------

    def prepare(self, nbytes: int) -> int:
        """Room for `nbytes` of payload; the sequence number the next step waits for. Called
        while nothing waits on the mailbox (before the build is submitted)."""
        if self.pending is not None:
            raise RuntimeError("a doorbell step is still armed")
        self._reserve(_padded(nbytes))
        self._seq = self._seq % 0xFFFFFFF0 + 1
        return self._seq

    def arm(self, seq: int) -> None:
        """From now on the step built on `seq` waits for `ring`."""
        self.pending = seq

    def ring(self, data: bytes | None) -> None:
        """Deliver the armed step's input (None: release it without data). Thread-safe against
        the builder; never call it from the thread that launched the step."""
        seq, self.pending = self.pending, None
        if seq is None:
            return
        if data is not None:
            self._write_payload(data)
            self._delivered = seq
        # The payload's stores before the sequence word's (x86 keeps store order; a lock's
        # release and acquire order them on weaker memory models).
        with self._order:
            pass
        self._write_seq(seq)

    # -- the builder's side (the MLX thread) ------------------------------------------------

    def delivered(self, seq: int) -> bool:
        """Whether `seq` was rung with its step's data."""
        return self._delivered == seq

    def input(self, seq: int, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
        raise NotImplementedError

    # -- the mailbox --------------------------------------------------------------------------

    def _reserve(self, nbytes: int) -> None:
        raise NotImplementedError

    def _write_payload(self, data: bytes) -> None:
        raise NotImplementedError

    def _write_seq(self, seq: int) -> None:
        raise NotImplementedError


class HostLateInput(LateInput):
    """The input is the first bytes of an MLX array that `ring` overwrites in place."""

    def __init__(self) -> None:
        super().__init__()
        self._mailbox: mx.array | None = None
        self._view: np.ndarray | None = None

    def _reserve(self, nbytes: int) -> None:
        if self._mailbox is not None and self._mailbox.size >= nbytes:
            return
        self._mailbox = mx.zeros((max(nbytes, 4096),), dtype=mx.uint8)
        mx.eval(self._mailbox)  # now, on the caller's thread: the MLX thread only reads it
        self._view = np.array(self._mailbox, copy=False)  # the array's own buffer
        if not self._view.flags.writeable:
            raise RuntimeError("this MLX build gives no writable view of an array's buffer")

    def input(self, seq: int, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
        nbytes = int(np.prod(shape)) * dtype.size
        return self._mailbox[:nbytes].view(dtype).reshape(shape)

    def _write_payload(self, data: bytes) -> None:
        self._view[: len(data)] = np.frombuffer(data, dtype=np.uint8)

    def _write_seq(self, seq: int) -> None:
        pass  # nothing waits: the step is evaluated after the ring


_WAIT_AND_COPY = """
  // One block: thread 0 waits for the host to write this step's sequence number, then every
  // thread copies the payload (16-byte words) into the output.
  const char* box = reinterpret_cast<const char*>(address[0]);
  const unsigned int want = seq[0];
  if (threadIdx.x == 0) {
    while (__ldcv(reinterpret_cast<const unsigned int*>(box)) != want) {
      __nanosleep(128);
    }
    __threadfence_system();
  }
  __syncthreads();
  const uint4* payload = reinterpret_cast<const uint4*>(box + PAYLOAD_OFFSET);
  uint4* into = reinterpret_cast<uint4*>(out);
  const int words = (int)words16[0];
  for (int i = threadIdx.x; i < words; i += blockDim.x) {
    into[i] = __ldcv(payload + i);
  }
"""


@functools.cache
def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime MLX runs on, for pinned host memory (None where there is none)."""
    names = [ctypes.util.find_library("cudart"), "libcudart.so.13", "libcudart.so.12"]
    names += sorted(glob.glob("/usr/local/cuda*/lib64/libcudart.so.*"), reverse=True)
    for name in names:
        if not name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


class PinnedLateInput(LateInput):
    """MLX CUDA: the mailbox is pinned host memory that the device reads directly; the input
    kernel waits for its sequence number, so a step can be launched before its input exists."""

    launches_ahead = True

    def __init__(self) -> None:
        super().__init__()
        self._cudart = _cudart()
        if self._cudart is None:
            raise RuntimeError("no CUDA runtime library found")
        self._pointer: int | None = None
        self._size = 0
        self._view: np.ndarray | None = None
        self._kernel = mx.fast.cuda_kernel(
            name="doorbell_input",
            input_names=["address", "seq", "words16"],
            output_names=["out"],
            source=_WAIT_AND_COPY,
            header=f"#define PAYLOAD_OFFSET {PAYLOAD_OFFSET}\n",
        )

    def _reserve(self, nbytes: int) -> None:
        size = PAYLOAD_OFFSET + max(nbytes, 1 << 16)
        if self._pointer is not None and self._size >= size:
            return
        size = max(size, 2 * self._size)
        pointer = ctypes.c_void_p()
        # cudaHostAllocPortable | cudaHostAllocMapped: every context sees it at one address.
        status = self._cudart.cudaHostAlloc(ctypes.byref(pointer), ctypes.c_size_t(size), 0x3)
        if status != 0 or not pointer.value:
            raise RuntimeError(f"cudaHostAlloc of {size} bytes failed (error {status})")
        if self._pointer is not None:
            self._cudart.cudaFreeHost(ctypes.c_void_p(self._pointer))
        self._pointer, self._size = pointer.value, size
        raw = ctypes.cast(pointer, ctypes.POINTER(ctypes.c_uint8))
        self._view = np.ctypeslib.as_array(raw, shape=(size,))
        self._seq_word = np.ctypeslib.as_array(
            ctypes.cast(pointer, ctypes.POINTER(ctypes.c_uint32)), shape=(1,)
        )
        self._seq_word[0] = 0
        self._address = mx.array(np.array([self._pointer], dtype=np.uint64))

    def input(self, seq: int, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
        nbytes = int(np.prod(shape)) * dtype.size
        words = _padded(nbytes) // 4
        (out,) = self._kernel(
            inputs=[self._address, mx.array([seq], dtype=mx.uint32),
                    mx.array([words // 4], dtype=mx.int32)],
            grid=(256, 1, 1),
            threadgroup=(256, 1, 1),
            output_shapes=[(words,)],
            output_dtypes=[mx.uint32],
        )  # fmt: skip
        out = out.view(mx.uint8)
        if out.size != nbytes:
            out = out[:nbytes]
        return out.view(dtype).reshape(shape)

    def _write_payload(self, data: bytes) -> None:
        start = PAYLOAD_OFFSET
        self._view[start : start + len(data)] = np.frombuffer(data, dtype=np.uint8)

    def _write_seq(self, seq: int) -> None:
        self._seq_word[0] = seq  # one aligned 32-bit store


BUILD_AHEAD_SETTINGS = ("auto", "on", "off")


def late_input_for(setting: str = "auto") -> LateInput | None:
    """A node's late input (`cluster node --build-ahead`): "auto", pinned on MLX CUDA, where
    launching a node's step ahead pays (its device starts the moment the input lands), and
    none elsewhere; "on",
    pinned on CUDA and a `HostLateInput` elsewhere (steps built ahead, not launched: not
    measured to pay on the CPU or Metal); "off", none."""
    if setting not in BUILD_AHEAD_SETTINGS:
        raise ValueError(f"build-ahead setting {setting!r} is not one of {BUILD_AHEAD_SETTINGS}")
    if setting == "off":
        return None
    if mx.default_device() == mx.gpu and mx.cuda.is_available():
        try:
            return PinnedLateInput()
        except RuntimeError as error:
            if setting == "on":
                raise ValueError(f"steps cannot be built ahead here: {error}") from error
            log.warning("steps are not built ahead: %s", error)
            return None
    return HostLateInput() if setting == "on" else None
