"""Test helper: a copy of a GGUF whose vocabulary differs in one token (a drafter the server must refuse)."""

from pathlib import Path

import gguf
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata


def with_changed_token(source: Path, output: Path, token_id: int, text: str) -> Path:
    reader = gguf.GGUFReader(source)
    field = reader.fields["tokenizer.ggml.tokens"]
    tokens = list(field.contents())
    tokens[token_id] = text
    writer = gguf.GGUFWriter(output, arch=reader.fields["general.architecture"].contents(), endianess=reader.endianess)
    new = {"tokenizer.ggml.tokens": MetadataDetails(gguf.GGUFValueType.ARRAY, tokens,
                                                    sub_type=gguf.GGUFValueType.STRING)}
    copy_with_new_metadata(reader, writer, new, [])
    return output
