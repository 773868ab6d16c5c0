"""Distil a draft model from a target: `python -m distill --help`.

prompts (the shipped prompt set) -> data (target greedy responses + top-k
log-probs) -> train (a few target layers, soft cross-entropy) -> evaluate
(held-out agreement, tokens per target pass, cost) -> a draft folder
(engine.model.drafts) that engine.model.loader serves like any model.
"""
