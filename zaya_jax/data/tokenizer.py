"""Tokenizers: text ↔ token ids behind one small interface.

`ByteTokenizer` needs no files (ids 0 pad, 1 bos, 2 eos, byte b → b + 3); `HFTokenizer` wraps a
local Hugging Face `tokenizer.json`. Both offer `encode`, `encode_batch`, `decode`, `vocab_size`,
`eos_id` and `pad_id`. `load_tokenizer(spec)` picks one from a CLI-style string.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from zaya_jax.errors import ZayaError, quoted

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
_PAD_NAMES = ("<pad>", "<|pad|>", "<|padding|>", "[PAD]")


class ByteTokenizer:
    """UTF-8 bytes as tokens; three special ids come first."""

    pad_id, bos_id, eos_id = 0, 1, 2
    _offset = 3
    vocab_size = 256 + _offset

    def encode(self, text: str) -> list[int]:
        data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        return (data.astype(np.int32) + self._offset).tolist()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        # Special ids carry no bytes; dropping them keeps decode(encode(x)) == x for any x.
        data = bytes(int(i) - self._offset for i in ids if self._offset <= int(i) < self.vocab_size)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer loaded from a local tokenizer.json."""

    def __init__(self, path: str | Path, eos_id: int | None = None, pad_id: int | None = None):
        self.path = Path(path)
        self._tok = _read_hf_tokenizer(self.path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._check_id("eos_id", eos_id if eos_id is not None else self._default_eos())
        # Padding is never trained on (its loss mask is 0), so eos is a safe stand-in.
        pad = pad_id if pad_id is not None else self._lookup(_PAD_NAMES)
        self.pad_id = self._check_id("pad_id", pad if pad is not None else self.eos_id)

    def encode(self, text: str) -> list[int]:
        # No template specials: documents are delimited by the eos the packer appends.
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token(self, token_id: int) -> str:
        return self._tok.id_to_token(int(token_id))

    def _default_eos(self) -> int:
        eos = self._lookup((_config_eos(self.path),) + _EOS_NAMES)
        if eos is None:
            raise ZayaError(f"tokenizer {self.path} has no recognizable end-of-text token; "
                            "pass its id as eos_id")
        return eos

    def _lookup(self, names) -> int | None:
        for name in names:
            if name and (token_id := self._tok.token_to_id(name)) is not None:
                return token_id
        return None

    def _check_id(self, what: str, value: int) -> int:
        if not 0 <= int(value) < self.vocab_size:
            raise ZayaError(f"{what}={value} is outside the vocabulary of tokenizer {self.path} "
                            f"(size {self.vocab_size}); pass an id below {self.vocab_size}")
        return int(value)


def load_tokenizer(spec: str, eos_id: int | None = None, pad_id: int | None = None):
    """"bytes" → ByteTokenizer; a tokenizer.json (or a directory holding one) → HFTokenizer."""
    resolved = resolve_spec(spec)
    if resolved == "bytes":
        if eos_id not in (None, ByteTokenizer.eos_id) or pad_id not in (None, ByteTokenizer.pad_id):
            raise ZayaError("the bytes tokenizer has fixed ids (eos 2, pad 0); drop eos_id/pad_id")
        return ByteTokenizer()
    return HFTokenizer(resolved, eos_id=eos_id, pad_id=pad_id)


def check_fits(tokenizer, vocab_size: int, fix: str) -> None:
    """A tokenizer with more ids than the model's vocabulary would feed it ids it has no row for."""
    if tokenizer.vocab_size > vocab_size:
        raise ZayaError(f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocabulary is {vocab_size}; {fix}")


def model_tokenizer(model_dir: str, spec: str | None = None):
    """The tokenizer `spec` names, else the one a model directory holds: a training run leaves
    `tokenizer.txt` (the word `bytes`) or `tokenizer.json` beside its model, and Hugging Face
    directories hold `tokenizer.json`."""
    if spec is None:
        folder = Path(model_dir)
        if (folder / "tokenizer.json").is_file():
            spec = str(folder / "tokenizer.json")
        elif (folder / "tokenizer.txt").is_file():
            spec = (folder / "tokenizer.txt").read_text(encoding="utf-8").strip()
        else:
            raise ZayaError(f"{model_dir} holds no tokenizer (tokenizer.json or tokenizer.txt); pass --tokenizer "
                            "bytes or a tokenizer.json (the one the model was trained with)")
    return load_tokenizer(spec)


def copy_hf_files(src_dir: str | Path, dst_dir: str | Path) -> bool:
    """Copy a Hugging Face tokenizer's files (`HF_TOKENIZER_FILES` that exist) from one directory to
    another; True when there was a tokenizer.json."""
    src, dst = Path(src_dir), Path(dst_dir)
    for name in HF_TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    return (src / "tokenizer.json").is_file()


def write_hf_config(folder: str | Path, max_length: int) -> None:
    """A minimal tokenizer_config.json beside a tokenizer.json that has none, so that Hugging Face's
    `AutoTokenizer` (and lm-eval's `hf` model) load it with our end-of-text token."""
    folder = Path(folder)
    if (folder / "tokenizer_config.json").exists():
        return
    words = HFTokenizer(folder / "tokenizer.json")
    eos = words.token(words.eos_id)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": words.token(words.pad_id),
              "model_max_length": max_length}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def resolve_spec(spec: str) -> str | Path:
    """"bytes", or the tokenizer.json a path names (itself, or the one in the directory it names)."""
    if spec == "bytes":
        return spec
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ZayaError(f"tokenizer {path} does not exist; pass 'bytes' or a path to a tokenizer.json")
    return path


def _read_hf_tokenizer(path: Path):
    try:
        import tokenizers
    except ImportError as e:
        raise ZayaError(f"loading tokenizer {path} needs the tokenizers library; "
                        "run `pip install tokenizers`") from e
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a bare Exception for any parse failure
        raise ZayaError(f"tokenizer {path} could not be parsed ({quoted(e, first_line=True)}); "
                        "pass a valid Hugging Face tokenizer.json") from e


def _config_eos(path: Path) -> str | None:
    """The eos token named by a tokenizer_config.json next to the tokenizer, if any."""
    config = path.parent / "tokenizer_config.json"
    try:
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None
