"""Build the parts of a run from its config: model path, tokenizer, data, envs, actors.

Each part receives its own config section. Startup problems a person must fix (a model that
is neither local nor downloadable, a missing data file) raise `StartupError` with one line.
"""

from __future__ import annotations

import fcntl
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_train.assets import builtin_model_path
from grpo_train.config.checks import env_import_paths
from grpo_train.config.schema import ClusterConfig, GRPOMasterConfig
from grpo_train.errors import StartupError  # re-exported: its old home
from grpo_train.generation.actor import generator_factories
from grpo_train.generation.async_vllm import make_async_generation_actor
from grpo_train.plan import PlanError, make_plan

if TYPE_CHECKING:  # the groups import torch and Ray; setup stays importable without them
    from grpo_train.generation.group import GeneratorGroup
    from grpo_train.policy.group import PolicyGroup

BUILTIN_PREFIX = "builtin:"
REWARD_FN_ENV = "grpo_envs.reward_fn:RewardFnEnv"  # what `env.<name>.reward_fn` runs


def resolve_model_path(name: str, key: str = "policy.model_name") -> str:
    """A local folder for `name`: bundled (`builtin:NAME`), a local path, or an HF hub cache hit."""
    if name.startswith(BUILTIN_PREFIX):
        try:
            return str(builtin_model_path(name[len(BUILTIN_PREFIX) :]))
        except ValueError as exc:
            raise StartupError(f"{key}: {exc}") from None
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise StartupError(f"{key}: {path} has no config.json; point it at a Hugging Face model folder")
        return str(path.resolve())
    if path.is_absolute() or name.startswith((".", "~")):
        raise StartupError(f"{key}: local model folder {name!r} does not exist")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
    except Exception as exc:  # offline, unknown repo, auth: all end the same way for the user
        reason = type(exc).__name__
        raise StartupError(
            f"{key}: cannot load {name!r} ({reason}: no network or not in the local Hugging Face cache); "
            f"download it elsewhere and set {key}=/path/to/local/copy"
        ) from None


def check_supported(cfg: GRPOMasterConfig) -> list[str]:
    """Refuse settings this version validates but cannot run yet; return warnings for the rest.

    Refused: what would change the algorithm or the resources silently. Warned: settings that run
    but may stop a run later (a micro-batch token budget below the longest allowed sequence).
    """
    gen = cfg.policy.generation
    if gen.weight_transport == "ipc" and (cfg.cluster.gpus_per_node == 0 or not gen.colocated.enabled):
        raise StartupError(
            "policy.generation.weight_transport: 'ipc' needs GPUs shared with the trainer "
            "(colocated on GPUs); use 'collective' or 'object_store'"
        )
    res = gen.colocated.resources
    if (res.gpus_per_node or res.num_nodes) and (gen.colocated.enabled or cfg.cluster.gpus_per_node == 0):
        raise StartupError(
            "policy.generation.colocated.resources: GPUs of generation's own apply only with "
            "policy.generation.colocated.enabled: false on GPUs (cluster.gpus_per_node > 0); set them to null"
        )
    warnings = []
    policy = cfg.policy
    for name in ("sequence_packing", "dynamic_batching"):
        section = getattr(policy, name)
        for field in ("train_mb_tokens", "logprob_mb_tokens"):
            budget = getattr(section, field)
            if section.enabled and budget < policy.max_total_sequence_length:
                warnings.append(
                    f"policy.{name}.{field}={budget} is below policy.max_total_sequence_length="
                    f"{policy.max_total_sequence_length}: a longer sequence will stop training with an error"
                )
    return warnings


def check_plan(cfg: GRPOMasterConfig, model_path: str):
    """The placement plan (grpo_train.plan) of the run, or a StartupError naming the keys to change."""
    try:
        plan = make_plan(cfg, model_path=model_path)
    except PlanError as exc:
        raise StartupError(str(exc)) from None
    if plan.problems:
        raise StartupError(f"placement plan (see `grpo plan`): {plan.problems[0]}")
    return plan


