"""The control plane: node table and liveness, the agent stream listener, the dispatcher."""
