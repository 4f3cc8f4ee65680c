"""Which token ids end a sequence: the model's generation config, its tokenizer, and its chat template's turn end."""

from __future__ import annotations


def end_of_sequence_ids(path: str, tokenizer) -> list[int]:
    """Every token id that ends a sequence: the model's ``generation_config.eos_token_id`` (an int or a list: Llama
    3.1 lists ``<|end_of_text|>``, ``<|eom_id|>`` and ``<|eot_id|>``, Qwen2.5 ``<|endoftext|>`` and ``<|im_end|>``),
    the tokenizer's own EOS, and the token its chat template ends an assistant turn with (:func:`chat_turn_end`),
    which a generation_config does not always list (the demo family's lists only its end of text)."""
    from pathlib import Path

    from transformers import GenerationConfig

    try:  # a local model's directory is read, never looked up on the Hub (which retries for ~20 s when offline)
        listed = GenerationConfig.from_pretrained(path, local_files_only=Path(path).is_dir()).eos_token_id
    except (OSError, ValueError):  # no generation_config.json
        listed = None
    ids = [listed] if isinstance(listed, int) else list(listed or [])
    ids += [getattr(tokenizer, "eos_token_id", None), chat_turn_end(tokenizer)]
    return list(dict.fromkeys(i for i in ids if i is not None))


_TURN_PROBE = "Cascade probes where this turn ends"


def chat_turn_end(tokenizer) -> int | None:
    """The special token a tokenizer's chat template writes right after an assistant message (``<|im_end|>`` in
    ChatML, ``<|eot_id|>`` in Llama 3): a chat reply ends there. None without a template, or when what follows the
    message is not a special token."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    conversation = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": _TURN_PROBE}]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
    except Exception:  # noqa: BLE001 - a template may reject this conversation: then there is nothing to learn
        return None
    _, found, after = text.partition(_TURN_PROBE)
    ids = tokenizer.encode(after, add_special_tokens=False) if found else []
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    return ids[0] if ids and ids[0] in special else None
