"""RDMA metadata channel (pyverbs / rdma-core): RDMA WRITE WITH IMM of the frame, imm = seq.

The instance registers a memory region holding one frame (header + capacity) with remote-write access and
listens on an authenticated TCP side channel (comm/auth.py) where each sender swaps RC QP details
(QP number, PSN, LID, GID, MR address and rkey). The sender writes header + payload into that region with
IBV_WR_RDMA_WRITE_WITH_IMM carrying the low 32 bits of the seq; the instance's completion poller copies the
frame into its local context buffer and rings the doorbell, and `wait_table` validates it like every other
backend. A frame written while the previous one is still being copied can tear it; the checksums catch
that (the control plane pushes one table per iteration, so this only happens when an instance lags a whole
iteration). Capability check: `rdma_available()`. PyPI's pyverbs names its enum module
`pyverbs.libibverbs_enums`, Debian's `pyverbs.enums`; both are handled.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from dataclasses import asdict, dataclass
from types import SimpleNamespace

from nanocp.comm import auth
from nanocp.comm.metadata_channel import (
    HEADER_SIZE,
    LocalContextBuffer,
    MetadataChannelError,
    MetadataReceiver,
    MetadataSender,
    header_seq,
    payload_length_hint,
)

_INFO_LIMIT = 4096
_RECV_DEPTH = 16


def rdma_available() -> tuple[bool, str]:
    """(True, device list) if pyverbs imports and an RDMA device exists, else (False, why not)."""
    try:
        import pyverbs.device as device
    except ImportError as exc:
        return False, f"pyverbs is not importable ({exc})"
    try:
        devices = device.get_device_list()
    except Exception as exc:  # noqa: BLE001 - any verbs failure means "not usable here"
        return False, f"pyverbs cannot list RDMA devices ({exc})"
    if not devices:
        return False, "pyverbs is installed but there is no RDMA device (no RDMA NIC, no soft-RoCE rxe)"
    return True, "RDMA devices: " + ", ".join(d.name.decode() for d in devices)


def _verbs() -> SimpleNamespace:
    """The pyverbs classes used here and an `enum(group, name)` lookup working for both enum modules."""
    import pyverbs.addr as addr
    import pyverbs.cq as cq
    import pyverbs.device as device
    import pyverbs.mr as mr
    import pyverbs.pd as pd
    import pyverbs.qp as qp
    import pyverbs.wr as wr

    try:
        import pyverbs.libibverbs_enums as enums
    except ImportError:
        import pyverbs.enums as enums

    def enum(group: str, name: str) -> int:
        if hasattr(enums, name):
            return int(getattr(enums, name))
        return int(getattr(getattr(enums, group), name))

    return SimpleNamespace(
        GID=addr.GID,
        AHAttr=addr.AHAttr,
        GlobalRoute=addr.GlobalRoute,
        CQ=cq.CQ,
        Context=device.Context,
        MR=mr.MR,
        PD=pd.PD,
        QP=qp.QP,
        QPAttr=qp.QPAttr,
        QPCap=qp.QPCap,
        QPInitAttr=qp.QPInitAttr,
        SGE=wr.SGE,
        RecvWR=wr.RecvWR,
        SendWR=wr.SendWR,
        enum=enum,
    )


@dataclass(frozen=True)
class QpInfo:
    """What a peer needs to reach this side's QP (and, for the receiver, its frame region)."""

    qpn: int
    psn: int
    lid: int
    gid: str
    addr: int = 0
    rkey: int = 0
    capacity: int = 0
    instance_id: int = 0


