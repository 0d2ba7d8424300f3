"""A process's TCP connections as the kernel sees them: bytes received and sent, and data waiting.

The pipeline's stages (engine/pipeline.py) talk through sockets that MLX's ring backend opens inside the
process, not through anything Python holds; `Connections.find` takes duplicates of them by port. Two
things the kernel knows about them are useful:

* Linux keeps per-connection counters in `struct tcp_info` (getsockopt TCP_INFO): `tcpi_bytes_received`
  (Linux 4.1+) and `tcpi_bytes_sent` (4.19+) count payload bytes, without TCP/IP headers and with
  retransmissions counted once. Read for a stage's connections, they give the bytes it took off the
  link, independent of what the protocol's own code says it sent.
* Whether data is waiting (`wait_readable`, select(2)): a stage can sleep in the kernel until its input
  arrives, where the ring's own socket threads would poll for it at a full core.

Elsewhere (macOS's tcp_info differs, and it has no /proc) `Connections.find` returns None.

Reference: Linux include/uapi/linux/tcp.h, `struct tcp_info` (the byte offsets below).

See chapter: pipeline
"""

from __future__ import annotations

import os
import select
import socket
import struct
import sys
from dataclasses import dataclass

TCP_INFO_SIZE = 216          # bytes of struct tcp_info up to tcpi_bytes_retrans
BYTES_RECEIVED_AT = 128      # offset of __u64 tcpi_bytes_received
BYTES_SENT_AT = 200          # offset of __u64 tcpi_bytes_sent


def connected_tcp(ports: set[int]) -> list[socket.socket]:
    """Duplicates of this process's connected TCP sockets with either end's port in `ports` (the
    duplicates share the connection: reading counters through them changes nothing)."""
    inodes = {}                                  # socket inode -> one fd; read before any duplicate exists
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:                          # listdir's own descriptor, closed by now
            continue
        if link.startswith("socket:"):
            inodes.setdefault(link, int(name))
    out = []
    for fd in inodes.values():
        try:
            s = socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM)
        except OSError:
            continue
        try:
            if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6) and \
                    {s.getsockname()[1], s.getpeername()[1]} & ports:
                out.append(s)
                continue
        except OSError:                          # a listening or closed socket has no peer
            pass
        s.close()
    return out


@dataclass
class Connections:
    """The kernel's view of a set of connections (a pipeline stage's links to its neighbours)."""
    sockets: list[socket.socket]

    @classmethod
    def find(cls, ports: set[int]) -> Connections | None:
        """This process's connections on `ports`, or None where they cannot be found or read (not Linux,
        or no such connection)."""
        if not sys.platform.startswith("linux"):
            return None
        found = connected_tcp(ports)
        return cls(found) if found else None

    def _field(self, offset: int) -> int:
        total = 0
        for s in self.sockets:
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_SIZE)
            total += struct.unpack_from("=Q", info, offset)[0] if len(info) >= offset + 8 else 0
        return total

    def received(self) -> int:
        """Payload bytes received on these connections so far."""
        return self._field(BYTES_RECEIVED_AT)

    def sent(self) -> int:
        """Payload bytes sent on these connections so far (0 before Linux 4.19)."""
        return self._field(BYTES_SENT_AT)

    def wait_readable(self, timeout_s: float | None = None) -> bool:
        """Sleep until data (or an end of stream) is waiting on one of the connections; False on timeout."""
        return bool(select.select(self.sockets, [], [], timeout_s)[0])

    def close(self) -> None:
        """Close the duplicates (the connections themselves stay open)."""
        for s in self.sockets:
            s.close()
