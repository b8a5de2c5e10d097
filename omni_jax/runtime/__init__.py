"""The runtime: stage processes, their clients, the transport (ZMQ + msgspec) and the orchestrator."""
