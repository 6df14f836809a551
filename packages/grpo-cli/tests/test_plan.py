"""The placement planner (grpo_train.plan) and `grpo plan`: no model loaded, no Ray, no CUDA.

Expectations are hand arithmetic: Qwen2.5-1.5B's parameter count from its published shape, the
bytes per parameter of each part, and Ray's packing of one-GPU bundles node by node.
"""

from __future__ import annotations

import json

import pytest

from grpo_cli.configs import CONFIG_DIR
from grpo_cli.main import main
from grpo_train.config import load_config, validate_config_dict
from grpo_train.plan import ParallelLayout, make_plan, params_from_config, params_from_safetensors

# Qwen2.5-1.5B: hidden 1536, 28 layers, 12 heads of 128, 2 KV heads, MLP 8960, vocab 151936, tied head.
EMBED = 151936 * 1536
ATTN = 1536 * 1536 * 2 + 1536 * 256 * 2 + (1536 + 2 * 256)  # q,o + k,v + q/k/v biases
MLP = 3 * 1536 * 8960
QWEN_1_5B = EMBED + 28 * (ATTN + MLP + 2 * 1536) + 1536
GB = 1e9


def test_qwen_1_5b_size_by_hand():
    assert QWEN_1_5B == 1_543_714_304  # "1.54B", 1.31B without the embedding, as Qwen publishes
    cfg, _ = load_config("grpo_math_1B", [], [CONFIG_DIR])
    assert make_plan(cfg, 80).model.params == QWEN_1_5B


def test_config_formula_agrees_with_real_safetensors_headers():
    from grpo_train.assets import builtin_model_path

    folder = builtin_model_path("arith-tiny")
    assert params_from_config(json.loads((folder / "config.json").read_text())) == params_from_safetensors(folder)


def test_grpo_math_1b_fits_80_gb_and_not_24_gb():
    cfg, _ = load_config("grpo_math_1B", [], [CONFIG_DIR])
    P = QWEN_1_5B
    # bf16 weights 2P + fp32 masters 4P + fp32 grads 4P + AdamW 8P + bf16 reference 2P; vLLM takes 0.6 of the GPU
    # Colocated, held in turns (colocation.py): training = the trainer alone; refit = bf16 weights +
    # fp32 masters (6P) beside the awake engine; generation = the engine alone. The peak is the largest.
    trainer = 20 * P / GB
    plan = make_plan(cfg, 80)
    (gpu,) = plan.gpus
    assert gpu.phase_totals() == pytest.approx(
        {"training": trainer, "refit": 6 * P / GB + 0.6 * 80, "generation": 0.6 * 80}
    )
    assert gpu.total == pytest.approx(6 * P / GB + 0.6 * 80) and gpu.peak_phase == "refit"  # 57.3, was 78.9 summed
    assert gpu.parts["engine KV cache"] == pytest.approx(0.6 * 80 - 2 * P / GB)
    assert not plan.problems
    small = make_plan(cfg, 24)
    assert small.gpus[0].total == pytest.approx(trainer) and small.gpus[0].peak_phase == "training"
    assert len(small.problems) == 1 and "policy.dtensor_cfg.cpu_offload" in small.problems[0]


def test_ppo_math_1b_puts_the_value_model_on_its_own_gpu():
    cfg, _ = load_config("ppo_math_1B", [], [CONFIG_DIR])
    plan = make_plan(cfg, 80)
    value = next(a for a in plan.actors if a.name == "value rank 0")
    assert (value.node, value.device, value.gpu) == (0, 1, 1.0)
    P = QWEN_1_5B
    assert plan.gpus[0].total == pytest.approx(6 * P / GB + 0.6 * 80)  # refit phase; no reference: kl penalty 0
    assert plan.gpus[1].total == pytest.approx(18 * P / GB)  # bf16 value model with fp32 masters
    assert not plan.problems
    assert any("value.num_workers" in p for p in make_plan(cfg, 24).problems)


def test_separate_async_engine_and_reward_model_get_gpus_on_two_nodes():
    cfg = validate_config_dict(
        {
            "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4, "async_grpo": {"enabled": True}},
            "loss_fn": {"use_importance_sampling_correction": True},
            "policy": {
                "model_name": "builtin:arith-tiny",
                "num_workers": 4,
                "train_global_batch_size": 8,
                "generation": {
                    "colocated": {"enabled": False, "resources": {"gpus_per_node": 2, "num_nodes": 1}},
                    "vllm_cfg": {"tensor_parallel_size": 2},
                },
            },
            "env": {"math": {"num_workers": 1}, "reward_model": {"num_workers": 1, "resources": {"GPU": 1}}},
            "cluster": {"gpus_per_node": 4, "num_nodes": 2},
        }
    )
    plan = make_plan(cfg, 80)
    where = {a.name: (a.node, a.device, a.gpu) for a in plan.actors}
    assert [where[f"policy rank {r}"] for r in range(4)] == [(0, r, 1.0) for r in range(4)]  # PACK: node 0 first
    assert where["async engine"] == (1, 4, 2.0)  # a {GPU: 2} bundle on node 1
    assert where["env reward_model [0]"] == (1, 6, 1.0)
    assert where["env math [0]"] == (None, None, 0.0)
    assert not plan.problems
    crowded = cfg.model_copy(
        update={"env": {**cfg.env, "reward_model": cfg.env["reward_model"].model_copy(update={"num_workers": 3})}}
    )
    assert "want 9 GPUs" in make_plan(crowded, 80).problems[0]


