"""What a JSON-schema constraint costs per token, and the grammar libraries compared."""
