"""The delaying TCP proxy (bench/proxy.py): bytes pass intact both ways, the delay is applied,
and gRPC works through it. Timing asserts are lower bounds only (a loaded machine is slower)."""
import asyncio
import os
import socket
import subprocess
import sys
import threading
import time

from bench.launch import ENV, ROOT
from bench.proxy import DelayProxy, ThreadedDelayProxy


async def _echo_server():
    async def echo(reader, writer):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_bytes_intact_both_ways_and_in_order():
    async def main():
        server, port = await _echo_server()
        payload = os.urandom(3 << 20)  # larger than the 1 MiB buffer bound: exercises back-pressure
        async with DelayProxy("127.0.0.1", 0, "127.0.0.1", port, delay_s=0.002, max_buffer_bytes=1 << 20) as p:
            host, pport = p.address.rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(pport))

            async def send():
                for i in range(0, len(payload), 50_000):  # many writes of odd sizes
                    writer.write(payload[i:i + 50_000])
                    await writer.drain()
                writer.write_eof()

            sender = asyncio.ensure_future(send())
            got = await asyncio.wait_for(reader.read(-1), 60)  # up to the proxied EOF
            await sender
            writer.close()
        server.close()
        return payload, got

    payload, got = asyncio.run(main())
    assert got == payload


def test_round_trip_time_has_the_added_delay():
    async def main(delay_s):
        server, port = await _echo_server()
        async with DelayProxy("127.0.0.1", 0, "127.0.0.1", port, delay_s=delay_s) as p:
            host, pport = p.address.rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(pport))
            rtts = []
            for i in range(5):
                t0 = time.perf_counter()
                writer.write(b"ping%d" % i)
                await writer.drain()
                assert await reader.readexactly(5) == b"ping%d" % i
                rtts.append(time.perf_counter() - t0)
            writer.close()
        server.close()
        return rtts

    rtts = asyncio.run(main(0.025))
    assert min(rtts) >= 0.050 * 0.95, rtts  # 2 × one-way delay (timer granularity slack only)


def test_grpc_through_the_proxy_module(services):
    """The real CLI (`python -m bench.proxy`) in front of a verify service: gRPC works and each
    round trip pays the delay."""
    from client import Client

    v, d = services("target", "draft")
    proc = subprocess.Popen([sys.executable, "-m", "bench.proxy", "--listen", "127.0.0.1:0", "--target", v.address,
                             "--rtt-ms", "40"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on "), line
        address = line.split()[-1]
        with Client(address, target_only=True, timeout=60) as c:
            c.info()  # connection set-up
            direct = Client(v.address, target_only=True, timeout=60)
            want = direct.generate(prompt="w3 w4 w5", max_new_tokens=6)
            direct.close()
            t0 = time.perf_counter()
            got = c.generate(prompt="w3 w4 w5", max_new_tokens=6)
            assert time.perf_counter() - t0 >= 0.040 * 0.95
        assert got.token_ids == want.token_ids
    finally:
        proc.terminate()
        assert proc.wait(10) == 0


def test_threaded_proxy_stops_cleanly():
    async def serve_once():
        return await _echo_server()

    loop = asyncio.new_event_loop()
    server, port = loop.run_until_complete(serve_once())
    threading.Thread(target=loop.run_forever, daemon=True).start()
    p = ThreadedDelayProxy("127.0.0.1", 0, "127.0.0.1", port, delay_s=0.001)
    host, pport = p.address.rsplit(":", 1)
    s = socket.create_connection((host, int(pport)))
    s.sendall(b"hello")
    assert s.recv(5) == b"hello"
    p.stop()  # with a connection still open
    s.settimeout(5)
    assert s.recv(5) == b""  # the proxy closed it
    s.close()
    loop.call_soon_threadsafe(loop.stop)
