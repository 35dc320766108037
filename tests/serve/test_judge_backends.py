"""The scorer backend of ``flowforge serve judge`` reads the side media of a group request and hands them to the
scorer in each candidate's metadata."""

import torch

from flowforge.rewards.judge import protocol as P
from flowforge.serve.judge_backends import ScorerBackend


class Recording:
    """Scores 1.0 per candidate and keeps the metadata it was given."""

    name = "recording"
    needs_group = False
    metadata_keys = ("label", "condition_media", "example_media")

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def __call__(self, media, prompts, metadata):
        self.seen.extend(metadata)
        return torch.ones(media.shape[0])


def test_example_images_reach_the_scorer_as_example_media():
    red, blue = torch.zeros(3, 8, 8), torch.zeros(3, 8, 8)
    red[0], blue[2] = 1.0, 1.0
    examples = [P.data_url(P.encode_media(x, 1, 8, 95)[0]) for x in (red, blue)]
    candidate = P.data_url(P.encode_media(torch.full((3, 8, 8), 0.5), 1, 8, 95)[0])
    content = P.build_content("judge", "p", None, [[candidate], [candidate]], ["A", "B"], examples=examples)
    scorer = Recording()
    ScorerBackend(scorer, "rec").scores([{"role": "user", "content": content}])
    got = scorer.seen[0]["example_media"]
    assert len(got) == 2 and got[0].shape == (3, 8, 8)
    assert got[0][0].mean() > 0.9 and got[1][2].mean() > 0.9 and got[0][2].mean() < 0.1  # red, then blue
    assert "condition_media" not in scorer.seen[0]
