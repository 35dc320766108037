"""The group-judge protocol: strict reply parser, template, frames, JPEG encoding, permutation, message layout."""

import hashlib
import io
import json

import pytest
import torch

from flowforge.rewards.judge import protocol as P

LABELS = ["A", "B", "C", "D"]


# ------------------------------------------------------------------------------------------------ parser

def test_parser_accepts_exactly_one_score_per_label_and_maps_to_unit_range():
    assert P.parse_scores('{"A": 0, "B": 100, "C": 50.5, "D": 7}', LABELS) == [0.0, 1.0, 0.505, 0.07]
    # key order in the reply does not matter, the labels' order is the output order; whitespace around is fine
    assert P.parse_scores('\n {"D": 1, "C": 2, "B": 3, "A": 4}  \n', LABELS) == [0.04, 0.03, 0.02, 0.01]


@pytest.mark.parametrize("reply, reason", [
    ('{"A": 1, "B": 2, "C": 3}', "wrong count"),
    ('{"A": 1, "B": 2, "C": 3, "D": 4, "E": 5}', "extra keys"),
    ('{"A": 1, "B": 2, "C": 3, "D": 4, "best": "A"}', "extra keys"),
    ('{"A": 101, "B": 2, "C": 3, "D": 4}', "outside"),
    ('{"A": -0.5, "B": 2, "C": 3, "D": 4}', "outside"),
    ('{"A": NaN, "B": 2, "C": 3, "D": 4}', "non-finite"),
    ('{"A": Infinity, "B": 2, "C": 3, "D": 4}', "non-finite"),
    ('{"A": 1e999, "B": 2, "C": 3, "D": 4}', "outside"),
    ('{"A": "90", "B": 2, "C": 3, "D": 4}', "not a number"),
    ('{"A": true, "B": 2, "C": 3, "D": 4}', "not a number"),
    ('{"A": null, "B": 2, "C": 3, "D": 4}', "not a number"),
    ('{"A": 1, "A": 1, "B": 2, "C": 3, "D": 4}', "duplicate"),
    ('[1, 2, 3, 4]', "not an object"),
    ('Scores: {"A": 1, "B": 2, "C": 3, "D": 4}', "not a single JSON object"),
    ('{"A": 1, "B": 2, "C": 3, "D": 4} I hope this helps', "not a single JSON object"),
    ('```json\n{"A": 1, "B": 2, "C": 3, "D": 4}\n```', "not a single JSON object"),
    ('', "empty"),
    ('   ', "empty"),
])
def test_parser_rejects_everything_else(reply, reason):
    with pytest.raises(P.MalformedReply, match=reason):
        P.parse_scores(reply, LABELS)


def test_parser_rejects_a_missing_reply_and_the_repair_message_names_the_labels():
    with pytest.raises(P.MalformedReply):
        P.parse_scores(None, LABELS)
    msg = P.repair_message("wrong count", LABELS)
    assert "wrong count" in msg and "A, B, C, D" in msg and "0 to 100" in msg
    assert P.parse_scores(P.scores_reply({"A": 1.0, "B": 2.0, "C": 3.0, "D": 4.0}), LABELS) == [0.01, 0.02, 0.03,
                                                                                              0.04]


# ------------------------------------------------------------------------------------------------ template

def test_default_template_loads_with_its_hash_and_renders_every_placeholder():
    t = P.JudgeTemplate.load()
    assert t.version == "group_v2" and t.sha256 == hashlib.sha256(P.DEFAULT_TEMPLATE.read_bytes()).hexdigest()
    text = t.render("a red cat", ["A", "B", "C"], frames=24, has_reference=True, has_condition=True)
    assert "{{" not in text and "3 generated videos" in text and "A, B, C" in text and "24 frames" in text
    assert "Reference:" in text and "Condition:" in text
    example = json.loads(text.strip().splitlines()[-1])
    assert P.parse_scores(json.dumps(example), ["A", "B", "C"])  # the shown example is itself a valid reply
    image = t.render("a red cat", ["A", "B"], frames=1, has_reference=False)
    assert "2 generated images" in image and "frames" not in image and "Reference" not in image
    assert "Condition" not in image
    old = P.JudgeTemplate.load(P.DEFAULT_TEMPLATE.with_name("group_v1.txt"))  # kept: older ledgers name it
    assert old.version == "group_v1" and "Condition" not in old.render("x", ["A"], 2, False, True)


def test_template_with_an_unknown_placeholder_is_refused(tmp_path):
    path = tmp_path / "mine_v2.txt"
    path.write_text("judge {{num_candidates}} for {{prompt}} with {{mood}}")
    with pytest.raises(ValueError, match=r"unknown placeholders \['mood'\].*allowed"):
        P.JudgeTemplate.load(path)
    path.write_text("judge {{num_candidates}}: {{prompt}}")
    t = P.JudgeTemplate.load(path)
    assert t.version == "mine_v2" and t.render("x", ["A"], 1, False) == "judge 1: x"


# ------------------------------------------------------------------------------------------------ media

