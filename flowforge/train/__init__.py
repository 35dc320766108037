"""Training: the loop (six stages), checkpoints, metrics, sidecars, preflight, SFT, report."""
