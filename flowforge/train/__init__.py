"""Training: the loop (``trainer``: six stages), checkpoints (``checkpoint``: the durable file format;
``checkpoint_manager``: save / resume of the Stateful policy bank, sampler and trainer record), metrics, sidecars,
preflight, SFT, report."""
