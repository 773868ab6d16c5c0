"""Where a round's drafted tokens come from: one protocol (base), the deterministic proposers
(local), the draft service (draft) with its parallel mode (parallel) and feature relay (features),
the combined proposer (combined), and the one factory (factory). Their names: orchestrator.common.kinds."""
