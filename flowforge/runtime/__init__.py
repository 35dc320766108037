"""Runtime services below the loop: torch.distributed set-up, durable (atomic, crash-safe) file writes."""
