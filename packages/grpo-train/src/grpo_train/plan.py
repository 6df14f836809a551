"""The placement plan of a run, computed from its config alone: no model is loaded, no Ray started.

`make_plan(cfg)` lists every actor a run starts (policy ranks, the reference each rank holds,
generation engines incl. the async engine, value ranks, environment actors) with the node, the
bundle and the GPU share it gets, and estimates what each GPU holds:

    compute weights   params x bytes(policy.precision)
    fp32 masters      params x 4, only when the compute dtype is not float32 (mixed precision)
    gradients         params x 4 (fp32 gradient reduction)
    optimizer state   params x 8 (AdamW: two fp32 moments)
    reference         params x bytes(policy.precision), when loss_fn.reference_policy_kl_penalty > 0
    engine            policy.generation.vllm_cfg.gpu_memory_utilization x the GPU (vLLM takes this share
                      for its weights and KV cache; KV budget = that share - the engine's weights)

A GPU shared by a rank and its colocated engine holds them in turns (grpo_train.colocation): its
estimate is the largest of its phases (`COLOCATED_PHASES`: training = the trainer alone; refit = the
trainer's weights and masters beside the awake engine; generation = the engine alone), not their sum.
The trainer's parts are divided by the data-parallel ranks when FSDP2 shards them (dtensor_cfg.enabled
null or true on GPUs) and leave the GPU when dtensor_cfg.cpu_offload is true. Activations and the
CUDA context are not estimated: a plan that fits with under 10% to spare says so.
The model's size comes from its config.json (a local folder, a `builtin:` model, the local Hugging
Face cache, or the table of known architectures in grpo_train/assets/model_configs), or from the
tensor shapes in its safetensors headers when present. No torch import.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from grpo_train.assets import builtin_model_path
from grpo_train.config.schema import GRPOMasterConfig
from grpo_train.errors import PlanError  # re-exported: its old home

GB = 1e9
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KNOWN_CONFIGS = Path(__file__).parent / "assets" / "model_configs"
HEADROOM = 0.10


# ------------------------------------------------------------------------------ model size
def params_from_config(c: dict) -> int:
    """Parameters of a decoder-only transformer (Llama/Qwen2/Qwen3/Mistral layout, dense or MoE) from its config.json."""
    h, layers, vocab, inter = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["intermediate_size"]
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or h // heads
    kv = c.get("num_key_value_heads") or heads
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2
    if c.get("attention_bias", c.get("model_type") == "qwen2"):  # Qwen2 has q/k/v biases
        attn += heads * head_dim + 2 * kv * head_dim
    if c.get("model_type") in QK_NORM_TYPES:  # per-head RMSNorm on q and k
        attn += 2 * head_dim
    mlp = sum(_mlp_params(c, i, h, inter) for i in range(layers))
    embed = vocab * h
    head = 0 if c.get("tie_word_embeddings", False) else vocab * h
    return embed + layers * (attn + 2 * h) + mlp + h + head


QK_NORM_TYPES = ("qwen3", "qwen3_moe")


def _mlp_params(c: dict, layer: int, h: int, inter: int) -> int:
    """One layer's MLP: dense gate/up/down, or (MoE layers) a router plus every expert, all of
    which stay resident in memory (Qwen2/3-MoE `num_experts`, Mixtral `num_local_experts`)."""
    experts = c.get("num_experts") or c.get("num_local_experts") or 0
    step = c.get("decoder_sparse_step") or 1
    if not experts or layer in (c.get("mlp_only_layers") or ()) or (layer + 1) % step:
        return 3 * h * inter
    moe_inter = c.get("moe_intermediate_size") or inter
    shared = c.get("shared_expert_intermediate_size") or 0
    return h * experts + experts * 3 * h * moe_inter + (3 * h * shared + h if shared else 0)


def params_from_safetensors(folder: Path) -> int | None:
    """Sum of tensor sizes in the folder's safetensors headers (the header only is read)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                n = 1
                for dim in entry["shape"]:
                    n *= dim
                total += n
    return total


