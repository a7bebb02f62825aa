"""A tiny byte-level BPE tokenizer with a ChatML chat template, trained here on a few texts (no download), saved
beside a tiny checkpoint so ``data.tokenizer=${model.path}`` finds it."""

from __future__ import annotations

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer_dir(directory, texts: list[str], vocab_size: int = 320, chat_template: str | None = CHATML) -> int:
    """Save a fast tokenizer into ``directory``; returns its vocabulary size (the model's must cover it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(str(directory))
    return len(fast)
