"""Context parallelism (policy/context_parallel.py) on two real gloo ranks against one unsharded model.

Each rank builds the same random tiny model (Llama: grouped KV heads, untied head)
and runs one right-padded batch twice: plainly (`sequence_logprobs`, the oracle) and with the
sequence sharded over a CP=2 mesh (`cp_sequence_logprobs`: torch's context_parallel with its
head-tail load balancing, the model's SDPA run as torch's ring attention through the CPU flash
kernel). The logprobs, the clipped PG loss and every parameter's gradient (summed over the CP
group, as the worker does) must equal the oracle's (fp32, 1e-5 relative). The backward runs after
the CP context has exited, as the training step's does. Rank 0 runs in the test process, rank 1 in
a child process that loads this file by path.

The worker-level test runs the real `PolicyWorker` code path with
`policy.dtensor_cfg.context_parallel_size: 2` (init_distributed's dp x cp mesh, logprob and train
micro-batches, the gradient sum over cp, clipping, the SGD step) on two gloo ranks against one
unsharded worker: policy and reference logprobs, train metrics, gradients and updated weights.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch

RTOL = 1e-5
ATOL = 1e-7  # k_proj.bias: an exactly-zero gradient in exact arithmetic (see test_fsdp.py)


def tiny_model(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **common)).float().train()
    return LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **common)).float().train()


def make_batch():
    """Two rows, width 150 (not a multiple of 2 * cp: CP pads), the second right-padded to 97 tokens."""
    g = torch.Generator().manual_seed(0)
    S = 150
    lengths = torch.tensor([S, 97])
    attention_mask = (torch.arange(S)[None, :] < lengths[:, None]).long()
    input_ids = torch.randint(3, 64, (2, S), generator=g) * attention_mask
    token_mask = attention_mask.float()
    token_mask[:, :20] = 0  # the prompt
    return input_ids, attention_mask, token_mask, torch.tensor([1.0, -0.5])


def pg_loss(lp, token_mask, advantages):
    from grpo_kernels import PGLossConfig, clipped_pg_loss

    prev = (lp.detach() + 0.05 * torch.cos(torch.arange(lp.numel()).view_as(lp).float())) * token_mask
    cfg = PGLossConfig(reference_policy_kl_penalty=0.1, ratio_clip_min=0.2, ratio_clip_max=0.2)
    loss, _ = clipped_pg_loss(
        lp,
        prev,
        prev,
        prev - 0.1 * token_mask,
        advantages[:, None] * token_mask,
        token_mask,
        torch.ones(lp.shape[0]),
        cfg,
        float(token_mask.sum()),
        float(lp.shape[0]),
    )
    return loss


def step(model, mesh=None):
    """logprobs [B, S], loss, {name: gradient} of one forward/backward (CP: gradients summed over the mesh)."""
    import torch.distributed as dist

    from grpo_train.policy.context_parallel import cp_sequence_logprobs
    from grpo_train.policy.logprobs import sequence_logprobs

    input_ids, attention_mask, token_mask, advantages = make_batch()
    model.zero_grad(set_to_none=True)
    if mesh is None:
        lp = sequence_logprobs(model, input_ids, attention_mask, temperature=0.7)
    else:
        lp = cp_sequence_logprobs(model, input_ids, attention_mask, temperature=0.7, mesh=mesh)
    loss = pg_loss(lp, token_mask, advantages)
    loss.backward()  # outside the CP context: the ring backward runs from the base handler table
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.detach().clone()
        if mesh is not None:
            dist.all_reduce(grad, group=mesh.get_group())
        grads[name] = grad
    return lp.detach(), loss.detach(), grads


def assert_close(got, want, what):
    diff = float((got - want).norm())
    assert diff <= RTOL * float(want.norm()) + ATOL, (what, diff, float(want.norm()))


def run_rank(rank: int, port: int) -> None:
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        for kind in ("llama",):  # GQA, untied head; the worker test below runs the tied Qwen2
            model = tiny_model(kind)
            want_lp, want_loss, want_grads = step(model)
            lp, loss, grads = step(model, mesh)
            what = f"{kind} rank {rank}"
            assert want_lp[1, 97:].abs().max() == 0 and lp[1, 97:].abs().max() == 0, what  # padding scores 0
            assert_close(lp, want_lp, what + " logprobs")
            assert_close(loss, want_loss, what + " loss")
            for name in want_grads:
                assert_close(grads[name], want_grads[name], f"{what} grad {name}")
            again, _, _ = step(model)  # plain SDPA is untouched once the ring handlers are registered
            assert torch.equal(again, want_lp), what
    finally:
        dist.destroy_process_group()


def worker_cfg(num_workers: int, cp: int):
    from grpo_train.config.schema import DTensorConfig, PolicyConfig

    return PolicyConfig(
        precision="float32",
        train_global_batch_size=2,
        train_micro_batch_size=1,
        logprob_batch_size=2,
        max_grad_norm=1.0,
        num_workers=num_workers,
        generation={"temperature": 0.7},
        optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 0.5, "momentum": 0.9}},
        dtensor_cfg=DTensorConfig(enabled=False, context_parallel_size=cp),
    )


def worker_batch():
    """Two right-padded rows of 130 and 71 tokens, 10 prompt tokens masked."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([130, 71])
    attention_mask = (torch.arange(130)[None, :] < lengths[:, None]).long()
    token_mask = attention_mask.float().clone()
    token_mask[:, :10] = 0
    return {
        "input_ids": torch.randint(3, 64, (2, 130), generator=g) * attention_mask,
        "attention_mask": attention_mask,
        "token_mask": token_mask,
        "gen_logprobs": -torch.rand(2, 130, generator=g) * token_mask,
        "advantages": torch.tensor([[1.0], [-0.7]]) * token_mask,
        "sample_mask": torch.ones(2),
    }


