"""A diffusers pipeline for flowforge's text-to-digit demo model, loadable without flowforge installed.

``flowforge export RUN OUT --form merged`` copies this file into ``OUT/pipeline.py`` when the base is the embedded
demo (a bare pixel-space SD3 transformer conditioned on MiniLM), so that

.. code-block:: python

    from diffusers import DiffusionPipeline
    pipe = DiffusionPipeline.from_pretrained(OUT, custom_pipeline=f"{OUT}/pipeline.py", trust_remote_code=True)
    images = pipe(["the digit 7"], generator=torch.Generator().manual_seed(0)).images

generates digits (diffusers' mechanism for local custom pipelines: ``custom_pipeline`` names the ``.py`` file;
diffusers 0.42 asks for ``trust_remote_code=True`` before it runs a pipeline file from a model directory).
This file imports only torch, diffusers and transformers: it is the reference a user reads.

What it computes (the same as flowforge's sampler on the demo model):

==================  ===========================================================================================
part                computation
==================  ===========================================================================================
text encoding       ``all-MiniLM-L6-v2`` (``text_encoder`` BertModel + ``tokenizer``): the prompts and the
                    negative prompt tokenised together (padding to the longest, truncation at 256 tokens);
                    ``prompt_embeds [B, max_length, 384]`` = last hidden states of the first ``max_length`` tokens,
                    zero at padding; ``pooled [B, 384]`` = L2-normalised mean of the last hidden states over the
                    real tokens (sentence-transformers' Transformer -> mean Pooling -> Normalize)
noise levels        ``FlowMatchEulerDiscreteScheduler`` (static ``shift`` of the run) with ``num_inference_steps``
                    steps; the transformer's timestep is ``1000 * sigma``
velocity            ``v = transformer(x, context, pooled, 1000 sigma)``; with ``guidance_scale != 1``
                    ``v_u + g (v_c - v_u)`` (classifier-free guidance, the negative prompt as unconditional)
step                Euler: ``x <- x + (sigma_next - sigma) v`` (the scheduler's ``step``), fp32
output              pixels: ``images = clamp((x + 1) / 2, 0, 1)``, one grey channel repeated to RGB
==================  ===========================================================================================
"""

from __future__ import annotations

from typing import List, Optional, Union

import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
from diffusers.pipelines.pipeline_utils import ImagePipelineOutput

MINILM_MAX_SEQ = 256  # all-MiniLM-L6-v2's max_seq_length: the sentence is encoded whole up to this length


