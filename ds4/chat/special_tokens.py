"""The V4 special-token strings (docs/PROTOCOLS.md, Special tokens): each encodes to one token."""

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
LATEST_REMINDER = "<｜latest_reminder｜>"

# The ones the format uses; client text containing them injects the token (logged).
SPECIAL_STRINGS = (BOS, EOS, USER, ASSISTANT, THINK, THINK_END, DSML, LATEST_REMINDER)
