"""No config key is inert: every leaf of the schema either changes behaviour or is refused.

The table below is maintained by hand: each leaf key path of `GRPOMasterConfig` (dataset entries
as `data.<entry>.*`, env sections as `env.<name>.*`, scheduler list entries as `.scheduler.*`)
maps to how a non-default value is proven to matter:

  T("tests/file.py::test_name")  a test that sets the key and checks its effect;
  R("pkg/module.py")             read by that module (checked here: the module names the key);
                                  no test sets the key by name;
  Refused(value)                 the value is refused at its key path (checked here).

Adding a schema key without a row fails `test_every_schema_key_is_in_the_table`.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest
from pydantic import BaseModel

from grpo_train.config import validate_config_dict
from grpo_train.config.errors import ConfigError
from grpo_train.config.schema import GRPOMasterConfig

ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class T:
    test: str


@dataclass(frozen=True)
class R:
    module: str


@dataclass(frozen=True)
class Refused:
    value: object


TABLE = {
    "grpo.num_prompts_per_step": T(
        "packages/grpo-data/tests/test_multi_dataloader.py::test_custom_sampler_by_import_path"
    ),
    "grpo.num_generations_per_prompt": R("grpo_train/rollout/dynamic_sampling.py"),
    "grpo.max_rollout_turns": T("tests/test_e2e_grpo.py::test_kill_and_resume_gives_bitwise_equal_weights_and_metrics"),
    "grpo.per_sample_turns": T(
        "packages/grpo-train/tests/test_tool_rollout.py::test_finished_samples_do_not_wait_for_a_slow_tool"
    ),
    "grpo.invalid_tool_call_advantage": T(
        "packages/grpo-train/tests/test_tool_rollout.py::test_invalid_tool_calls_take_the_configured_advantage_on_their_turn_only"
    ),
    "grpo.max_num_epochs": R("grpo_train/step.py"),
    "grpo.max_num_steps": R("grpo_train/step.py"),
    "grpo.normalize_rewards": T(
        "packages/grpo-train/tests/test_advantages.py::test_leave_one_out_without_normalisation"
    ),
    "grpo.use_leave_one_out_baseline": T(
        "packages/grpo-train/tests/test_advantages.py::test_group_mean_and_bessel_std_without_leave_one_out"
    ),
    "grpo.advantage_clip_low": T("packages/grpo-train/tests/test_advantages.py::test_advantage_clip"),
    "grpo.advantage_clip_high": T("packages/grpo-train/tests/test_advantages.py::test_advantage_clip"),
    "grpo.overlong_filtering": R("grpo_train/train_step.py"),
    "grpo.use_dynamic_sampling": T(
        "tests/test_e2e_grpo.py::test_short_run_with_dynamic_sampling_writes_metrics_plot_logs_and_checkpoints"
    ),
    "grpo.dynamic_sampling_max_gen_batches": T(
        "tests/test_e2e_grpo.py::test_short_run_with_dynamic_sampling_writes_metrics_plot_logs_and_checkpoints"
    ),
    "grpo.batch_multiplier": R("grpo_train/rollout/dynamic_sampling.py"),
    "grpo.val_period": R("grpo_train/step.py"),
    "grpo.val_at_start": T(
        "tests/test_e2e_async.py::test_kill_and_resume_trains_every_prompt_once_within_the_age_bound"
    ),
    "grpo.val_at_end": T("tests/test_e2e_async.py::test_zero_age_async_reproduces_the_sync_loop"),
    "grpo.max_val_samples": R("grpo_train/setup.py"),
    "grpo.val_batch_size": R("grpo_train/run.py"),
    "grpo.val_num_generations": R("grpo_train/run.py"),
    "grpo.seed": R("grpo_train/setup.py"),
    "grpo.reward_shaping.enabled": T(
        "packages/grpo-train/tests/test_advantages.py::test_reward_scaling_and_shaping_by_hand"
    ),
    "grpo.reward_shaping.overlong_buffer_length": T(
        "packages/grpo-train/tests/test_advantages.py::test_reward_scaling_and_shaping_by_hand"
    ),
    "grpo.reward_shaping.overlong_buffer_penalty": T(
        "packages/grpo-train/tests/test_advantages.py::test_reward_scaling_and_shaping_by_hand"
    ),
    "grpo.reward_shaping.max_response_length": T(
        "packages/grpo-train/tests/test_advantages.py::test_reward_scaling_and_shaping_by_hand"
    ),
    "grpo.reward_shaping.stop_properly_penalty_coef": T(
        "packages/grpo-train/tests/test_advantages.py::test_reward_scaling_and_shaping_by_hand"
    ),
    "grpo.reward_scaling.enabled": T(
        "packages/grpo-train/tests/test_advantages.py::test_reward_scaling_and_shaping_by_hand"
    ),
    "grpo.reward_scaling.source_min": T(
        "packages/grpo-train/tests/test_advantages.py::test_reward_scaling_and_shaping_by_hand"
    ),
    "grpo.reward_scaling.source_max": T(
        "packages/grpo-train/tests/test_advantages.py::test_reward_scaling_and_shaping_by_hand"
    ),
    "grpo.reward_scaling.target_min": T(
        "packages/grpo-train/tests/test_advantages.py::test_reward_scaling_and_shaping_by_hand"
    ),
    "grpo.reward_scaling.target_max": T(
        "packages/grpo-train/tests/test_advantages.py::test_reward_scaling_and_shaping_by_hand"
    ),
    "grpo.async_grpo.enabled": R("grpo_train/setup.py"),
    "grpo.async_grpo.max_trajectory_age_steps": T(
        "packages/grpo-train/tests/test_replay_buffer.py::test_negative_bound_names_the_key"
    ),
    "grpo.async_grpo.in_flight_weight_updates": R("grpo_train/async_loop.py"),
    "grpo.async_grpo.recompute_kv_cache_after_weight_updates": R("grpo_train/setup.py"),
    "grpo.refit_check.enabled": R("grpo_train/step.py"),
    "grpo.refit_check.num_probe_sequences": T(
        "packages/grpo-train/tests/test_refit_gate.py::test_defaults_follow_the_coarser_precision_and_keys_override_them"
    ),
    "grpo.refit_check.max_abs_logprob_diff": T(
        "tests/test_e2e_ppo.py::test_ppo_value_loss_falls_and_held_out_accuracy_rises"
    ),
    "grpo.refit_check.max_mean_abs_logprob_diff": T(
        "packages/grpo-train/tests/test_refit_gate.py::test_defaults_follow_the_coarser_precision_and_keys_override_them"
    ),
    "grpo.refit_check.max_seq_logratio_rms": T(
        "packages/grpo-train/tests/test_refit_gate.py::test_defaults_follow_the_coarser_precision_and_keys_override_them"
    ),
    "grpo.refit_check.period": R("grpo_train/step.py"),
    "loss_fn.reference_policy_kl_penalty": R("grpo_train/train_step.py"),
    "loss_fn.reference_policy_kl_type": T(
        "packages/grpo-kernels/tests/test_pg_loss.py::test_kl_types_at_the_clamps_by_hand"
    ),
    "loss_fn.kl_input_clamp_value": T(
        "packages/grpo-kernels/tests/test_pg_loss.py::test_kl_types_at_the_clamps_by_hand"
    ),
    "loss_fn.kl_output_clamp_value": T(
        "packages/grpo-kernels/tests/test_pg_loss.py::test_kl_types_at_the_clamps_by_hand"
    ),
    "loss_fn.ratio_clip_min": T("packages/grpo-kernels/tests/test_pg_loss.py::test_ppo_clipping_by_hand"),
    "loss_fn.ratio_clip_max": T("packages/grpo-train/tests/test_schema_walk.py::test_ratio_clip_max_is_the_upper_clip"),
    "loss_fn.ratio_clip_c": T(
        "packages/grpo-kernels/tests/test_pg_loss.py::test_dual_clip_with_negative_advantages_by_hand"
    ),
    "loss_fn.use_on_policy_kl_approximation": T(
        "packages/grpo-kernels/tests/test_pg_loss.py::test_on_policy_kl_weight_is_applied_before_the_output_clamp"
    ),
    "loss_fn.use_importance_sampling_correction": T(
        "packages/grpo-kernels/tests/test_pg_loss.py::test_importance_weights_are_ignored_without_correction_but_still_reported"
    ),
    "loss_fn.truncated_importance_sampling_type": T(
        "packages/grpo-kernels/tests/test_loss_config.py::test_accepted_combinations"
    ),
    "loss_fn.truncated_importance_sampling_ratio": T(
        "packages/grpo-kernels/tests/test_loss_config.py::test_accepted_combinations"
    ),
    "loss_fn.truncated_importance_sampling_ratio_min": T(
        "packages/grpo-kernels/tests/test_loss_config.py::test_accepted_combinations"
    ),
    "loss_fn.token_level_loss": T(
        "packages/grpo-train/tests/test_packed_training.py::test_packing_matches_padded_with_sequence_level_loss_and_fused_head"
    ),
    "loss_fn.sequence_level_importance_ratios": T(
        "packages/grpo-train/tests/test_packed_training.py::test_packing_matches_padded_with_sequence_level_loss_and_fused_head"
    ),
    "loss_fn.disable_ppo_ratio": T("packages/grpo-kernels/tests/test_pg_loss.py::test_reinforce_by_hand"),
    "loss_fn.loss_aggregation": T(
        "packages/grpo-kernels/tests/test_pg_loss_variants.py::test_loss_aggregation_by_hand"
    ),
    "loss_fn.loss_scale_factor": T(
        "packages/grpo-kernels/tests/test_pg_loss_variants.py::test_loss_aggregation_by_hand"
    ),
    "loss_fn.force_on_policy_ratio": T(
        "packages/grpo-kernels/tests/test_pg_loss_variants.py::test_force_on_policy_ratio_by_hand"
    ),
    "loss_fn.use_cispo": T("packages/grpo-kernels/tests/test_pg_loss_variants.py::test_cispo_by_hand"),
    "loss_fn.kl_true_gradient": T(
        "packages/grpo-kernels/tests/test_pg_loss_variants.py::test_kl_true_gradient_is_the_gradient_of_the_kl"
    ),
    "loss_fn.positive_example_nll_weight": T(
        "packages/grpo-train/tests/test_policy_worker.py::test_loss_fn_keys_change_the_training_loss"
    ),
    "policy.model_name": T("tests/test_e2e_grpo.py::test_missing_local_model_fails_at_startup_with_one_line"),
    "policy.tokenizer.name": R("grpo_train/setup.py"),
    "policy.tokenizer.chat_template_kwargs": T(
        "packages/grpo-train/tests/test_tool_rollout.py::test_processed_datums_carry_the_tokenizers_and_their_entrys_chat_template_kwargs"
    ),
    "policy.train_global_batch_size": R("grpo_train/ppo/ppo_step.py"),
    "policy.train_micro_batch_size": R("grpo_train/policy/microbatch.py"),
    "policy.generation_batch_size": T(
        "packages/grpo-train/tests/test_schema_walk.py::test_generation_batch_size_submits_prompts_in_chunks"
    ),
    "policy.logprob_batch_size": T(
        "packages/grpo-train/tests/test_packed_training.py::test_data_parallel_ranks_with_different_bin_counts_stay_in_step"
    ),
    "policy.reference_beside_training": T(
        "packages/grpo-train/tests/test_policy_worker.py::test_reference_beside_training_is_bitwise_the_reference_pass_first"
    ),
    "policy.max_total_sequence_length": R("grpo_train/rollout/__init__.py"),
    "policy.precision": R("grpo_train/setup.py"),
    "policy.logprob_chunk_size": R("grpo_train/policy/worker.py"),
    "policy.use_fused_kernels": T(
        "packages/grpo-train/tests/test_packed_training.py::test_packing_matches_padded_with_sequence_level_loss_and_fused_head"
    ),
    "policy.num_workers": R("grpo_train/policy/group.py"),
    "policy.dtensor_cfg.enabled": R("grpo_train/policy/worker.py"),
    "policy.dtensor_cfg.cpu_offload": R("grpo_train/policy/worker.py"),
    "policy.dtensor_cfg.sequence_parallel": T(
        "packages/grpo-train/tests/test_tp_workers.py::test_tp2_ranks_match_one_worker"
    ),
    "policy.dtensor_cfg.activation_checkpointing": T(
        "packages/grpo-train/tests/test_policy_group.py::test_activation_checkpointing_keeps_the_gradients"
    ),
    "policy.dtensor_cfg.tensor_parallel_size": T(
        "packages/grpo-train/tests/test_tp_workers.py::test_tp2_ranks_match_one_worker"
    ),
    "policy.dtensor_cfg.context_parallel_size": T(
        "packages/grpo-train/tests/test_context_parallel.py::test_cp2_model_and_policy_workers_match_one_unsharded"
    ),
    "policy.dtensor_cfg.custom_parallel_plan": R("grpo_train/policy/worker.py"),
    "policy.dtensor_cfg.lora_cfg.enabled": T(
        "packages/grpo-train/tests/test_lora.py::test_only_adapters_require_grad_and_get_optimizer_state"
    ),
    "policy.dtensor_cfg.lora_cfg.target_modules": T(
        "packages/grpo-train/tests/test_lora.py::test_target_modules_select_layers_and_exclude_modules_remove_them"
    ),
    "policy.dtensor_cfg.lora_cfg.exclude_modules": T(
        "packages/grpo-train/tests/test_lora.py::test_target_modules_select_layers_and_exclude_modules_remove_them"
    ),
    "policy.dtensor_cfg.lora_cfg.match_all_linear": T(
        "packages/grpo-train/tests/test_lora.py::test_target_modules_select_layers_and_exclude_modules_remove_them"
    ),
    "policy.dtensor_cfg.lora_cfg.dim": T(
        "packages/grpo-train/tests/test_lora.py::test_reference_is_the_base_model_with_adapters_disabled_and_no_copy"
    ),
    "policy.dtensor_cfg.lora_cfg.alpha": T(
        "packages/grpo-train/tests/test_lora.py::test_merged_refit_is_w_plus_scaled_ba_and_leaves_the_trainer_unmerged"
    ),
    "policy.dtensor_cfg.lora_cfg.dropout": T(
        "packages/grpo-train/tests/test_lora.py::test_dropout_reaches_the_adapter_input"
    ),
    "policy.dtensor_cfg.lora_cfg.dropout_position": Refused("post"),
    "policy.dtensor_cfg.lora_cfg.lora_A_init": T(
        "packages/grpo-train/tests/test_lora.py::test_lora_a_init_is_rank_independent_and_follows_lora_A_init"
    ),
    "policy.dtensor_cfg.lora_cfg.refit": T(
        "packages/grpo-train/tests/test_refit.py::test_lora_adapter_refit_passes_the_gate"
    ),
    "policy.dynamic_batching.enabled": R("grpo_train/policy/microbatch.py"),
    "policy.dynamic_batching.train_mb_tokens": R("grpo_train/policy/microbatch.py"),
    "policy.dynamic_batching.logprob_mb_tokens": R("grpo_train/policy/microbatch.py"),
    "policy.dynamic_batching.sequence_length_round": T(
        "packages/grpo-train/tests/test_microbatch.py::test_budgets_and_row_counts_come_from_the_purpose"
    ),
    "policy.sequence_packing.enabled": R("grpo_train/policy/microbatch.py"),
    "policy.sequence_packing.train_mb_tokens": R("grpo_train/policy/microbatch.py"),
    "policy.sequence_packing.logprob_mb_tokens": R("grpo_train/policy/microbatch.py"),
    "policy.sequence_packing.sequence_length_round": T(
        "packages/grpo-train/tests/test_microbatch.py::test_budgets_and_row_counts_come_from_the_purpose"
    ),
    "policy.sequence_packing.algorithm": T(
        "packages/grpo-train/tests/test_microbatch.py::test_unknown_packing_algorithm_names_the_key"
    ),
    "policy.make_sequence_length_divisible_by": R("grpo_train/train_step.py"),
    "policy.max_grad_norm": R("grpo_train/policy/core.py"),
    "policy.moe_aux_loss_coeff": T(
        "packages/grpo-train/tests/test_moe_aux_loss.py::test_added_term_is_coeff_times_the_models_aux_loss"
    ),
    "policy.optimizer.name": R("grpo_train/policy/optim.py"),
    "policy.optimizer.kwargs": R("grpo_train/policy/optim.py"),
    "policy.scheduler.name": R("grpo_train/policy/optim.py"),
    "policy.scheduler.kwargs": R("grpo_train/policy/optim.py"),
    "policy.scheduler.milestones": R("grpo_train/policy/optim.py"),
    "policy.generation.backend": R("grpo_train/generation/actor.py"),
    "policy.generation.max_new_tokens": R("grpo_train/step.py"),
    "policy.generation.temperature": R("grpo_train/policy/worker.py"),
    "policy.generation.top_p": R("grpo_train/step.py"),
    "policy.generation.top_k": R("grpo_train/step.py"),
    "policy.generation.stop_token_ids": T(
        "packages/grpo-train/tests/test_multi_turn.py::test_multi_turn_rollout_masks_observations_and_sums_rewards"
    ),
    "policy.generation.stop_strings": R("grpo_train/step.py"),
    "policy.generation.vllm_cfg.async_engine": Refused(True),
    "policy.generation.vllm_cfg.precision": R("grpo_train/setup.py"),
    "policy.generation.vllm_cfg.tensor_parallel_size": R("grpo_train/generation/actor.py"),
    "policy.generation.vllm_cfg.pipeline_parallel_size": Refused(2),
    "policy.generation.vllm_cfg.expert_parallel_size": Refused(2),
    "policy.generation.vllm_cfg.gpu_memory_utilization": T(
        "packages/grpo-train/tests/test_weight_transport.py::test_colocated_engine_sleeps_and_is_refit_over_ipc"
    ),
    "policy.generation.vllm_cfg.max_model_len": R("grpo_train/setup.py"),
    "policy.generation.vllm_cfg.enforce_eager": R("grpo_train/setup.py"),
    "policy.generation.vllm_cfg.kv_cache_space_gb": T(
        "packages/grpo-train/tests/test_refit.py::test_generation_actors_through_ray"
    ),
    "policy.generation.colocated.enabled": R("grpo_train/setup.py"),
    "policy.generation.colocated.resources.gpus_per_node": T(
        "packages/grpo-cli/tests/test_plan.py::test_separate_async_engine_and_reward_model_get_gpus_on_two_nodes"
    ),
    "policy.generation.colocated.resources.num_nodes": T(
        "packages/grpo-cli/tests/test_plan.py::test_separate_async_engine_and_reward_model_get_gpus_on_two_nodes"
    ),
    "policy.generation.weight_transport": T(
        "packages/grpo-train/tests/test_weight_transport.py::test_tensor_metadata_survives_plain_rows"
    ),
    "policy.generation.refit_buffer_size_gb": T(
        "tests/test_e2e_async.py::test_zero_age_async_reproduces_the_sync_loop"
    ),
    "policy.generation.max_engine_restarts": T(
        "packages/grpo-train/tests/test_engine_faults.py::test_sync_run_survives_a_killed_engine_then_stops_with_one_line"
    ),
    "data.max_input_seq_length": T("packages/grpo-data/tests/test_datasets.py::test_build_dataset_arithmetic_demo"),
    "data.shuffle": R("grpo_data/multi_dataloader.py"),
    "data.num_workers": R("grpo_data/multi_dataloader.py"),
    "data.<entry>.dataset_name": R("grpo_data/datasets.py"),
    "data.<entry>.task_name": T("packages/grpo-data/tests/test_records.py::test_task_spec_is_frozen_and_renders"),
    "data.<entry>.processor": T(
        "packages/grpo-data/tests/test_datasets.py::test_processed_dataset_processes_every_row_once_at_build"
    ),
    "data.<entry>.processor_kwargs": R("grpo_data/datasets.py"),
    "data.<entry>.prompt_file": T(
        "packages/grpo-data/tests/test_records.py::test_missing_prompt_file_is_an_error_naming_it"
    ),
    "data.<entry>.system_prompt_file": R("grpo_data/datasets.py"),
    "data.<entry>.env_name": T("packages/grpo-data/tests/test_datasets.py::test_build_dataset_arithmetic_demo"),
    "data.<entry>.max_input_seq_length": T(
        "packages/grpo-data/tests/test_datasets.py::test_build_dataset_arithmetic_demo"
    ),
    "data.<entry>.chat_template_kwargs": T(
        "packages/grpo-data/tests/test_processors.py::test_math_passes_chat_template_kwargs"
    ),
    "data.<entry>.on_overlong": T("packages/grpo-data/tests/test_datasets.py::test_strict_truncation_names_the_row"),
    "data.<entry>.split_validation_size": T(
        "packages/grpo-data/tests/test_datasets.py::test_build_data_lists_defaults_and_carved_validation"
    ),
    "data.<entry>.seed": T(
        "packages/grpo-data/tests/test_datasets.py::test_processed_dataset_processes_every_row_once_at_build"
    ),
    "data.<entry>.data_path": T("packages/grpo-data/tests/test_datasets.py::test_strict_truncation_names_the_row"),
    "data.<entry>.train_data_path": R("grpo_data/datasets.py"),
    "data.<entry>.val_data_path": T(
        "packages/grpo-data/tests/test_response_dataset.py::test_val_data_path_repeat_and_keys"
    ),
    "data.<entry>.input_key": T(
        "packages/grpo-data/tests/test_datasets.py::test_build_data_lists_defaults_and_carved_validation"
    ),
    "data.<entry>.output_key": T(
        "packages/grpo-data/tests/test_datasets.py::test_build_data_lists_defaults_and_carved_validation"
    ),
    "data.<entry>.subset": T(
        "packages/grpo-data/tests/test_builtin_datasets.py::test_unknown_split_and_offline_hub_message"
    ),
    "data.<entry>.split": R("grpo_data/datasets.py"),
    "data.<entry>.val_split": R("grpo_data/datasets.py"),
    "data.<entry>.repeat": T("packages/grpo-data/tests/test_response_dataset.py::test_val_data_path_repeat_and_keys"),
    "data.<entry>.size": R("grpo_data/datasets.py"),
    "data.<entry>.digits": T("packages/grpo-data/tests/test_datasets.py::test_build_dataset_arithmetic_demo"),
    "data.<entry>.operations": T("packages/grpo-data/tests/test_datasets.py::test_build_dataset_arithmetic_demo"),
    "data.use_multiple_dataloader": T(
        "packages/grpo-data/tests/test_multi_dataloader.py::test_make_train_iterator_from_the_data_section"
    ),
    "data.num_prompts_per_dataloader": T(
        "packages/grpo-data/tests/test_multi_dataloader.py::test_documented_interleaving"
    ),
    "data.custom_dataloader": R("grpo_data/multi_dataloader.py"),
    "data.bad_rows": T("packages/grpo-train/tests/test_setup_data.py::test_bad_rows_policy_reaches_the_datasets"),
    "env.<name>.resources": T(
        "packages/grpo-cli/tests/test_plan.py::test_separate_async_engine_and_reward_model_get_gpus_on_two_nodes"
    ),
    "env.<name>.num_workers": R("grpo_train/setup.py"),
    "env.<name>.step_timeout_s": T(
        "packages/grpo-train/tests/test_env_step_budget.py::test_step_timeout_from_config_reaches_the_pool"
    ),
    "env.<name>.class": T("tests/test_custom_env.py::test_custom_env_and_reward_fn_train_through_grpo_train"),
    "env.<name>.reward_fn": T("tests/test_custom_env.py::test_custom_env_and_reward_fn_train_through_grpo_train"),
    "logger.log_dir": R("grpo_cli/main.py"),
    "logger.console_enabled": R("grpo_train/loggers.py"),
    "logger.wandb_enabled": T(
        "packages/grpo-train/tests/test_loggers.py::test_wandb_offline_run_folder_has_the_logged_values"
    ),
    "logger.tensorboard_enabled": R("grpo_train/loggers.py"),
    "logger.plot_enabled": T("tests/test_e2e_grpo.py::test_kill_and_resume_gives_bitwise_equal_weights_and_metrics"),
    "logger.num_val_samples_to_print": T(
        "packages/grpo-train/tests/test_loggers.py::test_console_prints_one_line_per_step_and_samples"
    ),
    "logger.wandb.project": R("grpo_train/loggers.py"),
    "logger.wandb.name": R("grpo_train/loggers.py"),
    "logger.tensorboard": T("tests/test_e2e_grpo.py::test_kill_and_resume_gives_bitwise_equal_weights_and_metrics"),
    "cluster.gpus_per_node": T("packages/grpo-train/tests/test_policy_group.py::test_bundles_follow_the_cluster_shape"),
    "cluster.num_nodes": T("tests/test_multinode.py::test_policy_ranks_are_placed_on_both_nodes"),
    "cluster.address": R("grpo_train/setup.py"),
    "cluster.gpu_memory_gb": R("grpo_train/plan.py"),
    "cluster.num_cpus": R("grpo_train/setup.py"),
    "checkpointing.enabled": T("tests/test_e2e_async.py::test_zero_age_async_reproduces_the_sync_loop"),
    "checkpointing.checkpoint_dir": R("grpo_train/run.py"),
    "checkpointing.metric_name": R("grpo_train/run.py"),
    "checkpointing.higher_is_better": T(
        "packages/grpo-train/tests/test_checkpoint.py::test_pruning_with_metric_keeps_newest_plus_best_k"
    ),
    "checkpointing.keep_top_k": T(
        "tests/test_e2e_async.py::test_kill_and_resume_trains_every_prompt_once_within_the_age_bound"
    ),
    "checkpointing.save_period": T(
        "tests/test_e2e_async.py::test_kill_and_resume_trains_every_prompt_once_within_the_age_bound"
    ),
    "checkpointing.checkpoint_must_save_by": T(
        "packages/grpo-train/tests/test_schema_walk.py::test_deadline_saves_before_the_next_step_would_overrun"
    ),
    "ppo.adv_estimator.name": R("grpo_train/ppo/estimators.py"),
    "ppo.adv_estimator.gae_gamma": R("grpo_train/ppo/estimators.py"),
    "ppo.adv_estimator.gae_lambda": R("grpo_train/ppo/estimators.py"),
    "ppo.adv_estimator.policy_gae_lambda": T(
        "packages/grpo-train/tests/test_gae.py::test_gae_estimator_with_separate_policy_and_value_lambdas"
    ),
    "ppo.adv_estimator.value_gae_lambda": T(
        "packages/grpo-train/tests/test_gae.py::test_gae_estimator_with_separate_policy_and_value_lambdas"
    ),
    "ppo.adv_estimator.length_adaptive_alpha": T(
        "packages/grpo-train/tests/test_gae.py::test_length_adaptive_alpha_overrides_the_policy_lambda"
    ),
    "ppo.adv_estimator.normalize_advantages": T(
        "packages/grpo-train/tests/test_gae.py::test_gae_estimator_with_separate_policy_and_value_lambdas"
    ),
    "ppo.ppo_epochs": R("grpo_train/ppo/ppo_loop.py"),
    "ppo.policy_training_start_step": T("tests/test_e2e_ppo.py::test_ppo_value_loss_falls_and_held_out_accuracy_rises"),
    "grpo.seq_logprob_error_threshold": T(
        "packages/grpo-train/tests/test_train_step.py::test_seq_logprob_error_threshold_masks_sequences_by_their_mean_exp_error"
    ),
    "grpo.adv_estimator.name": T(
        "packages/grpo-train/tests/test_group_estimators.py::test_reinforce_plus_plus_baseline_whitens_over_all_response_tokens"
    ),
    "grpo.adv_estimator.normalize_rewards": T(
        "packages/grpo-train/tests/test_group_estimators.py::test_grpo_adv_estimator_keys_override_the_top_level_ones"
    ),
    "grpo.adv_estimator.use_leave_one_out_baseline": T(
        "packages/grpo-train/tests/test_group_estimators.py::test_grpo_adv_estimator_keys_override_the_top_level_ones"
    ),
    "grpo.adv_estimator.minus_baseline": T(
        "packages/grpo-train/tests/test_group_estimators.py::test_reinforce_plus_plus_without_baseline"
    ),
    "grpo.adv_estimator.reward_weights": T(
        "packages/grpo-train/tests/test_group_estimators.py::test_gdpo_normalises_each_component_in_its_group_then_the_sum_over_the_batch"
    ),
    "loss_fn.use_kl_in_reward": T(
        "packages/grpo-train/tests/test_train_step.py::test_kl_in_reward_for_grpo_goes_into_the_advantage_and_out_of_the_loss"
    ),
    "value.model_name": R("grpo_train/ppo/ppo_step.py"),
    "value.precision": R("grpo_train/setup.py"),
    "value.train_global_batch_size": R("grpo_train/ppo/ppo_step.py"),
    "value.train_micro_batch_size": R("grpo_train/ppo/value_worker.py"),
    "value.inference_batch_size": R("grpo_train/ppo/value_worker.py"),
    "value.max_grad_norm": R("grpo_train/policy/core.py"),
    "value.num_workers": T("packages/grpo-train/tests/test_value_group.py::test_config_accepts_value_ranks_that_fit"),
    "value.dynamic_batching.enabled": R("grpo_train/policy/microbatch.py"),
    "value.dynamic_batching.train_mb_tokens": R("grpo_train/policy/microbatch.py"),
    "value.dynamic_batching.logprob_mb_tokens": R("grpo_train/policy/microbatch.py"),
    "value.dynamic_batching.sequence_length_round": T(
        "packages/grpo-train/tests/test_microbatch.py::test_budgets_and_row_counts_come_from_the_purpose"
    ),
    "value.sequence_packing.enabled": R("grpo_train/policy/microbatch.py"),
    "value.sequence_packing.train_mb_tokens": R("grpo_train/policy/microbatch.py"),
    "value.sequence_packing.logprob_mb_tokens": R("grpo_train/policy/microbatch.py"),
    "value.sequence_packing.sequence_length_round": T(
        "packages/grpo-train/tests/test_microbatch.py::test_budgets_and_row_counts_come_from_the_purpose"
    ),
    "value.sequence_packing.algorithm": T(
        "packages/grpo-train/tests/test_microbatch.py::test_unknown_packing_algorithm_names_the_key"
    ),
    "value.optimizer.name": R("grpo_train/policy/optim.py"),
    "value.optimizer.kwargs": R("grpo_train/policy/optim.py"),
    "value.scheduler.name": R("grpo_train/policy/optim.py"),
    "value.scheduler.kwargs": R("grpo_train/policy/optim.py"),
    "value.scheduler.milestones": R("grpo_train/policy/optim.py"),
    "value.lora_cfg.enabled": T(
        "packages/grpo-train/tests/test_value_lora.py::test_only_adapters_and_head_train_and_one_step_matches_a_peft_twin"
    ),
    "value.lora_cfg.target_modules": T(
        "packages/grpo-train/tests/test_value_lora.py::test_only_adapters_and_head_train_and_one_step_matches_a_peft_twin"
    ),
    "value.lora_cfg.exclude_modules": T(
        "packages/grpo-train/tests/test_value_lora.py::test_only_adapters_and_head_train_and_one_step_matches_a_peft_twin"
    ),
    "value.lora_cfg.match_all_linear": T(
        "packages/grpo-train/tests/test_value_lora.py::test_dropout_reaches_the_adapters_of_all_linear_layers_and_rollout_values_are_deterministic"
    ),
    "value.lora_cfg.dim": T(
        "packages/grpo-train/tests/test_value_lora.py::test_only_adapters_and_head_train_and_one_step_matches_a_peft_twin"
    ),
    "value.lora_cfg.alpha": T(
        "packages/grpo-train/tests/test_value_lora.py::test_only_adapters_and_head_train_and_one_step_matches_a_peft_twin"
    ),
    "value.lora_cfg.dropout": T(
        "packages/grpo-train/tests/test_value_lora.py::test_dropout_reaches_the_adapters_of_all_linear_layers_and_rollout_values_are_deterministic"
    ),
    "value.lora_cfg.dropout_position": Refused("post"),
    "value.lora_cfg.lora_A_init": R("grpo_train/policy/lora.py"),
    "value.lora_cfg.refit": Refused("merged"),
    "value_loss_fn.value_clip": R("grpo_train/ppo/value_loss.py"),
    "value_loss_fn.token_level_loss": T(
        "packages/grpo-train/tests/test_packed_training.py::test_packing_matches_padded_with_sequence_level_loss_and_fused_head"
    ),
}


def _models(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def schema_leaves(model: type[BaseModel] = GRPOMasterConfig, prefix: str = "") -> list[str]:
    """Every leaf key path of the schema (the walk the table must cover)."""
    keys = []
    for attr, field in model.model_fields.items():
        name = field.alias or attr  # the key a config writes (`class`, not the attribute `class_`)
        inner = _models(field.annotation)
        if not inner:
            keys.append(prefix + name)
            continue
        label = name
        if typing.get_origin(field.annotation) is dict:
            label = f"{name}.<name>"
        elif prefix == "data." and name in ("default", "train", "validation"):
            label = "<entry>"
        keys += [k for k in schema_leaves(inner[0], f"{prefix}{label}.") if k not in keys]
    return list(dict.fromkeys(keys))


def test_every_schema_key_is_in_the_table():
    leaves = schema_leaves()
    assert len(leaves) > 150  # the walk reached the nested sections
    missing = [k for k in leaves if k not in TABLE]
    stale = [k for k in TABLE if k not in leaves]
    assert not missing, f"schema keys without a row in TABLE (say how a non-default value is proven): {missing}"
    assert not stale, f"TABLE rows for keys the schema no longer has: {stale}"


def test_cited_tests_exist_and_modules_read_their_key():
    problems = []
    for key, how in TABLE.items():
        leaf = key.rsplit(".", 1)[-1]
        if isinstance(how, T):
            path, name = how.test.split("::")
            text = (ROOT / path).read_text()
            if not re.search(rf"^(async )?def {name}\(", text, re.M):
                problems.append(f"{key}: {how.test} does not exist")
            elif not re.search(rf"\b{leaf}\b", text):
                problems.append(f"{key}: {path} never names {leaf!r}")
        elif isinstance(how, R):
            package = how.module.split("/")[0].replace("_", "-")
            text = (ROOT / "packages" / package / "src" / how.module).read_text()
            parent = [p for p in key.split(".")[:-1] if not p.startswith("<")][-1]
            if not (re.search(rf"\b{leaf}\b", text) and re.search(rf"\b{parent}\b", text)):
                problems.append(f"{key}: {how.module} does not name {parent!r} and {leaf!r}")
    assert not problems, "\n".join(problems)


REFUSED = [(k, how.value) for k, how in TABLE.items() if isinstance(how, Refused)]


def _set(config: dict, key: str, value) -> dict:
    node = config
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return config


@pytest.mark.parametrize(("key", "value"), REFUSED, ids=[k for k, _ in REFUSED])
def test_refused_keys_fail_at_their_key_path(key, value):
    with pytest.raises(ConfigError) as err:
        validate_config_dict(_set({}, key, value))
    message = str(err.value)
    assert key in message and "set " in message, message


class FakeGenerator:
    """Records each generate call; answers n samples per prompt, prompt_index local to the call."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, sampling):
        from grpo_train.generation.base import GenerationResult

        self.calls.append(len(prompts))
        return [
            GenerationResult(i, list(p), [k], [0.0], f"{p[0]}:{k}", "stop")
            for i, p in enumerate(prompts)
            for k in range(sampling.n)
        ]


