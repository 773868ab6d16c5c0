"""specdec target service: TargetService.Score over gRPC (python -m target_service)."""
