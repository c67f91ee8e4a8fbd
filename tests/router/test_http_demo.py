"""``helix demo --serve``: serves a user's own openai client, and SIGTERM leaves no process behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from openai import OpenAI


def _pids_with(text: str) -> set[int]:
    """Live processes (not zombies) whose command line mentions ``text``."""
    return {p.pid for p in psutil.process_iter(["cmdline", "status"])
            if p.info["status"] != psutil.STATUS_ZOMBIE and text in " ".join(p.info["cmdline"] or ())}  # fmt: skip


def test_demo_serve_then_sigterm_leaves_nothing(demo_cluster: Path) -> None:
    env = {**os.environ, "COLUMNS": "200", "TERM": "dumb"}
    demo = subprocess.Popen([sys.executable, "-m", "helix.cli", "demo", "--serve", "--port", "0", "--max-tokens", "4",
                             "--cluster", str(demo_cluster)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    output: list[str] = []
    workdir = base_url = None
    try:
        deadline = time.monotonic() + 240
        assert demo.stdout is not None
        while base_url is None and time.monotonic() < deadline:
            line = demo.stdout.readline()
            if not line:
                break
            output.append(line)
            workdir = workdir or (m.group(1) if (m := re.search(r"agent logs in (\S+)", line)) else None)
            base_url = m.group(1) if (m := re.search(r"at (http://127\.0\.0\.1:\d+/v1)", line)) else None
        assert base_url and workdir, "".join(output)
        text = "".join(output)
        assert "assistant:" in text and "pipeline:" in text and "placement" in text
        agents = _pids_with(workdir)
        assert len(agents) == 3, agents  # one `helix agent` per demo node

        client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
        out = client.chat.completions.create(model="smollm2-135m", max_tokens=2, temperature=0,
                                             messages=[{"role": "user", "content": "Hello"}])
        assert out.choices[0].message.content is not None

        demo.send_signal(signal.SIGTERM)
        assert demo.wait(timeout=60) == 0
        assert not _pids_with(workdir)
        assert not Path(workdir).exists()  # a clean exit leaves no helix-demo-* folder behind
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()


def test_a_port_in_use_is_one_line_before_anything_starts(demo_cluster: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for cmd in (["demo", "--cluster", str(demo_cluster)],
                    ["serve", "--cluster", str(demo_cluster), "--plan", "unused.json"]):
            done = subprocess.run([sys.executable, "-m", "helix.cli", *cmd, "--port", str(port)],
                                  capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "300"})
            assert done.returncode == 2, done.stderr
            assert f"--port: 127.0.0.1:{port} is not available" in done.stderr
            assert "Traceback" not in done.stderr + done.stdout and len(done.stderr.strip().splitlines()) == 1
            assert "planning" not in done.stdout and "agent" not in done.stdout  # nothing was started
