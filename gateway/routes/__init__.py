"""The gateway's HTTP routes, one module-level router per thing served.

    health        GET /health (readiness: the orchestrator's gRPC health)
    models        GET /v1/models, /v1/models/{model_id}
    completions   POST /v1/chat/completions, /v1/completions (one Generate stream each)
    playground    /playground: the page and its API

Each handler finds what it shares with the others through gateway.state.of(request).
"""
