"""The specdec orchestrator: runs the speculative decoding loop over the model services."""
