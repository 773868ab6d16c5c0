"""specdec draft service: DraftService.Propose over gRPC (python -m draft_service)."""
