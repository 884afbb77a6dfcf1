"""A TCP relay that can stop relaying: a peer that vanished, or a server that stopped answering."""

from __future__ import annotations

import socket
import threading
from urllib.parse import urlsplit, urlunsplit


class StallProxy:
    """A TCP relay to ``host``:``port``; :meth:`stall` stops relaying and reading both ways
    while keeping every connection open, and relays nothing on the connections it accepts
    after: a client host that vanished (powered off, a NAT mapping dropped) as the server
    sees it, or a server that stopped answering (a network partition) as its clients see it."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.host_to = host
        self.port_to = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.stalled = threading.Event()
        self.closed = threading.Event()
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection((self.host_to, self.port_to))
            self.sockets += [client, server]
            for source, target in ((client, server), (server, client)):
                threading.Thread(target=self._relay, args=(source, target), daemon=True).start()

    def _relay(self, source: socket.socket, target: socket.socket) -> None:
        while not self.stalled.is_set():
            try:
                data = source.recv(65536)
                if not data or self.stalled.is_set():
                    break
                target.sendall(data)
            except OSError:
                return
        self.closed.wait()  # stalled: neither read nor close

    @classmethod
    def to_url(cls, url: str) -> tuple[StallProxy, str]:
        """A proxy to the server of ``url`` (``postgresql://…``), and ``url`` through it."""
        parts = urlsplit(url)
        proxy = cls(parts.port or 5432, host=parts.hostname or "127.0.0.1")
        user, at, _ = parts.netloc.rpartition("@")
        return proxy, urlunsplit(parts._replace(netloc=f"{user}{at}127.0.0.1:{proxy.port}"))

    def stall(self) -> None:
        self.stalled.set()

    def close(self) -> None:
        self.closed.set()
        self.listener.close()
        for sock in self.sockets:
            sock.close()