def run_worker_rank(rank: int, port: int, model_dir: str, batch: dict) -> dict:
    """One CP rank's logprobs (policy, reference), train metrics, gradients and weights after the step."""
    from grpo_train.config.schema import LossConfig
    from grpo_train.policy.worker import PolicyWorker

    worker = PolicyWorker(
        model_dir, worker_cfg(2, 2), LossConfig(reference_policy_kl_penalty=0.05), seed=0, rank=rank, world_size=2
    )
    try:
        worker.init_distributed("127.0.0.1", port)
        out = {"logprobs": worker.logprobs(batch), "reference": worker.logprobs(batch, reference=True)}
        out["attention"] = worker.model.config._attn_implementation  # CP's (no mask under CP, SDPA's otherwise)
        out["metrics"] = worker.train(batch)
        out["gradients"], out["weights"] = worker.gradients(), worker.master_weights()
        return out
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def prepared_batch(model_dir: str):
    """The worker batch with prev/ref logprobs from one unsharded worker, and that worker (not yet trained)."""
    from grpo_train.config.schema import LossConfig
    from grpo_train.policy.worker import PolicyWorker

    single = PolicyWorker(model_dir, worker_cfg(1, 1), LossConfig(reference_policy_kl_penalty=0.05), seed=0)
    batch = worker_batch()
    batch["prev_logprobs"] = single.logprobs(batch) + 0.02 * batch["token_mask"]  # off-policy: ratios != 1
    batch["ref_logprobs"] = single.logprobs(batch, reference=True) - 0.05 * batch["token_mask"]
    return batch, single


