"""rsync's remote shell (`rsync -e`) through the login node's hpctrain server: no sshd session per transfer.

rsync runs `RSH HOST COMMAND...` and speaks its protocol on that program's stdin/stdout, as it does with
`ssh HOST COMMAND...`. Here RSH is `python -m hpctrain.remote.pipe SOCKET`: it joins COMMAND as ssh does,
asks the server behind SOCKET (the forwarded unix socket of hpctrain.remote.forward) to run it with `sh -c`,
and carries the bytes both ways; the remote stderr comes back on stderr, the remote exit status is ours. A
connection cut off before the exit status is exit 255 with ssh's wording, so hpctrain.remote.ssh.failure
reads it as it reads ssh's.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading

from hpctrain.remote import wire


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def main(argv: list[str]) -> int:
    path, _host, *words = argv
    # rsync leaves its end of our stdout non-blocking (only --blocking-io changes that); ssh copes with
    # EAGAIN, and so would we only by spinning: block instead.
    os.set_blocking(0, True)
    os.set_blocking(1, True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    frames, pending = wire.Frames(), []  # type: ignore[var-annotated]
    try:
        sock.settimeout(60)
        sock.connect(path)
        hello = wire.recv_one(sock, frames, pending)
        if hello is None or hello[0] != wire.HELLO or json.loads(hello[1]).get("restart"):
            raise OSError("no hpctrain server behind the forwarded socket")
        sock.settimeout(None)
        sock.sendall(wire.pack_json(wire.REQUEST, {"shell": " ".join(words), "stdin": True}))
    except OSError as exc:
        sys.stderr.write(f"hpctrain: connection to the login node's server closed ({exc})\n")
        return 255

    def outbound() -> None:  # our stdin -> the remote command; its end is an empty frame
        try:
            while data := os.read(0, 65536):
                sock.sendall(wire.pack(wire.STDIN, data))
            sock.sendall(wire.pack(wire.STDIN))
        except OSError:
            pass

    threading.Thread(target=outbound, daemon=True).start()
    while True:
        try:
            got = wire.recv_one(sock, frames, pending)
        except OSError:
            got = None
        if got is None:
            sys.stderr.write("hpctrain: Connection closed by the login node's server (the link dropped)\n")
            return 255
        kind, payload = got
        if kind == wire.STDOUT:
            _write_all(1, payload)
        elif kind == wire.STDERR:
            _write_all(2, payload)
        elif kind == wire.EXIT:
            return int(payload or b"1")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
