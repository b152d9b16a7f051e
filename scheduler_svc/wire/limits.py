"""Request limits that the scheduler's validation and the API front-end share."""

# No tokenizer of a supported family has a token longer than this many characters; a text prompt
# (or a chat's messages) longer than max_model_len times it can never fit the model and is refused
# before tokenizing.
MAX_PROMPT_CHARS_PER_TOKEN = 32
