"""Run reports (report.html), read by train, orchestrate and tools alike."""
