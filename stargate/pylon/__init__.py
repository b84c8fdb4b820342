"""The Pylon: a registration sidecar that keeps one inference engine registered with every
Stargate replica (docs/pylon.md; HTTP backends per docs/decisions.md, D3).

`run_pylon(config)` is the library entry point; `stargate.pylon.cli.pylon_command` the CLI.
"""

from stargate.pylon.config import PylonConfig, PylonConfigError
from stargate.pylon.sidecar import Pylon, run_pylon

__all__ = ["Pylon", "PylonConfig", "PylonConfigError", "run_pylon"]