class FlowforgeDigitsPipeline(DiffusionPipeline):
    """Text-to-image sampling of a pixel-space SD3 transformer conditioned on MiniLM (module table).

    Args:
        transformer: ``SD3Transformer2DModel`` whose ``joint_attention_dim`` and ``pooled_projection_dim`` are 384.
        scheduler: ``FlowMatchEulerDiscreteScheduler`` (its ``shift`` is the run's ``sampler.shift``).
        text_encoder: the MiniLM ``BertModel``; tokenizer: its tokenizer.
        max_length: context tokens the transformer sees (``flowforge.json`` ``max_length`` of the base).
        height, width: default image size in pixels; num_inference_steps, guidance_scale: defaults of ``__call__``
            (the run's ``sampler.num_steps`` and ``sampler.guidance_scale``).
        negative_prompt: the unconditional prompt of classifier-free guidance.
    """

    model_cpu_offload_seq = "text_encoder->transformer"

    def __init__(self, transformer: SD3Transformer2DModel, scheduler: FlowMatchEulerDiscreteScheduler, text_encoder,
                 tokenizer, max_length: int = 16, height: int = 32, width: int = 32, num_inference_steps: int = 10,
                 guidance_scale: float = 1.0, negative_prompt: str = ""):
        super().__init__()
        self.register_modules(transformer=transformer, scheduler=scheduler, text_encoder=text_encoder,
                              tokenizer=tokenizer)
        self.register_to_config(max_length=max_length, height=height, width=width,
                                num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                                negative_prompt=negative_prompt)

    @torch.no_grad()
    def encode_prompt(self, prompts: List[str]):
        """``prompts`` (plus the negative prompt, encoded in the same batch) -> ``(prompt_embeds [B + 1, L, 384],
        pooled [B + 1, 384])`` fp32, the negative prompt last."""
        batch = self.tokenizer(list(prompts) + [self.config.negative_prompt], padding=True, truncation=True,
                               max_length=MINILM_MAX_SEQ, return_tensors="pt").to(self.text_encoder.device)
        hidden = self.text_encoder(**batch).last_hidden_state.float()
        full_mask = batch["attention_mask"]
        weights = full_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = torch.nn.functional.normalize((hidden * weights).sum(1) / weights.sum(1).clamp_min(1e-9), dim=-1)
        length = int(self.config.max_length)
        embeds = hidden.new_zeros(hidden.shape[0], length, hidden.shape[-1])
        mask = torch.zeros(hidden.shape[0], length, dtype=torch.long, device=hidden.device)
        keep = min(length, hidden.shape[1])
        embeds[:, :keep] = hidden[:, :keep]
        mask[:, :keep] = full_mask[:, :keep]
        return embeds * mask.unsqueeze(-1).to(embeds.dtype), pooled

    def _velocity(self, x, sigma, embeds, pooled, negative, guidance_scale: float):
        dtype = self.transformer.dtype

        def forward(x_in, e, p):
            t = (1000.0 * sigma.to(device=x_in.device, dtype=torch.float32)).expand(x_in.shape[0]).to(dtype)
            return self.transformer(hidden_states=x_in.to(dtype), encoder_hidden_states=e.to(dtype),
                                    pooled_projections=p.to(dtype), timestep=t, return_dict=False)[0].float()

        if guidance_scale == 1.0:
            return forward(x, embeds, pooled)
        n = x.shape[0]
        neg_e, neg_p = negative[0].expand(n, *negative[0].shape[1:]), negative[1].expand(n, -1)
        v_u, v_c = forward(torch.cat([x, x]), torch.cat([neg_e, embeds]), torch.cat([neg_p, pooled])).chunk(2)
        return v_u + guidance_scale * (v_c - v_u)

    @torch.no_grad()
    def __call__(self, prompt: Union[str, List[str]], num_inference_steps: Optional[int] = None,
                 guidance_scale: Optional[float] = None, height: Optional[int] = None, width: Optional[int] = None,
                 num_images_per_prompt: int = 1, generator: Optional[torch.Generator] = None,
                 latents: Optional[torch.Tensor] = None, output_type: str = "pil", return_dict: bool = True):
        """Generate ``num_images_per_prompt`` images per prompt (prompt-major).

        Args:
            latents: initial noise ``[B * num_images_per_prompt, C, H, W]`` (fp32, standard normal); drawn with
                ``generator`` when ``None``.
            output_type: ``"pil"`` (list of RGB images), ``"np"`` (``[N, H, W, 3]`` float32 in [0, 1]) or ``"pt"``
                (``[N, 3, H, W]`` float32 in [0, 1]).

        Returns:
            ``ImagePipelineOutput(images=...)`` (or the tuple ``(images,)`` with ``return_dict=False``).

        Raises:
            ValueError: ``latents`` of the wrong shape; unknown ``output_type``.
        """
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        cfg = self.config
        steps = int(cfg.num_inference_steps if num_inference_steps is None else num_inference_steps)
        g = float(cfg.guidance_scale if guidance_scale is None else guidance_scale)
        h, w = int(height or cfg.height), int(width or cfg.width)
        device = self._execution_device
        embeds, pooled = self.encode_prompt(prompts)
        negative = (embeds[-1:], pooled[-1:])
        embeds = embeds[:-1].repeat_interleave(num_images_per_prompt, 0)
        pooled = pooled[:-1].repeat_interleave(num_images_per_prompt, 0)
        shape = (len(prompts) * num_images_per_prompt, int(self.transformer.config.in_channels), h, w)
        if latents is None:
            latents = torch.randn(shape, generator=generator, dtype=torch.float32).to(device)
        elif tuple(latents.shape) != shape:
            raise ValueError(f"latents have shape {tuple(latents.shape)}, expected {shape}")
        x = latents.to(device=device, dtype=torch.float32)
        self.scheduler.set_timesteps(steps, device=device)
        for i, t in enumerate(self.progress_bar(self.scheduler.timesteps)):
            sigma = self.scheduler.sigmas[i].to(device=device, dtype=torch.float32)
            v = self._velocity(x, sigma.reshape(1), embeds, pooled, negative, g)
            x = self.scheduler.step(v, t, x, return_dict=False)[0].float()
        images = ((x + 1.0) / 2.0).clamp(0.0, 1.0)
        if images.shape[1] == 1:
            images = images.repeat(1, 3, 1, 1)
        images = images.cpu()
        if output_type == "np" or output_type == "pil":
            images = images.permute(0, 2, 3, 1).numpy()
            if output_type == "pil":
                images = self.numpy_to_pil(images)
        elif output_type != "pt":
            raise ValueError(f"output_type {output_type!r}: allowed 'pil', 'np', 'pt'")
        self.maybe_free_model_hooks()
        return ImagePipelineOutput(images=images) if return_dict else (images,)


__all__ = ["FlowforgeDigitsPipeline"]
