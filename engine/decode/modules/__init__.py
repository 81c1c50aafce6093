"""The model's modules as the native decode paths (engine.decode.paths) see them: which families and
experts modules the kernels compute (`families`, `expert_recipe`), the attention the native steps
run for one query (`one_query_attention`, `latent_attention`), and the switch patched modules read
(`switch`). None of these is a path itself."""