@dataclass(frozen=True)
class ModelSize:
    params: int
    source: str
    """Where the size came from (config.json path, safetensors headers, or the known-architectures table)."""
    config: dict | None = None
    """The model's config.json when one was found (heads and vocabulary for the tensor-parallel checks)."""


def _config_json(name: str) -> tuple[Path | None, Path | None]:
    """(model folder or None, config.json or None) for `name`, without downloading anything."""
    if name.startswith("builtin:"):
        folder = builtin_model_path(name.removeprefix("builtin:"))
        return folder, folder / "config.json"
    path = Path(name).expanduser()
    if path.is_dir():
        return path, path / "config.json" if (path / "config.json").is_file() else None
    try:
        # huggingface_hub: only for a hub model name; `grpo plan` stays light otherwise
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "config.json")
        if isinstance(cached, str):
            return Path(cached).parent, Path(cached)
    except Exception:  # noqa: BLE001 - not a hub name: fall through to the table
        pass
    known = KNOWN_CONFIGS / f"{name.replace('/', '--')}.json"
    return None, known if known.is_file() else None


def model_size(name: str, key: str) -> ModelSize:
    try:
        folder, config = _config_json(name)
    except ValueError as exc:
        raise PlanError(f"{key}: {exc}") from None
    config_dict = json.loads(config.read_text()) if config is not None and config.is_file() else None
    if folder is not None and (n := params_from_safetensors(folder)):
        return ModelSize(n, f"safetensors headers in {folder}", config_dict)
    if config is None or config_dict is None:
        known = ", ".join(p.stem.replace("--", "/") for p in sorted(KNOWN_CONFIGS.glob("*.json")))
        raise PlanError(
            f"{key}: cannot size {name!r} without loading it: no local folder, no config.json in the "
            f"Hugging Face cache, not a known architecture ({known}); set {key} to a local folder"
        )
    return ModelSize(params_from_config(config_dict), str(config), config_dict)


# ------------------------------------------------------------------- tensor-parallel sizes
def _config_value(config, key: str):
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def tp_size_problem(config, tp_size: int) -> str | None:
    """Why the policy's `tp_size` cannot split this model (heads, KV heads, vocabulary), or None.
    `config`: an HF config object or its config.json dict."""
    heads = _config_value(config, "num_attention_heads")
    counts = {
        "num_attention_heads": heads,
        "num_key_value_heads": _config_value(config, "num_key_value_heads") or heads,
        "vocab_size": _config_value(config, "vocab_size"),
    }
    bad = {name: n for name, n in counts.items() if n is not None and n % tp_size}
    if not bad:
        return None
    return (
        f"{tp_size} does not divide the model's "
        + ", ".join(f"{k}={v}" for k, v in bad.items())
        + " (each tensor-parallel rank holds whole heads and an equal vocabulary slice)"
    )


def engine_tp_problem(config: dict, tp: int) -> str | None:
    """Why vLLM cannot split this model (config.json dict) over `tp` ranks: it needs tp to divide the
    heads, and to divide or be a multiple of the KV heads (it replicates KV heads then)."""
    text = config.get("text_config") or config
    heads = text.get("num_attention_heads")
    if heads is None:
        return None
    kv = text.get("num_key_value_heads") or heads
    if heads % tp or (kv % tp and tp % kv):
        return (
            f"{tp} does not fit the model's num_attention_heads={heads}, num_key_value_heads={kv} (vLLM needs it "
            f"to divide the heads, and to divide or be a multiple of the KV heads)"
        )
    return None


def _where(nodes: Sequence[int]) -> str:
    nodes = sorted(set(nodes))
    if not nodes:
        return "CPU ranks"
    return f"node {nodes[0]}" if len(nodes) == 1 else "nodes " + ", ".join(map(str, nodes))


