"""The orchestrator's bottom room: what every other room uses, importing none of them.

kinds (the built-in proposer kinds' names), request (TurnRequest, WireSampling), grammar
(structured output's compiled grammars and masks), text (prompts and streamed text), events (the
chunks a turn streams), stats (a turn's and a round's figures) and calls (one RPC's cost).
"""
