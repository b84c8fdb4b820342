"""nginx in front of a replica, with its default proxy settings: HTTP/1.0 and `Connection: close`
to the upstream, response buffering on, a 60 s upstream read timeout (what an operator who puts a
plain `proxy_pass` in front gets). `.ci/run` installs nginx; without it the test is skipped."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.processes import free_port, wait_until

__all__ = ["nginx_in_front"]

NGINX_CONF = """\
{user}worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log info;
events {{ worker_connections 64; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    server {{
        listen 127.0.0.1:{port};
        location / {{
            # nginx's defaults otherwise: HTTP/1.0 and Connection: close to the upstream.
            proxy_pass http://127.0.0.1:{upstream};
        }}
    }}
}}
"""


@contextlib.contextmanager
def nginx_in_front(prefix: Path, upstream: int) -> Iterator[int]:
    """nginx as a child process proxying to `127.0.0.1:upstream`, its files under `prefix`
    (created if missing); yields its port, stops it on exit."""
    binary = shutil.which("nginx")
    if binary is None:
        pytest.skip("nginx is not installed (.ci/run installs it)")
    prefix.mkdir(parents=True, exist_ok=True)
    port = free_port()
    (prefix / "nginx.conf").write_text(
        NGINX_CONF.format(
            # As root, workers run as root too, so they can use the 0700 temp directory.
            user="user root;\n" if os.geteuid() == 0 else "",
            prefix=prefix,
            port=port,
            upstream=upstream,
        )
    )
    command = [binary, "-p", str(prefix), "-c", "nginx.conf", "-g", "daemon off;"]
    process = subprocess.Popen(
        [*command, "-e", str(prefix / "error.log")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:

        def accepting() -> bool:
            assert process.poll() is None, (prefix / "error.log").read_text()
            with socket.socket() as sock:
                return sock.connect_ex(("127.0.0.1", port)) == 0

        wait_until(accepting, 10, "nginx")
        yield port
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