class _Endpoint:
    """Context -> PD -> MR -> CQ -> RC QP on one device port."""

    def __init__(self, device: str | None, port_num: int, gid_index: int, region: int, remote_write: bool):
        v = self.v = _verbs()
        if device is None:
            from pyverbs.device import get_device_list

            device = get_device_list()[0].name.decode()
        self.port_num, self.gid_index = port_num, gid_index
        self.ctx = v.Context(name=device)
        self.pd = v.PD(self.ctx)
        access = v.enum("ibv_access_flags", "IBV_ACCESS_LOCAL_WRITE")
        if remote_write:
            access |= v.enum("ibv_access_flags", "IBV_ACCESS_REMOTE_WRITE")
        self.mr = v.MR(self.pd, region, access)
        self.cq = v.CQ(self.ctx, 2 * _RECV_DEPTH)
        cap = v.QPCap(max_send_wr=_RECV_DEPTH, max_recv_wr=_RECV_DEPTH, max_send_sge=1, max_recv_sge=1)
        init = v.QPInitAttr(qp_type=v.enum("ibv_qp_type", "IBV_QPT_RC"), scq=self.cq, rcq=self.cq, cap=cap)
        self.qp = v.QP(self.pd, init)
        self.port = self.ctx.query_port(port_num)
        self.psn = random.getrandbits(24)

    def info(self, **extra) -> QpInfo:
        gid = self.ctx.query_gid(self.port_num, self.gid_index).gid
        return QpInfo(self.qp.qp_num, self.psn, self.port.lid, gid, **extra)

    def connect(self, peer: QpInfo) -> None:
        """RESET -> INIT -> RTR -> RTS towards the peer's QP."""
        v = self.v
        attr = v.QPAttr(port_num=self.port_num)
        attr.path_mtu = self.port.active_mtu
        attr.qp_access_flags = v.enum("ibv_access_flags", "IBV_ACCESS_LOCAL_WRITE") | v.enum(
            "ibv_access_flags", "IBV_ACCESS_REMOTE_WRITE"
        )
        attr.dest_qp_num, attr.rq_psn, attr.sq_psn = peer.qpn, peer.psn, self.psn
        attr.max_dest_rd_atomic = attr.max_rd_atomic = 1
        attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
        route = v.GlobalRoute(dgid=v.GID(peer.gid), sgid_index=self.gid_index)
        attr.ah_attr = v.AHAttr(port_num=self.port_num, is_global=1, gr=route, dlid=peer.lid)
        self.qp.to_rts(attr)

    def post_recv(self) -> None:
        """A receive WR for one WRITE WITH IMM (the data goes to the MR, the WR only carries the imm)."""
        sge = self.v.SGE(self.mr.buf, 1, self.mr.lkey)
        self.qp.post_recv(self.v.RecvWR(num_sge=1, sg=[sge]))

    def close(self) -> None:
        for obj in (self.qp, self.cq, self.mr, self.pd, self.ctx):
            obj.close()


def _send_info(sock: socket.socket, info: QpInfo) -> None:
    auth.send_message(sock, json.dumps(asdict(info)).encode())


def _recv_info(sock: socket.socket) -> QpInfo:
    return QpInfo(**json.loads(auth.recv_message(sock, _INFO_LIMIT)))