@dataclass(frozen=True)
class ParallelLayout:
    """The policy ranks' process groups: rank = (dp_rank * cp + cp_rank) * tp + tp_rank (tp innermost,
    so a tensor-parallel group's ranks are neighbours, on one node when tp divides cluster.gpus_per_node)."""

    tp: int
    cp: int
    nodes: tuple[int | None, ...]  # the node of each policy rank (None: CPU ranks, no placement group)

    @property
    def dp(self) -> int:
        return len(self.nodes) // (self.tp * self.cp)

    def _rank(self, d: int, c: int, t: int) -> int:
        return (d * self.cp + c) * self.tp + t

    def tp_groups(self) -> list[list[int]]:
        return [[self._rank(d, c, t) for t in range(self.tp)] for d in range(self.dp) for c in range(self.cp)]

    def cp_groups(self) -> list[list[int]]:
        return [[self._rank(d, c, t) for c in range(self.cp)] for d in range(self.dp) for t in range(self.tp)]

    def dp_groups(self) -> list[list[int]]:
        return [[self._rank(d, c, t) for d in range(self.dp)] for c in range(self.cp) for t in range(self.tp)]

    def nodes_of(self, ranks: Sequence[int]) -> list[int]:
        return sorted({node for r in ranks if (node := self.nodes[r]) is not None})

    def lines(self) -> list[str]:
        """One line per group, each starting with the node(s) it sits on; TP groups first."""
        kinds = [("tp", self.tp_groups())] + ([("cp", self.cp_groups())] if self.cp > 1 else [])
        kinds.append(("dp", self.dp_groups()))
        out = []
        for kind, groups in kinds:
            for i, ranks in enumerate(groups):
                out.append(f"{_where(self.nodes_of(ranks))}: {kind} group {i} = ranks {ranks}")
        return out

    def header(self) -> str:
        sizes = f"dp {self.dp}" + (f" x cp {self.cp}" if self.cp > 1 else "") + f" x tp {self.tp}"
        order = (
            f"(dp_rank * {self.cp} + cp_rank) * {self.tp} + tp_rank"
            if self.cp > 1
            else f"dp_rank * {self.tp} + tp_rank"
        )
        return f"policy process groups: {sizes} (rank = {order})"


# ---------------------------------------------------------------------------------- plan
@dataclass
class Actor:
    name: str
    node: int | None  # None: wherever Ray puts it (CPU actors without a placement group)
    bundle: str
    gpu: float  # GPU share
    device: int | None = None  # global GPU index (node * gpus_per_node + local)


# What a colocated GPU holds in each phase of colocation.MemoryChoreography (part names as below;
# the refit phase keeps the trainer's weights for the push, the rest is offloaded or freed).
_ENGINE_PARTS = ("engine weights", "engine KV cache")
COLOCATED_PHASES = {
    "training": (
        "compute weights",
        "compute weights (gathered per layer)",
        "fp32 masters",
        "gradients",
        "optimizer",
        "reference",
    ),
    "refit": ("compute weights", "compute weights (gathered per layer)", "fp32 masters", *_ENGINE_PARTS),
    "generation": _ENGINE_PARTS,
}


@dataclass
class GpuLoad:
    index: int
    node: int
    parts: dict[str, float] = field(default_factory=dict)  # name -> GB
    role: str = "policy"
    phases: dict[str, tuple[str, ...]] | None = None  # colocated: the parts resident in each phase

    def phase_totals(self) -> dict[str, float]:
        if self.phases is None:
            return {"all": sum(self.parts.values())}
        return {name: sum(v for k, v in self.parts.items() if k in held) for name, held in self.phases.items()}

    @property
    def peak_phase(self) -> str:
        totals = self.phase_totals()
        return max(totals, key=lambda name: totals[name])

    @property
    def total(self) -> float:
        """The most this GPU holds at once (the largest phase of a colocated GPU)."""
        return max(self.phase_totals().values())


