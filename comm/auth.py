"""Mutual HMAC challenge-response over a socket, plus length-prefixed messages.

Both sides hold the cluster token. The server sends a random nonce; the client answers with its own nonce
and HMAC-SHA256(token, "client" | server nonce | client nonce); the server checks it with
`hmac.compare_digest` and closes the connection if it is wrong; otherwise it proves itself with
HMAC(token, "server" | client nonce | server nonce), which the client checks before trusting the peer.
Neither side ever sends the token.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import threading

from nanocp.comm.metadata_channel import MetadataAuthError

PROTOCOL = b"NCPAUTH1"
NONCE_SIZE = 32
MAC_SIZE = 32
_LEN = struct.Struct("<I")


def normalize_token(token: str | bytes) -> bytes:
    token = token.encode() if isinstance(token, str) else bytes(token)
    if not token:
        raise ValueError("the cluster token must not be empty")
    return token


def _mac(token: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(token, PROTOCOL + role + first + second, hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Read exactly n bytes; ConnectionError if the peer closes first."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError(f"peer closed the connection with {n - got} of {n} bytes outstanding")
        got += k
    return buf


def send_message(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_message(sock: socket.socket, max_len: int) -> bytearray:
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if n > max_len:
        raise ConnectionError(f"message of {n} bytes exceeds the limit of {max_len}")
    return recv_exact(sock, n)


def server_handshake(sock: socket.socket, token: bytes) -> bool:
    """Authenticate the connecting client. Returns False (caller closes) if it does not know the token."""
    server_nonce = os.urandom(NONCE_SIZE)
    sock.sendall(PROTOCOL + server_nonce)
    answer = recv_exact(sock, NONCE_SIZE + MAC_SIZE)
    client_nonce, client_mac = answer[:NONCE_SIZE], answer[NONCE_SIZE:]
    if not hmac.compare_digest(client_mac, _mac(token, b"client", server_nonce, client_nonce)):
        return False
    sock.sendall(_mac(token, b"server", client_nonce, server_nonce))
    return True


def client_handshake(sock: socket.socket, token: bytes) -> None:
    """Prove the token to the server and check its proof; MetadataAuthError if either side fails."""
    try:
        hello = recv_exact(sock, len(PROTOCOL) + NONCE_SIZE)
        if not hello.startswith(PROTOCOL):
            raise MetadataAuthError(f"peer does not speak {PROTOCOL.decode()}")
        server_nonce = hello[len(PROTOCOL) :]
        client_nonce = os.urandom(NONCE_SIZE)
        sock.sendall(client_nonce + _mac(token, b"client", server_nonce, client_nonce))
        server_mac = recv_exact(sock, MAC_SIZE)
    except (ConnectionError, TimeoutError) as exc:
        raise MetadataAuthError(f"authentication failed, the peer closed the connection (wrong token?): {exc}") from exc
    if not hmac.compare_digest(server_mac, _mac(token, b"server", client_nonce, server_nonce)):
        raise MetadataAuthError("the peer failed to prove the cluster token")


def accept_loop(listener, closed, serve, threads: list) -> None:
    """Accept connections on `listener` (a socket with a short timeout) until `closed` is set; each connection is
    served by `serve(conn)` on its own daemon thread, appended to `threads`."""
    while not closed.is_set():
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        except OSError:
            return
        worker = threading.Thread(target=serve, args=(conn,), daemon=True)
        threads.append(worker)
        worker.start()
