"""The node agent: discovery, the outbound stream to the control plane, reconnects."""
