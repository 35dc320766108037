"""Wan 2.2 A14B, the two-expert Wan (diffusers ``WanPipeline`` / ``WanImageToVideoPipeline`` with ``transformer_2``
and ``boundary_ratio``): a high-noise and a low-noise ``WanTransformer3DModel`` of the same architecture.

==================  ================================================================================================
flowforge           checked against diffusers 0.42 ``pipelines/wan/pipeline_wan.py`` (``pipeline_wan_i2v.py`` has the
                    same lines)
==================  ================================================================================================
expert switch       ``boundary_timestep = boundary_ratio * scheduler.config.num_train_timesteps`` (pipeline_wan.py
                    585-588); ``t >= boundary_timestep``: ``transformer`` (the high-noise expert), else
                    ``transformer_2`` (597-604). :class:`WanExperts` applies the same comparison, fp32 timestep
                    ``1000 * sigma`` against the Python float boundary, **per row**: a batch whose rows sit on both
                    sides (NFT's forward process draws a sigma per row) is split, each expert runs its rows.
replay              the expert is a function of the row's sigma alone, so a replayed step uses the expert its rollout
                    step used (same sigma, same comparison).
CFG                 ``guidance_scale`` for both experts: the pipeline's ``guidance_scale_2`` defaults to
                    ``guidance_scale`` (517-518); a different low-noise scale is not expressible in flowforge's one
                    ``sampler.guidance_scale`` (see "Not done").
everything else     as :mod:`flowforge.models.wan.adapter` (timestep unit, VAE scaling, UMT5 text, i2v layouts): both
                    experts are called exactly like the single Wan transformer (``hidden_states``, ``timestep``,
                    ``encoder_hidden_states``, 620-635).
==================  ================================================================================================

:func:`flowforge.models.wan.adapter.load_wan` (``model.adapter: wan``) loads such a directory as a ``WanAdapter`` whose
``transformer`` is a :class:`WanExperts`; every Wan convention (timestep unit, VAE scaling, UMT5 text, i2v layouts,
CFG) is then ``WanAdapter``'s, unchanged. Training: ``adapter.transformer`` is a :class:`WanExperts` module holding
both experts as ``transformer`` (high noise) and ``transformer_2`` (low noise), so LoRA injection, the policy bank,
checkpoints (parameter names ``transformer.blocks.0...`` / ``transformer_2.blocks.0...``) and full fine-tunes cover
both at once. The default LoRA targets (``WanAdapter.lora_targets``, module-name suffixes) put LoRA on both experts;
LoRA on one expert only: list that expert's full module names in ``lora.targets`` (:func:`expert_lora_targets`
prints them, e.g. ``transformer_2.blocks.0.attn1.to_q``); the other expert then stays the base model bit for bit.

Exports keep both experts (:mod:`flowforge.tools.export.wan_experts`). Not done: ``guidance_scale_2`` different
from ``guidance_scale``. Multi-GPU FSDP with per-row sigmas (NFT's forward process) is untested: ranks whose rows fall
on different sides of the boundary run different experts.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

EXPERTS = ("transformer", "transformer_2")
"""Submodule names of :class:`WanExperts`: the high-noise and the low-noise expert (the pipeline's names)."""


def _plain(value: Any) -> Any:
    return tuple(value) if isinstance(value, (list, tuple)) else value


class WanExperts(nn.Module):
    """Both Wan 2.2 A14B experts behind one ``WanTransformer3DModel`` call signature.

    Args:
        transformer: the high-noise expert (used where ``timestep >= boundary_ratio * num_train_timesteps``).
        transformer_2: the low-noise expert (every other timestep); same config as ``transformer``.
        boundary_ratio: the pipeline's ``boundary_ratio`` in (0, 1).
        num_train_timesteps: the scheduler config's ``num_train_timesteps`` (1000 for Wan).

    Raises:
        ValueError: ``boundary_ratio`` outside (0, 1); experts whose input / output channels or patch sizes differ.
    """

    def __init__(self, transformer: nn.Module, transformer_2: nn.Module, boundary_ratio: float,
                 num_train_timesteps: int = 1000):
        super().__init__()
        if not 0.0 < float(boundary_ratio) < 1.0:
            raise ValueError(f"boundary_ratio={boundary_ratio!r}; allowed: a float in (0, 1)")
        for key in ("in_channels", "out_channels", "patch_size"):
            a, b = getattr(transformer.config, key), getattr(transformer_2.config, key)
            if _plain(a) != _plain(b):
                raise ValueError(f"the two Wan experts differ in {key}: {a} vs {b}")
        self.transformer = transformer
        self.transformer_2 = transformer_2
        self.boundary_ratio = float(boundary_ratio)
        self.num_train_timesteps = int(num_train_timesteps)

    @property
    def config(self):
        """The high-noise expert's config (both experts share the architecture)."""
        return self.transformer.config

    @property
    def boundary_timestep(self) -> float:
        """``boundary_ratio * num_train_timesteps``, as the pipeline computes it (a Python float)."""
        return self.boundary_ratio * self.num_train_timesteps

    def high_noise_rows(self, timestep: Tensor) -> Tensor:
        """Bool ``[B]``: rows the high-noise expert runs, ``t >= boundary_timestep`` with the pipeline's comparison
        (fp32 tensor against the Python float). ``timestep`` is ``[B]`` or per token ``[B, seq]`` (TI2V's pinned
        frame has 0 there; the row's timestep is its largest, the pipeline's ``t``)."""
        t = timestep if timestep.ndim == 1 else timestep.amax(dim=1)
        return t >= self.boundary_timestep

    def forward(self, hidden_states: Tensor, timestep: Tensor, encoder_hidden_states: Tensor,
                encoder_hidden_states_image: Tensor | None = None, return_dict: bool = False,
                attention_kwargs: dict | None = None):
        """``WanTransformer3DModel.forward`` of the expert of each row; returns ``(out,)`` (``return_dict`` must be
        False). A batch all on one side runs that expert alone (so a loss over it may reach no trained weight when
        LoRA is on the other expert only: :meth:`flowforge.policy.Policy.backward` then skips it)."""
        if return_dict:
            raise ValueError("WanExperts.forward returns a tuple; call it with return_dict=False")
        high = self.high_noise_rows(timestep)
        kw = dict(attention_kwargs=attention_kwargs, return_dict=False)
        if bool(high.all()) or bool((~high).all()):  # the pipeline's case: the whole batch on one expert
            expert = EXPERTS[0] if bool(high.all()) else EXPERTS[1]
            out = getattr(self, expert)(hidden_states=hidden_states, timestep=timestep,
                                        encoder_hidden_states=encoder_hidden_states,
                                        encoder_hidden_states_image=encoder_hidden_states_image, **kw)[0]
            return (out,)
        out = None
        for expert, rows in ((self.transformer, high), (self.transformer_2, ~high)):
            idx = rows.nonzero().flatten()
            part = expert(hidden_states=hidden_states[idx], timestep=timestep[idx],
                          encoder_hidden_states=encoder_hidden_states[idx],
                          encoder_hidden_states_image=None if encoder_hidden_states_image is None
                          else encoder_hidden_states_image[idx], **kw)[0]
            if out is None:
                out = part.new_empty(hidden_states.shape[0], *part.shape[1:])
            out[idx] = part
        return (out,)

    @property
    def blocks(self) -> list[nn.Module]:
        """The high-noise expert's ``WanTransformerBlock`` modules, then the low-noise expert's (a plain list:
        parameter names stay ``transformer.blocks.<i>`` / ``transformer_2.blocks.<i>``)."""
        return list(self.transformer.blocks) + list(self.transformer_2.blocks)

    def expert_of(self, sigma: Tensor) -> list[str]:
        """The expert (:data:`EXPERTS` name) that denoises each ``sigma [B]`` (Wan's timestep ``1000 * sigma``)."""
        high = self.high_noise_rows(1000.0 * sigma.float())
        return [EXPERTS[0] if h else EXPERTS[1] for h in high.tolist()]

    def enable_gradient_checkpointing(self) -> None:
        """diffusers' activation checkpointing on both experts (parameter names unchanged)."""
        self.transformer.enable_gradient_checkpointing()
        self.transformer_2.enable_gradient_checkpointing()


def expert_lora_targets(transformer: WanExperts, experts: Iterable[str], suffixes: Iterable[str]) -> tuple[str, ...]:
    """Full module names (``<expert>.blocks.<i>.<suffix>``) of ``suffixes`` (e.g. ``WanAdapter.lora_targets``) in
    the chosen ``experts`` (names from :data:`EXPERTS`): ``lora.targets`` for LoRA on one expert only.

    Raises:
        ValueError: an unknown expert name.
    """
    out = []
    for name in experts:
        if name not in EXPERTS:
            raise ValueError(f"expert {name!r}; allowed: {list(EXPERTS)}")
        n = len(getattr(transformer, name).blocks)
        out += [f"{name}.blocks.{i}.{s}" for i in range(n) for s in tuple(suffixes)]
    return tuple(out)


def load_wan_experts(root: Path, index: dict, *, dtype: torch.dtype, device: torch.device | str) -> WanExperts:
    """Both experts of pipeline directory ``root`` (``transformer/``, ``transformer_2/``, ``model_index.json``
    ``boundary_ratio``, the scheduler's ``num_train_timesteps``) as one :class:`WanExperts`; :func:`load_wan`
    wraps it in a :class:`WanExpertsAdapter` with the directory's text encoder and VAE.

    Raises:
        ValueError: ``transformer_2/`` or ``boundary_ratio`` missing (one without the other).
    """
    from diffusers import WanTransformer3DModel

    from flowforge.models.common import has_component, read_json

    ratio = index.get("boundary_ratio")
    if ratio is None or not has_component(root, "transformer_2"):
        raise ValueError(f"{root!s}: a two-expert Wan2.2 directory needs both transformer_2/ and model_index.json "
                         f"boundary_ratio (found boundary_ratio={ratio!r}, "
                         f"transformer_2={has_component(root, 'transformer_2')})")
    experts = [WanTransformer3DModel.from_pretrained(str(root / name), torch_dtype=dtype,
                                                     local_files_only=True).to(device) for name in EXPERTS]
    scheduler = read_json(root / "scheduler" / "scheduler_config.json")
    return WanExperts(*experts, boundary_ratio=float(ratio),
                      num_train_timesteps=int(scheduler.get("num_train_timesteps", 1000)))
