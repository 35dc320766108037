"""The three-stage pipeline's orchestration (teacher-judge RL -> student reward model -> student-reward RL):
:mod:`.ledger` (one pass over the conditions shared by the stages), :mod:`.config` (the pipeline config and its
whole-pipeline check), :mod:`.stage_trainer` (the trainer on the ledger, audits), :mod:`.stages` (A -> B -> C, the
gate, resume), :mod:`.servers` (judge servers it starts), :mod:`.report`, :mod:`.demo` (the digits demo's teacher).
Imports nothing at package import."""
