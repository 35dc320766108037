"""``model.adapter: world_model`` -- the action-conditioned video world model behind the FlowModel contract.

==================  ================================================================================================
flowforge           world model
==================  ================================================================================================
prompt              the action sequence, one name per video frame, space-separated (``"LEFT LEFT NOOP RIGHT"``;
                    names from :attr:`WorldModelAdapter.action_names`, case-insensitive)
``cond``            :meth:`WorldModelAdapter.encode`: ``prompt_embeds [B, frames, A]`` one-hot actions (fp32),
                    ``mask [B, frames]`` ones; ``negative`` = all-zero rows (no action: the null-action branch of
                    CFG). Actions therefore ride in the :class:`~flowforge.models.base.Conditioning` through the
                    encode cache, rollout, replay and every loss like text embeddings do.
``cond.image``      the clean first frame ``[B, C, 1, H, W]`` (:meth:`WorldModelAdapter.condition_on_images`)
``x`` [B,C,F,H,W]   pixel-space latents in [-1, 1] (``C`` = 1 grey or 3 RGB; no VAE), ``F`` latent frames
slot 0              latent frame 0 is the condition (``condition_index``): the loop writes ``cond.image`` there and
                    steps ``generated_index`` (frames 1..) only; the velocity is 0 on slot 0 and the network gives
                    that frame timestep 0
``sigma`` [B]       ``timestep = 1000 * sigma`` inside the network
CFG                 ``v_u + g (v_c - v_u)`` with ``v_u`` from the null actions
==================  ================================================================================================

Parameter modes (what RL may change; :meth:`WorldModelAdapter.apply_parameter_mode`):

* ``module``: full fine-tune of exactly the named submodules (``trainable_modules``, default the transition module
  ``latent_state_rollout.transition``); every other parameter is frozen, including the initializer and
  ``out_proj`` that sit beside B in ``latent_state_rollout``.
* ``lora``: LoRA on exactly :attr:`WorldModelAdapter.lora_targets` = ``blocks.{i}.coupling.{q,k,v,out}`` of every
  block (exact module paths; no other attention matches).
* ``module+lora``: both (``lora.trainable: module+lora``), e.g. B in full and LoRA on the coupling attention; a
  trained module may not contain a LoRA target (``blocks.{i}.coupling`` is refused: q / k / v / out would train
  twice).

Loading (:func:`load_world_model`) builds the network from ``config.json``, reads the weights read-only with a
provenance row per tensor and refuses a checkpoint that would leave a module randomly initialised
(:mod:`~flowforge.models.world_model.provenance`). :meth:`WorldModelAdapter.save_pretrained` writes the same layout
(``config.json``, ``diffusion_pytorch_model.safetensors``, ``flowforge.json``) and refuses to write over its source.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from flowforge.models.base import Conditioning
from flowforge.models.family import FamilyAdapter
from flowforge.models.world_model.spec import FAMILY
from flowforge.models.common import check_velocity_inputs, require_negative
from flowforge.models.world_model import provenance as prov
from flowforge.models.world_model.config import ACTIONS, WorldModelConfig
from flowforge.models.world_model.dit import COUPLING_LINEARS
from flowforge.models.world_model.network import WorldModel

logger = logging.getLogger(__name__)

PARAMETER_MODES = ("module", "lora", "module+lora")
DEFAULT_TRAINABLE_MODULES = ("latent_state_rollout.transition",)
LORA_RANK = 8
LORA_ALPHA = 16.0
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
META_NAME = "flowforge.json"
PROVENANCE_NAME = "source_provenance.json"
CLASS_NAME = "FlowforgeWorldModel"


GATE_FLOOR = 1e-2
"""A coupling gate under this size adds at most 1% of its attention output to the residual stream (the world base made
before demo:world ended at ~1e-4 in SFT; demo:world, whose gates started at 0.1, ended at 0.019):
:func:`gate_leverage_warnings` calls such a gate closed."""


def gate_leverage_warnings(trainable: str, modules: Sequence[str] | None, gates: Sequence[float], *,
                           threshold: float = GATE_FLOOR) -> list[str]:
    """Warnings when what ``lora.trainable`` / ``lora.modules`` train can barely change the video: a trained set
    that reaches the video only through the coupling attention (B or anything else in ``latent_state_rollout``,
    or LoRA on the coupling's q / k / v / out) while no coupling gate is trained and every gate of ``gates`` (one
    per block, any sign) is under ``threshold`` in size. Empty when a gate is trained or open, or nothing behind
    the gates is trained."""
    modules = tuple(modules or ())
    through_state = [m for m in modules if m == "latent_state_rollout" or m.startswith("latent_state_rollout.")]
    lora = "lora" in trainable and trainable != "full"
    gates_trained = any(m == "blocks" or (m.startswith("blocks.") and (m.endswith(".coupling") or m.count(".") < 2))
                        for m in modules)
    if trainable == "full" or gates_trained or not (through_state or lora) or not gates:
        return []
    largest = max(abs(g) for g in gates)
    if largest >= threshold:
        return []
    what = " and ".join([f"{through_state}"] * bool(through_state) + ["LoRA on the coupling attention"] * lora)
    return [f"lora.trainable={trainable!r} trains {what}, which reach the video only through the coupling "
            f"attention, but every coupling gate of this model is ~0 (max |gate| {largest:.1e} < {threshold}) "
            "and none is trained: this run can barely change the video. Train the gates too (lora.modules "
            "with blocks.<i>.coupling) or start from a model whose gates opened in SFT"]


def read_coupling_gates(path: str | Path) -> list[float] | None:
    """The coupling gate of every block (block order) read from the weights file of the world-model directory
    ``path`` without building the network (``flowforge check``), or None when ``path`` holds no such file.

    Raises:
        OSError / safetensors errors: an unreadable weights file (loading would fail on it too).
    """
    import re

    from safetensors import safe_open

    weights = Path(path) / WEIGHTS_NAME
    if not weights.is_file():
        return None
    pattern = re.compile(r"blocks\.(\d+)\.coupling\.gate")
    with safe_open(str(weights), framework="pt") as f:
        found = {int(m.group(1)): k for k in f.keys() if (m := pattern.fullmatch(k))}
        return [float(f.get_tensor(found[i]).abs().max()) for i in sorted(found)]


class WorldModelAdapter(FamilyAdapter):
    """:class:`~flowforge.models.base.FlowModel` + ``ImageConditioned`` around a :class:`WorldModel`.

    Args:
        model: the network (put in eval mode here).
        action_names: the action vocabulary, index = action id (``len == config.num_actions``).
        parameter_mode: one of :data:`PARAMETER_MODES`.
        trainable_modules: exact module paths trained in ``module`` mode.
        provenance / sources: what :func:`load_world_model` recorded (empty for a model built in memory).

    Raises:
        ValueError: unknown mode; a trainable module that does not exist; action names that do not fit.
    """

    family_spec = FAMILY

    tasks: tuple[str, ...] = FAMILY.tasks
    cfg_rule = "guidance_scale != 1 (flowforge's own world model, no pipeline)"

    def guidance_use(self, guidance_scale: float) -> str:
        """``"cfg"`` for any ``guidance_scale`` other than 1 (no pipeline defines a rule for this model)."""
        return "off" if float(guidance_scale) == 1.0 else "cfg"
    condition_index: tuple[slice, ...] = (slice(None), slice(None), slice(0, 1))
    generated_index: tuple[slice, ...] = (slice(None), slice(None), slice(1, None))

    def __init__(self, model: WorldModel, *, action_names: Sequence[str] = ACTIONS, parameter_mode: str = "module",
                 trainable_modules: Sequence[str] = DEFAULT_TRAINABLE_MODULES,
                 provenance: Sequence[prov.ProvenanceRow] = (), sources: Sequence[prov.SourceFile] = ()):
        if parameter_mode not in PARAMETER_MODES:
            raise ValueError(f"parameter_mode={parameter_mode!r}; allowed: {list(PARAMETER_MODES)}")
        self.transformer = model.eval()
        self.action_names = tuple(str(a).upper() for a in action_names)
        if len(self.action_names) != model.config.num_actions or len(set(self.action_names)) != len(action_names):
            raise ValueError(f"action_names {list(action_names)} must be {model.config.num_actions} distinct names")
        self.parameter_mode = parameter_mode
        self.trainable_modules = tuple(trainable_modules)
        names = dict(model.named_modules())
        unknown = [m for m in self.trainable_modules if m not in names or not m]
        if unknown:
            raise ValueError(f"trainable_modules {unknown} are not modules of the world model; e.g. "
                             f"{list(DEFAULT_TRAINABLE_MODULES)}")
        self.provenance = tuple(provenance)
        self.sources = tuple(sources)

    @property
    def world_config(self) -> WorldModelConfig:
        return self.transformer.config

    # ------------------------------------------------------------------ FlowModel

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """``blocks.{i}.coupling.{q,k,v,out}`` for every block: exact module paths (peft matches them whole)."""
        return self.lora_targets_of(self.transformer)

    @staticmethod
    def lora_targets_of(transformer: nn.Module) -> tuple[str, ...]:
        """:attr:`lora_targets` of a :class:`WorldModel` (a weightless one on the meta device too: preflight reads
        them before the model loads)."""
        return tuple(f"blocks.{i}.coupling.{n}" for i in range(len(transformer.blocks)) for n in COUPLING_LINEARS)

    @property
    def encoder_id(self) -> str:
        return f"world_model-actions:{','.join(self.action_names)}"

    def blocks(self) -> list[nn.Module]:
        """The DiT blocks, in order."""
        return list(self.transformer.blocks)

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        """Action prompts -> one-hot ``prompt_embeds [B, frames, A]`` fp32, ``mask`` ones, ``negative`` zeros.

        Raises:
            TypeError: a single string. ValueError: an unknown action name; prompts of different lengths; empty.
        """
        if isinstance(prompts, str):
            raise TypeError("prompts must be a sequence of action strings, not a single string")
        ids = [self.action_ids(p.split()) for p in prompts]
        lengths = sorted({len(i) for i in ids})
        if not ids or len(lengths) != 1 or lengths[0] == 0:
            raise ValueError(f"every prompt must name the same positive number of actions, got lengths {lengths}")
        onehot = torch.nn.functional.one_hot(torch.tensor(ids), len(self.action_names)).float()
        mask = torch.ones(onehot.shape[:2], dtype=torch.long)
        negative = Conditioning(prompt_embeds=torch.zeros_like(onehot), mask=mask.clone())
        return Conditioning(prompt_embeds=onehot, mask=mask, negative=negative)

    def action_ids(self, names: Sequence[str]) -> list[int]:
        """Action names -> ids. Raises ValueError for an unknown name (the allowed ones listed)."""
        out = []
        for name in names:
            if name.upper() not in self.action_names:
                raise ValueError(f"unknown action {name!r}; allowed: {list(self.action_names)}")
            out.append(self.action_names.index(name.upper()))
        return out

    def frame_labels(self, prompt: str) -> list[str]:
        """What the report writes under each frame of a clip generated from ``prompt``: its action names, one per
        video frame (upper case). Raises ValueError for an unknown action name."""
        return [self.action_names[i] for i in self.action_ids(prompt.split())]

    def latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        """``(C, f, H, W)`` with ``f = (frames - 1) / temporal_factor + 1`` (pixel space: ``H = height``).

        Raises:
            ValueError: ``frames`` missing / not of that form / under 2 / over ``max_frames`` latent frames; a size
                other than the network's ``sample_size``.
        """
        cfg = self.world_config
        r = cfg.temporal_factor
        if frames is None or frames < r + 1 or (frames - 1) % r:
            raise ValueError(f"world model needs frames = (f - 1) * {r} + 1 with f >= 2 (frame 0 is the condition), "
                             f"got {frames}")
        f = (frames - 1) // r + 1
        if f > cfg.max_frames:
            raise ValueError(f"{frames} frames = {f} latent frames; this model covers at most {cfg.max_frames}")
        if height != cfg.sample_size or width != cfg.sample_size:
            raise ValueError(f"this world model is {cfg.sample_size}x{cfg.sample_size} pixels, got {height}x{width}")
        return (cfg.in_channels, f, height, width)

    def _forward(self, x: Tensor, sigma: Tensor, actions: Tensor, first: Tensor) -> Tensor:
        return self.transformer(x, sigma, actions.to(x.device), first.to(device=x.device))

    def velocity(self, x: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        """Velocity ``noise - x0`` at ``x [B, C, F, H, W]``, ``sigma [B]``; fp32, 0 on slot 0. The first frame is
        ``cond.image`` (``x[:, :, :1]`` when it is None: the pinned slot).

        Raises:
            ValueError: bad shapes; actions of the wrong length for ``F``; CFG without ``cond.negative``.
        """
        sigma = check_velocity_inputs(x, sigma, cond, 5)
        first = cond.image if cond.image is not None else x[:, :, :1]
        g = float(guidance_scale)
        if self.guidance_use(g) == "off":
            return self._forward(x, sigma, cond.prompt_embeds, first)
        negative = require_negative(cond, g).prompt_embeds.to(cond.prompt_embeds.device)
        v_u, v_c = self._forward(torch.cat([x, x]), torch.cat([sigma, sigma]),
                                 torch.cat([negative, cond.prompt_embeds]), torch.cat([first, first])).chunk(2)
        return v_u + g * (v_c - v_u)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Pixels in [-1, 1] ``[B, C, F, H, W]`` -> video ``[B, 3, F, H, W]`` float32 in [0, 1] (grey repeated)."""
        video = ((latents.float() + 1.0) / 2.0).clamp(0.0, 1.0)
        return video.repeat(1, 3, 1, 1, 1) if video.shape[1] == 1 else video

    def encode_video(self, video: Tensor) -> Tensor:
        """Video ``[B, 3 or C, F, H, W]`` in [0, 1] -> latents ``[B, C, F, H, W]`` fp32 in [-1, 1] (RGB is averaged
        to grey for a 1-channel model)."""
        video = video.float()
        if self.world_config.in_channels == 1 and video.shape[1] == 3:
            video = video.mean(dim=1, keepdim=True)
        return video * 2.0 - 1.0

    def condition_on_images(self, cond: Conditioning, prompts: Sequence[str], images: Tensor,
                            latent_shape: Sequence[int]) -> Conditioning:
        """``cond`` with ``image`` = the first frames ``images [N, 3, H, W]`` in [0, 1] as slot values ``[N, C, 1, H,
        W]`` fp32 (``prompts`` and ``latent_shape`` unused beyond the shape check).

        Raises:
            ValueError: images whose size is not the latent's.
        """
        if tuple(images.shape[-2:]) != tuple(latent_shape[-2:]):
            raise ValueError(f"condition images are {tuple(images.shape[-2:])}, latents {tuple(latent_shape[-2:])}")
        return dataclasses.replace(cond, image=self.encode_video(images.unsqueeze(2)))

    def enable_gradient_checkpointing(self) -> None:
        """Recompute each block's activations in the backward pass (parameter names unchanged)."""
        self.transformer.gradient_checkpointing = True

    # ------------------------------------------------------------------ parameter modes

    def module_parameters(self) -> dict[str, nn.Parameter]:
        """``{full name: parameter}`` of exactly :attr:`trainable_modules` (module mode), in model order."""
        return {f"{m}.{n}": p for m in self.trainable_modules
                for n, p in self.transformer.get_submodule(m).named_parameters()}

    def apply_parameter_mode(self, rank: int = LORA_RANK, alpha: float = LORA_ALPHA) -> dict[str, nn.Parameter]:
        """Freeze everything, then make trainable what :attr:`parameter_mode` names: the module parameters, LoRA
        (rank ``rank``, alpha ``alpha``, dropout 0, peft adapter ``"default"``) on :attr:`lora_targets`, or both.
        Returns ``{name: parameter}`` of the trainable parameters (``named_parameters`` order).

        Raises:
            ValueError: ``module+lora`` with a trainable module at, inside or around a LoRA target
                (:func:`flowforge.models.trained_parts.check_disjoint`)."""
        from flowforge.models import lora as lora_lib
        from flowforge.models.trained_parts import check_disjoint

        if self.parameter_mode == "module+lora":
            check_disjoint(self.transformer, self.trainable_modules, self.lora_targets)
        self.transformer.requires_grad_(False)
        if "lora" in self.parameter_mode:
            lora_lib.inject_lora(self.transformer, rank, alpha, self.lora_targets)
        if "module" in self.parameter_mode:
            for p in self.module_parameters().values():
                p.requires_grad_(True)
        return {n: p for n, p in self.transformer.named_parameters() if p.requires_grad}

    def leverage_warnings(self, trainable: str, modules: Sequence[str] | None, *,
                          threshold: float = GATE_FLOOR) -> list[str]:
        """:func:`gate_leverage_warnings` of this model's coupling gates."""
        gates = [float(b.coupling.gate.detach().abs().max()) for b in self.transformer.blocks]
        return gate_leverage_warnings(trainable, modules, gates, threshold=threshold)

    # ------------------------------------------------------------------ files

    def provenance_table(self) -> str:
        """The provenance summary of the load (:func:`~.provenance.format_table`)."""
        return prov.format_table(self.provenance, self.sources)

    def provenance_record(self) -> dict:
        """Every loaded tensor's provenance and the source files, JSON-ready (:func:`~.provenance.provenance_record`;
        empty lists for a model built in memory): written into a run directory and beside an export."""
        return prov.provenance_record(self.provenance, self.sources)

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write ``config.json``, ``diffusion_pytorch_model.safetensors`` and ``flowforge.json`` to ``directory`` (and
        ``source_provenance.json``, the provenance of the load this model started from, when it was loaded).

        Raises:
            ValueError: ``directory`` overlaps the source checkpoint. RuntimeError: LoRA layers are injected (export
                merges them; this writes base weights only).
        """
        from safetensors.torch import save_file

        prov.check_outside_sources(directory, self.sources)
        if any(".lora_" in n or ".base_layer." in n for n in self.transformer.state_dict()):
            raise RuntimeError("save_pretrained writes base weights; this model has LoRA layers injected")
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        if self.provenance:  # where the weights this export starts from came from
            (root / PROVENANCE_NAME).write_text(json.dumps(self.provenance_record(), indent=1) + "\n")
        config = {"_class_name": CLASS_NAME, **self.world_config.to_dict()}
        (root / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        (root / META_NAME).write_text(json.dumps({"family": "world_model",
                                                  "action_names": list(self.action_names)}, indent=2) + "\n")
        state = {k: v.detach().contiguous().cpu() for k, v in self.transformer.state_dict().items()}
        save_file(state, str(root / WEIGHTS_NAME), metadata={"format": "pt"})
        return root



def load_world_model(path: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                     task: str = "i2v", parameter_mode: str = "module",
                     trainable_modules: Sequence[str] = DEFAULT_TRAINABLE_MODULES,
                     allow_init: Sequence[str] = (), seed: int = 0) -> WorldModelAdapter:
    """Load a world-model directory (``config.json`` + ``diffusion_pytorch_model.safetensors`` [+ ``flowforge.json``
    with ``action_names``]) with a provenance row for every tensor (kept on the adapter, logged as one summary line;
    a refused load's error carries the full table).

    Args:
        allow_init: exact module paths that may be absent from the checkpoint and are then freshly initialised
            (seeded by ``seed``), e.g. ``["latent_state_rollout", "transition_tokenizer"]`` when the checkpoint is a
            plain video backbone. Everything else must come from the checkpoint.

    Raises:
        FileNotFoundError: no config / weights. ValueError: ``task`` other than ``"i2v"``; not a world-model config.
        ProvenanceError: missing (not allowed), unexpected or mismatched tensors.
    """
    if task != "i2v":
        raise ValueError(f"model.task={task!r}: the world_model adapter runs only ['i2v'] (first frame + actions)")
    root = Path(path)
    if not (root / CONFIG_NAME).is_file() or not (root / WEIGHTS_NAME).is_file():
        raise FileNotFoundError(f"{path!s}: expected {CONFIG_NAME} and {WEIGHTS_NAME}")
    raw = json.loads((root / CONFIG_NAME).read_text())
    if raw.get("_class_name") != CLASS_NAME:
        raise ValueError(f"{root / CONFIG_NAME}: _class_name {raw.get('_class_name')!r}, expected {CLASS_NAME!r}")
    config = WorldModelConfig.from_dict(raw)
    meta = json.loads((root / META_NAME).read_text()) if (root / META_NAME).is_file() else {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = WorldModel(config)
    source, tensors = prov.read_source(root / WEIGHTS_NAME)
    rows = prov.provenance_rows(model, tensors, source, allow_init)
    prov.refuse_unsafe(rows, [source])
    model.load_state_dict({r.name: tensors[r.name] for r in rows if r.status == "loaded"}, strict=False)
    model = model.to(device=device, dtype=dtype)
    adapter = WorldModelAdapter(model, action_names=meta.get("action_names", ACTIONS), parameter_mode=parameter_mode,
                                trainable_modules=trainable_modules, provenance=rows, sources=[source])
    logger.info("world model provenance: %s", prov.summary_line(rows, [source]))
    return adapter