def check_engine_tensor_parallel(cfg: GRPOMasterConfig, model_path: str) -> None:
    """vLLM splits attention heads over its TP ranks (KV heads too, or replicates them when there are
    fewer KV heads than ranks): a size that does not fit the model is refused here, not by the engine
    after the actors start."""
    tp = cfg.policy.generation.vllm_cfg.tensor_parallel_size
    if cfg.policy.generation.backend != "vllm" or tp == 1:
        return
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(model_path).get_text_config()
    heads = int(text.num_attention_heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    if heads % tp or (kv % tp and tp % kv):
        raise StartupError(
            f"policy.generation.vllm_cfg.tensor_parallel_size: {tp} does not fit the model's "
            f"num_attention_heads={heads}, num_key_value_heads={kv} (vLLM needs it to divide the heads, "
            f"and to divide or be a multiple of the KV heads)"
        )


def check_model_options(cfg: GRPOMasterConfig, model_path: str) -> None:
    """Refuse options the model cannot honour, at their key path, before any actor starts."""
    if cfg.policy.moe_aux_loss_coeff > 0:
        from transformers import AutoConfig

        from grpo_train.policy.moe_aux import NotMoEError, check_moe_config  # torch: only for MoE runs

        try:
            check_moe_config(AutoConfig.from_pretrained(model_path))
        except NotMoEError as exc:
            raise StartupError(f"policy.moe_aux_loss_coeff: {exc}") from None
    check_engine_tensor_parallel(cfg, model_path)
    if (tp := cfg.policy.dtensor_cfg.tensor_parallel_size) > 1:
        from transformers import AutoConfig

        # torch: only for TP runs
        from grpo_train.policy.fsdp import uses_fsdp
        from grpo_train.policy.tensor_parallel import tp_size_problem  # torch: only for TP runs

        if (problem := tp_size_problem(AutoConfig.from_pretrained(model_path), tp)) is not None:
            raise StartupError(f"policy.dtensor_cfg.tensor_parallel_size: {problem}")
        dp = cfg.policy.num_workers // tp
        if cfg.policy.precision != "float32" and not uses_fsdp(
            cfg.policy.dtensor_cfg, cfg.cluster.gpus_per_node > 0, dp
        ):
            raise StartupError(
                f"policy.precision: {cfg.policy.precision} with policy.dtensor_cfg.tensor_parallel_size {tp} keeps its "
                f"fp32 masters in FSDP2's mixed precision, and this run has no FSDP2 (policy.dtensor_cfg.enabled "
                f"{cfg.policy.dtensor_cfg.enabled}, {dp} data-parallel rank(s), "
                f"{'GPUs' if cfg.cluster.gpus_per_node else 'CPU ranks'}); set float32 or policy.dtensor_cfg.enabled "
                f"true with more than one data-parallel rank"
            )
    if cfg.policy.dtensor_cfg.context_parallel_size > 1:
        from transformers import AutoConfig

        from grpo_train.policy.context_parallel import cp_model_problem  # torch: only for CP runs

        if (problem := cp_model_problem(AutoConfig.from_pretrained(model_path))) is not None:
            raise StartupError(f"policy.dtensor_cfg.context_parallel_size: {problem}")
    if cfg.policy.dtensor_cfg.lora_cfg.enabled:
        from grpo_train.policy.lora import LoRAConfigError, check_lora_for_model_path  # torch: only for LoRA runs

        try:
            check_lora_for_model_path(model_path, cfg.policy.dtensor_cfg.lora_cfg)
        except LoRAConfigError as exc:
            raise StartupError(str(exc)) from None
    if cfg.value is not None and cfg.value.lora_cfg.enabled:
        from grpo_train.policy.lora import LoRAConfigError, check_lora_for_model_path  # torch: only for LoRA runs

        value_path = (
            resolve_model_path(cfg.value.model_name, "value.model_name") if cfg.value.model_name else model_path
        )
        try:
            check_lora_for_model_path(value_path, cfg.value.lora_cfg, key="value.lora_cfg", backbone=True)
        except LoRAConfigError as exc:
            raise StartupError(str(exc)) from None


# Ray 2.60's raylet gives its dashboard agent and runtime-env agent a fixed 15 s (not a config
# key) to write their port files, and aborts otherwise; `ray.init` then fails 30 s later with
# "The current node timed out during startup". Each agent is a Python process importing Ray's
# dashboard, so two local heads started in the same second on a small loaded machine (two runs,
# two users, a test starting a run beside another) can miss it. Local head start-ups of grpo
# processes on one node therefore take turns under a node-wide lock, and a head that still
# fails to start (load from outside grpo) is started once more.
RAY_START_LOCK = Path(tempfile.gettempdir()) / "grpo-ray-head-start.lock"
RAY_START_LOCK_WAIT_S = 300.0  # a holder is inside ray.init, which gives up after about 45 s
RAY_START_ATTEMPTS = 2


@contextmanager
def node_start_lock(path: Path | None = None, wait_s: float = RAY_START_LOCK_WAIT_S):
    """Hold the node-wide lock on local Ray head start-ups (flock: released when the holder
    exits, even by SIGKILL). Opened read-only so another user's lock file serves as well; past
    `wait_s` the start goes ahead unlocked with a warning rather than hang a run."""
    path = path or RAY_START_LOCK
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        deadline = time.monotonic() + wait_s
        locked = False
        while not locked:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    print(f"warning: {path} held for over {wait_s:g} s; starting Ray without it", file=sys.stderr)
                    break
                time.sleep(0.2)
        yield locked
    finally:
        os.close(fd)  # releases the flock


def init_ray(cluster_cfg, env_vars: dict[str, str]) -> None:
    import ray

    if ray.is_initialized():
        return
    address = cluster_cfg.address or os.environ.get("RAY_ADDRESS")
    # Actor output (vLLM banners, HF progress bars) stays in Ray's log files unless asked for;
    # errors still reach the driver as exceptions.
    to_driver = os.environ.get("GRPO_ACTOR_LOGS", "0") == "1"
    kwargs: dict[str, Any] = {
        "include_dashboard": False,
        "log_to_driver": to_driver,
        "configure_logging": False,
        "runtime_env": {"env_vars": env_vars},
    }
    if address:
        ray.init(address=address, **kwargs)
        return
    # Logical CPUs: generation, training and environments take turns on the same cores.
    cpus = cluster_cfg.num_cpus or max(os.cpu_count() or 1, 4)
    start_local_head(lambda: ray.init(num_cpus=cpus, **kwargs), ray.shutdown)


def start_local_head(start, shutdown, attempts: int = RAY_START_ATTEMPTS, lock_path: Path | None = None) -> None:
    """`start()` a local Ray head under `node_start_lock`; a failed start is shut down and, up
    to `attempts` in all, started again (one line on stderr says why)."""
    for attempt in range(1, attempts + 1):
        try:
            with node_start_lock(lock_path):
                start()
            return
        except Exception as exc:
            shutdown()
            if attempt == attempts:
                raise
            print(
                f"warning: Ray's local head did not start ({str(exc).splitlines()[0][:200]}); "
                f"starting it again (attempt {attempt + 1} of {attempts})",
                file=sys.stderr,
            )


def ranks_per_node(cluster: ClusterConfig, num_workers: int) -> int:
    """Data-parallel ranks of one group that land on the same node, as `policy.group.worker_bundles`
    places them: on GPUs the ranks pack a node's GPUs first; on CPU they spread over the nodes."""
    if cluster.gpus_per_node > 0:
        return max(1, min(num_workers, cluster.gpus_per_node))
    return max(1, -(-num_workers // cluster.num_nodes))


def threads_per_actor(ranks_on_node: int = 1) -> int:
    """Torch threads per actor: the node's cores divided among the data-parallel ranks that share
    it (their forwards and backwards run at the same time). Generation, training and environments
    take turns, so the active phase of a sync step gets the whole machine; `actor_env_vars` makes
    idle OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE) instead of spinning, the spinning that once
    made a tiny model's forward 17x slower with more threads than half the cores. Measured on the
    2-core demo (benchmarks/results/perf_profile_cpu.md): 2 threads + passive waiting beat 1 thread.
    Derived from the machine and the config alone, so a resumed run on the same machine has the
    same count (and bitwise the same float reductions)."""
    return max(1, (os.cpu_count() or 1) // max(1, ranks_on_node))


def actor_env_vars() -> dict[str, str]:
    """Environment for every actor (thread counts, offline flags, Ray/vLLM switches)."""
    threads = str(threads_per_actor())
    env = {
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_WAIT_POLICY": "PASSIVE",  # idle actors' threads sleep (threads_per_actor gives each every core)
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME", "VLLM_CPU_KVCACHE_SPACE", "PYTHONPATH"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def build_datasets(cfg: GRPOMasterConfig, tokenizer):
    """(train datasets, validation dataset or None); several validation entries are concatenated."""
    from torch.utils.data import ConcatDataset

    from grpo_data.datasets import build_data
    from grpo_data.errors import DataError

    try:
        splits = build_data(
            cfg.data.data_config(), tokenizer, chat_template_kwargs=cfg.policy.tokenizer.chat_template_kwargs
        )
    except (DataError, FileNotFoundError) as exc:
        raise StartupError(str(exc)) from None
    if not splits.train:
        raise StartupError("data.train: no training dataset configured")
    for ds in (*splits.train, *splits.validation):  # rows may name their own environment
        unknown = sorted(ds.env_names() - set(cfg.env))
        if unknown:
            raise StartupError(
                f"data: dataset {ds.name!r} ({ds.source}) routes prompts to environment(s) {unknown}, "
                f"which the env section does not configure (configured: {sorted(cfg.env)})"
            )
    val = splits.validation
    return splits.train, (None if not val else val[0] if len(val) == 1 else ConcatDataset(val))


def build_train_iterator(cfg: GRPOMasterConfig, train_sets: list):
    """One endless loader, or one per dataset mixed by a sampler (data.use_multiple_dataloader)."""
    from grpo_data.errors import DataError
    from grpo_data.multi_dataloader import make_train_iterator

    try:
        return make_train_iterator(cfg.data.data_config(), train_sets, cfg.grpo.num_prompts_per_step, cfg.grpo.seed)
    except DataError as exc:
        raise StartupError(str(exc)) from None


@dataclass
class Components:
    model_path: str
    tokenizer: Any
    train_data: Any  # endless iterator of DatumSpec batches (InfiniteDataLoader or MultiDataLoader)
    val_datums: list  # DatumSpecs of the validation set (at most grpo.max_val_samples)
    envs: dict  # env name -> EnvPool
    policy: PolicyGroup  # the data-parallel PolicyWorkers (one or more)
    generator: GeneratorGroup  # the generation engines (one or more)
    train_sets: list | None = None  # the datasets train_data draws from (the async collector draws from them too)
    engine_factories: list | None = None  # per engine: starts it again with the same placement (engine_faults)
    memory: Any = None  # colocation.MemoryChoreography: who holds a shared GPU when (inactive unless colocated on GPUs)

    def shutdown(self) -> None:
        for pool in self.envs.values():
            pool.shutdown()
        self.generator.close()
        self.policy.close()


def build_envs(cfg: GRPOMasterConfig) -> dict:
    """env name -> EnvPool of Ray actors (the async collector calls the same actors)."""
    from grpo_envs.pool import EnvPool

    pools = {}
    for name, env_cfg in cfg.env.items():
        settings = dict(env_cfg.model_extra or {})
        env_class = env_cfg.class_
        if env_cfg.reward_fn is not None:
            env_class, settings = REWARD_FN_ENV, {"reward_fn": env_cfg.reward_fn}
        pools[name] = EnvPool(
            name,
            settings,
            num_workers=env_cfg.num_workers,
            step_timeout_s=env_cfg.step_timeout_s,
            actor_options=env_actor_options(env_cfg.resources),
            env_class=env_class,
            import_paths=env_import_paths() if env_class is not None else (),
        )
    return pools


def env_actor_options(resources: dict[str, float] | None) -> dict:
    """Ray options of an environment actor from `env.<name>.resources` (CPU 1 unless given)."""
    want = dict(resources or {})
    options = {"num_cpus": want.pop("CPU", 1), "num_gpus": want.pop("GPU", 0)}
    if want:
        options["resources"] = want
    return options


def attach_generators(cfg: GRPOMasterConfig, policy, generator) -> None:
    """Wait for the policy ranks and connect the weight transport to the engines (the sync and
    async loops push over it alike)."""
    # the engines' and transports' code (torch, Ray) loads when the run starts them
    from grpo_train.refit import choose_transport, make_transport

    gen_cfg = cfg.policy.generation
    lora = cfg.policy.dtensor_cfg.lora_cfg
    name = choose_transport(
        gen_cfg.weight_transport,
        gen_cfg.colocated.enabled,
        cfg.cluster.gpus_per_node > 0,
        lora.refit if lora.enabled else None,
    )
    try:
        policy.attach(make_transport(name, gen_cfg.refit_buffer_size_gb), generator.engines)
    except (ValueError, NotImplementedError) as exc:
        raise StartupError(str(exc)) from None


def start_generator(cfg: GRPOMasterConfig, model_path: str, policy):
    """The generation engine(s) of the run, placed as the config says (grpo_train.plan prints where):
    the async engine, or `place_generators`' engines (colocated in the policy's bundles, or separate)."""
    return start_engines(engine_factories(cfg, model_path, policy))


def start_engines(factories: list):
    """One engine per factory, in a `GeneratorGroup` (also for one engine)."""
    # the engines' code (torch, Ray) loads when the run starts them
    from grpo_train.generation.group import GeneratorGroup

    return GeneratorGroup([start() for start in factories])


def engine_factories(cfg: GRPOMasterConfig, model_path: str, policy) -> list:
    """One function per generation engine of the run that starts it (again, after a death: see
    grpo_train.engine_faults) with the same placement and options."""
    from functools import partial

    gen_cfg = cfg.policy.generation
    if gen_cfg.backend == "vllm":
        vllm = gen_cfg.vllm_cfg
        gen_kwargs = dict(
            dtype=vllm.precision,
            max_model_len=vllm.max_model_len,
            seed=cfg.grpo.seed,
            gpu_memory_utilization=vllm.gpu_memory_utilization,
            tensor_parallel_size=vllm.tensor_parallel_size,
            enforce_eager=vllm.enforce_eager,
            kv_cache_space_gb=vllm.kv_cache_space_gb,
            temperature_for_logprobs=gen_cfg.temperature,
        )
        lora = cfg.policy.dtensor_cfg.lora_cfg
        if lora.enabled and lora.refit == "adapter":  # LoRA-enabled engine; refits bring adapters only
            gen_kwargs = {**gen_kwargs, "lora_adapter": {"dim": lora.dim, "alpha": lora.alpha}}
    else:
        gen_kwargs = dict(
            dtype=cfg.policy.precision,
            max_model_len=cfg.policy.max_total_sequence_length,
            seed=cfg.grpo.seed,
            temperature_for_logprobs=gen_cfg.temperature,
        )
    if cfg.grpo.async_grpo.enabled:  # the async engine (the config allows only vLLM here)
        flags = cfg.grpo.async_grpo  # in-flight pushes that keep old KV cannot reset a prefix cache
        prefix_caching = not (flags.in_flight_weight_updates and not flags.recompute_kv_cache_after_weight_updates)
        # On GPUs the engine takes its tensor-parallel GPUs (from policy.generation.colocated.resources, which
        # async GRPO requires to be separate); Ray then gives it those devices and no others.
        gpus = vllm.tensor_parallel_size if cfg.cluster.gpus_per_node > 0 else 0
        return [
            partial(
                make_async_generation_actor,
                model_path,
                num_cpus=1,
                num_gpus=gpus,
                prefix_caching=prefix_caching,
                **gen_kwargs,
            )
        ]
    resources = gen_cfg.colocated.resources
    return generator_factories(
        gen_cfg.backend,
        model_path,
        gpus_per_node=cfg.cluster.gpus_per_node,
        colocated=gen_cfg.colocated.enabled,
        policy_placement_group=policy.placement_group,
        separate_gpus=(resources.gpus_per_node or 0) * (resources.num_nodes or 1),
        **gen_kwargs,
    )


def build_components(cfg: GRPOMasterConfig, model_path: str) -> Components:
    # the actors' code (torch, Ray) loads when the run builds them
    from grpo_train.colocation import MemoryChoreography
    from grpo_train.policy.group import PolicyGroup

    # The actors start first: the engine's start-up is the longest wait of a launch, and the
    # tokenizer, the datasets and the environments are built meanwhile.
    threads = threads_per_actor(ranks_per_node(cfg.cluster, cfg.policy.num_workers))
    policy = PolicyGroup(
        model_path,
        cfg.policy,
        cfg.loss_fn,
        cfg.cluster,
        cfg.grpo.seed,
        num_threads=threads,
        colocated_generation=cfg.policy.generation.colocated.enabled,
        start=False,
    )
    factories = engine_factories(cfg, model_path, policy)
    generator = start_engines(factories)
    # After the actors are on their way: importing transformers costs the driver ~2-7 CPU-s.
    from transformers import AutoTokenizer

    tokenizer_path = (
        resolve_model_path(cfg.policy.tokenizer.name, "policy.tokenizer.name")
        if cfg.policy.tokenizer.name
        else model_path
    )
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    train_sets, val_set = build_datasets(cfg, tokenizer)
    train_data = build_train_iterator(cfg, train_sets)
    val_datums = [val_set[i] for i in range(min(len(val_set), cfg.grpo.max_val_samples))] if val_set is not None else []
    envs = build_envs(cfg)
    memory = MemoryChoreography.for_run(cfg, policy, generator)
    memory.start_engines_first()  # colocated on GPUs: engines profile a clean GPU before the trainer moves in
    attach_generators(cfg, policy, generator)
    return Components(
        model_path, tokenizer, train_data, val_datums, envs, policy, generator, train_sets, factories, memory
    )