def test_cpu_cluster_plan_has_no_memory_check():
    cfg = validate_config_dict({"policy": {"model_name": "builtin:arith-tiny"}})
    plan = make_plan(cfg, 80)
    assert plan.gpus == [] and not plan.problems
    assert [a.name for a in plan.actors] == ["policy rank 0", "  reference (in rank 0)", "engine 0", "env math [0]"]
    assert plan.actors[2].bundle == "{CPU:1}"
    tp2 = validate_config_dict(
        {"policy": {"model_name": "builtin:arith-tiny", "generation": {"vllm_cfg": {"tensor_parallel_size": 2}}}}
    )
    assert make_plan(tp2, 80).actors[2].bundle == "{CPU:1} + 2 TP worker processes"  # the CPU build's TP engine


def test_cli_plan_exit_codes(capsys):
    assert main(["plan", "-c", "grpo_math_1B"]) == 0
    out = capsys.readouterr().out
    assert "engine 0 (colocated)" in out and "fits" in out
    assert main(["plan", "-c", "grpo_math_1B", "--gpu-memory-gb", "24"]) == 2
    out = capsys.readouterr().out
    assert "does not fit: GPU 0 needs 30.9 GB in its training phase" in out
    assert main(["plan", "-c", "grpo_math_1B", "policy.model_name=nobody/unknown-model"]) == 2
    assert "policy.model_name: cannot size 'nobody/unknown-model'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "sections",
    [
        {
            "policy": {"generation": {"colocated": {"enabled": True, "resources": {"gpus_per_node": 1}}}},
            "cluster": {"gpus_per_node": 2},
        },
        {"policy": {"generation": {"colocated": {"enabled": False, "resources": {"gpus_per_node": 1}}}}},  # CPU cluster
    ],
)
def test_generation_resources_that_would_be_ignored_are_refused(sections):
    from grpo_train.setup import StartupError, check_supported

    with pytest.raises(StartupError, match="^policy.generation.colocated.resources: .*set them to null"):
        check_supported(validate_config_dict(sections))


