"""Request features measured end to end on a stack of their own: what each keeps exact and what it costs.

`python -m benchmarks.features.structured` (structured output: validity, identity, passes per token);
`python -m benchmarks.features.seeded` (one seed, one text: identity alone and under load, the coupling's cost);
`python -m benchmarks.features.tools --gateway URL` (tool calls through the openai SDK: valid, identical, streamed).
"""
