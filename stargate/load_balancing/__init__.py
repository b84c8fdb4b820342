"""Load balancing: which cluster and backend serve one attempt.

Pure choices over routing-state snapshots: the protocol, scores and simple algorithms
(`balancers.py`), wait-and-widen (`wait_and_widen.py`), pulsar and pulsar-wait-and-widen
(`pulsar.py`) and the hash layouts they share (`hashing.py`); the LB config file and the
`x-routing-method` resolution (`config.py`); and the balancer instances kept per target and
algorithm, with input-work admission per definition (`registry.py`). The Rust crate map's load
balancer (docs/architecture.md).
"""
