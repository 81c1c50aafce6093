"""Running the server: the bind address check, the listening socket, uvicorn in the foreground
(`moescope serve`) or on a thread (the window's "Local server" switch)."""

from __future__ import annotations

import ipaddress
import socket
import threading

import uvicorn
from fastapi import FastAPI

from engine.errors import MoEScopeError


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None) -> None:
    """Loopback only, unless an API key guards the server."""
    if not is_loopback(host) and not api_key:
        raise MoEScopeError(f"--host {host} would let other machines use the model: set --api-key KEY too "
                            "(or keep the default 127.0.0.1)")


def listen(host: str, port: int) -> socket.socket:
    """The bound socket (port 0: any free one), before the model loads, so a taken port fails at once."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise MoEScopeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def _server(app: FastAPI) -> uvicorn.Server:
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2,
                            lifespan="off")
    return uvicorn.Server(config)


def serve_forever(app: FastAPI, sock: socket.socket) -> None:
    """Until Ctrl-C (uvicorn handles the signal)."""
    _server(app).run(sockets=[sock])


class ServerThread:
    """uvicorn on a background thread, for the window: `start` returns once it accepts connections."""

    def __init__(self, app: FastAPI, sock: socket.socket) -> None:
        self.sock = sock
        self.url = url_of(sock)
        self._server = _server(app)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, name="moescope-server",
                                        daemon=True)

    def start(self) -> None:
        """The socket already listens, so a client that connects before uvicorn runs simply waits in the backlog."""
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self.sock.close()
