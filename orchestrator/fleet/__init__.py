"""The model-service replicas as the orchestrator sees them: discovery and routing (routing), calls
with failover and cache-miss recovery (remote), gathered batch calls (batching), learned deadlines
(deadlines) and outlier ejection (outliers)."""
