"""One small interface over SentencePiece (tokenizer.model) and Hugging Face tokenizers (tokenizer.json).

Special-token ids come from the checkpoint's config.json (bos_token_id, eos_token_id, add_bos_token), which
the converter fills from the source model.
"""
from pathlib import Path

from checkpoint import InputError, read_config


class Tokenizer:
    def __init__(self, checkpoint_dir, config=None):
        """config: config.json's dict where the caller has read it (checkpoint.Checkpoint.config)."""
        checkpoint_dir = Path(checkpoint_dir)
        config_path = checkpoint_dir / "config.json"
        if config is None:
            config = read_config(config_path) if config_path.is_file() else {}
        if (checkpoint_dir / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as HFTokenizer
            path = checkpoint_dir / "tokenizer.json"
            try:
                self._hf = HFTokenizer.from_file(str(path))
            except Exception as e:
                raise InputError(f"{path}: not a readable tokenizer.json ({e})") from None
            self._sp = None
            self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
        elif (checkpoint_dir / "tokenizer.model").is_file():
            from sentencepiece import SentencePieceProcessor
            path = checkpoint_dir / "tokenizer.model"
            self._sp = SentencePieceProcessor()
            try:
                self._sp.Load(str(path))
            except Exception as e:
                raise InputError(f"{path}: not a readable SentencePiece model ({e})") from None
            self._hf = None
            self.vocab_size = self._sp.vocab_size()
        else:
            raise InputError(f"{checkpoint_dir}: no tokenizer.json or tokenizer.model; re-run "
                             "scripts/convert_checkpoint.py")
        self.path = path
        sp_default = lambda get: get() if self._sp is not None and get() >= 0 else None  # noqa: E731
        self.bos_id = config.get("bos_token_id", sp_default(lambda: self._sp.bos_id()))
        eos = config.get("eos_token_id", sp_default(lambda: self._sp.eos_id()))
        eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
        if not all(i is None or isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in [self.bos_id, *eos]):
            raise InputError(f"{config_path}: bos_token_id / eos_token_id must be token ids (integers >= 0, "
                             f"eos_token_id also a list of them), not {self.bos_id!r} / {eos!r}")
        self.eos_ids = set(eos)
        # tokenizer.json files carry their own BOS rule in the post-processor; SentencePiece models (Llama 2)
        # expect BOS unless the config says otherwise.
        self.add_bos = config.get("add_bos_token", self._sp is not None) and self.bos_id is not None

    def encode_texts(self, texts: list[str]) -> list[list[int]]:
        """The ids of many texts, each alone and without BOS, on every core."""
        if self._sp is not None:
            return self._sp.EncodeAsIds(list(texts))
        return [e.ids for e in self._hf.encode_batch(list(texts), add_special_tokens=False)]

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """Token ids; bos=False: the text alone, without the BOS or other tokens the tokenizer adds (a chat template
        writes its own)."""
        if self._sp is not None:
            ids = self._sp.EncodeAsIds(text)
        else:
            ids = self._hf.encode(text, add_special_tokens=bos).ids
        if bos and self.add_bos and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    @property
    def special_ids(self) -> set[int]:
        """Control tokens: never split, never produced from plain text."""
        if self._sp is not None:
            return {i for i in range(self.vocab_size) if self._sp.IsControl(i)}
        return {i for i, t in self._hf.get_added_tokens_decoder().items() if t.special}

    def same_vocabulary(self, other: "Tokenizer") -> bool:
        if (self._sp is None) != (other._sp is None) or self.vocab_size != other.vocab_size:
            return False
        if self._sp is not None:
            return all(self._sp.IdToPiece(i) == other._sp.IdToPiece(i) for i in range(self.vocab_size))
        return self._hf.get_vocab(with_added_tokens=True) == other._hf.get_vocab(with_added_tokens=True)

    def decode(self, ids: list[int]) -> str:
        if self._sp is not None:
            return self._sp.DecodeIds(list(ids))
        return self._hf.decode(list(ids), skip_special_tokens=False)

    def decode_after(self, context: list[int], ids: list[int]) -> str:
        """The text `ids` add after `context` (decoded alone, SentencePiece drops a first word's space)."""
        if not context:
            return self.decode(ids)
        before = self.decode(context)
        return self.decode(list(context) + list(ids))[len(before):]


class TextStream:
    """Prints a row's text as it grows, holding back an incomplete UTF-8 sequence. The text is what the row adds to
    `context` (the prompt's ids: a SentencePiece word's leading space shows after it), without the `hidden` ids."""

    def __init__(self, tokenizer, context=(), hidden=None):
        self.tokenizer, self.context, self.ids, self.printed = tokenizer, list(context), [], 0
        self.hidden = tokenizer.eos_ids if hidden is None else hidden

    def text(self) -> str:
        return self.tokenizer.decode_after(self.context, self.ids)

    def __call__(self, tokens):
        self.ids += [t for t in tokens if t not in self.hidden]
        text = self.text()
        if not text.endswith("\ufffd"):
            print(text[self.printed:], end="", flush=True)
            self.printed = len(text)

    def finish(self):
        """Print what is held back, as --json's text has it (a partial character decodes as U+FFFD), and a newline."""
        print(self.text()[self.printed:], flush=True)
