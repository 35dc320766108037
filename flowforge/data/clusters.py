"""Cluster ids of conditions: what the condition ledger orders a pass by and what the student's data splits keep
apart (no cluster in two splits).

A prompt row's ``metadata.cluster`` (a string or an int) is its cluster; without one, the cluster is
:func:`text_cluster` of the prompt, so rephrasings that differ only in case, punctuation or spacing share one.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Mapping
from typing import Any

_SEPARATORS = re.compile(r"[\W_]+")


def normalise_text(text: str) -> str:
    """``text`` in NFKC, lower case, with every run of non-alphanumeric characters (punctuation, underscores,
    whitespace) replaced by one space, stripped: ``"A  handwritten SEVEN!"`` -> ``"a handwritten seven"``."""
    return _SEPARATORS.sub(" ", unicodedata.normalize("NFKC", text).lower()).strip()


def text_cluster(text: str) -> str:
    """``"text:"`` + the first 16 hex digits of ``sha256(normalise_text(text))`` (the default cluster id)."""
    return "text:" + hashlib.sha256(normalise_text(text).encode("utf-8")).hexdigest()[:16]


def cluster_of(prompt: str, metadata: Mapping[str, Any]) -> str:
    """The cluster of a condition: ``metadata["cluster"]`` (a string or an int, as text) when present, else
    :func:`text_cluster` of ``prompt``.

    Raises:
        ValueError: ``metadata["cluster"]`` is present but not a non-empty string or an int.
    """
    cluster = metadata.get("cluster")
    if cluster is None:
        return text_cluster(prompt)
    if isinstance(cluster, bool) or not isinstance(cluster, (str, int)) or cluster == "":
        raise ValueError(f"metadata.cluster must be a non-empty string or an int, got {cluster!r}")
    return str(cluster)
