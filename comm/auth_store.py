"""An authenticated rendezvous store for torch.distributed: the key-value store gloo's process group meets in,
behind the cluster-token handshake of the TCP metadata channel (comm/auth.py).

torch's own TCPStore answers whoever connects to its port. Here rank 0 runs `AuthStoreServer` and every rank
(rank 0 included) uses an `AuthStore` client, a `torch.distributed.Store` that `init_process_group(store=...)`
takes: each connection must prove the token (mutual HMAC challenge-response, the token never sent) before a single
request is read, and a peer that fails is disconnected and counted in `rejected`.

Requests and answers are length-prefixed messages: one op byte, then length-prefixed fields (no pickle).
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from nanocp.comm import auth
from nanocp.comm.metadata_channel import MetadataAuthError

MAX_MESSAGE = 64 << 20
_FIELD = struct.Struct("<I")
_INT = struct.Struct("<q")


class StoreError(RuntimeError):
    """A store request failed (timeout, closed server, bad request)."""


def _pack(op: bytes, *fields: bytes) -> bytes:
    return op + b"".join(_FIELD.pack(len(f)) + f for f in fields)


def _unpack(data: bytes) -> tuple[bytes, list[bytes]]:
    op, fields, i = bytes(data[:1]), [], 1
    while i < len(data):
        (n,) = _FIELD.unpack_from(data, i)
        fields.append(bytes(data[i + 4 : i + 4 + n]))
        i += 4 + n
    return op, fields


def _as_bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class AuthStoreServer:
    """The store itself, served on (host, port) to clients that prove the token; blocking requests (get, wait)
    hold only their own connection's thread."""

    def __init__(self, token: str | bytes, host: str = "0.0.0.0", port: int = 0):
        self._token = auth.normalize_token(token)
        self._data: dict[bytes, bytes] = {}
        self._cond = threading.Condition()
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self.rejected = 0  # connections that failed authentication
        self._listener = socket.create_server((host, port))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        threading.Thread(
            target=auth.accept_loop, args=(self._listener, self._closed, self._serve, self._threads), daemon=True
        ).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(10.0)
                if not auth.server_handshake(conn, self._token):
                    self.rejected += 1
                    return
                conn.settimeout(None)
                while not self._closed.is_set():
                    op, fields = _unpack(auth.recv_message(conn, MAX_MESSAGE))
                    auth.send_message(conn, self._answer(op, fields))
            except (ConnectionError, OSError, struct.error):
                return

    def _answer(self, op: bytes, f: list[bytes]) -> bytes:
        with self._cond:
            if op == b"S":
                self._data[f[0]] = f[1]
                self._cond.notify_all()
                return b"+"
            if op == b"A":
                value = int(self._data.get(f[0], b"0")) + _INT.unpack(f[1])[0]
                self._data[f[0]] = str(value).encode()
                self._cond.notify_all()
                return b"+" + _INT.pack(value)
            if op in (b"G", b"W"):  # get / wait: fields are the timeout (ms), then the keys
                timeout_s = _INT.unpack(f[0])[0] / 1e3
                keys = f[1:]
                if not self._cond.wait_for(lambda: all(k in self._data for k in keys), timeout_s):
                    return b"-" + f"timed out after {timeout_s:.0f} s waiting for {keys}".encode()
                return b"+" + (self._data[keys[0]] if op == b"G" else b"")
            if op == b"C":
                return b"+" + bytes([all(k in self._data for k in f)])
            if op == b"D":
                return b"+" + bytes([self._data.pop(f[0], None) is not None])
            if op == b"N":
                return b"+" + _INT.pack(len(self._data))
            if op == b"X":  # compare_set: key, expected, desired
                current = self._data.get(f[0])
                if (current is None and f[1] == b"") or current == f[1]:
                    self._data[f[0]] = current = f[2]
                    self._cond.notify_all()
                return b"+" + (f[1] if current is None else current)
        return b"-" + f"unknown store request {op!r}".encode()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()


class AuthStore(dist.Store):
    """A client of `AuthStoreServer`: one authenticated connection, one request at a time."""

    def __init__(self, address: tuple[str, int], token: str | bytes, timeout_s: float = 120.0):
        super().__init__()
        self._timeout_ms = int(timeout_s * 1e3)
        self._lock = threading.Lock()
        deadline = time.monotonic() + timeout_s
        while True:  # the server may still be starting
            try:
                self._sock = socket.create_connection(address, timeout=10.0)
                break
            except OSError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)
        try:
            auth.client_handshake(self._sock, auth.normalize_token(token))
        except MetadataAuthError:
            self._sock.close()
            raise
        self._sock.settimeout(None)

    def _call(self, op: bytes, *fields: bytes) -> bytes:
        with self._lock:
            auth.send_message(self._sock, _pack(op, *fields))
            answer = auth.recv_message(self._sock, MAX_MESSAGE)
        if answer[:1] != b"+":
            raise StoreError(bytes(answer[1:]).decode(errors="replace"))
        return bytes(answer[1:])

    def _wait_ms(self, timeout) -> bytes:
        ms = self._timeout_ms if timeout is None else int(timeout.total_seconds() * 1e3)
        return _INT.pack(ms)

    # ---- the torch.distributed.Store interface --------------------------------------------------------------
    def set(self, key: str, value) -> None:
        self._call(b"S", _as_bytes(key), _as_bytes(value))

    def get(self, key: str) -> bytes:
        return self._call(b"G", self._wait_ms(None), _as_bytes(key))

    def add(self, key: str, amount: int) -> int:
        return _INT.unpack(self._call(b"A", _as_bytes(key), _INT.pack(int(amount))))[0]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._call(b"W", self._wait_ms(timeout), *(_as_bytes(k) for k in keys))

    def check(self, keys: list[str]) -> bool:
        return self._call(b"C", *(_as_bytes(k) for k in keys)) == b"\x01"

    def delete_key(self, key: str) -> bool:
        return self._call(b"D", _as_bytes(key)) == b"\x01"

    def num_keys(self) -> int:
        return _INT.unpack(self._call(b"N"))[0]

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._call(b"X", _as_bytes(key), _as_bytes(expected), _as_bytes(desired))

    def close(self) -> None:
        self._sock.close()