@dataclass
class Plan:
    actors: list[Actor]
    gpus: list[GpuLoad]
    gpu_memory_gb: float | None
    model: ModelSize
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    layout: ParallelLayout | None = None  # the policy's process groups when tensor (or context) parallel
    engine_groups: list[tuple[int, list[int], list[int]]] = field(
        default_factory=list
    )  # (engine, nodes, GPUs): TP engines

    def render(self) -> str:
        lines = [f"model: {self.model.params / 1e9:.3f} B parameters ({self.model.source})", "actors:"]
        for a in self.actors:
            where = "any node" if a.node is None else f"node {a.node}"
            gpu = f"GPU {a.device} x {a.gpu:g}" if a.device is not None else "no GPU"
            lines.append(f"  {a.name:<28} {where:<9} bundle {a.bundle:<26} {gpu}")
        if self.layout is not None:
            lines.append(self.layout.header())
            lines += [f"  {line}" for line in self.layout.lines()]
        if self.engine_groups:
            lines.append("engine tensor-parallel groups:")
            lines += [f"  {_where(nodes)}: engine {e} = GPUs {devs}" for e, nodes, devs in self.engine_groups]
        if self.gpus:
            cap = f" of {self.gpu_memory_gb:g} GB" if self.gpu_memory_gb else ""
            lines.append(f"memory per GPU (GB{cap}; activations and CUDA context not included):")
            for g in self.gpus:
                parts = ", ".join(f"{k} {v:.1f}" for k, v in g.parts.items()) or "idle"
                if g.phases is None:
                    lines.append(f"  GPU {g.index} (node {g.node}): {g.total:.1f} = {parts}")
                else:
                    phases = ", ".join(f"{k} {v:.1f}" for k, v in g.phase_totals().items())
                    lines.append(
                        f"  GPU {g.index} (node {g.node}): peak {g.total:.1f} ({g.peak_phase}) of phases "
                        f"{phases}; parts {parts}"
                    )
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"does not fit: {p}" for p in self.problems]
        if not self.problems and self.gpus:
            lines.append("fits")
        return "\n".join(lines)


