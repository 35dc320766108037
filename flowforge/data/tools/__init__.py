"""Data tools behind ``flowforge data``: raw prompt sources -> unified JSONL -> curated train / eval files -> checks.

===========  ========================================================================================================
module       what it does
===========  ========================================================================================================
prepare      Pick-a-Pic / parquet / JSONL / one-per-line sources -> one unified-schema JSONL, stable sample ids
curate       schema check, min-words / missing-media / duplicate filters, hashed train / eval split, eval subsets
inspect      every problem of a train / eval pair (schema, tasks, placeholders, media, decode, leakage), file:line
records      the shared rules: validation, media paths, content hash, split key, atomic no-symlink writes
media        decode checks (PIL images, frame directories, GIFs)
===========  ========================================================================================================

Every tool is deterministic: no RNG, no clock, no dependence on input order beyond what its docstring states.
"""
