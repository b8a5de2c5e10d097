"""Wire codec and ZMQ sockets between the orchestrator and the stage processes.

Codec
-----
`encode(msg)` turns a `protocol` message into a list of ZMQ frames:

* frame 0: the message as msgpack, in which every numpy array is replaced by a msgpack
  extension value (a reference): dtype code, shape, and the index of the frame that holds
  its bytes;
* frames 1..: the arrays' buffers, C-contiguous, as memoryviews of the arrays themselves
  (ZMQ sends them without copying).

Arrays smaller than `inline_threshold` bytes (default 1 KiB) are instead carried inside
frame 0 (a second extension type holding header and bytes): a ZMQ frame costs more than
copying a few hundred bytes, and per-message overhead is what the orchestrator pays for
every decode step.

`decode(frames, type)` decodes frame 0 with a typed msgspec decoder (`StageRequest` on the
stage side, `StageReply` on the orchestrator side) and rebuilds each array with
`np.frombuffer(frame, dtype).reshape(shape)`: no copy, the array is a view of the received
ZMQ frame (writable; it keeps the frame alive). The exception: a frame ZMQ delivered at an
unaligned address (frames of a few KB can share ZMQ's receive buffer) is copied.
Anything malformed (bad msgpack, a message of the wrong type or shape, a frame index out
of range, a buffer whose size does not match dtype x shape, an unknown dtype or
extension) raises `ProtocolError`. Nothing from the wire is ever executed: msgpack only
builds plain values and the Structs of `protocol`, and there is no pickle anywhere.

Supported dtypes: bool, uint8/16/32/64, int8/16/32/64, float16, bfloat16 (ml_dtypes),
float32, float64. Non-native byte order is converted on encode; object, string, complex and
structured arrays are refused.

Both functions are thread-safe: the encoder collects array frames in a per-call list, and
the decoder reaches the current message's frames through a thread-local slot, so the
orchestrator thread and an API thread may encode and decode at the same time.

Sockets
-------
One PUSH/PULL pair per direction per stage:

* requests: orchestrator PUSH --bind--> `<ipc_dir>/<stage>-requests` <--connect-- stage PULL
* replies:  stage PUSH --connect--> `<ipc_dir>/<stage>-replies` <--bind-- orchestrator PULL

The orchestrator BINDS both sockets (it owns the private ipc dir and outlives the stages;
a restarted stage reconnects to the same addresses), the stage CONNECTS. `ipc://` paths
live in a private temp dir (mode 0700) so no other user can connect; TCP is opt-in
(`tcp_address`) for a stage placed on another host and binds to 127.0.0.1 unless told
otherwise. `Channel` wraps one socket: `send(msg)`, `recv(timeout_ms)`, `recv_or_drop`.
"""

from __future__ import annotations

import logging
import math
import os
import re
import struct
import tempfile
import threading
from typing import Any, Callable, NamedTuple, Sequence

import ml_dtypes
import msgspec
import numpy as np
import zmq

from ..errors import ProtocolError

__all__ = [
    "ProtocolError",
    "Codec",
    "encode",
    "decode",
    "INLINE_THRESHOLD",
    "SUPPORTED_DTYPES",
    "private_ipc_dir",
    "ipc_address",
    "tcp_address",
    "StageAddresses",
    "stage_addresses",
    "Channel",
    "DEFAULT_HWM",
]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------
# Codec
# ---------------------------------------------------------------------------------------

# msgpack extension type codes for array references.
EXT_ARRAY_FRAME = 1  # header + uint32 frame index; the bytes are in that frame
EXT_ARRAY_INLINE = 2  # header + the bytes themselves

# Arrays below this many bytes travel inside frame 0 (see module docstring).
INLINE_THRESHOLD = 1024

# Wire dtype codes. Fixed numbers (not numpy's dtype strings) so a peer cannot name an
# arbitrary dtype such as object; append only, never renumber.
_DTYPE_BY_CODE: dict[int, np.dtype] = {
    1: np.dtype(np.bool_),
    2: np.dtype(np.uint8),
    3: np.dtype(np.int8),
    4: np.dtype(np.int16),
    5: np.dtype(np.int32),
    6: np.dtype(np.int64),
    7: np.dtype(np.uint16),
    8: np.dtype(np.uint32),
    9: np.dtype(np.uint64),
    10: np.dtype(np.float16),
    11: np.dtype(ml_dtypes.bfloat16),
    12: np.dtype(np.float32),
    13: np.dtype(np.float64),
}
_CODE_BY_DTYPE: dict[np.dtype, int] = {dt: code for code, dt in _DTYPE_BY_CODE.items()}
SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(_DTYPE_BY_CODE.values())

