"""rallypoint.agent: the elastic agent and the torchrun-compatible launcher.

* ``rallypoint run ...`` / ``python -m rallypoint.run ...``: :mod:`rallypoint.agent.launcher`.
* :func:`record`: decorate a worker's entry point so its exception reaches the agent.
* :func:`elastic_launch`: run a Python function on every worker of an elastic job.
* :class:`ElasticAgent` and :class:`LaunchConfig`: the agent itself, for embedding.

Importing this package stays cheap (no torch) so that workers can import
:func:`record`; the agent and the API load on first use.
"""

from __future__ import annotations

from typing import Any

from .config import ConfigError, LaunchConfig
from .errors import record

__all__ = ["ConfigError", "ElasticAgent", "LaunchConfig", "elastic_launch", "record"]


def __getattr__(name: str) -> Any:
    if name == "elastic_launch":
        from .api import elastic_launch

        return elastic_launch
    if name == "ElasticAgent":
        from .agent import ElasticAgent

        return ElasticAgent
    raise AttributeError(f"module 'rallypoint.agent' has no attribute {name!r}")
