"""/explain/view in a real headless Chromium against a live server: the page fetches an explanation
and draws it (DOM checked, and a screenshot that must show the rendered result)."""

from __future__ import annotations

import struct
import subprocess
import zlib
from pathlib import Path
from urllib.parse import urlencode

import numpy as np
import pytest

from tests.service.conftest import live_server

CHROMIUM = Path("/usr/bin/chromium")
WIDTH, HEIGHT = 1200, 900
PROB_BAR = (0x57, 0x60, 0x6A)  # fill of a non-top probability bar: drawn only once a result is shown

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium")


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [
        str(CHROMIUM),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--force-color-profile=srgb",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'profile'}",
        f"--window-size={WIDTH},{HEIGHT}",
        "--virtual-time-budget=5000",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90)


def decode_png(data: bytes) -> np.ndarray:
    """(height, width, 3) RGB pixels of an 8-bit, non-interlaced RGB or RGBA PNG (what Chromium writes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, head = 8, [], None
    while pos < len(data):
        (n,), kind = struct.unpack(">I", data[pos : pos + 4]), data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + n]
        assert zlib.crc32(kind + body) == struct.unpack(">I", data[pos + 8 + n : pos + 12 + n])[0], "bad CRC"
        if kind == b"IHDR":
            head = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        pos += 12 + n
    assert head is not None
    w, h, depth, colour, _, _, interlace = head
    assert depth == 8 and colour in (2, 6) and interlace == 0, f"unsupported PNG {head}"
    bpp = 3 if colour == 2 else 4
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), np.uint8).reshape(h, 1 + w * bpp)
    out = np.zeros((h, w * bpp), np.uint8)
    prev = np.zeros(w * bpp, np.int64)
    for y in range(h):
        f, line = raw[y, 0], raw[y, 1:].astype(np.int64)
        if f == 1:  # sub: a running sum along the row, per channel
            line = line.reshape(w, bpp).cumsum(0).reshape(-1)
        elif f == 2:  # up
            line = line + prev
        elif f in (3, 4):  # average, Paeth: byte by byte, on plain ints (numpy scalars are slow)
            cur, up = line.tolist(), prev.tolist()
            for i in range(w * bpp):
                a = cur[i - bpp] if i >= bpp else 0
                b, c = up[i], (up[i - bpp] if i >= bpp else 0)
                if f == 3:
                    cur[i] = (cur[i] + (a + b) // 2) & 0xFF
                else:
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    cur[i] = (cur[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
            line = np.array(cur, np.int64)
        prev = line & 0xFF
        out[y] = prev
    return out.reshape(h, w, bpp)[:, :, :3]


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with live_server(tiny_checkpoint, max_wait_ms=5) as srv:
        yield srv


def view_url(server, **params) -> str:
    return f"{server.url}/explain/view?{urlencode(params)}"


def test_view_draws_the_explanation(server, tmp_path):
    url = view_url(server, query="cordless drill", title="dewalt 20v max cordless drill kit")
    dom = chromium(tmp_path, "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert 'id="error" role="alert"></div>' in html  # no error shown
    assert html.count("<line ") > 3  # attention lines between query and title tokens
    assert ">drill<" in html and ">kit<" in html  # tokens drawn in the SVG
    assert html.count('class="prob') == 5  # one bar per level


def test_screenshot_shows_the_rendered_attention(server, tmp_path):
    png = tmp_path / "explain.png"
    url = view_url(server, query="cordless drill", title="dewalt 20v max cordless drill kit")
    out = chromium(tmp_path, f"--screenshot={png}", url)
    assert out.returncode == 0 and png.is_file(), out.stderr[-2000:]
    rgb = decode_png(png.read_bytes())
    assert rgb.shape == (HEIGHT, WIDTH, 3)
    colours = rgb.reshape(-1, 3)
    assert len(np.unique(colours, axis=0)) > 200, "the page looks blank"
    assert (colours == PROB_BAR).all(1).sum() > 50, "no probability bars: the explanation was not drawn"


def test_view_shows_the_error_of_a_refused_request(server, tmp_path):
    dom = chromium(tmp_path, "--dump-dom", view_url(server, query="drill", title="x" * 3000))
    assert "413 payload_too_large" in dom.stdout
