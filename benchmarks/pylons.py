"""Pylon-like registration streams in bulk, for the `registration` and `readiness` parts: one
process (a "shard") holds many `RegisterInferenceServer` streams on grpc.aio, each with a TCP
connection of its own, each re-sending its registration every heartbeat (1 s, at a random phase),
as a Pylon does, and times every ack.

`benchmarks.common.Registration` (a blocking grpc stream and a reader thread each) is what
benchmarks/capacity.py uses; at 1,000 streams its 2,000 threads contend for one GIL and the
ack latency it would measure is mostly its own. Here one asyncio loop drives them all; the
replica answers each message of a stream with one ack, in order, so the latency of an ack is its
arrival minus the send time of the oldest unanswered message of that stream.

Driven by one JSON command per stdin line, one JSON answer per stdout line (`python -m
benchmarks.pylons`):

* `{"op": "open", "grpc_port": P, "registrations": [[id, url, [models...]], ...],
  "admit_seconds": S, "heartbeat_ms": 1000, "changing_stats": true}`: open them (64 at a time),
  wait up to S seconds for their first acks; answer `admitted`, `failed` (ended by the replica),
  `pending`, `seconds`.

Every heartbeat carries new statistics, as a Pylon measuring its engine sends
(docs/pylon-data-path.md; the fields `stargate/pylon/stats/aggregator.py` fills): queue depth,
running and queued work, TPS, KV-cache use and the observation time change on each message, so
the replica cannot take a heartbeat for a repeat of the last one. `"changing_stats": false`
re-sends the first message unchanged (the figures before the Pylon measured every request).
* `{"op": "stats", "since": T0, "until": T1}` (time.monotonic() instants): acks that arrived in
  the window and their latencies (ms), streams live and ended, heartbeats sent, this process's CPU.
* `{"op": "close"}`: end every stream; `{"op": "quit"}`: end them and exit.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import sys
import time
from typing import Any

from benchmarks.common import HEARTBEAT_HEADER

KV_CAPACITY_TOKENS = 400_000
"""A mid-sized engine's KV cache, in tokens."""


def live_stats(rng: random.Random, beat: int) -> Any:
    """One model's statistics at heartbeat `beat`, as a busy Pylon publishes them: every field a
    Pylon refreshes on each heartbeat has a new value (a random walk around a plausible load)."""
    from stargate.protocol import stargate_pb2 as pb

    running = rng.randint(0, 24)
    queued = rng.randint(0, 12)
    queued_tokens = queued * rng.randint(200, 2_000)
    used = rng.randint(0, KV_CAPACITY_TOKENS)
    input_tps = rng.uniform(2_000.0, 12_000.0)
    return pb.ModelStats(
        last_mean_input_tps=input_tps,
        output_tps=rng.uniform(200.0, 1_500.0),
        queue_size=queued,
        queued_input_size=queued_tokens,
        max_output_tps=1_800.0,
        kv_cache_capacity_tokens=KV_CAPACITY_TOKENS,
        kv_cache_used_tokens=used,
        kv_cache_free_tokens=KV_CAPACITY_TOKENS - used,
        num_running_queries=running,
        total_query_input_size=queued_tokens + running * rng.randint(200, 2_000),
        queue_time_estimate_ms_by_priority={0: int(queued_tokens / input_tps * 1000)},
        input_processing_queries=min(running, rng.randint(0, 4)),
        output_generation_queries=max(0, running - 4),
        stats_observed_at_unix_ms=int(time.time() * 1000) - beat % 7,
        stats_capabilities=["machine.kv_cache.http"],
        stats_sources=["kv_cache_stats"],
    )


