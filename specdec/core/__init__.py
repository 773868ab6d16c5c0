"""specdec.core: the transport-free heart of speculative decoding.

No gRPC, no protobuf, no Redis, no model loading: free functions and frozen
dataclasses over token lists and torch tensors, unit-tested on their own.
"""
