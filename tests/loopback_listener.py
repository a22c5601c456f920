"""A TCP listener on loopback that serves each connection in a thread of its own: the
base of the tests' hand-made peers and receivers, which misbehave on purpose."""

from __future__ import annotations

import socket
import threading


class LoopbackListener:
    """Subclasses say what to do with a connection (`serve`); `connections` counts them."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:  # closed
                return
            self.connections += 1
            threading.Thread(target=self.serve, args=(connection,), daemon=True).start()

    def serve(self, connection: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.listener.close()
