"""Runtime services below the loop: torch.distributed set-up (``distributed``), crash-safe files and step
directories (``durable``), dtype names (``dtypes``)."""
