"""Student kind ``vlm_json``: a Hugging Face image-text-to-text VLM, LoRA-tuned to answer the teacher's JSON scores.

Training is supervised fine-tuning on the teacher's own exchanges: the input is the message the judge sent (the
rendered instructions, ``Prompt: ...``, the condition frame and static examples when sent, the reference and each
candidate's ordered frames, in the presented order: :func:`flowforge.reward_model.data.group_message`), and the
target is the teacher's score dictionary as the assistant's answer (:func:`flowforge.reward_model.data.score_answer`,
e.g. ``{"A":73,"B":41}``) followed by the chat template's end-of-turn token. The student then answers the judge
protocol itself, and its replies are read by the judge's strict parser
(:func:`flowforge.rewards.judge.protocol.parse_scores`).

Sequence layout and loss, for a prefix of ``P`` tokens (the chat template up to the assistant turn, images
expanded by the processor) and a target of ``T`` tokens::

    input     = prefix[0:P] + target[0:T-1]                  (S = P + T - 1 positions)
    hidden    = base model (vision + language, no LM head) on input       [1, S, H]
    logits    = lm_head(hidden[:, P-1:])                                  [1, T, V]   (only the answer suffix)
    loss      = sum over t of -log softmax(logits[t])[target[t]] / (target tokens in the batch)

so the vocabulary projection never runs over the ``P`` prompt + image positions (a VLM prompt with many frames is
thousands of tokens; ``T`` is a few dozen), and only answer tokens carry loss. The prefix and the answer are
tokenized separately and concatenated, so training and generation see the same token boundary.

LoRA (peft) goes on the language model only: the requested module-name suffixes (default ``q/k/v/o`` and
``gate/up/down`` projections) are resolved to exact module names under the model's decoder
(``get_decoder()``), each suffix must exist there, and nothing under the vision tower is adapted; every base weight
(the vision tower included) is frozen, and the vision tower stays in eval mode. A language model with linear-attention
layers (Qwen3.5's gated DeltaNet) lists their projections too
(:data:`~flowforge.reward_model.config.GATED_DELTA_NET_PROJECTIONS`). ``chat_template_kwargs`` reach every rendering
of the chat template -- training, the gate, serving -- so ``{enable_thinking: false}`` trains and serves a Qwen3-style
model in its non-thinking mode (the answer right after the template's empty think block). A saved student is
``adapter/`` (peft), ``processor/`` (the base model's processor files) and ``meta.json``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flowforge.reward_model.config import DTYPES, VLMJsonOptions
from flowforge.reward_model.data import JudgedGroup, group_message, score_answer
from flowforge.rewards.judge import protocol as P

KIND = "vlm_json"


def answer_pattern(labels: Sequence[str], decimals: int) -> Any:
    """The strict answers for ``labels`` as a compiled ``regex`` pattern: compact JSON ``{"A":s,"B":s,...}`` in
    label order (:func:`flowforge.reward_model.data.score_answer`'s layout), each ``s`` a number in [0, 100] with at
    most ``decimals`` decimals; every match parses (:func:`flowforge.rewards.judge.protocol.parse_scores`). The
    ``regex`` module's partial matching tells whether a text can still become an answer."""
    import regex

    frac = rf"(?:\.[0-9]{{1,{decimals}}})?" if decimals else ""
    hundred = rf"100(?:\.0{{1,{decimals}}})?" if decimals else "100"
    number = rf"(?:{hundred}|[1-9]?[0-9]{frac})"
    return regex.compile(r"\{" + ",".join(f'"{regex.escape(label)}":{number}' for label in labels) + r"\}")
META_FILE = "meta.json"
VISION_NAMES = ("visual", "vision_tower", "vision_model", "vision_encoder")
"""Attribute names under which transformers VLMs keep their vision tower."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
MODEL_FILES = ("config.json", "generation_config.json")


def language_model_prefix(vlm: nn.Module) -> str:
    """The module name of ``vlm``'s language model (its ``get_decoder()``), e.g. ``model.language_model``.

    Raises:
        ValueError: the model has no decoder module below its root.
    """
    names = {id(m): n for n, m in vlm.named_modules()}
    decoder = vlm.get_decoder() if hasattr(vlm, "get_decoder") else None
    if decoder is None or not names.get(id(decoder)):
        raise ValueError(f"{type(vlm).__name__} exposes no language model below its root (get_decoder())")
    return names[id(decoder)]


def vision_prefixes(vlm: nn.Module) -> list[str]:
    """Module names of the vision tower(s): modules named one of :data:`VISION_NAMES`, outermost only."""
    found = [n for n, _ in vlm.named_modules() if n.rsplit(".", 1)[-1] in VISION_NAMES]
    return [n for n in found if not any(n.startswith(o + ".") for o in found)]


def resolve_lora_targets(vlm: nn.Module, suffixes: Sequence[str]) -> list[str]:
    """Exact names of the ``nn.Linear`` modules under the language model whose last name component is in
    ``suffixes``, in module order.

    Raises:
        ValueError: a suffix matches no linear layer of the language model (the available ones are listed), or a
            resolved module lies under the vision tower.
    """
    prefix = language_model_prefix(vlm)
    linear = [(n, n.rsplit(".", 1)[-1]) for n, m in vlm.named_modules()
              if n.startswith(prefix + ".") and isinstance(m, nn.Linear)]
    missing = sorted(set(suffixes) - {s for _, s in linear})
    if missing:
        raise ValueError(f"LoRA targets {missing} match no linear layer of the language model {prefix!r}; its "
                         f"linear layers end in {sorted({s for _, s in linear})}")
    targets = [n for n, s in linear if s in set(suffixes)]
    vision = [n for n in targets for v in vision_prefixes(vlm) if n == v or n.startswith(v + ".")]
    if vision:
        raise ValueError(f"LoRA targets {vision[:3]} lie under the vision tower")
    return targets


def _end_of_turn(processor: Any, template_kwargs: dict[str, Any] | None = None) -> str:
    """What the chat template (with ``template_kwargs``, e.g. ``enable_thinking=False``) writes after an assistant
    answer (e.g. ``<|im_end|>\\n``): the text after the answer's last occurrence in a rendered exchange. The training
    sequence is the generation prompt + the answer + this, so a template that renders a past answer differently
    from the generation prompt (a Qwen3 template's think block) still trains what generation continues.

    Raises:
        ValueError: the template does not render the assistant's answer.
    """
    kwargs = dict(template_kwargs or {})
    chat = [{"role": "user", "content": [{"type": "text", "text": "probe"}]}]
    answer = '{"A":50}'
    full = ""
    for content in (answer, [{"type": "text", "text": answer}]):  # templates take a string or a list of parts
        full = processor.apply_chat_template([*chat, {"role": "assistant", "content": content}], tokenize=False,
                                             **kwargs)
        at = full.rfind(answer)
        if at >= 0 and "probe" in full[:at]:
            return full[at + len(answer):]
    raise ValueError(f"the chat template does not write an assistant answer after the user turn; got {full[-80:]!r}")


def _config_sha256(base: Path) -> str:
    return hashlib.sha256((base / "config.json").read_bytes()).hexdigest()


@dataclasses.dataclass
class SFTExample:
    """One training sequence: ``inputs`` (processor outputs for ``prefix + target[:-1]``, batch 1), the prefix
    length ``P`` and the target ids ``[T]`` (answer tokens + end-of-turn)."""

    inputs: dict[str, Tensor]
    prefix_len: int
    target_ids: Tensor  # [T] int64

    def sequence(self) -> Tensor:
        """``[P + T]`` int64: the prefix followed by the whole target."""
        return torch.cat([self.inputs["input_ids"][0, :self.prefix_len], self.target_ids.to(torch.long)])

    def labels(self) -> Tensor:
        """``[P + T]`` int64: -100 (no loss) on the prefix, the target ids on the answer."""
        out = self.sequence().clone()
        out[:self.prefix_len] = -100
        return out


class VLMJsonStudent:
    """A ``vlm_json`` student (module docstring): a peft-wrapped VLM and its processor.

    Build one with :meth:`create` (base model + fresh LoRA) or :meth:`load` (a saved student).
    """

    kind = KIND

    def __init__(self, model: Any, processor: Any, meta: dict[str, Any], device: str | torch.device) -> None:
        self.model, self.processor, self.meta = model, processor, meta
        self.device = torch.device(device)
        self.tokenizer = processor.tokenizer
        end = meta["end_of_turn"]
        stop = self.tokenizer(end, add_special_tokens=False)["input_ids"] if end.strip() else []
        # the first token the template writes after an answer ends the turn (the tokenizer's EOS without one)
        self.stop_id = int(stop[0]) if stop else int(self.tokenizer.eos_token_id)
        self._pieces: dict[int, str] | None = None  # guided decoding's vocabulary (built on first use)

    # ------------------------------------------------------------------------------------------------ build
    @classmethod
    def create(cls, options: VLMJsonOptions, *, device: str = "cpu", seed: int = 0) -> VLMJsonStudent:
        """The base model of ``options.base`` with a fresh LoRA (B = 0: it starts as the base model).

        Raises:
            ValueError: a bad dtype, targets that do not resolve (:func:`resolve_lora_targets`), a chat template
                that cannot hold an answer.
            RuntimeError: anything but the LoRA weights of those targets would train.
        """
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForImageTextToText

        from flowforge.rewards.vl_processor import load_vl_processor

        if options.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {options.dtype!r}")
        base = Path(options.base).resolve()
        vlm = AutoModelForImageTextToText.from_pretrained(str(base), dtype=getattr(torch, options.dtype))
        targets = resolve_lora_targets(vlm, options.lora_targets)
        torch.manual_seed(seed)
        config = LoraConfig(r=options.lora_rank, lora_alpha=options.lora_alpha, lora_dropout=options.lora_dropout,
                            target_modules=targets, bias="none")
        model = get_peft_model(vlm, config).to(device)
        processor = load_vl_processor(base)
        meta = {"kind": KIND, "version": 1, "base": str(base), "base_config_sha256": _config_sha256(base),
                "options": dataclasses.asdict(options), "targets": targets,
                "language_model": language_model_prefix(vlm), "vision": vision_prefixes(vlm),
                "end_of_turn": _end_of_turn(processor, options.chat_template_kwargs)}
        student = cls(model, processor, meta, device)
        student.check_trainable()
        return student

    def check_trainable(self) -> None:
        """Every trainable parameter is a LoRA weight of a resolved target (none under the vision tower).

        Raises:
            RuntimeError: anything else requires grad, or a target got no LoRA weight.
        """
        targets = set(self.meta["targets"])
        owners = set()
        for name, param in self.model.named_parameters():
            if not param.requires_grad:
                continue
            owner = name.split(".lora_", 1)[0].removeprefix("base_model.model.")
            if ".lora_" not in name or owner not in targets:
                raise RuntimeError(f"{name} would train, but only the LoRA weights of {len(targets)} language-model "
                                   "targets may")
            owners.add(owner)
        if owners != targets:
            raise RuntimeError(f"targets without LoRA weights: {sorted(targets - owners)[:3]}")

    @property
    def vlm(self) -> nn.Module:
        """The underlying ``...ForConditionalGeneration`` (LoRA layers inside)."""
        return self.model.get_base_model()

    @property
    def lm_head(self) -> nn.Module:
        return self.vlm.get_output_embeddings()

    @property
    def body(self) -> nn.Module:
        """The VLM without its LM head (transformers' ``...ForConditionalGeneration.model``: vision tower + language
        model, returning ``last_hidden_state``).

        Raises:
            ValueError: the model keeps no ``model`` submodule.
        """
        body = getattr(self.vlm, "model", None)
        if not isinstance(body, nn.Module):
            raise ValueError(f"{type(self.vlm).__name__} has no .model (vision + language body without the LM head)")
        return body

    # ------------------------------------------------------------------------------------------------ examples
    def encode_prompt(self, messages: Sequence[dict]) -> dict[str, Tensor]:
        """The processor's tensors (batch 1) for ``messages`` + the generation prompt, rendered with
        ``options.chat_template_kwargs`` (training, gate and serving alike)."""
        chat, images = P.chat_from_messages(messages)
        kwargs = self.meta["options"].get("chat_template_kwargs") or {}  # e.g. enable_thinking=False
        text = self.processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, **kwargs)
        return dict(self.processor(text=[text], images=images or None, return_tensors="pt"))

    def build_example(self, group: JudgedGroup) -> SFTExample:
        """The SFT sequence of ``group``: its judge message -> its teacher answer + end-of-turn."""
        prefix = self.encode_prompt(group_message(group))
        answer = score_answer(group, self.meta["options"]["score_decimals"])
        answer_ids = self.tokenizer(answer, add_special_tokens=False)["input_ids"]
        target = torch.tensor([*answer_ids, self.stop_id], dtype=torch.long)
        length = prefix["input_ids"].shape[1]
        extra = target[:-1].view(1, -1)
        inputs = {}
        for key, value in prefix.items():
            if torch.is_tensor(value) and value.dim() == 2 and value.shape == (1, length):
                fill = extra if key == "input_ids" else (torch.ones_like(extra) if key == "attention_mask"
                                                         else torch.zeros_like(extra))
                value = torch.cat([value, fill.to(value.dtype)], dim=1)
            inputs[key] = value
        return SFTExample(inputs=inputs, prefix_len=length, target_ids=target)

    # ------------------------------------------------------------------------------------------------ training
    def answer_logits(self, example: SFTExample) -> Tensor:
        """``[T, V]`` float32 logits at the positions that predict the target (module docstring): the base model
        runs to hidden states and the LM head sees only the last ``T`` positions."""
        inputs = {k: (v.to(self.device) if torch.is_tensor(v) else v) for k, v in example.inputs.items()}
        out = self.body(**inputs, use_cache=False)
        hidden = out.last_hidden_state[:, example.prefix_len - 1:]  # [1, T, H]
        return self.lm_head(hidden)[0].float()

    def backward(self, groups: Sequence[JudgedGroup]) -> dict[str, float]:
        """Accumulate the gradient of the mean answer-token cross-entropy over ``groups`` (one sequence per
        forward); its metrics: ``loss`` and ``token_accuracy`` (greedy argmax == target)."""
        decimals = self.meta["options"]["score_decimals"]
        total = sum(len(self.tokenizer(score_answer(g, decimals), add_special_tokens=False)["input_ids"]) + 1
                    for g in groups)  # target tokens of the batch, known before any image is processed
        loss_sum, correct = 0.0, 0
        for group in groups:  # one sequence at a time: only one group's frames and activations are held
            example = self.build_example(group)
            logits = self.answer_logits(example)
            target = example.target_ids.to(logits.device)
            loss = F.cross_entropy(logits, target, reduction="sum")
            (loss / total).backward()
            loss_sum += float(loss.detach())
            correct += int((logits.detach().argmax(-1) == target).sum())
        return {"loss": loss_sum / total, "token_accuracy": correct / total, "tokens": float(total)}

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def trainable_state(self) -> dict[str, Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    def load_trainable_state(self, state: dict[str, Tensor]) -> None:
        """Restore the LoRA weights.

        Raises:
            ValueError: ``state`` does not name exactly the trainable parameters.
        """
        params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        if set(params) != set(state):
            raise ValueError(f"LoRA state does not fit: {sorted(set(params) ^ set(state))[:3]}")
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(state[name])

    def train(self) -> None:
        """Train mode (LoRA dropout on) with the vision tower kept in eval mode (frozen, no dropout)."""
        self.model.train()
        for name in self.meta["vision"]:
            self.vlm.get_submodule(name).eval()

    def eval(self) -> None:
        self.model.eval()

    # ------------------------------------------------------------------------------------------------ inference
    def _guide(self, messages: Sequence[dict], prompt_len: int) -> Any:
        """``prefix_allowed_tokens_fn`` for ``generate`` (or ``None``): when ``options.guided`` and ``messages`` is a
        judge group request, each step allows only the tokens after which the answer is still a prefix of
        :func:`answer_pattern` for its labels, and the end of turn once the answer is complete."""
        if not self.meta["options"].get("guided", True):
            return None
        user = [m for m in messages if m.get("role") == "user"]
        content = user[0].get("content") if user else None
        try:
            labels = list(P.read_group_request(content).candidates) if isinstance(content, list) else []
        except ValueError:
            labels = []
        if not labels:
            return None
        pattern = answer_pattern(labels, self.meta["options"]["score_decimals"])
        if self._pieces is None:  # every vocabulary entry that can appear in such an answer, decoded once
            alphabet = set('{}":,.0123456789') | set("".join(P.candidate_labels(26)))
            pieces = {}
            for token in range(len(self.tokenizer)):
                text = self.tokenizer.decode([token])
                if text and set(text) <= alphabet:
                    pieces[token] = text
            self._pieces = pieces

        def allowed(_batch: int, ids: Tensor) -> list[int]:
            text = self.tokenizer.decode(ids[prompt_len:].tolist(), skip_special_tokens=True)
            if pattern.fullmatch(text):
                return [self.stop_id]
            ok = [t for t, piece in self._pieces.items() if pattern.fullmatch(text + piece, partial=True)]
            return ok or [self.stop_id]

        return allowed

    @torch.no_grad()
    def reply(self, messages: Sequence[dict], *, max_new_tokens: int | None = None, temperature: float = 0.0,
              seed: int | None = None) -> tuple[str, int, int]:
        """Answer chat ``messages`` (OpenAI layout): ``(text, prompt tokens, generated tokens)``. Greedy at
        temperature 0, sampled otherwise (seeded by ``seed``); generation stops at the end-of-turn token and is
        capped at ``options.max_new_tokens``. A judge group request is answered by guided decoding
        (``options.guided``, :meth:`_guide`): the reply parses whenever it is not cut by the cap."""
        inputs = {k: (v.to(self.device) if torch.is_tensor(v) else v) for k, v in self.encode_prompt(messages).items()}
        cap = self.meta["options"]["max_new_tokens"]
        budget = min(max_new_tokens or cap, cap)
        sampling = dict(do_sample=True, temperature=temperature) if temperature > 0 else dict(do_sample=False)
        if seed is not None:
            torch.manual_seed(seed)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_id
        length = inputs["input_ids"].shape[1]
        out = self.model.generate(**inputs, max_new_tokens=budget, eos_token_id=[self.stop_id], pad_token_id=pad,
                                  prefix_allowed_tokens_fn=self._guide(messages, length), **sampling)
        new = out[0, length:].tolist()
        answer = new[:new.index(self.stop_id)] if self.stop_id in new else new
        text = self.tokenizer.decode(answer, skip_special_tokens=True)
        return text, int(length), len(new)

    @torch.no_grad()
    def predict(self, groups: Sequence[JudgedGroup]) -> list[Tensor]:
        """One ``[K]`` float32 tensor per group: the student's answer to the group's judge message read by the
        judge's strict parser, on [0, 1], presented order; all NaN when the answer does not parse."""
        out = []
        for group in groups:
            text, _, _ = self.reply(group_message(group))
            try:
                out.append(torch.tensor(P.parse_scores(text, group.labels), dtype=torch.float32))
            except P.MalformedReply:
                out.append(torch.full((len(group.labels),), math.nan, dtype=torch.float32))
        return out

    # ------------------------------------------------------------------------------------------------ files
    def save(self, path: str | Path) -> None:
        """Write ``adapter/`` (peft), ``processor/`` (the base's processor and tokenizer files) and ``meta.json``
        into the directory ``path``."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(str(path / "adapter"))
        processor_dir = path / "processor"
        processor_dir.mkdir(exist_ok=True)
        for item in Path(self.meta["base"]).iterdir():
            if item.is_file() and item.name not in MODEL_FILES and not item.name.endswith(WEIGHT_SUFFIXES) \
                    and not item.name.endswith(".index.json"):
                shutil.copy2(item, processor_dir / item.name)
        (path / META_FILE).write_text(json.dumps(self.meta, indent=1))

    @classmethod
    def load(cls, path: str | Path, *, device: str = "cpu") -> VLMJsonStudent:
        """The student saved at ``path`` on its base model (``meta.json``'s ``base``), in eval mode.

        Raises:
            ValueError: another kind of student, or the base model's ``config.json`` changed since training.
        """
        from peft import PeftModel
        from transformers import AutoModelForImageTextToText

        from flowforge.rewards.vl_processor import load_vl_processor

        path = Path(path)
        meta = json.loads((path / META_FILE).read_text())
        if meta.get("kind") != KIND:
            raise ValueError(f"{path} holds a {meta.get('kind')!r} student, not {KIND!r}")
        base = Path(meta["base"])
        if _config_sha256(base) != meta["base_config_sha256"]:
            raise ValueError(f"the base model {base} changed since the student at {path} was trained")
        vlm = AutoModelForImageTextToText.from_pretrained(str(base), dtype=getattr(torch, meta["options"]["dtype"]))
        model = PeftModel.from_pretrained(vlm, str(path / "adapter"), is_trainable=False).to(device)
        student = cls(model, load_vl_processor(path / "processor"), meta, device)
        student.eval()
        return student
