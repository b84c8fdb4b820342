"""`stargate demo`: a replica, two mock engines and two Pylons on this machine, in one command.

Everything runs as child processes of one trio program (the same commands an operator would run
by hand), so the demo shows the real thing: Pylons discover the replica through WatchStargates,
register the mock engines over gRPC, the replica's warmup samples them and promotes, and the
replica proxies OpenAI requests (`--accept-openai-requests`) to the engines.

While the replica warms up, one live status line shows the sampled backend count and the streak
against the stabilization window; then the promotion. Ctrl-C (or SIGTERM) stops every child, the
replica last, and exits 0.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Any, TextIO

import httpx
import trio

from stargate.config import DemoConfig, ListenAddress

__all__ = ["DemoConfig", "run_demo"]

DEMO_MODEL = "demo-model"
STATUS_INTERVAL = 0.25
STOP_GRACE_SECONDS = 10.0
STATS_INTERVAL = 2.0


def stats_line(stats: dict[str, Any], estimated: bool) -> str:
    """One backend's `ModelStats` in a line (rounded, so it changes only when they do)."""
    tps = stats["last_mean_input_tps"]
    measured = "not measured yet" if estimated or not tps else f"{tps:,.0f} tok/s"
    return (
        f"input {measured}, output {stats['output_tps']:,.1f} tok/s, "
        f"queue {stats['queue_size']} ({stats['queued_input_size']} tokens), "
        f"running {stats['num_running_queries']}"
    )


def _stargate(*args: str) -> list[str]:
    return [sys.executable, "-m", "stargate", *args]


def _local(address: ListenAddress) -> str:
    """Where a client on this machine reaches a listener (0.0.0.0 means loopback too)."""
    host = "127.0.0.1" if address.host in ("0.0.0.0", "::") else address.host
    return str(ListenAddress(host, address.port))


