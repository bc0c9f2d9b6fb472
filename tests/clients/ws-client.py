#!/usr/bin/python3
"""A real WebSocket client (Debian's python3-websockets) against
tests/child/ws-server.lisp's websocket-driver app on Clack :gallop.
Usage: ws-client.py PORT.  Prints one line per check; the test compares."""
import asyncio
import sys

import websockets


async def main(port):
    base = "ws://127.0.0.1:%d" % port
    async with websockets.connect(base + "/echo", max_size=None) as ws:
        await ws.send("hello")
        print("text", await ws.recv())
        await ws.send(b"\x00\x01\x02\xff")
        print("binary", (await ws.recv()).hex())
        big = bytes(i % 251 for i in range(16 * 1024 * 1024))
        await ws.send(big)
        back = await ws.recv()
        print("big", len(back), back == big)
        await (await ws.ping(b"abc"))
        print("pong")
        await ws.close(code=4000, reason="bye")
        print("closed", ws.close_code, ws.close_reason)
    a = await websockets.connect(base + "/chat")
    b = await websockets.connect(base + "/chat")
    await a.send("hello from a")
    print("chat", await a.recv())
    print("chat", await b.recv())
    await a.close()
    await b.close()


asyncio.run(asyncio.wait_for(main(int(sys.argv[1])), 60))
