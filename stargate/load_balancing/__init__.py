"""Load balancing: which cluster and backend serve one attempt.

Pure choices over routing-state snapshots (`balancers.py`), the LB config file and the
`x-routing-method` resolution (`config.py`), and the balancer instances kept per target and
algorithm (`registry.py`); the Rust crate map's load balancer (docs/architecture.md).
"""
