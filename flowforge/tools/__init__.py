"""Run-level tools built on the trainer: export, compare."""
