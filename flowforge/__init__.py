"""flowforge: online RL post-training for flow-matching generators."""
__version__ = "0.1.0"
