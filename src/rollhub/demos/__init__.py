"""One-command demos that run online RL end to end on the CPU."""
