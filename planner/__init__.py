"""The planner role: sizes the replica pools (prefill, decode, combined) from latency
targets and measured capacity, and acts through the Kubernetes API (docs/planner.md)."""