class RdmaMetadataReceiver(MetadataReceiver):
    """Instance side: serves one frame region per sender; `address` is the side channel's (host, port)."""

    def __init__(
        self,
        instance_id: int,
        capacity: int,
        token: str | bytes,
        device: str | None = None,
        port_num: int = 1,
        gid_index: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        ok, reason = rdma_available()
        if not ok:
            raise MetadataChannelError(reason)
        super().__init__(LocalContextBuffer(capacity), instance_id)
        self._token = auth.normalize_token(token)
        self._device, self._port_num, self._gid_index = device, port_num, gid_index
        self._listener = socket.create_server((host, port))
        self._listener.settimeout(0.2)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._accept_loop, daemon=True)]
        self._threads[0].start()

    def _accept_loop(self) -> None:
        auth.accept_loop(self._listener, self._closed, self._serve, self._threads)

    def _serve(self, conn: socket.socket) -> None:
        endpoint = None
        try:
            conn.settimeout(10.0)
            if not auth.server_handshake(conn, self._token):
                return
            endpoint = _Endpoint(self._device, self._port_num, self._gid_index, HEADER_SIZE + self.capacity, True)
            for _ in range(_RECV_DEPTH):
                endpoint.post_recv()
            mine = endpoint.info(
                addr=endpoint.mr.buf, rkey=endpoint.mr.rkey, capacity=self.capacity, instance_id=self.instance_id
            )
            _send_info(conn, mine)
            endpoint.connect(_recv_info(conn))
            auth.send_message(conn, b"ready")
            self._poll(endpoint)
        except (OSError, ConnectionError):
            pass
        finally:
            if endpoint is not None:
                endpoint.close()
            conn.close()

    def _poll(self, endpoint: _Endpoint) -> None:
        """Turn each WRITE WITH IMM completion into a published frame until close()."""
        v, delay = endpoint.v, 1e-5
        ok = v.enum("ibv_wc_status", "IBV_WC_SUCCESS")
        with_imm = v.enum("ibv_wc_opcode", "IBV_WC_RECV_RDMA_WITH_IMM")
        while not self._closed.is_set():
            count, completions = endpoint.cq.poll()
            if not count:
                time.sleep(delay)
                delay = min(delay * 2, 2e-4)
                continue
            delay = 1e-5
            for wc in completions:
                if wc.status != ok:
                    raise ConnectionError(f"RDMA completion failed with status {wc.status}")
                if wc.opcode == with_imm:
                    endpoint.post_recv()
                    header = endpoint.mr.read(HEADER_SIZE, 0)
                    payload = endpoint.mr.read(payload_length_hint(header, self.capacity), HEADER_SIZE)
                    with self._lock:
                        self.context.publish(header, payload)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._listener.close()
        for thread in self._threads:
            thread.join(timeout=5.0)
        super().close()


class RdmaMetadataSender(MetadataSender):
    """Control-plane side: authenticates over TCP, connects an RC QP, pushes frames by RDMA WRITE WITH IMM."""

    def __init__(
        self,
        address: tuple[str, int],
        token: str | bytes,
        instance_id: int,
        device: str | None = None,
        port_num: int = 1,
        gid_index: int = 0,
        timeout_s: float = 10.0,
    ):
        self._timeout_s = timeout_s
        self._sock = socket.create_connection(tuple(address), timeout=timeout_s)
        try:
            auth.client_handshake(self._sock, auth.normalize_token(token))
            self._remote = _recv_info(self._sock)
            if self._remote.instance_id != instance_id:
                raise MetadataChannelError(f"{address} serves instance {self._remote.instance_id}, not {instance_id}")
            self._ep = _Endpoint(device, port_num, gid_index, HEADER_SIZE + self._remote.capacity, False)
            _send_info(self._sock, self._ep.info())
            self._ep.connect(self._remote)
            if auth.recv_message(self._sock, 16) != b"ready":
                raise MetadataChannelError("instance did not confirm the RDMA connection")
        except BaseException:
            self._sock.close()
            raise
        super().__init__(instance_id, self._remote.capacity)

    def transmit(self, header: bytes, payload) -> None:
        v = self._ep.v
        frame = header + memoryview(payload).cast("B").tobytes()
        self._ep.mr.write(frame, len(frame), 0)
        sge = v.SGE(self._ep.mr.buf, len(frame), self._ep.mr.lkey)
        imm = socket.htonl(header_seq(header) & 0xFFFFFFFF)
        wr = v.SendWR(
            opcode=v.enum("ibv_wr_opcode", "IBV_WR_RDMA_WRITE_WITH_IMM"),
            num_sge=1,
            sg=[sge],
            imm_data=imm,
            send_flags=v.enum("ibv_send_flags", "IBV_SEND_SIGNALED"),
        )
        wr.set_wr_rdma(self._remote.rkey, self._remote.addr)
        self._ep.qp.post_send(wr)
        self._await_send(v)

    def _await_send(self, v) -> None:
        deadline = time.monotonic() + self._timeout_s
        while time.monotonic() < deadline:
            count, completions = self._ep.cq.poll()
            if count:
                status = completions[0].status
                if status != v.enum("ibv_wc_status", "IBV_WC_SUCCESS"):
                    raise MetadataChannelError(f"RDMA WRITE WITH IMM failed with status {status}")
                return
        raise MetadataChannelError(f"RDMA WRITE WITH IMM did not complete within {self._timeout_s}s")

    def close(self) -> None:
        self._ep.close()
        self._sock.close()
