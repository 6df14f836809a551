"""A tiny, fully known tokenizer for tests and benchmarks (built locally, nothing downloaded).

Character level: every character of `CHARS` is one token, and the chat markers are special
tokens. Ids are fixed, so tests can assert exact token ids:
0 <pad>, 1 <unk>, 2 <bos>, 3 <eos>, 4 <|system|>, 5 <|user|>, 6 <|assistant|>, 7 <|end|>,
8 <|nothink|>, then `CHARS` in order from 9 ("0" is 9, "9" is 18, "+" is 19, ...).
"""

from __future__ import annotations

import string

SPECIAL_TOKENS = [
    "<pad>",
    "<unk>",
    "<bos>",
    "<eos>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
    "<|nothink|>",
]
CHARS = string.digits + "+-*=" + " \n" + string.ascii_lowercase + string.ascii_uppercase + ".,:;?!'\"()#$/\\{}[]^_<>|"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<|nothink|>{% endif %}{% endif %}"
)


def token_id(char_or_special: str) -> int:
    """The id the tiny tokenizer gives one character or special token."""
    if char_or_special in SPECIAL_TOKENS:
        return SPECIAL_TOKENS.index(char_or_special)
    return len(SPECIAL_TOKENS) + CHARS.index(char_or_special)


def make_char_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    """A `PreTrainedTokenizerFast` that splits text into single characters (see module doc)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: token_id(tok) for tok in SPECIAL_TOKENS}
    vocab.update({c: token_id(c) for c in CHARS})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>", eos_token="<eos>"
    )
    fast.chat_template = chat_template
    return fast
