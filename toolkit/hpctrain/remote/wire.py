"""The frames between the laptop and the login node's hpctrain server (hpctrain.remote.serve).

A frame is one kind byte, a 4-byte big-endian length and that many bytes. The server greets each connection
(HELLO, JSON: version, remote_dir, or restart); the laptop sends one REQUEST (JSON), then STDIN data (an empty
STDIN frame is end of input) and WINSIZE; the server streams STDOUT and STDERR and ends with EXIT (the exit
status as text). A connection that closes before EXIT was cut off.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

HELLO, REQUEST, STDIN, WINSIZE = b"h", b"q", b"i", b"w"
STDOUT, STDERR, EXIT = b"o", b"e", b"x"
_HEAD = struct.Struct(">cI")
MAX_FRAME = 64 << 20  # a request carries no files; anything bigger is not ours


def pack(kind: bytes, payload: bytes = b"") -> bytes:
    return _HEAD.pack(kind, len(payload)) + payload


def pack_json(kind: bytes, doc: dict[str, Any]) -> bytes:
    return pack(kind, json.dumps(doc).encode())


class Frames:
    """Frames out of a byte stream that arrives in pieces: feed() what recv() gave, get the whole frames."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        self._buf += data
        out: list[tuple[bytes, bytes]] = []
        while len(self._buf) >= _HEAD.size:
            kind, size = _HEAD.unpack_from(self._buf)
            if size > MAX_FRAME:
                raise ValueError(f"frame of {size} bytes: not an hpctrain server's stream")
            if len(self._buf) < _HEAD.size + size:
                break
            out.append((kind, bytes(self._buf[_HEAD.size:_HEAD.size + size])))
            del self._buf[:_HEAD.size + size]
        return out


def recv_one(sock: socket.socket, frames: Frames, pending: list[tuple[bytes, bytes]]) -> tuple[bytes, bytes] | None:
    """The next frame from SOCK (blocking, within the socket's timeout); None when the peer closed first.
    PENDING keeps frames that arrived in the same recv as this one."""
    while not pending:
        data = sock.recv(65536)
        if not data:
            return None
        pending += frames.feed(data)
    return pending.pop(0)
