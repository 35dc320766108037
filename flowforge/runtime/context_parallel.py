"""Context (sequence) parallelism through diffusers' own hooks: one sample's token sequence split over ranks.

diffusers (>= 0.36) ships context parallelism for transformers that declare a ``_cp_plan`` (which module inputs
are split along the sequence, which outputs are gathered back): ``model.enable_parallelism(config=
ContextParallelConfig(ulysses_degree=U, ring_degree=R, mesh=...))`` registers split / gather hooks on the planned
modules and hands the attention processors the config, so attention runs as

* **Ulysses** (degree ``U``): an all-to-all turns "my tokens, every head" into "every token, my heads" around each
  attention call (needs ``U`` to divide the number of heads; works with the native SDPA backend, CPU included);
* **ring** (degree ``R``): key / value chunks visit every rank and the partial outputs are merged with their
  log-sum-exp (needs a backend that returns it: ``flash``, ``_native_flash``, ``_native_cudnn``, ``sage``, ... on
  CUDA; on CPU diffusers' ``native`` backend does not, so :func:`enable` switches a CPU model to
  :mod:`~flowforge.runtime.cpu_ring_attention`, PyTorch's CPU flash kernel, which does).

The gather hook at the model's output all-gathers the full sequence, so every rank of a context group ends with the
same full velocity, and a loss computed from it is the same on every rank of the group. Its backward keeps each
rank's own chunk of the (identical) output gradient, so each rank's parameter gradients hold the contribution of its
own tokens: the full gradient is their **sum** over the context group (:func:`sum_context_gradients`).

Mesh. :func:`build_mesh` makes one ``torch.distributed.device_mesh`` of shape ``(data, ring, ulysses)`` with those
``mesh_dim_names`` (ranks ordered data-major: the ranks of one context group are consecutive); diffusers gets the
``("ring", "ulysses")`` sub-mesh of this rank through ``ContextParallelConfig.mesh`` and builds nothing itself.
Data parallelism (DDP / FSDP2) then runs over the data dimension for the *samples*: the ranks of one context group
roll out and train the same samples (:attr:`ContextMesh.data_rank` picks the share). Gradient averaging may run
over every rank (the flattened mesh, what torchtitan does for FSDP under context parallelism) once each rank's
gradient is scaled by ``degree`` (average over ``data x context`` ranks x ``degree`` = sum over context, mean over
data): :attr:`ContextMesh.gradient_scale`.

The CPU shim. diffusers places the config on ``torch.device(accelerator, rank % torch.accelerator.device_count())``;
without an accelerator the count is 0 (a ``ZeroDivisionError``). :func:`cpu_accelerator_count` makes the count
answer 1 only while ``enable_parallelism`` runs, and only when there is no accelerator; nothing reads that device
afterwards (the hooks and the attention use the tensors' own devices and the mesh's process groups).

=============  ==========================================================================================
name           meaning
=============  ==========================================================================================
``U``, ``R``   Ulysses and ring degrees (``distributed.context_parallel.ulysses`` / ``ring``)
``degree``     ``U * R``: ranks sharing one sample's sequence (a context group)
``data``       ``world_size / degree``: context groups, each with its own samples
=============  ==========================================================================================
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flowforge.runtime import cp_plans, cpu_ring_attention

MESH_DIMS = ("data", "ring", "ulysses")
"""Names of the device-mesh dimensions, outermost first."""

LSE_BACKENDS = ("flash", "flash_hub", "flash_varlen_hub", "_flash_3_hub", "_flash_3_varlen_hub", "_native_cudnn",
                "_native_flash", "_native_npu", "sage", "sage_hub")
"""diffusers attention backends with context-parallel support whose forward returns the log-sum-exp, which ring
attention needs (``native`` has context-parallel support for Ulysses only)."""


@dataclass(frozen=True)
class ContextMesh:
    """This rank's place in the ``(data, ring, ulysses)`` mesh of :func:`build_mesh`."""

    mesh: object  # torch.distributed.device_mesh.DeviceMesh, dims MESH_DIMS
    ulysses: int
    ring: int

    @property
    def degree(self) -> int:
        """Ranks sharing one sample's sequence: ``ulysses * ring``."""
        return self.ulysses * self.ring

    @property
    def data_size(self) -> int:
        """Number of context groups (ranks with different samples)."""
        return self.mesh.size(0)

    @property
    def data_rank(self) -> int:
        """Which context group this rank is in: the share of the samples it processes, in ``[0, data_size)``."""
        return self.mesh.get_local_rank("data")

    @property
    def context_mesh(self):
        """The 2-D ``("ring", "ulysses")`` sub-mesh of this rank's context group (what diffusers receives)."""
        return self.mesh["ring", "ulysses"]

    @property
    def context_group(self):
        """The process group of this rank's context group (ring and Ulysses ranks together)."""
        return self.context_mesh._flatten().get_group()

    @property
    def gradient_scale(self) -> float:
        """Factor on each rank's gradient before an average over *all* ranks, so that the result is the sum over the
        context group and the mean over the data dimension: ``degree``."""
        return float(self.degree)


