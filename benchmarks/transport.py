"""What one round trip costs between the driver and a stage in another process, by transport and payload.

The data plane of a cascade on Ray (issue 17) moves, per round and stage, token ids (a few integers) and, when
sampling, rows of the vocabulary (float32). This measures a round trip (send a payload, get an answer of the same
size back) between this process and a worker process for:

- ``ray``: an ordinary Ray actor call (``ray.get(actor.echo.remote(x))``), what the Ray backend uses today;
- ``zmq``: a ZeroMQ REQ/REP pair over ``ipc://`` (pickle protocol 5, buffers sent out of band, no copy into the
  pickle), what vLLM's newest Ray executor uses across nodes;
- ``shm``: the payload written into a shared-memory buffer both processes map, with only its size sent through
  ZeroMQ (one copy in, one copy out, no serialisation), what vLLM uses within a node.
- ``channel``: Cascade's own data plane (``cascade.distributed.channel``): ZeroMQ REQ/REP over ``ipc://``, the
  actor's secret checked before anything is unpickled, out-of-band buffers sent zero-copy only from 64 KiB up.

Payloads: ``ids`` (16 token ids), ``row`` (one row of a 4,096-token vocabulary, the demo family's),
``rows-16x5`` (16 requests × 5 positions × 4,096: a batched sampling round), ``row-128k`` (one row of a
128k vocabulary, Llama 3's). Reports the median and p95 round trip in microseconds.

    python benchmarks/transport.py [--repeats 300] [--skip-ray]     (needs the bench and ray extras)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import statistics
import time
from multiprocessing import shared_memory

import numpy as np

PAYLOADS = {
    "ids": lambda: np.arange(16, dtype=np.int64),
    "row": lambda: np.random.default_rng(0).random(4096, dtype=np.float32),
    "rows-16x5": lambda: np.random.default_rng(0).random((80, 4096), dtype=np.float32),
    "row-128k": lambda: np.random.default_rng(0).random(128_256, dtype=np.float32),
}
SHM_BYTES = 8 << 20


def _timed(call, payload, repeats: int) -> tuple[float, float]:
    for _ in range(10):
        call(payload)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call(payload)
        times.append((time.perf_counter() - started) * 1e6)
    times.sort()
    return statistics.median(times), times[int(0.95 * (len(times) - 1))]


# ---- zmq ------------------------------------------------------------------------------------------------------


def _zmq_worker(address: str) -> None:
    import zmq

    socket = zmq.Context().socket(zmq.REP)
    socket.connect(address)
    while True:
        frames = socket.recv_multipart(copy=False)
        message = pickle.loads(frames[0].bytes, buffers=[f.buffer for f in frames[1:]])
        if message is None:
            socket.send(pickle.dumps(None))
            return
        buffers: list[pickle.PickleBuffer] = []
        head = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
        socket.send_multipart([head, *buffers], copy=False)


def _zmq_client(address: str):
    import zmq

    socket = zmq.Context().socket(zmq.REQ)
    socket.bind(address)

    def call(payload):
        buffers: list[pickle.PickleBuffer] = []
        head = pickle.dumps(payload, protocol=5, buffer_callback=buffers.append)
        socket.send_multipart([head, *buffers], copy=False)
        frames = socket.recv_multipart(copy=False)
        return pickle.loads(frames[0].bytes, buffers=[f.buffer for f in frames[1:]])

    return socket, call


# ---- shared memory ------------------------------------------------------------------------------------------------


def _shm_worker(address: str, name: str) -> None:
    import zmq

    memory = shared_memory.SharedMemory(name=name)
    socket = zmq.Context().socket(zmq.REP)
    socket.connect(address)
    while True:
        header = socket.recv()
        if not header:
            socket.send(b"")
            memory.close()
            return
        size, dtype = int.from_bytes(header[:8], "little"), header[8:].decode()
        data = np.frombuffer(memory.buf, dtype=dtype, count=size // np.dtype(dtype).itemsize).copy()  # the stage's read
        np.frombuffer(memory.buf, dtype=dtype, count=data.size)[:] = data  # and its answer, the same size
        socket.send(header)


def _shm_client(address: str, memory: shared_memory.SharedMemory):
    import zmq

    socket = zmq.Context().socket(zmq.REQ)
    socket.bind(address)

    def call(payload: np.ndarray):
        view = np.frombuffer(memory.buf, dtype=payload.dtype, count=payload.size)
        view[:] = payload.reshape(-1)
        socket.send(payload.nbytes.to_bytes(8, "little") + payload.dtype.str.encode())
        socket.recv()
        return view.copy().reshape(payload.shape)

    return socket, call


# ---- cascade's channel ----------------------------------------------------------------------------------------------


def _channel_worker(endpoint: str, connection) -> None:
    from cascade.distributed.channel import ChannelServer

    server = ChannelServer(lambda method, args: args[0], [endpoint], setup=lambda: None)
    connection.send((server.endpoints[0], server.secret))
    connection.recv()  # until the driver is done


# ---- ray ----------------------------------------------------------------------------------------------------------


def _ray_client():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Echo:
        def echo(self, x):
            return x

    actor = Echo.remote()
    ray.get(actor.echo.remote(0))
    return ray, lambda payload: ray.get(actor.echo.remote(payload))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--skip-ray", action="store_true")
    args = parser.parse_args()
    payloads = {name: make() for name, make in PAYLOADS.items()}
    results: dict[str, dict[str, tuple[float, float]]] = {}
    context = mp.get_context("spawn")

    address = f"ipc:///tmp/cascade-transport-{mp.current_process().pid}-zmq"
    worker = context.Process(target=_zmq_worker, args=(address,), daemon=True)
    socket, call = _zmq_client(address)
    worker.start()
    results["zmq"] = {name: _timed(call, p, args.repeats) for name, p in payloads.items()}
    call(None)
    worker.join(10)
    socket.close()

    memory = shared_memory.SharedMemory(create=True, size=SHM_BYTES)
    address = f"ipc:///tmp/cascade-transport-{mp.current_process().pid}-shm"
    worker = context.Process(target=_shm_worker, args=(address, memory.name), daemon=True)
    socket, call = _shm_client(address, memory)
    worker.start()
    results["shm"] = {name: _timed(call, p, args.repeats) for name, p in payloads.items()}
    socket.send(b"")
    socket.recv()
    worker.join(10)
    socket.close()
    memory.close()
    memory.unlink()

    from cascade.distributed.channel import Channel, ChannelServer

    parent, child = context.Pipe()
    worker = context.Process(target=_channel_worker, args=(ChannelServer.endpoints_for("127.0.0.1")[0], child),
                             daemon=True)
    worker.start()
    channel = Channel(*parent.recv())
    results["channel"] = {
        name: _timed(lambda x: channel.call("echo", (x,), 60, lambda: None), p, args.repeats)
        for name, p in payloads.items()
    }
    parent.send(None)
    worker.join(10)
    channel.close()

    if not args.skip_ray:
        ray, call = _ray_client()
        results["ray"] = {name: _timed(call, p, args.repeats) for name, p in payloads.items()}
        ray.shutdown()

    print("round trip, µs: median / p95 (payload each way)")
    print(f"| transport | {' | '.join(f'{n} ({payloads[n].nbytes:,} B)' for n in payloads)} |")
    print(f"|---|{'---|' * len(payloads)}")
    for transport, row in results.items():
        print(f"| {transport} | {' | '.join(f'{m:.0f} / {p:.0f}' for m, p in row.values())} |")


if __name__ == "__main__":
    main()