CHILD = """
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("context_parallel_rank", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
torch.set_num_threads(1)
module.run_rank(1, int(sys.argv[2]))
module.run_worker_rank(1, int(sys.argv[3]), sys.argv[4], module.prepared_batch(sys.argv[4])[0])
# Every check ran above (a failure raises with its traceback first); skip the interpreter's teardown, where a
# native thread once aborted test_tensor_parallel's twin child after all its checks had passed.
import os
os._exit(0)
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_cp2_model_and_policy_workers_match_one_unsharded(tiny_qwen2_dir):
    """The model-level check (Llama, run_rank), then the real PolicyWorker path (Qwen2) in the same two
    processes (one start-up for both)."""
    from grpo_train.policy.context_parallel import CP_ATTENTION

    ports = free_port(), free_port()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, __file__, *map(str, ports), tiny_qwen2_dir], stderr=subprocess.PIPE, text=True
    )
    try:
        run_rank(0, ports[0])
        batch, single = prepared_batch(tiny_qwen2_dir)
        got = run_worker_rank(0, ports[1], tiny_qwen2_dir, batch)
    finally:
        _, err = child.communicate(timeout=240)
    assert child.returncode == 0, err[-3000:]
    assert got["attention"] == CP_ATTENTION
    assert_close(got["logprobs"], single.logprobs(batch), "logprobs")
    assert_close(got["reference"], single.logprobs(batch, reference=True), "reference logprobs")
    want = single.train(batch)
    for key in ("loss", "grad_norm"):
        assert abs(got["metrics"][key] - want[key]) <= RTOL * abs(want[key]) + ATOL, (
            key,
            got["metrics"][key],
            want[key],
        )
    assert got["metrics"]["grad_norm"] > 0
    for what, want_tensors in (("gradients", single.gradients()), ("weights", single.master_weights())):
        assert got[what].keys() == want_tensors.keys() and want_tensors, what
        for name in want_tensors:
            assert_close(got[what][name], want_tensors[name], f"{what} {name}")


def test_torch_private_context_parallel_api_is_where_we_drive_it():
    """Pins the private torch API the CPU ring attention depends on: a torch upgrade that moves any of
    it fails here, naming what moved, instead of silently losing the ring (policy/context_parallel.py)."""
    import torch.distributed.tensor.experimental._context_parallel._attention as cpa
    from torch.distributed.tensor import DTensor

    from grpo_train.policy.context_parallel import check_torch_api, register_cpu_ring_attention

    check_torch_api()
    assert cpa.existing_custom_ops is DTensor._op_dispatcher._custom_op_handlers  # outside any CP context
    register_cpu_ring_attention()
    for op in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"):
        assert getattr(torch.ops.aten, op).default in cpa.existing_custom_ops, op
    # the CUDA kernels torch itself rings stay torch's
    assert cpa.custom_ops[torch.ops.aten._scaled_dot_product_flash_attention.default] is cpa._sdpa_handler


def test_left_padded_rows_are_refused():
    from grpo_train.policy.context_parallel import _check_right_padded

    _check_right_padded(torch.tensor([[1, 1, 1, 0]]))
    with pytest.raises(ValueError, match="right-padded rows"):
        _check_right_padded(torch.tensor([[0, 1, 1, 1]]))


CP = {"context_parallel_size": 2, "enabled": False}


@pytest.mark.parametrize(
    ("policy", "key"),
    [
        ({"dtensor_cfg": {**CP, "tensor_parallel_size": 2}}, "policy.dtensor_cfg.context_parallel_size"),
        ({"dtensor_cfg": {"context_parallel_size": 2}}, "policy.dtensor_cfg.enabled: false"),
        ({"dtensor_cfg": {**CP, "activation_checkpointing": True}}, "policy.dtensor_cfg.context_parallel_size"),
        ({"dtensor_cfg": {**CP, "lora_cfg": {"enabled": True}}}, "policy.dtensor_cfg.context_parallel_size"),
        ({"dtensor_cfg": CP, "sequence_packing": {"enabled": True}}, "policy.sequence_packing"),
        ({"dtensor_cfg": CP, "moe_aux_loss_coeff": 0.01}, "policy.moe_aux_loss_coeff"),
        (
            {"dtensor_cfg": {**CP, "context_parallel_size": 3}},
            "policy.dtensor_cfg.context_parallel_size (3) must divide",
        ),
    ],
    ids=["tp", "fsdp2", "activation_checkpointing", "lora", "packing", "moe_aux", "num_workers"],
)
def test_unsupported_combinations_are_refused_at_their_keys(policy, key):
    from grpo_train.config import ConfigError, validate_config_dict

    cfg = {"policy": {"num_workers": 4, "train_global_batch_size": 4, "train_micro_batch_size": 1, **policy}}
    with pytest.raises(ConfigError) as err:
        validate_config_dict(cfg)
    assert key in str(err.value) and len(str(err.value).splitlines()) == 1, str(err.value)
    ok = {"policy": {"num_workers": 4, "train_global_batch_size": 2, "train_micro_batch_size": 1, "dtensor_cfg": CP}}
    assert validate_config_dict(ok).policy.dtensor_cfg.context_parallel_size == 2  # dp 2: 2 rows per step


def test_models_cp_cannot_ring_are_refused_at_startup():
    """Before any actor: a non-SDPA attention, a sliding window or attention soft-capping names the key."""
    from transformers import Gemma2Config, MistralConfig

    from grpo_train.policy.context_parallel import cp_model_problem

    config = tiny_model("llama").config
    assert cp_model_problem(config) is None
    config._attn_implementation = "eager"
    assert "attn_implementation='eager'" in cp_model_problem(config)
    assert "sliding_window=64" in cp_model_problem(MistralConfig(sliding_window=64))
    assert "soft-caps" in cp_model_problem(Gemma2Config(sliding_window=None, attn_logit_softcapping=50.0))