class Pylon:
    """One registration stream."""

    def __init__(
        self,
        shard: Shard,
        server_id: str,
        url: str,
        models: list[str],
        heartbeat_ms: int,
        changing_stats: bool = True,
    ) -> None:
        self.shard = shard
        self.server_id = server_id
        self.url = url
        self.models = models
        self.heartbeat = heartbeat_ms / 1000
        self.heartbeat_ms = heartbeat_ms
        self.changing_stats = changing_stats
        self.rng = random.Random(server_id)
        self.beat = 0
        self.message = self._build()
        self.sent: collections.deque[float] = collections.deque()
        self.admitted = asyncio.Event()
        self.ended = False
        self.error = ""
        self.acks = 0
        self.task: asyncio.Task[None] | None = None

    def _build(self) -> Any:
        from stargate.protocol import stargate_pb2 as pb

        return pb.InferenceServerRegistration(
            inference_server_id=self.server_id,
            inference_server_url=self.url,
            models={
                model: pb.InferenceServerModelRegistration(
                    stats=live_stats(self.rng, self.beat),
                    status=pb.INFERENCE_SERVER_STATUS_ACTIVE,
                )
                for model in self.models
            },
        )

    def next_message(self) -> Any:
        """The next heartbeat's message: new statistics, or the first message again."""
        if self.changing_stats:
            self.beat += 1
            self.message = self._build()
        return self.message

    async def run(self, grpc_port: int) -> None:
        import grpc

        from stargate.protocol import stargate_pb2_grpc as pb_grpc

        channel = grpc.aio.insecure_channel(
            f"127.0.0.1:{grpc_port}", options=[("grpc.use_local_subchannel_pool", 1)]
        )
        try:
            stub = pb_grpc.StargateControlPlaneStub(channel)  # type: ignore[no-untyped-call]
            call = stub.RegisterInferenceServer(
                metadata=((HEARTBEAT_HEADER, str(self.heartbeat_ms)),)
            )
            reader = asyncio.create_task(self._read(call))
            try:
                self.sent.append(time.monotonic())
                await call.write(self.message)
                await self.admitted.wait()
                loop = asyncio.get_running_loop()
                next_at = loop.time() + random.uniform(0, self.heartbeat)
                while not self.ended:
                    await asyncio.sleep(max(0.0, next_at - loop.time()))
                    next_at += self.heartbeat
                    message = self.next_message()
                    self.sent.append(time.monotonic())
                    self.shard.heartbeats_sent.append(time.monotonic())
                    await call.write(message)
            finally:
                reader.cancel()
                call.cancel()
        except asyncio.CancelledError:
            raise
        except Exception as error:
            self.error = self.error or repr(error)[:300]
        finally:
            self.ended = True
            await channel.close()

    async def _read(self, call: Any) -> None:
        import grpc

        try:
            while True:
                ack = await call.read()
                if ack is grpc.aio.EOF:
                    break
                now = time.monotonic()
                sent = self.sent.popleft() if self.sent else now
                self.acks += 1
                if self.acks == 1:
                    self.admitted.set()
                else:
                    self.shard.acks.append((now, now - sent))
        except asyncio.CancelledError:
            raise
        except Exception as error:
            self.error = self.error or repr(error)[:300]
        self.ended = True
        self.admitted.set()  # wake `run` (it sees `ended`)


class Shard:
    def __init__(self) -> None:
        self.pylons: list[Pylon] = []
        self.acks: list[tuple[float, float]] = []
        """(arrival, latency) of every heartbeat ack (the first ack of a stream is its
        admission, not a heartbeat, and is left out)."""
        self.heartbeats_sent: list[float] = []

    async def open(
        self,
        grpc_port: int,
        registrations: list[list[Any]],
        admit_seconds: float,
        heartbeat_ms: int = 1000,
        changing_stats: bool = True,
    ) -> dict[str, Any]:
        began = time.monotonic()
        deadline = began + admit_seconds
        fresh = [
            Pylon(self, server_id, url, list(models), heartbeat_ms, changing_stats)
            for server_id, url, models in registrations
        ]
        self.pylons.extend(fresh)
        for start in range(0, len(fresh), 64):
            batch = fresh[start : start + 64]
            for pylon in batch:
                pylon.task = asyncio.create_task(pylon.run(grpc_port))
            for pylon in batch:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(pylon.admitted.wait(), left)
                except TimeoutError:
                    break
        admitted = sum(p.acks > 0 and not p.ended for p in fresh)
        failed = [p for p in fresh if p.ended]
        return {
            "admitted": admitted,
            "failed": len(failed),
            "pending": len(fresh) - admitted - len(failed),
            "seconds": time.monotonic() - began,
            "first_error": next((p.error for p in failed if p.error), ""),
        }

    def stats(self, since: float, until: float) -> dict[str, Any]:
        latencies = [round(lat * 1000, 3) for at, lat in self.acks if since <= at < until]
        return {
            "acks": len(latencies),
            "latencies_ms": latencies,
            "sent": sum(1 for at in self.heartbeats_sent if since <= at < until),
            "live": sum(p.acks > 0 and not p.ended for p in self.pylons),
            "ended": sum(p.ended for p in self.pylons),
            "total": len(self.pylons),
            "cpu_seconds": time.process_time(),
            "first_error": next((p.error for p in self.pylons if p.error), ""),
        }

    async def close(self) -> dict[str, Any]:
        tasks = [p.task for p in self.pylons if p.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        closed = len(self.pylons)
        self.pylons = []
        self.acks = []
        self.heartbeats_sent = []
        return {"closed": closed}


async def serve() -> None:
    shard = Shard()
    loop = asyncio.get_running_loop()
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                break
            command = json.loads(line)
            op = command.pop("op")
            answer: dict[str, Any]
            if op == "open":
                answer = await shard.open(**command)
            elif op == "stats":
                answer = shard.stats(**command)
            elif op == "close":
                answer = await shard.close()
            elif op == "quit":
                break
            else:
                answer = {"error": f"unknown op {op!r}"}
            sys.stdout.write(json.dumps(answer) + "\n")
            sys.stdout.flush()
    finally:
        await shard.close()


def main() -> None:
    asyncio.run(serve())


if __name__ == "__main__":
    main()
