"""Cluster ids of conditions (flowforge.data.clusters)."""

import pytest

from flowforge.data.clusters import cluster_of, normalise_text, text_cluster


def test_clusters_from_metadata_or_normalised_text():
    assert normalise_text("  A handwritten   SEVEN!!") == "a handwritten seven"
    assert normalise_text("the_number, 7") == "the number 7"
    assert text_cluster("A handwritten seven.") == text_cluster("a  handwritten, SEVEN")
    assert text_cluster("a handwritten seven") != text_cluster("a handwritten eight")
    assert text_cluster("x").startswith("text:") and len(text_cluster("x")) == 5 + 16
    assert cluster_of("p", {"cluster": 3}) == "3" and cluster_of("p", {"cluster": "g"}) == "g"
    assert cluster_of("Seven!", {}) == text_cluster("seven")
    with pytest.raises(ValueError, match="metadata.cluster"):
        cluster_of("p", {"cluster": 1.5})