def test_train_refuses_a_plan_that_does_not_fit_before_any_actor(tmp_path, capsys):
    from grpo_train.setup import StartupError, check_plan

    cfg, _ = load_config("grpo_math_1B", ["+cluster.gpu_memory_gb=24"], [CONFIG_DIR])
    with pytest.raises(
        StartupError, match=r"^placement plan \(see `grpo plan`\): GPU 0 needs 30.9 GB in its training phase"
    ):
        check_plan(cfg, None)
    assert not check_plan(load_config("grpo_math_1B", ["+cluster.gpu_memory_gb=80"], [CONFIG_DIR])[0], None).problems
    # the same through `grpo train`: exit 2 and one line, before Ray starts (the model is unknown offline,
    # so the resolved-model step is skipped by pointing at the bundled model's folder)
    from grpo_train.assets import builtin_model_path

    model = builtin_model_path("arith-tiny")
    code = main(
        [
            "train",
            "-c",
            "grpo_math_1B",
            f"policy.model_name={model}",
            "+cluster.gpu_memory_gb=0.001",
            "--run-dir",
            str(tmp_path / "run"),
        ]
    )
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("grpo: placement plan (see `grpo plan`): GPU 0")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "qwen3"])
def test_parameter_count_includes_every_expert(name):
    """MoE memory counts the router and every expert (all resident); checked against the count of
    a tiny random model that transformers builds from the same config."""
    import transformers

    common = dict(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        tie_word_embeddings=False,
    )
    extra = {
        "qwen3_moe": dict(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1, mlp_only_layers=[1]
        ),
        "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
        "qwen3": {},
    }[name]
    config = transformers.AutoConfig.for_model(name, **common, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert params_from_config(config.to_dict()) == sum(p.numel() for p in model.parameters())


def test_plan_shows_policy_tensor_parallel_groups_per_node():
    """policy.dtensor_cfg.tensor_parallel_size=2 over 4 ranks on 2 nodes of 2 GPUs: tp groups {0,1} on
    node 0 and {2,3} on node 1; each rank's trainer state is its 1/tp TP shard (FSDP2 divides by dp on top);
    a TP size that does not divide the GPUs of a node is refused at its key."""

    def cfg(tp: int, num_workers: int, gpus_per_node: int):
        return validate_config_dict(
            {
                "grpo": {"num_prompts_per_step": 6, "num_generations_per_prompt": 16},
                "policy": {
                    "model_name": "builtin:arith-tiny",
                    "num_workers": num_workers,
                    "train_global_batch_size": 96,
                    "dtensor_cfg": {"tensor_parallel_size": tp},
                },
                "cluster": {"gpus_per_node": gpus_per_node, "num_nodes": 2},
            }
        )

    plan = make_plan(cfg(2, 4, 2), 80)
    assert plan.layout is not None
    assert (plan.layout.tp_groups(), plan.layout.dp_groups()) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert [a.name for a in plan.actors if a.name.startswith("policy")] == [
        f"policy rank {r} (dp {r // 2}, tp {r % 2})" for r in range(4)
    ]
    assert "policy process groups: dp 2 x tp 2 (rank = dp_rank * 2 + tp_rank)" in plan.render() and not plan.problems
    one = make_plan(cfg(1, 4, 2), 80)  # FSDP2 over 4 ranks: the same division as dp 2 x tp 2
    assert one.layout is None
    assert plan.gpus[0].parts["gradients"] == pytest.approx(one.gpus[0].parts["gradients"])
    alone = make_plan(
        cfg(1, 2, 2).model_copy(update={"cluster": cfg(1, 2, 2).cluster.model_copy(update={"num_nodes": 1})}), 80
    )  # FSDP2 over 2 ranks: twice a dp 2 x tp 2 rank's share
    assert alone.gpus[0].parts["gradients"] == pytest.approx(2 * plan.gpus[0].parts["gradients"])
    split = make_plan(cfg(2, 6, 3), 80)  # 3 GPUs per node: tp group 1 = ranks 2 (node 0) and 3 (node 1)
    assert split.layout is not None and split.layout.lines()[1] == "nodes 0, 1: tp group 1 = ranks [2, 3]"
    assert split.problems[0].startswith(
        "policy.dtensor_cfg.tensor_parallel_size (2) must divide cluster.gpus_per_node (3)"
    )


def test_plan_lays_out_tp_and_dp_groups_of_the_policy_and_engines_on_two_nodes():
    """Qwen2.5-1.5B (12 heads, 2 KV heads, vocabulary 151936) on 2 nodes of 4 GPUs. Policy: 8 ranks,
    tp 2, rank = dp_rank * 2 + tp_rank packed node by node, so each TP group is a pair of neighbours on
    one node and each dp group holds one tp rank of every replica, across both nodes. Engines: tp 2 on
    separate GPUs of node 1 beside a 4-rank policy on node 0. Sizes the model or nodes cannot take are
    refused at their keys (a plan problem: `grpo plan` and `grpo train` exit 2 on it, see
    test_cli_plan_exit_codes and test_train_refuses_a_plan_that_does_not_fit_before_any_actor)."""

    def cfg(policy_tp: int = 2, workers: int = 8, engine_tp: int = 1, separate: bool = False):
        generation: dict = {"vllm_cfg": {"tensor_parallel_size": engine_tp}}
        if separate:
            generation["colocated"] = {"enabled": False, "resources": {"gpus_per_node": 4, "num_nodes": 1}}
        return validate_config_dict(
            {
                "policy": {
                    "model_name": "Qwen/Qwen2.5-1.5B",
                    "num_workers": workers,
                    "train_global_batch_size": 128,
                    "dtensor_cfg": {"tensor_parallel_size": policy_tp},
                    "generation": generation,
                },
                "cluster": {"gpus_per_node": 4, "num_nodes": 2},
            }
        )

    plan = make_plan(cfg(), 80)
    assert plan.layout is not None and not plan.problems
    assert plan.layout.lines() == [
        "node 0: tp group 0 = ranks [0, 1]",
        "node 0: tp group 1 = ranks [2, 3]",
        "node 1: tp group 2 = ranks [4, 5]",
        "node 1: tp group 3 = ranks [6, 7]",
        "nodes 0, 1: dp group 0 = ranks [0, 2, 4, 6]",
        "nodes 0, 1: dp group 1 = ranks [1, 3, 5, 7]",
    ]
    rendered = plan.render().splitlines()
    header = rendered.index("policy process groups: dp 4 x tp 2 (rank = dp_rank * 2 + tp_rank)")
    assert rendered[header + 1 : header + 7] == [f"  {line}" for line in plan.layout.lines()]
    # With context parallelism (refused at its key until it is built) cp sits between dp and tp.
    cp = ParallelLayout(tp=2, cp=2, nodes=(0, 0, 0, 0, 1, 1, 1, 1))
    assert (cp.tp_groups(), cp.cp_groups(), cp.dp_groups()) == (
        [[0, 1], [2, 3], [4, 5], [6, 7]],
        [[0, 2], [1, 3], [4, 6], [5, 7]],
        [[0, 4], [1, 5], [2, 6], [3, 7]],
    )
    assert cp.header() == "policy process groups: dp 2 x cp 2 x tp 2 (rank = (dp_rank * 2 + cp_rank) * 2 + tp_rank)"
    assert cp.lines()[4:6] == ["node 0: cp group 0 = ranks [0, 2]", "node 0: cp group 1 = ranks [1, 3]"]

    engines = make_plan(cfg(workers=4, engine_tp=2, separate=True), 80)
    assert not engines.problems
    assert engines.layout is not None and engines.layout.lines() == [
        "node 0: tp group 0 = ranks [0, 1]",
        "node 0: tp group 1 = ranks [2, 3]",
        "node 0: dp group 0 = ranks [0, 2]",
        "node 0: dp group 1 = ranks [1, 3]",
    ]
    assert engines.engine_groups == [(0, [1], [4, 5]), (1, [1], [6, 7])]
    assert (
        "engine tensor-parallel groups:\n  node 1: engine 0 = GPUs [4, 5]\n  node 1: engine 1 = GPUs [6, 7]"
        in engines.render()
    )

    assert make_plan(cfg(policy_tp=4), 80).problems == [
        "policy.dtensor_cfg.tensor_parallel_size: 4 does not divide the model's num_key_value_heads=2 (each "
        "tensor-parallel rank holds whole heads and an equal vocabulary slice)"
    ]
    assert make_plan(cfg(workers=4, engine_tp=3, separate=True), 80).problems == [
        "policy.generation.vllm_cfg.tensor_parallel_size: 3 does not fit the model's num_attention_heads=12, "
        "num_key_value_heads=2 (vLLM needs it to divide the heads, and to divide or be a multiple of the KV heads)"
    ]
    too_wide = make_plan(cfg(workers=4, engine_tp=6, separate=True), 80).problems  # 6 fits 12 heads, not a node
    assert too_wide[0] == (
        "policy.generation.vllm_cfg.tensor_parallel_size (6): the engine needs 6 GPUs in one "
        "bundle, more than a node's cluster.gpus_per_node (4)"
    )


def test_plan_counts_policy_context_parallel_groups():
    """policy.dtensor_cfg.context_parallel_size=2 over 4 CPU ranks: dp groups {0,1} and {2,3}, each rank
    labelled with its dp and cp coordinates; each rank holds full weights (CP splits tokens, not parameters),
    so a GPU's trainer state is the unsharded replica's; a CP size not dividing the GPUs of a node is refused."""

    def cfg(cp: int, num_workers: int, gpus_per_node: int):
        return validate_config_dict(
            {
                "policy": {
                    "model_name": "builtin:arith-tiny",
                    "num_workers": num_workers,
                    "train_global_batch_size": 128,
                    "dtensor_cfg": {"context_parallel_size": cp, "enabled": False},
                },
                "cluster": {"gpus_per_node": gpus_per_node, "num_nodes": 2},
            }
        )

    plan = make_plan(cfg(2, 4, 0), 80)
    assert plan.layout is not None and plan.layout.cp_groups() == [[0, 1], [2, 3]]
    assert plan.layout.dp_groups() == [[0, 2], [1, 3]]
    assert [a.name for a in plan.actors if a.name.startswith("policy")] == [
        f"policy rank {r} (dp {r // 2}, cp {r % 2})" for r in range(4)
    ]
    assert "policy process groups: dp 2 x cp 2 x tp 1 (rank = (dp_rank * 2 + cp_rank) * 1 + tp_rank)" in plan.render()
    assert not plan.problems
    on_gpus, replicas = make_plan(cfg(2, 4, 2), 80), make_plan(cfg(1, 4, 2), 80)
    assert on_gpus.gpus[0].parts["gradients"] == pytest.approx(replicas.gpus[0].parts["gradients"])
    assert on_gpus.layout is not None and "node 1: cp group 1 = ranks [2, 3]" in on_gpus.layout.lines()
    assert not on_gpus.problems
    odd = make_plan(
        validate_config_dict(
            {
                "policy": {
                    "model_name": "builtin:arith-tiny",
                    "num_workers": 2,
                    "train_global_batch_size": 128,
                    "dtensor_cfg": {"context_parallel_size": 2, "enabled": False},
                },
                "cluster": {"gpus_per_node": 3, "num_nodes": 1},
            }
        ),
        80,
    )
    assert any(
        p.startswith("policy.dtensor_cfg.context_parallel_size (2) must divide cluster.gpus_per_node (3)")
        for p in odd.problems
    ), odd.problems
