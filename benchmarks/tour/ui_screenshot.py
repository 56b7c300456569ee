"""docs/web-ui.png: kiln serve's page after one chat question and one embedding, in headless
Chromium (the system's, as tests/serve/test_serve_ui_browser.py drives it).

    kiln convert $(python -m modelkiln.embedded SmolLM2-135M-Instruct) --task text-generation --out artifacts/smollm2
    kiln convert $(python -m modelkiln.embedded all-MiniLM-L6-v2) --precision int8 --out artifacts/all-MiniLM-L6-v2
    python benchmarks/tour/ui_screenshot.py artifacts/smollm2 artifacts/all-MiniLM-L6-v2 --out docs/web-ui.png
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

import httpx
from playwright.sync_api import sync_playwright

from modelkiln.net import free_port

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", nargs="+")
    parser.add_argument("--out", default="docs/web-ui.png")
    parser.add_argument("--question", default="Give me a short tip for better sleep.")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "modelkiln", "serve", *args.artifacts, "--port", str(port),
                               "--grpc-port", "0"], env={**os.environ, "KILN_THREADS": "1"})
    try:
        wait_ready(url, server)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 800}, device_scale_factor=1)
            page.set_default_timeout(60_000)
            page.goto(url + "/")
            page.wait_for_function("() => document.querySelectorAll('#models-body tr').length > 0")
            page.wait_for_timeout(3000)  # the figures' first samples
            page.fill("#chat-temperature", "0")
            page.fill("#chat-max-tokens", "96")
            page.fill("#chat-input", args.question)
            page.press("#chat-input", "Enter")
            page.locator("#chat-log .msg.assistant .meta").wait_for()
            page.click("#encode-form button[type=submit]")
            page.wait_for_timeout(4000)  # a few more samples of the figures
            page.screenshot(path=args.out, full_page=True)
            browser.close()
        print(f"Wrote {args.out}")
    finally:
        server.terminate()
        server.wait(30)


def wait_ready(url: str, server: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            if httpx.get(url + "/v2/health/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or server.poll() is not None:
            raise SystemExit("the server did not become ready")
        time.sleep(0.2)


if __name__ == "__main__":
    main()
