"""Bounds every process agrees on (no torch, no I/O)."""
from __future__ import annotations

# The largest k (drafted tokens in one Propose or Score) the services accept unless started with
# another --max-k; the orchestrator's bound until a replica's GetInfo reports its own.
MAX_K = 16