def test_generation_batch_size_submits_prompts_in_chunks():
    from grpo_train.generation.base import SamplingSpec
    from grpo_train.rollout import single_turn as rollout

    prompts = [[100 + i] for i in range(7)]
    gen = FakeGenerator()
    results = rollout.generate_in_chunks(gen, prompts, SamplingSpec(n=2), chunk_size=3)
    assert gen.calls == [3, 3, 1]
    # prompt-major as one call would give: prompt i's two samples, prompt_index into all 7 prompts
    assert [(r.prompt_index, r.text) for r in results] == [(i, f"{100 + i}:{k}") for i in range(7) for k in range(2)]
    gen = FakeGenerator()
    rollout.generate_in_chunks(gen, prompts, SamplingSpec(n=2), chunk_size=32)
    assert gen.calls == [7]
    cfg = validate_config_dict({"policy": {"generation_batch_size": 3}})
    assert cfg.policy.generation_batch_size == 3


def test_deadline_saves_before_the_next_step_would_overrun():
    from grpo_train.config.schema import parse_duration
    from grpo_train.deadline import SaveDeadline

    assert parse_duration("00:03:45:00") == 3 * 3600 + 45 * 60  # NeMo RL's DD:HH:MM:SS
    assert parse_duration("01:00:30") == 3630
    now = [1000.0]
    deadline = SaveDeadline("00:00:01:00", clock=lambda: now[0])  # a 60 s budget
    steps = []
    for duration in (10, 10, 25, 5, 5):  # 10, 20, 45 (+25 longest = 70 >= 60: stop after step 3)
        now[0] += duration
        steps.append(deadline.step_done())
        if steps[-1]:
            break
    assert steps == [False, False, True]
    assert deadline.longest_step_s == 25
    assert not SaveDeadline(None, clock=lambda: now[0]).step_done()
    with pytest.raises(ConfigError, match="checkpointing.checkpoint_must_save_by"):
        validate_config_dict({"checkpointing": {"checkpoint_must_save_by": "soon"}})
    with pytest.raises(ConfigError, match="checkpointing.enabled: true"):
        validate_config_dict({"checkpointing": {"enabled": False, "checkpoint_must_save_by": "01:00:00"}})


