"""Context parallelism on 2 ranks against the same model on one rank, for tiny random-init families.

Usage (under torchrun, gloo): ``python tests/cp_worker.py OUT_DIR FAMILY:ULYSSES:RING[:fsdp] [...]``.

Per family every rank builds the same tiny adapter (seeded), adds LoRA with random ``B`` (so both ``lora_A`` and
``lora_B`` get gradients), and computes velocities of 2 samples per context group and the gradients of the LoRA
weights of the loss ``sum(v * w)`` (``w`` fixed; averaged over the context groups) twice: first as one process would
(no parallelism, every group's samples), then with the sequence split over the ranks of each context group
(:func:`flowforge.runtime.context_parallel.enable`). With one context group (world = ULYSSES x RING) the gradients
are summed over it (:func:`~flowforge.runtime.context_parallel.sum_context_gradients`); with several, each group
takes its own samples and DDP (``replicate``; FSDP2 over the flattened mesh with ``:fsdp``) averages over every rank,
the gathered output's gradient scaled by the
degree (:func:`~flowforge.runtime.context_parallel.scale_gathered_gradients`). Rank r
writes ``OUT_DIR/<spec with - for :>.rank<r>.json``: the largest absolute differences, the sizes the plan split, the
number of
tokens this rank's attention saw, or the one-line error the run raised.
"""

import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist

from flowforge.models.lora import inject_lora
from flowforge.runtime import context_parallel as cp

PROMPTS = ["a red cat sitting under a tree", "two dogs"]


def build(name: str):
    """(adapter, latent shape without batch) of a tiny family."""
    if name in ("wan", "qwen_image", "flux"):
        from tests.models.families import build_family

        fam = build_family(name)  # Wan's test latent has 3 tokens: 12 here (3 latent frames of 4 x 4, patch 1 x 2 x 2)
        return fam.adapter, {"wan": (4, 3, 4, 4)}.get(name, fam.latent)
    if name == "wan22":  # two experts; the test's sigmas 0.37 / 0.81 fall on either side of the 0.5 boundary
        from flowforge.models.wan.adapter import WanAdapter, wan_text
        from flowforge.models.wan.experts import WanExperts
        from tests.models import tiny_families as tiny

        c, c2 = tiny.wan_components(0), tiny.wan_components(1)
        text = wan_text(components={k: c[k] for k in ("tokenizer", "text_encoder")}, max_sequence_length=16,
                        min_tokenizer_size=10)
        experts = WanExperts(c["transformer"], c2["transformer"], boundary_ratio=0.5)
        return WanAdapter(experts, text, c["vae"], scheduler_config=dict(c["scheduler"].config)), (4, 3, 4, 4)
    if name == "flux2":
        from flowforge.models.flux2.adapter import Flux2KleinAdapter, flux2_klein_text
        from tests.models import tiny_image_families as tiny

        c = tiny.flux2_klein_components()
        text = flux2_klein_text(components={k: c[k] for k in ("tokenizer", "text_encoder")},
                                max_sequence_length=32, min_tokenizer_size=10)
        return Flux2KleinAdapter(c["transformer"], text, c["vae"], scheduler_config=dict(c["scheduler"].config)), \
            (16, 4, 4)
    if name == "ltx2":
        from flowforge.models.ltx2.adapter import LTX2Adapter, ltx2_text
        from tests.models import tiny_av_families as tiny

        c = tiny.ltx2_components()
        text = ltx2_text(components={k: c[k] for k in ("tokenizer", "text_encoder", "connectors")},
                         max_sequence_length=16, min_tokenizer_size=10)
        adapter = LTX2Adapter(c["transformer"], text, c["vae"], c["audio_vae"], c["vocoder"],
                              scheduler_config=dict(c["scheduler"].config), frame_rate=12.5)
        return adapter, adapter.latent_shape(32, 32, 1)  # 256 video + 2 audio tokens (12.5 fps): both split evenly
    raise ValueError(name)