def _placed(count: int, start: int, gpus_per_node: int) -> list[tuple[int, int]]:
    """(node, global GPU index) of `count` one-GPU bundles packed node by node from GPU `start`."""
    return [((start + i) // gpus_per_node, start + i) for i in range(count)]


def make_plan(cfg: GRPOMasterConfig, gpu_memory_gb: float | None = None, model_path: str | None = None) -> Plan:
    """The plan; `gpu_memory_gb` (default cluster.gpu_memory_gb) is each GPU's memory, None: no memory
    check. `model_path`: the resolved local model folder when the caller has one."""
    policy, gen, cluster = cfg.policy, cfg.policy.generation, cfg.cluster
    gpu_memory_gb = gpu_memory_gb if gpu_memory_gb is not None else cluster.gpu_memory_gb
    model = model_size(model_path or policy.model_name, "policy.model_name")
    g = cluster.gpus_per_node
    actors: list[Actor] = []
    gpus = [GpuLoad(i, i // g) for i in range(g * cluster.num_nodes)] if g else []
    P = model.params
    b = DTYPE_BYTES[policy.precision]
    workers = policy.num_workers
    tp_size = policy.dtensor_cfg.tensor_parallel_size  # ranks dp_rank * tp + tp_rank; TP shards every rank's model
    cp_size = policy.dtensor_cfg.context_parallel_size  # never with TP: ranks dp_rank * cp + cp_rank, full weights
    dp = workers // (tp_size * cp_size)
    sharded = bool(g) and policy.dtensor_cfg.enabled is not False and dp > 1
    div = (dp if sharded else 1) * tp_size
    kl = cfg.loss_fn.reference_policy_kl_penalty > 0
    next_gpu = 0

    # policy ranks (and the reference each holds)
    ranks = _placed(workers, 0, g) if g else [(None, None)] * workers
    next_gpu += workers if g else 0
    for r, (node, dev) in enumerate(ranks):
        bundle = f"policy[{r}] {{GPU:1,CPU:1}}" if g else f"policy[{r}] {{CPU:1}}"
        name = f"policy rank {r}" + (f" (dp {r // tp_size}, tp {r % tp_size})" if tp_size > 1 else "")
        name += f" (dp {r // cp_size}, cp {r % cp_size})" if cp_size > 1 else ""
        actors.append(Actor(name, node, bundle, 1.0 if g else 0.0, dev))
        if kl:
            actors.append(Actor(f"  reference (in rank {r})", node, bundle, 0.0, dev))
        if g:
            _trainer_memory(gpus[dev], P, b, div, kl, policy.dtensor_cfg.cpu_offload)

    # generation engines
    vllm = gen.vllm_cfg
    engine_weights = P * DTYPE_BYTES.get(vllm.precision, 4) / GB if gen.backend == "vllm" else P * b / GB
    tp = vllm.tensor_parallel_size if gen.backend == "vllm" else 1
    res = gen.colocated.resources
    separate = (res.gpus_per_node or 0) * (res.num_nodes or 1)
    engine_groups: list[tuple[list[int], list[int]]] = []  # (nodes, GPUs) of each TP engine
    if not g:
        name = "async engine" if cfg.grpo.async_grpo.enabled else "engine 0"
        # vLLM's CPU build runs a TP engine as one worker process per shard beside the actor's engine core
        actors.append(Actor(name, None, "{CPU:1}" if tp == 1 else f"{{CPU:1}} + {tp} TP worker processes", 0.0))
    elif gen.colocated.enabled:
        for r, (node, dev) in enumerate(ranks):
            actors.append(Actor(f"engine {r} (colocated)", node, f"policy[{r}] (shared)", 0.5, dev))
            _engine_memory(gpus[dev], gen.backend, vllm.gpu_memory_utilization, engine_weights, 1, gpu_memory_gb)
            gpus[dev].phases = COLOCATED_PHASES
    else:
        engines = separate // tp if separate else 0
        label = "async engine" if cfg.grpo.async_grpo.enabled else "engine"
        for e in range(engines):
            devs = _placed(tp, next_gpu + e * tp, g)
            for _node, dev in devs:
                _engine_memory(
                    gpus[dev] if dev < len(gpus) else None,
                    gen.backend,
                    vllm.gpu_memory_utilization,
                    engine_weights,
                    tp,
                    gpu_memory_gb,
                )
            engine_groups.append((sorted({node for node, _ in devs}), [dev for _, dev in devs]))
            actors.append(
                Actor(
                    f"{label} {e}" if engines > 1 else label,
                    devs[0][0],
                    f"generation[{e}] {{GPU:{tp},CPU:1}}",
                    float(tp),
                    devs[0][1],
                )
            )
        next_gpu += engines * tp

    # value ranks (PPO)
    if cfg.value is not None:
        vb = DTYPE_BYTES[cfg.value.precision]
        for r in range(cfg.value.num_workers):
            node, dev = ((next_gpu + r) // g, next_gpu + r) if g else (None, None)
            actors.append(
                Actor(
                    f"value rank {r}",
                    node,
                    f"value[{r}] {{GPU:1,CPU:1}}" if g else f"value[{r}] {{CPU:1}}",
                    1.0 if g else 0.0,
                    dev,
                )
            )
            if g and dev < len(gpus):
                gpus[dev].role = "value"
                _trainer_memory(gpus[dev], P, vb, 1, False, False)  # value ranks hold full replicas
        next_gpu += cfg.value.num_workers if g else 0

    # environments
    for name, env in cfg.env.items():
        want = env.resources or {}
        env_gpus = float(want.get("GPU", 0))
        for w in range(env.num_workers):
            dev = None
            if env_gpus and g:
                dev = next_gpu
                next_gpu += 1
            actors.append(
                Actor(
                    f"env {name} [{w}]",
                    None if dev is None else dev // g,
                    "{" + ",".join(f"{k}:{v:g}" for k, v in {"CPU": want.get("CPU", 1), **want}.items()) + "}",
                    env_gpus,
                    dev,
                )
            )

    plan = Plan(actors, gpus, gpu_memory_gb if g else None, model)
    plan.layout = _policy_layout(cfg, [node for node, _ in ranks])
    plan.engine_groups = [(e, nodes, devs) for e, (nodes, devs) in enumerate(engine_groups) if len(devs) > 1]
    _check_tensor_parallel(cfg, plan, g)
    _check(cfg, plan, next_gpu)
    return plan


def _policy_layout(cfg: GRPOMasterConfig, nodes: list[int | None]) -> ParallelLayout | None:
    """The policy's process groups, when it is tensor (or context) parallel."""
    dtensor = cfg.policy.dtensor_cfg
    if dtensor.tensor_parallel_size == 1 and dtensor.context_parallel_size == 1:
        return None
    return ParallelLayout(dtensor.tensor_parallel_size, dtensor.context_parallel_size, tuple(nodes))


def _check_tensor_parallel(cfg: GRPOMasterConfig, plan: Plan, gpus_per_node: int) -> None:
    """TP sizes the model or the nodes cannot take, at their keys: the policy's must divide the heads,
    KV heads and vocabulary, and cluster.gpus_per_node (a TP group's all-reduces stay inside a node);
    the engine's must fit vLLM's head split (heads checked when the model's config.json was read) and
    one node (an engine is one {GPU: tp} bundle)."""
    tp_size = cfg.policy.dtensor_cfg.tensor_parallel_size
    config = plan.model.config
    if tp_size > 1 and config is not None and (problem := tp_size_problem(config, tp_size)):
        plan.problems.append(f"policy.dtensor_cfg.tensor_parallel_size: {problem}")
    if tp_size > 1 and gpus_per_node and gpus_per_node % tp_size:
        plan.problems.append(
            f"policy.dtensor_cfg.tensor_parallel_size ({tp_size}) must divide cluster.gpus_per_node "
            f"({gpus_per_node}): a tensor-parallel group's ranks stay on one node"
        )
    cp_size = cfg.policy.dtensor_cfg.context_parallel_size
    if cp_size > 1 and gpus_per_node and gpus_per_node % cp_size:
        plan.problems.append(
            f"policy.dtensor_cfg.context_parallel_size ({cp_size}) must divide cluster.gpus_per_node "
            f"({gpus_per_node}): a context-parallel ring's ranks stay on one node"
        )
    gen = cfg.policy.generation
    engine_tp = gen.vllm_cfg.tensor_parallel_size if gen.backend == "vllm" else 1
    if engine_tp > 1 and config is not None and (problem := engine_tp_problem(config, engine_tp)):
        plan.problems.append(f"policy.generation.vllm_cfg.tensor_parallel_size: {problem}")
    if engine_tp > gpus_per_node > 0 and not gen.colocated.enabled:
        plan.problems.append(
            f"policy.generation.vllm_cfg.tensor_parallel_size ({engine_tp}): the engine needs "
            f"{engine_tp} GPUs in one bundle, more than a node's cluster.gpus_per_node ({gpus_per_node})"
        )


def _trainer_memory(load: GpuLoad, P: int, b: int, div: int, reference: bool, offload: bool) -> None:
    if offload:  # FSDP2 keeps parameters, gradients and optimizer state on the host between uses
        load.parts["compute weights (gathered per layer)"] = 0.0
        return
    load.parts["compute weights"] = load.parts.get("compute weights", 0) + P * b / div / GB
    if b != 4:
        load.parts["fp32 masters"] = load.parts.get("fp32 masters", 0) + P * 4 / div / GB
    load.parts["gradients"] = load.parts.get("gradients", 0) + P * 4 / div / GB
    load.parts["optimizer"] = load.parts.get("optimizer", 0) + P * 8 / div / GB
    if reference:
        load.parts["reference"] = P * b / div / GB


def _engine_memory(
    load: GpuLoad | None, backend: str, util: float, weights_gb: float, tp: int, gpu_memory_gb: float | None
) -> None:
    if load is None or not gpu_memory_gb:
        return
    if backend == "vllm":
        share = util * gpu_memory_gb
        load.parts["engine weights"] = weights_gb / tp
        load.parts["engine KV cache"] = share - weights_gb / tp
    else:
        load.parts["engine weights"] = weights_gb


def _check(cfg: GRPOMasterConfig, plan: Plan, gpus_wanted: int) -> None:
    g, have = cfg.cluster.gpus_per_node, cfg.cluster.gpus_per_node * cfg.cluster.num_nodes
    if not g:
        plan.notes.append(
            "CPU cluster: no GPU memory to check (engines use policy.generation.vllm_cfg.kv_cache_space_gb "
            "of host memory)"
        )
        return
    if gpus_wanted > have:
        plan.problems.append(
            f"the actors want {gpus_wanted} GPUs but cluster.gpus_per_node * cluster.num_nodes = {have}; "
            f"lower policy.num_workers, value.num_workers, policy.generation.colocated.resources or "
            f"env.<name>.resources, or raise cluster.gpus_per_node / cluster.num_nodes"
        )
    if not plan.gpu_memory_gb:
        plan.notes.append("GPU memory not checked: set cluster.gpu_memory_gb (or `grpo plan --gpu-memory-gb`)")
        return
    util = cfg.policy.generation.vllm_cfg.gpu_memory_utilization
    for load in plan.gpus:
        kv = load.parts.get("engine KV cache")
        if kv is not None and kv <= 0:
            plan.problems.append(
                f"GPU {load.index}: policy.generation.vllm_cfg.gpu_memory_utilization={util:g} "
                f"({util * plan.gpu_memory_gb:.1f} GB) leaves no KV cache beside the engine's weights "
                f"({load.parts['engine weights']:.1f} GB); raise it"
            )
        if load.total > plan.gpu_memory_gb and load.role == "value":
            plan.problems.append(
                f"GPU {load.index} (value rank) needs {load.total:.1f} GB of {plan.gpu_memory_gb:g} GB; "
                f"change value.num_workers (more ranks shard the value model's state) or value.precision"
            )
        elif load.total > plan.gpu_memory_gb:
            engine = load.parts.get("engine weights", 0) + max(kv or 0, 0)
            trainer = sum(load.parts.values()) - engine
            held = (
                f"in its {load.peak_phase} phase (trainer {trainer:.1f} and engine {engine:.1f} held in turns)"
                if load.phases
                else f"(trainer {trainer:.1f} + engine {engine:.1f})"
            )
            plan.problems.append(
                f"GPU {load.index} needs {load.total:.1f} GB {held} of {plan.gpu_memory_gb:g} GB; change policy.num_workers (FSDP2 shards "
                f"the trainer's state over ranks), policy.dtensor_cfg.cpu_offload: true, "
                f"policy.generation.vllm_cfg.gpu_memory_utilization, loss_fn.reference_policy_kl_penalty: 0 (no "
                f"reference) or policy.generation.colocated.enabled: false"
            )
        elif load.total > (1 - HEADROOM) * plan.gpu_memory_gb:
            plan.notes.append(
                f"GPU {load.index}: {load.total:.1f} of {plan.gpu_memory_gb:g} GB leaves under "
                f"{HEADROOM:.0%} for activations and the CUDA context"
            )
