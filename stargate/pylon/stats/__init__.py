"""What the Pylon measures of its engine, as pure functions of the bytes and instants it sees.

The Pylon sits in the request path (docs/pylon-data-path.md): every request the replica sends it
is observed on its way to the engine and back, and these modules turn what was seen into the
`ModelStats` a heartbeat carries. Nothing here does I/O or reads a clock: callers pass the
instant (`now`, trio's clock in seconds) in, so every rule is tested with plain values and a
mock clock.

* `sse.py`: splitting an SSE byte stream into events; which events are output.
* `tokens.py`: output-token counting from SSE events and JSON bodies.
* `engine_stream.py`: the engine stats stream's NDJSON lines and events.
* `kv_cache.py`: the KV-cache JSON endpoint's body.
* `engine_metrics.py`: vLLM and SGLang Prometheus metrics mapped onto KV capacity and usage.
* `observer.py`: one request's phases (`RequestTracker`).
* `throughput.py`: input-TPS distribution, cumulative counter samples, the output window.
* `live.py`: the live requests of one model: phase counts, prompt work by priority, queue
  estimates.
* `aggregator.py`: `StatsAggregator`, every model's state and its `ModelStats` snapshot.
* `admission.py`: the queue-estimate-mismatch admission rule and its 429 answer.
"""
