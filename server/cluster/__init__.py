"""The storage cluster: gateways that route, targets that store, the map they share (docs/cluster.md)."""
