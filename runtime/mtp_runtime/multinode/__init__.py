"""Multi-node runtime: rendezvous, failing together, step plans, sharding."""
