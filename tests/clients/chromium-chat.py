#!/usr/bin/python3
"""Two pages of Debian's headless Chromium on examples/chat.lisp's /chat,
driven through the DevTools protocol (with python3-websockets): page A
sends a message with the page's own form, page B must show it.
Usage: chromium-chat.py PORT.  Prints "B saw: <its chat log>", or why not."""
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import websockets


def browser():
    return shutil.which("chromium") or shutil.which("chromium-browser")


async def evaluate(ws, expression, ids=[0]):
    ids[0] += 1
    await ws.send(json.dumps({"id": ids[0], "method": "Runtime.evaluate",
                              "params": {"expression": expression, "returnByValue": True}}))
    while True:
        reply = json.loads(await ws.recv())
        if reply.get("id") == ids[0]:
            return reply.get("result", {}).get("result", {}).get("value")


async def until(ws, expression, check, seconds=20):
    end = time.time() + seconds
    while time.time() < end:
        value = await evaluate(ws, expression)
        if check(value):
            return value
        await asyncio.sleep(0.1)
    return value


async def main(port):
    profile = tempfile.mkdtemp(prefix="gallop-chromium-")
    process = subprocess.Popen(
        [browser(), "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-extensions", "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
         "--user-data-dir=" + profile, "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        active = os.path.join(profile, "DevToolsActivePort")
        for _ in range(300):
            if os.path.exists(active) and open(active).read().strip():
                break
            time.sleep(0.1)
        debug_port = int(open(active).read().split()[0])
        page = "http://127.0.0.1:%d/chat" % port

        def new_target():
            request = urllib.request.Request(
                "http://127.0.0.1:%d/json/new?%s" % (debug_port, page), method="PUT")
            return json.load(urllib.request.urlopen(request))["webSocketDebuggerUrl"]

        a = await websockets.connect(new_target(), max_size=None)
        b = await websockets.connect(new_target(), max_size=None)
        for ws in (a, b):
            if await until(ws, "document.body && document.body.dataset.open", lambda v: v == "yes") != "yes":
                print("a page did not open its WebSocket")
                return
        await evaluate(a, "document.getElementById('text').value = 'hello from A';"
                          "document.getElementById('form').requestSubmit(); true")
        log = await until(b, "Array.from(document.querySelectorAll('#log li'))"
                             ".map(e => e.textContent).join('|')",
                          lambda v: v and "hello from A" in v)
        print("B saw:", log)
        await a.close()
        await b.close()
    finally:
        process.kill()
        process.wait()
        shutil.rmtree(profile, ignore_errors=True)


asyncio.run(asyncio.wait_for(main(int(sys.argv[1])), 90))
