#!/usr/bin/python3
"""Debian's python3-websockets, with its default permessage-deflate offer,
against the native echo of tests/native/websocket.lisp.
Usage: ws-deflate-client.py PORT.  Prints one line per check; the test compares."""
import asyncio
import json
import random
import sys

import websockets


async def main(port):
    async with websockets.connect("ws://127.0.0.1:%d/echo" % port, max_size=None) as ws:
        for ext in ws.extensions:
            print("agreed", ext.name, "server_no_context_takeover", ext.remote_no_context_takeover,
                  "client_no_context_takeover", ext.local_no_context_takeover)
        await ws.send("hello")
        print("short", await ws.recv())
        records = json.dumps([{"id": i, "user": "user%d" % (i % 7), "text": "see you at six"}
                              for i in range(40)])
        await ws.send(records)
        print("json", len(records), await ws.recv() == records)
        big = bytes(i % 251 for i in range(4 * 1024 * 1024))
        await ws.send(big)
        print("big", await ws.recv() == big)
        noise = random.Random(7).randbytes(100000)
        await ws.send(noise)
        print("noise", await ws.recv() == noise)
        await ws.send(["frag", "mented " * 50, "message"])
        print("fragments", await ws.recv() == "frag" + "mented " * 50 + "message")
        await ws.close(code=4000, reason="bye")
        print("closed", ws.close_code, ws.close_reason)


asyncio.run(asyncio.wait_for(main(int(sys.argv[1])), 60))