class Demo:
    def __init__(self, config: DemoConfig, out: TextIO) -> None:
        self.config = config
        self.out = out
        self.children: list[tuple[str, trio.Process]] = []
        self.base_url = f"http://{_local(config.http_listen_addr)}"

    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    async def start(
        self, name: str, command: Sequence[str], *, capture: bool = False
    ) -> trio.Process:
        process = await trio.lowlevel.open_process(
            list(command),
            stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C reaches only us; we stop the children in order
        )
        self.children.append((name, process))
        return process

    async def start_engine(self, index: int) -> str:
        process = await self.start(
            f"engine-{index}",
            _stargate(
                "mock-backend",
                "--port=0",
                f"--model={DEMO_MODEL}",
                # A small batching engine: 4 running slots and a queue, prefill time per prompt
                # token, 40 ms a token; engine 1 is half as fast, so the routing shows.
                "--max-num-seqs=4",
                f"--ttft-ms={30 * (index + 1)}",
                f"--prefill-ms-per-token={0.2 * (index + 1)}",
                f"--inter-token-ms={40 * (index + 1)}",
                "--tokens=24",
                "--log-level=warning",
            ),
            capture=True,
        )
        assert process.stdout is not None
        line = b""
        with trio.fail_after(15):
            while not line.endswith(b"\n"):
                chunk = await process.stdout.receive_some(1)
                if not chunk:
                    raise RuntimeError(f"mock engine {index} exited before listening")
                line += chunk
        return line.decode().split()[-1]  # "listening on http://HOST:PORT"

    async def run(self) -> None:
        config = self.config
        warmup = config.warmup
        await self.start(
            "replica",
            _stargate(
                "serve",
                "--stargate-id=demo-replica",
                f"--http-listen-addr={config.http_listen_addr}",
                f"--listen-addr={config.listen_addr}",
                f"--model-discovery-listen-addr={config.model_discovery_listen_addr}",
                f"--metrics-listen-addr={config.metrics_listen_addr}",
                f"--readiness-warmup-ms={warmup.warmup_ms}",
                f"--warmup-sample-interval-ms={warmup.sample_interval_ms}",
                f"--warmup-stabilization-window={warmup.stabilization_window}",
                "--disable-dns-discovery",
                "--accept-openai-requests",
                "--shutdown-delay-ms=0",  # no Service to leave: Ctrl-C stops at once
                "--log-level=warning",
                *self.tunnel_flags("replica"),
            ),
        )
        engines = [await self.start_engine(index) for index in range(config.engines)]
        for index, url in enumerate(engines):
            await self.start(
                f"pylon-{index}",
                _stargate(
                    "pylon",
                    f"--upstream={url}",
                    f"--stargate={_local(config.listen_addr)}",
                    f"--inference-server-id=demo-pylon-{index}",
                    f"--model-name={DEMO_MODEL}",
                    "--log-level=warning",
                    *self.tunnel_flags("pylon"),
                ),
            )
        self.say("stargate demo")
        self.say(f"  replica      {self.base_url}  (gRPC {_local(config.listen_addr)})")
        if config.tunnel != "http":
            self.say(
                f"  tunnels      {config.tunnel}, {config.tunnel_connectivity} "
                "(self-signed QUIC identities, not verified: a demo)"
            )
        self.say(f"  metrics      http://{_local(config.metrics_listen_addr)}/metrics")
        for index, url in enumerate(engines):
            self.say(
                f"  engine {index}     {url}  (model {DEMO_MODEL}, via pylon demo-pylon-{index})"
            )
        self.say()
        self.say("Try a streaming chat (a plain OpenAI request):")
        body = json.dumps(
            {
                "model": DEMO_MODEL,
                "stream": True,
                "messages": [{"role": "user", "content": "Hello!"}],
            }
        )
        self.say(
            f"  curl -N {self.base_url}/v1/chat/completions "
            f"-H 'content-type: application/json' -d '{body}'"
        )
        self.say()
        await self.show_warmup()
        self.say("Press Ctrl-C to stop. What the replica's load balancers see of each engine")
        self.say("(measured by its Pylon, in the request path), whenever it changes:")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.show_stats)
            await self.watch_children()
            nursery.cancel_scope.cancel()

    def tunnel_flags(self, side: str) -> list[str]:
        """The flags that put the replica and the Pylons on `--tunnel` (none for http)."""
        config = self.config
        if config.tunnel == "http":
            return []
        flags = [f"--tunnel-protocol={config.tunnel}"]
        reverse = config.tunnel_connectivity == "reverse"
        if side == "replica":
            flags.append("--quic-insecure")
            if reverse:
                flags += [
                    "--backend-connectivity=reverse",
                    "--reverse-tunnel-listen-addr=127.0.0.1:0",
                ]
        else:
            flags.append(f"--backend-connectivity={config.tunnel_connectivity}")
            if reverse:
                flags.append("--quic-insecure")
        return flags

    async def show_warmup(self) -> None:
        """One live line while warming up, then the promotion."""
        warmup = self.config.warmup
        window = warmup.stabilization_window
        if not warmup.covers_pylon_reconnect:
            self.say(
                f"warning: the stabilization window ({window} x {warmup.sample_interval_ms} ms) "
                "is shorter than a Pylon's reconnect after a replica restart (docs/pylon.md)"
            )
        async with httpx.AsyncClient(base_url=self.base_url, timeout=2) as client:
            while True:
                try:
                    response = await client.get("/readyz")
                    state = response.json()
                except (httpx.HTTPError, ValueError):
                    state = None
                if state is not None and state.get("ready"):
                    self.say(
                        f"\r\x1b[Kready: promoted ({state.get('promotion_reason')}) with "
                        f"{state.get('sampled_backend_count')} active backends"
                    )
                    return
                if state is None:
                    line = "starting the replica..."
                else:
                    line = (
                        f"warming up: {state.get('sampled_backend_count') or 0} active backends, "
                        f"stable for {state.get('stable_samples')}/{window} samples"
                    )
                print(f"\r\x1b[K{line}", end="", file=self.out, flush=True)
                await trio.sleep(STATUS_INTERVAL)

    async def show_stats(self) -> None:
        """Print each backend's stats (from `/debug/routing`) when they change."""
        shown: dict[str, str] = {}
        async with httpx.AsyncClient(base_url=self.base_url, timeout=2) as client:
            while True:
                try:
                    targets = (await client.get("/debug/routing")).json()["targets"]
                except (httpx.HTTPError, ValueError, KeyError):
                    targets = []
                for target in targets:
                    for cluster in target["clusters"]:
                        for backend in cluster["backends"]:
                            name = backend["inference_server_id"]
                            line = stats_line(backend["stats"], cluster["input_tps_estimated"])
                            if shown.get(name) != line:
                                shown[name] = line
                                self.say(f"  {name}  {line}")
                await trio.sleep(STATS_INTERVAL)

    async def watch_children(self) -> None:
        """Return if any child exits on its own (the demo cannot go on without it)."""
        async with trio.open_nursery() as nursery:
            for name, process in self.children:
                nursery.start_soon(self._wait_child, name, process, nursery.cancel_scope)

    async def _wait_child(self, name: str, process: trio.Process, scope: trio.CancelScope) -> None:
        code = await process.wait()
        self.say(f"{name} exited with code {code}; stopping the demo")
        scope.cancel()

    async def stop(self) -> None:
        """Stop the children in reverse order of start (Pylons, engines, then the replica)."""
        with trio.CancelScope(shield=True):
            for _name, process in reversed(self.children):
                if process.returncode is None:
                    process.send_signal(signal.SIGTERM)
                with trio.move_on_after(STOP_GRACE_SECONDS):
                    await process.wait()
                if process.returncode is None:
                    process.kill()
                    await process.wait()


async def run_demo(config: DemoConfig, out: TextIO = sys.stdout) -> int:
    """Run the demo until Ctrl-C/SIGTERM (exit 0) or until a child dies (exit 1)."""
    demo = Demo(config, out)
    interrupted = False
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        try:
            async with trio.open_nursery() as nursery:

                async def wait_signal() -> None:
                    nonlocal interrupted
                    async for _ in signals:
                        interrupted = True
                        nursery.cancel_scope.cancel()
                        return

                nursery.start_soon(wait_signal)
                await demo.run()
                nursery.cancel_scope.cancel()
        finally:
            demo.say("\nstopping...")
            await demo.stop()
    return 0 if interrupted else 1
