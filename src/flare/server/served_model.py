"""The served model's text side, loaded from a runtime core: tokenizer, chat template
and output-grammar compiler, next to the manifest that selects its parsers."""

from __future__ import annotations

from flare.runtime.engine import Engine
from flare.server.grammar import GrammarCompiler
from flare.server.template import ChatTemplate
from flare.server.text import TextCodec


class ServedModel:
    """The model as the server presents it, what it needs from a core besides the
    engine: the name it is served under, tokenizer, chat template, parser selection
    (the manifest) and grammar compiler."""

    def __init__(self, core_dir: str, engine: Engine, served_name: str | None = None, *,
                 grammar_timeout_s: float = 5.0):
        m = engine.manifest
        self.manifest = m
        self.served_name = served_name or m.frontend.served_name
        self.codec = TextCodec(f"{core_dir}/{m.frontend.tokenizer}")
        self.template = None
        if m.frontend.chat_template is not None:
            with open(f"{core_dir}/{m.frontend.chat_template}") as f:
                self.template = ChatTemplate(f.read(), dict(m.frontend.special_tokens))
        self.grammars = GrammarCompiler(f"{core_dir}/{m.frontend.tokenizer}", vocab_size=m.capacities.vocab_size,
                                        eos_ids=m.frontend.eos_ids, timeout_s=grammar_timeout_s)

    def marker(self, text: str) -> str:
        return self.grammars.marker(text, self.codec.encode(text, add_special_tokens=False))

    def close(self) -> None:
        self.grammars.close()
