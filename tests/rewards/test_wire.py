"""Media on the wire (:mod:`flowforge.rewards.wire`): lossless round trips and clear errors."""

import pytest
import torch

from flowforge.rewards.wire import decode_image, decode_wire_media, encode_image, encode_images, on_byte_grid


def test_auto_encoding_is_lossless_and_uses_png_where_exact():
    floats = torch.rand(3, 3, 5, 7, generator=torch.Generator().manual_seed(0))
    on_grid = (floats * 255).round() / 255
    assert on_byte_grid(on_grid[0]) and not on_byte_grid(floats[0]) and not on_byte_grid(on_grid[0].double())
    mixed = torch.stack([floats[0], on_grid[1]])
    items = encode_images(mixed)
    assert [i["format"] for i in items] == ["float32", "png"]
    assert torch.equal(decode_wire_media(items), mixed)
    assert torch.equal(decode_wire_media(encode_images(floats, "png")), on_grid)  # forced PNG rounds to bytes
    half = floats.to(torch.bfloat16)
    assert torch.equal(decode_wire_media(encode_images(half, "float32")), half.float())


def test_videos_decode_to_channel_major_clips():
    clip = torch.rand(3, 4, 6, 6)  # [3, F, H, W]
    item = {"frames": encode_images(clip.permute(1, 0, 2, 3))}
    assert torch.equal(decode_wire_media([item, item]), torch.stack([clip, clip]))


def test_decoding_errors_name_the_item():
    image = encode_image(torch.rand(3, 4, 4), "png")
    with pytest.raises(ValueError, match=r"media\[3\]: .* exceeds the limit of 10 pixels"):
        decode_image(image, "media[3]", max_pixels=10)
    with pytest.raises(ValueError, match="3 frames exceed the limit of 2"):
        decode_wire_media([{"frames": [image] * 3}], max_frames=2)
    with pytest.raises(ValueError, match="media is empty"):
        decode_wire_media([])
    with pytest.raises(ValueError, match="format must be one of"):
        decode_image({"format": "webp", "data": ""})
    with pytest.raises(ValueError, match="encoding must be one of"):
        encode_images(torch.rand(1, 3, 2, 2), "jpeg")
