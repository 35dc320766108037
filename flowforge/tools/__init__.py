"""Run-level tools built on the trainer: ``export/`` (merged / adapter, verified), ``sample/``, ``compare/``."""
