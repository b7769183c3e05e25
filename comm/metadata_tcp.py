"""TCP metadata channel between hosts.

The instance runs `TcpMetadataReceiver`: a server (127.0.0.1 unless told otherwise) whose connections must
pass the token handshake (comm/auth.py) before anything else is read. After it, the server tells the sender
its capacity and instance id, then reads length-prefixed frames (header + payload), writes each into its
local context buffer and rings the doorbell; `wait_table` validates as for every backend. A frame length
outside [header, header + capacity] is a protocol violation and closes the connection.
"""

from __future__ import annotations

import socket
import struct
import threading

from nanocp.comm import auth
from nanocp.comm.metadata_channel import (
    HEADER_SIZE,
    LocalContextBuffer,
    MetadataChannelError,
    MetadataReceiver,
    MetadataSender,
)

_HELLO = struct.Struct("<QI")  # capacity, instance id
_LEN = struct.Struct("<I")


class TcpMetadataReceiver(MetadataReceiver):
    """Instance side; `address` is the (host, port) to give the control plane."""

    def __init__(
        self,
        instance_id: int,
        capacity: int,
        token: str | bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        handshake_timeout_s: float = 10.0,
    ):
        super().__init__(LocalContextBuffer(capacity), instance_id)
        self._token = auth.normalize_token(token)
        self._handshake_timeout_s = handshake_timeout_s
        self._listener = socket.create_server((host, port))
        self._listener.settimeout(0.2)  # lets the accept loop notice close()
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._closed = threading.Event()
        self._lock = threading.Lock()  # one frame at a time into the context buffer
        self._conns: set[socket.socket] = set()
        self.rejected = 0  # connections that failed authentication
        self._threads = [threading.Thread(target=self._accept_loop, name=f"meta-tcp{instance_id}", daemon=True)]
        self._threads[0].start()

    def _accept_loop(self) -> None:
        auth.accept_loop(self._listener, self._closed, self._serve, self._threads)

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.add(conn)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(self._handshake_timeout_s)
            if not auth.server_handshake(conn, self._token):
                self.rejected += 1
                return
            auth.send_message(conn, _HELLO.pack(self.capacity, self.instance_id))
            conn.settimeout(None)
            self._read_frames(conn)
        except (OSError, ConnectionError):
            pass  # peer went away or close() shut the socket
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _read_frames(self, conn: socket.socket) -> None:
        limit = HEADER_SIZE + self.capacity
        while not self._closed.is_set():
            frame = auth.recv_message(conn, limit)
            if len(frame) < HEADER_SIZE:
                raise ConnectionError(f"frame of {len(frame)} bytes is shorter than a header")
            with self._lock:
                self.context.publish(bytes(frame[:HEADER_SIZE]), memoryview(frame)[HEADER_SIZE:])

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop at once
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for conn in self._conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for thread in self._threads:
            thread.join(timeout=5.0)
        super().close()


class TcpMetadataSender(MetadataSender):
    """Control-plane side: connects, authenticates, then pushes frames."""

    def __init__(self, address: tuple[str, int], token: str | bytes, instance_id: int, timeout_s: float = 10.0):
        self._sock = socket.create_connection(tuple(address), timeout=timeout_s)
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            auth.client_handshake(self._sock, auth.normalize_token(token))
            capacity, remote_instance = _HELLO.unpack(auth.recv_message(self._sock, _HELLO.size))
        except BaseException:
            self._sock.close()
            raise
        if remote_instance != instance_id:
            self._sock.close()
            raise MetadataChannelError(f"{address} serves instance {remote_instance}, not {instance_id}")
        super().__init__(instance_id, capacity)

    def transmit(self, header: bytes, payload) -> None:
        payload = memoryview(payload).cast("B")
        self._sock.sendall(b"".join((_LEN.pack(HEADER_SIZE + payload.nbytes), header, payload)))

    def close(self) -> None:
        self._sock.close()
