"""Training: the loop (``trainer``: six stages), metrics and trackers, sidecars, the reward-hacking guard, rollout
workers; ``checkpoint/`` (the durable file format; ``checkpoint.manager``: save / resume of the Stateful policy bank,
sampler and trainer record), ``preflight/`` (whole-config rules before any model loads, checks after load),
``sft/`` (flow-matching SFT of the demo base and the world model)."""
