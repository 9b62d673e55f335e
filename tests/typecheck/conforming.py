"""Both implementations are a `Backend` to the type checker: mypy must ACCEPT this file.

Assigning an `Engine` and a `RemoteBackend` to `Backend` checks every protocol method's signature
against theirs, so the protocol cannot lag the implementations (a missing `images=`, a new method).
"""

from __future__ import annotations

from probes.arch import ArchInfo
from probes.backend import Backend
from probes.client import RemoteBackend
from probes.engine import Engine


def both_are_backends(engine: Engine, remote: RemoteBackend) -> tuple[ArchInfo, ArchInfo]:
    local: Backend = engine
    served: Backend = remote
    return local.arch(), served.arch()
