"""Outlier ejection and slow start end to end (docs/outliers.md): a real replica, `stargate
pylon` sidecars in front of `stargate mock-backend` engines, and real HTTP clients (httpx)
sending a steady stream of streamed chats.

* One of three engines is made to answer 500 to everything through the mock's control endpoint
  (`fail_next`): within 2 s of its first failure it gets (almost) nothing, and the replica's log
  and `/metrics` show the ejection. With a short base ejection time, the backend comes back,
  fails again and is ejected for twice as long; healed, it serves again.
* A fourth backend joins an established fleet: its share starts small and grows over the
  slow-start window.

The measured figures are printed (run with `-s` to see them); docs/outliers.md, "Measured".
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter

import httpx

from tests.e2e.fleet import MODEL, Fleet, chat, wait_routable
from tests.e2e.processes import Replica, wait_until

ENGINE = ("--ttft-ms", "5", "--inter-token-ms", "2", "--tokens", "4", "--max-num-seqs", "32")
CLIENTS = 4
SLICE = 0.5  # seconds per measuring window


class Stream:
    """`CLIENTS` threads sending streamed chats back to back through the replica; each answer
    recorded as (monotonic time, status, serving backend id)."""

    def __init__(self, replica: Replica) -> None:
        self.url = f"http://127.0.0.1:{replica.ports.http}"
        self.records: list[tuple[float, int, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run) for _ in range(CLIENTS)]

    def __enter__(self) -> Stream:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as client:
            while not self._stop.is_set():
                with client.stream("POST", "/v1/chat/completions", json=chat()) as response:
                    for _ in response.iter_bytes():
                        pass
                    backend = response.headers.get("x-inference-server-id", "")
                    with self._lock:
                        self.records.append((time.monotonic(), response.status_code, backend))

    def since(self, start: float) -> list[tuple[float, int, str]]:
        with self._lock:
            return [record for record in self.records if record[0] >= start]


def windows(
    records: list[tuple[float, int, str]], start: float, backend: str, width: float = SLICE
) -> list[tuple[float, int, int]]:
    """(window start relative to `start`, answers by `backend`, all answers) per window."""
    counts: dict[int, Counter[str]] = {}
    for at, _, served_by in records:
        if at >= start:
            counts.setdefault(int((at - start) // width), Counter())[served_by] += 1
    return [
        (index * width, counts[index][backend], sum(counts[index].values()))
        for index in sorted(counts)
    ]


def metrics_text(replica: Replica) -> str:
    return httpx.get(f"http://127.0.0.1:{replica.ports.metrics}/metrics", timeout=5).text


def three_backends(fleet: Fleet, *flags: str) -> tuple[Replica, list[str]]:
    replica = fleet.replica(*flags)
    ids = []
    for _ in range(3):
        engine = fleet.engine(*ENGINE)
        ids.append(fleet.pylon(engine.url, replica).id)
    wait_routable(replica, 3)
    return replica, ids


def test_a_backend_answering_500_to_everything_is_ejected_within_2_s(fleet: Fleet) -> None:
    """Default flags. The bad backend's share per 0.5 s window from its first failure, the time
    from its first 500 to its last, the log line and the series."""
    replica, ids = three_backends(fleet)
    bad_engine, bad = fleet.engines[1], ids[1]
    started = time.monotonic()
    with Stream(replica) as stream:
        time.sleep(1.5)  # a steady stream first: every backend serves
        before = Counter(backend for _, _, backend in stream.since(0))
        assert all(before[backend] > 0 for backend in ids), before
        injected = time.monotonic()
        bad_engine.control(fail_next={"count": 1_000_000, "status": 500})
        time.sleep(4.5)
    records = stream.since(injected)
    failures = [at for at, status, backend in records if status == 500]
    assert failures and all(backend == bad for _, status, backend in records if status == 500), (
        "only the bad backend answers 500"
    )
    first, last = failures[0], failures[-1]
    shares = windows(records, first, bad)
    print("\nshare of the bad backend per 0.5 s window from the start of the stream:")
    for offset, mine, total in windows(stream.since(started), started, bad):
        print(
            f"  {offset:4.1f}-{offset + SLICE:4.1f} s: {mine:3d}/{total:3d} = {mine / total:6.1%}"
        )
    print(f"500s injected at +{injected - started:.3f} s")
    print(f"first 500 at +{first - injected:.3f} s after the injection")
    print(f"500s answered: {len(failures)}; the last {last - first:.3f} s after the first")
    print("share of the 500-everything backend per 0.5 s window from its first failure:")
    for offset, mine, total in shares:
        print(
            f"  {offset:4.1f}-{offset + SLICE:4.1f} s: {mine:3d}/{total:3d} = {mine / total:6.1%}"
        )
    after = [(at, backend) for at, _, backend in records if at >= first + 2.0]
    assert len(after) > 20, len(after)  # the stream went on: a steady stream, not a trickle
    bad_after = sum(1 for _, backend in after if backend == bad)
    assert bad_after / len(after) < 0.05, (bad_after, len(after))
    assert len(failures) <= 5 + CLIENTS  # K, plus answers to attempts already in flight
    # The other two took over: every request after the ejection succeeded.
    assert all(status == 200 for at, status, _ in records if at >= last + 0.01)

    log = replica.process.log
    (line,) = [text for text in log.splitlines() if "outlier ejected" in text]
    assert f"backend={bad} reason=consecutive_5xx consecutive=5 ejections=1 ejection_ms=30000" in (
        line
    )
    text = metrics_text(replica)
    assert (
        f'stargate_outlier_ejections_total{{inference_server_id="{bad}",reason="consecutive_5xx"}}'
        " 1.0" in text
    )
    assert "stargate_outlier_ejected_backends 1.0" in text


def test_an_ejected_backend_returns_and_is_ejected_again_for_longer(fleet: Fleet) -> None:
    """A short base ejection (1.5 s): the backend comes back after it with no probe, fails five
    more times, and is out for 3 s; healed, it serves its share again."""
    replica, ids = three_backends(fleet, "--outlier-base-ejection-ms=1500")
    bad_engine, bad = fleet.engines[0], ids[0]
    with Stream(replica) as stream:
        time.sleep(1.0)
        bad_engine.control(fail_next={"count": 1_000_000, "status": 500})
        wait_until(
            lambda: "ejections=2 ejection_ms=3000\n" in replica.process.log, 10, "a 2nd ejection"
        )
        bad_engine.control(fail_next={"count": 0, "status": 500})
        healed = time.monotonic()
        time.sleep(5)  # 3 s out, then back: a healthy backend's share
    lines = [
        re.sub(r"^.*?(outlier)", r"\1", text)
        for text in replica.process.log.splitlines()
        if "outlier " in text
    ]
    print("\n" + "\n".join(lines))
    assert [line.split(" backend=")[0] for line in lines[:3]] == [
        "outlier ejected:",
        "outlier returned to routing:",
        "outlier ejected:",
    ]
    assert "ejections=1 ejection_ms=1500" in lines[0]
    assert f"backend={bad} ejected_ms=1500 ejections=1" in lines[1]
    assert "ejections=2 ejection_ms=3000" in lines[2]
    late = [backend for at, status, backend in stream.since(healed + 3.5) if status == 200]
    assert late.count(bad) / len(late) > 0.15, Counter(late)  # back, with about a third
    assert 'reason="consecutive_5xx"} 2.0' in metrics_text(replica)


def test_a_backend_joining_an_established_fleet_ramps_up(fleet: Fleet) -> None:
    """A 6 s slow-start window. The three first backends are established once their own window
    is over; a fourth joins then and its share grows from a few percent to about a quarter."""
    window = 6.0
    replica, ids = three_backends(fleet, f"--slow-start-window-ms={int(window * 1000)}")
    time.sleep(window + 0.5)
    with Stream(replica) as stream:
        time.sleep(1.0)
        engine = fleet.engine(*ENGINE)
        joiner = fleet.pylon(engine.url, replica).id
        wait_routable(replica, 4)
        joined = time.monotonic()
        time.sleep(window + 2.0)
    records = stream.since(joined)
    shares = windows(records, joined, joiner, width=1.0)
    print(f"\nshare of the joining backend per 1 s of its {window:.0f} s window:")
    for offset, mine, total in shares:
        print(f"  {offset:4.1f}-{offset + 1:4.1f} s: {mine:3d}/{total:3d} = {mine / total:6.1%}")
    shares = [share for share in shares if share[0] + 1.0 <= window + 2.0]  # whole windows
    early = sum(mine for offset, mine, _ in shares if offset < 2.0)
    early_total = sum(total for offset, _, total in shares if offset < 2.0)
    late = sum(mine for offset, mine, _ in shares if offset >= window)
    late_total = sum(total for offset, _, total in shares if offset >= window)
    assert early / early_total < 0.13, shares  # a full share is 25 %
    assert late / late_total > 0.15, shares
    assert early / early_total < late / late_total
    assert f'stargate_slow_start_left_out_total{{inference_server_id="{joiner}"}}' in (
        metrics_text(replica)
    )
    assert {backend for _, _, backend in records} == {*ids, joiner}
    assert MODEL
