"""Save a tiny MLA checkpoint (a DeepSeek-V3-style model with random weights, a word-level tokenizer and a chat
template) to a folder, for trying the server, or anything else that loads a checkpoint, on any machine. Nothing is
downloaded: the tokenizer is built here with the tokenizers library.

    python examples/tiny_checkpoint.py tiny-mla
    python -m hf_flashinfer_mla.serve tiny-mla

Its answers are random words: the weights are random. The tokenizer knows the words in `WORDS` (in any case, split on
spaces); any other word is `<unk>`. The tests' checkpoints use the same tokenizer with their own words
(`save_tokenizer`).
"""

from __future__ import annotations

import argparse
import os
import sys

PROG = "python examples/tiny_checkpoint.py"
WORDS = sorted(set("""
the of and to a in is it you that he was for on are with as his they be at one have this from or had by word but
what some we can out other were all there when up use your how said an each she which do their time if will way about
many then them write would like so these her long make thing see him two has look more day could go come did number
sound no most people my over know water than call first who may down side been now find any new work part take get
place made live where after back little only round man year came show every good me give our under name very through
just form sentence great think say help low line differ turn cause much mean before move right boy old too same tell
does set three want air well also play small end put home read hand port large spell add even land here must big high
such follow act why ask men change went light kind off need house picture try us again animal point mother world near
build self earth father head stand own page should country found answer school grow study still learn plant cover
food sun four between state keep eye never last let thought city tree cross farm hard start might story saw far sea
draw left late run while press close night real life few north hello capital france paris question model attention
latent cache token
""".split()))
SPECIAL = ("<pad>", "<user>", "<bot>", "<unk>")
CHAT_TEMPLATE = ("{% for m in messages %}<user> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<bot>{% endif %}")


def save_tokenizer(path, words) -> int:
    """A word-level tokenizer of `words` with a chat template, saved to `path`: ``<pad>`` is id 0, ``words[i]`` id
    i + 1, then ``<user>``, ``<bot>`` and ``<unk>``. Returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pad, user, bot, unk = SPECIAL
    vocab = {pad: 0, **{word: i + 1 for i, word in enumerate(words)}}
    vocab.update({user: len(vocab), bot: len(vocab) + 1, unk: len(vocab) + 2})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=pad, unk_token=unk)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return len(vocab)


def tiny_model(vocab_size: int):
    """A 2-layer DeepSeek-V3-style model (MLA with a q_lora, MoE) with random weights, float32."""
    import torch
    import transformers

    config = transformers.DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=1024, pad_token_id=0, eos_token_id=None,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def save_checkpoint(path, model=None, words=WORDS) -> None:
    """`model` (default: `tiny_model`) and `save_tokenizer(words)` saved to `path`. The model has no end-of-sequence
    token: its random answers run to their max_tokens (or the context)."""
    vocab_size = save_tokenizer(path, words)
    model = tiny_model(vocab_size) if model is None else model
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="where to save it (created; the files of a checkpoint there are replaced)")
    folder = parser.parse_args(argv).folder
    if os.path.exists(folder) and not os.path.isdir(folder):
        print(f"{PROG}: error: {folder}: not a directory", file=sys.stderr)
        return 2
    os.makedirs(folder, exist_ok=True)
    save_checkpoint(folder)
    print(f"Saved a tiny random DeepSeek-V3-style checkpoint to {folder}. Serve it with:\n"
          f"    python -m hf_flashinfer_mla.serve {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
