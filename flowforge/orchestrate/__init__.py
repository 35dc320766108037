"""The three-stage pipeline's orchestration: the condition ledger (:mod:`.ledger`, one pass over the conditions
shared by the stages). Imports nothing at package import."""
