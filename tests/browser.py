"""Headless Chromium for tests: install it (Debian's package), start it, drive it over DevTools.

The page is driven over the Chrome DevTools Protocol (CDP): Chromium listens on a free loopback
port, GET /json/list names the page's websocket, and a tiny synchronous client sends commands
(navigate, evaluate JavaScript, capture a screenshot) and waits for their answers. Single-page
apps such as the MLflow UI fill the page after their own fetches, so tests poll the rendered
text until what they expect is there instead of reading the first HTML.
"""

import base64
import itertools
import json
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from websockets.sync.client import ClientConnection, connect

from tests.services import apt_install, background, free_port, get_json, wait_for

CHROMIUM = Path("/usr/bin/chromium")
# Headless as root in a container, on loopback only: no sandbox (needs user namespaces), no
# GPU, and none of the background services that would try to reach the internet.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
)


def install_chromium() -> tuple[Path | None, str]:
    """Chromium's path, installed with apt when missing and possible; else None and why not."""
    why = apt_install("chromium", CHROMIUM.exists)
    return (CHROMIUM, "") if why is None else (None, why)


def require_chromium() -> Path:
    """Debian's Chromium, installed when missing (skip the test locally, fail it in CI)."""
    path, why = install_chromium()
    if path is not None:
        return path
    if os.environ.get("CI"):
        pytest.fail(f"no Chromium in CI: {why}", pytrace=False)
    pytest.skip(f"no Chromium: {why}")


class Page:
    """One browser tab driven over its DevTools websocket."""

    def __init__(self, websocket_url: str) -> None:
        # Screenshots arrive as one large base64 message: no size limit.
        self._ws: ClientConnection = connect(websocket_url, max_size=None, open_timeout=30)
        self._ids = itertools.count(1)

    def close(self) -> None:
        """Close the websocket (the tab stays until the browser stops)."""
        self._ws.close()

    def send(self, method: str, params: dict[str, Any] | None = None, limit_s: float = 60) -> Any:
        """Run one CDP command and return its result; events that arrive meanwhile are dropped."""
        call_id = next(self._ids)
        self._ws.send(json.dumps({"id": call_id, "method": method, "params": params or {}}))
        deadline = time.monotonic() + limit_s
        while True:
            message = json.loads(self._ws.recv(timeout=max(deadline - time.monotonic(), 0.1)))
            if message.get("id") != call_id:
                continue
            if "error" in message:
                raise RuntimeError(f"CDP {method} failed: {message['error']}")
            return message["result"]

    def navigate(self, url: str) -> None:
        """Open url in this tab."""
        result = self.send("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise RuntimeError(f"cannot open {url}: {result['errorText']}")

    def evaluate(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression evaluated in the page."""
        params = {"expression": expression, "returnByValue": True, "awaitPromise": True}
        result = self.send("Runtime.evaluate", params)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} raised: {result['exceptionDetails']}")
        return result["result"].get("value")

    def before_each_document(self, script: str) -> None:
        """Run script in every document this tab loads from now on, before the page's own."""
        self.send("Page.addScriptToEvaluateOnNewDocument", {"source": script})

    def set_viewport(self, width: int, height: int) -> None:
        """Make the page's viewport (and so screenshots) exactly width x height pixels."""
        metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}
        self.send("Emulation.setDeviceMetricsOverride", metrics)

    def scroll_to_text(self, text: str) -> bool:
        """Scroll the innermost element whose whole text is `text` into view; False if none."""
        script = f"""(() => {{
            const hits = [...document.querySelectorAll('body *')].filter(
                e => e.children.length === 0 && e.textContent.trim() === {json.dumps(text)});
            if (!hits.length) return false;
            hits[0].scrollIntoView({{block: 'center'}});
            return true;
        }})()"""
        return bool(self.evaluate(script))

    def text(self) -> str:
        """The page's rendered text (what a person reads, as document.body.innerText)."""
        return str(self.evaluate("document.body ? document.body.innerText : ''") or "")

    def wait_for_text(self, needles: Sequence[str], limit_s: float) -> str:
        """Poll the rendered text until every needle appears in it; return that text."""

        def shown() -> str | None:
            text = self.text()
            return text if all(n in text for n in needles) else None

        try:
            return wait_for(shown, limit_s, f"{list(needles)} on the page")
        except AssertionError as err:
            text = self.text()
            missing = [n for n in needles if n not in text]
            raise AssertionError(
                f"{err}; missing {missing}; the page shows:\n{text[:3000]}"
            ) from None

    def screenshot(self, *paths: Path) -> bytes:
        """Capture the visible page as PNG and write it to each path."""
        data = base64.b64decode(self.send("Page.captureScreenshot", {"format": "png"})["data"])
        for path in paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        return data


@contextmanager
def chromium(
    binary: Path, folder: Path, size: tuple[int, int] = (1400, 900), limit_s: float = 60
) -> Iterator[Page]:
    """A headless Chromium with a fresh profile under folder; yields its first tab."""
    port = free_port()
    argv = [
        str(binary),
        *FLAGS,
        f"--user-data-dir={folder / 'profile'}",
        f"--remote-debugging-port={port}",
        "--remote-debugging-address=127.0.0.1",
        f"--window-size={size[0]},{size[1]}",
        "about:blank",
    ]
    with background(argv, folder / "chromium.log", os.environ):

        def page_url() -> str | None:
            targets = get_json(f"http://127.0.0.1:{port}/json/list") or []
            pages = [t["webSocketDebuggerUrl"] for t in targets if t.get("type") == "page"]
            return pages[0] if pages else None

        page = Page(wait_for(page_url, limit_s, "Chromium's DevTools endpoint"))
        try:
            page.send("Page.enable")  # scripts added for new documents run only with it
            page.set_viewport(*size)
            yield page
        finally:
            page.close()
