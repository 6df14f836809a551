"""Context parallelism (policy/context_parallel.py) on two real gloo ranks against one unsharded model.

Each rank builds the same random tiny model (Qwen2 with grouped KV heads, tied head; Llama, untied)
and runs one right-padded batch twice: plainly (`sequence_logprobs`, the oracle) and with the
sequence sharded over a CP=2 mesh (`cp_sequence_logprobs`: torch's context_parallel with its
head-tail load balancing, the model's SDPA run as torch's ring attention through the CPU flash
kernel). The logprobs, the clipped PG loss and every parameter's gradient (summed over the CP
group, as the worker does) must equal the oracle's (fp32, 1e-5 relative). The backward runs after
the CP context has exited, as the training step's does. Rank 0 runs in the test process, rank 1 in
a child process that loads this file by path.
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
    common = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0,
                  attn_implementation="sdpa")
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
    loss, _ = clipped_pg_loss(lp, prev, prev, prev - 0.1 * token_mask, advantages[:, None] * token_mask, token_mask,
                              torch.ones(lp.shape[0]), cfg, float(token_mask.sum()), float(lp.shape[0]))
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

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        for kind in ("qwen2", "llama"):
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


CHILD = """
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("context_parallel_rank", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
torch.set_num_threads(1)
module.run_rank(1, int(sys.argv[2]))
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_cp2_logprobs_loss_and_gradients_match_one_unsharded_model():
    port = free_port()
    child = subprocess.Popen([sys.executable, "-c", CHILD, __file__, str(port)], stderr=subprocess.PIPE, text=True)
    try:
        run_rank(0, port)
    finally:
        _, err = child.communicate(timeout=240)
    assert child.returncode == 0, err[-3000:]


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
