"""The processor of a local vision-language model directory, shared by the ``vlm_json`` student, the VLM judge
backend of ``flowforge serve judge`` and the ``vqa_score`` reward (it lives in ``rewards``, below all three, so that
none imports another)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_vl_processor(path: str | Path) -> Any:
    """The processor of a vision-language model directory.

    ``AutoProcessor`` first. transformers 5.x builds Qwen2-VL-style processors only together with their video
    processor, which needs torchvision; when that fails (or only a tokenizer comes back), the processor class named
    in ``processor_config.json`` is built from its image processor and tokenizer alone, without the video part
    (images only; its own text / image processing unchanged).

    Raises:
        ValueError: no processor can be built (the message says what was tried).
    """
    import transformers
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    path = Path(path)
    try:
        processor = AutoProcessor.from_pretrained(str(path))
        if hasattr(processor, "image_processor"):
            return processor
        first_error = "AutoProcessor returned no image processor"
    except (OSError, ValueError, ImportError, TypeError) as exc:
        first_error = f"{type(exc).__name__}: {exc}"
    config = path / "processor_config.json"
    name = json.loads(config.read_text()).get("processor_class") if config.is_file() else None
    cls = getattr(transformers, name, None) if name else None
    if cls is None:
        raise ValueError(f"cannot build a processor for {str(path)!r}: {first_error}; processor_config.json names "
                         f"{name!r}, which transformers does not define")

    class ImageOnlyProcessor(cls):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    template_file = path / "chat_template.jinja"
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    template = template_file.read_text() if template_file.is_file() else getattr(tokenizer, "chat_template", None)
    return ImageOnlyProcessor(image_processor=AutoImageProcessor.from_pretrained(str(path)), tokenizer=tokenizer,
                              video_processor=None, chat_template=template)
