"""Peer servers that `mtpkit bench serve` starts, measures and stops itself."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

READY_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, log: Path) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise ValueError(f"llama-server exited with {proc.returncode} before it was "
                             f"ready; its last output:\n{tail}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):  # refused, not ready (503), timed out
            pass
        time.sleep(0.3)
    raise ValueError(f"llama-server did not answer {url}/health within {READY_TIMEOUT_S:.0f} s")


@contextlib.contextmanager
def llama_server(binary: str, gguf: str | None, slots: int,
                 threads: int | None = None) -> Iterator[str]:
    """Run llama.cpp's llama-server on a free loopback port with ``slots`` parallel slots
    (continuous batching) for as long as the block runs; yields its URL."""
    path = Path(binary)
    if not path.is_file() or not os.access(path, os.X_OK):
        raise FileNotFoundError(f"--llama-server {binary}: not an executable file (build it "
                                "from llama.cpp's sources, target llama-server)")
    if gguf is None:
        from ..builtin import smollm2_gguf

        gguf = str(smollm2_gguf())
    if not Path(gguf).is_file():
        raise FileNotFoundError(f"--gguf {gguf}: no such file")
    if threads is None:
        from .. import threads as mtp_threads

        threads = mtp_threads.limit()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    # A context of 1024 positions per slot: llama-server divides -c among its slots.
    cmd = [str(path), "-m", gguf, "-t", str(threads), "-np", str(slots),
           "-c", str(1024 * slots), "--host", "127.0.0.1", "--port", str(port)]
    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as f:
        log = Path(f.name)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_ready(url, proc, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.unlink(missing_ok=True)
