"""Render a page in a real headless Chromium (Debian's `chromium`, installed by scripts/setup.sh)
and check it: the script drew it (`data-ready`), nothing reached the console (no errors, no
logs), and the screenshot is not blank."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

# The flags of a closed-network, root, GPU-less machine: no sandbox (root), no background
# connections (refused here), a fresh profile per run.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--enable-logging=stderr", "--v=0", "--virtual-time-budget=3000"]


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    raise AssertionError("no Chromium on this machine: scripts/setup.sh installs Debian's `chromium` "
                         "(apt-get install -y chromium)")


def _run(url: str, *args: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="vh-chromium-") as profile:
        return subprocess.run([chromium(), *FLAGS, f"--user-data-dir={profile}", *args, url],
                              capture_output=True, text=True, timeout=120)


def assert_renders(html: str | Path, png: str | Path, size: tuple[int, int] = (1100, 800)) -> np.ndarray:
    """Render `html`; assert it drew itself without console output and its screenshot (written
    to `png`) is not blank. Returns the screenshot as an [H, W, C] array."""
    url = Path(html).resolve().as_uri()
    dom = _run(url, "--dump-dom")
    body = re.search(r"<body[^>]*>", dom.stdout)
    assert body is not None, f"Chromium printed no DOM for {html}:\n{dom.stderr[-3000:]}"
    assert "data-error" not in body.group(0), f"the page's script failed: {body.group(0)}"
    assert 'data-ready="1"' in body.group(0), f"the page's script did not finish: {body.group(0)}"
    shot = _run(url, f"--screenshot={Path(png).resolve()}", f"--window-size={size[0]},{size[1]}")
    console = [ln for ln in (dom.stderr + shot.stderr).splitlines() if ":CONSOLE" in ln]
    assert not console, "the page wrote to the console:\n" + "\n".join(console)
    assert Path(png).is_file(), f"no screenshot:\n{shot.stderr[-3000:]}"
    from matplotlib.image import imread

    img = imread(str(png))[..., :3]
    ink = (img < 0.9).any(-1).mean()                       # share of pixels that are not near-white
    colours = len(np.unique((img * 255).astype(np.uint8).reshape(-1, 3), axis=0))
    assert ink > 0.01 and colours > 50, f"the screenshot looks blank: {ink:.4f} of pixels drawn, {colours} colours"
    return img