@contextlib.contextmanager
def attention_lengths(transformer):
    """Collects the query sequence length of every attention call inside the block (the image / video stream)."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    seen: list[int] = []

    def pre(mod, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        seen.append(int(hidden.shape[1]))

    hooks = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in transformer.modules()
             if isinstance(m, (Attention, AttentionModuleMixin))]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def grads_of(params):
    # a LoRA weight the output does not reach (the text stream of a last joint block) gets no gradient: 0;
    # an FSDP2-sharded gradient is gathered whole
    return [torch.zeros_like(p) if p.grad is None else
            (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()) for p in params]


def run(name: str, ulysses: int, ring: int, strategy: str = "ddp") -> dict:
    adapter, latent = build(name)
    adapter.transformer.eval()
    params = inject_lora(adapter.transformer, 4, 4.0, adapter.lora_targets)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in params:
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    cond = adapter.encode(PROMPTS)
    data = dist.get_world_size() // (ulysses * ring)  # context groups, each with samples of its own
    xs = torch.randn(data, len(PROMPTS), *latent, generator=g)
    ws = torch.randn(xs.shape, generator=g)
    sigma = torch.tensor([0.37, 0.81])
    for p in params:
        p.grad = None
    ref_v = []  # one process: the mean over the data groups of each group's loss sum(v * w)
    with attention_lengths(adapter.transformer) as ref_seen:
        for d in range(data):
            ref_v.append(adapter.velocity(xs[d], sigma, cond, 1.0))
            ((ref_v[-1] * ws[d]).sum() / data).backward()
    ref_g = grads_of(params)
    sizes = cp.split_sizes(adapter.transformer, lambda: adapter.velocity(xs[0], sigma, cond, 1.0))
    cm = cp.build_mesh(ulysses, ring)
    record = {"sizes": sizes, "problems": cp.divisibility_problems(sizes, cm.degree)}
    if record["problems"]:
        return record
    try:
        cp.enable(adapter.transformer, cm)
    except ValueError as exc:
        return {**record, "error": str(exc)}
    if data > 1:  # DDP / FSDP2 averaging over all ranks, the gathered gradient scaled by the degree
        cp.scale_gathered_gradients(adapter.transformer, cm)
        if strategy == "fsdp":  # sharded over the flattened (data, ring, ulysses) mesh: every rank
            from torch.distributed.fsdp import fully_shard

            for block in adapter.blocks():
                fully_shard(block, mesh=cm.mesh._flatten())
            fully_shard(adapter.transformer, mesh=cm.mesh._flatten())
            params = [p for p in adapter.transformer.parameters() if p.requires_grad]  # now sharded DTensors
            assert len(params) == len(ref_g)
        else:
            from torch.distributed._composable import replicate

            replicate(adapter.transformer)
    for p in params:
        p.grad = None
    x, w = xs[cm.data_rank], ws[cm.data_rank]
    with attention_lengths(adapter.transformer) as seen:
        v = adapter.velocity(x, sigma, cond, 1.0)
        (v * w).sum().backward()
    if data == 1:
        cp.sum_context_gradients(params, cm)
    v, ref_v, grads = v.detach(), ref_v[cm.data_rank].detach(), grads_of(params)
    return {**record, "v_max_diff": float((v - ref_v).abs().max()), "v_max": float(ref_v.abs().max()),
            "grad_max_diff": max(float((a - b).abs().max()) for a, b in zip(grads, ref_g)),
            "grad_max": max(float(b.abs().max()) for b in ref_g), "n_params": len(params),
            "attn_tokens": seen, "ref_attn_tokens": ref_seen[:len(ref_seen) // data], "data_rank": cm.data_rank,
            "degree": cm.degree,
            "accelerator_count_after": torch.accelerator.device_count()}


def main() -> None:
    out_dir, specs = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for spec in specs:
        name, ulysses, ring, *strategy = spec.split(":")
        record = run(name, int(ulysses), int(ring), *strategy)
        with open(f"{out_dir}/{spec.replace(':', '-')}.rank{rank}.json", "w") as f:
            json.dump(record, f)
    dist.barrier()
    # every rank's records are written and closed. Tearing the gloo group down can still abort a rank under load
    # ("terminate called without an active exception", SIGABRT, seen once in a 4-rank CI run after all 8 records
    # were written), which fails the launch though the run was right: exit without the teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
