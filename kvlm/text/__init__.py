"""Text in and out of a model: its tokenizer rebuilt from the file (byte-level BPE, SentencePiece), its chat
template rendered."""
