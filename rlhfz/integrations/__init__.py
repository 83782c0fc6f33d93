"""Integrations of rlhfz with training libraries (imported on demand)."""
