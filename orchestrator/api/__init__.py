"""The Orchestrator service: the gRPC servicer (servicer) over the round, its settings, the Check
and Predict verbs, n > 1 choices and the Prometheus metrics."""
