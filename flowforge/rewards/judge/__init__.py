"""Group VLM judge: the ``vlm_judge`` scorer (:mod:`.client`), its wire protocol (:mod:`.protocol`: template, media
encoding, permutation, strict reply parser) and its request ledger (:mod:`.ledger`).

Imports nothing at package import (the client needs ``openai``, loaded when a judge is built).
"""
