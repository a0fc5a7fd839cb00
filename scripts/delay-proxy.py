#!/usr/bin/env python3
"""A userspace TCP delay proxy: each `LISTEN_PORT:TARGET_HOST:TARGET_PORT` mapping accepts on 127.0.0.1:LISTEN_PORT
and forwards to TARGET_HOST:TARGET_PORT, delivering every chunk DELAY_MS after it was read, in each direction, in
order (a link with that one-way latency and no bandwidth limit). No `tc netem` needed.

usage: delay-proxy.py DELAY_MS LISTEN_PORT:TARGET_HOST:TARGET_PORT [...]
Prints `ready` once every port listens.
"""

import asyncio
import socket
import sys


def nodelay(writer):
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def pump(reader, writer, delay):
    loop = asyncio.get_running_loop()
    queue = asyncio.Queue()

    async def read():
        try:
            while True:
                data = await reader.read(65536)
                await queue.put((loop.time() + delay, data))
                if not data:
                    return
        except (ConnectionError, OSError):
            await queue.put((loop.time(), b""))

    async def write():
        try:
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            return

    await asyncio.gather(read(), write())


async def handle(client_reader, client_writer, host, port, delay):
    try:
        upstream_reader, upstream_writer = await asyncio.open_connection(host, port)
    except OSError:
        client_writer.close()
        return
    nodelay(client_writer)
    nodelay(upstream_writer)
    await asyncio.gather(
        pump(client_reader, upstream_writer, delay),
        pump(upstream_reader, client_writer, delay),
    )
    for w in (client_writer, upstream_writer):
        w.close()


async def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    delay = float(sys.argv[1]) / 1000.0
    servers = []
    for mapping in sys.argv[2:]:
        listen, host, port = mapping.split(":")
        servers.append(await asyncio.start_server(
            lambda r, w, h=host, p=int(port): handle(r, w, h, p, delay), "127.0.0.1", int(listen)))
    print("ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


if __name__ == "__main__":
    asyncio.run(main())
