"""KV blocks beyond one instance's KV memory: lower tiers and the shared store (issue 26), keyed by chain hash."""
