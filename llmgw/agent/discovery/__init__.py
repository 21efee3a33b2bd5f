"""What the agent finds out about its node (each probe a module of its own)."""
