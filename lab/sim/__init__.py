"""The real engine, KV managers and policies run in virtual time over request traces."""

from __future__ import annotations

from lab.sim.clock import VirtualClock
from lab.sim.executor import SimulatedExecutor
from lab.sim.setup import SimParts, SimSetup, build_parts
from lab.sim.simulator import (
    ROW_KEYS,
    SimResult,
    SimulationStuck,
    run_simulation,
    simulate,
)
from lab.sim.transfer import (
    DuplexLink,
    NaiveLink,
    SimulatedHandle,
    SimulatedTransferEngine,
    naive_link,
)

__all__ = [
    "ROW_KEYS",
    "DuplexLink",
    "NaiveLink",
    "SimParts",
    "SimResult",
    "SimSetup",
    "SimulatedExecutor",
    "SimulatedHandle",
    "SimulatedTransferEngine",
    "SimulationStuck",
    "VirtualClock",
    "build_parts",
    "naive_link",
    "run_simulation",
    "simulate",
]