# numpy 2 allows 64 dimensions; nothing here needs more than a handful.
_MAX_NDIM = 32
_HEAD = struct.Struct("<BB")  # dtype code, ndim; then ndim x uint64 shape
_INDEX = struct.Struct("<I")


def _pack_header(code: int, shape: tuple[int, ...]) -> bytes:
    return _HEAD.pack(code, len(shape)) + struct.pack(f"<{len(shape)}Q", *shape)


def _unpack_header(data: memoryview) -> tuple[np.dtype, tuple[int, ...], int]:
    """(dtype, shape, offset of what follows) of an array reference, validated."""
    if len(data) < _HEAD.size:
        raise ProtocolError(f"array reference of {len(data)} bytes is too short")
    code, ndim = _HEAD.unpack_from(data)
    dtype = _DTYPE_BY_CODE.get(code)
    if dtype is None:
        raise ProtocolError(f"array reference has unknown dtype code {code}")
    if ndim > _MAX_NDIM:
        raise ProtocolError(f"array reference has {ndim} dimensions (max {_MAX_NDIM})")
    end = _HEAD.size + 8 * ndim
    if len(data) < end:
        raise ProtocolError(f"array reference of {len(data)} bytes is too short for {ndim} dims")
    return dtype, struct.unpack_from(f"<{ndim}Q", data, _HEAD.size), end


