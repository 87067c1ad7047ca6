"""Tiny real transformers models and an in-memory tokenizer for the real-model tier.

Nothing is downloaded: every model is its real transformers class built from a small config with
dropout off, and the tokenizer is trained in memory with ``tokenizers`` on a fixed corpus. Builders
take a seed so that the same call under transformers' Trainer and ours starts from equal weights.
"""

from __future__ import annotations

from typing import Any

import torch

WORDS = tuple(
    (  # noqa: SIM905 - one readable line of words
        "the a one two three red green blue cat dog bird runs jumps sleeps eats fast slow big "
        "small happy sad old new house tree river sky sun moon day night good bad"
    ).split()
)


def corpus(n: int = 64, seed: int = 0) -> list[str]:
    """``n`` short sentences of the fixed vocabulary, varying lengths (padding is exercised)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(3, 12, (1,), generator=gen))
        idx = torch.randint(0, len(WORDS), (length,), generator=gen).tolist()
        out.append(" ".join(WORDS[i] for i in idx))
    return out


def tokenizer(model_max_length: int = 32) -> Any:
    """A word-level fast tokenizer (pad, unk, bos/cls, eos/sep, mask) trained in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        bos_token="[CLS]",
        eos_token="[SEP]",
        model_max_length=model_max_length,
    )


def _ids(tok: Any) -> dict[str, int]:
    return {
        "vocab_size": len(tok),
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
    }


def gpt2(tok: Any, seed: int = 0, dropout: float = 0.0) -> Any:
    """``dropout`` > 0 for the scripts that check the global RNG stream (dropout masks)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=dropout, embd_pdrop=dropout,
        attn_pdrop=dropout, **_ids(tok),
    )  # fmt: skip
    return GPT2LMHeadModel(cfg)


def llama(tok: Any, seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, **_ids(tok),
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def bert_classifier(tok: Any, num_labels: int = 2, seed: int = 0) -> Any:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    cfg = BertConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        classifier_dropout=0.0, num_labels=num_labels, vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    return BertForSequenceClassification(cfg)


def t5(tok: Any, seed: int = 0) -> Any:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = T5Config(
        d_model=32, d_ff=64, d_kv=16, num_layers=2, num_decoder_layers=2, num_heads=2,
        dropout_rate=0.0, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, decoder_start_token_id=tok.pad_token_id,
    )  # fmt: skip
    return T5ForConditionalGeneration(cfg)


def causal_lm_dataset(tok: Any, n: int = 32, seed: int = 0) -> Any:
    """A ``datasets.Dataset`` with ``text`` still present and ``input_ids`` / ``attention_mask``."""
    import datasets

    ds = datasets.Dataset.from_dict({"text": corpus(n, seed)})
    return ds.map(lambda b: tok(b["text"], truncation=True), batched=True)


def classification_dataset(tok: Any, n: int = 32, seed: int = 0) -> Any:
    """Sentences labelled 1 when they hold a 'good'/'happy' word: learnable, with ``text`` kept."""
    import datasets

    texts = corpus(n, seed)
    labels = [int(any(w in t.split() for w in ("good", "happy", "sun"))) for t in texts]
    ds = datasets.Dataset.from_dict({"text": texts, "label": labels})
    return ds.map(lambda b: tok(b["text"], truncation=True), batched=True)


def seq2seq_dataset(tok: Any, n: int = 32, seed: int = 0) -> Any:
    """Source -> its words reversed, as ``input_ids`` / ``labels``."""
    import datasets

    texts = corpus(n, seed)
    targets = [" ".join(reversed(t.split())) for t in texts]
    ds = datasets.Dataset.from_dict({"text": texts, "target": targets})

    def encode(batch: dict[str, list[str]]) -> dict[str, Any]:
        enc = tok(batch["text"], truncation=True)
        enc["labels"] = tok(text_target=batch["target"], truncation=True)["input_ids"]
        return enc

    return ds.map(encode, batched=True, remove_columns=["text", "target"])


def _bert_config(tok: Any, **extra: Any) -> Any:
    from transformers import BertConfig

    return BertConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        classifier_dropout=0.0, vocab_size=len(tok), pad_token_id=tok.pad_token_id, **extra,
    )  # fmt: skip


def bert_masked_lm(tok: Any, seed: int = 0) -> Any:
    from transformers import BertForMaskedLM

    torch.manual_seed(seed)
    return BertForMaskedLM(_bert_config(tok))


def bert_token_classifier(tok: Any, num_labels: int = 3, seed: int = 0) -> Any:
    from transformers import BertForTokenClassification

    torch.manual_seed(seed)
    return BertForTokenClassification(_bert_config(tok, num_labels=num_labels))


def bert_question_answering(tok: Any, seed: int = 0) -> Any:
    from transformers import BertForQuestionAnswering

    torch.manual_seed(seed)
    return BertForQuestionAnswering(_bert_config(tok))


def bart(tok: Any, seed: int = 0) -> Any:
    """A tiny BART (encoder-decoder with learned positions; decoder starts with eos, as BART)."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(seed)
    cfg = BartConfig(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=64,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, **_ids(tok),
        decoder_start_token_id=tok.eos_token_id, forced_eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    return BartForConditionalGeneration(cfg)
