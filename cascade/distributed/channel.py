"""The data plane between the driver and a stage actor: ZeroMQ request/reply, Ray kept for the rest.

An ordinary Ray actor call costs 1–2 ms on a CPU node whatever it carries (``benchmarks/transport.py``), as
much as a small target's forward pass, and a round makes one or two per stage. The stage calls of a round
(``forward``, ``draft``) therefore go over a ZeroMQ socket the actor serves from a thread of its own:
``ipc://`` when the driver is on the actor's node, TCP on the node's address otherwise. Ray still places the
actors, restarts them, says whether one lives, and hands the driver the channel's address and secret
(an authenticated Ray call), so the data plane needs no configuration of its own.

Messages are pickled (protocol 5; numpy rows travel as separate frames, not copied into the pickle). A reply also
carries the wall seconds the call spent in emulated passes, which the driver's thread counts as device time (so the
engine's host time leaves out the actors' emulated passes it waited for, as it does for stages in its own process).
A request starts with the actor's secret, compared before anything is unpickled: a process that can reach the port but
was not given the secret by Ray cannot make the actor unpickle its bytes.
"""

from __future__ import annotations

import hmac
import os
import pickle
import secrets
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable

import zmq

from cascade.emulation.device import charge_device_seconds, device_seconds_on_this_thread

_ZERO_COPY = 1 << 16  # bytes: below this a frame is copied (zmq's zero-copy path costs more than a small copy)
_POLL_MS = 250  # how often a waiting driver checks that the actor is still alive


class ChannelTimeout(RuntimeError):
    """The actor did not answer in time."""


def _pack(message: object) -> list:
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
    return [head, *(buffer.raw() for buffer in buffers)]


def _send(socket: zmq.Socket, frames: list) -> None:
    socket.send_multipart(frames, copy=max(len(f) for f in frames) < _ZERO_COPY)


def _unpack(frames: list) -> object:
    return pickle.loads(frames[0], buffers=frames[1:])


class ChannelServer:
    """Serves ``handler(method, args)`` on ``endpoints`` from one daemon thread of the actor, which first runs
    ``setup`` (and the constructor waits for it, raising what it raised)."""

    def __init__(self, handler: Callable[[str, tuple], object], endpoints: list[str], setup: Callable[[], None]):
        self._handler = handler
        self.secret = secrets.token_bytes(32)
        self._socket = zmq.Context.instance().socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self.endpoints = []
        for endpoint in endpoints:
            self._socket.bind(endpoint)
            self.endpoints.append(self._socket.getsockopt_string(zmq.LAST_ENDPOINT))
        failure: list[BaseException] = []
        started = threading.Event()

        def run() -> None:
            try:
                setup()
            except BaseException as error:  # the actor's constructor raises it (a model that does not load)
                failure.append(error)
            finally:
                started.set()
            if not failure:
                self._serve()

        threading.Thread(target=run, name="cascade-channel", daemon=True).start()
        started.wait()
        if failure:
            raise failure[0]

    @staticmethod
    def endpoints_for(node_ip: str) -> list[str]:
        """``ipc://`` for a driver on this node — in Linux's abstract namespace, which leaves no file behind when
        the actor is killed, elsewhere in the temporary directory — and TCP on a free port for the others."""
        name = f"cascade-{uuid.uuid4().hex[:12]}"
        local = f"ipc://@{name}" if sys.platform.startswith("linux") else f"ipc://{os.path.join(tempfile.gettempdir(), name)}"
        return [local, f"tcp://{node_ip}:*"]

    def _serve(self) -> None:
        while True:
            frames = self._socket.recv_multipart()
            if not frames or not hmac.compare_digest(frames[0], self.secret):
                self._socket.send_multipart(_pack((False, PermissionError("wrong channel secret"), 0.0)))
                continue
            device = device_seconds_on_this_thread()
            try:
                method, args = _unpack(frames[1:])
                ok, value = True, self._handler(method, args)
            except Exception as error:  # the driver raises it: StaleContext, a bad argument, a failed forward
                ok, value = False, error
            device = device_seconds_on_this_thread() - device  # the call's emulated passes (0 when not emulated)
            try:
                frames = _pack((ok, value, device))
            except Exception as error:  # an exception that does not pickle still gets its message across
                frames = _pack((False, RuntimeError(f"{type(error).__name__}: {error}"), device))
            _send(self._socket, frames)


class Channel:
    """The driver's end: one request at a time, like the synchronous Ray call it replaces."""

    def __init__(self, address: str, secret: bytes):
        self.address = address
        self._secret = secret
        self._socket = self._connect()

    def _connect(self) -> zmq.Socket:
        socket = zmq.Context.instance().socket(zmq.REQ)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.address)
        return socket

    def call(self, method: str, args: tuple, timeout_s: float, alive: Callable[[], None]) -> object:
        """The actor's ``method(*args)``. While waiting, ``alive()`` is called every quarter of a second and may
        raise (the actor died: Ray knows before any timeout); after ``timeout_s`` raises :class:`ChannelTimeout`.
        Either way the socket is replaced, since a request socket cannot send again before it has its reply."""
        try:
            _send(self._socket, [self._secret, *_pack((method, args))])
            deadline = time.monotonic() + timeout_s
            while not self._socket.poll(_POLL_MS):
                if time.monotonic() > deadline:
                    raise ChannelTimeout(f"no answer to {method} within {timeout_s} s")
                alive()
            ok, value, device = _unpack(self._socket.recv_multipart())
        except BaseException:
            self.close()
            self._socket = self._connect()
            raise
        charge_device_seconds(device)
        if not ok:
            raise value
        return value

    def close(self) -> None:
        self._socket.close(linger=0)
