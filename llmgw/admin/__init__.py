"""The management API, served on the admin listener (its own port and token)."""
