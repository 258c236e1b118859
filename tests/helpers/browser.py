"""Headless Chromium, for the pages the server draws: a page's DOM after its scripts ran and a screenshot of it."""
from __future__ import annotations

import shutil
import subprocess

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
# Without the background-networking flags Chromium keeps dialling Google's hosts, which this sandbox refuses.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--virtual-time-budget=3000"]


def chromium(profile, *args: str) -> str:
    """Headless Chromium's output, run with a fresh profile each time: a second run on the profile of one still
    shutting down can wait on its lock (seen once in a full suite: the screenshot hung 120 s after the DOM dump).
    One more try if it hangs anyway: the page under test answers at once, a hang is the browser's."""
    def run(attempt: int) -> str:
        command = [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}-{attempt}", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout

    try:
        return run(0)
    except subprocess.TimeoutExpired:
        return run(1)


def render_page(tmp_path, url: str, height: int) -> tuple[str, object]:
    """The page's DOM after its scripts ran, and the path of a 1100 x height screenshot of it."""
    dom = chromium(tmp_path / "dom-profile", "--dump-dom", url)
    shot = tmp_path / "kv_view.png"
    chromium(tmp_path / "shot-profile", f"--screenshot={shot}", f"--window-size=1100,{height}", url)
    return dom, shot
