"""The data plane between the driver and a stage actor (``cascade.distributed.channel``), over real sockets."""

from __future__ import annotations

import pickle
import sys
import tempfile
import threading

import numpy as np
import pytest
import zmq

from cascade.distributed.channel import Channel, ChannelServer, ChannelTimeout


class Handler:
    def __init__(self):
        self.calls: list[tuple[str, tuple]] = []
        self.release = threading.Event()
        self.release.set()

    def __call__(self, method: str, args: tuple):
        self.calls.append((method, args))
        if method == "fail":
            raise KeyError(args[0])
        if method == "block":
            self.release.wait()
        return args


@pytest.fixture(params=["ipc", "tcp"])
def served(request):
    handler = Handler()
    ipc, tcp = ChannelServer.endpoints_for("127.0.0.1")
    server = ChannelServer(handler, [ipc if request.param == "ipc" else tcp], setup=lambda: None)
    yield handler, server
    handler.release.set()


def test_a_call_returns_what_the_handler_returned_rows_included(served):
    handler, server = served
    channel = Channel(server.endpoints[0], server.secret)
    rows = np.random.default_rng(0).random((5, 4096), dtype=np.float32)  # large enough to travel zero-copy
    out = channel.call("forward", ("target", [3, 1], rows), 10, lambda: None)
    assert out[:2] == ("target", [3, 1])
    assert np.array_equal(out[2], rows)
    assert handler.calls[0][0] == "forward"


def test_the_handlers_exception_is_raised_in_the_driver_and_the_channel_goes_on(served):
    _, server = served
    channel = Channel(server.endpoints[0], server.secret)
    with pytest.raises(KeyError, match="missing"):
        channel.call("fail", ("missing",), 10, lambda: None)
    assert channel.call("echo", (1,), 10, lambda: None) == (1,)


def test_a_request_without_the_secret_is_refused_before_it_is_unpickled(served):
    handler, server = served

    class Bomb:
        def __reduce__(self):  # what unpickling a hostile message would run
            return (handler.calls.append, (("unpickled", ()),))

    socket = zmq.Context.instance().socket(zmq.REQ)
    socket.connect(server.endpoints[0])
    socket.send_multipart([b"x" * 32, pickle.dumps(("echo", (Bomb(),)))])
    ok, error, _ = pickle.loads(socket.recv_multipart()[0])
    socket.close(linger=0)
    assert not ok and isinstance(error, PermissionError)
    assert handler.calls == []  # nothing was unpickled, nothing ran
    assert Channel(server.endpoints[0], server.secret).call("echo", (2,), 10, lambda: None) == (2,)


def test_a_call_that_gets_no_answer_times_out_and_the_channel_is_usable_after(served):
    handler, server = served
    channel = Channel(server.endpoints[0], server.secret)
    handler.release.clear()
    checks = []
    with pytest.raises(ChannelTimeout, match="block"):
        channel.call("block", (), 0.6, lambda: checks.append(1))
    assert checks  # the actor's liveness was asked while waiting
    handler.release.set()
    assert channel.call("echo", (3,), 10, lambda: None) == (3,)


def test_a_failed_liveness_check_ends_the_wait_with_its_error(served):
    handler, server = served
    channel = Channel(server.endpoints[0], server.secret)
    handler.release.clear()

    def dead():
        raise ConnectionError("the actor died")

    with pytest.raises(ConnectionError, match="died"):
        channel.call("block", (), 30, dead)
    handler.release.set()
    assert channel.call("echo", (4,), 10, lambda: None) == (4,)


def test_a_setup_that_fails_fails_the_constructor():
    def setup():
        raise OSError("no such model")

    with pytest.raises(OSError, match="no such model"):
        ChannelServer(lambda m, a: None, ChannelServer.endpoints_for("127.0.0.1")[:1], setup)


def test_a_same_node_channel_leaves_no_socket_file_behind(tmp_path, monkeypatch):
    """On Linux the ipc endpoint is an abstract socket: nothing in the temporary directory outlives the actor."""
    if not sys.platform.startswith("linux"):
        pytest.skip("abstract sockets are Linux's")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    tempfile.tempdir = None  # re-read TMPDIR
    try:
        ipc, _ = ChannelServer.endpoints_for("127.0.0.1")
        server = ChannelServer(Handler(), [ipc], setup=lambda: None)
        assert Channel(server.endpoints[0], server.secret).call("echo", (5,), 10, lambda: None) == (5,)
        assert list(tmp_path.iterdir()) == []
    finally:
        tempfile.tempdir = None
