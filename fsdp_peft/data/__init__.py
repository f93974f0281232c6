"""Training data: local files or hub datasets in four formats, tokenized once, only answers trained.

Sources: the embedded ``tiny-reverse``; a local ``.jsonl``/``.json``/``.parquet``/``.csv`` file or a
directory of them; a hub dataset (``datasets.load_dataset(name)``). Formats, detected from the columns
or declared with ``data_format``: ``prompt_completion``, ``instruction`` (Alpaca), ``messages`` and
``sharegpt`` (chats).

Every row becomes text segments that are trained or not (the prompt, or the non-assistant turns of a
chat rendered with the tokenizer's chat template), each tokenized on its own and concatenated, so a
prompt tokenizes exactly as it does for generation. A bad row is a `ConfigError` naming file, row,
rule and fix, unless ``skip_invalid_rows`` is set: then it is dropped and counted.

Tokenization runs once per node (local rank 0) and is saved under ``$FSDP_PEFT_CACHE/data/<key>``,
keyed by the files' bytes, the tokenizer and every setting that changes the result; the other ranks,
and later runs, load it from there.

One module per step, in the order data flows (import from the step's module: this package imports none of
them, so a module that needs one step does not load them all):

- `fsdp_peft.data.sources`: where a split's rows come from (files, directories, hub splits), read raw
- `fsdp_peft.data.formats`: the four row formats, detected and checked; rows as `Example`s
- `fsdp_peft.data.templates`: prompts and chats rendered as the model sees them, cut into trained pieces
- `fsdp_peft.data.tokenize`: token ids and labels (-100 off the trained pieces), truncation, whole sources
- `fsdp_peft.data.packing`: examples packed into rows, their collator, and the model check that packing is safe
- `fsdp_peft.data.cache`: tokenized once per node, cached, and loaded (`load_data`)

Preference rows (DPO pairs, KTO's rated completions) are `fsdp_peft.data.preference`: the same sources
and bad-row rules, rendered as text for TRL, which tokenizes them itself. Chat rows with images, for the
vision-language recipes, are `fsdp_peft.data.vision_rows`: checked and rendered by the model's processor.
"""
