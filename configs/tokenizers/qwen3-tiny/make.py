"""Rebuild this directory's tokenizer.json from ../smollm2 (run from anywhere):

    python configs/tokenizers/qwen3-tiny/make.py

SmolLM2's tokenizer already has <|endoftext|> (0), <|im_start|> (1) and <|im_end|> (2);
this adds Qwen3's tool and reasoning markers as added tokens that are not special
(as in Qwen3's own tokenizer), so they stay visible in decoded text for the parsers.
"""

from pathlib import Path

from tokenizers import AddedToken, Tokenizer

HERE = Path(__file__).resolve().parent
MARKERS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

tok = Tokenizer.from_file(str(HERE.parent / "smollm2" / "tokenizer.json"))
base = tok.get_vocab_size(with_added_tokens=True)
tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])
assert [tok.token_to_id(m) for m in MARKERS] == list(range(base, base + len(MARKERS)))
tok.save(str(HERE / "tokenizer.json"))