@pytest.mark.parametrize(("clip_max", "loss"), [(0.2, -1.2), (0.4, -1.4)])
def test_ratio_clip_max_is_the_upper_clip(clip_max, loss):
    """DAPO clip-higher by hand: r = 1.5, A = +1 -> max(-A r, -A clamp(r, 0.8, 1 + clip_max))."""
    import math

    import torch

    from grpo_kernels import reference
    from grpo_kernels.loss_config import PGLossConfig

    f64 = dict(dtype=torch.float64)
    curr = torch.tensor([[math.log(1.5)]], **f64, requires_grad=True)
    zeros, ones = torch.zeros(1, 1, **f64), torch.ones(1, 1, **f64)
    cfg = PGLossConfig(reference_policy_kl_penalty=0.0, ratio_clip_max=clip_max)
    value, _ = reference.clipped_pg_loss(curr, zeros, zeros, None, ones, ones, torch.ones(1, **f64), cfg, 1, 1, None)
    assert value.item() == pytest.approx(loss, abs=1e-12)


# ----------------------------------------------------------------- one declaration per key
# Keys whose name is also a field of a leaf package's config but that are another concept.
SAME_NAME_OTHER_CONCEPT = {
    ("ValueLossConfig", "token_level_loss"): "the value loss's own aggregation, not the policy loss's",
    ("GRPOConfig", "seed"): "the run's seed; a dataset entry's seed carves its validation rows",
    ("TokenizerConfig", "chat_template_kwargs"): "the policy tokenizer's; an entry's applies to its own prompts",
}


