"""Headless Chromium, driven over its DevTools protocol.

One client for the manual's screenshots (``docs/screenshots.py``) and the browser tests
(``tests/test_review_live.py``; ``tests/helpers.py`` launches it with the same flags). It is
here, beside the screenshots script, and not in ``tuneloop``: the product never drives a
browser.
"""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tuneloop.net import free_port

# Debian's chromium (its package's name for the program, or Ubuntu's older one).
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
START_TIMEOUT_S = 300  # chromium's DevTools port on a busy 2-core machine
ANSWER_TIMEOUT_S = 120
RENDER_TIMEOUT_S = 90


def headless(profile: Path) -> list[str]:
    """The command that starts headless Chromium on its own ``profile`` folder, without a
    sandbox (tests run as root in CI) and without reaching out to Google's services."""
    if CHROMIUM is None:
        raise RuntimeError("needs Debian's chromium: apt-get install chromium")
    return [
        CHROMIUM,
        *("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"),
        *("--disable-background-networking", "--disable-component-update", "--disable-sync"),
        f"--user-data-dir={profile}",
    ]


class Browser:
    """One page of headless Chromium in a fixed window: open it, poll it, click and type in
    it, shoot it."""

    def __init__(self, profile: Path, window: tuple[int, int]) -> None:
        from websockets.sync.client import connect

        port = free_port()
        self.process = subprocess.Popen(
            [
                *headless(profile),
                "--hide-scrollbars",
                f"--remote-debugging-port={port}",
                f"--window-size={window[0]},{window[1]}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        def page() -> str | None:
            if self.process.poll() is not None:
                raise RuntimeError(f"chromium stopped (exit {self.process.returncode})")
            return _page_target(port)

        try:
            found = poll(page, START_TIMEOUT_S, "chromium's DevTools port")
            self.socket = connect(found, max_size=None, open_timeout=30)
        except BaseException:
            stop(self.process)
            raise
        self.calls = 0
        self.send(
            "Emulation.setDeviceMetricsOverride",
            width=window[0],
            height=window[1],
            deviceScaleFactor=1,
            mobile=False,
        )

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        """Call a DevTools ``method``; its result, or RuntimeError with the page's error."""
        self.calls += 1
        self.socket.send(json.dumps({"id": self.calls, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=ANSWER_TIMEOUT_S))
            if message.get("id") == self.calls:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                result: dict[str, Any] = message.get("result", {})
                return result

    def evaluate(self, expression: str) -> Any:
        """The JavaScript ``expression``'s value in the page (a promise's, once it settles)."""
        found = self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        return found["result"].get("value")

    def visit(self, url: str, ready: str) -> None:
        """Open ``url`` and wait until the JavaScript ``ready`` is true there."""
        # A blank page between two: a change of the hash alone would keep the last page's
        # images, which could answer ``ready`` for the next one.
        self.send("Page.navigate", url="about:blank")
        self.send("Page.navigate", url=url)
        self.wait(ready, url)

    def wait(self, ready: str, where: str = "the page", timeout: float = RENDER_TIMEOUT_S) -> None:
        """Wait until the page is loaded and the JavaScript ``ready`` is true in it."""

        def rendered() -> bool:
            with contextlib.suppress(RuntimeError):  # mid-navigation: nothing to evaluate in
                return bool(self.evaluate(f"document.readyState === 'complete' && !!({ready})"))
            return False

        poll(rendered, timeout, f"{where} to render ({ready})")

    def click(self, selector: str) -> None:
        """A real mouse click (move, press, release) at the middle of the element."""
        box = self.evaluate(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
            "e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
            "return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        x, y = box
        self.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def press(self, key: str) -> None:
        """A key typed on the keyboard: a letter or a digit."""
        code = f"Digit{key}" if key.isdigit() else f"Key{key.upper()}"
        keys = {"key": key, "code": code, "windowsVirtualKeyCode": ord(key.upper())}
        self.send("Input.dispatchKeyEvent", type="keyDown", text=key, **keys)
        self.send("Input.dispatchKeyEvent", type="keyUp", **keys)

    def capture(self, out: Path, clip: str | None = None) -> Path:
        """The window (or the box of the element ``clip`` selects) as a PNG in ``out``."""
        self.evaluate("document.fonts.ready.then(() => true)")  # no fallback font in the shot
        params: dict[str, Any] = {"format": "png"}
        if clip is not None:
            box = self.evaluate(
                f"(() => {{ const r = document.querySelector({json.dumps(clip)})"
                ".getBoundingClientRect(); return [r.x, r.y, r.width, r.height]; })()"
            )
            x, y, width, height = box
            params["clip"] = {"x": x, "y": y, "width": width, "height": height, "scale": 1}
        data = self.send("Page.captureScreenshot", **params)["data"]
        out.write_bytes(base64.b64decode(data))
        return out

    def shoot(self, url: str, ready: str, out: Path) -> Path:
        """``url`` once ``ready`` is true there, as a PNG of the window in ``out``."""
        self.visit(url, ready)
        return self.capture(out)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.socket.close()
        stop(self.process)


def _page_target(port: int) -> str | None:
    """The DevTools websocket of Chromium's page on ``port``, once it listens."""
    with contextlib.suppress(urllib.error.URLError, OSError, ValueError):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=2) as answer:
            targets = json.load(answer)
        pages = [t["webSocketDebuggerUrl"] for t in targets if t.get("type") == "page"]
        return pages[0] if pages else None
    return None


def poll(check: Callable[[], Any], timeout: float, what: str) -> Any:
    """``check()``'s first true value, asked every 0.3 s; an error naming ``what`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.3)
    raise RuntimeError(f"gave up waiting {timeout:.0f} s for {what}")


def stop(process: subprocess.Popen[Any], grace: float = 20.0) -> None:
    """End ``process``: asked first, killed after ``grace`` seconds."""
    process.terminate()
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