def build_mesh(ulysses: int, ring: int, device_type: str = "cpu") -> ContextMesh:
    """The ``(data, ring, ulysses)`` device mesh over every rank of the default process group.

    Args:
        ulysses, ring: the degrees (>= 1; their product > 1 and dividing the world size).
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (the mesh's device type).

    Raises:
        ValueError: a degree < 1, both 1, or a product that does not divide the world size (the values named).
        RuntimeError: no process group initialised.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("context parallelism needs a process group: launch with torchrun")
    world = dist.get_world_size()
    problems = degree_problems(ulysses, ring, world)
    if problems:
        raise ValueError("; ".join(problems))
    degree = ulysses * ring
    mesh = init_device_mesh(device_type, (world // degree, ring, ulysses), mesh_dim_names=MESH_DIMS)
    return ContextMesh(mesh, ulysses=ulysses, ring=ring)


def degree_problems(ulysses: int, ring: int, world_size: int) -> list[str]:
    """What is wrong with degrees ``ulysses`` / ``ring`` on ``world_size`` ranks (``[]`` when they fit), one line
    each naming ``distributed.context_parallel.*``."""
    where = "distributed.context_parallel"
    problems = [f"{where}.{k}={v!r} must be an integer >= 1" for k, v in (("ulysses", ulysses), ("ring", ring))
                if not isinstance(v, int) or isinstance(v, bool) or v < 1]
    if problems:
        return problems
    degree = ulysses * ring
    if degree > 1 and world_size % degree:
        problems.append(f"{where}: ulysses x ring = {ulysses} x {ring} = {degree} does not divide the world size "
                        f"{world_size}; launch a multiple of {degree} ranks (torchrun --nproc_per_node)")
    return problems


def supports_context_parallel(transformer_class: type) -> bool:
    """Whether diffusers can split this transformer class's sequence: it declares a ``_cp_plan``."""
    return getattr(transformer_class, "_cp_plan", None) is not None


def plan_of(module: torch.nn.Module) -> dict:
    """The ``_cp_plan`` diffusers is given for ``module``: flowforge's correction for its class
    (:data:`flowforge.runtime.cp_plans.PLANS`, e.g. LTX-2's), else the class's own."""
    fix = cp_plans.PLANS.get(type(module).__name__)
    return fix(module) if fix is not None else type(module)._cp_plan