def _array_from_buffer(buf: memoryview, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """View `buf` as an array of `dtype` and `shape`, after checking the sizes agree."""
    expected = math.prod(shape) * dtype.itemsize
    if buf.nbytes != expected:
        raise ProtocolError(
            f"array of dtype {dtype.name} and shape {shape} needs {expected} bytes, "
            f"its buffer has {buf.nbytes}")
    if dtype == np.bool_ and buf.nbytes and np.frombuffer(buf, np.uint8).max() > 1:
        # numpy would accept any byte as a bool and give it odd arithmetic; refuse.
        raise ProtocolError("bool array holds bytes other than 0 and 1")
    try:
        return np.frombuffer(buf, dtype).reshape(shape)
    except (ValueError, OverflowError, TypeError) as e:  # e.g. a dim beyond intp
        raise ProtocolError(f"cannot build array of shape {shape}: {e}") from None


def _as_buffer(frame: Any, index: int) -> memoryview:
    """A flat byte memoryview of a received frame (zmq.Frame, bytes, memoryview, array)."""
    if isinstance(frame, zmq.Frame):
        return frame.buffer
    try:
        mv = memoryview(frame)
    except TypeError:
        raise ProtocolError(f"frame {index} is a {type(frame).__name__}, not a buffer") from None
    if mv.ndim != 1 or mv.format != "B":
        try:
            mv = mv.cast("B")
        except TypeError:  # not C-contiguous
            raise ProtocolError(f"frame {index} is not a contiguous buffer") from None
    return mv


class Codec:
    """Encodes protocol messages to ZMQ frames and back; see the module docstring.

    One instance serves any number of threads. `inline_threshold`: arrays of fewer bytes
    ride inside frame 0 (0 sends every array, even empty ones, as its own frame).
    """

    def __init__(self, inline_threshold: int = INLINE_THRESHOLD):
        self.inline_threshold = int(inline_threshold)
        # The frames of the message being decoded on this thread: msgspec's ext_hook gets
        # no per-call argument, and building a typed Decoder per call costs ~4 us.
        self._local = threading.local()
        self._decoders: dict[Any, msgspec.msgpack.Decoder] = {}

    # -- encode ---------------------------------------------------------------------

    def encode(self, msg: Any) -> list:
        """Frames of `msg`: [msgpack bytes, array buffer, ...]; raises ProtocolError."""
        frames: list = [b""]
        threshold = self.inline_threshold

        def enc_hook(obj: Any) -> Any:
            if isinstance(obj, np.ndarray):
                return _encode_array(obj, frames, threshold)
            if isinstance(obj, np.generic):  # numpy scalars in untyped fields (stats, info)
                return obj.item()
            raise TypeError(f"cannot encode objects of type {type(obj).__name__}")

        try:
            # An Encoder per call (~0.2 us) so the hook can close over this call's frames.
            frames[0] = msgspec.msgpack.Encoder(enc_hook=enc_hook).encode(msg)
        except ProtocolError:
            raise
        except (TypeError, ValueError, OverflowError) as e:
            raise ProtocolError(f"cannot encode {type(msg).__name__}: {e}") from e
        return frames

    # -- decode ---------------------------------------------------------------------

    def decode(self, frames: Sequence[Any], type: Any = Any) -> Any:
        """The message of `type` held by `frames` (as from `encode` or recv_multipart).

        Arrays are views of the frames (zero-copy). Raises ProtocolError if the frames are
        not a valid message of `type`.
        """
        if not frames:
            raise ProtocolError("empty message (no frames)")
        bufs = [_as_buffer(f, i) for i, f in enumerate(frames)]
        decoder = self._decoders.get(type)
        if decoder is None:
            decoder = self._decoders.setdefault(type, msgspec.msgpack.Decoder(
                type, dec_hook=_dec_hook, ext_hook=self._ext_hook))
        local = self._local
        outer = getattr(local, "frames", None)  # restored below, should a hook ever nest
        local.frames = bufs
        try:
            return decoder.decode(bufs[0])
        except ProtocolError:
            raise
        except msgspec.DecodeError as e:  # includes ValidationError (wrong type / values)
            raise ProtocolError(f"invalid message: {e}", _request_id_of(bufs[0])) from None
        except (ValueError, TypeError, OverflowError) as e:
            raise ProtocolError(f"invalid message: {_type_name(e)}: {e}", _request_id_of(bufs[0])) from None
        finally:
            local.frames = outer

    def _ext_hook(self, code: int, data: memoryview) -> np.ndarray:
        """Rebuild the array an extension value refers to."""
        if code == EXT_ARRAY_FRAME:
            dtype, shape, offset = _unpack_header(data)
            if len(data) != offset + _INDEX.size:
                raise ProtocolError("array frame reference has trailing or missing bytes")
            (index,) = _INDEX.unpack_from(data, offset)
            bufs = self._local.frames
            if not 1 <= index < len(bufs):
                raise ProtocolError(
                    f"array reference points to frame {index}, message has {len(bufs)} frames")
            arr = _array_from_buffer(bufs[index], dtype, shape)
            if not arr.flags.aligned:
                # A small frame can sit at any offset of ZMQ's receive buffer; numpy and
                # jax are slower on (or copy) unaligned data anyway.
                arr = arr.copy()
            return arr
        if code == EXT_ARRAY_INLINE:
            dtype, shape, offset = _unpack_header(data)
            # Copied out of frame 0: small, and gives aligned memory that does not pin
            # the message buffer.
            return _array_from_buffer(data[offset:], dtype, shape).copy()
        raise ProtocolError(f"unknown msgpack extension type {code}")


def _request_id_of(frame: memoryview) -> str | None:
    """The `request_id` string of an undecodable message, if its top level still reads as a map."""
    try:
        msg = msgspec.msgpack.decode(frame, ext_hook=lambda code, data: None)
    except Exception:  # not even msgpack: nothing to recover
        return None
    rid = msg.get("request_id") if isinstance(msg, dict) else None
    return rid if isinstance(rid, str) else None


def _type_name(obj: Any) -> str:
    return obj.__class__.__name__


def _encode_array(arr: np.ndarray, frames: list, threshold: int) -> msgspec.msgpack.Ext:
    """The reference to `arr` for frame 0; appends its buffer to `frames` if not inlined."""
    code = _CODE_BY_DTYPE.get(arr.dtype)
    if code is None:
        native = arr.dtype.newbyteorder("=") if arr.dtype.byteorder not in "=|" else None
        code = _CODE_BY_DTYPE.get(native) if native is not None else None
        if code is None:
            raise ProtocolError(
                f"cannot send arrays of dtype {arr.dtype}; supported: "
                + ", ".join(dt.name for dt in SUPPORTED_DTYPES))
        arr = arr.astype(native)
    if not arr.flags.c_contiguous:
        # copy(order="C") keeps 0-d arrays 0-d (np.ascontiguousarray would make them 1-d).
        arr = arr.copy(order="C")
    header = _pack_header(code, arr.shape)
    # A flat uint8 view: memoryview() refuses extension dtypes such as bfloat16.
    raw = arr.reshape(-1).view(np.uint8)
    if arr.nbytes < threshold:
        return msgspec.msgpack.Ext(EXT_ARRAY_INLINE, header + raw.tobytes())
    frames.append(memoryview(raw))
    return msgspec.msgpack.Ext(EXT_ARRAY_FRAME, header + _INDEX.pack(len(frames) - 1))


def _dec_hook(type_: Any, obj: Any) -> Any:
    """Typed fields of custom types: np.ndarray fields must hold an array reference."""
    if type_ is np.ndarray:
        if isinstance(obj, np.ndarray):
            return obj
        raise TypeError(f"expected an array, got {_type_name(obj)}")
    raise NotImplementedError(f"cannot decode type {type_!r}")


_DEFAULT_CODEC = Codec()


def encode(msg: Any) -> list:
    """Frames of `msg` with the default codec (see `Codec.encode`)."""
    return _DEFAULT_CODEC.encode(msg)


def decode(frames: Sequence[Any], type: Any = Any) -> Any:
    """Message of `type` from `frames` with the default codec (see `Codec.decode`)."""
    return _DEFAULT_CODEC.decode(frames, type)


# ---------------------------------------------------------------------------------------
# Addresses
# ---------------------------------------------------------------------------------------

# sockaddr_un.sun_path is 108 bytes on Linux (104 on macOS), NUL included.
_MAX_IPC_PATH = 103
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


def private_ipc_dir(prefix: str = "omni-jax-", dir: str | None = None) -> str:
    """A new temp dir only this user can enter (mode 0700) for ipc sockets.

    The caller removes it (shutil.rmtree) when the pipeline shuts down.
    """
    path = tempfile.mkdtemp(prefix=prefix, dir=dir)
    os.chmod(path, 0o700)  # mkdtemp's mode is masked by the umask; be explicit
    return path


def ipc_address(ipc_dir: str, name: str) -> str:
    """`ipc://<ipc_dir>/<name>`; raises ValueError for odd names or too long paths."""
    if not _NAME_RE.match(name):
        raise ValueError(f"ipc socket name must match {_NAME_RE.pattern}, got {name!r}")
    path = os.path.join(os.path.abspath(ipc_dir), name)
    if len(path.encode()) > _MAX_IPC_PATH:
        raise ValueError(f"ipc socket path is {len(path.encode())} bytes, the OS allows "
                         f"{_MAX_IPC_PATH}: {path!r} (use a shorter temp dir)")
    return f"ipc://{path}"


def tcp_address(host: str = "127.0.0.1", port: int | None = None) -> str:
    """`tcp://host:port`; port None means any free port (bind side; see Channel.address).

    Only for a stage on another host: TCP has no 0700 directory guarding it.
    """
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return f"tcp://{host}:{'*' if port is None else int(port)}"


class StageAddresses(NamedTuple):
    """The endpoints of one stage: requests (orchestrator -> stage), data (earlier stage -> this
    stage, bound by the stage) and replies (stage -> orchestrator)."""

    requests: str
    data: str
    replies: str


def stage_addresses(ipc_dir: str, stage: str) -> StageAddresses:
    """The ipc endpoints of `stage` inside the orchestrator's private dir."""
    return StageAddresses(*(ipc_address(ipc_dir, f"{stage}-{kind}") for kind in StageAddresses._fields))


# ---------------------------------------------------------------------------------------
# Channel
# ---------------------------------------------------------------------------------------

# 0 = no limit on queued messages. Orchestrator and stage each send to the other from one
# thread; bounded queues in both directions could block both sends at once (deadlock).
# What is in flight is bounded by the schedulers (running requests per stage) instead.
DEFAULT_HWM = 0


class Channel:
    """One end of a one-way message pipe over a ZMQ socket (PUSH to send, PULL to receive).

    The orchestrator creates its ends with `bind=True`, stages with `bind=False` (see the
    module docstring). `decode_type` is what `recv` decodes to (`StageRequest` in a stage,
    `StageReply` in the orchestrator). A ZMQ socket must be used by one thread at a time;
    encoding may happen elsewhere (`send_frames(encode(msg))`).
    """

    def __init__(self, socket_type: int, address: str, *, bind: bool,
                 decode_type: Any = Any, context: zmq.Context | None = None,
                 codec: Codec | None = None, hwm: int = DEFAULT_HWM):
        self.decode_type = decode_type
        self.codec = codec or _DEFAULT_CODEC
        self._context = context or zmq.Context.instance()
        self.socket = self._context.socket(socket_type)
        try:
            # Nothing left unsent should keep a process from exiting.
            self.socket.setsockopt(zmq.LINGER, 0)
            self.socket.setsockopt(zmq.SNDHWM, hwm)
            self.socket.setsockopt(zmq.RCVHWM, hwm)
            if bind:
                self.socket.bind(address)
            else:
                self.socket.connect(address)
        except BaseException:
            self.socket.close(linger=0)
            raise
        self.bound = bind
        # The concrete endpoint (a "tcp://...:*" bind gets its port here).
        self.address = (self.socket.getsockopt_string(zmq.LAST_ENDPOINT) if bind else address)

    # -- send -----------------------------------------------------------------------

    def send(self, msg: Any, timeout_ms: int | None = None) -> None:
        """Encode and send `msg`; arrays go without copying (do not mutate them after).

        Blocks while the peer cannot take it (PUSH with no connected peer); with
        `timeout_ms`, raises TimeoutError instead of waiting longer.
        """
        self.send_frames(self.codec.encode(msg), timeout_ms)

    def send_frames(self, frames: Sequence[Any], timeout_ms: int | None = None) -> None:
        """Send already encoded frames as one multipart message (see `send`)."""
        if timeout_ms is None:
            self.socket.send_multipart(frames, copy=False)
            return
        if not self.socket.poll(timeout_ms, zmq.POLLOUT):
            raise TimeoutError(f"peer of {self.address} took no message for {timeout_ms} ms")
        try:
            self.socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise TimeoutError(f"peer of {self.address} took no message") from None

    # -- receive --------------------------------------------------------------------

    def recv_raw(self, timeout_ms: int | None = None) -> list[zmq.Frame] | None:
        """The next message's frames (not copied), or None after `timeout_ms` (None: wait)."""
        if timeout_ms is not None and not self.socket.poll(timeout_ms, zmq.POLLIN):
            return None
        return self.socket.recv_multipart(copy=False)

    def recv(self, timeout_ms: int | None = None) -> Any:
        """The next message decoded as `decode_type`, or None after `timeout_ms`.

        A malformed message is consumed and raises ProtocolError; the next call gets the
        message after it.
        """
        frames = self.recv_raw(timeout_ms)
        if frames is None:
            return None
        return self.codec.decode(frames, self.decode_type)

    def recv_or_drop(self, timeout_ms: int | None = None,
                     log: logging.Logger | Callable[[str], Any] | None = None) -> Any:
        """Like `recv`, but a malformed message is logged and dropped (returns None).

        For serving loops that must keep going whatever a peer sends. `log` is a Logger
        (warning level) or a callable taking the text; default this module's logger.
        """
        frames = self.recv_raw(timeout_ms)
        if frames is None:
            return None
        try:
            return self.codec.decode(frames, self.decode_type)
        except ProtocolError as e:
            text = (f"dropped a malformed message on {self.address} "
                    f"({len(frames)} frames, {sum(len(f) for f in frames)} bytes): {e}")
            if log is None:
                logger.warning(text)
            elif isinstance(log, logging.Logger):
                log.warning(text)
            else:
                log(text)
            return None

    # -- lifetime -------------------------------------------------------------------

    def close(self) -> None:
        """Close the socket at once, dropping unsent messages (LINGER 0)."""
        if not self.socket.closed:
            self.socket.close(linger=0)

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return self.socket.closed

    def __enter__(self) -> "Channel":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = "closed" if self.socket.closed else zmq.SocketType(self.socket.type).name
        return f"Channel({kind}, {'bind' if self.bound else 'connect'} {self.address})"
