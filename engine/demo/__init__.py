"""The embedded demo model: a tiny MoE trained by the project on a multi-skill chat corpus.

`corpus` generates the data, `tokenizer` builds the byte-level tokenizer and chat template,
`train` trains and saves the model to ``resources/models/demo``, `evaluate` measures
held-out accuracy per skill and expert specialisation.
"""
