"""Built-in verifiable tasks made here (no download): problems with exact answers, their splits,
formats, judges and tokenizers. Pure Python and sentencepiece, at the bottom layer, so that built-in
models (their tokenizer), data sets and reward rules can all use them."""
