"""The lifecycle stage: `up`, `status`, `logs` and `down` carrying a plan out on the hosts (steps 3 onwards)."""