def test_frame_indices_are_evenly_spaced_segment_centres():
    assert P.frame_indices(48, 24) == list(range(1, 48, 2))
    assert P.frame_indices(10, 24) == list(range(10))  # fewer frames than asked: all of them
    assert P.frame_indices(9, 1) == [4]
    assert P.frame_indices(9, 3) == [1, 4, 7]
    with pytest.raises(ValueError):
        P.frame_indices(0, 3)


def test_jpeg_frames_are_rgb_downscaled_to_max_side_and_never_upscaled():
    from PIL import Image

    video = torch.rand(3, 30, 40, 100)  # [3, F, H, W]
    frames = P.encode_media(video, frames=24, max_side=50)
    assert len(frames) == 24
    with Image.open(io.BytesIO(frames[0])) as im:
        assert im.format == "JPEG" and im.mode == "RGB" and im.size == (50, 20)
    small = P.encode_media(torch.rand(3, 16, 8), frames=24, max_side=832)
    with Image.open(io.BytesIO(small[0])) as im:
        assert len(small) == 1 and im.size == (8, 16)
    assert P.encode_media(video, 24, 50) == frames  # deterministic: same media, same bytes, same hashes
    url = P.data_url(frames[0])
    assert url.startswith("data:image/jpeg;base64,") and P.decode_data_url(url) == frames[0]
    for bad in ("http://example.invalid/x.jpg", "data:image/jpeg;base64,@@@", "data:text/plain;base64,AAAA"):
        with pytest.raises(ValueError):
            P.decode_data_url(bad)
    with pytest.raises(ValueError, match="candidate must be"):
        P.encode_media(torch.rand(1, 8, 8), 1, 8)


# ------------------------------------------------------------------------------------------------ permutation + keys

def test_permutation_is_seeded_deterministic_and_varies_across_groups():
    hashes = [[f"h{i}"] for i in range(4)]
    perm = P.group_permutation(0, "p", hashes)
    assert sorted(perm) == [0, 1, 2, 3] and P.group_permutation(0, "p", hashes) == perm
    perms = {tuple(P.group_permutation(seed, "p", hashes)) for seed in range(40)}
    assert len(perms) > 10  # seeds shuffle differently
    perms = {tuple(P.group_permutation(0, f"p{i}", hashes)) for i in range(40)}
    assert len(perms) > 10  # and so do groups


def test_request_key_covers_model_template_media_order_and_settings():
    base = dict(model="m", template_sha256="t", prompt="p", reference=["r"], presented=[["a"], ["b"]],
                settings={"temperature": 0.0, "frames": 24})
    key = P.request_key(**base)
    assert len(key) == 64 and P.request_key(**base) == key
    for change in (dict(model="m2"), dict(template_sha256="t2"), dict(prompt="q"), dict(reference=[]),
                   dict(presented=[["b"], ["a"]]), dict(settings={"temperature": 0.7, "frames": 24})):
        assert P.request_key(**{**base, **change}) != key, change


# ------------------------------------------------------------------------------------------------ layout

def test_content_layout_round_trips_through_the_server_reader():
    frames = [P.encode_media(torch.full((3, 8, 8), v), 1, 8) for v in (0.2, 0.8)]
    ref = P.encode_media(torch.rand(3, 3, 8, 8), 3, 8)
    content = P.build_content("instructions", "a cat", [P.data_url(f) for f in ref],
                              [[P.data_url(f) for f in c] for c in frames], ["A", "B"])
    assert [p["type"] for p in content] == ["text", "text", "text", *["image_url"] * 3, "text", "image_url",
                                            "text", "image_url"]
    group = P.read_group_request(content)
    assert group.prompt == "a cat" and group.reference == ref
    assert group.candidates == {"A": frames[0], "B": frames[1]}
    no_ref = P.read_group_request(P.build_content("i", "x", None, [[P.data_url(frames[0][0])]], ["A"]))
    assert no_ref.reference == [] and no_ref.condition == [] and list(no_ref.candidates) == ["A"]
    first = P.encode_media(torch.full((3, 8, 8), 0.5), 1, 8)
    with_condition = P.build_content("i", "x", [P.data_url(f) for f in ref], [[P.data_url(f) for f in c]
                                                                            for c in frames], ["A", "B"],
                                     condition=[P.data_url(first[0])])
    assert [p.get("text") for p in with_condition[2:4]] == ["Condition:", None]  # first, before the reference
    group = P.read_group_request(with_condition)
    assert group.condition == first and group.reference == ref and group.candidates["B"] == frames[1]


@pytest.mark.parametrize("content, match", [
    ([{"type": "text", "text": "hi"}], "no 'Candidate X:'"),
    ([{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,AAAA"}}], "before any"),
    ([{"type": "text", "text": "Candidate A:"}], "without images"),
    ([{"type": "text", "text": "Candidate A:"}, {"type": "audio"}], "unknown content part"),
    ([{"type": "text", "text": "Candidate A:"}, {"type": "text", "text": "Candidate A:"}], "twice"),
])
def test_server_reader_rejects_requests_outside_the_layout(content, match):
    with pytest.raises(ValueError, match=match):
        P.read_group_request(content)


def test_labels():
    assert P.candidate_labels(3) == ["A", "B", "C"]
    assert P.candidate_labels(28)[-2:] == ["AA", "AB"]
    with pytest.raises(ValueError):
        P.candidate_labels(0)