def _sections(model: type[BaseModel] = GRPOMasterConfig, prefix: str = "") -> dict[str, type[BaseModel]]:
    """Every section model of the schema by key path (`data.<entry>` for dataset entries)."""
    found = {prefix.rstrip(".") or "<root>": model}
    for name, field in model.model_fields.items():
        for inner in _models(field.annotation):
            label = "<entry>" if prefix == "data." and name in ("default", "train", "validation") else name
            found.update(_sections(inner, f"{prefix}{label}."))
    return found


def _declaration_sites(section: type[BaseModel], name: str) -> list[str]:
    """Where the key `name` of `section` is written down: a class body in the schema, or the leaf
    package's dataclass that a section made by `schema.section_of` takes its fields from."""
    sites = []
    for cls in section.__mro__:
        component = cls.__dict__.get("__declared_in__")
        if component is not None:
            if name in {f.name for f in dataclasses.fields(component)}:
                sites.append(f"{component.__module__}.{component.__qualname__}")
        elif name in cls.__dict__.get("__annotations__", {}):
            sites.append(f"{cls.__module__}.{cls.__qualname__}")
    return sites


def test_every_schema_key_is_declared_once():
    """`grpo config show` is the single truth: each key (section + name) has one declaration, in a
    schema class or in the leaf package's own config it comes from, never in both (issue #17)."""
    from grpo_train.config import schema

    leaf_configs = [
        obj
        for obj in vars(schema).values()
        if dataclasses.is_dataclass(obj)
        and isinstance(obj, type)
        and obj.__module__.split(".")[0] in ("grpo_kernels", "grpo_data", "grpo_envs")
    ]
    assert {c.__name__ for c in leaf_configs} >= {"PGLossConfig", "DatasetEntry"}
    leaf_names = {f.name for c in leaf_configs for f in dataclasses.fields(c)}
    sections = _sections()
    assert len(sections) > 30 and "loss_fn" in sections and "data.<entry>" in sections
    problems = []
    for path, section in sections.items():
        for name in section.model_fields:
            sites = _declaration_sites(section, name)
            if len(sites) != 1:
                problems.append(f"{path}.{name}: declared in {sites or 'no class body'}")
            elif sites[0].startswith("grpo_train.") and name in leaf_names:
                if (sites[0].rsplit(".", 1)[-1], name) not in SAME_NAME_OTHER_CONCEPT:
                    problems.append(f"{path}.{name}: declared in {sites[0]} and in a leaf package's config")
    # Each leaf config the schema imports is the source of a section, not a copy beside one.
    sources = {s.__dict__.get("__declared_in__") for c in sections.values() for s in c.__mro__}
    problems += [
        f"{c.__qualname__}: imported by the schema but no section takes its fields"
        for c in leaf_configs
        if c not in sources
    ]
    assert not problems, "\n".join(problems)


