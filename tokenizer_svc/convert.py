"""`python -m tokenizer_svc.convert KIND SOURCE DESTINATION`: writes fast-tokenizer files
(tokenizer.json, its config, the chat template) for a model that has none, KIND being
`gguf` (SOURCE a .gguf file) or `hf_dir`. Run as a child process by Tokenizer.load:
transformers' converters load torch, which the roles that tokenize never do."""
from __future__ import annotations

import sys
from pathlib import Path

from transformers import AutoTokenizer


def main(argv: list[str]) -> int:
    kind, source, destination = argv
    path = Path(source)
    if kind == "gguf":
        converted = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    else:
        converted = AutoTokenizer.from_pretrained(path, local_files_only=True)
    converted.save_pretrained(destination)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
