"""The per-rank memory budget of a training config: items, phases, the verdict against a GPU, and the one change
that would make it fit.

Items (bytes per rank, ``N`` ranks, FSDP2 divides what it shards by ``N``; DDP and one GPU divide nothing):

======================  ======================================================================================
weights                 transformer parameters + buffers in ``model.dtype`` (full training: none, see masters)
trained masters         LoRA parameters (fp32), or every parameter under full training (fp32)
gradients               fp32, one per trained parameter
AdamW states            ``exp_avg`` + ``exp_avg_sq``, fp32
policy copies           old / EMA (and, under full training, ref) copies of what trains, fp32 (LoRA's adapters sit
                        in the sharded transformer; full training's copies are whole on every rank)
policy copy in use      with offload under full training: the host copy being evaluated, on the GPU
host AdamW buffers      ``offload: optimizer``: host copies of the trained shard and of its gradient, fp32
collective buffers      FSDP2: the largest block unsharded in ``param_dtype``, twice (current + prefetched)
trajectories            ``[B_rank, *latent]`` final + ``[B_rank, S, *latent]`` x and x_next (replay objectives)
conditioning            ``[B_rank, text_tokens, D]`` prompt embeddings (x2 with a CFG negative), model dtype
activations             measured per micro-batch row (:mod:`flowforge.tools.plan.activations`), x rows
======================  ======================================================================================

Offload (``distributed.offload``, FSDP on > 1 GPU only) moves items to the **host** (CPU memory of the rank's
machine), shown apart and never in a GPU phase: ``optimizer`` moves the AdamW states (and adds the host AdamW
buffers); ``params`` moves the weights' parameters (buffers stay), trained masters, gradients, AdamW states and the
policy copies; under full training either mode keeps the policy copies on the host and one of them on the GPU while
it is evaluated.

Phases: **load** (every rank materialises the whole transformer before ``fully_shard``, beside the text encoders
and VAE when their configs are known), **rollout** (resident items + a no-grad forward of a rollout chunk) and
**train** (resident items + the training transient). The peak is the largest phase. Not counted: reward models,
the VAE decode's activations, the CUDA context and allocator fragmentation (``CONTEXT_GB`` is added to the total
before the verdict, as an assumption, and shown as its own line).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CONTEXT_GB = 1.0  # CUDA context + allocator slack, an assumption (not measured), added before the verdict
GPUS = {  # name -> memory in GB (1e9 bytes), as sold (the datasheet)
    "h100-80gb": 80, "h100-94gb": 94, "h200": 141, "b200": 180, "a100-80gb": 80, "a100-40gb": 40, "h20": 96,
    "l20": 48, "l40s": 48, "a6000": 48, "rtx-4090": 24, "rtx-5090": 32,
}


def check_gpu(name: str) -> int:
    """The memory (GB) of GPU ``name``.

    Raises:
        ValueError: unknown name; the allowed names are listed.
    """
    if name not in GPUS:
        raise ValueError(f"--gpu={name!r} is not one of {sorted(GPUS)}")
    return GPUS[name]


@dataclass(frozen=True)
class Item:
    name: str
    bytes: float
    note: str = ""
    host: bool = False  # held in host (CPU) memory, not on the GPU (offload)


@dataclass
class Plan:
    """A memory plan; ``items`` are the train phase's, ``phases`` each phase's total bytes."""

    model: str
    algorithm: str
    trainable: str
    gpus: int
    gpu: str
    gpu_gb: float
    strategy: str
    items: list[Item]
    phases: dict[str, float]
    facts: dict = field(default_factory=dict)
    fix: str = ""

    @property
    def gpu_items(self) -> list[Item]:
        return [i for i in self.items if not i.host]

    @property
    def host_items(self) -> list[Item]:
        return [i for i in self.items if i.host]

    @property
    def host_bytes(self) -> float:
        """Bytes per rank in host memory (offloaded items)."""
        return sum(i.bytes for i in self.host_items)

    @property
    def peak(self) -> float:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    @property
    def fits(self) -> bool:
        return self.peak / 1e9 + CONTEXT_GB <= self.gpu_gb

    def largest(self, k: int = 3) -> list[Item]:
        return sorted(self.gpu_items, key=lambda i: -i.bytes)[:k]

    def as_dict(self) -> dict:
        return {"model": self.model, "algorithm": self.algorithm, "trainable": self.trainable, "gpus": self.gpus,
                "gpu": self.gpu, "gpu_gb": self.gpu_gb, "strategy": self.strategy,
                "items_gb": {i.name: round(i.bytes / 1e9, 3) for i in self.gpu_items},
                "host_items_gb": {i.name: round(i.bytes / 1e9, 3) for i in self.host_items},
                "host_gb": round(self.host_bytes / 1e9, 3),
                "notes": {i.name: i.note for i in self.items if i.note},
                "phases_gb": {k: round(v / 1e9, 3) for k, v in self.phases.items()},
                "peak_gb": round(self.peak / 1e9, 3), "peak_phase": self.peak_phase, "context_gb": CONTEXT_GB,
                "fits": self.fits, "largest": [i.name for i in self.largest()], "fix": self.fix,
                "facts": self.facts}


@dataclass(frozen=True)
class Setting:
    """What the budget reads from a config, flattened (so a plan can be re-evaluated with one thing changed)."""

    gpus: int
    fsdp: bool
    dtype_bytes: int
    param_dtype_bytes: int
    lora: bool
    copies: int  # fp32 copies of what trains (old, EMA, and ref under full training)
    rows_per_rank: int  # B_rank = prompts x group / N
    micro: int  # training micro-batch rows
    rollout_rows: int  # rollout chunk rows
    checkpointing: bool
    stored_steps: int  # x / x_next pairs kept per row (replay objectives), + means
    text_tokens: int
    text_dim: int
    pooled_dim: int
    cfg_negative: bool  # a CFG negative conditioning is kept beside the positive
    offload: str = "none"  # distributed.offload; read only under FSDP on > 1 GPU


def items_for(s: Setting, *, params: int, buffer_bytes: int, trained: int, largest_block: int, latent_numel: int,
              activations: dict[str, float], other_components: int) -> tuple[list[Item], dict[str, float]]:
    """The train phase's items and every phase's total (bytes per rank). ``activations``: ``train``,
    ``checkpointed``, ``rollout`` transients of the relevant rows (from the measured model)."""
    shard = s.gpus if s.fsdp else 1
    offload = s.offload if s.fsdp and s.gpus > 1 else "none"
    on_host = {"params": {"trained masters", "gradients", "AdamW states", "policy copies"},
               "optimizer": {"AdamW states"}, "none": set()}[offload]
    if offload != "none" and not s.lora:  # whole copies: host-homed under either mode (flowforge.policy)
        on_host = on_host | {"policy copies"}
    base = params * s.dtype_bytes if s.lora else 0.0  # the weights' parameters (full training: the masters)
    copies = s.copies * trained * 4 / (shard if s.lora else 1)  # LoRA copies are sharded adapters; whole ones not
    items = [
        Item("weights", (base + buffer_bytes) / shard,
             f"{params / 1e9:.3f}B params in the model dtype" if s.lora else "buffers only"),
        Item("trained masters", trained * 4 / shard, f"{trained / 1e6:.1f}M trained params, fp32"),
        Item("gradients", trained * 4 / shard, "fp32"),
        Item("AdamW states", trained * 8 / shard, "exp_avg + exp_avg_sq, fp32"),
        Item("policy copies", copies, f"{s.copies} fp32 copies of what trains"),
    ]
    items = [replace(i, host=i.name in on_host) for i in items]
    if offload == "params" and s.lora:  # FSDP offloads parameters; buffers stay on the GPU
        items[0] = replace(items[0], bytes=base / shard, host=True)
        items.insert(1, Item("weights (buffers)", buffer_bytes / shard, "FSDP keeps buffers on the GPU"))
    if offload == "optimizer":
        items.append(Item("host AdamW buffers", trained * 8 / shard, "trained shard + its gradient, fp32",
                          host=True))
    if offload != "none" and not s.lora and s.copies:
        items.append(Item("policy copy in use", trained * 4, "one whole copy on the GPU while evaluated"))
    items += [
        Item("collective buffers", (2 * largest_block * s.param_dtype_bytes) if s.fsdp and s.gpus > 1 else 0.0,
             "FSDP2 all-gather: largest block x2" if s.fsdp and s.gpus > 1 else "none"),
        Item("trajectories", s.rows_per_rank * latent_numel * 4 * (1 + s.stored_steps),
             f"{s.rows_per_rank} rows x (1 + {s.stored_steps}) latents, fp32"),
        Item("conditioning", s.rows_per_rank * (1 + s.cfg_negative) * (s.text_tokens * s.text_dim + s.pooled_dim)
             * s.dtype_bytes, f"{s.text_tokens} tokens x {s.text_dim}"),
    ]
    kind = "checkpointed" if s.checkpointing else "train"
    other = "checkpointed" if kind == "train" else "train"
    items.append(Item("activations", activations[kind],
                      f"{s.micro} rows, measured, {'with' if s.checkpointing else 'without'} checkpointing "
                      f"({'with' if other == 'checkpointed' else 'without'}: {activations[other] / 1e9:.3f} GB)"))
    resident = sum(i.bytes for i in items[:-1] if not i.host)
    full_weights = params * (s.dtype_bytes if s.lora else 4) + buffer_bytes
    phases = {"load": full_weights + other_components * s.dtype_bytes,
              "rollout": resident + activations["rollout"],
              "train": resident + activations[kind]}
    return items, phases


def suggest(plan: Plan, alternatives: dict[str, Plan]) -> str:
    """The first change (in the order given) whose plan fits, as one line; ``""`` when the plan fits."""
    if plan.fits:
        return ""
    for change, other in alternatives.items():
        if other.fits:
            return f"{change} (planned peak {other.peak / 1e9:.1f} GB)"
    return ("no single change fits: combine them (more GPUs with FSDP + offload + checkpointing + a smaller "
            "micro-batch)")


def render(plan: Plan) -> str:
    """The plan as a text table."""
    lines = [f"memory plan: {plan.model}, {plan.algorithm}, {plan.trainable}, {plan.gpus} x {plan.gpu} "
             f"({plan.gpu_gb} GB), {plan.strategy}; per rank", ""]
    width = max(len(i.name) for i in plan.items)
    for i in plan.gpu_items:
        lines.append(f"  {i.name:<{width}}  {i.bytes / 1e9:9.3f} GB   {i.note}")
    lines.append(f"  {'':<{width}}  {'-' * 9}")
    for name, v in plan.phases.items():
        lines.append(f"  {('phase ' + name):<{width}}  {v / 1e9:9.3f} GB")
    lines.append(f"  {'+ CUDA context':<{width}}  {CONTEXT_GB:9.3f} GB   assumption, not measured")
    if plan.host_items:
        lines += ["", "  host memory (CPU, per rank; distributed.offload):"]
        lines += [f"  {i.name:<{width}}  {i.bytes / 1e9:9.3f} GB   {i.note}" for i in plan.host_items]
        lines.append(f"  {'host total':<{width}}  {plan.host_bytes / 1e9:9.3f} GB")
    total = plan.peak / 1e9 + CONTEXT_GB
    verdict = "fits" if plan.fits else "does not fit"
    lines += ["", f"peak {total:.1f} GB ({plan.peak_phase}) of {plan.gpu_gb} GB: {verdict}; largest: "
              + ", ".join(f"{i.name} {i.bytes / 1e9:.1f} GB" for i in plan.largest())]
    if plan.fix:
        lines.append(f"to fit: {plan.fix}")
    lines.append("not counted: reward models, VAE decode activations, allocator fragmentation")
    return "\n".join(lines)