def planned_modules(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules context parallelism is enabled on: ``[transformer]`` when its class declares a ``_cp_plan``,
    else its direct children whose classes do (a container of experts, e.g. Wan 2.2's ``WanExperts``: each expert
    gets its own hooks and splits its own calls); ``[]`` when neither."""
    if supports_context_parallel(type(transformer)):
        return [transformer]
    return [m for m in transformer.children() if supports_context_parallel(type(m))]


@contextlib.contextmanager
def cpu_accelerator_count() -> Iterator[None]:
    """Within the block, ``torch.accelerator.device_count()`` answers 1 when this machine has no accelerator (it
    answers 0, and diffusers computes ``rank % device_count()`` while enabling parallelism); the real function is
    back on exit, also after an error. A no-op where an accelerator exists."""
    real = torch.accelerator.device_count
    if real() > 0:
        yield
        return
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = real


def active_backend(transformer: torch.nn.Module) -> str:
    """The diffusers attention backend ``transformer``'s attention processors use (``"native"`` unless set)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    for module in transformer.modules():
        backend = getattr(getattr(module, "processor", None), "_attention_backend", None)
        if backend is not None:
            return str(getattr(backend, "value", backend))
    return str(_AttentionBackendRegistry.get_active_backend()[0].value)


def enable(transformer: torch.nn.Module, cm: ContextMesh, attention_backend: str | None = None) -> None:
    """Split ``transformer``'s sequence over ``cm``'s context group (diffusers' ``enable_parallelism`` with the
    ``(ring, ulysses)`` sub-mesh). Call after LoRA injection (the hooks sit on the modules the plan names; a module
    replaced afterwards would lose its hook) and once per model. ``attention_backend`` (a diffusers backend name)
    is set on the transformer first when given (``set_attention_backend``).

    Inputs and outputs keep their shapes: the planned inputs are split on the way in and the output is all-gathered,
    so every rank of the group returns the full result. Parameter gradients are per-rank partial sums
    (:func:`sum_context_gradients`).

    Raises:
        ValueError: the class has no ``_cp_plan``; Ulysses on a class it cannot split
            (:data:`~flowforge.runtime.cp_plans.ULYSSES_REFUSED`); ring degree > 1 with an attention backend that
            returns no log-sum-exp (the backend and :data:`LSE_BACKENDS` named); on CPU ``native`` is switched to
            :data:`~flowforge.runtime.cpu_ring_attention.BACKEND`, which returns it.
    """
    from diffusers import ContextParallelConfig

    modules = planned_modules(transformer)
    if not modules:
        raise ValueError(f"{type(transformer).__name__} declares no _cp_plan: diffusers cannot split its sequence; "
                         "set distributed.context_parallel.ulysses=1 and ring=1")
    problems = [p for p in (cp_plans.ulysses_problem(m, cm.ulysses) for m in modules) if p]
    if problems:
        raise ValueError(problems[0])
    for module in modules:
        if attention_backend is not None:
            _set_attention_backend(module, attention_backend)
        backend = active_backend(module)
        if cm.ring > 1 and backend not in LSE_BACKENDS:
            on_cpu = all(p.device.type == "cpu" for p in module.parameters())
            if not (on_cpu and backend in ("native", cpu_ring_attention.BACKEND)):
                raise ValueError(f"distributed.context_parallel.ring={cm.ring} needs an attention backend that "
                                 f"returns the log-sum-exp, one of {list(LSE_BACKENDS)} (CUDA; 'native' on CPU); "
                                 f"this model uses {backend!r}; use ulysses instead")
            _set_attention_backend(module, cpu_ring_attention.register())  # PyTorch's CPU flash kernel + its LSE
        config = ContextParallelConfig(ulysses_degree=cm.ulysses, ring_degree=cm.ring, mesh=cm.context_mesh)
        with cpu_accelerator_count():
            module.enable_parallelism(config=config, cp_plan=plan_of(module))


def _set_attention_backend(module: torch.nn.Module, name: str) -> None:
    """``module.set_attention_backend(name)`` for ``module``'s attention processors only: diffusers also makes
    ``name`` the process-wide default of every other model's processors (``set_active_backend``), which is put
    back."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    previous = _AttentionBackendRegistry._active_backend
    module.set_attention_backend(name)
    _AttentionBackendRegistry.set_active_backend(previous)


def sum_context_gradients(params: Iterable[torch.nn.Parameter], cm: ContextMesh) -> None:
    """Sum each parameter's ``.grad`` over ``cm``'s context group in place (parameters without a gradient are
    skipped): the full gradient of a loss computed identically on every rank of the group from the gathered
    output. For loops that reduce gradients themselves; under DDP / FSDP see :attr:`ContextMesh.gradient_scale`."""
    group = cm.context_group
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; the backward multiplies the incoming gradient by ``factor``."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def scale_gathered_gradients(transformer: torch.nn.Module, cm: ContextMesh) -> list:
    """Multiply the gradient entering each gathered output of ``transformer``'s plan (``proj_out`` in every
    supported family) by ``cm.degree``, so that a data-parallel wrapper that *averages* over all ranks (DDP's
    ``replicate``, FSDP2 over the flattened ``data x ring x ulysses`` mesh) yields the sum over the context group and
    the mean over the data dimension. Call after :func:`enable` (the hook must see the gathered output). Returns the
    hook handles (``.remove()`` undoes it). The loss and everything reported are unchanged."""
    handles = []

    def hook(module, args, output):
        if torch.is_tensor(output):
            return _ScaleGradient.apply(output, float(cm.degree))
        return type(output)(_ScaleGradient.apply(o, float(cm.degree)) if torch.is_tensor(o) else o for o in output)

    for planned in planned_modules(transformer):
        for module_id, plan in plan_of(planned).items():
            if not isinstance(plan, dict):  # a ContextParallelOutput (or a list of them): gathered here
                handles += [m.register_forward_hook(hook) for m in _planned_modules(planned, module_id)]
    return handles


def training_setup(settings, dist_info, device_type: str):
    """For the trainer: ``(data, context_mesh)`` under ``settings`` (``distributed.context_parallel``) -- ``data`` the
    :class:`~flowforge.runtime.distributed.DistInfo` over which samples are sharded and rewards gathered: this rank's
    place along the mesh's ``data`` dimension, with that dimension's process group (the ranks with this rank's place
    in their context groups; one process's view when there is one context group) -- and the mesh (None when off).

    Raises:
        ValueError: as :func:`build_mesh`.
    """
    from flowforge.runtime.distributed import DistInfo

    if settings.degree == 1:
        return dist_info, None
    cm = build_mesh(settings.ulysses, settings.ring, device_type)
    if cm.data_size == 1:
        return DistInfo(local_rank=dist_info.local_rank), cm
    return DistInfo(rank=cm.data_rank, world_size=cm.data_size, local_rank=dist_info.local_rank,
                    group=cm.mesh.get_group("data")), cm


def training_wrapper(adapter, cm: ContextMesh | None, attention_backend: str | None, wrap):
    """``wrap`` (the data-parallel wrapper the policy calls after LoRA injection) preceded, under context
    parallelism, by :func:`enable` and :func:`scale_gathered_gradients`: DDP / FSDP2 then average over every rank
    the gradients whose sum over the context group is the full gradient."""
    if cm is None:
        return wrap

    def wrapped():
        enable(adapter.transformer, cm, attention_backend)
        scale_gathered_gradients(adapter.transformer, cm)
        if wrap is not None:
            wrap()
    return wrapped


def split_sizes(transformer: torch.nn.Module, run: Callable[[], object]) -> list[tuple[str, int, int]]:
    """The sequence lengths ``transformer``'s ``_cp_plan`` would split, measured on one call of ``run`` (which
    calls the transformer, e.g. one velocity of the configured size) *before* :func:`enable`.

    Returns:
        ``(where, dim, size)`` per split tensor: ``where`` names the planned module and input (or output index).
    """
    from diffusers.models._modeling_parallel import ContextParallelInput

    found: list[tuple[str, int, int]] = []
    handles = []

    def record(where: str, value, spec) -> None:
        specs = spec if isinstance(spec, (list, tuple)) else [spec]
        values = value if isinstance(value, (list, tuple)) else [value]
        for i, (v, s) in enumerate(zip(values, specs)):
            if torch.is_tensor(v) and (s.expected_dims is None or v.dim() == s.expected_dims):
                found.append((where if len(specs) == 1 else f"{where}[{i}]", s.split_dim, int(v.shape[s.split_dim])))

    for planned, module_id, plan in [(m, k, v) for m in planned_modules(transformer) for k, v in plan_of(m).items()]:
        if not isinstance(plan, dict):
            continue  # an output gathered, not split
        modules = _planned_modules(planned, module_id)
        inputs = {k: v for k, v in plan.items() if isinstance(k, str)}
        outputs = {k: v for k, v in plan.items() if isinstance(k, int)}
        label = module_id or type(planned).__name__
        for m in modules:
            def pre(mod, args, kwargs, inputs=inputs, label=label):
                import inspect

                names = list(inspect.signature(type(mod).forward).parameters)[1:]
                bound = {**dict(zip(names, args)), **kwargs}
                for name, spec in inputs.items():
                    if bound.get(name) is not None:
                        record(f"{label} input {name!r}", bound[name], spec)

            def post(mod, args, output, outputs=outputs, label=label):
                out = output if isinstance(output, (list, tuple)) else [output]
                for index, spec in outputs.items():
                    if isinstance(spec, ContextParallelInput) and spec.split_output and index < len(out):
                        record(f"{label} output {index}", out[index], spec)

            handles += [m.register_forward_pre_hook(pre, with_kwargs=True), m.register_forward_hook(post)]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return found


def _planned_modules(transformer: torch.nn.Module, module_id: str) -> list[torch.nn.Module]:
    """The modules a ``_cp_plan`` key names (``""`` the model, ``"blocks.0"``, ``"blocks.*"``)."""
    if "*" not in module_id:
        return [transformer.get_submodule(module_id)] if module_id else [transformer]
    head, _, tail = module_id.partition("*")
    parent = transformer.get_submodule(head.rstrip("."))
    return [m.get_submodule(tail.lstrip(".")) if tail.strip(".") else m for m in parent]


def divisibility_problems(sizes: Iterable[tuple[str, int, int]], degree: int, context: str = "") -> list[str]:
    """One line per split length of :func:`split_sizes` that ``degree`` does not divide (diffusers splits into equal
    chunks), with ``context`` (e.g. the configured sizes) appended."""
    return [f"distributed.context_parallel: degree {degree} does not divide the {size} tokens of {where} (dim "
            f"{dim}){context}; choose sizes whose token counts are multiples of {degree}"
            for where, dim, size in sizes if size % degree]