def test_declared_once_check_catches_a_copied_key():
    """The check above fails on the pattern it guards against: a schema class re-declaring a
    field of the loss op's config (as LossConfig did before), and a subclass re-declaring a key."""
    from pydantic import create_model

    from grpo_train.config.schema import LossConfig, Section

    copied = create_model("CopiedLoss", __base__=Section, ratio_clip_min=(float, 0.2))
    copied.__module__ = "grpo_train.config.schema"
    assert _declaration_sites(copied, "ratio_clip_min") == ["grpo_train.config.schema.CopiedLoss"]

    class Twice(LossConfig):
        ratio_clip_max: float = 0.3

    assert len(_declaration_sites(Twice, "ratio_clip_max")) == 2
    assert _declaration_sites(LossConfig, "ratio_clip_max") == ["grpo_kernels.loss_config.PGLossConfig"]
    assert _declaration_sites(LossConfig, "use_kl_in_reward") == ["grpo_train.config.schema.loss.LossConfig"]


def test_the_data_section_is_grpo_datas_own_config():
    """The data section's keys are declared by grpo-data (grpo_data.config.DataConfig); the
    schema's section hands grpo-data that very object, entries included."""
    import grpo_data.config
    from grpo_train.config.schema import DataConfig, DatasetConfig

    data_keys = [f.name for f in dataclasses.fields(grpo_data.config.DataConfig)]
    assert list(DataConfig.model_fields) == data_keys
    assert {_declaration_sites(DataConfig, k)[0] for k in data_keys} == {"grpo_data.config.DataConfig"}
    section = DataConfig(
        train=[DatasetConfig(dataset_name="arithmetic", size=3), DatasetConfig(dataset_name="GSM8K")],
        shuffle=False,
        num_workers=2,
    )
    assert section.data_config() == grpo_data.config.DataConfig(
        train=[
            grpo_data.config.DatasetEntry(dataset_name="arithmetic", size=3),
            grpo_data.config.DatasetEntry(dataset_name="GSM8K"),
        ],
        shuffle=False,
        num_workers=2,
    )
    assert DataConfig().data_config() == grpo_data.config.DataConfig()  # the same defaults
