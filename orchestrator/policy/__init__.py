"""How much to draft and where streams go: the per-round drafting decision (drafting), the costs it
learns from every call (costs), the speculation gate (gate) and admission by measured capacity
(capacity)."""
