"""A TCP proxy that adds a fixed one-way delay in each direction (round-trip time = 2 × delay).

Put it between the draft and the verify service to see how the split topology behaves across a
network: gRPC over HTTP/2 is plain TCP to it. Bytes are forwarded unchanged and in order.

    python -m bench.proxy --listen 127.0.0.1:0 --target 10.77.0.2:50051 --rtt-ms 10
    # prints `listening on HOST:PORT` once it accepts connections

    async with DelayProxy("127.0.0.1", 0, "10.77.0.2", 50051, delay_s=0.005) as p:
        ...  # dial p.address

How the delay is applied: a reader stamps every chunk it reads with a deadline (arrival time +
delay) and appends it to a FIFO; a writer sends each chunk when its deadline has passed. The
reader never waits for the delay, so the link keeps its throughput (a bandwidth-delay pipe, not
stop-and-wait), and a single FIFO per direction with monotone deadlines keeps byte order. Each
direction holds at most `max_buffer_bytes` in flight; beyond that the reader stops reading and
TCP flow control pushes back on the sender. (`tc qdisc netem` does the same in the kernel; this
exists because netem is not available everywhere.)
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import logging
import signal
import socket
import sys
import time

log = logging.getLogger("specdec.proxy")
CHUNK = 64 * 1024


def split_hostport(s: str) -> tuple[str, int]:
    host, _, port = s.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {s!r}")
    return host.strip("[]"), int(port)


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):  # Nagle would add its own delay to small HTTP/2 frames
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _DelayedPipe:
    """One direction of one connection: reader → FIFO of (deadline, bytes) → writer."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float, max_buffer_bytes: int):
        self.reader, self.writer = reader, writer
        self.delay_s, self.max_buffer_bytes = delay_s, max_buffer_bytes
        self.fifo: collections.deque[tuple[float, bytes]] = collections.deque()
        self.buffered = 0
        self.changed = asyncio.Event()  # set whenever the FIFO gains or loses an item

    async def run(self) -> None:
        tasks = [asyncio.ensure_future(self._read()), asyncio.ensure_future(self._write())]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:  # one side failed (reset) or we were cancelled: stop the other too
                t.cancel()

    async def _read(self) -> None:
        while True:
            while self.buffered >= self.max_buffer_bytes:  # bounded: stop reading, let TCP push back
                self.changed.clear()
                await self.changed.wait()
            data = await self.reader.read(CHUNK)
            self.fifo.append((time.monotonic() + self.delay_s, data))
            self.buffered += len(data)
            self.changed.set()
            if not data:
                return

    async def _write(self) -> None:
        while True:
            while not self.fifo:
                self.changed.clear()
                await self.changed.wait()
            deadline, data = self.fifo[0]
            wait = deadline - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self.fifo.popleft()
            self.buffered -= len(data)
            self.changed.set()
            if not data:
                if self.writer.can_write_eof():
                    with contextlib.suppress(OSError):
                        self.writer.write_eof()  # half-close: the peer sees EOF, the other direction stays open
                return
            self.writer.write(data)
            await self.writer.drain()


class DelayProxy:
    """Listens on (host, port) and forwards each connection to (target_host, target_port), delaying
    every byte by `delay_s` in each direction. Use `async with`, or `await start()` / `await close()`."""

    def __init__(self, host: str, port: int, target_host: str, target_port: int, delay_s: float = 0.0,
                 max_buffer_bytes: int = 4 << 20):
        if delay_s < 0:
            raise ValueError("delay must be >= 0")
        self.host, self.port = host, port
        self.target = (target_host, target_port)
        self.delay_s, self.max_buffer_bytes = delay_s, max_buffer_bytes
        self.server: asyncio.base_events.Server | None = None
        self.connections: set[asyncio.Task] = set()
        self.address = ""

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, self.host, self.port)
        host, port = self.server.sockets[0].getsockname()[:2]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return self.address

    async def close(self) -> None:
        """Stop accepting, then drop every open connection."""
        if self.server is not None:
            self.server.close()
        for t in list(self.connections):
            t.cancel()
        await asyncio.gather(*self.connections, return_exceptions=True)
        if self.server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 5)

    async def __aenter__(self) -> "DelayProxy":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self.connections.add(task)
        u_writer = None
        try:
            try:
                async with asyncio.timeout(10):  # not wait_for: on 3.11 it drops a cancel that lands as the connection opens
                    u_reader, u_writer = await asyncio.open_connection(*self.target)
            except (OSError, asyncio.TimeoutError) as e:
                log.warning("cannot reach target %s:%s: %s", *self.target, e)
                return
            _nodelay(c_writer)
            _nodelay(u_writer)
            up = _DelayedPipe(c_reader, u_writer, self.delay_s, self.max_buffer_bytes)
            down = _DelayedPipe(u_reader, c_writer, self.delay_s, self.max_buffer_bytes)
            pipes = [asyncio.ensure_future(up.run()), asyncio.ensure_future(down.run())]
            try:
                # Both directions finish on EOF; a reset on either side ends the whole connection.
                done, pending = await asyncio.wait(pipes, return_when=asyncio.FIRST_EXCEPTION)
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pipes, return_exceptions=True)
            finally:
                for t in pipes:
                    t.cancel()
        except asyncio.CancelledError:
            pass
        finally:
            for w in (c_writer, u_writer):
                if w is not None:
                    w.close()
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(w.wait_closed(), 1)
            self.connections.discard(task)


class ThreadedDelayProxy:
    """A DelayProxy on its own event loop in a daemon thread, for blocking code (tests, scripts).

        p = ThreadedDelayProxy("127.0.0.1", 0, host, port, delay_s=0.005); p.address; p.stop()"""

    def __init__(self, *args, **kw):
        import threading

        self._loop = asyncio.new_event_loop()
        self.proxy = DelayProxy(*args, **kw)
        started = threading.Event()

        def run():
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self.proxy.start())
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True, name="delay-proxy")
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("proxy did not start")
        self.address = self.proxy.address

    def stop(self) -> None:
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self.proxy.close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


async def _serve(args) -> None:
    host, port = split_hostport(args.listen) if args.listen else (args.host, args.port)
    t_host, t_port = split_hostport(args.target)
    delay = args.delay_ms / 1000 if args.delay_ms is not None else args.rtt_ms / 2000
    proxy = DelayProxy(host, port, t_host, t_port, delay_s=delay, max_buffer_bytes=args.max_buffer_bytes)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await proxy.start()
    print(f"listening on {proxy.address}", flush=True)
    log.info("proxy %s -> %s:%s, one-way delay %.1f ms", proxy.address, t_host, t_port, delay * 1000)
    await stop.wait()
    await proxy.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", help="HOST:PORT to listen on (port 0 picks a free port)")
    p.add_argument("--host", default="127.0.0.1", help="listen host when --listen is not given")
    p.add_argument("--port", type=int, default=0, help="listen port when --listen is not given")
    p.add_argument("--target", required=True, help="HOST:PORT to forward to")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--rtt-ms", type=float, default=0.0, help="added round-trip time, split evenly over the two directions")
    g.add_argument("--delay-ms", type=float, help="added one-way delay (each direction)")
    p.add_argument("--max-buffer-bytes", type=int, default=4 << 20, help="bytes held in flight per direction and connection")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
