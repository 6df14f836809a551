"""Reward model: a Hugging Face sequence-classification (Bradley–Terry) model scores conversations.

The conversation is rendered to text with the tokenizer's chat template when it has one (else
``"role: content"`` lines), tokenised with right padding, and scored in batches sorted by
length; the reward is the logit ``score_index`` of the last real token. Run it on Ray through
``EnvPool("reward_model", {...}, num_workers=1, actor_options={"num_gpus": 1})``.

Needs the ``reward-model`` extra: ``pip install "grpo-envs[reward-model]"``.
"""

from __future__ import annotations

from grpo_envs.base import Environment, EnvOutput, single_turn_output

EXTRA_HINT = 'the reward_model env needs torch and transformers: pip install "grpo-envs[reward-model]"'


def _import_backend():
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise ImportError(f"{EXTRA_HINT} ({exc})") from exc
    return torch, transformers


class RewardModelEnv(Environment):
    """Reward = the score of a sequence-classification model for the whole conversation.

    Args:
        model_name_or_path: local folder or hub name of an ``AutoModelForSequenceClassification``.
        batch_size: conversations per forward pass.
        max_length: longer conversations are truncated (from the right; counted in metadata).
        device: ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
        dtype: ``"auto"`` (bfloat16 on CUDA, float32 on CPU) or a torch dtype name.
        use_chat_template: render with the tokenizer's chat template (None: when it has one).
        score_index: which logit is the reward (0 for a one-label Bradley–Terry head).
    """

    def __init__(
        self,
        model_name_or_path: str,
        batch_size: int = 8,
        max_length: int = 4096,
        device: str = "auto",
        dtype: str = "auto",
        use_chat_template: bool | None = None,
        score_index: int = 0,
        trust_remote_code: bool = False,
    ) -> None:
        torch, transformers = _import_backend()
        if batch_size < 1 or max_length < 1:
            raise ValueError(
                f"reward_model env: batch_size and max_length must be >= 1, got {batch_size}, {max_length}"
            )
        self._torch = torch
        self.device = torch.device(
            "cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device
        )
        if dtype == "auto":
            torch_dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        else:
            torch_dtype = getattr(torch, dtype)
        try:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(
                model_name_or_path, trust_remote_code=trust_remote_code
            )
            self.model = transformers.AutoModelForSequenceClassification.from_pretrained(
                model_name_or_path, dtype=torch_dtype, trust_remote_code=trust_remote_code
            )
        except OSError as exc:
            raise OSError(
                f"reward_model env: cannot load {model_name_or_path!r} ({exc}); point model_name_or_path "
                "at a local folder holding the model and its tokenizer"
            ) from exc
        self.model.to(self.device).eval()
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.padding_side = "right"  # causal models: right padding keeps positions intact
        self.batch_size = batch_size
        self.max_length = max_length
        self.use_chat_template = bool(self.tokenizer.chat_template) if use_chat_template is None else use_chat_template
        self.score_index = score_index

    def render(self, message_log: list[dict]) -> str:
        """The text the model scores for one conversation."""
        messages = [{"role": str(m.get("role", "")), "content": str(m.get("content") or "")} for m in message_log]
        if self.use_chat_template:
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return "\n".join(f"{m['role']}: {m['content']}" for m in messages)

    def step(self, message_logs: list[list[dict]], env_infos: list[dict]) -> EnvOutput:
        encoded = [
            self.tokenizer(self.render(log), add_special_tokens=not self.use_chat_template)["input_ids"]
            for log in message_logs
        ]
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))  # less padding per batch
        scores = [0.0] * len(encoded)
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            for i, score in zip(idx, self._score([encoded[i][: self.max_length] for i in idx])):
                scores[i] = score
        metadata = [{"score": s, "truncated": len(e) > self.max_length} for s, e in zip(scores, encoded)]
        n = len(scores)
        return single_turn_output(scores, metadata, {"score_mean": sum(scores) / n if n else 0.0})

    def _score(self, input_ids: list[list[int]]) -> list[float]:
        torch = self._torch
        batch = self.tokenizer.pad({"input_ids": input_ids}, return_tensors="pt").to(self.device)
        with torch.inference_mode():
            logits = self.model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).logits  # [b, labels]
        return logits[:, self.score_index].float().cpu().tolist()

    def close(self) -> None:
        self.model = None
        if self.device.type == "cuda":
            self._torch.cuda.empty_cache()
