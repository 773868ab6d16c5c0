"""The runtime every process shares: the gRPC server bootstrap, errors and their statuses, the wire
codec, security (TLS, tokens, tenants), per-tenant limits, the Redis session store and registry,
process helpers, settings and tracing. It imports only specdec.core and specdec.v1."""
